"""Saving checkpoints in the background (``save_checkpoint(...,
blocking=False)``), with real ranks: what is saved is the state at the
call, whatever training does next; one save is in flight at a time; a
failed background write is raised on every rank, never dropped."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx
from phalanx_core import CheckpointSaveError, MisconfigurationError, TorchCheckpointIO, WorkerFailedError

pytestmark = pytest.mark.subprocess

TIMEOUT = 60

STRATEGIES = {
    "single_device": lambda: phalanx.resolve("single_device", accelerator="cpu"),
    "ddp": lambda: phalanx.resolve("ddp_fork", accelerator="cpu", devices=2, timeout=TIMEOUT),
    "fsdp-sharded": lambda: phalanx.resolve(
        "fsdp", accelerator="cpu", devices=2, launcher="fork", timeout=TIMEOUT, state_dict_type="sharded"
    ),
    "fsdp-full": lambda: phalanx.resolve(
        "fsdp", accelerator="cpu", devices=2, launcher="fork", timeout=TIMEOUT, state_dict_type="full"
    ),
    "manual": lambda: phalanx.resolve(
        "manual", accelerator="cpu", devices=2, launcher="fork", timeout=TIMEOUT, checkpoint_per_rank=False
    ),
}


def make(strategy):
    torch.manual_seed(0)
    return strategy.setup(nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 2)), torch.optim.Adam)


def train(strategy, model, optimizer, steps=1):
    x = torch.randn(8, 6)
    for _ in range(steps):
        optimizer.zero_grad()
        strategy.backward(model(x).pow(2).mean())
        strategy.optimizer_step(optimizer)


def whole(strategy, model):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return {
        k: v.detach().clone()
        for k, v in get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)).items()
    }


def save_then_train(strategy, path):
    model, optimizer = make(strategy)
    train(strategy, model, optimizer)
    at_save = whole(strategy, model)
    handle = strategy.save_checkpoint(
        path, {"model": model, "optimizer": optimizer, "step": 1}, blocking=False
    )
    train(strategy, model, optimizer, steps=3)  # changes what was saved, in place, at once
    handle.wait()
    assert handle.done()
    handle.wait()  # again: at once, no collective
    after = whole(strategy, model)
    # A second background save, of the same shapes, into the same staging buffers.
    second = strategy.save_checkpoint(
        str(path) + "-2", {"model": model, "optimizer": optimizer, "step": 4}, blocking=False
    )
    train(strategy, model, optimizer)
    second.wait()
    fresh, fresh_optimizer = make(strategy)
    rest = strategy.load_checkpoint(path, {"model": fresh, "optimizer": fresh_optimizer})
    first = whole(strategy, fresh)
    rest2 = strategy.load_checkpoint(str(path) + "-2", {"model": fresh, "optimizer": fresh_optimizer})
    return (
        rest["step"],
        all(torch.equal(first[k], at_save[k]) for k in at_save),
        rest2["step"],
        all(torch.equal(v, after[k]) for k, v in whole(strategy, fresh).items()),
        any(not torch.equal(after[k], at_save[k]) for k in at_save),
    )


@pytest.mark.parametrize("kind", list(STRATEGIES))
def test_a_background_save_holds_the_state_at_the_call(tmp_path, kind):
    results = STRATEGIES[kind]().launch(save_then_train, str(tmp_path / "ckpt"))
    for rank, (step, same, step2, same2, trained) in enumerate(results):
        assert (step, same, step2, same2, trained) == (1, True, 4, True, True), rank
    assert not [p.name for p in tmp_path.iterdir() if "partial" in p.name or "previous" in p.name]


def fail_in_background(strategy, path, when):
    model, optimizer = make(strategy)
    handle = strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer}, blocking=False)
    train(strategy, model, optimizer)  # training goes on; the failure waits for a sync point
    try:
        if when == "wait":
            handle.wait()
        elif when == "next save":
            strategy.save_checkpoint(path, {"model": model})
        elif when == "load":
            strategy.load_checkpoint(path, {"model": model})
        else:
            return None  # teardown raises it
    except CheckpointSaveError as exc:
        return str(exc), type(exc.__cause__).__name__ if exc.__cause__ else None
    return "nothing raised"


@pytest.mark.parametrize("kind", ["single_device", "ddp", "fsdp-sharded", "fsdp-full"])
@pytest.mark.parametrize("when", ["wait", "next save", "load"])
def test_a_failed_background_write_is_raised_on_every_rank(tmp_path, kind, when):
    (tmp_path / "a-file").write_text("not a directory")
    path = tmp_path / "a-file" / "ckpt"  # the write fails in the background: its parent is a file
    results = STRATEGIES[kind]().launch(fail_in_background, str(path), when)
    for rank, result in enumerate(results):
        assert result != "nothing raised", rank
        message, cause = result
        assert f"the background save of the checkpoint {str(path)!r} failed" in message, rank
        assert "rank 0:" in message and any(
            error in message for error in ("FileExistsError", "NotADirectoryError", "CheckpointException")
        )
        assert "previous one, whole" in message
        writers = {0} if kind in ("single_device", "ddp", "fsdp-full") else {0, 1}
        assert (cause is not None) == (rank in writers), (rank, cause)


def test_a_background_failure_never_waited_for_fails_the_rank_at_teardown(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    path = tmp_path / "a-file" / "ckpt"
    with pytest.raises(WorkerFailedError) as info:
        STRATEGIES["ddp"]().launch(fail_in_background, str(path), "teardown")
    assert info.value.rank == 0
    assert "CheckpointSaveError" in info.value.traceback
    assert "the background save of the checkpoint" in info.value.traceback


class SlowIO(TorchCheckpointIO):
    """A file checkpoint_io that takes its time and records when each write
    starts and ends (a user's own checkpoint_io, on a slow disk)."""

    def __init__(self, events):
        self.events = events

    def save(self, state, path):
        self.events.append(("start", Path(path).name, threading.current_thread().name))
        time.sleep(0.3)
        super().save(state, path)
        self.events.append(("end", Path(path).name, threading.current_thread().name))


def test_one_save_in_flight_a_second_waits_for_the_first(tmp_path):
    events = []
    strategy = phalanx.resolve("single_device", accelerator="cpu", checkpoint_io=SlowIO(events))
    model = nn.Linear(2, 2)
    first = strategy.save_checkpoint(tmp_path / "a", {"model": model}, blocking=False)
    events.append(("returned", "a", threading.current_thread().name))
    assert not first.done()
    second = strategy.save_checkpoint(tmp_path / "b", {"model": model}, blocking=False)
    assert first.done()
    strategy.save_checkpoint(tmp_path / "c", {"model": model})
    assert second.done()
    names = [(what, name) for what, name, _ in events]
    assert names == [
        ("start", "a"), ("returned", "a"), ("end", "a"),
        ("start", "b"), ("end", "b"), ("start", "c"), ("end", "c"),
    ]  # fmt: skip
    assert {thread for what, name, thread in events if name in "ab" and what != "returned"} == {
        "phalanx-checkpoint"
    }
    assert [thread for what, name, thread in events if name == "c"] == ["MainThread", "MainThread"]
    strategy.teardown()


def test_blocking_must_be_a_bool(tmp_path):
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    with pytest.raises(MisconfigurationError, match=r"save_checkpoint\(blocking='no'\): give True"):
        strategy.save_checkpoint(tmp_path / "x", {}, blocking="no")


def test_the_handle_of_a_blocking_save_is_done(tmp_path):
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    handle = strategy.save_checkpoint(tmp_path / "x", {"a": 1})
    assert handle.done() and handle.path == str(tmp_path / "x")
    handle.wait()
    seen = []
    handle.add_done_callback(seen.append)
    assert seen == [handle]
