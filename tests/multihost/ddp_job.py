"""One rank of a job across the hosts of a test bed, started as a
scheduler starts it: by ``mpirun`` (test_mpirun.py), or one process per
slot or pod with the variables LSF or Kubeflow set (test_schedulers.py).

    python ddp_job.py --devices N --nodes M [--collective mpi|torch] [--timeout S]

Resolves ``ddp`` on the CPU with ``devices=N, num_nodes=M``, nothing else
named, so that the registry detects the environment and chooses the
``in_process`` launcher; then, in ``strategy.launch``: an all_reduce of
``rank + 1``, every rank's host name gathered, and one DDP step whose
gradients must be ``world_size + 1`` on every rank. Each rank writes one
line, ``PHALANX-RESULT {json}``, in one write (mpirun tags each write of a
rank apart), and exits 0; a rank that fails raises, and exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

import phalanx

sys.path.insert(
    0, str(Path(__file__).resolve().parents[2] / "plugins" / "torch" / "tests" / "launch_scripts")
)
from rank_fns import _listening


def ddp_gradient(strategy: Any) -> list[float]:
    """One DDP step: rank r sums 2 rows of (r + 1) and DDP averages them,
    so every rank's gradient is ``world_size + 1`` everywhere."""
    import torch

    torch.manual_seed(0)
    model = strategy.setup(torch.nn.Linear(4, 1))
    x = torch.full((2, 4), float(strategy.global_rank + 1))
    strategy.backward(model(x).sum())
    return [round(v, 6) for v in model.module.weight.grad.flatten().tolist()]


def run(strategy: Any) -> None:
    import torch

    total = strategy.all_reduce(torch.tensor([float(strategy.global_rank + 1)]))
    result = {
        "environment": strategy.plan.environment.name,
        "launcher": strategy.plan.launcher.name,
        "collective": strategy.plan.collective.name,
        "rank": strategy.global_rank,
        "world_size": strategy.world_size,
        "local_rank": strategy.local_rank,
        "node_rank": strategy.node_rank,
        "host": socket.gethostname(),
        "main_address": _main_address(strategy),
        "main_port": strategy.environment.main_port,
        "all_reduce": total.item(),
        "hosts": strategy.all_gather_object(socket.gethostname()),
        "ddp_gradient": ddp_gradient(strategy),
        "gloo_interface": os.environ.get("GLOO_SOCKET_IFNAME"),
        "listening": _listening(os.getpid()),
    }
    strategy.barrier()  # every rank's group traffic done before any leaves
    sys.stdout.write("PHALANX-RESULT " + json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--collective")
    parser.add_argument("--timeout", type=float, default=60.0)
    options = parser.parse_args()
    flags: dict[str, Any] = {"accelerator": "cpu", "devices": options.devices, "num_nodes": options.nodes}
    if options.collective:
        flags["collective"] = options.collective
    strategy = phalanx.resolve("ddp", **flags, timeout=options.timeout)
    strategy.launch(run)
    return 0


def _main_address(strategy) -> str | None:
    """The environment's main address; None where it has none (mpirun on
    several nodes without MASTER_ADDR, under the mpi collective)."""
    from phalanx_core import MisconfigurationError

    try:
        return strategy.environment.main_address
    except MisconfigurationError:
        return None


if __name__ == "__main__":
    sys.exit(main())
