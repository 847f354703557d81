"""Your own parallelism under the ``manual`` strategy: DDP on one part of the
model, a hand-sharded layer on another.

    python examples/manual_parallel.py --devices 2 --steps 40
    phalanx run --strategy manual --accelerator cpu --devices 2 examples/manual_parallel.py

phalanx gives the ranks, the processes, the collective and torch's default
process group; this code places the modules on ``strategy.root_device`` and
wraps them itself:

- the trunk is replicated and wrapped in DistributedDataParallel;
- the head is sharded by output columns: each rank holds ``OUT // world``
  rows of its weight and computes its columns for every rank's batch, so
  the weight is never whole on any rank. The rows of every rank's batch
  are gathered, and their gradients summed back, through the strategy's
  collective (``--collective mpi`` sends them over MPI while DDP's own
  gradient reduction stays on torch's group).

Each rank saves its own checkpoint file (``manual``'s default).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.nn.parallel import DistributedDataParallel

import phalanx

OUT = 8  # the head's output features, split across ranks


class GatherRows(torch.autograd.Function):
    """Every rank's rows, in rank order; backward sums each row's gradient
    over the ranks and gives each rank its own rows' back."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, strategy) -> torch.Tensor:  # type: ignore[override]
        ctx.strategy = strategy
        return torch.cat(strategy.all_gather(rows), dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        strategy = ctx.strategy
        total = strategy.all_reduce(grad.contiguous().clone(), op="sum")
        return total.chunk(strategy.world_size)[strategy.global_rank], None


class ShardedHead(torch.nn.Module):
    """A Linear(32, OUT) whose output columns are split across the ranks."""

    def __init__(self, strategy) -> None:
        super().__init__()
        world = strategy.world_size
        if OUT % world:
            raise SystemExit(f"the head has {OUT} outputs, which {world} ranks cannot split evenly")
        torch.manual_seed(100 + strategy.global_rank)  # each shard is its own
        self.shard = torch.nn.Linear(32, OUT // world)
        self.strategy = strategy

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.shard(GatherRows.apply(features, self.strategy))  # this rank's columns, every row


def make_data(rank: int, n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(n, 8, generator=generator)
    return x, torch.tanh(x @ torch.linspace(-1, 1, 8 * OUT).reshape(8, OUT))


def train(strategy, steps: int) -> dict[str, float]:
    rank, world, device = strategy.global_rank, strategy.world_size, strategy.root_device
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh()).to(device)
    trunk = DistributedDataParallel(trunk) if world > 1 else trunk
    head = ShardedHead(strategy).to(device)
    trunk, head = strategy.setup(trunk), strategy.setup(head)  # manual: left as they are
    optimizer = torch.optim.Adam([*trunk.parameters(), *head.parameters()], lr=0.01)
    x, y = make_data(rank)
    x, y = x.to(device), y.to(device)
    targets = torch.cat(strategy.all_gather(y), dim=0)
    columns = slice(rank * OUT // world, (rank + 1) * OUT // world)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with strategy.forward_context():
            out = head(trunk(x))
            loss = torch.nn.functional.mse_loss(out, targets[:, columns])
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        total = strategy.all_reduce(loss.detach().clone(), op="mean")
        losses.append(total.item())
    with tempfile.TemporaryDirectory() as tmp:
        path = strategy.broadcast_object(tmp)  # rank 0's folder, for everyone
        strategy.save_checkpoint(f"{path}/ckpt", {"head": head, "step": steps})
        restored = ShardedHead(strategy)
        assert strategy.load_checkpoint(f"{path}/ckpt", {"head": restored}) == {"step": steps}
        assert torch.equal(restored.shard.weight, head.shard.weight.cpu())
        strategy.barrier()
    strategy.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {steps} steps on {world} rank(s)")
    return {"first": losses[0], "last": losses[-1], "shard_rows": head.shard.weight.shape[0]}


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, help="the number of ranks (default 2, or phalanx run's)")
    parser.add_argument("--collective", help="a collective name (default: torch over gloo)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    flags = {"collective": args.collective} if args.collective else {}
    if not phalanx.under_run():
        devices = args.devices or 2
        flags |= {"strategy": "manual", "accelerator": "cpu", "devices": devices, "launcher": "spawn"}
    elif args.devices:
        flags["devices"] = args.devices
    return phalanx.resolve(**flags).launch(train, args.steps)


if __name__ == "__main__":
    main()
