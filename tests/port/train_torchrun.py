"""A flat torchrun training script, as most are written: set up, then the loop.

torchrun --standalone --nproc-per-node 2 train_torchrun.py STEPS
"""

import sys

import torch
import torch.distributed as dist
from tiny_gpt import GPT, batch, param_groups
from torch.nn.parallel import DistributedDataParallel as DDP

steps = int(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
master_process = rank == 0
torch.manual_seed(1337)
model = DDP(GPT())
raw_model = model.module
optimizer = torch.optim.AdamW(param_groups(model.parameters()), lr=1e-2)
for step in range(steps):
    x, y = batch(rank, step)
    loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    sys.stdout.write(f"rank {rank} step {step} loss {loss.item():.6f}\n")
    sys.stdout.flush()
if master_process:
    torch.save({"model": raw_model.state_dict()}, "ckpt.pt")
dist.destroy_process_group()
