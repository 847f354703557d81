"""phalanx-xla's parts on torch_xla's CPU runtime (2 replicas, threads of
one process), beyond the conformance suites: ranks from torch_xla.runtime,
what the collective refuses, gradient averaging and its pause, checkpoints,
the precisions, and the launching process that never starts the runtime."""

from __future__ import annotations

import functools
from typing import Any

import pytest

import phalanx
from phalanx.testing.suites import _bounded
from phalanx_core import MisconfigurationError, UnavailableError

pytestmark = pytest.mark.subprocess

GUARD = 180.0


def xla(strategy: str = "xla", devices: int = 2, **flags: Any) -> Any:
    return phalanx.resolve(strategy, accelerator="xla", devices=devices, **flags)


# -- functions the replicas run ------------------------------------------------


def ranks(strategy: Any) -> dict[str, Any]:
    import torch_xla.runtime as xr

    env = strategy.environment
    return {
        "env": (env.global_rank, env.world_size, env.local_rank, env.node_rank),
        "xr": (xr.global_ordinal(), xr.world_size(), xr.local_ordinal(), xr.host_index()),
        "device": str(strategy.root_device),
        "collective": (strategy.collective.rank, strategy.collective.world_size),
    }


def refusals(strategy: Any) -> list[str]:
    import torch

    said = []
    for call in (
        lambda: strategy.collective.new_group([0]),
        lambda: strategy.collective.send(torch.zeros(1), 1 - strategy.global_rank),
    ):
        try:
            call()
        except UnavailableError as exc:
            said.append(str(exc))
    strategy.barrier()
    return said


def gradients(strategy: Any, accumulate: bool) -> dict[str, Any]:
    """Each replica's own data; the gradient after backward, then after a
    second backward inside no_backward_sync (accumulating locally)."""
    import torch

    torch.manual_seed(strategy.global_rank)  # different weights: setup makes them rank 0's
    model = strategy.setup(torch.nn.Linear(2, 1, bias=False))
    x = torch.full((1, 2), float(strategy.global_rank + 1), device=strategy.root_device)
    strategy.backward(model(x).sum())
    averaged = model.weight.grad.cpu().tolist()
    local = None
    if accumulate:
        with strategy.no_backward_sync(model):
            strategy.backward(model(x).sum())
        local = model.weight.grad.cpu().tolist()
    return {"weight": model.weight.detach().cpu().tolist(), "averaged": averaged, "local": local}


def checkpoint(strategy: Any, path: str) -> list[float]:
    import torch

    torch.manual_seed(0)
    model, optimizer = strategy.setup(torch.nn.Linear(2, 1), functools.partial(torch.optim.SGD, lr=0.1))
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer, "step": 3})
    with torch.no_grad():
        model.weight.zero_()
    rest = strategy.load_checkpoint(path, {"model": model, "optimizer": optimizer})
    assert rest == {"step": 3}, rest
    return model.weight.detach().cpu().flatten().tolist()


def dtype_of_parameters(strategy: Any) -> str:
    import torch

    model = strategy.setup(torch.nn.Linear(2, 1))
    return str(next(model.parameters()).dtype)


# -- the tests -------------------------------------------------------------------


def test_ranks_come_from_torch_xla_runtime_in_each_replica():
    with _bounded(GUARD):
        results = xla().launch(ranks)
    assert [r["env"] for r in results] == [(0, 2, 0, 0), (1, 2, 1, 0)]
    assert [r["env"] for r in results] == [r["xr"] for r in results]
    assert [r["device"] for r in results] == ["xla:0", "xla:1"]
    assert [r["collective"] for r in results] == [(0, 2), (1, 2)]


def test_ranks_outside_a_replica_are_refused_without_starting_the_runtime():
    import torch_xla

    strategy = xla()
    with pytest.raises(MisconfigurationError, match=r"global_rank.*inside strategy.launch"):
        strategy.global_rank
    assert not torch_xla._XLAC._xla_runtime_is_initialized()
    assert not strategy.environment.detect()


def test_the_launching_process_can_launch_again():
    import torch_xla

    with _bounded(GUARD):
        first = xla().launch(ranks)
        second = xla(devices=1).launch(ranks)
        third = xla().launch(ranks)
    assert [r["env"] for r in first] == [r["env"] for r in third]
    assert [r["env"] for r in second] == [(0, 1, 0, 0)]
    assert not torch_xla._XLAC._xla_runtime_is_initialized()


def test_subgroups_and_point_to_point_are_refused_naming_the_operation():
    with _bounded(GUARD):
        results = xla().launch(refusals)
    for said in results:
        assert len(said) == 2, said
        assert "new_group([0])" in said[0] and "every rank, [0, 1]" in said[0]
        assert "send()" in said[1] and "'xla' collective" in said[1]


def test_backward_averages_gradients_and_no_backward_sync_keeps_them_local():
    with _bounded(GUARD):
        results = xla().launch(gradients, True)
    first, second = results
    assert first["weight"] == second["weight"], "setup makes every replica start from rank 0's weights"
    # d(sum(w . x))/dw = x: replicas have x = 1 and 2, so the average is 1.5
    assert first["averaged"] == second["averaged"] == [[1.5, 1.5]]
    # then a local backward adds each replica's own x
    assert first["local"] == [[2.5, 2.5]] and second["local"] == [[3.5, 3.5]]


def test_a_checkpoint_saved_by_rank_0_loads_on_every_replica(tmp_path):
    with _bounded(GUARD):
        results = xla().launch(checkpoint, str(tmp_path / "ckpt.pt"))
    assert results[0] == results[1] and any(v != 0.0 for v in results[0])


@pytest.mark.parametrize(
    ("precision", "dtype"), [("32-true", "torch.float32"), ("bf16-true", "torch.bfloat16")]
)
def test_the_precisions_xla_runs(precision, dtype):
    with _bounded(GUARD):
        assert xla("xla_single", devices=1, precision=precision).launch(dtype_of_parameters) == [dtype]


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed", "64-true", "16-true"])
def test_other_precisions_are_refused_with_what_to_use(precision):
    with pytest.raises(MisconfigurationError, match=r"use precision='bf16-true' or '32-true'"):
        xla(precision=precision)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"strategy": "xla_single", "devices": 2}, r"runs on one device"),
        ({"strategy": "xla", "devices": [1]}, r"devices=1 or devices=2"),
        ({"strategy": "xla", "num_nodes": 2}, r"num_nodes"),
        ({"strategy": "xla", "accelerator": "cpu"}, r"works with accelerator\(s\) xla"),
        ({"strategy": "xla", "launcher": "spawn"}, r"collective 'xla' with launcher"),
    ],
)
def test_bad_flags_are_refused_when_resolving(flags, message):
    flags = {"accelerator": "xla", "devices": 2, **flags}
    with pytest.raises(MisconfigurationError, match=message):
        phalanx.resolve(flags.pop("strategy"), **flags)


def test_auto_chooses_xla_and_its_strategy_where_pjrt_device_is_set():
    plan = phalanx.Registry().plan("auto", devices=2)
    assert (plan.accelerator.name, plan.strategy.name) == ("xla", "xla"), plan.explain()
    assert (plan.environment.name, plan.launcher.name, plan.collective.name) == ("xla", "xla", "xla")


def test_a_collective_other_than_xla_is_refused_when_resolving():
    # The gradients would go through xm.all_reduce whatever was named.
    with pytest.raises(
        MisconfigurationError, match=r"strategy 'xla' with collective 'torch'.*xm\.all_reduce"
    ):
        xla(collective="torch")
