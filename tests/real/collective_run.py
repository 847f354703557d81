"""One rank of a real run, started by torchrun, srun or mpirun.

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/real/collective_run.py
    srun -N1 -n2 python tests/real/collective_run.py
    mpirun -np 2 python tests/real/collective_run.py

Reads the scheduler's own variables (not through phalanx) to learn this
rank, the world size and the processes per node; resolves ``ddp`` on the
CPU with that many devices, so that the registry must detect the
environment and choose the ``in_process`` launcher; then, in
``strategy.launch``, checks that phalanx's ranks are the scheduler's, runs
the shared collective contract (``phalanx_core.testing.contract``) over the
real gloo group, and one DDP step whose gradients must agree on every
rank. Prints one line ``PHALANX_RESULT {json}`` per rank and exits 0; any
failed check raises, so the rank exits non-zero and the scheduler reports
it.
"""

from __future__ import annotations

import json
import os
import sys

import phalanx
from phalanx_core.testing.contract import check_collective

#: scheduler: (the variable that says it started us, rank, world size, local rank, per node)
SCHEDULERS = {
    "torchelastic": ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "slurm": ("SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_TASKS_PER_NODE"),
    "mpi": (
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
}


def scheduler() -> tuple[str, dict[str, int]]:
    for name, (marker, rank, size, local, per_node) in SCHEDULERS.items():
        if marker in os.environ:
            return name, {
                "rank": int(os.environ[rank]),
                "world_size": int(os.environ[size]),
                "local_rank": int(os.environ[local]),
                "per_node": int(os.environ[per_node]),  # one node here: a plain number
            }
    raise SystemExit("collective_run.py: start me with torchrun, srun or mpirun (no scheduler found)")


def ddp_step(strategy) -> list[float]:
    import torch

    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts them)
    model = strategy.setup(torch.nn.Linear(4, 1))
    x = torch.full((2, 4), float(strategy.global_rank + 1))  # different data on each rank
    strategy.backward(model(x).sum())
    return [round(v, 6) for v in model.module.weight.grad.flatten().tolist()]


def run(strategy, expected: dict[str, int]) -> dict:
    got = {
        "rank": strategy.global_rank,
        "world_size": strategy.world_size,
        "local_rank": strategy.local_rank,
        "node_rank": strategy.node_rank,
    }
    for key in ("rank", "world_size", "local_rank"):
        assert got[key] == expected[key], f"{key}: phalanx says {got[key]}, the scheduler {expected[key]}"
    collective = strategy.collective
    assert (collective.rank, collective.world_size) == (got["rank"], got["world_size"]), (
        f"the collective's group is rank {collective.rank} of {collective.world_size}, not the job's"
    )
    checks = check_collective(collective)
    grads = ddp_step(strategy)
    every = strategy.collective.all_gather_object(grads)
    # rank r sums 2 rows of (r + 1); DDP averages: every rank gets world_size + 1
    want = [float(strategy.world_size + 1)] * 4
    assert all(g == want for g in every), f"DDP gradients: expected {want} on every rank, got {every}"
    return {
        **got,
        "main_address": strategy.environment.main_address,
        "main_port": strategy.environment.main_port,
        "backend": collective.backend,
        "checks": checks,
        "ddp_grad": grads,
    }


def main() -> int:
    which, expected = scheduler()
    flags = {"accelerator": "cpu", "devices": expected["per_node"], "num_nodes": 1}
    plan = phalanx.plan("ddp", **flags)
    strategy = phalanx.resolve("ddp", **flags, timeout=60)
    # In place, launch's list is indexed by global rank: this rank's value at its rank.
    result = strategy.launch(run, expected)[strategy.global_rank]
    result.update(
        scheduler=which,
        environment=plan.environment.name if plan.environment else None,
        environment_reason=plan.environment.reason if plan.environment else None,
        environment_class=type(strategy.environment).__name__,
        launcher=plan.launcher.name if plan.launcher else None,
        launcher_reason=plan.launcher.reason if plan.launcher else None,
        collective=plan.collective.name if plan.collective else None,
        pid=os.getpid(),
    )
    sys.stdout.write("PHALANX_RESULT " + json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
