"""OpenMPI's mpirun starts two processes; phalanx detects ``mpi`` from the
variables mpirun sets (no mpi4py), runs in them (launcher ``in_process``)
and the torch collective meets the contract over gloo.

Collected only by ``nox -s mpi`` (``PHALANX_REAL_RUNS=mpi``), which installs
OpenMPI; without mpirun these tests fail, they never skip.
"""

from __future__ import annotations

import shutil
import sys

import pytest

pytestmark = pytest.mark.subprocess

SCRIPT = "tests/real/collective_run.py"


def test_mpirun_two_processes(real_run, check_results):
    assert shutil.which("mpirun"), "mpirun not found; install OpenMPI: apt-get install -y openmpi-bin"
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, SCRIPT]
    job = real_run(command, timeout=240)
    results = check_results(job, ranks=2, environment="mpi")
    assert {r["scheduler"] for r in results} == {"mpi"}
    # hashed from the job's PMIx namespace into 20000-29999, the same on both ranks
    assert 20000 <= results[0]["main_port"] < 30000


def test_ddp_ft_under_mpirun_restarts_a_killed_group_while_the_other_trains(job_env, tmp_path):
    # mpirun starts one phalanx run per node (here one), which runs launcher
    # replica_groups there; a killed group is restarted by phalanx run alone.
    from ft_job import Job, kill_one_of_two_groups_and_check_it_heals

    mpirun = ["mpirun", "--allow-run-as-root", "-np", "1", "--map-by", "ppr:1:node"]
    job = Job(
        tmp_path, "--devices", "1", "--replica-groups", "2", "--max-restarts", "1",
        park_at=6, launch=mpirun, env=job_env(),
    )  # fmt: skip
    kill_one_of_two_groups_and_check_it_heals(job, park_at=6)
