"""The training example with real horovod on two processes:
``python examples/train.py --strategy horovod --devices 2`` (the ``horovod``
launcher starts the ranks) and the same script started by
``horovodrun --gloo -np 2`` (the ranks run in place)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx_core.testing.processes import TAG_VAR, new_tag, reap, scheduler_free_environment

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[3]
TRAIN = [sys.executable, str(ROOT / "examples" / "train.py"), "--strategy", "horovod", "--devices", "2"]
LOSS = re.compile(r"loss (\d+\.\d+) -> (\d+\.\d+) after (\d+) steps")


def run(command: list[str]) -> str:
    tag = new_tag()
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=scheduler_free_environment(**{TAG_VAR: tag}),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        left = reap(tag, grace=10)
        assert not left, f"processes left behind (killed now): {left}"
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def losses(out: str) -> list[tuple[float, float, int]]:
    return [(float(a), float(b), int(n)) for a, b, n in LOSS.findall(out)]


def test_train_py_with_the_horovod_launcher():
    found = losses(run([*TRAIN, "--steps", "30"]))
    assert len(found) == 1, found  # printed on rank 0 only
    first, last, steps = found[0]
    assert steps == 30 and last < first / 2, found


def test_train_py_under_horovodrun():
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    out = run(
        [horovodrun, "--gloo", "-np", "2", "-H", "localhost:2", "--disable-cache", *TRAIN, "--steps", "30"]
    )
    found = losses(out)
    assert len(found) == 1, out[-3000:]
    first, last, steps = found[0]
    assert steps == 30 and last < first / 2, found


def test_phalanx_run_with_the_horovod_strategy():
    """``phalanx run`` starts the ranks through horovodrun (the launcher's
    run_script); in each, the script's resolve() takes run's flags."""
    run_ = [sys.executable, "-m", "phalanx", "run", "--strategy", "horovod", "--accelerator", "cpu"]
    out = run([*run_, "--devices", "2", str(ROOT / "examples" / "train.py"), "--steps", "30"])
    found = losses(out)
    assert len(found) == 1, out[-3000:]
    first, last, steps = found[0]
    assert steps == 30 and last < first / 2, found
    # Every line of a rank marked as under every launcher (Horovod's own
    # "[0]<stdout>:" tags put back together into whole lines).
    assert "[rank0]: loss " in out and "<stdout>:" not in out, out[-3000:]


def test_phalanx_run_names_the_failing_rank(tmp_path):
    script = tmp_path / "fails.py"
    script.write_text(
        "import phalanx\n"
        "def fn(strategy):\n"
        "    if strategy.global_rank == 1:\n"
        "        raise ValueError('raised on purpose in rank 1')\n"
        "    strategy.barrier()\n"
        "phalanx.resolve().launch(fn)\n"
    )
    tag = new_tag()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "phalanx", "run", "--strategy", "horovod", "--accelerator", "cpu",
             "--devices", "2", str(script)],
            cwd=ROOT,
            env=scheduler_free_environment(**{TAG_VAR: tag}),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )  # fmt: skip
    finally:
        left = reap(tag, grace=10)
        assert not left, f"processes left behind (killed now): {left}"
    assert done.returncode != 0
    assert "raised on purpose in rank 1" in done.stdout + done.stderr
    assert "phalanx run: rank 1 " in done.stderr, done.stderr[-2000:]
