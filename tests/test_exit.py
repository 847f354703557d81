"""Every run ends the way it should: a finished job exits 0 every time, a
killed ``phalanx run`` leaves no rank, SIGTERM and SIGINT end the job with
one line and the shell's status.

The loops repeat the README's main job and the ``ddp_spawn`` example,
whose ranks used to die by SIGABRT after their work was done (gloo's
threads during the interpreter's finalization; see
``phalanx_core.launching.exit_process``). ``PHALANX_EXIT_LOOPS`` sets how
many runs each loop makes (default 8; CI's ``tests`` session: 3; 100 to measure).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phalanx_core.testing.processes import (
    TAG_VAR,
    as_a_terminal_starts_it,
    new_tag,
    reap,
    run_tagged,
    scheduler_free_environment,
    tagged_processes,
)

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[1]
LOOPS = int(os.environ.get("PHALANX_EXIT_LOOPS", "8"))
#: A long job: the signals arrive while it trains.
LONG = ["examples/train.py", "--steps", "1000000"]


def phalanx_run(*args: str) -> list[str]:
    return [sys.executable, "-m", "phalanx", "run", "--strategy", "ddp", "--accelerator", "cpu", *args]


def run_tagged_job(command: list[str]) -> subprocess.CompletedProcess[str]:
    return run_tagged(command, timeout=120, cwd=ROOT)


@pytest.mark.parametrize(
    "command",
    [
        phalanx_run("--devices", "2", "examples/train.py", "--steps", "5"),
        [sys.executable, "examples/train.py", "--strategy", "ddp_spawn", "--devices", "2", "--steps", "5"],
    ],
    ids=["phalanx-run-ddp", "ddp_spawn"],
)
def test_a_finished_job_exits_0_every_time(command):
    failed = []
    for attempt in range(LOOPS):
        done = run_tagged_job(command)
        if done.returncode != 0 or "terminate called" in done.stderr:
            failed.append((attempt, done.returncode, done.stderr[-600:]))
        assert "loss 3.4714 -> 1.6842 after 5 steps" in done.stdout
    assert not failed, f"{len(failed)} of {LOOPS} runs failed: {failed}"


class Job:
    """``phalanx run`` of a long training job in its own session (as a
    terminal's job is its own process group), tagged."""

    def __init__(self, devices: int = 2) -> None:
        self.tag = new_tag()
        self.proc = subprocess.Popen(
            phalanx_run("--devices", str(devices), *LONG),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=scheduler_free_environment(**{TAG_VAR: self.tag}),
            start_new_session=True,
            preexec_fn=as_a_terminal_starts_it,  # the test sends SIGINT and SIGTERM
        )

    def ranks(self) -> dict[int, str]:
        return {
            pid: c
            for pid, c in tagged_processes(self.tag).items()
            if "phalanx_torch._launch.rank_program" in c
        }

    def wait_for_ranks(self, count: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.ranks()) < count:
            assert self.proc.poll() is None, self.proc.communicate()
            assert time.monotonic() < deadline, "the ranks did not start within 60 s"
            time.sleep(0.05)
        time.sleep(1.0)  # into training: past imports and the group's set-up

    def finish(self) -> tuple[int, str, str]:
        try:
            out, err = self.proc.communicate(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            assert not reap(self.tag), "processes left behind"
        return self.proc.returncode, out, err


def test_sigkill_of_phalanx_run_takes_its_ranks_with_it():
    job = Job()
    try:
        job.wait_for_ranks(2)
        job.proc.kill()
        job.proc.wait(timeout=30)
        deadline = time.monotonic() + 10
        while job.ranks() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not job.ranks(), "ranks outlived a SIGKILLed phalanx run"
    finally:
        assert not reap(job.tag), "processes left behind"


@pytest.mark.parametrize(
    ("sig", "status", "line"),
    [
        (signal.SIGTERM, 143, "phalanx run: stopped by SIGTERM; every rank was stopped."),
        (signal.SIGINT, 130, "phalanx run: interrupted (SIGINT); every rank was stopped."),
    ],
)
def test_a_signal_ends_every_rank_with_one_line(sig, status, line):
    job = Job()
    job.wait_for_ranks(2)
    if sig == signal.SIGINT:
        os.killpg(job.proc.pid, sig)  # Ctrl-C: the terminal signals the whole job
    else:
        job.proc.send_signal(sig)  # a scheduler stopping the job
    code, _, err = job.finish()
    assert code == status, err
    assert err.strip().splitlines() == [line], err
    assert "Traceback" not in err
