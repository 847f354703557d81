"""One task of a two-node Slurm job (tests/multihost/test_slurm.py)::

    srun -N2 --ntasks-per-node=2 python tests/multihost/slurm/rank.py 2

The argument is the tasks per node. Resolves ``ddp`` on the CPU for two
nodes, so that the registry must detect the ``slurm`` environment and read
the ranks and the main address from Slurm's variables; in
``strategy.launch`` does an all_reduce over the real gloo group that spans
the hosts and one DDP step whose gradients must agree on every rank. Prints
one line ``PHALANX-RESULT {json}`` with what phalanx found, what Slurm set
and this host's name, and exits 0; a failed check raises, so the task exits
non-zero and srun reports it.
"""

from __future__ import annotations

import json
import os
import socket
import sys

import phalanx

#: Slurm's own variables, reported as they are, for the test to compare with.
SLURM_VARS = (
    "SLURM_PROCID",
    "SLURM_NODEID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
    "SLURMD_NODENAME",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
)


def ddp_step(strategy) -> list[float]:
    import torch

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts them)
    model = strategy.setup(torch.nn.Linear(4, 1))
    x = torch.full((2, 4), float(strategy.global_rank + 1))  # different data on each rank
    strategy.backward(model(x).sum())
    return [round(v, 6) for v in model.module.weight.grad.flatten().tolist()]


def run(strategy) -> dict:
    import torch

    collective = strategy.collective
    total = torch.tensor([float(strategy.global_rank + 1)])
    collective.all_reduce(total)
    grads = ddp_step(strategy)
    return {
        "rank": strategy.global_rank,
        "world_size": strategy.world_size,
        "local_rank": strategy.local_rank,
        "node_rank": strategy.node_rank,
        "group": [collective.rank, collective.world_size],
        "all_reduce": total.item(),
        "ddp_grad": grads,
        # every rank's gradients, as this rank sees them
        "ddp_grads": collective.all_gather_object(grads),
    }


def main() -> int:
    flags = {"accelerator": "cpu", "devices": int(sys.argv[1]), "num_nodes": 2}
    plan = phalanx.plan("ddp", **flags)
    strategy = phalanx.resolve("ddp", **flags, timeout=60)
    # In place, launch's list is indexed by global rank: this rank's value at its rank.
    result = strategy.launch(run)[strategy.global_rank]
    result.update(
        host=socket.gethostname(),
        main_address=strategy.environment.main_address,
        main_port=strategy.environment.main_port,
        # what the main address is on this host
        main_resolved=socket.gethostbyname(strategy.environment.main_address),
        environment=plan.environment.name if plan.environment else None,
        launcher=plan.launcher.name if plan.launcher else None,
        master_addr=os.environ.get("MASTER_ADDR"),
        gloo_socket_ifname=os.environ.get("GLOO_SOCKET_IFNAME"),
        slurm={name: os.environ.get(name) for name in SLURM_VARS},
    )
    # One write per line: srun forwards each task's output as it comes.
    sys.stdout.write("PHALANX-RESULT " + json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
