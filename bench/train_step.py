"""A training step through phalanx vs plain torch, measured in one run.

    python bench/training.py [--steps 50] [--repeat 15] [--strategy ddp_spawn] [--json]

In each of two gloo ranks (CPU), the same small MLP is trained two ways in
interleaved blocks of ``--steps`` steps:

- plain: ``DistributedDataParallel(model)``, ``loss.backward()``,
  ``optimizer.step()``;
- phalanx: ``strategy.setup(model, optimizer)``, ``strategy.forward_context()``,
  ``strategy.backward(loss)``, ``strategy.optimizer_step(optimizer)`` under
  the named strategy (``ddp_spawn`` by default; ``fsdp`` compares FSDP2 with
  plain ``fully_shard``).

The blocks alternate which side runs first. The ratio is phalanx / plain
per-step median, one per rank. Goal: at most
1.05 (the layer adds a few Python calls per step). This prints; it asserts
nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import phalanx


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 1),
    )


def plain_model(strategy_name: str, model: torch.nn.Module) -> torch.nn.Module:
    if strategy_name == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def measure(strategy, name: str, steps: int, repeat: int) -> dict[str, float]:
    torch.set_num_threads(1)
    x, y = torch.randn(64, 256), torch.randn(64, 1)
    plain = plain_model(name, make_model())
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-3)
    ours, ours_opt = strategy.setup(make_model(), lambda params: torch.optim.SGD(params, lr=1e-3))

    def plain_step() -> None:
        plain_opt.zero_grad()
        torch.nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()

    def ours_step() -> None:
        ours_opt.zero_grad()
        with strategy.forward_context():
            loss = torch.nn.functional.mse_loss(ours(x), y)
        strategy.backward(loss)
        strategy.optimizer_step(ours_opt)

    times: dict[str, list[float]] = {"plain": [], "phalanx": []}
    for step in (plain_step, ours_step):  # warm up
        for _ in range(5):
            step()
    order = (("plain", plain_step), ("phalanx", ours_step))
    for block in range(repeat):
        # The second of two back-to-back blocks runs a little faster here:
        # alternate which goes first, so that neither side gets the edge.
        for label, step in order if block % 2 == 0 else order[::-1]:
            strategy.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            times[label].append((time.perf_counter() - start) / steps)
    plain_ms = statistics.median(times["plain"]) * 1e3
    ours_ms = statistics.median(times["phalanx"]) * 1e3
    return {"plain_ms": plain_ms, "phalanx_ms": ours_ms, "ratio": ours_ms / plain_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--strategy", default="ddp_spawn", choices=["ddp_spawn", "fsdp"])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    flags = {"launcher": "spawn"} if args.strategy == "fsdp" else {}
    strategy = phalanx.resolve(args.strategy, accelerator="cpu", devices=2, **flags)
    results = strategy.launch(measure, args.strategy, args.steps, args.repeat)
    if args.json:
        print(json.dumps({"strategy": args.strategy, "ranks": results}, indent=2))
        return
    print(f"{args.strategy}, 2 ranks on CPU (gloo), {args.steps} steps x {args.repeat} interleaved blocks")
    print(f"{'rank':<6}{'plain ms/step':>15}{'phalanx ms/step':>17}{'ratio':>8}")
    for rank, r in enumerate(results):
        print(f"{rank:<6}{r['plain_ms']:>15.3f}{r['phalanx_ms']:>17.3f}{r['ratio']:>8.3f}")
    worst = max(r["ratio"] for r in results)
    print(f"worst ratio {worst:.3f} (goal: at most 1.05)")


if __name__ == "__main__":
    main()
