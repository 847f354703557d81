"""Launch to the first finished training step, 2 CPU ranks: the ``ray``
launcher (cold, and warm with ``keep_alive``) against ``ddp_spawn`` and
plain torch, measured in one run.

    python bench/ray_launch.py [--repeat 3] [--warm 10]

Each launch runs one DDP step of a small model in every rank; the time is
from just before ``launch`` (or ``mp.spawn``) to the moment the last rank
finished its step (``time.time()`` in the rank, one machine's clock).

1. plain torch: ``torch.multiprocessing.spawn`` of 2 ranks,
   ``init_process_group("gloo")``, DDP, one step.
2. ``ddp_spawn``: ``phalanx.resolve("ddp_spawn", devices=2).launch(step)``.
3. ``launcher="ray"``, cold: a local Ray instance started for the launch
   (and stopped after it), then the actors.
4. ``launcher="ray"``, cold, in a process that already called
   ``ray.init()``: the actors and their group alone.
5. ``launcher="ray", keep_alive=True``, warm: the 2nd, 3rd, ... launch of
   the same strategy; the model the first launch built is in
   ``strategy.rank_state`` and each launch takes one more step.

Goal (issue "phalanx-ray"): a warm launch at most one tenth of a cold
``ddp_spawn`` launch. This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))


def _one_step(model, optimizer, backward, step) -> None:
    x = torch.randn(16, 32)
    optimizer.zero_grad()
    backward(model(x).pow(2).mean())
    step()


def phalanx_step(strategy) -> float:
    """A phalanx rank: set up (unless warm and kept), one step; when it ended."""
    kept = strategy.rank_state.get("model")
    if kept is None:
        model, optimizer = strategy.setup(_model(), functools.partial(torch.optim.SGD, lr=0.01))
        strategy.rank_state.update(model=model, optimizer=optimizer)
    model, optimizer = strategy.rank_state["model"], strategy.rank_state["optimizer"]
    _one_step(model, optimizer, strategy.backward, lambda: strategy.optimizer_step(optimizer))
    return time.time()


def _plain_rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    _one_step(model, optimizer, lambda loss: loss.backward(), optimizer.step)
    queue.put(time.time())
    dist.destroy_process_group()
    # Not through the interpreter's finalization, where the gloo group DDP
    # keeps alive can abort the rank (SIGABRT seen here: torch's own bug,
    # see phalanx_core.launching.exit_process). The time was taken above.
    os._exit(0)


def plain_spawn() -> float:
    with socket.socket() as s:  # the benchmark's own rendezvous, chosen before any rank starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    start = time.time()
    mp.spawn(_plain_rank, args=(port, queue), nprocs=2, join=True)
    return max(queue.get() for _ in range(2)) - start


def phalanx_launch(**flags) -> float:
    import phalanx

    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, **flags)
    start = time.time()
    return max(strategy.launch(phalanx_step)) - start


def warm(launches: int) -> tuple[float, list[float]]:
    import phalanx

    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray", keep_alive=True)
    try:
        start = time.time()
        first = max(strategy.launch(phalanx_step)) - start
        times = []
        for _ in range(launches):
            start = time.time()
            times.append(max(strategy.launch(phalanx_step)) - start)
        return first, times
    finally:
        strategy.teardown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="cold launches of each kind")
    parser.add_argument("--warm", type=int, default=10, help="warm launches after the first")
    args = parser.parse_args()
    import ray

    runs: dict[str, list[float]] = {"plain": [], "ddp_spawn": [], "ray": [], "ray joined": []}
    for _ in range(args.repeat):  # interleaved, so that the machine's load falls on every kind alike
        runs["plain"].append(plain_spawn())
        runs["ddp_spawn"].append(phalanx_launch(launcher="spawn"))
        runs["ray"].append(phalanx_launch(launcher="ray"))
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, address="local")
        try:
            runs["ray joined"].append(phalanx_launch(launcher="ray"))
        finally:
            ray.shutdown()
    first, warm_times = warm(args.warm)
    median = {kind: statistics.median(times) for kind, times in runs.items()}
    median["ray warm"] = statistics.median(warm_times)

    def row(kind: str, what: str) -> None:
        spread = runs.get(kind, warm_times if kind == "ray warm" else [])
        print(
            f"  {what:<58} {median[kind] * 1e3:9.1f} ms  ({', '.join(f'{t:.3f}' for t in sorted(spread))} s)"
        )

    print("launch -> first finished step, 2 CPU ranks, median:")
    row("plain", "plain torch (mp.spawn + init_process_group + DDP)")
    row("ddp_spawn", "ddp_spawn")
    row("ray", "ray, cold (a local Ray instance started for it)")
    row("ray joined", "ray, cold (ray.init() done before: actors and group)")
    row("ray warm", f"ray, keep_alive, warm (launches 2..{args.warm + 1}; first {first:.2f} s)")
    print(
        f"ratio warm ray / cold ddp_spawn: {median['ray warm'] / median['ddp_spawn']:.4f} (goal at most 0.1)"
    )
    print(f"ratio cold ray / cold ddp_spawn: {median['ray'] / median['ddp_spawn']:.2f}")
    print(f"ratio cold ray (joined) / cold ddp_spawn: {median['ray joined'] / median['ddp_spawn']:.2f}")
    print(f"ratio ddp_spawn / plain torch: {median['ddp_spawn'] / median['plain']:.3f}")


if __name__ == "__main__":
    main()
