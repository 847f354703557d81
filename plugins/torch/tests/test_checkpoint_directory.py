"""A directory of numbered checkpoints (``CheckpointDirectory``) with real
saves, and background saves killed at random points: what a kill leaves
always loads, and what it leaves behind is cleared."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import phalanx
from phalanx_core import CheckpointDirectory, MisconfigurationError
from phalanx_core.checkpoint import HOST
from phalanx_core.testing.processes import as_a_terminal_starts_it, scheduler_free_environment
from phalanx_torch.checkpoint_io import TorchDistributedCheckpointIO

pytestmark = pytest.mark.subprocess

SCRIPT = Path(__file__).parent / "launch_scripts" / "background_saves.py"


def numbered_saves(strategy, root: str, keep: int, blocking: bool):
    checkpoints = CheckpointDirectory(root, keep=keep)
    assert checkpoints.latest() is None
    model = strategy.setup(nn.Linear(3, 3))
    for step in range(1, 6):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(step))
        checkpoints.save(strategy, step, {"model": model, "step": step}, blocking=blocking)
    strategy.load_checkpoint(checkpoints.latest(), {"model": model})  # waits for the save in flight
    return checkpoints.latest_step(), [p.name for _, p in checkpoints.checkpoints()]


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
@pytest.mark.parametrize("kind", ["single_device", "fsdp"])
def test_the_newest_k_are_kept_and_the_latest_found(tmp_path, kind, blocking):
    if kind == "single_device":
        strategy = phalanx.resolve("single_device", accelerator="cpu")
    else:
        strategy = phalanx.resolve("fsdp", accelerator="cpu", devices=2, launcher="fork", timeout=60)
    for latest, names in strategy.launch(numbered_saves, str(tmp_path), 2, blocking):
        assert latest == 5
        assert names == ["step-00000004", "step-00000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_what_killed_saves_left_is_cleared_and_nothing_else(tmp_path):
    checkpoints = CheckpointDirectory(tmp_path, keep=None)
    dead = _dead_pid()
    (tmp_path / "step-00000001").write_bytes(b"x")
    (tmp_path / "step-00000002").mkdir()  # a sharded save's folder with no .metadata: not complete
    leftovers = [
        tmp_path / f"step-00000003.{HOST}-{dead}-0123abcd.partial",
        tmp_path / "step-00000004.otherhost-7-0123abcd.partial",
        tmp_path / "step-00000001.previous",  # the new one is there
    ]
    for leftover in leftovers:
        leftover.write_bytes(b"x")
    (tmp_path / "step-00000005.partial").mkdir()  # a sharded save's staging folder
    (tmp_path / "step-00000005.partial" / "__0_0.distcp").write_bytes(b"x")
    kept = [
        tmp_path / f"step-00000006.{HOST}-1-0123abcd.partial",  # pid 1 runs: maybe a save in flight
        tmp_path / "step-00000007.previous",  # no step-00000007: this one is the checkpoint
        tmp_path / "notes.txt",
        tmp_path / "other-00000001.partial",
    ]
    for path in kept:
        path.write_bytes(b"x")
    assert checkpoints.latest() == tmp_path / "step-00000001"
    removed = checkpoints.clear_partials()
    assert sorted(removed) == sorted([*leftovers, tmp_path / "step-00000005.partial"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["step-00000001", "step-00000002", *(p.name for p in kept)]
    )


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"keep": 0}, r"keep=0\): give how many complete checkpoints to keep \(1 or more\)"),
        ({"keep": True}, r"keep=True\)"),
        ({"prefix": "a/b"}, r"prefix='a/b'\): give a file-name prefix"),
        ({"prefix": ".hidden"}, r"not starting with '.'"),
    ],
)
def test_bad_arguments_say_what_to_give(tmp_path, arguments, message):
    with pytest.raises(MisconfigurationError, match=message):
        CheckpointDirectory(tmp_path, **arguments)
    with pytest.raises(MisconfigurationError, match=r"CheckpointDirectory\(3\): give the directory's path"):
        CheckpointDirectory(3)  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"a step is an int, 0 or more"):
        CheckpointDirectory(tmp_path).path(-1)


def _check_whole(path: Path) -> int:
    """Load the checkpoint at ``path``; check it is one save's (every weight
    and ``i`` agree); return ``i``."""
    state = TorchDistributedCheckpointIO().load(path)
    weights = next(iter(state["model"].values()))
    assert torch.all(weights == float(state["i"])), f"a mixed checkpoint at {path}"
    return state["i"]


@pytest.mark.parametrize(("kind", "megabytes"), [("file", 12), ("sharded", 12)])
def test_a_background_save_killed_at_random_points_leaves_a_loadable_checkpoint(tmp_path, kind, megabytes):
    rng = random.Random(20261125)
    path = tmp_path / "ckpt"
    landed = {"while a save was being written": 0, "between saves": 0}
    seen = []
    for _ in range(20):
        process = subprocess.Popen(
            [sys.executable, str(SCRIPT), kind, str(path), str(megabytes)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=scheduler_free_environment(),
            text=True,
            start_new_session=True,
            preexec_fn=as_a_terminal_starts_it,
        )
        try:
            assert process.stdout is not None
            first = process.stdout.readline()  # a save is complete: the path holds one from now on
            assert first.startswith("done "), first
            time.sleep(rng.uniform(0.0, 0.6))
        finally:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
        leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
        assert all(name.endswith((".partial", ".previous")) for name in leftovers), leftovers
        landed["while a save was being written" if leftovers else "between saves"] += 1
        seen.append(_check_whole(path))
    # The kills landed both ways, and each found a later save complete.
    assert landed["while a save was being written"] > 0, landed
    assert len(set(seen)) > 1, seen
    # A save to the same path clears what the killed saves left.
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    if kind == "file":
        strategy.save_checkpoint(path, {"model": nn.Linear(2, 2), "i": -1})
        assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
