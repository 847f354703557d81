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


FLAT = """\
import sys

import torch
import phalanx

strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, collective="mpi", launcher="mpirun")
strategy.launch()  # python flat.py: mpirun runs this script again in every rank
torch.manual_seed(strategy.global_rank)  # each rank its own initial weights: DDP copies rank 0's
model, optimizer = strategy.setup(torch.nn.Linear(4, 1), lambda ps: torch.optim.SGD(ps, lr=0.1))
for step in range(3):
    optimizer.zero_grad()
    strategy.backward(model(torch.full((2, 4), float(strategy.global_rank + step))).pow(2).mean())
    strategy.optimizer_step(optimizer)
weights = strategy.all_gather(strategy.unwrap_module(model).weight.detach())
same = all(torch.equal(w, weights[0]) for w in weights)
sys.stdout.write(f"rank {strategy.global_rank} same {same}\\n")  # one write: the launcher tags each write
sys.stdout.flush()
"""


def test_a_flat_script_launches_itself_through_mpirun(tmp_path):
    script = tmp_path / "flat.py"
    script.write_text(FLAT)
    out = run([sys.executable, str(script)])
    assert sorted(line.split("rank ", 1)[1] for line in out.splitlines() if "same" in line) == [
        "0 same True",
        "1 same True",
    ]
