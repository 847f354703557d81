"""A one-node job that reports every TCP socket its processes listen on.

``python -m phalanx.testing.listening_job launch '{"strategy": ...,
"launcher": ...}'`` calls ``strategy.launch(sockets)`` from a plain
process; ``phalanx run ... -m phalanx.testing.listening_job`` runs it as
every rank's program. For launchers' tests that a one-node job listens on
loopback only (the mpi and horovod plugins' use it). Every process of the job
carries the test's tag (``PHALANX_TEST_TAG``): the launching process, the
launcher's tool (mpirun, horovodrun) and the ranks. Once every rank's group
is up, rank 0 prints ``SOCKETS [[pid, address, port, command], ...]``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import phalanx
from phalanx_core.testing.processes import TAG_VAR, listening_sockets, tagged_processes


def sockets(strategy: Any) -> list[list[Any]] | None:
    ranks = strategy.all_gather_object(os.getpid())
    strategy.barrier()
    found: list[list[Any]] | None = None
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
