"""Real ``horovodrun --gloo -np 2``: the ranks it starts detect the
``horovod`` environment, run ``fn`` in place (``in_process``, or the
``horovod`` launcher named), pass the whole collective contract, train
with the horovod strategy and with DDP over the horovod collective, leave
a Horovod the user initialised running, and a failing rank ends the job
with nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx_core.testing.contract import CHECKS
from phalanx_core.testing.processes import TAG_VAR, new_tag, reap, scheduler_free_environment

pytestmark = pytest.mark.subprocess

JOB = Path(__file__).parent / "jobs" / "under_horovodrun.py"
HOROVODRUN = str(Path(sys.executable).parent / "horovodrun")


def horovodrun(out: Path, mode: str = "") -> subprocess.CompletedProcess[str]:
    tag = new_tag()
    command = [HOROVODRUN, "--gloo", "-np", "2", "-H", "localhost:2", "--disable-cache"]
    command += [sys.executable, str(JOB), str(out), *([mode] if mode else [])]
    try:
        return subprocess.run(
            command,
            env=scheduler_free_environment(**{TAG_VAR: tag}),
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        left = reap(tag, grace=10)
        assert not left, f"processes left behind (killed now): {left}"


def read(out: Path) -> dict[int, dict]:
    return {int(p.stem): json.loads(p.read_text()) for p in out.glob("*.json")}


@pytest.mark.parametrize("mode", ["", "adopt"])
def test_every_rank_runs_in_place_and_passes(tmp_path, mode):
    done = horovodrun(tmp_path, mode)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = read(tmp_path)
    assert sorted(seen) == [0, 1], done.stdout[-3000:]
    expected_checks = [n for n in CHECKS if n != "send_recv"]
    for rank, s in seen.items():
        assert s["parts"] == {
            "environment": "HorovodEnvironment",
            "launcher": "InProcessLauncher",
            "rank": rank,
            "world_size": 2,
        }
        ran = s["contract"]
        assert [c for c in ran if not c.startswith("refuses:")] == expected_checks, ran
        assert {"refuses:send", "refuses:recv"} <= set(ran)
        first, last, same = s["train"]
        assert last < first and same
        assert s["ddp"][:2] == ["HorovodCollective", "InProcessLauncher"]
        assert s["ddp"][3] < s["ddp"][2] and s["ddp"][4]
        assert s["named_launcher"] == [rank, 2]
        if mode == "adopt":
            assert s["still_initialized"] is True


def test_a_failing_rank_ends_the_job(tmp_path):
    done = horovodrun(tmp_path, "fail")
    assert done.returncode != 0
    assert "raised on purpose in rank 1 under horovodrun" in done.stdout + done.stderr
    assert read(tmp_path) == {}
