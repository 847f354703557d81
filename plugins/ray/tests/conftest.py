"""phalanx-ray's tests that need ray run in the ``ray`` nox session, which
installs ray and sets ``PHALANX_REAL_RUNS=ray``; there a missing ray fails,
never skips. Elsewhere (the ``tests`` session, where ray is not installed)
only the tests that need no ray run: installation and the environment."""

from __future__ import annotations

import os

import pytest

_asked = {name.strip() for name in os.environ.get("PHALANX_REAL_RUNS", "").split(",")}
_NEED_RAY = [
    "test_launcher.py",
    "test_training.py",
    "test_cluster.py",
    "test_warm.py",
    "test_failures.py",
]
collect_ignore = [] if "ray" in _asked else _NEED_RAY


@pytest.fixture
def clean(monkeypatch):
    """No scheduler's variables (nor phalanx's): the tests set their own."""
    from phalanx_core.testing.suites import EnvironmentSuite

    for name in list(os.environ):
        if name.startswith(EnvironmentSuite.cleared):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def rank_1_of_4(clean):
    """The variables the ray launcher sets in rank 1 of 2 nodes x 2 ranks."""
    from phalanx_ray.environment import JOB_VAR, NODES_VAR

    variables = {
        JOB_VAR: "job-1",
        NODES_VAR: "2",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "0",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "40123",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }
    for name, value in variables.items():
        clean.setenv(name, value)
    return variables
