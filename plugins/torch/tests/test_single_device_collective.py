"""The single_device collective meets the Collective contract for a world of one."""

from __future__ import annotations

import pytest
import torch

from phalanx_core import MisconfigurationError, Work
from phalanx_torch.collectives import SingleDeviceCollective
from phalanx_torch.environments import LocalEnvironment


@pytest.fixture
def coll(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    c = SingleDeviceCollective()
    c.setup(LocalEnvironment())
    yield c
    c.teardown()


@pytest.mark.parametrize("op", ["sum", "mean", "min", "max", "product"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_reductions_in_place(coll, op, dtype):
    t = torch.tensor([3, 4], dtype=dtype)
    assert coll.all_reduce(t, op) is t
    assert t.tolist() == [3, 4] and t.dtype is dtype
    assert coll.reduce(t, 0, op) is t


def test_bool_tensors_only_min_and_max(coll):
    t = torch.tensor([True, False])
    assert coll.all_reduce(t, "max") is t
    with pytest.raises(MisconfigurationError, match="only 'min' \\(logical and\\) and 'max'"):
        coll.all_reduce(t, "sum")


def test_gathers_return_new_tensors(coll):
    t = torch.tensor([1.0])
    [g] = coll.all_gather(t)
    assert torch.equal(g, t) and g is not t
    [g] = coll.gather(t)
    assert g is not t
    r = coll.reduce_scatter(torch.tensor([1.0, 2.0]))
    assert r.tolist() == [1.0, 2.0]
    [a] = coll.all_to_all([t])
    assert a is not t


def test_broadcast_and_scatter_in_place(coll):
    t = torch.zeros(2)
    assert coll.broadcast(t, 0) is t
    assert coll.scatter(t, [torch.ones(2)], 0) is t and t.tolist() == [1.0, 1.0]


def test_async_handles(coll):
    t = torch.ones(1)
    work = coll.all_reduce(t, "sum", async_op=True)
    assert isinstance(work, Work) and work.is_completed()
    assert work.wait() is t
    assert coll.barrier(async_op=True).wait() is None
    assert len(coll.all_gather(t, async_op=True).wait()) == 1


def test_objects(coll):
    assert coll.broadcast_object({"a": 1}) == {"a": 1}
    assert coll.all_gather_object(3) == [3]
    assert coll.gather_object(3) == [3]
    assert coll.scatter_object(["x"]) == "x"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda c: c.broadcast(torch.ones(1), 1), r"broadcast\(src=1\): the ranks of this group are 0..0"),
        (lambda c: c.all_reduce(torch.ones(1), "avg"), r"op='avg' is not a reduce op"),
        (lambda c: c.scatter(torch.ones(1), None), r"gives scatter_list, one tensor per rank"),
        (lambda c: c.send(torch.ones(1), 0), r"send\(dst=0\): .* world of one"),
        (lambda c: c.recv(torch.ones(1), 0), r"recv\(src=0\): .* world of one"),
        (lambda c: c.all_to_all([]), r"one tensor per rank"),
        (lambda c: c.scatter_object(None), r"one object per rank"),
        (lambda c: c.new_group([0, 1]), r"the only group is \[0\]"),
    ],
)
def test_bad_arguments_are_refused_by_name(coll, call, match):
    with pytest.raises(MisconfigurationError, match=match):
        call(coll)


def test_subgroup_of_the_only_rank(coll):
    group = coll.new_group([0])
    assert group.is_member and group.rank == 0 and group.world_size == 1
    t = torch.ones(1)
    assert group.all_reduce(t) is t


def test_setup_refuses_a_bigger_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(MisconfigurationError, match="world_size=2; use a collective for several processes"):
        SingleDeviceCollective().setup(LocalEnvironment())


def test_bad_environment_variable_is_named(monkeypatch):
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(MisconfigurationError, match="environment variable RANK='zero' is not an integer"):
        LocalEnvironment().global_rank


def test_the_shared_contract(coll):
    from phalanx_core.testing.contract import CHECKS, check_collective

    assert check_collective(coll) == list(CHECKS)
