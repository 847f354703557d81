"""The workload of ``bench/diloco_ft.py``: a character-level language model
(the next byte after 32) on the sources of Python's own standard library,
AdamW each step, batches from ``setup_dataloader``; one line per step of
group 0's rank 0 (its time and loss), and at the end the loss on a held-out
part of the text.

    phalanx run ... bench/diloco_ft_train.py OUT STEPS WIDTH
"""

from __future__ import annotations

import functools
import sys
import sysconfig
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import phalanx

CONTEXT = 32
#: Standard library modules whose sources are the text (about 0.9 MB).
SOURCES = ("argparse", "inspect", "typing", "textwrap", "pathlib", "dataclasses", "enum", "functools",
           "collections/__init__", "logging/__init__", "subprocess", "tarfile")  # fmt: skip

out, steps, width = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
strategy = phalanx.resolve()
strategy.launch()

library = Path(sysconfig.get_paths()["stdlib"])
text = b"".join(
    (library / f"{name}.py").read_bytes() for name in SOURCES if (library / f"{name}.py").exists()
)
data = torch.tensor([b if b < 128 else 0 for b in text], dtype=torch.long)
cut = len(data) * 9 // 10
train, held_out = data[:cut], data[cut:]


class Windows(Dataset):
    """Every 4th window of CONTEXT bytes, and the byte after it."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return (len(self.tokens) - CONTEXT - 1) // 4

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * 4
        return self.tokens[start : start + CONTEXT], self.tokens[start + CONTEXT]


torch.manual_seed(0)
model = nn.Sequential(
    nn.Embedding(128, 32), nn.Flatten(), nn.Linear(CONTEXT * 32, width), nn.ReLU(), nn.Linear(width, 128)
)
model, optimizer = strategy.setup(model, functools.partial(torch.optim.AdamW, lr=1e-3))
loader = strategy.setup_dataloader(DataLoader(Windows(train), batch_size=32, shuffle=True))
lead = strategy.replica_group == 0 and strategy.global_rank == 0
batches = iter(loader)
while strategy.current_step < steps:
    step = strategy.current_step
    try:
        x, y = next(batches)
    except StopIteration:
        batches = iter(loader)
        x, y = next(batches)
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    strategy.backward(loss)
    strategy.optimizer_step(optimizer)
    if lead:
        print(f"STEP step={step} t={time.monotonic():.4f} loss={loss.item():.5f}", flush=True)

if lead:
    evaluation = Windows(held_out)
    picked = range(0, len(evaluation), max(len(evaluation) // 4096, 1))
    x = torch.stack([evaluation[i][0] for i in picked])
    y = torch.stack([evaluation[i][1] for i in picked])
    with torch.no_grad():
        print(f"EVAL loss={nn.functional.cross_entropy(model(x), y).item():.5f}", flush=True)
