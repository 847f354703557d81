"""A driver that joins a Ray cluster, for ``test_cluster.py``::

    python join.py [--address ADDRESS] [--devices N] [--num-nodes N]
                   [--launches N] [--placement-timeout S] [--fail] [--connect-first]
                   [--train ROOT --max-restarts N]

It resolves ``ddp`` on the CPU with ``launcher="ray"`` (and ``address=``
where given) and launches ``where`` ``--launches`` times: each rank prints
a line and returns where it ran, its Ray job, and the all_reduce of
``rank + 1`` over every rank. With ``--fail`` it launches ``fail`` instead:
rank 1 raises once every rank passed a barrier, while rank 0 sleeps outside
any collective, where only a kill ends it.

After each launch it prints ``PHALANX-RESULT {"results": [...], ...}``
(one dict per rank, by global rank); where a launch raised a phalanx error,
``PHALANX-ERROR {"type": ..., "message": ..., ...}``, and it exits 1. Both
say how long the launch took and whether this process is still connected
to Ray.

``--train ROOT`` launches ``train`` instead: 30 steps of a small model,
0.3 s each, a checkpoint every 2 steps in ``ROOT`` (resumed from after a
restart), each step printed as ``STEP {"rank": ..., "host": ..., "step":
..., "restart": ..., "world": ...}``; with ``--max-restarts N`` the job
survives N failures (a rank's node lost, say).

``--connect-first`` calls ``ray.init(address=...)`` before launching, as a
program that uses Ray itself does, and resolves without ``address=`` (the
launcher then uses that connection and keeps it); after the launches the
driver stays connected until it reads a line from stdin, so that the test
looks at the cluster while the job's driver is still there.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import sys
import time

import phalanx
from phalanx_core import PhalanxError


def where(strategy):
    import ray
    import torch

    job = ray.get_runtime_context().get_job_id()
    total = strategy.all_reduce(torch.tensor([float(strategy.global_rank + 1)])).item()
    print(f"rank {strategy.global_rank} on {socket.gethostname()} in job {job}: all_reduce {total:g}")
    return {
        "rank": strategy.global_rank,
        "node": strategy.node_rank,
        "address": ray.util.get_node_ip_address(),
        "host": socket.gethostname(),
        "gcs": ray.get_runtime_context().gcs_address,
        "job": job,
        "all_reduce": total,
    }


def fail(strategy):
    import ray

    print(f"job {ray.get_runtime_context().get_job_id()}")
    strategy.barrier()
    if strategy.global_rank == 1:
        raise ValueError("rank 1 gave up")
    time.sleep(3600)


def train(strategy, root):
    import torch
    from torch import nn

    from phalanx_core import CheckpointDirectory

    torch.manual_seed(0)
    model, optimizer = strategy.setup(nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    checkpoints = CheckpointDirectory(root, keep=2)
    state = {"model": model, "optimizer": optimizer}
    step = start = strategy.resume(checkpoints, state)
    x = torch.ones(4, 3)
    while step < 30:
        step += 1
        optimizer.zero_grad()
        strategy.backward(model(x).pow(2).mean())
        strategy.optimizer_step(optimizer)
        if step % 2 == 0:
            checkpoints.save(strategy, step, state)
        where = {"rank": strategy.global_rank, "host": socket.gethostname(), "step": step}
        print(
            f"STEP {json.dumps({**where, 'restart': strategy.restart_count, 'world': strategy.world_size})}"
        )
        sys.stdout.flush()
        time.sleep(0.3)
    weights = [p.detach().flatten().tolist() for p in model.parameters()]
    return {"restart": strategy.restart_count, "start": start, "step": step, "weights": weights}


def report(marker: str, started: float, **values) -> None:
    import ray

    values.update(seconds=time.monotonic() - started, connected=ray.is_initialized())
    print(f"{marker} {json.dumps(values)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--launches", type=int, default=1)
    parser.add_argument("--placement-timeout", type=float, default=60.0)
    parser.add_argument("--fail", action="store_true")
    parser.add_argument("--connect-first", action="store_true")
    parser.add_argument("--train")
    parser.add_argument("--max-restarts", type=int, default=0)
    args = parser.parse_args()
    if args.connect_first:
        import ray

        ray.init(address=args.address, log_to_driver=False, logging_level=logging.WARNING)
    # Connected first, the launcher runs where ray.init() joined, and
    # refuses an address= besides.
    options = {"address": args.address} if args.address and not args.connect_first else {}
    strategy = phalanx.resolve(
        "ddp", accelerator="cpu", devices=args.devices, num_nodes=args.num_nodes, launcher="ray",
        placement_timeout=args.placement_timeout, max_restarts=args.max_restarts, **options,
    )  # fmt: skip
    code = 0
    for _ in range(args.launches):
        started = time.monotonic()
        try:
            if args.train:
                results = strategy.launch(train, args.train)
            else:
                results = strategy.launch(fail if args.fail else where)
        except PhalanxError as exc:
            fields = {k: getattr(exc, k, None) for k in ("rank", "node", "host", "traceback")}
            report("PHALANX-ERROR", started, type=type(exc).__name__, message=str(exc), **fields)
            code = 1
            break
        report("PHALANX-RESULT", started, results=results)
    if args.connect_first:
        sys.stdin.readline()
    return code


if __name__ == "__main__":
    sys.exit(main())
