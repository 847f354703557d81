"""Rank 1 arrives late: it sleeps ``SECONDS`` before the operation ``OP``
(``all_reduce``, or ``backward`` of a DDP model), which rank 0 waits in.
``python late_rank.py OP SECONDS``; under ``phalanx run``, or as a plain
script with ``--strategy ddp_spawn --hang-report S``."""

from __future__ import annotations

import sys
import time

import torch

import phalanx


def fn(strategy, op: str, seconds: float) -> float:
    model = strategy.setup(torch.nn.Linear(4, 1))
    t = torch.ones(1)
    strategy.all_reduce(t)
    if strategy.global_rank == 1:
        time.sleep(seconds)
    if op == "backward":
        strategy.backward(model(torch.ones(2, 4)).sum())
    else:
        strategy.all_reduce(t)
    return float(t.item())


if __name__ == "__main__":
    op, seconds = sys.argv[1], float(sys.argv[2])
    flags = {}
    if len(sys.argv) > 3:  # --strategy S --hang-report H: without phalanx run
        flags = {
            "strategy": sys.argv[4],
            "accelerator": "cpu",
            "devices": 2,
            "hang_report": float(sys.argv[6]),
        }
    print(phalanx.resolve(**flags).launch(fn, op, seconds))
