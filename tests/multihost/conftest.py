"""Jobs across several hosts made of network namespaces
(:mod:`phalanx_core.testing.hosts`).

Collected only in the ``multihost`` nox session (``PHALANX_REAL_RUNS`` names
``multihost``), which runs as root with iproute2; there a missing tool fails
the tests instead of skipping them.

``bed`` is a test bed of two hosts (``node0`` at 192.168.77.1, ``node1`` at
192.168.77.2) whose own names map to loopback, as Debian's ``/etc/hosts``
does; ``make_bed(count, names_on_loopback=...)`` makes others. ``run_nodes``
starts one command per host at once and waits for all of them, bounded in
time; every process of the job carries a tag, and one still alive
afterwards fails the test (it is killed by pid first).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from phalanx_core.testing.hosts import Host, TestBed, missing
from phalanx_core.testing.processes import TAG_VAR, new_tag, reap, scheduler_free_environment

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MARKER = "PHALANX-RESULT "

if "multihost" not in {n.strip() for n in os.environ.get("PHALANX_REAL_RUNS", "").split(",")}:
    collect_ignore_glob = ["test_*.py"]


@dataclass
class NodeRun:
    host: Host
    command: list[str]
    returncode: int
    stdout: str
    stderr: str
    #: Seconds from the start of the job to this node's end.
    ended: float

    @property
    def results(self) -> list[dict]:
        """The ``PHALANX-RESULT`` lines this node printed, as JSON."""
        found = []
        for line in self.stdout.splitlines():
            _, marker, rest = line.partition(MARKER)
            if marker:
                found.append(json.loads(rest))
        return found

    def describe(self) -> str:
        return (
            f"--- {self.host.name}: $ {' '.join(self.command)}\nexit code {self.returncode} after "
            f"{self.ended:.1f} s\n--- stdout\n{self.stdout[-5000:]}\n--- stderr\n{self.stderr[-5000:]}"
        )


def describe(runs: list[NodeRun]) -> str:
    return "\n".join(run.describe() for run in runs)


@pytest.fixture
def make_bed():
    if missing() is not None:
        pytest.fail(f"the multihost session needs network namespaces: {missing()}")
    beds: list[TestBed] = []

    def make(count: int = 2, *, names_on_loopback: bool = True) -> TestBed:
        bed = TestBed(count, names_on_loopback=names_on_loopback)
        beds.append(bed)
        bed.open()
        return bed

    yield make
    for bed in beds:
        bed.close()


@pytest.fixture
def bed(make_bed) -> TestBed:
    return make_bed(2)


def run_on(
    hosts: list[Host],
    commands: list[list[str]],
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    node_env: list[dict[str, str]] | None = None,
    cwd: Path = ROOT,
) -> list[NodeRun]:
    """Run ``commands[i]`` on ``hosts[i]``, all at once; wait for every one,
    at most ``timeout`` seconds in all."""
    tag = new_tag()
    base = {**scheduler_free_environment(), **(env or {}), TAG_VAR: tag}
    start = time.monotonic()
    processes = [
        host.popen(
            command,
            env={**base, **(node_env[i] if node_env else {})},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, (host, command) in enumerate(zip(hosts, commands, strict=True))
    ]
    ended = [0.0] * len(processes)
    outputs: list[tuple[str, str]] = [("", "")] * len(processes)
    threads: list[threading.Thread] = []
    try:
        # Read every node's output in its own thread, so none blocks on a full pipe.
        def collect(i: int) -> None:
            outputs[i] = processes[i].communicate()
            ended[i] = time.monotonic() - start

        threads = [threading.Thread(target=collect, args=(i,), daemon=True) for i in range(len(processes))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(0.0, timeout - (time.monotonic() - start)))
        late = [hosts[i].name for i, thread in enumerate(threads) if thread.is_alive()]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for thread in threads:
        thread.join(30)
    runs = [
        NodeRun(
            host, command, process.returncode if process.returncode is not None else -9, *outputs[i], ended[i]
        )
        for i, (host, command, process) in enumerate(zip(hosts, commands, processes, strict=True))
    ]
    left = reap(tag)
    if late:
        pytest.fail(f"still running after {timeout} s on {', '.join(late)}; killed\n{describe(runs)}")
    assert not left, f"processes left behind (killed now): {left}\n{describe(runs)}"
    return runs


@pytest.fixture
def run_nodes():
    """:func:`run_on`."""
    return run_on


@pytest.fixture
def python() -> str:
    return sys.executable
