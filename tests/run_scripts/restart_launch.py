"""``resolve(..., max_restarts=1)`` in a script run with python: rank 1
kills itself on the first start; ``launch(fn)`` returns every rank's value
from the restarted ranks.

    python restart_launch.py          # one node, two ranks
    python restart_launch.py NODES    # one rank on each of NODES nodes (NODE_RANK, MASTER_ADDR/PORT set)
    python restart_launch.py NODES slow   # rank 0 takes 3 s to end after it loses its peer
"""

from __future__ import annotations

import os
import signal
import sys
import time

import phalanx


def fn(strategy):
    if strategy.restart_count == 0 and strategy.global_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        total = strategy.all_reduce(__import__("torch").ones(1)).item()
    except Exception:
        if SLOW and strategy.restart_count == 0:
            time.sleep(3)  # a rank that writes something out before it ends
        raise
    return strategy.global_rank, strategy.restart_count, total


SLOW = sys.argv[2:] == ["slow"]

if __name__ == "__main__":
    nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    devices = 2 if nodes == 1 else 1
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=devices, num_nodes=nodes, max_restarts=1)
    print("RESULT", strategy.launch(fn), flush=True)
