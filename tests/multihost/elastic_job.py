"""A training job that survives lost nodes: run on every host with
``phalanx run --num-nodes MIN:MAX --max-restarts N``.

    elastic_job.py OUT [SAMPLES [PAUSE]]

Trains 2 epochs over SAMPLES samples (default 96; batch 2 per rank),
waiting PAUSE seconds (default 0.1) after each step so that a test can
kill a host mid-training, and saves a checkpoint every 2 steps (in the
background). It resumes with ``strategy.resume`` from OUT/ckpt, which every
host shares. Every rank appends a line per step to OUT/seen-<host>-<rank>.txt:
``<restarts> <resumed step> <world size> <epoch> <step> <sample>...``
(a round is told apart by its restart count and the step it resumed from).
Rank 0 writes OUT/done.json at the end (restarts, world, steps, host) and
the final weights to OUT/final.pt.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx_core import CheckpointDirectory


def main() -> None:
    out = Path(sys.argv[1])
    samples = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
    strategy = phalanx.resolve()
    strategy.launch()
    torch.manual_seed(0)
    model, optimizer = strategy.setup(nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    x = torch.arange(samples * 3, dtype=torch.float32).reshape(samples, 3) / (samples * 3)
    data = TensorDataset(torch.arange(samples), x, x.sum(dim=1, keepdim=True))
    loader = strategy.setup_dataloader(DataLoader(data, batch_size=2, shuffle=True))
    checkpoints = CheckpointDirectory(out / "ckpt", keep=2)
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    step = resumed = strategy.resume(checkpoints, state)
    host = socket.gethostname()
    head = f"{strategy.restart_count} {resumed} {strategy.world_size}"
    seen = open(out / f"seen-{host}-{strategy.global_rank}.txt", "a")  # noqa: SIM115 - open until the end
    for epoch in range(loader.epoch, 2):
        loader.set_epoch(epoch)
        for index, inputs, target in loader:
            step += 1
            optimizer.zero_grad()
            strategy.backward(nn.functional.mse_loss(model(inputs), target))
            strategy.optimizer_step(optimizer)
            seen.write(f"{head} {epoch} {step} {' '.join(map(str, index.tolist()))}\n")
            seen.flush()
            if step % 2 == 0:
                checkpoints.save(strategy, step, state, blocking=False)
            time.sleep(pause)
    strategy.save_checkpoint(out / "final.pt", {"model": model})
    if strategy.is_global_zero:
        done = {"restarts": strategy.restart_count, "world": strategy.world_size, "steps": step, "host": host}
        (out / "done.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main()
