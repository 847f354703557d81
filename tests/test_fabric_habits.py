"""What Fabric users pass to the strategy's collective methods: any
picklable object to ``broadcast``, dicts / lists / tuples of tensors to
``all_reduce`` and ``all_gather``; anything else is a phalanx error naming
where it is and the call that takes it. Using the strategy before it is set
up says to call ``launch`` first, not torch's "Default process group has not
been initialized"."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch

import phalanx
from phalanx_core import MisconfigurationError

pytestmark = pytest.mark.subprocess

Pair = namedtuple("Pair", ["first", "second"])


def exchange(strategy):
    r = strategy.global_rank
    out = {}
    out["object"] = strategy.broadcast({"from": r, "items": [r, "x"]}, src=1)
    out["number"] = strategy.broadcast(10 + r, src=0)
    t = torch.full((2,), float(r))
    out["tensor_in_place"] = strategy.broadcast(t, src=1) is t and t.tolist() == [1.0, 1.0]
    reduced = strategy.all_reduce(
        OrderedDict(a=torch.tensor([1.0 + r]), b=[torch.tensor(2.0), (torch.tensor(r),)]), op="sum"
    )
    out["reduced_type"] = type(reduced).__name__
    out["reduced"] = [reduced["a"].tolist(), reduced["b"][0].item(), reduced["b"][1][0].item()]
    gathered = strategy.all_gather(Pair(torch.tensor(r), {"k": torch.tensor([r, r])}))
    out["gathered_type"] = type(gathered).__name__
    out["gathered"] = [[t.item() for t in gathered.first], [t.tolist() for t in gathered.second["k"]]]
    errors = []
    for call in (
        lambda: strategy.all_reduce({"loss": 0.5}),
        lambda: strategy.all_gather([torch.tensor(1), "label"]),
        lambda: strategy.all_reduce([torch.tensor(1.0)], async_op=True),
    ):
        try:
            call()
        except MisconfigurationError as exc:
            errors.append(str(exc))
    out["errors"] = errors
    return out


def test_what_fabric_users_pass_to_the_collective_methods():
    results = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2).launch(exchange)
    for out in results:
        assert out["object"] == {"from": 1, "items": [1, "x"]}
        assert out["number"] == 10
        assert out["tensor_in_place"]
        assert out["reduced_type"] == "OrderedDict"
        assert out["reduced"] == [[3.0], 4.0, 1.0]
        assert out["gathered_type"] == "Pair"
        assert out["gathered"] == [[0, 1], [[0, 0], [1, 1]]]
        first, second, third = out["errors"]
        assert "strategy.all_reduce() takes a tensor, or a dict, list or tuple of tensors" in first
        assert "data['loss'] is a float" in first and "torch.tensor(x)" in first
        assert "data[1] is a str" in second and "all_gather_object" in second
        assert "all_reduce(async_op=True) takes one tensor, got a list" in third


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.barrier(),
        lambda s: s.all_reduce(torch.ones(1)),
        lambda s: s.broadcast({"from": 0}),
        lambda s: s.all_gather(torch.ones(1)),
        lambda s: s.broadcast_object(1),
    ],
    ids=["barrier", "all_reduce", "broadcast", "all_gather", "broadcast_object"],
)
def test_the_strategy_before_launch_says_to_launch_first(call):
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2)
    with pytest.raises(MisconfigurationError, match=r"before the strategy was set up.*strategy\.launch\(fn"):
        call(strategy)


def test_launch_without_a_function_sets_up_one_process_in_place_once():
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    assert strategy.launch() is None
    assert strategy.collective.is_initialized and strategy.world_size == 1
    with pytest.raises(MisconfigurationError, match=r"launch\(\) was called already in this process"):
        strategy.launch()
    strategy._teardown_at_exit()
    with pytest.raises(MisconfigurationError, match=r"got arguments but no function"):
        strategy.launch(None, 1)


def test_a_call_that_needs_the_group_before_launch_says_to_call_launch():
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2)
    with pytest.raises(MisconfigurationError, match=r"call strategy.launch\(\) first \(in a flat script\)"):
        strategy.setup(torch.nn.Linear(2, 2))
    with pytest.raises(MisconfigurationError, match=r"Call strategy.launch\(\) first"):
        strategy.barrier()
