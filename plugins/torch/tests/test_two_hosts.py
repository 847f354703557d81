"""Two nodes on two hosts made of network namespaces: where a job of the
``subprocess`` launcher listens when its nodes are on different machines.

The test makes two namespaces joined by a veth pair (private addresses
10.231.7.1 and .2, nothing else reachable from them), runs one node of a
two-node job in each, and reads the listening sockets of node 0's agent (the
rendezvous store) and of every rank (gloo): each listens on its host's veth
address, the one that reaches node 0, never on every interface or on
loopback. Needs root and iproute2 (``ip netns``); it removes the namespaces
afterwards, whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from phalanx_core.testing.processes import TAG_VAR, new_tag, reap, scheduler_free_environment

SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
HOSTS = {"0": "10.231.7.1", "1": "10.231.7.2"}

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(
        not sys.platform.startswith("linux") or os.geteuid() != 0 or shutil.which("ip") is None,
        reason="network namespaces need Linux, root and iproute2",
    ),
]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    suffix = uuid.uuid4().hex[:6]
    names = [f"phx{suffix}a", f"phx{suffix}b"]
    try:
        for name in names:
            ip("netns", "add", name)
            ip("-n", name, "link", "set", "lo", "up")
        ip(
            "link",
            "add",
            f"v{suffix}a",
            "netns",
            names[0],
            "type",
            "veth",
            "peer",
            "name",
            f"v{suffix}b",
            "netns",
            names[1],
        )
        for node, (name, end) in enumerate(zip(names, "ab", strict=True)):
            ip("-n", name, "addr", "add", f"{HOSTS[str(node)]}/24", "dev", f"v{suffix}{end}")
            ip("-n", name, "link", "set", f"v{suffix}{end}", "up")
        yield names, [f"v{suffix}a", f"v{suffix}b"]
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def test_each_node_listens_on_the_address_that_reaches_node_0(two_hosts):
    names, interfaces = two_hosts
    tag = new_tag()
    env = scheduler_free_environment(**{TAG_VAR: tag, "MASTER_ADDR": HOSTS["0"], "MASTER_PORT": "29731"})
    nodes = [
        subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                name,
                sys.executable,
                "launch_job.py",
                "world_listening",
                "--processes",
                "2",
                "--nodes",
                "2",
            ],
            cwd=SCRIPTS,
            env={**env, "NODE_RANK": str(node)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node, name in enumerate(names)
    ]
    outputs = []
    try:
        for node in nodes:
            out, err = node.communicate(timeout=120)
            assert node.returncode == 0, err
            outputs.append(out)
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
        assert not reap(tag), "processes left behind"
    for node, out in enumerate(outputs):
        line = next(x for x in out.splitlines() if x.startswith("PHALANX-RESULT "))
        [results] = json.loads(line.removeprefix("PHALANX-RESULT "))
        mine = [r for r in results if r is not None]
        assert len(mine) == 2, results
        for result in mine:
            assert result["rank"] and set(result["rank"]) == {HOSTS[str(node)]}, result  # gloo
            if node == 0:  # the agent hosts the store
                assert HOSTS["0"] in result["launcher"], result
            assert not set(result["launcher"]) - {HOSTS[str(node)]}, result  # nothing on * or loopback
