"""A one-node job of the horovod launcher listens on loopback only, both
ways: ``strategy.launch(fn)`` from a plain process, and a script run by
``phalanx run --launcher horovod``; under the horovod strategy (Horovod's
gloo) and under DDP with torch's collective beside it (the launcher's
rendezvous store, the ranks' torch gloo). Every process of the job is
looked at: the launching process with Horovod's HTTP servers, horovodrun,
the shells it starts the ranks with, the ranks."""

from __future__ import annotations

import ipaddress
import json
import sys
from pathlib import Path

import pytest

from phalanx_core.testing.processes import run_tagged

pytestmark = pytest.mark.subprocess

JOB = "phalanx.testing.listening_job"  # python -m
JOBS = {"horovod": {"strategy": "horovod"}, "ddp-torch": {"strategy": "ddp", "collective": "torch"}}


def job_sockets(way: str, flags: dict, cwd: Path) -> list[tuple[int, str, int, str]]:
    """Every (pid, address, port, command) the job's processes listen on."""
    flags = {"accelerator": "cpu", "devices": 2, "launcher": "horovod", **flags}
    if way == "launch":
        command = [sys.executable, "-m", JOB, "launch", json.dumps(flags)]
    else:
        command = [sys.executable, "-m", "phalanx", "run"]
        for name, value in flags.items():
            command += [f"--{name}", str(value)]
        command += ["-m", JOB]
    done = run_tagged(command, timeout=180, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    reports = [line.split("SOCKETS ", 1)[1] for line in done.stdout.splitlines() if "SOCKETS " in line]
    assert len(reports) == 1, done.stdout + done.stderr
    return [tuple(row) for row in json.loads(reports[0])]


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("way", ["launch", "phalanx run"])
def test_a_one_node_job_listens_on_loopback_only(way, job, tmp_path):
    found = job_sockets(way, JOBS[job], tmp_path)
    wide = [s for s in found if not ipaddress.ip_address(s[1]).is_loopback]
    assert not wide, f"{way}, {job}: listening beyond loopback: {found}"
    # Horovod's rendezvous server, in the launching process or horovodrun.
    assert any(s[3] != "rank" for s in found), found
