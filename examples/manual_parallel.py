"""Your own parallelism under the ``manual`` strategy: a recommendation-style
model whose embedding tables are sharded across the ranks by hand, lookups
exchanged with all_to_all, and a dense part wrapped in DDP.

    python examples/manual_parallel.py --devices 2 --steps 40
    python examples/manual_parallel.py --collective mpi --launcher mpirun   # phalanx-mpi
    phalanx run --strategy manual --accelerator cpu --devices 2 examples/manual_parallel.py

phalanx gives the ranks, the processes, the collective and torch's default
process group; this code places the modules on ``strategy.root_device`` and
wraps them itself, as in DLRM:

- ``TABLES`` embedding tables, table ``t`` held whole by one rank only
  (table-wise sharding: rank ``r`` holds the tables ``t`` with
  ``t * world // TABLES == r``), so no rank holds every table;
- every rank has its own batch of (dense features, one id per table).
  Each rank sends the ids of every table to the rank holding it
  (``all_to_all``), looks up its tables for every rank's batch, and sends
  the embeddings back (``all_to_all`` again). In backward the embeddings'
  gradients travel the reverse way, so each table's gradient sums what
  every rank's batch asked of it;
- the dense part (an MLP over the dense features and the embeddings) is
  replicated and wrapped in DistributedDataParallel.

Both exchanges go through the strategy's collective (``--collective mpi``
sends them over MPI while DDP's gradient reduction stays on torch's group).
With the same seeds, 1 rank on the whole batch and N ranks on its shares
train to the same weights. Each rank saves its own checkpoint file
(``manual``'s default): its tables.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from torch.nn.parallel import DistributedDataParallel

import phalanx

TABLES = 4  # embedding tables, split across the ranks
ROWS = 100  # ids per table
DIM = 8  # embedding width
BATCH = 64  # the global batch, split across the ranks


def owner(table: int, world: int) -> int:
    return table * world // TABLES


class Exchange(torch.autograd.Function):
    """``all_to_all`` through the strategy's collective, differentiable:
    the gradient of what rank ``j`` sent goes back to rank ``j``."""

    @staticmethod
    def forward(ctx, strategy, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.strategy = strategy
        return tuple(strategy.all_to_all([t.contiguous() for t in tensors]))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):  # type: ignore[override]
        return (None, *ctx.strategy.all_to_all([g.contiguous() for g in grads]))


class ShardedEmbeddings(torch.nn.Module):
    """This rank's tables; ``forward(ids)`` gives every table's embeddings
    of this rank's batch, whichever rank holds the table."""

    def __init__(self, strategy) -> None:
        super().__init__()
        self.strategy = strategy
        world, rank = strategy.world_size, strategy.global_rank
        self.tables_of = [[t for t in range(TABLES) if owner(t, world) == r] for r in range(world)]
        tables = {}
        for t in self.tables_of[rank]:
            torch.manual_seed(1000 + t)  # a table is the same whichever rank holds it
            tables[str(t)] = torch.nn.Embedding(ROWS, DIM)
        self.tables = torch.nn.ModuleDict(tables)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [batch, TABLES]
        mine = self.tables_of[self.strategy.global_rank]
        # 1. every rank's ids for my tables: asked[j] is [rank j's batch, len(mine)]
        asked = self.strategy.all_to_all([ids[:, tables] for tables in self.tables_of])
        # 2. look them up, and send each rank its rows back: [batch, len(tables of j), DIM]
        looked_up = [
            torch.stack([self.tables[str(t)](asked_j[:, i]) for i, t in enumerate(mine)], dim=1)
            for asked_j in asked
        ]
        got = Exchange.apply(self.strategy, *looked_up)
        # 3. in table order: got[j] holds the tables of rank j, which come in order
        return torch.cat(got, dim=1)  # [batch, TABLES, DIM]


def make_dense() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4 + TABLES * DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))


def my_batch(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's share of one global batch: dense features, ids, target."""
    generator = torch.Generator().manual_seed(7)
    dense = torch.randn(BATCH, 4, generator=generator)
    ids = torch.randint(0, ROWS, (BATCH, TABLES), generator=generator)
    target = dense.sum(dim=1, keepdim=True) + torch.sin(ids.float()).sum(dim=1, keepdim=True)
    share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return dense[share], ids[share], target[share]


def train(strategy, steps: int) -> dict[str, float]:
    rank, world, device = strategy.global_rank, strategy.world_size, strategy.root_device
    if BATCH % world or world > TABLES:
        raise SystemExit(f"{world} ranks cannot share {TABLES} tables and a batch of {BATCH} evenly")
    dense = make_dense().to(device)
    # Over the strategy's collective (whichever was named), not a group of torch's own.
    dense = DistributedDataParallel(dense, process_group=strategy.process_group) if world > 1 else dense
    embeddings = ShardedEmbeddings(strategy).to(device)
    dense, embeddings = strategy.setup(dense), strategy.setup(embeddings)  # manual: left as they are
    optimizer = torch.optim.Adam([*dense.parameters(), *embeddings.parameters()], lr=0.02)
    x, ids, y = (t.to(device) for t in my_batch(rank, world))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with strategy.forward_context():
            features = torch.cat([x, embeddings(ids).flatten(1)], dim=1)
            loss = torch.nn.functional.mse_loss(dense(features), y)
        strategy.backward(loss)
        # DDP averages the dense gradients over the ranks; a table's gradient
        # arrives summed over every rank's batch: average it the same way.
        for p in embeddings.parameters():
            p.grad.div_(world)
        strategy.optimizer_step(optimizer)
        losses.append(strategy.all_reduce(loss.detach().clone(), op="mean").item())
    with tempfile.TemporaryDirectory() as tmp:
        path = strategy.broadcast_object(tmp)  # rank 0's folder, for everyone
        strategy.save_checkpoint(f"{path}/ckpt", {"embeddings": embeddings, "step": steps})
        restored = ShardedEmbeddings(strategy)
        assert strategy.load_checkpoint(f"{path}/ckpt", {"embeddings": restored}) == {"step": steps}
        for t, table in restored.tables.items():
            assert torch.equal(table.weight, embeddings.tables[t].weight.cpu())
        strategy.barrier()
    strategy.print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} after {steps} steps on {world} rank(s)")
    tables = {t: table.weight.detach().cpu() for t, table in embeddings.tables.items()}
    return {"first": losses[0], "last": losses[-1], "tables": tables}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, help="the number of ranks (default 2, or phalanx run's)")
    parser.add_argument("--collective", help="a collective name (default: torch over gloo)")
    parser.add_argument("--launcher", help="a launcher name (default: spawn, or phalanx run's)")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    flags = {"collective": args.collective} if args.collective else {}
    if not phalanx.under_run():
        devices = args.devices or 2
        launcher = args.launcher or "spawn"
        flags |= {"strategy": "manual", "accelerator": "cpu", "devices": devices, "launcher": launcher}
    elif args.devices:
        flags["devices"] = args.devices
    return phalanx.resolve(**flags).launch(train, args.steps)


if __name__ == "__main__":
    main()
