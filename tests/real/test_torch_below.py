"""A torch older than the supported range, installed for real, is refused.

Collected only in ``nox -s torch_below_range``, which installs torch 2.5.1
(without its CUDA libraries: nothing here may import torch, only read its
metadata) beside every phalanx package. Each way in, ``phalanx list``,
``phalanx explain``, ``phalanx run`` and ``phalanx.resolve()``, says in one
line which torch is installed and which range is supported, and what to
run; none imports torch, and ``phalanx run`` starts no rank.
"""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

RANGE = ">=2.9"
SAID = f"supports torch{RANGE} (torch 2.5.1 is installed); run: pip install 'torch{RANGE}'"


@pytest.fixture(autouse=True, scope="module")
def _old_torch() -> None:
    installed = importlib.metadata.version("torch")
    if not installed.startswith("2.5."):
        pytest.fail(f"this session installs torch 2.5.1; torch {installed} is installed")


def test_phalanx_list_says_the_torch_is_not_in_the_range_and_every_torch_part_is_unavailable(real_run):
    job = real_run([sys.executable, "-m", "phalanx", "list"], timeout=60)
    assert job.returncode == 0, job.describe()
    [said] = [line for line in job.stdout.splitlines() if line.startswith("torch 2.5.1: ")]
    assert said.startswith("torch 2.5.1: NOT in the range of phalanx-compose 0.1.0, "), job.describe()
    assert "phalanx-torch 0.1.0" in said and said.endswith(f"({RANGE})"), job.describe()
    rows = {
        tuple(line.split()[:2]): line for line in job.stdout.splitlines() if "phalanx-torch 0.1.0    " in line
    }
    for part in [("accelerator", "cpu"), ("strategy", "ddp"), ("strategy", "fsdp"), ("collective", "torch"),
                 ("precision", "32-true"), ("launcher", "subprocess"), ("launcher", "spawn")]:  # fmt: skip
        assert f"no: needs torch{RANGE}  " in rows[part], job.describe()
    assert (
        f"(phalanx-torch): needs torch{RANGE} (2.5.1 is installed): pip install 'torch{RANGE}'" in job.stdout
    )
    # The cluster environments read variables and in_process runs fn: no torch.
    assert " yes " in rows[("launcher", "in_process")], job.describe()


@pytest.mark.parametrize(
    "command",
    [
        ["explain", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2"],
        ["run", "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", "examples/train.py"],
    ],
    ids=["explain", "run"],
)
def test_the_command_line_refuses_in_one_line_before_any_rank_starts(real_run, command):
    job = real_run([sys.executable, "-m", "phalanx", *command], timeout=60)
    assert job.returncode != 0, job.describe()
    lines = [line for line in job.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, job.describe()
    assert SAID in lines[0], job.describe()
    assert "Traceback" not in job.stdout + job.stderr and "[rank" not in job.stdout, job.describe()


def test_resolve_raises_unavailable_error_naming_the_range_and_imports_no_torch(real_run):
    code = (
        "import sys, phalanx\n"
        "from phalanx_core import UnavailableError\n"
        "try:\n"
        "    phalanx.resolve('ddp', accelerator='cpu', devices=2)\n"
        "except UnavailableError as exc:\n"
        "    print('REFUSED', exc)\n"
        "print('TORCH IMPORTED', 'torch' in sys.modules)\n"
    )
    job = real_run([sys.executable, "-c", code], timeout=60)
    assert job.returncode == 0, job.describe()
    assert "REFUSED strategy 'ddp' from 'torch' (phalanx-torch 0.1.0) " + SAID in job.stdout, job.describe()
    assert "TORCH IMPORTED False" in job.stdout, job.describe()
