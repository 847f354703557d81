"""A 2-rank job with the counting collective chosen by name."""

import torch

import phalanx


def fn(strategy):
    total = strategy.all_reduce(torch.ones(4))  # forwarded to strategy.collective
    strategy.barrier()
    collective = strategy.collective
    return type(collective).__name__, total.tolist(), dict(collective.calls), dict(collective.tensor_bytes)


if __name__ == "__main__":
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, collective="counting")
    for rank, result in enumerate(strategy.launch(fn)):
        print(rank, result)
