"""Run under `phalanx run`: rank 1 leaves with exit code 0 before a barrier
that rank 0 waits in: rank 0's lost-peer error is the job's only failure."""

import os
import sys

import phalanx


def fn(strategy):
    if strategy.global_rank == 1:
        sys.stdout.flush()
        os._exit(0)
    strategy.barrier()


phalanx.resolve().launch(fn)
