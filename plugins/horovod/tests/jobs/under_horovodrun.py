"""A job that horovodrun starts (test_horovodrun.py): every rank resolves
strategies as a user's script would, with no launcher named, and writes
what it saw to <out>/<rank>.json.

    horovodrun --gloo -np 2 -H localhost:2 python under_horovodrun.py OUT [adopt|fail]
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

import phalanx
from phalanx_core.testing.contract import check_collective


def contract(strategy):
    return check_collective(strategy.collective)


def train(strategy, steps: int = 10):
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    net, optimizer = strategy.setup(net, functools.partial(torch.optim.SGD, lr=0.1))
    g = torch.Generator().manual_seed(strategy.global_rank)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        losses.append(loss.item())
    params = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    gathered = strategy.all_gather(params)
    return losses[0], losses[-1], all(torch.equal(gathered[0], t) for t in gathered)


def main(out: Path, mode: str) -> None:
    seen: dict = {}
    if mode == "adopt":  # the user's own Horovod, which phalanx must leave running
        import horovod.torch as hvd

        hvd.init(process_sets="dynamic")
    strategy = phalanx.resolve("horovod", accelerator="cpu", devices=2)
    seen["parts"] = {
        "environment": type(strategy.environment).__name__,
        "launcher": type(strategy.launcher).__name__,
        "rank": strategy.global_rank,
        "world_size": strategy.world_size,
    }
    if mode == "fail":
        seen["failing"] = strategy.launch(_fail)
    me = strategy.global_rank  # in place, launch's list is indexed by global rank
    seen["contract"] = strategy.launch(contract)[me]
    seen["train"] = strategy.launch(train)[me]
    ddp = phalanx.resolve("ddp", accelerator="cpu", devices=2, collective="horovod")
    seen["ddp"] = [type(ddp.collective).__name__, type(ddp.launcher).__name__, *ddp.launch(train)[me]]
    named = phalanx.resolve("horovod", accelerator="cpu", devices=2, launcher="horovod")
    seen["named_launcher"] = named.launch(lambda s: (s.global_rank, s.collective.world_size))[me]
    if mode == "adopt":
        import horovod.torch as hvd

        seen["still_initialized"] = hvd.is_initialized()
        hvd.shutdown()
    (out / f"{strategy.global_rank}.json").write_text(json.dumps(seen))


def _fail(strategy):
    if strategy.global_rank == 1:
        raise ValueError("raised on purpose in rank 1 under horovodrun")
    strategy.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "")
