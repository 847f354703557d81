"""The horovod collective beyond the shared contract, with real horovod:
what Horovod allows that the contract does not ask (uneven first
dimensions), dtypes Horovod lacks (bool, bfloat16, int8), the
refusals (send/recv, Adasum in a Horovod without MPI, subgroups of
subgroups), async handles of every tensor operation, and Horovod in
processes it did not start.

The functions the ranks run travel by value (cloudpickle, as horovod.run
sends them), so this module need not be importable in the ranks."""

from __future__ import annotations

import sys

import cloudpickle
import pytest
import torch

import phalanx
from phalanx_core import MisconfigurationError, NotInGroupError, UnavailableError
from phalanx_core.collective import Work
from phalanx_core.testing.processes import TAG_VAR, new_tag, reap

pytestmark = pytest.mark.subprocess

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch: pytest.MonkeyPatch):
    tag = new_tag()
    monkeypatch.setenv(TAG_VAR, tag)
    yield
    left = reap(tag, grace=10)
    assert not left, f"processes left behind (killed now): {left}"


def launch(fn, devices: int, **flags):
    return phalanx.resolve("horovod", accelerator="cpu", devices=devices, **flags).launch(fn)


def _refuses(call, error, *words):
    try:
        call()
    except error as exc:
        text = str(exc)
    else:
        raise AssertionError(f"expected {error.__name__}")
    assert all(w in text for w in words), text
    return text


def beyond_the_contract(strategy):
    c = strategy.collective
    r, n = c.rank, c.world_size
    out = {}
    # all_gather with first dimensions that differ between ranks
    got = c.all_gather(torch.full((r + 1, 2), float(r)))
    out["uneven_all_gather"] = [tuple(t.shape) for t in got] + [t[0, 0].item() for t in got]
    out["scalar_all_gather"] = [t.item() for t in c.all_gather(torch.tensor(float(r) + 0.5))]
    # all_to_all sending rank j (j + 1) rows
    got = c.all_to_all([torch.full((j + 1,), 10.0 * r + j) for j in range(n)])
    out["uneven_all_to_all"] = [t.tolist() for t in got]
    # dtypes Horovod lacks on the CPU
    b = torch.tensor([r == 0, r == 1, True])
    c.broadcast(b, 1)
    out["bool_broadcast"] = b.tolist()
    out["bool_all_gather"] = [t.tolist() for t in c.all_gather(torch.tensor([r == 0]))]
    x = torch.tensor([1.5, -2.0], dtype=torch.bfloat16) * (r + 1)
    c.all_reduce(x, "sum")
    out["bf16_all_reduce"] = (str(x.dtype), x.tolist())
    y = torch.tensor([float(r) + 0.25], dtype=torch.bfloat16)
    c.broadcast(y, 0)
    out["bf16_broadcast"] = y.tolist()
    out["bf16_reduce_scatter"] = c.reduce_scatter(torch.ones(2 * n, dtype=torch.bfloat16), "sum").tolist()
    i8 = torch.tensor([100, -3], dtype=torch.int8)
    c.all_reduce(i8, "max")
    out["int8_all_reduce"] = (str(i8.dtype), i8.tolist())
    h = torch.tensor([r + 1.0], dtype=torch.float16)
    c.all_reduce(h, "product")
    out["f16_product"] = h.tolist()
    nc = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    c.all_reduce(nc, "sum")
    out["non_contiguous"] = nc.tolist()
    # reduce_scatter with the ops Gloo's reduce-scatter lacks, and integer mean
    t = torch.arange(2 * n, dtype=torch.int64) * (r + 1)
    out["reduce_scatter"] = {
        op: c.reduce_scatter(t, op).tolist() for op in ("sum", "mean", "min", "max", "product")
    }
    # Adasum: Horovod has it over MPI only; this horovod runs over gloo
    out["adasum"] = _refuses(
        lambda: c.all_reduce(torch.ones(2), "adasum"), UnavailableError, "op='adasum'", "MPI"
    )
    # async handles of every tensor operation
    works = {
        "broadcast": c.broadcast(torch.tensor([float(r)]), 1, async_op=True),
        "reduce": c.reduce(torch.tensor([1.0]), 0, async_op=True),
        "gather": c.gather(torch.tensor([float(r)]), 1, async_op=True),
        "scatter": c.scatter(
            torch.zeros(1), [torch.tensor([5.0 + j]) for j in range(n)] if r == 0 else None, 0, async_op=True
        ),
        "reduce_scatter": c.reduce_scatter(torch.ones(n), "sum", async_op=True),
        "all_to_all": c.all_to_all([torch.tensor([float(r)])] * n, async_op=True),
    }
    assert all(isinstance(w, Work) for w in works.values())
    done = {k: w.wait() for k, w in works.items()}
    out["async"] = {
        k: (v.tolist() if torch.is_tensor(v) else [t.tolist() for t in v]) for k, v in done.items()
    }
    # send / recv: refused, naming the operation and the collective
    out["send"] = _refuses(lambda: c.send(torch.zeros(1), 1 - r), UnavailableError, "send()", "'horovod'")
    out["recv"] = _refuses(lambda: c.recv(torch.zeros(1), 1 - r), UnavailableError, "recv()", "'horovod'")
    # a group of the whole world twice, and the same subgroup twice (one process set)
    for _ in range(2):
        world = c.new_group([1, 0])
        out.setdefault("world_group", []).append(world.all_reduce(torch.ones(1)).item())
    # objects of every size, including an empty pickle-able and a large one
    big = list(range(100_000)) if r == 1 else None
    out["big_object"] = len(c.broadcast_object(big, 1))
    out["scatter_objects"] = c.scatter_object([{"to": j} for j in range(n)] if r == 1 else None, 1)
    return r, out


def test_what_horovod_allows_beyond_the_contract():
    results = launch(beyond_the_contract, 2)
    for r, out in results:
        assert out["uneven_all_gather"] == [(1, 2), (2, 2), 0.0, 1.0]
        assert out["scalar_all_gather"] == [0.5, 1.5]
        assert out["uneven_all_to_all"] == [[0.0 + r] * (r + 1), [10.0 + r] * (r + 1)]
        assert out["bool_broadcast"] == [False, True, True]
        assert out["bool_all_gather"] == [[True], [False]]
        assert out["bf16_all_reduce"] == ("torch.bfloat16", [4.5, -6.0])
        assert out["bf16_broadcast"] == [0.25]
        assert out["bf16_reduce_scatter"] == [2.0, 2.0]
        assert out["int8_all_reduce"] == ("torch.int8", [100, -3])
        assert out["f16_product"] == [2.0]
        assert out["non_contiguous"] == [[0.0, 6.0], [2.0, 8.0], [4.0, 10.0]]
        rows = slice(2 * r, 2 * r + 2)
        base = list(range(4))
        assert out["reduce_scatter"] == {
            "sum": [3 * v for v in base][rows],
            "mean": [3 * v // 2 for v in base][rows],
            "min": base[rows],
            "max": [2 * v for v in base][rows],
            "product": [2 * v * v for v in base][rows],
        }
        assert "HOROVOD_WITH_MPI=1" in out["adasum"]
        assert out["async"] == {
            "broadcast": [1.0],
            "reduce": [2.0] if r == 0 else out["async"]["reduce"],
            "gather": [[0.0], [1.0]] if r == 1 else [],
            "scatter": [5.0 + r],
            "reduce_scatter": [2.0],
            "all_to_all": [[0.0], [1.0]],
        }
        assert out["world_group"] == [2.0, 2.0]
        assert out["big_object"] == 100_000
        assert out["scatter_objects"] == {"to": r}


def in_three(strategy):
    c = strategy.collective
    r = c.rank
    out = {}
    pair = c.new_group([2, 0])
    again = c.new_group([0, 2])  # the same ranks: the same process set, not a duplicate
    if r in (0, 2):
        t = torch.tensor([float(r)])
        pair.all_reduce(t)
        u = torch.tensor([1.0])
        again.all_reduce(u)
        out["pair"] = (pair.rank, pair.world_size, pair.global_ranks, t.item(), u.item())
        out["pair_gather"] = [x.item() for x in pair.all_gather(torch.tensor([r * 1.0]))]
        out["nested"] = _refuses(lambda: pair.new_group([0]), UnavailableError, "subgroup", "world")
    else:
        out["pair"] = _refuses(lambda: pair.all_reduce(torch.ones(1)), NotInGroupError, "[0, 2]")
    out["bad_group"] = _refuses(lambda: c.new_group([0, 0]), MisconfigurationError, "distinct")
    return r, out


def test_subgroups_are_process_sets():
    results = dict(launch(in_three, 3))
    assert results[0]["pair"] == (0, 2, (0, 2), 2.0, 2.0)
    assert results[2]["pair"] == (1, 2, (0, 2), 2.0, 2.0)
    assert results[0]["pair_gather"] == [0.0, 2.0]
    assert "not a member" in results[1]["pair"]
    for r in (0, 2):
        assert "process set with every process of the job" in results[r]["nested"]


@pytest.mark.parametrize(("strategy", "launcher"), [("horovod", "spawn"), ("ddp", None), ("manual", "fork")])
def test_horovod_in_processes_it_did_not_start_is_refused_when_resolving(strategy, launcher):
    flags = {"launcher": launcher} if launcher else {}
    with pytest.raises(MisconfigurationError) as info:
        phalanx.resolve(strategy, accelerator="cpu", devices=2, collective="horovod", **flags)
    message = str(info.value)
    assert "collective 'horovod' with launcher" in message, message
    assert "launcher='horovod'" in message and "horovodrun" in message


def test_another_collective_is_taken_and_adasum_with_it_refused_when_resolving():
    # The gradients then go through that collective (test_strategy.py trains
    # this way); Adasum is Horovod's alone.
    strategy = phalanx.resolve("horovod", accelerator="cpu", devices=2, collective="torch")
    assert type(strategy.collective).__name__ == "TorchCollective"
    with pytest.raises(MisconfigurationError, match=r"op='adasum' and collective 'torch'"):
        phalanx.resolve("horovod", accelerator="cpu", devices=2, collective="torch", op="adasum")
