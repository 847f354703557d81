"""Run under `phalanx run`: rank 1 raises, rank 0 waits for it in a barrier."""

import phalanx


def fn(strategy):
    print(f"started {strategy.global_rank}", flush=True)
    if strategy.global_rank == 1:
        raise ValueError("rank one broke on purpose")
    strategy.barrier()


phalanx.resolve().launch(fn)
