"""Checkpoints load on any world size, under any torch strategy.

A checkpoint written by ``single_device`` (1 rank), ``ddp`` (1, 2 and 3
ranks) or ``fsdp`` (sharded and full, 1, 2 and 3 ranks) is loaded by
``single_device``, ``ddp`` and ``fsdp`` on 1, 2 and 3 ranks (3 is no
divisor of 2, 2 none of 3): every combination, with real forked ranks over
gloo. After the load, the model's weights and the optimizer's state (Adam's
moments and step counts, both parameter groups with their own learning
rate and weight decay) equal the writer's exactly; after one more step on
the same batch, they equal the writer's after that step, to float
rounding (the gradient's reduction sums in another order on another number
of ranks).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

import phalanx
from phalanx_core import MisconfigurationError

pytestmark = pytest.mark.subprocess

TIMEOUT = 60
WRITERS = [
    ("single_device", 1),
    ("ddp", 1), ("ddp", 2), ("ddp", 3),
    ("fsdp-sharded", 1), ("fsdp-sharded", 2), ("fsdp-sharded", 3),
    ("fsdp-full", 1), ("fsdp-full", 2), ("fsdp-full", 3),
]  # fmt: skip
READERS = [("single_device", 1), ("ddp", 1), ("ddp", 2), ("ddp", 3), ("fsdp", 1), ("fsdp", 2), ("fsdp", 3)]


def strategy_for(kind: str, ranks: int):
    if kind == "single_device":
        return phalanx.resolve("single_device", accelerator="cpu")
    if kind == "ddp":
        return phalanx.resolve("ddp_fork", accelerator="cpu", devices=ranks, timeout=TIMEOUT)
    state_dict_type = kind.partition("-")[2] or "sharded"
    return phalanx.resolve(
        "fsdp",
        accelerator="cpu",
        devices=ranks,
        launcher="fork",
        timeout=TIMEOUT,
        state_dict_type=state_dict_type,
    )


def make(strategy, seed: int):
    """A model (odd sizes: 3 ranks shard them unevenly) and an AdamW with
    two parameter groups, set up by ``strategy``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))

    def optimizer(params):
        params = list(params)
        weights = [p for p in params if p.dim() > 1]
        biases = [p for p in params if p.dim() == 1]
        return torch.optim.AdamW(
            [{"params": weights, "weight_decay": 0.1}, {"params": biases, "lr": 0.02, "weight_decay": 0.0}],
            lr=0.01,
        )

    return strategy.setup(model, optimizer)


def batch():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(12, 5, generator=g)
    return x, torch.randn(12, 3, generator=g)


def step(strategy, model, optimizer) -> None:
    x, y = batch()  # the same batch on every rank: the same gradient in any world
    optimizer.zero_grad()
    strategy.backward(nn.functional.mse_loss(model(x), y))
    strategy.optimizer_step(optimizer)


def whole_state(model, optimizer) -> dict:
    """The model's and the optimizer's state whole (gathered), keyed by
    parameter name, on every rank (a collective under fsdp)."""
    options = StateDictOptions(full_state_dict=True)  # on every rank (cpu_offload: rank 0 only)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    return {
        "weights": {k: v.detach().cpu().clone() for k, v in weights.items()},
        "moments": {
            name: {k: v.cpu().clone() for k, v in entry.items()} for name, entry in optim["state"].items()
        },
        "groups": [{k: v for k, v in g.items()} for g in optim["param_groups"]],
    }


def write(strategy, path: str):
    model, optimizer = make(strategy, seed=0)
    for _ in range(3):
        step(strategy, model, optimizer)
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer, "steps": 3})
    saved = whole_state(model, optimizer)
    step(strategy, model, optimizer)
    return saved, whole_state(model, optimizer)


def read(strategy, paths: list[str]):
    out = {}
    for path in paths:
        model, optimizer = make(strategy, seed=1)  # other weights: the load must replace them
        rest = strategy.load_checkpoint(path, {"model": model, "optimizer": optimizer})
        loaded = whole_state(model, optimizer)
        step(strategy, model, optimizer)
        out[path] = (rest, loaded, whole_state(model, optimizer))
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("worlds")
    found = {}
    for kind, ranks in WRITERS:
        path = root / f"{kind}-{ranks}"
        results = strategy_for(kind, ranks).launch(write, str(path))
        found[(kind, ranks)] = (str(path), *results[0])
        assert path.is_dir() == (kind == "fsdp-sharded")
    return found


def exact(a: dict, b: dict) -> list[str]:
    """Where two whole states differ at all."""
    differ = [k for k in a["weights"] if not torch.equal(a["weights"][k], b["weights"][k])]
    for name, entry in a["moments"].items():
        differ += [f"{name}.{k}" for k in entry if not torch.equal(entry[k], b["moments"][name][k])]
    if a["groups"] != b["groups"]:
        differ.append("param_groups")
    if set(a["weights"]) != set(b["weights"]) or set(a["moments"]) != set(b["moments"]):
        differ.append("keys")
    return differ


def close(a: dict, b: dict) -> list[str]:
    differ = [
        k for k in a["weights"] if not torch.allclose(a["weights"][k], b["weights"][k], rtol=1e-5, atol=1e-6)
    ]
    for name, entry in a["moments"].items():
        differ += [
            f"{name}.{k}"
            for k in entry
            if not torch.allclose(entry[k].double(), b["moments"][name][k].double(), rtol=1e-5, atol=1e-7)
        ]
    return differ


@pytest.mark.parametrize(("reader", "ranks"), READERS, ids=[f"{r}-{n}" for r, n in READERS])
def test_every_checkpoint_loads_exactly_on_this_world(written, reader, ranks):
    paths = [entry[0] for entry in written.values()]
    results = strategy_for(reader, ranks).launch(read, paths)
    problems = []
    for (kind, n), (path, saved, after) in written.items():
        for rank, per_path in enumerate(results):
            rest, loaded, stepped = per_path[path]
            if rest.get("steps") != 3:
                problems.append(f"{kind} on {n} -> {reader} on {ranks}, rank {rank}: the rest is {rest}")
            if differ := exact(saved, loaded):
                problems.append(
                    f"{kind} on {n} -> {reader} on {ranks}, rank {rank}: loaded differs at {differ}"
                )
            if differ := close(after, stepped):
                problems.append(
                    f"{kind} on {n} -> {reader} on {ranks}, rank {rank}: one step on differs at {differ}"
                )
    assert not problems, "\n".join(problems)


def save_per_rank(strategy, path: str) -> None:
    model, optimizer = make(strategy, seed=0)
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer})


def load_one(strategy, path: str):
    model, optimizer = make(strategy, seed=0)
    try:
        strategy.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    except MisconfigurationError as exc:
        return str(exc)
    return None


def test_a_per_rank_directory_is_refused_by_the_others_saying_why_and_what_to_do(tmp_path):
    path = tmp_path / "manual"
    phalanx.resolve("manual", accelerator="cpu", devices=2, launcher="fork", timeout=TIMEOUT).launch(
        save_per_rank, str(path)
    )
    assert sorted(p.name for p in path.iterdir()) == [".complete", "rank-00000.pt", "rank-00001.pt"]
    for reader, ranks in [("single_device", 1), ("ddp", 2), ("fsdp", 2)]:
        [message, *_] = strategy_for(reader, ranks).launch(load_one, str(path))
        assert message is not None, reader
        assert "one file per rank (2: rank-00000.pt, rank-00001.pt)" in message
        assert "checkpoint_per_rank=True" in message and "checkpoint_per_rank=False (one file)" in message
        assert f"{path / 'rank-00000.pt'}" in message


def test_a_manual_per_rank_background_save_is_refused_with_what_to_do(tmp_path):
    strategy = phalanx.resolve("manual", accelerator="cpu", devices=1, launcher="in_process")
    [message] = strategy.launch(functools.partial(_background_manual, path=str(tmp_path / "m")))
    assert "saves blocking only" in message and "checkpoint_per_rank=False" in message


def _background_manual(strategy, path):
    model, optimizer = make(strategy, seed=0)
    try:
        strategy.save_checkpoint(path, {"model": model}, blocking=False)
    except MisconfigurationError as exc:
        return str(exc)
    return None


def test_the_sharded_directory_read_whole_names_a_damaged_file(tmp_path, written):
    # A sharded directory read whole by a strategy that does not shard says
    # which file is damaged, as fsdp's own reading does.
    source = Path(written[("fsdp-sharded", 2)][0])
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in source.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    data = sorted(p for p in copy.iterdir() if p.suffix == ".distcp")[0]
    data.write_bytes(data.read_bytes()[:10])
    [message] = strategy_for("single_device", 1).launch(load_one, str(copy))
    assert message is not None and f"its file {data.name!r} is truncated" in message


def test_reading_the_sharded_directory_whole_warns_nothing(written):
    # torch warns on every single-process load of a sharded checkpoint that
    # it "assumes the intent is to load in a single process": that is what
    # the torch strategies' checkpoint_io asks for, so the user sees nothing.
    import warnings

    from phalanx_torch.checkpoint_io import TorchDistributedCheckpointIO

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = TorchDistributedCheckpointIO().load(written[("fsdp-sharded", 2)][0])
    assert state["steps"] == 3
    assert [str(w.message) for w in caught] == []
