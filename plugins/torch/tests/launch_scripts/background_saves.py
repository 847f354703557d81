"""Saves checkpoints in the background to one path, again and again, until
it is killed: every parameter holds the save's number ``i`` and the
checkpoint has ``"i": i``, so a reader can tell a whole checkpoint from a
mixed one. Prints ``done <i>`` once save ``i`` is known complete.

    python background_saves.py file|sharded PATH MEGABYTES
"""

from __future__ import annotations

import sys

import torch
from torch import nn

import phalanx


def run(strategy, path: str, megabytes: int) -> None:
    width = int((megabytes * 2**20 / 4) ** 0.5)
    model = strategy.setup(nn.Linear(width, width, bias=False))
    handle = None
    i = 0
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(i))
        previous = handle
        handle = strategy.save_checkpoint(path, {"model": model, "i": i}, blocking=False)
        if previous is not None and strategy.is_global_zero:  # the new save waited for it
            print(f"done {i - 1}", flush=True)
        i += 1


if __name__ == "__main__":
    kind, path, megabytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if kind == "file":
        strategy = phalanx.resolve("single_device", accelerator="cpu")
    else:
        strategy = phalanx.resolve("fsdp", accelerator="cpu", devices=2, launcher="fork", timeout=60)
    strategy.launch(run, path, megabytes)
