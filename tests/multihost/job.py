"""What the multi-host tests run on every node: ``python job.py MODE [ARG]``
under ``phalanx run`` or ``torchrun``.

Modes:
    train         a few training steps of a small model; each rank prints
                  ``PHALANX-RESULT {json}`` with its rank, node, host, the
                  all_reduce of its rank and a digest of its weights.
    fail RANK     rank RANK raises once every rank has passed a barrier; the
                  others wait in an all_reduce. It prints the time it raised.
    fail-early N  every rank of node N raises before its group is made.
    save PATH     train, then save a checkpoint to PATH.
    load PATH     load the checkpoint at PATH, print its weights' digest.
    lose PID      rank 0 kills process PID (the job's etcd) with SIGKILL once
                  every rank has passed a barrier; every rank then goes on
                  with collectives for about 6 s, and trains; its
                  result says when it ended (``ended_at``, epoch seconds).

Outside ``phalanx run`` (torchrun) the strategy is ``ddp`` on the CPU with
``num_nodes`` from ``--nnodes`` (``GROUP_WORLD_SIZE``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import sys
import time

import torch

import phalanx

MODE = sys.argv[1]
ARG = sys.argv[2] if len(sys.argv) > 2 else ""


def digest(strategy, model) -> str:
    """A digest of the whole model's weights (an fsdp shard is gathered
    first: every rank calls this at the same point)."""
    hasher = hashlib.sha256()
    for name, tensor in sorted(strategy.unwrap_module(model).state_dict().items()):
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        hasher.update(name.encode())
        hasher.update(full.detach().to(torch.float64).cpu().numpy().tobytes())
    return hasher.hexdigest()[:16]


def report(strategy, **values) -> None:
    record = {
        "rank": strategy.global_rank,
        "world_size": strategy.world_size,
        "node": strategy.node_rank,
        "host": socket.gethostname(),
        **values,
    }
    sys.stdout.write(f"PHALANX-RESULT {json.dumps(record)}\n")
    sys.stdout.flush()


def train(strategy, steps: int = 3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    model, optimizer = strategy.setup(model, functools.partial(torch.optim.SGD, lr=0.1))
    generator = torch.Generator().manual_seed(strategy.global_rank)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=generator)
        optimizer.zero_grad()
        loss = model(x).pow(2).mean()
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
    return model, optimizer


def main(strategy):
    if MODE == "train":
        model, _ = train(strategy)
        total = strategy.all_reduce(torch.tensor([float(strategy.global_rank)])).item()
        report(strategy, all_reduce=total, weights=digest(strategy, model))
    elif MODE == "fail":
        strategy.barrier()
        if strategy.global_rank == int(ARG):
            time.sleep(0.5)
            sys.stdout.write(f"PHALANX-FAILED-AT {time.time()}\n")
            sys.stdout.flush()
            raise ValueError(f"rank {strategy.global_rank} on {socket.gethostname()} broke on purpose")
        strategy.all_reduce(torch.ones(1))
        report(strategy)
    elif MODE == "lose":
        strategy.barrier()
        if strategy.global_rank == 0:
            os.kill(int(ARG), 9)
        for _ in range(20):
            strategy.all_reduce(torch.ones(1))
            time.sleep(0.3)
        model, _ = train(strategy)
        report(strategy, weights=digest(strategy, model), ended_at=time.time())
    elif MODE == "save":
        model, optimizer = train(strategy)
        strategy.save_checkpoint(ARG, {"model": model, "optimizer": optimizer, "step": 3})
        report(strategy, weights=digest(strategy, model))
    elif MODE == "load":
        torch.manual_seed(1)  # other initial weights: the checkpoint must overwrite them
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        model, optimizer = strategy.setup(model, functools.partial(torch.optim.SGD, lr=0.1))
        rest = strategy.load_checkpoint(ARG, {"model": model, "optimizer": optimizer})
        report(strategy, weights=digest(strategy, model), step=rest.get("step"))


if MODE == "fail-early" and os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK")) == ARG:
    sys.stdout.write(f"PHALANX-FAILED-AT {time.time()}\n")
    sys.stdout.flush()
    raise RuntimeError(f"node {ARG} could not read its data")

if phalanx.run_flags():
    strategy = phalanx.resolve()
else:  # torchrun
    strategy = phalanx.resolve("ddp", accelerator="cpu", num_nodes=int(os.environ["GROUP_WORLD_SIZE"]))
sys.stdout.write(f"PHALANX-RESOLVED-AT {time.time()}\n")
sys.stdout.flush()
strategy.launch(main)
