"""The workload of ``bench/ddp_ft.py``: a small model, its batches from
``setup_dataloader`` (under ``ddp_ft``, dealt over each step's quorum), a
padded step, one line per step. Under ``ddp_ft`` the step is TorchFT's (``current_step``,
committed or not); under any other strategy it counts itself and saves a
checkpoint every ``EVERY`` steps, from which a restarted job resumes.

    phalanx run ... bench/ddp_ft_train.py OUT STEPS PAD EVERY [own] [width=N] [workers=N]

``own``: the script's own ``DataLoader`` instead of ``setup_dataloader``'s
(every group reads the same batches; the quorum is then awaited in the
step's all-reduce, not before its batch). ``width=N``: the hidden layer's
width (256 by default; the gradients are about 66 * N float32).
``workers=N``: the ``DataLoader``'s ``num_workers`` (0 by default).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import phalanx
from phalanx_core import CheckpointDirectory

out, steps, pad, every = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
own = "own" in sys.argv[5:]
options = dict(a.split("=", 1) for a in sys.argv[5:] if "=" in a)
width, workers = int(options.get("width", 256)), int(options.get("workers", 0))
strategy = phalanx.resolve()
strategy.launch()
ft = hasattr(strategy, "replica_group")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
samples = TensorDataset(torch.randn(32 * 1000, 64, generator=torch.Generator().manual_seed(0)))
loader = DataLoader(samples, batch_size=32, shuffle=True, num_workers=workers)
loader = loader if own else strategy.setup_dataloader(loader)
batches = iter(loader)
checkpoints = CheckpointDirectory(out / "ckpt", keep=2)
step = 0 if ft else strategy.resume(checkpoints, {"model": model, "optimizer": optimizer})
who = f"group={strategy.replica_group}" if ft else f"group={strategy.global_rank}"
while step < steps:
    optimizer.zero_grad()
    try:
        (x,) = next(batches)
    except StopIteration:
        batches = iter(loader)
        (x,) = next(batches)
    loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
    time.sleep(pad)
    strategy.backward(loss)
    strategy.optimizer_step(optimizer)
    if ft:
        committed, step = bool(strategy.committed), strategy.current_step
    else:
        committed, step = True, step + 1
        if step % every == 0:
            checkpoints.save(strategy, step, {"model": model, "optimizer": optimizer})
    now = time.monotonic()
    print(f"STEP {who} pid={os.getpid()} step={step} committed={committed} t={now:.4f}", flush=True)
