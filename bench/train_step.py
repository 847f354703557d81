"""A training step through phalanx vs plain torch, measured in one run.

    python bench/train_step.py [--steps 50] [--repeat 15] [--strategy ddp_spawn] [--json]
    python bench/train_step.py --strategy fsdp
    python bench/train_step.py --accelerator cuda --devices 1 --precision bf16-mixed   # on a GPU
    python bench/train_step.py --collective mpi           # DDP over MPI vs DDP over gloo
    python bench/train_step.py --collective passthrough   # the process-group adapter's own cost
    python bench/train_step.py --strategy fsdp --collective mpi   # fully_shard over MPI vs over gloo

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

   With ``--collective NAME`` the phalanx side is ``ddp`` over that
   collective (its gradient buckets go through it, as a process group),
   and the plain side is still DDP over a gloo group of its own, made in
   the same ranks; the model defaults to ``--model 16mb`` (16.8 MB of
   float32 gradients), and the ranks are started by the collective's
   launcher (``mpirun`` for ``mpi``, ``horovod`` for ``horovod``).
   ``passthrough`` is a collective that hands every operation to the
   torch one: the cost of the adapter itself (goal at least 0.97). With
   ``--strategy fsdp`` both sides are ``fully_shard``: over the collective,
   and over the plain side's own gloo group.

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
import itertools
import json
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.multiprocessing as mp

import phalanx
from phalanx_core import OPERATIONS
from phalanx_torch.collectives import TorchCollective
from phalanx_torch.process_group import CollectiveProcessGroup

#: The launcher a collective's ranks need (others: spawn).
COLLECTIVE_LAUNCHERS = {"mpi": "mpirun", "horovod": "horovod"}

AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


#: Layer widths of each model: input, hidden..., output.
MODELS = {
    "small": (256, 512, 512, 1),  # 0.4 M parameters, 1.6 MB of gradients
    "16mb": (1024, 2048, 1024, 1),  # 4.2 M parameters, 16.8 MB of gradients
}


def make_model(widths: tuple[int, ...] = MODELS["small"]) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(widths) - 2 else [])
    return torch.nn.Sequential(*layers)


class PassThrough(TorchCollective):
    """The torch collective with every operation handed on as it is: as a
    third party's collective, it reaches DDP through the process-group
    adapter, whose cost it measures."""

    name = "passthrough"


def _hand_on(operation: str) -> Any:
    inherited = getattr(TorchCollective, operation)

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return inherited(self, *args, **kwargs)

    call.__name__ = operation
    return call


for _operation in OPERATIONS:
    setattr(PassThrough, _operation, _hand_on(_operation))


def _plain_group(strategy) -> Any:
    """The plain side's gloo group: torch's default group where the
    collective made it (the torch one), else one made here for it."""
    if torch.distributed.is_initialized() and not isinstance(
        torch.distributed.distributed_c10d._get_default_group(), CollectiveProcessGroup
    ):
        return None
    port = strategy.broadcast_object(_port() if strategy.global_rank == 0 else None)
    return _gloo_group(strategy, port)


def _gloo_group(strategy, port: int) -> Any:
    """A gloo ProcessGroup of every rank, made as init_process_group makes
    one, beside the default group (which is the collective's adapter)."""
    dist = torch.distributed
    rank, size = strategy.global_rank, strategy.world_size
    store = dist.PrefixStore("plain", dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0))
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(
        torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, dist.ProcessGroupGloo(store, rank, size)
    )
    # DeviceMesh.from_group finds a group by its name (set once a backend is there).
    group._set_group_name("bench-plain-gloo")
    dist.distributed_c10d._register_pg_in_world(
        group, "gloo", store, "bench-plain-gloo", "gloo", rank_mapping={r: r for r in range(size)}
    )
    return group


def plain_model(
    strategy_name: str, model: torch.nn.Module, device: torch.device, group: Any = None
) -> torch.nn.Module:
    model = model.to(device)
    if strategy_name == "fsdp":
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # Over a collective, torch's default group is the collective's
        # adapter: the plain side's mesh is its own gloo group.
        if group is not None:
            mesh = DeviceMesh.from_group(group, device.type)
        else:
            mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None, process_group=group
    )


def plain_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if precision in AUTOCAST:
        return torch.autocast(device.type, dtype=AUTOCAST[precision])
    return contextlib.nullcontext()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    strategy, name: str, precision: str, steps: int, repeat: int, widths=MODELS["small"], batch: int = 64
) -> dict[str, float]:
    torch.set_num_threads(1)
    device = strategy.root_device
    x = torch.randn(batch, widths[0], device=device)
    y = torch.randn(batch, widths[-1], device=device)
    # phalanx's model is made first: in one process the model made second ran
    # about 5 % faster here even when both sides were plain DDP, so any edge
    # of the order goes to plain torch.
    ours, ours_opt = strategy.setup(make_model(widths), lambda params: torch.optim.SGD(params, lr=1e-3))
    plain = plain_model(name, make_model(widths), device, _plain_group(strategy))
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
    parser.add_argument("--collective", help="the strategy over this collective (mpi, passthrough, ...)")
    parser.add_argument("--model", choices=sorted(MODELS), help="small, or 16mb with --collective")
    parser.add_argument("--batch", type=int, help="rows per step and rank (default 64; 8 with --collective)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    devices = args.devices or (2 if args.accelerator == "cpu" else 1)
    flags: dict[str, Any] = {"launcher": "spawn"}
    if args.collective:
        collective = PassThrough() if args.collective == "passthrough" else args.collective
        flags = {"collective": collective, "launcher": COLLECTIVE_LAUNCHERS.get(args.collective, "spawn")}
    model = args.model or ("16mb" if args.collective else "small")
    batch = args.batch or (8 if args.collective else 64)
    strategy = phalanx.resolve(
        args.strategy, accelerator=args.accelerator, devices=devices, precision=args.precision, **flags
    )
    ranks = strategy.launch(
        measure, args.strategy, args.precision, args.steps, args.repeat, MODELS[model], batch
    )
    launch = (
        launch_times(devices, args.launch_repeat)
        if args.accelerator == "cpu" and not args.collective
        else None
    )
    if args.json:
        report = {
            "strategy": args.strategy,
            "collective": args.collective,
            "model": model,
            "batch": batch,
            "precision": args.precision,
            "ranks": ranks,
            "launch": launch,
        }
        print(json.dumps(report, indent=2))
        return
    plain_name = "fully_shard" if args.strategy == "fsdp" else "DDP"
    over = (
        f" over collective {args.collective!r}, launcher {flags['launcher']!r} "
        f"(plain: {plain_name} over gloo)"
        if args.collective
        else ""
    )
    print(
        f"{args.strategy}{over}, {devices} rank(s) on {args.accelerator}, {args.precision}, model {model} "
        f"({sum(a * b + b for a, b in itertools.pairwise(MODELS[model])) * 4 / 1e6:.1f} MB of "
        f"gradients), batch {batch}, {args.steps} steps x {args.repeat} interleaved blocks"
    )
    print(f"{'rank':<6}{'plain steps/s':>15}{'phalanx steps/s':>17}{'ratio':>8}")
    for rank, r in enumerate(ranks):
        print(f"{rank:<6}{r['plain_steps_s']:>15.1f}{r['phalanx_steps_s']:>17.1f}{r['ratio']:>8.3f}")
    worst = min(r["ratio"] for r in ranks)
    goal = {"passthrough": 0.97}.get(args.collective or "", 1.5 if args.collective else 0.98)
    print(f"worst steps/s ratio {worst:.3f} (goal: at least {goal})")
    if launch:
        ratio = launch["phalanx_s"] / launch["plain_s"]
        print(
            f"launch to first finished step ({args.launch_repeat} each, medians): plain "
            f"{launch['plain_s']:.3f} s, phalanx {launch['phalanx_s']:.3f} s, ratio {ratio:.3f}"
        )


if __name__ == "__main__":
    main()
