"""``resolve(..., max_restarts=1)`` in a script run with python: rank 1
kills itself on the first start; ``launch(fn)`` returns every rank's value
from the restarted ranks.

    python restart_launch.py          # one node, two ranks
    python restart_launch.py NODES    # one rank on each of NODES nodes (NODE_RANK, MASTER_ADDR/PORT set)
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
    import sys

    nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    devices = 2 if nodes == 1 else 1
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=devices, num_nodes=nodes, max_restarts=1)
    print("RESULT", strategy.launch(fn), flush=True)
