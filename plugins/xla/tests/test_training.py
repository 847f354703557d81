"""examples/train.py on XLA: data parallel over the 2 CPU replicas (float32
and bfloat16), and one replica; the loss must go down, and no process may
be left behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from phalanx_core.testing.processes import run_tagged

pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[3]


def train(*flags: str, timeout: float = 300) -> tuple[float, float]:
    command = [sys.executable, "examples/train.py", "--accelerator", "xla", *flags]
    done = run_tagged(command, timeout=timeout, cwd=ROOT, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    assert done.returncode == 0, done.stdout + done.stderr
    [line] = [line for line in done.stdout.splitlines() if line.startswith("loss ")]  # rank 0 prints
    first, last = (float(x) for x in line.split("loss ")[1].split(" after")[0].split(" -> "))
    return first, last


def test_data_parallel_on_two_replicas_in_float32():
    first, last = train("--strategy", "xla", "--devices", "2", "--steps", "20")
    assert last < 0.5 * first


def test_data_parallel_on_two_replicas_in_bfloat16():
    first, last = train("--strategy", "xla", "--devices", "2", "--precision", "bf16-true", "--steps", "20")
    assert last < 0.5 * first


def test_one_replica():
    first, last = train("--strategy", "xla_single", "--steps", "20")
    assert last < 0.5 * first
