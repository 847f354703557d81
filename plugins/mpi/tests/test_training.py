"""Training with MPI: DDP over the mpi collective on 2 ranks, from a plain
python process (the mpirun launcher) and under mpirun itself; the manual
strategy's example with its hand-sharded head over MPI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from phalanx_core.testing.processes import run_tagged

ROOT = Path(__file__).resolve().parents[3]


def run(command, timeout=180):
    root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    done = run_tagged(command, timeout=timeout, cwd=ROOT, **root)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def losses(line):
    first, last = (float(x) for x in line.split("loss ")[1].split(" after")[0].split(" -> "))
    return first, last


def test_ddp_over_mpi_through_the_mpirun_launcher():
    out = run([sys.executable, "examples/train.py", "--strategy", "ddp", "--devices", "2", "--collective", "mpi",
               "--launcher", "mpirun", "--steps", "30"])  # fmt: skip
    first, last = losses(next(line for line in out.splitlines() if "loss" in line))
    assert last < 0.5 * first


def test_ddp_over_mpi_under_mpirun():
    mpirun = ["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        mpirun.append("--allow-run-as-root")
    out = run([*mpirun, sys.executable, "examples/train.py", "--strategy", "ddp", "--devices", "2",
               "--collective", "mpi", "--steps", "30"])  # fmt: skip
    [line] = [line for line in out.splitlines() if "loss" in line]  # rank 0 prints
    first, last = losses(line)
    assert last < 0.5 * first


def test_the_manual_example_with_its_head_sharded_over_mpi():
    out = run([sys.executable, "examples/manual_parallel.py", "--devices", "2", "--collective", "mpi",
               "--launcher", "mpirun", "--steps", "30"])  # fmt: skip
    [line] = out.splitlines()
    first, last = losses(line)
    assert last < 0.3 * first and line.endswith("on 2 rank(s)")
