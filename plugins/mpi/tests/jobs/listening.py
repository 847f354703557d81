"""A one-node job that reports every TCP socket its processes listen on.

``python listening.py launch '{"strategy": ..., "launcher": ...}'`` calls
``strategy.launch(sockets)`` from a plain process; ``phalanx run ...
listening.py`` runs it as every rank's program. Every process of the job
carries the test's tag (``PHALANX_TEST_TAG``): the launching process, the
launcher's tool (mpirun, horovodrun) and the ranks. Once every rank's group
is up, rank 0 prints ``SOCKETS [[pid, address, port, command], ...]``.
"""

import json
import os
import sys

import phalanx
from phalanx_core.testing.processes import TAG_VAR, listening_sockets, tagged_processes


def sockets(strategy):
    ranks = strategy.all_gather_object(os.getpid())
    strategy.barrier()
    found = None
    if strategy.global_rank == 0:
        job = {**tagged_processes(os.environ[TAG_VAR]), **dict.fromkeys(ranks, "rank")}
        found = [[pid, address, port, job[pid]] for pid, address, port in listening_sockets(set(job))]
    strategy.barrier()  # every process is still up while rank 0 looks
    return found


if __name__ == "__main__":
    if sys.argv[1:2] == ["launch"]:
        found = phalanx.resolve(**json.loads(sys.argv[2])).launch(sockets)[0]
    else:  # a rank of `phalanx run`
        strategy = phalanx.resolve()
        strategy.launch()
        found = sockets(strategy)
    if found is not None:
        sys.stdout.write("SOCKETS " + json.dumps(found) + "\n")
        sys.stdout.flush()
