"""torchrun starts two processes; phalanx detects ``torchelastic``, runs in
them (launcher ``in_process``) and the torch collective meets the contract
over the real group."""

from __future__ import annotations

import sys

import pytest

from phalanx_torch.environments import TorchElasticEnvironment

pytestmark = pytest.mark.subprocess

SCRIPT = "tests/real/collective_run.py"


def test_torchrun_two_processes(real_run, check_results):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT]
    job = real_run(command, timeout=240)
    results = check_results(job, ranks=2, environment="torchelastic")
    assert {r["environment_class"] for r in results} == {TorchElasticEnvironment.__name__}
    assert {r["scheduler"] for r in results} == {"torchelastic"}


def test_a_mismatch_stops_every_rank_with_the_fix(real_run, job_env):
    # torchrun made 2 processes, the script asks for 1 device per node.
    code = (
        "import sys, phalanx\n"
        "try:\n"
        "    phalanx.resolve('ddp', accelerator='cpu', devices=1, num_nodes=1)\n"
        "except phalanx.MisconfigurationError as exc:\n"
        # One write per line: two ranks share the pipe, unbuffered, and
        # print() writes its arguments one by one (they interleaved once).
        "    sys.stdout.write(f'REFUSED {exc}\\n')\n"
    )
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    job = real_run([*torchrun, "--no-python", sys.executable, "-c", code], timeout=240)
    refused = [line for line in job.stdout.splitlines() if line.startswith("REFUSED")]
    assert job.returncode == 0, job.describe()
    assert len(refused) == 2, job.describe()
    assert "torchrun started WORLD_SIZE=2 process(es), but devices=1 x num_nodes=1 = 1" in refused[0]
    assert "torchrun --nproc-per-node=1 --nnodes=1" in refused[0]
