"""The plugin authors' guides are real: their example packages,
docs/examples/phalanx-counting (docs/content/publish.md) and
docs/examples/phalanx-popen (docs/content/launchers.md), the pages showing
these very files, are copied to an empty folder, built and installed with
pip into a temporary site folder, and then, as their authors and users
would:

- ``phalanx list`` shows the part, from its distribution;
- a 2-rank job chooses the collective by name (and by qualified name, and
  through ``phalanx run --collective``), and DDP's gradients go through it;
- each author's own test file runs the conformance suites on the part (the
  collective's contract and training traffic; the launcher's launch and
  failure contracts).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx_core.testing.processes import scheduler_free_environment

pytestmark = pytest.mark.subprocess

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def install(name: str, root: Path) -> tuple[Path, dict[str, str]]:
    """The example package ``name`` built and installed by pip into a site
    folder under ``root``; its copy, and the environment that puts it on
    the path."""
    project = root / name
    shutil.copytree(EXAMPLES / name, project)
    site = root / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(project)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert (site / f"{name.replace('-', '_')}-0.1.0.dist-info" / "entry_points.txt").is_file()
    env = scheduler_free_environment()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return project, env


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    return install("phalanx-counting", tmp_path_factory.mktemp("author"))


@pytest.fixture(scope="module")
def launcher_installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    return install("phalanx-popen", tmp_path_factory.mktemp("launcher-author"))


def run(command: list[str], env: dict[str, str], cwd: Path) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)
    assert done.returncode == 0, f"$ {' '.join(command)}\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def test_phalanx_list_shows_the_collective_from_its_distribution(installed):
    project, env = installed
    out = run([sys.executable, "-m", "phalanx", "list"], env, project)
    [row] = [line for line in out.splitlines() if line.split()[:2] == ["collective", "counting"]]
    assert "phalanx-counting 0.1.0" in row and "yes" in row.split()


#: What each rank of tests/job.py reports: its own all_reduce of 4 floats
#: (16 bytes), then DDP's: 4 broadcasts of the module's state (4104 bytes)
#: and one bucket of 1010 gradients (4040 bytes) in each of 3 steps.
JOB_LINE = (
    "('CountingCollective', [2.0, 2.0, 2.0, 2.0], {'all_reduce': 4, 'all_gather': 1, 'broadcast': 4}, "
    "{'all_reduce': 12136, 'all_gather': 8, 'broadcast': 4104})"
)


def test_a_two_rank_job_uses_it_by_name_and_ddp_trains_through_it(installed):
    project, env = installed
    out = run([sys.executable, "tests/job.py"], env, project)
    for rank in (0, 1):
        assert f"{rank} {JOB_LINE}" in out.splitlines(), out


def test_phalanx_run_chooses_it_and_ddp_trains_through_it(installed):
    project, env = installed
    command = [sys.executable, "-m", "phalanx", "run", "--strategy", "ddp", "--accelerator", "cpu"]
    out = run([*command, "--devices", "2", "--collective", "counting", "tests/job.py"], env, project)
    for rank in (0, 1):
        assert f"[rank{rank}]: {rank} {JOB_LINE}" in out.splitlines(), out


def test_the_qualified_name_resolves_to_it(installed):
    project, env = installed
    code = (
        "import phalanx\n"
        "s = phalanx.resolve('ddp_fork', accelerator='cpu', devices=2, collective='phalanx-counting:counting')\n"
        "print(type(s.collective).__name__)\n"
    )
    assert run([sys.executable, "-c", code], env, project).strip() == "CountingCollective"


def test_the_authors_conformance_suite_passes(installed):
    project, env = installed
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], env, project)
    assert "9 passed" in out, out


def test_phalanx_list_shows_the_launcher_from_its_distribution(launcher_installed):
    project, env = launcher_installed
    out = run([sys.executable, "-m", "phalanx", "list"], env, project)
    [row] = [line for line in out.splitlines() if line.split()[:2] == ["launcher", "popen"]]
    assert "phalanx-popen 0.1.0" in row, row


def test_the_launcher_authors_conformance_suite_passes(launcher_installed):
    project, env = launcher_installed
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], env, project)
    assert "5 passed" in out, out
