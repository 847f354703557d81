"""What the registry says of phalanx-mpi, with or without mpi4py installed:
the parts are listed either way, available only with their needs, and
resolving one without them says what to install. The plugin's entry module
imports neither mpi4py nor torch."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

import phalanx
from phalanx_core import UnavailableError

HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None


def test_listed_with_the_install_line_when_mpi4py_is_missing():
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "list", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    parts = {(p["kind"], p["name"]): p for p in json.loads(done.stdout)["parts"]}
    for key in (("collective", "mpi"), ("launcher", "mpirun")):
        part = parts[key]
        assert part["distribution"] == "phalanx-mpi"
        assert part["available"] is HAVE_MPI4PY
        if not HAVE_MPI4PY:
            assert "pip install mpi4py" in part["reason"]


@pytest.mark.skipif(HAVE_MPI4PY, reason="mpi4py is installed here: the refusal needs it missing")
def test_resolving_without_mpi4py_says_what_to_install():
    with pytest.raises(UnavailableError, match=r"mpi4py.*pip install mpi4py"):
        phalanx.resolve("ddp", accelerator="cpu", devices=2, collective="mpi")


def test_the_entry_module_imports_neither_mpi4py_nor_torch():
    code = "import sys, phalanx_mpi.plugin; print(sorted(m for m in ('mpi4py', 'torch') if m in sys.modules))"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
