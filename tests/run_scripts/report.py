"""Run under `phalanx run`: print what resolve() gave, from every rank."""

import sys

import phalanx


def report(strategy, tag):
    parts = (strategy.precision.name, type(strategy.launcher).__name__, strategy.world_size)
    print(
        f"{tag} strategy={type(strategy).__name__} precision={parts[0]} launcher={parts[1]} "
        f"world={parts[2]} rank={strategy.global_rank}",
        flush=True,
    )
    return strategy.global_rank


strategy = phalanx.resolve(**dict(arg.split("=", 1) for arg in sys.argv[2:]))
strategy.launch(report, sys.argv[1])
