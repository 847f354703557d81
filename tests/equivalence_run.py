"""Train the same model the same way under plain torch DDP or a phalanx strategy.

    python tests/equivalence_run.py plain OUT [--steps 4]
    python tests/equivalence_run.py STRATEGY OUT [--steps 4] [--load PATH] [--save PATH] [--full]

Two ranks on the CPU (one for ``single_device``): every rank seeds the same
model, takes its own slice of one global batch, and runs SGD with momentum
and weight decay (so the optimizer has state a checkpoint must carry).
``plain`` is the reference: ``torch.multiprocessing.spawn``,
``init_process_group("gloo")`` and ``DistributedDataParallel``, written the
way the torch tutorial writes it. Under ``manual`` the function wraps the
model in DDP itself, as a user of ``manual`` does.

Global rank 0 writes the whole weights (gathered from the shards under
``fsdp``) to OUT with ``torch.save``. Run by tests/test_equivalence.py, as
a program, because the ``subprocess`` launcher (``ddp``, ``fsdp``,
``manual``) re-runs the script in each rank.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from typing import Any

import torch
from torch import nn

import phalanx

WORLD = 2
BATCH = 32
#: Seconds a collective may wait before its rank fails: a hang fails the run.
TIMEOUT = 60


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 12), nn.Tanh(), nn.Linear(12, 2))


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def my_slice(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal share of one global batch, the same in every process."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 6, generator=generator)
    y = torch.stack([x[:, :3].sum(dim=1), x[:, 3] * x[:, 4]], dim=1)
    share = BATCH // world_size
    return x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]


def whole_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's weights whole: a DTensor (fsdp) is gathered, on every rank."""
    module = getattr(module, "module", module)  # a user's own DDP wrapper (manual)
    weights = {}
    for name, value in module.state_dict().items():
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        weights[name] = value.detach().clone()
    return weights


def sgd_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, x, y, backward) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()


# -- plain torch ------------------------------------------------------------------------------


def plain_rank(rank: int, steps: int, init_file: str, out: str) -> None:
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD
    )
    try:
        model = nn.parallel.DistributedDataParallel(make_model())
        optimizer = make_optimizer(model.parameters())
        sgd_steps(model, optimizer, steps, *my_slice(rank, WORLD), backward=lambda loss: loss.backward())
        if rank == 0:
            torch.save(whole_weights(model), out)
    finally:
        torch.distributed.destroy_process_group()
    # Plain torch's own exit can abort (SIGABRT from a gloo thread during the
    # interpreter's finalization, 9 runs in 20 under torchrun): the reference
    # leaves without it, as phalanx's ranks do.
    os._exit(0)


def plain(steps: int, out: str) -> None:
    with tempfile.TemporaryDirectory() as folder:
        init_file = os.path.join(folder, "init")
        torch.multiprocessing.spawn(plain_rank, args=(steps, init_file, out), nprocs=WORLD)


# -- through phalanx --------------------------------------------------------------------------


def train(strategy, steps: int, out: str, load: str | None, save: str | None, manual: bool) -> None:
    model = make_model()
    if manual:  # the user places and wraps; phalanx made the process group
        model = nn.parallel.DistributedDataParallel(model.to(strategy.root_device))
    model, optimizer = strategy.setup(model, make_optimizer)
    if load:
        strategy.load_checkpoint(load, {"model": model, "optimizer": optimizer})
    x, y = strategy.batch_to_device(my_slice(strategy.global_rank, strategy.world_size))
    for _ in range(steps):
        optimizer.zero_grad()
        with strategy.forward_context():
            loss = nn.functional.mse_loss(model(x), y)
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
    if save:
        strategy.save_checkpoint(save, {"model": model, "optimizer": optimizer})
    weights = whole_weights(model)
    if strategy.is_global_zero:
        torch.save(weights, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("strategy")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--load")
    parser.add_argument("--save")
    parser.add_argument("--full", action="store_true", help="fsdp: one full checkpoint file")
    args = parser.parse_args()
    if args.strategy == "plain":
        plain(args.steps, args.out)
        return
    devices = 1 if args.strategy == "single_device" else WORLD
    options: dict[str, Any] = {"timeout": TIMEOUT} if devices > 1 else {}
    if args.full:
        options["state_dict_type"] = "full"
    strategy = phalanx.resolve(args.strategy, accelerator="cpu", devices=devices, **options)
    strategy.launch(
        functools.partial(train, manual=args.strategy == "manual"),
        args.steps,
        args.out,
        args.load,
        args.save,
    )


if __name__ == "__main__":
    main()
