"""A training step through phalanx vs plain torch, measured in one run.

    python bench/train_step.py [--steps 50] [--repeat 15] [--strategy ddp_spawn] [--json]
    python bench/train_step.py --strategy fsdp
    python bench/train_step.py --accelerator cuda --devices 1 --precision bf16-mixed   # on a GPU

1. **Steps per second.** In each rank (two gloo ranks on the CPU by
   default), the same MLP is trained two ways in interleaved blocks of
   ``--steps`` steps:

   - plain: ``DistributedDataParallel(model)`` (or ``fully_shard`` for
     ``fsdp``), ``torch.autocast`` for a mixed precision, ``loss.backward()``,
     ``optimizer.step()`` (through a ``torch.amp.GradScaler`` for
     ``16-mixed``);
   - phalanx: ``strategy.setup(model, optimizer)``,
     ``strategy.forward_context()``, ``strategy.backward(loss)``,
     ``strategy.optimizer_step(optimizer)``.

   The blocks alternate which side runs first. The ratio is phalanx / plain
   steps per second (per-block medians), one per rank; goal at least 0.98.

2. **Launch to the first finished step** (``ddp_spawn`` / ``spawn``
   only): ``phalanx.resolve(...).launch(fn)`` where ``fn`` sets up the model
   and runs one step, against ``torch.multiprocessing.start_processes`` +
   ``init_process_group`` + ``DistributedDataParallel`` + one step, taken
   in alternation ``--launch-repeat`` times each; the ratio of the medians,
   phalanx / plain (lower is better).

This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp

import phalanx

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 1),
    )


def plain_model(strategy_name: str, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    model = model.to(device)
    if strategy_name == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh(device.type, (torch.distributed.get_world_size(),)))
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def plain_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision in AUTOCAST:
        return torch.autocast(device.type, dtype=AUTOCAST[precision])
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(strategy, name: str, precision: str, steps: int, repeat: int) -> dict[str, float]:
    torch.set_num_threads(1)
    device = strategy.root_device
    x, y = torch.randn(64, 256, device=device), torch.randn(64, 1, device=device)
    # phalanx's model is made first: in one process the model made second ran
    # about 5 % faster here even when both sides were plain DDP, so any edge
    # of the order goes to plain torch.
    ours, ours_opt = strategy.setup(make_model(), lambda params: torch.optim.SGD(params, lr=1e-3))
    plain = plain_model(name, make_model(), device)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)

    # 16-mixed: the grad scaler, as torch's AMP recipe writes it.
    scaler = torch.amp.GradScaler(device.type) if precision == "16-mixed" else None

    def plain_step() -> None:
        plain_opt.zero_grad()
        with plain_context(precision, device):
            loss = torch.nn.functional.mse_loss(plain(x), y)
        if scaler is None:
            loss.backward()
            plain_opt.step()
            return
        scaler.scale(loss).backward()
        scaler.step(plain_opt)
        scaler.update()

    def ours_step() -> None:
        ours_opt.zero_grad()
        with strategy.forward_context():
            loss = torch.nn.functional.mse_loss(ours(x), y)
        strategy.backward(loss)
        strategy.optimizer_step(ours_opt)

    seconds: dict[str, list[float]] = {"plain": [], "phalanx": []}
    for step in (plain_step, ours_step):  # warm up
        for _ in range(5):
            step()
    order = (("plain", plain_step), ("phalanx", ours_step))
    for block in range(repeat):
        # The second of two back-to-back blocks runs a little faster here:
        # alternate which goes first, so that neither side gets the edge.
        for label, step in order if block % 2 == 0 else order[::-1]:
            strategy.barrier()
            _sync(device)
            start = time.perf_counter()
            for _ in range(steps):
                step()
            _sync(device)
            seconds[label].append((time.perf_counter() - start) / steps)
    plain_sps = 1 / statistics.median(seconds["plain"])
    ours_sps = 1 / statistics.median(seconds["phalanx"])
    return {"plain_steps_s": plain_sps, "phalanx_steps_s": ours_sps, "ratio": ours_sps / plain_sps}


# -- launch to the first finished step --------------------------------------------------------


def _port() -> int:
    # The plain side's own rendezvous: a free port chosen before its ranks start.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, backward) -> None:
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    optimizer.zero_grad()
    backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()


def _plain_first_step(rank: int, world: int, port: int, t0: float, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    _one_step(model, torch.optim.SGD(model.parameters(), lr=1e-3), lambda loss: loss.backward())
    if rank == 0:
        queue.put(time.time() - t0)
    torch.distributed.destroy_process_group()


def _phalanx_first_step(strategy, t0: float) -> float:
    model, optimizer = strategy.setup(make_model(), lambda params: torch.optim.SGD(params, lr=1e-3))
    _one_step(model, optimizer, strategy.backward)
    return time.time() - t0


def launch_times(devices: int, repeat: int) -> dict[str, float]:
    plain, ours = [], []
    ctx = mp.get_context("spawn")
    for _ in range(repeat):
        queue = ctx.SimpleQueue()
        t0 = time.time()
        mp.start_processes(
            _plain_first_step, args=(devices, _port(), t0, queue), nprocs=devices, start_method="spawn"
        )
        plain.append(queue.get())
        t0 = time.time()
        strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=devices)
        ours.append(strategy.launch(_phalanx_first_step, t0)[0])
    return {"plain_s": statistics.median(plain), "phalanx_s": statistics.median(ours)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--strategy", default="ddp_spawn", choices=["ddp_spawn", "fsdp"])
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--devices", type=int, help="ranks (default: 2 on cpu, 1 on cuda)")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--launch-repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    devices = args.devices or (2 if args.accelerator == "cpu" else 1)
    strategy = phalanx.resolve(
        args.strategy,
        accelerator=args.accelerator,
        devices=devices,
        precision=args.precision,
        launcher="spawn",
    )
    ranks = strategy.launch(measure, args.strategy, args.precision, args.steps, args.repeat)
    launch = launch_times(devices, args.launch_repeat) if args.accelerator == "cpu" else None
    if args.json:
        report = {"strategy": args.strategy, "precision": args.precision, "ranks": ranks, "launch": launch}
        print(json.dumps(report, indent=2))
        return
    print(
        f"{args.strategy}, {devices} rank(s) on {args.accelerator}, {args.precision}, "
        f"{args.steps} steps x {args.repeat} interleaved blocks"
    )
    print(f"{'rank':<6}{'plain steps/s':>15}{'phalanx steps/s':>17}{'ratio':>8}")
    for rank, r in enumerate(ranks):
        print(f"{rank:<6}{r['plain_steps_s']:>15.1f}{r['phalanx_steps_s']:>17.1f}{r['ratio']:>8.3f}")
    worst = min(r["ratio"] for r in ranks)
    print(f"worst steps/s ratio {worst:.3f} (goal: at least 0.98)")
    if launch:
        ratio = launch["phalanx_s"] / launch["plain_s"]
        print(
            f"launch to first finished step ({args.launch_repeat} each, medians): plain "
            f"{launch['plain_s']:.3f} s, phalanx {launch['phalanx_s']:.3f} s, ratio {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
