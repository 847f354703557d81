"""Checkpoint saves through phalanx against plain torch, measured in one run.

    python bench/checkpoint.py [--gigabytes 1] [--repeat 3] [--dir PATH] [--json]

One process, ``single_device`` on the CPU, a state of ``--gigabytes`` of
float32 weights (a stack of square layers) and a step counter. In every
round, in turn (the order rotates from round to round, so that the disk's
and the page cache's moods hit every row alike):

- ``torch.save + fsync``: ``torch.save(state)`` to an open file, ``flush``,
  ``os.fsync``: the least a durable save does;
- ``dcp.save``: ``torch.distributed.checkpoint.save(state, no_dist=True)``
  into a folder (it fsyncs its files);
- ``phalanx blocking``: ``strategy.save_checkpoint(path, state)``, which
  also writes to a temporary name, renames it and fsyncs the directory;
- ``phalanx background``: ``strategy.save_checkpoint(path, state,
  blocking=False)``: the **stall** is how long the call blocks the training
  loop (copying the state into host memory; the first round also allocates
  the buffers, later rounds reuse them); **complete** is until
  ``handle.wait()`` returns.

Before each save the page cache is given the chance to settle
(``os.sync()``), so one save's write-back does not slow the next.
Printed: seconds per save (median over the rounds), throughput, the
blocking save's throughput as a ratio of each plain one (goal: at least
0.95), and the background stall as a fraction of the blocking save (goal:
at most 1/10). This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import phalanx


def make_state(gigabytes: float) -> dict:
    width = 4096
    layers = max(1, round(gigabytes * 2**30 / (width * width * 4)))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    return {"model": model, "step": 1}, sum(p.numel() * 4 for p in model.parameters())


def timed(fn) -> float:
    os.sync()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gigabytes", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder here)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="phalanx-bench-ckpt-", dir=args.dir or "."))
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    state, size = make_state(args.gigabytes)
    plain = {"model": state["model"].state_dict(), "step": 1}
    times: dict[str, list[float]] = {
        name: []
        for name in (
            "torch.save + fsync",
            "dcp.save",
            "phalanx blocking",
            "background stall",
            "background complete",
        )
    }

    def torch_save() -> None:
        with open(root / "plain.pt", "wb") as file:
            torch.save(plain, file)
            file.flush()
            os.fsync(file.fileno())

    def dcp_save() -> None:
        import torch.distributed.checkpoint as dcp

        shutil.rmtree(root / "dcp", ignore_errors=True)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(plain, checkpoint_id=root / "dcp", no_dist=True)

    def blocking() -> None:
        strategy.save_checkpoint(root / "blocking.pt", state)

    def background() -> None:
        os.sync()
        start = time.perf_counter()
        handle = strategy.save_checkpoint(root / "background.pt", state, blocking=False)
        times["background stall"].append(time.perf_counter() - start)
        handle.wait()
        times["background complete"].append(time.perf_counter() - start)

    rows = [("torch.save + fsync", torch_save), ("dcp.save", dcp_save), ("phalanx blocking", blocking)]
    try:
        for round_ in range(args.repeat):
            order = rows[round_ % 3 :] + rows[: round_ % 3]
            for name, fn in order:
                times[name].append(timed(fn))
            background()
    finally:
        strategy.teardown()
        shutil.rmtree(root, ignore_errors=True)

    median = {name: statistics.median(values) for name, values in times.items()}
    gib = size / 2**30
    if args.json:
        print(json.dumps({"bytes": size, "seconds": times, "median": median}, indent=2))
        return
    print(f"single_device on the CPU, a state of {gib:.2f} GiB ({size:,} bytes), {args.repeat} rounds")
    print(f"{'save':<24}{'median s':>10}{'GiB/s':>8}   every round (s)")
    for name, values in times.items():
        rounds = " ".join(f"{v:.3f}" for v in values)
        print(f"{name:<24}{median[name]:>10.3f}{gib / median[name]:>8.2f}   {rounds}")
    for name in ("torch.save + fsync", "dcp.save"):
        ratio = median[name] / median["phalanx blocking"]
        print(f"phalanx blocking throughput / {name}: {ratio:.3f} (goal: at least 0.95)")
    steady = (
        statistics.median(times["background stall"][1:]) if args.repeat > 1 else median["background stall"]
    )
    first = times["background stall"][0] / median["phalanx blocking"]
    print(
        f"background stall / blocking save: {steady / median['phalanx blocking']:.3f} "
        f"(the first save, which allocates the buffers: {first:.3f}; goal: at most 0.1)"
    )


if __name__ == "__main__":
    main()
