"""Every torch strategy trains to the weights plain torch DDP trains to, and
a checkpoint written under one strategy resumes under another.

Each run is tests/equivalence_run.py as a program (the ``subprocess``
launcher of ``ddp``, ``fsdp`` and ``manual`` re-runs the script in each
rank): two CPU ranks over gloo, the same seeds, the same global batch split
between the ranks, SGD with momentum and weight decay. The reference is
plain ``torch.multiprocessing.spawn`` + ``DistributedDataParallel``.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from phalanx_core.testing.processes import scheduler_free_environment

pytestmark = pytest.mark.subprocess

SCRIPT = Path(__file__).resolve().parent / "equivalence_run.py"
STEPS = 4


def initial_weights() -> dict[str, torch.Tensor]:
    spec = importlib.util.spec_from_file_location("equivalence_run", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.make_model().state_dict()


def run(strategy: str, out: Path, *options: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), strategy, str(out), "--steps", str(steps), *options],
        capture_output=True,
        text=True,
        timeout=240,
        env=scheduler_free_environment(),
        cwd=out.parent,
    )
    assert done.returncode == 0, f"{strategy} {options}: exit {done.returncode}\n{done.stderr[-6000:]}"
    return torch.load(out, weights_only=True)


def assert_same_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def plain_weights(tmp_path_factory) -> dict[int, dict[str, torch.Tensor]]:
    """Plain torch DDP after STEPS and after 6 steps, computed once for the module."""
    folder = tmp_path_factory.mktemp("plain")
    return {steps: run("plain", folder / f"plain-{steps}.pt", steps=steps) for steps in (STEPS, 6)}


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "ddp_fork", "fsdp", "manual", "single_device"])
def test_the_same_weights_as_plain_ddp(strategy, plain_weights, tmp_path):
    expected = plain_weights[STEPS]
    initial = initial_weights()
    assert all(not torch.equal(initial[k], expected[k]) for k in expected)  # training moved them
    assert_same_weights(run(strategy, tmp_path / "trained.pt"), expected)


def test_a_checkpoint_resumes_under_other_strategies(plain_weights, tmp_path):
    # 2 steps under ddp (one file from rank 0), 2 more under fsdp loading it
    # and writing one full file, 2 more under single_device loading that:
    # the weights of 6 uninterrupted steps (momentum buffers included).
    run("ddp", tmp_path / "a.pt", "--save", str(tmp_path / "ddp.pt"), steps=2)
    run("fsdp", tmp_path / "b.pt", "--load", str(tmp_path / "ddp.pt"), "--save", str(tmp_path / "fsdp.pt"),
        "--full", steps=2)  # fmt: skip
    resumed = run("single_device", tmp_path / "c.pt", "--load", str(tmp_path / "fsdp.pt"), steps=2)
    assert_same_weights(resumed, plain_weights[6])


def test_manual_per_rank_files_resume_under_ddp(plain_weights, tmp_path):
    # manual saves one file per rank; the model the user wrapped in DDP is
    # saved unwrapped, so a rank's file loads under ddp_spawn.
    run("manual", tmp_path / "a.pt", "--save", str(tmp_path / "manual"), steps=3)
    assert sorted(p.name for p in (tmp_path / "manual").iterdir()) == [
        ".complete",
        "rank-00000.pt",
        "rank-00001.pt",
    ]
    saved = torch.load(tmp_path / "manual" / "rank-00001.pt", weights_only=True)
    assert sorted(saved["model"]) == sorted(plain_weights[6])  # no "module." prefix
    resumed = run(
        "ddp_spawn", tmp_path / "b.pt", "--load", str(tmp_path / "manual" / "rank-00001.pt"), steps=3
    )
    assert_same_weights(resumed, plain_weights[6])


def test_a_checkpoint_of_another_model_is_refused_with_the_keys(tmp_path):
    torch.save({"model": {"weight": torch.zeros(2, 6)}, "optimizer": {}}, tmp_path / "other.pt")
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "ddp_spawn",
            str(tmp_path / "x.pt"),
            "--load",
            str(tmp_path / "other.pt"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=scheduler_free_environment(),
    )
    assert done.returncode != 0
    assert "MisconfigurationError: load_checkpoint(" in done.stderr
    assert "the module under 'model' does not match the checkpoint" in done.stderr
    assert "missing from the checkpoint: ['0.bias', '0.weight'" in done.stderr
    assert "in the checkpoint, not in the module: ['weight']" in done.stderr
