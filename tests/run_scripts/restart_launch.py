"""``resolve(..., max_restarts=1)`` in a script run with python: rank 1
kills itself on the first start; ``launch(fn)`` returns every rank's value
from the restarted ranks.

    python restart_launch.py
"""

from __future__ import annotations

import os
import signal

import phalanx


def fn(strategy):
    if strategy.restart_count == 0 and strategy.global_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    total = strategy.all_reduce(__import__("torch").ones(1)).item()
    return strategy.global_rank, strategy.restart_count, total


if __name__ == "__main__":
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, max_restarts=1)
    print("RESULT", strategy.launch(fn), flush=True)
