"""Rank 1 is late to its set-up: it sleeps ``SECONDS`` before
``launch()`` (as a rank stuck in its imports or its data would), while
rank 0 waits at the set-up. ``phalanx run --strategy ddp ... late_setup.py
SECONDS``."""

from __future__ import annotations

import os
import sys
import time

import phalanx

if __name__ == "__main__":
    if os.environ.get("RANK") == "1":
        time.sleep(float(sys.argv[1]))
    print(phalanx.resolve().launch(lambda strategy: strategy.global_rank))
