"""Run under `phalanx run`: rank 1 raises and then takes its time to exit
(its group is torn down by then); rank 0, in a barrier, loses it and exits
first, so that elastic sees rank 0 fail while rank 1 still runs."""

import sys
import time

import phalanx


def print_then_linger(kind, value, traceback, print_it=sys.excepthook):
    """Rank 1's exception hook: it runs after its error file is written."""
    print_it(kind, value, traceback)
    time.sleep(5)


def fn(strategy):
    sys.stdout.write(f"started {strategy.global_rank}\n")  # one write: two ranks share the pipe
    if strategy.global_rank == 1:
        sys.excepthook = print_then_linger
        raise ValueError("rank one broke on purpose")
    strategy.barrier()


phalanx.resolve().launch(fn)
