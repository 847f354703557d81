"""One node's ranks of a 2-node job: ``phalanx run --num-nodes 2
--node-rank N ... two_level.py MODE``; or one rank under ``mpirun`` across
two hosts, ``two_level.py MODE INTER`` (``hierarchical`` with ``inter=INTER``,
2 ranks per host). Each rank prints ``PHALANX-RESULT {json}``, in one write.

Modes:
    contract  the whole collective contract on the strategy's collective,
              and which groups an all_reduce, a broadcast and an all_gather
              went through.
    train     a few DDP or FSDP steps; the final weights.
"""

from __future__ import annotations

import functools
import json
import sys

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
    cross, _ = count_calls(collective._cross)
    tensor = torch.full((5,), float(strategy.global_rank))
    collective.all_reduce(tensor)
    sent = torch.arange(3.0) if strategy.global_rank == 3 else torch.zeros(3)
    collective.broadcast(sent, src=3)
    gathered = collective.all_gather(torch.tensor([strategy.global_rank]))
    levels.update(
        all_reduce=tensor.tolist(),
        broadcast=sent.tolist(),
        all_gather=[t.item() for t in gathered],
        local=dict(local),
        cross=dict(cross),
    )
    ran = check_collective(collective, device=strategy.root_device)
    report(strategy, ran=ran, **levels)


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
