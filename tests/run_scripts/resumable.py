"""A training script that survives a restart: it resumes from the newest
complete checkpoint, and its loader goes on where the checkpoint left it.

    phalanx run --strategy ddp --devices 2 --max-restarts 1 resumable.py OUT [KILL_AT [STOP_AT]]

Trains 2 epochs over 48 samples (batch 4 per rank), saving every 2 steps
(in the background). Where KILL_AT is given, rank 1 kills itself with
SIGKILL at that global step on the first start (``restart_count == 0``);
where STOP_AT is given, every rank stops after that step (the job ends
there, to go on later, on another number of ranks).
Every rank appends the samples it trained on, with the attempt, to
OUT/seen-<rank>.txt; rank 0 writes the final weights to OUT/weights.pt
and OUT/done.json (restart count, world size, steps).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx_core import CheckpointDirectory


def main() -> None:
    out = Path(sys.argv[1])
    kill_at = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    stop_at = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    strategy = phalanx.resolve()
    strategy.launch()
    torch.manual_seed(0)
    model, optimizer = strategy.setup(nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    x = torch.arange(48 * 3, dtype=torch.float32).reshape(48, 3) / 100
    data = TensorDataset(torch.arange(48), x, x.sum(dim=1, keepdim=True))
    loader = strategy.setup_dataloader(DataLoader(data, batch_size=4, shuffle=True))
    checkpoints = CheckpointDirectory(out / "ckpt", keep=2)
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    step = strategy.resume(checkpoints, state)
    seen = open(out / f"seen-{strategy.global_rank}.txt", "a")  # noqa: SIM115 - open until the end
    for epoch in range(loader.epoch, 2):
        loader.set_epoch(epoch)
        for index, inputs, target in loader:
            step += 1
            if step == kill_at and strategy.restart_count == 0 and strategy.global_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            strategy.backward(nn.functional.mse_loss(model(inputs), target))
            strategy.optimizer_step(optimizer)
            seen.write(f"{strategy.restart_count} {epoch} {step} {' '.join(map(str, index.tolist()))}\n")
            seen.flush()
            if step % 2 == 0:
                checkpoints.save(strategy, step, state, blocking=False)
            if step == stop_at:
                return
    strategy.save_checkpoint(out / "final.pt", {"model": model})
    if strategy.is_global_zero:
        (out / "done.json").write_text(
            json.dumps({"restarts": strategy.restart_count, "world": strategy.world_size, "steps": step})
        )


if __name__ == "__main__":
    main()
