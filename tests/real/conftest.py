"""Real runs of tests/real/collective_run.py under torchrun, srun and mpirun.

test_torchrun.py runs in every ``tests`` session. test_slurm.py and
test_mpi.py need Slurm daemons or OpenMPI installed, so they are collected
only in their own nox sessions (``nox -s slurm``, ``nox -s mpi``), which
install what they need and set ``PHALANX_REAL_RUNS=slurm`` (or ``mpi``);
there a missing ``srun`` / ``mpirun`` fails, never skips.

The ``real_run`` fixture starts a command with a timeout, in its own
process group, with a tag in its environment that every process of the job
inherits (torchrun's workers, srun's tasks under slurmstepd, mpirun's
ranks). After the command, any process still carrying the tag is left
behind: it is killed by pid and the test fails.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from phalanx_core.testing.processes import TAG_VAR, new_tag, reap, scheduler_free_environment

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "collective_run.py"
MARKER = "PHALANX_RESULT "

_ONLY_IN_THEIR_SESSION = {
    "slurm": "test_slurm.py",
    "mpi": "test_mpi.py",
    "torch_below": "test_torch_below.py",
}
_asked = {name.strip() for name in os.environ.get("PHALANX_REAL_RUNS", "").split(",")}
collect_ignore = [file for name, file in _ONLY_IN_THEIR_SESSION.items() if name not in _asked]


def clean_environment(**extra: str) -> dict[str, str]:
    return scheduler_free_environment(**extra)


@dataclass
class Job:
    command: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def results(self) -> list[dict]:
        """The ``PHALANX_RESULT`` lines, one per rank, sorted by rank."""
        lines = [line[len(MARKER) :] for line in self.stdout.splitlines() if line.startswith(MARKER)]
        return sorted((json.loads(line) for line in lines), key=lambda r: r["rank"])

    def describe(self) -> str:
        return (
            f"$ {' '.join(self.command)}\nexit code {self.returncode}\n"
            f"--- stdout\n{self.stdout[-6000:]}\n--- stderr\n{self.stderr[-6000:]}"
        )


def _kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # its own group: start_new_session


def run_job(command: list[str], *, timeout: float, env: dict[str, str] | None = None) -> Job:
    """Run ``command`` bounded by ``timeout``; fail the test if it runs over
    or leaves a process behind (those are killed by pid first)."""
    tag = new_tag()
    env = {**(env if env is not None else clean_environment()), TAG_VAR: tag}
    process = subprocess.Popen(
        command, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        exited = process.poll() is not None
        _kill_group(process)
        left = reap(tag, grace=0)  # they may hold the output pipes open
        stdout, stderr = process.communicate(timeout=30)
        job = Job(command, process.returncode, stdout, stderr)
        what = "its output was still open (held by a process left behind)" if exited else "still running"
        pytest.fail(f"{what} after {timeout} s; killed the job's group and {left}\n{job.describe()}")
    finally:
        if process.poll() is None:  # an exception other than the timeout
            _kill_group(process)
            process.wait(timeout=30)
    job = Job(command, process.returncode, stdout, stderr)
    left = reap(tag)
    assert not left, f"processes left behind (killed now): {left}\n{job.describe()}"
    return job


def check_collective_results(job: Job, *, ranks: int, environment: str) -> list[dict]:
    """Every rank ran the contract and the DDP step, with the environment
    the registry should have detected and the ``in_process`` launcher."""
    assert job.returncode == 0, job.describe()
    results = job.results
    assert [r["rank"] for r in results] == list(range(ranks)), job.describe()
    for r in results:
        assert r["environment"] == environment, r
        assert r["environment_reason"].startswith("detected"), r
        assert r["launcher"] == "in_process", r
        assert r["launcher_reason"] == f"environment {environment!r} already started one process per rank"
        assert (r["world_size"], r["local_rank"], r["node_rank"]) == (ranks, r["rank"], 0), r
        assert r["collective"] == "torch" and r["backend"] == "gloo", r
        assert r["main_address"] == "127.0.0.1", r
        assert r["ddp_grad"] == [float(ranks + 1)] * 4, r
        assert {"all_reduce", "broadcast", "all_gather", "barrier", "objects"} <= set(r["checks"]), r
    assert len({r["main_port"] for r in results}) == 1, "the ranks disagree on the port"
    assert len({r["pid"] for r in results}) == ranks, "the ranks are not separate processes"
    return results


# Fixtures, since test modules cannot import this conftest under --import-mode=importlib.


@pytest.fixture
def real_run():
    """:func:`run_job`: run a job bounded in time, checked for leftovers."""
    return run_job


@pytest.fixture
def job_env():
    """:func:`clean_environment`: this environment without any scheduler's variables."""
    return clean_environment


@pytest.fixture
def check_results():
    """:func:`check_collective_results`."""
    return check_collective_results
