"""Train a small model on the GPU under a strategy and a precision, by name.

    python tests/cuda_run.py STRATEGY PRECISION OUT [--steps 20] [--accelerator cuda]

Run by tests/test_cuda.py, as a program (the ``subprocess`` launcher of
``ddp``, ``fsdp`` and ``manual`` re-runs the script in each rank). One
rank on ``cuda:0``. Each rank trains, saves a checkpoint, loads it back
into a fresh model and optimizer, and global rank 0 writes what it saw to
OUT as JSON: the first and last loss, the parameters' dtype and device, the
output's dtype under the precision's forward context, the collective's
backend, the keys of the checkpoint, and whether the loaded weights equal
the trained ones. ``--accelerator cpu`` runs the same on the CPU (for
checking this program where there is no GPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from typing import Any

import torch
from torch import nn

import phalanx


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def data(strategy: Any) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(128, 16, generator=generator)
    return strategy.batch_to_device((x, x[:, :4].sum(dim=1, keepdim=True)))


def prepare(strategy: Any, manual: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    optimizer = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    with strategy.module_init_context():
        module = make_model()
    if not manual:
        return strategy.setup(module, optimizer)
    # ``manual``: the user's own code converts, places and wraps the module.
    module = strategy.precision.convert_module(module).to(strategy.root_device)
    if strategy.world_size > 1 or torch.distributed.is_initialized():
        ids = [strategy.root_device.index] if strategy.root_device.type == "cuda" else None
        module = nn.parallel.DistributedDataParallel(module, device_ids=ids)
    return strategy.setup(module, optimizer)


def train(strategy: Any, steps: int, out: str, manual: bool) -> None:
    model, optimizer = prepare(strategy, manual)
    x, y = data(strategy)
    losses, out_dtype = [], ""
    for _ in range(steps):
        optimizer.zero_grad()
        with strategy.forward_context():
            pred = model(x)
            loss = nn.functional.mse_loss(pred.float(), y.float())
        out_dtype = str(pred.dtype)
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        losses.append(strategy.all_reduce(loss.detach().float(), op="mean").item())
    param = next(model.parameters())
    path = out + ".ckpt"
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer, "step": steps})
    if os.path.isfile(path):
        keys = sorted(torch.load(path, weights_only=False))
    elif manual:  # one file per rank
        keys = sorted(torch.load(strategy.rank_checkpoint_path(path), weights_only=False))
    else:  # fsdp: a distributed checkpoint, a directory of shards
        keys = None

    fresh, fresh_optimizer = prepare(strategy, manual)
    rest = strategy.load_checkpoint(path, {"model": fresh, "optimizer": fresh_optimizer})
    same = all(
        torch.equal(_full(a), _full(b))
        for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True)
    )
    # A background save: training changes the weights on the GPU at once;
    # the checkpoint holds them as they were at the call.
    at_save = [_full(t).clone() for t in model.state_dict().values()]
    background = None
    if not manual:
        handle = strategy.save_checkpoint(
            path + "-bg", {"model": model, "optimizer": optimizer}, blocking=False
        )
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        handle.wait()
        strategy.load_checkpoint(path + "-bg", {"model": fresh, "optimizer": fresh_optimizer})
        background = all(
            torch.equal(a, _full(b)) for a, b in zip(at_save, fresh.state_dict().values(), strict=True)
        )
    result = {
        "background_same_weights": background,
        "first": losses[0],
        "last": losses[-1],
        "finite": all(loss == loss and abs(loss) != float("inf") for loss in losses),
        "param_dtype": str(param.dtype),
        "param_device": _full(param).device.type,
        "out_dtype": out_dtype,
        "backend": getattr(strategy.collective, "backend", None),
        "checkpoint_keys": keys,
        "loaded_same_weights": same,
        "loaded_rest": sorted(rest),
    }
    if strategy.is_global_zero:
        with open(out, "w") as f:
            json.dump(result, f)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor (fsdp) whole; anything else as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("precision")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accelerator", default="cuda")
    args = parser.parse_args()
    options = {} if args.strategy == "single_device" else {"timeout": 120}
    strategy = phalanx.resolve(
        args.strategy, accelerator=args.accelerator, devices=1, precision=args.precision, **options
    )
    strategy.launch(train, args.steps, args.out, args.strategy == "manual")


if __name__ == "__main__":
    main()
