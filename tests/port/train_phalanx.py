"""The same script ported to phalanx: one strategy, chosen on the command line.

phalanx run --strategy ddp --accelerator cpu --devices 2 train_phalanx.py STEPS
python train_phalanx.py STEPS ddp     (the strategy starts the ranks itself)
"""

import sys

import torch
from tiny_gpt import GPT, batch, param_groups

import phalanx

steps = int(sys.argv[1])
strategy = phalanx.resolve(sys.argv[2], accelerator="cpu", devices=2) if sys.argv[2:] else phalanx.resolve()
strategy.launch()
rank = strategy.global_rank
master_process = strategy.is_global_zero
torch.manual_seed(1337)
model, optimizer = strategy.setup(GPT(), lambda params: torch.optim.AdamW(param_groups(params), lr=1e-2))
raw_model = strategy.unwrap_module(model)
for step in range(steps):
    x, y = batch(rank, step)
    loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    strategy.backward(loss)
    strategy.clip_gradients(model, optimizer, max_norm=1.0)
    strategy.optimizer_step(optimizer)
    sys.stdout.write(f"rank {rank} step {step} loss {loss.item():.6f}\n")
    sys.stdout.flush()
strategy.save_checkpoint("ckpt.pt", {"model": model})
