"""What ``phalanx run --launcher ray`` runs as every rank in
``test_cluster.py``: ``per_rank.py LAUNCH_DIR``, copied into a directory of
its own together with a ``data.txt``.

Each rank prints one line: its rank, the world size, its host, the
all_reduce of ``rank + 1`` over every rank, what ``data.txt`` in its working
directory holds, and whether that working directory is another than
LAUNCH_DIR (the directory ``phalanx run`` ran in): a copy that Ray shipped.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import torch

import phalanx


def main(strategy):
    total = strategy.all_reduce(torch.tensor([float(strategy.global_rank + 1)])).item()
    data = Path("data.txt").read_text().strip()
    shipped = os.path.realpath(os.getcwd()) != os.path.realpath(sys.argv[1])
    print(
        f"rank {strategy.global_rank} of {strategy.world_size} on {socket.gethostname()}: "
        f"all_reduce {total:g}, data.txt {data!r}, shipped {shipped}"
    )


phalanx.resolve().launch(main)
