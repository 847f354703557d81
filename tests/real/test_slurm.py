"""A one-node Slurm cluster on loopback (tests/real/slurm/start.sh): srun
starts two tasks, phalanx detects ``slurm``, runs in them (launcher
``in_process``) and the torch collective meets the contract over the real
group. A script that runs in the allocation without srun is refused with
what to run.

Collected only by ``nox -s slurm`` (``PHALANX_REAL_RUNS=slurm``), which
installs Slurm; without srun these tests fail, they never skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.subprocess

HERE = Path(__file__).resolve().parent
SCRIPT = "tests/real/collective_run.py"
INSTALL = "apt-get install -y slurmd slurmctld slurm-client munge (nox -s slurm does it)"
PID_FILES = ("slurmd.pid", "slurmctld.pid", "munge/munged.pid")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def slurm_conf():
    """Start munged, slurmctld and slurmd; stop them by pid file afterwards,
    whatever the tests did, and check they are gone."""
    for tool in ("srun", "salloc", "sinfo"):
        assert shutil.which(tool), f"{tool} not found; install Slurm: {INSTALL}"
    # A short path: munged's socket lives under it (sockets paths are limited to 107 bytes).
    folder = Path(tempfile.mkdtemp(prefix="phalanx-slurm-"))
    pids: dict[str, int] = {}
    try:
        start = subprocess.run(
            ["bash", str(HERE / "slurm" / "start.sh"), str(folder)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        for name in PID_FILES:
            if (folder / name).is_file():
                pids[name] = int((folder / name).read_text())
        assert start.returncode == 0, f"start.sh failed:\n{start.stdout}\n{start.stderr}"
        yield folder / "slurm.conf"
    finally:
        stop = subprocess.run(
            ["bash", str(HERE / "slurm" / "stop.sh"), str(folder)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        left = {name: pid for name, pid in pids.items() if _alive(pid)}
        for pid in left.values():
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
        assert stop.returncode == 0, f"stop.sh failed:\n{stop.stdout}\n{stop.stderr}"
        assert not left, f"daemons still running after stop.sh (killed now): {left}"


def test_srun_two_tasks(slurm_conf, real_run, job_env, check_results):
    command = ["srun", "-N1", "-n2", "--kill-on-bad-exit=1", sys.executable, SCRIPT]
    job = real_run(command, env=job_env(SLURM_CONF=str(slurm_conf)), timeout=240)
    results = check_results(job, ranks=2, environment="slurm")
    assert {r["scheduler"] for r in results} == {"slurm"}
    # 10000 + the last four digits of the job id, the same on both tasks
    assert 10000 <= results[0]["main_port"] < 20000


def test_a_script_in_the_allocation_without_srun_is_refused(slurm_conf, real_run, job_env):
    code = (
        "import phalanx\n"
        "plan = phalanx.plan('ddp', accelerator='cpu', devices=2)\n"
        "print('ENVIRONMENT', plan.environment.name, flush=True)\n"
        "try:\n"
        "    phalanx.resolve('ddp', accelerator='cpu', devices=2)\n"
        "except phalanx.MisconfigurationError as exc:\n"
        "    print('REFUSED', exc, flush=True)\n"
    )
    command = ["salloc", "-N1", "-n2", sys.executable, "-c", code]
    job = real_run(command, env=job_env(SLURM_CONF=str(slurm_conf)), timeout=120)
    assert job.returncode == 0, job.describe()
    assert "ENVIRONMENT slurm" in job.stdout, job.describe()
    [refused] = [line for line in job.stdout.splitlines() if line.startswith("REFUSED")]
    assert "inside a Slurm allocation" in refused and "was not started with srun" in refused
    assert "run `srun --nodes=1 --ntasks-per-node=2 python script.py`" in refused


def test_ddp_ft_under_srun_restarts_a_killed_group_on_its_node_while_the_other_trains(
    slurm_conf, job_env, tmp_path
):
    # srun starts one phalanx run per node (here one node), which runs
    # launcher replica_groups there: the lighthouse and this node's groups.
    # A group's rank killed: that group alone is started again, by phalanx
    # run, not by Slurm, and heals from its peer.
    from ft_job import Job, kill_one_of_two_groups_and_check_it_heals

    srun = ["srun", "-N1", "-n1", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    job = Job(
        tmp_path, "--devices", "1", "--replica-groups", "2", "--max-restarts", "1",
        park_at=6, launch=srun, env=job_env(SLURM_CONF=str(slurm_conf)),
    )  # fmt: skip
    kill_one_of_two_groups_and_check_it_heals(job, park_at=6)
