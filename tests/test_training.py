"""A name becomes a working strategy: train a small model end to end on CPU."""

from __future__ import annotations

import functools
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx_core import MisconfigurationError

ROOT = Path(__file__).resolve().parents[1]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def batch():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    return {"x": x, "y": (x.sum(dim=1, keepdim=True) > 0).float()}


def fit(strategy, steps):
    model = make_model()
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    data = strategy.batch_to_device(batch())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with strategy.forward_context():
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(data["x"]), data["y"])
        strategy.backward(loss)
        strategy.clip_gradients(model, optimizer, max_norm=10.0)
        strategy.optimizer_step(optimizer)
        losses.append(loss.item())
    assert strategy.collective.is_initialized
    reduced = strategy.all_reduce(torch.tensor([losses[-1]]), op="mean")
    return losses, reduced.item(), model


def test_single_device_trains_and_the_loss_goes_down():
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    [(losses, reduced, model)] = strategy.launch(fit, 40)
    assert losses[-1] < 0.6 * losses[0]
    assert reduced == pytest.approx(losses[-1])
    assert next(model.parameters()).device.type == "cpu"
    assert not strategy.collective.is_initialized  # torn down after launch


def test_checkpoint_round_trip(tmp_path):
    strategy = phalanx.resolve("single_device", accelerator="cpu")

    def save_and_load(strategy):
        model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.Adam, lr=0.01))
        strategy.backward(model(torch.ones(2, 4)).sum())
        strategy.optimizer_step(optimizer)
        strategy.save_checkpoint(
            tmp_path / "ckpt" / "last.pt", {"model": model, "optimizer": optimizer, "step": 7}
        )
        fresh, fresh_opt = strategy.setup(
            torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)),
            functools.partial(torch.optim.Adam, lr=0.01),
        )
        rest = strategy.load_checkpoint(
            tmp_path / "ckpt" / "last.pt", {"model": fresh, "optimizer": fresh_opt}
        )
        same = all(
            torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
        )
        with pytest.raises(MisconfigurationError, match=r"the file has no 'scheduler'"):
            strategy.load_checkpoint(tmp_path / "ckpt" / "last.pt", {"scheduler": fresh_opt})
        partial = strategy.load_checkpoint(
            tmp_path / "ckpt" / "last.pt", {"scheduler": fresh_opt}, strict=False
        )
        with pytest.raises(FileNotFoundError, match="no checkpoint file at"):
            strategy.load_checkpoint(tmp_path / "missing.pt")
        return same, rest, sorted(partial)

    [(same, rest, partial)] = strategy.launch(save_and_load)
    assert same
    assert rest == {"step": 7}
    assert partial == ["model", "optimizer", "step"]
    assert not list((tmp_path / "ckpt").glob("*.partial"))


def test_strategy_api_without_launch():
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    strategy.setup_environment()
    try:
        assert strategy.global_rank == 0 and strategy.local_rank == 0 and strategy.node_rank == 0
        moved = strategy.batch_to_device([torch.zeros(1), (torch.ones(1), "label"), {"k": 3}])
        assert moved[1][1] == "label" and moved[2] == {"k": 3}
        assert strategy.broadcast_object({"a": 1}) == {"a": 1}
        assert strategy.all_gather_object(5) == [5]
        assert [t.item() for t in strategy.all_gather(torch.tensor(2))] == [2]
        with strategy.module_init_context():
            layer = torch.nn.Linear(2, 2)
        assert layer.weight.device.type == "cpu"
        with strategy.no_backward_sync(layer):
            pass
        with pytest.raises(MisconfigurationError, match="exactly one of max_norm"):
            strategy.clip_gradients(layer, None)
    finally:
        strategy.teardown()


def test_an_exception_in_fn_reaches_the_caller_and_tears_down():
    strategy = phalanx.resolve("single_device", accelerator="cpu")

    def boom(strategy):
        raise KeyError("from the user's function")

    with pytest.raises(KeyError, match="from the user's function"):
        strategy.launch(boom)
    assert not strategy.collective.is_initialized


def test_the_example_script_trains(capsys):
    module = runpy.run_path(str(ROOT / "examples" / "train.py"))
    [result] = module["main"](["--strategy", "single_device", "--steps", "30"])
    assert result["last"] < result["first"]
    assert "loss" in capsys.readouterr().out


@pytest.mark.subprocess
def test_the_example_script_as_a_program():
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train.py"), "--steps", "20"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "loss" in out.stdout and "after 20 steps" in out.stdout
