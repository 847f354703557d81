"""One node's ranks of a 2-node job: ``phalanx run --num-nodes 2
--node-rank N ... two_level.py MODE``; or one rank under ``mpirun`` across
two hosts, ``two_level.py MODE INTER`` (``hierarchical`` with ``inter=INTER``,
2 ranks per host). Each rank prints ``PHALANX-RESULT {json}``, in one write.

Modes:
    contract  the whole collective contract on the strategy's collective;
              which groups an all_reduce, a broadcast, an all_gather and a
              reduce_scatter went through; whether asynchronous all_reduces
              and reduce_scatters return before they are done.
    train     a few DDP or FSDP steps; the final weights.
"""

from __future__ import annotations

import functools
import json
import sys
import time

import torch

import phalanx
from phalanx_core.testing.contract import check_collective
from phalanx_core.testing.traffic import count_calls


def report(strategy, **values):
    sys.stdout.write(f"PHALANX-RESULT {json.dumps({'rank': strategy.global_rank, **values})}\n")
    sys.stdout.flush()


def contract(strategy):
    collective = strategy.collective
    levels = {"hierarchical": collective.hierarchical, "layout": collective._layout}
    local, _ = count_calls(collective._local)
    last, _ = count_calls(collective._local_last)
    cross, _ = count_calls(collective._cross)
    tensor = torch.full((5,), float(strategy.global_rank))
    collective.all_reduce(tensor)
    sent = torch.arange(3.0) if strategy.global_rank == 3 else torch.zeros(3)
    collective.broadcast(sent, src=3)
    gathered = collective.all_gather(torch.tensor([strategy.global_rank]))
    # reduce_scatter of integers: row r of rank k is 100 * r + k, so rank
    # r's row sums to 400 * r + 6 exactly; the flat one is the reference.
    rows = torch.arange(4, dtype=torch.int64).repeat_interleave(3).view(4, 3) * 100 + strategy.global_rank
    scattered = collective.reduce_scatter(rows)
    flat = collective.intra.reduce_scatter(rows)
    levels.update(
        all_reduce=tensor.tolist(),
        broadcast=sent.tolist(),
        all_gather=[t.item() for t in gathered],
        reduce_scatter=scattered.tolist(),
        reduce_scatter_flat=flat.tolist(),
        local=dict(local),
        last=dict(last),
        cross=dict(cross),
    )
    levels.update(overlap(strategy))
    ran = check_collective(collective, device=strategy.root_device)
    report(strategy, ran=ran, **levels)


def overlap(strategy):
    """Asynchronous operations return before their bytes have travelled:
    the last rank starts its 8 all_reduces (32 MB of float32) and its 8
    reduce_scatter_intos a second late, so on every other rank no handle
    can be done when its own calls return (a call that ran the steps
    itself would have waited for that rank); waited on, they hold the flat
    collective's results (integers, exact in float32). ``pending_*``:
    the handles not done then, on a rank that did not wait (None on the
    late rank)."""
    collective = strategy.collective
    rank, size = strategy.global_rank, strategy.world_size
    late = rank == size - 1
    tensors = [torch.full((1 << 20,), float(rank + i)) for i in range(8)]
    if late:
        time.sleep(1.0)
    works = [collective.all_reduce(t, async_op=True) for t in tensors]
    pending_reduce = None if late else sum(not w.is_completed() for w in works)
    results = [w.wait() for w in works]
    ok_reduce = all(
        r is t and bool((t == sum(k + i for k in range(size))).all())
        for i, (r, t) in enumerate(zip(results, tensors))
    )
    inputs = [torch.arange(size * (1 << 18), dtype=torch.float32) + rank + i for i in range(8)]
    outputs = [torch.empty(1 << 18) for _ in inputs]
    if late:
        time.sleep(1.0)
    works = [collective.reduce_scatter_into(o, t, async_op=True) for o, t in zip(outputs, inputs)]
    pending_scatter = None if late else sum(not w.is_completed() for w in works)
    for w in works:
        w.wait()
    expected = [collective.intra.reduce_scatter(t.view(size, -1)).view(-1) for t in inputs]
    ok_scatter = all(torch.equal(o, e) for o, e in zip(outputs, expected))
    # What phalanx's process group hands DDP for a bucket: a Work over the
    # chain's own future, completed by the steps' callbacks.
    from phalanx_torch.process_group import CollectiveProcessGroup

    group = CollectiveProcessGroup(collective)
    bucket = torch.full((999,), float(rank))
    work = group.allreduce([bucket])
    summed = work.get_future().wait()[0] is bucket and bucket[:2].tolist() == [6.0, 6.0]
    handed = type(work).__name__
    group.unregister()
    return {
        "handed": handed,
        "bucket_summed": summed,
        "pending_all_reduce": pending_reduce,
        "pending_reduce_scatter": pending_scatter,
        "async_all_reduce_right": ok_reduce,
        "async_reduce_scatter_right": ok_scatter,
    }


def train(strategy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model, optimizer = strategy.setup(model, functools.partial(torch.optim.SGD, lr=0.1))
    generator = torch.Generator().manual_seed(strategy.global_rank)
    for _ in range(5):
        x = torch.randn(4, 8, generator=generator)
        optimizer.zero_grad()
        strategy.backward(model(x).pow(2).mean())
        strategy.optimizer_step(optimizer)
    state = strategy.unwrap_module(model).state_dict()
    full = [t.full_tensor() if hasattr(t, "full_tensor") else t for _, t in sorted(state.items())]
    report(strategy, weights=torch.cat([t.flatten() for t in full]).tolist())


if phalanx.run_flags():
    strategy = phalanx.resolve()
else:  # under mpirun, one process per rank: inter over MPI
    strategy = phalanx.resolve(
        "ddp", accelerator="cpu", devices=2, num_nodes=2, collective="hierarchical", inter=sys.argv[2]
    )
strategy.launch(contract if sys.argv[1] == "contract" else train)
