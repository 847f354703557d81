"""Run under `phalanx run`: rank 1 raises, rank 0 waits for it in a barrier."""

import sys

import phalanx


def fn(strategy):
    sys.stdout.write(f"started {strategy.global_rank}\n")  # one write: two ranks share the pipe
    if strategy.global_rank == 1:
        raise ValueError("rank one broke on purpose")
    strategy.barrier()


phalanx.resolve().launch(fn)
