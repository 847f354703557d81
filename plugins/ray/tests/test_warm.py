"""Warm ranks (``keep_alive=True``): the actors, their group and what each
rank keeps in ``strategy.rank_state`` stay between launches of the same
strategy, until ``strategy.teardown()``; a failure in a warm job ends it,
and the next launch starts afresh."""

from __future__ import annotations

import functools
import os
import time

import pytest
import torch

import phalanx
from phalanx_core import WorkerFailedError
from phalanx_core.testing.processes import TAG_VAR, new_tag, reap


def build(strategy):
    """The first launch: a model and its optimizer, kept in the rank."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = strategy.setup(model, functools.partial(torch.optim.SGD, lr=0.1))
    strategy.rank_state.update(model=model, optimizer=optimizer, steps=0)
    return os.getpid(), id(strategy)


def step(strategy):
    """A later launch: one more step of the model the first one made."""
    model, optimizer = strategy.rank_state["model"], strategy.rank_state["optimizer"]
    x = torch.full((2, 4), float(strategy.global_rank + 1))
    optimizer.zero_grad()
    strategy.backward(model(x).pow(2).mean())
    strategy.optimizer_step(optimizer)
    strategy.rank_state["steps"] += 1
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    return os.getpid(), id(strategy), strategy.rank_state["steps"], weights.tolist()


def fail_on_rank_1(strategy):
    if strategy.global_rank == 1:
        raise RuntimeError("rank 1 broke on purpose")
    strategy.barrier()


@pytest.fixture
def tagged(monkeypatch):
    tag = new_tag()
    monkeypatch.setenv(TAG_VAR, tag)
    yield
    left = reap(tag, grace=10, children_of=os.getpid())
    assert not left, f"processes left behind (killed now): {left}"


def test_three_launches_share_the_actors_the_group_and_the_model(tagged):
    import ray

    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray", keep_alive=True)
    try:
        started = time.perf_counter()
        first = strategy.launch(build)
        cold = time.perf_counter() - started
        warm = []
        results = []
        for _ in range(2):
            started = time.perf_counter()
            results.append(strategy.launch(step))
            warm.append(time.perf_counter() - started)
        assert ray.is_initialized()  # the job's Ray instance stays with its actors
    finally:
        strategy.teardown()
    assert not ray.is_initialized()  # and goes with them
    for rank in range(2):
        pid, kept = first[rank]
        # The same process and the same set-up strategy object in it.
        assert [r[rank][:2] for r in results] == [(pid, kept), (pid, kept)]
        assert [r[rank][2] for r in results] == [1, 2]
    # DDP kept the replicas equal across the launches: the group is alive.
    assert results[-1][0][3] == results[-1][1][3]
    assert results[0][0][3] != results[-1][0][3]
    print(f"launch: cold {cold:.2f} s, warm {warm[0]:.3f} s and {warm[1]:.3f} s")


def test_a_failure_ends_the_warm_job_and_the_next_launch_starts_afresh(tagged):
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray", keep_alive=True)
    try:
        first = strategy.launch(build)
        with pytest.raises(WorkerFailedError) as info:
            strategy.launch(fail_on_rank_1)
        assert info.value.rank == 1 and "rank 1 broke on purpose" in info.value.traceback
        again = strategy.launch(build)
    finally:
        strategy.teardown()
    assert {pid for pid, _ in again}.isdisjoint(pid for pid, _ in first)


def test_teardown_twice_and_a_launch_after_it(tagged):
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray", keep_alive=True)
    first = strategy.launch(build)
    strategy.teardown()
    strategy.teardown()
    try:
        again = strategy.launch(build)
    finally:
        strategy.teardown()
    assert {pid for pid, _ in again}.isdisjoint(pid for pid, _ in first)


def test_two_warm_strategies_share_the_local_instance_until_the_last_ends(tagged):
    import ray

    one = phalanx.resolve("ddp", accelerator="cpu", devices=1, launcher="ray", keep_alive=True)
    two = phalanx.resolve("ddp", accelerator="cpu", devices=1, launcher="ray", keep_alive=True)
    try:
        one.launch(build)
        two.launch(build)
        with pytest.raises(phalanx.MisconfigurationError, match="already joined to a local Ray instance"):
            phalanx.resolve("ddp", accelerator="cpu", devices=1, launcher="ray", address="auto").launch(build)
        one.teardown()
        assert ray.is_initialized()
        assert two.launch(step)[0][2] == 1  # still warm after the other one ended
    finally:
        one.teardown()
        two.teardown()
    assert not ray.is_initialized()
