"""What resolving a composed collective says: ``phalanx explain`` shows the
collectives it is made of, each with its package; a bad option or an
unknown inner collective is refused, naming what to give instead."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import phalanx
from phalanx_core import MisconfigurationError, UnknownNameError


def test_explain_shows_the_inner_collective_and_its_package():
    plan = phalanx.Registry().plan(
        "ddp", accelerator="cpu", devices=2, collective="compressed", inner="torch"
    )
    [inner] = plan.composition
    assert (inner.name, inner.provider.distribution, inner.reason) == (
        "inner: torch",
        "phalanx-torch",
        "inner of 'compressed'",
    )
    text = plan.explain().splitlines()
    row = text.index(next(line for line in text if line.startswith("collective")))
    assert "compressed" in text[row] and "phalanx-compose" in text[row]
    assert "inner: torch" in text[row + 1] and "phalanx-torch" in text[row + 1]


def test_the_command_line_shows_it_too():
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "explain", "--strategy", "fsdp", "--accelerator", "cpu",
         "--devices", "2", "--collective", "compressed", "-o", "dtype=fp16", "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    [inner] = json.loads(done.stdout)["composition"]
    assert (inner["name"], inner["distribution"]) == ("inner: torch", "phalanx-torch")


def test_a_plain_collective_is_made_of_nothing():
    assert phalanx.Registry().plan("ddp", accelerator="cpu", devices=2).composition == ()


def test_planning_a_composed_collective_imports_no_torch():
    code = (
        "import json, sys, phalanx\n"
        "plan = phalanx.Registry().plan('ddp', accelerator='cpu', devices=2, collective='hierarchical', inter='mpi', launcher='fork')\n"
        "print(json.dumps([[c.name for c in plan.composition], 'torch' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(done.stdout) == [["intra: torch", "inter: mpi"], False]


def test_an_unknown_inner_collective_is_refused_naming_those_that_exist():
    with pytest.raises(UnknownNameError, match=r"'nosuch'.*torch"):
        phalanx.resolve("ddp", accelerator="cpu", devices=2, collective="compressed", inner="nosuch")


@pytest.mark.parametrize(
    ("option", "message"),
    [
        ({"dtype": "fp8"}, r"dtype='fp8'; give 'bf16'"),
        ({"error_feedback": "yes"}, r"error_feedback='yes'"),
        ({"inner": "compressed"}, r"would compress twice"),
        ({"inner_options": {"nosuch": 1}}, r"does not take the options"),
    ],
)
def test_bad_options_are_refused(option, message):
    with pytest.raises(MisconfigurationError, match=message):
        phalanx.resolve("ddp", accelerator="cpu", devices=2, collective="compressed", **option)
