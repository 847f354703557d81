"""A 2-rank job with the counting collective chosen by name: one call of
our own, then three DDP training steps, whose gradients DDP reduces
through the collective too.

    python tests/job.py
    phalanx run --strategy ddp --accelerator cpu --devices 2 --collective counting tests/job.py
"""

import sys

import torch

import phalanx


def fn(strategy):
    total = strategy.all_reduce(torch.ones(4))  # forwarded to strategy.collective
    model, optimizer = strategy.setup(torch.nn.Linear(100, 10), lambda p: torch.optim.SGD(p, lr=0.1))
    for _ in range(3):
        optimizer.zero_grad()
        strategy.backward(model(torch.randn(8, 100)).square().mean())  # DDP all-reduces the gradients
        strategy.optimizer_step(optimizer)
    collective = strategy.collective
    return type(collective).__name__, total.tolist(), dict(collective.calls), dict(collective.tensor_bytes)


if __name__ == "__main__":
    if phalanx.under_run():  # started by `phalanx run`: the command line chose the strategy
        strategy = phalanx.resolve()
    else:
        strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, collective="counting")
    results = strategy.launch(fn)
    # Under `phalanx run` every rank runs this script and has its own
    # result; otherwise launch() returned every rank's here.
    for rank in [strategy.global_rank] if phalanx.under_run() else range(len(results)):
        sys.stdout.write(f"{rank} {results[rank]}\n")  # one write a line: ranks share stdout
