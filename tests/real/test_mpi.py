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
