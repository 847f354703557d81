"""What the registry says of phalanx-xla with or without torch_xla
installed: every part is listed either way, available only with torch_xla
(and the torch it was built for), and resolving one without it says what to
install. Listing imports neither torch nor torch_xla. Runs in every
session: the ``tests`` session has no torch_xla, the ``xla`` session has it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

import phalanx
from phalanx_core import MisconfigurationError, UnavailableError
from phalanx_xla._runtime import INSTALL, version_problem

HAVE_XLA = importlib.util.find_spec("torch_xla") is not None
PARTS = [
    ("accelerator", "xla"),
    ("collective", "xla"),
    ("launcher", "xla"),
    ("environment", "xla"),
    ("strategy", "xla"),
    ("strategy", "xla_single"),
]


def listed(*flags: str, **env: str) -> dict[tuple[str, str], dict]:
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "list", "--json", *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, **env},
    )
    return {(p["kind"], p["name"]): p for p in json.loads(done.stdout)["parts"]}


def test_every_part_is_listed_and_says_what_to_install_when_torch_xla_is_missing():
    parts = listed()
    for key in PARTS:
        part = parts[key]
        assert part["distribution"] == "phalanx-xla", part
        assert part["available"] is HAVE_XLA, part
        if not HAVE_XLA:
            assert "torch_xla" in part["reason"] and INSTALL in part["reason"], part


def test_the_accelerator_probe_gives_the_reason():
    part = listed("--probe", PJRT_DEVICE="CPU")[("accelerator", "xla")]
    if HAVE_XLA:
        assert part["available"] is True, part
    else:
        assert part["available"] is False and INSTALL in part["reason"], part


def test_the_install_line_pins_the_version_pair():
    assert "'torch==2.9.0'" in INSTALL and "'torch_xla==2.9.0'" in INSTALL


@pytest.mark.parametrize("strategy", ["xla", "xla_single"])
def test_resolving_says_what_to_install_without_torch_xla_and_builds_with_it(monkeypatch, strategy):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    if not HAVE_XLA:
        with pytest.raises(UnavailableError, match=r"torch_xla.*torch==2\.9\.0.*torch_xla==2\.9\.0"):
            phalanx.resolve(strategy, accelerator="xla", devices=1)
    else:  # building starts no XLA runtime here: that waits for the launch
        built = phalanx.resolve(strategy, accelerator="xla", devices=1)
        assert type(built.collective).__name__ == "XLACollective"


def test_naming_the_collective_says_what_to_install_or_what_to_use():
    error = MisconfigurationError if HAVE_XLA else UnavailableError
    match = r"collective 'xla' with accelerator 'cpu'" if HAVE_XLA else r"collective 'xla'.*torch_xla"
    with pytest.raises(error, match=match):
        phalanx.resolve("ddp", accelerator="cpu", devices=2, collective="xla")


def test_auto_never_picks_xla_where_it_cannot_run():
    plan = phalanx.Registry().plan("auto", accelerator="auto", devices=1)
    if not HAVE_XLA or not os.environ.get("PJRT_DEVICE"):
        assert plan.accelerator.name != "xla", plan.explain()


def test_the_entry_module_and_listing_import_neither_torch_nor_torch_xla():
    code = (
        "import sys, phalanx_xla.plugin, phalanx\n"
        "r = phalanx.Registry()\n"
        "assert 'xla' in r.names('strategy')\n"
        "print(sorted(m for m in ('torch', 'torch_xla') if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]", done.stdout + done.stderr


@pytest.mark.parametrize(
    ("torch", "xla", "problem"),
    [
        ("2.9.0", "2.9.0", None),
        ("2.9.0+cu128", "2.9.0", None),
        ("2.9.0+cpu", "2.9.0", None),
        (
            "2.13.0+cpu",
            "2.9.0",
            "torch_xla 2.9.0 needs exactly torch 2.9.0, and torch 2.13.0+cpu is installed",
        ),
        ("2.9.1", "2.9.0", "needs exactly torch 2.9.0"),
        ("2.8.0", "2.9.0", "needs exactly torch 2.9.0"),
        ("2.10.0", "2.10.0", None),  # not in the table: the same major.minor
        ("2.11.0", "2.10.1", "torch_xla 2.10.1 needs torch 2.10.x"),
    ],
)
def test_the_version_pair_is_checked_because_torch_xla_metadata_does_not(torch, xla, problem):
    said = version_problem(torch, xla)
    if problem is None:
        assert said is None
    else:
        assert said is not None and problem in said and "metadata does not say" in said


def test_the_accelerator_says_why_it_is_unavailable(monkeypatch):
    from phalanx_xla.accelerator import XLAAccelerator

    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    availability = XLAAccelerator.availability()
    assert availability.available is False
    if HAVE_XLA:  # installed, but nothing names a device here (no TPU on this machine)
        assert "PJRT_DEVICE is not set" in availability.reason and "PJRT_DEVICE=CPU" in availability.reason
        assert "PJRT_DEVICE" not in os.environ, "the check must not import torch_xla, which sets it"
    else:
        assert "torch_xla is not installed" in availability.reason and INSTALL in availability.reason
    with pytest.raises(UnavailableError, match="accelerator 'xla' cannot be used here"):
        XLAAccelerator()
