"""phalanx-ray's tests that need ray run in the ``ray`` nox session, which
installs ray and sets ``PHALANX_REAL_RUNS=ray``; there a missing ray fails,
never skips. Elsewhere (the ``tests`` session, where ray is not installed)
only the tests that need no ray run: installation and the environment.

Ray 2.60 turns token authentication on for the clusters it starts, and
looks for the token in ``RAY_AUTH_TOKEN``, then the file
``RAY_AUTH_TOKEN_PATH`` names, then ``~/.ray/auth_token`` (which a local
``ray.init()`` writes when it finds none, and ``ray start --head``
requires). The tests bring their own: a token made for this run, in a
temporary file that every Ray process they start reads through
``RAY_AUTH_TOKEN_PATH``, with ``RAY_AUTH_MODE=token`` set for all of them
alike. Nothing an earlier Ray run left in the home directory is used, and
the home directory's ``.ray`` is left as it was found (checked at the end).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

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


def _listing(folder: Path) -> dict[str, bytes] | None:
    """The files under ``folder`` with their contents; None if it does not exist."""
    if not folder.is_dir():
        return None
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


@pytest.fixture(scope="session", autouse=True)
def ray_token() -> Iterator[Path]:
    """A Ray token of this test run's own (see the module's docstring),
    and the check that ``~/.ray`` is as it was."""
    home_ray = Path.home() / ".ray"
    before = _listing(home_ray)
    folder = Path(tempfile.mkdtemp(prefix="phx-token-"))
    token = folder / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_AUTH_MODE", "token")
        patch.setenv("RAY_AUTH_TOKEN_PATH", str(token))
        patch.delenv("RAY_AUTH_TOKEN", raising=False)
        yield token
    shutil.rmtree(folder, ignore_errors=True)
    after = _listing(home_ray)
    assert after == before, (
        f"the tests changed {home_ray}: {sorted(before or ())} before, {sorted(after or ())} after"
    )


@pytest.fixture
def clean(monkeypatch):
    """No scheduler's variables (nor phalanx's): the tests set their own."""
    from phalanx.testing.suites import EnvironmentSuite

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
