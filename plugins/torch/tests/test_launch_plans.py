"""What a launch of several nodes reads of its settings, and how often: the
rendezvous string is parsed once into a frozen place that every part is
handed (its TLS files checked and its password read once), not once a
question (the launcher asked it about ten times a launch)."""

from __future__ import annotations

import dataclasses

import pytest

from phalanx_torch._launch import elastic
from phalanx_torch.launchers import SubprocessLauncher


@pytest.fixture
def parses(monkeypatch):
    made = []
    real = elastic.parse_rendezvous

    def counted(*args):
        made.append(args)
        return real(*args)

    monkeypatch.setattr(elastic, "parse_rendezvous", counted)
    return made


@pytest.mark.parametrize("rendezvous", ["c10d", "etcd://127.0.0.1:2379,127.0.0.2:2379/job"])
def test_the_rendezvous_is_parsed_once_whatever_the_parts_ask(parses, monkeypatch, rendezvous):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29655")
    launcher = SubprocessLauncher(num_nodes=2, node_rank=0, max_restarts=1, rendezvous=rendezvous)
    place = launcher._place()
    with pytest.raises(dataclasses.FrozenInstanceError):
        place.name = "another"  # type: ignore[misc]
    launcher.explain()
    launcher.listening()
    assert launcher.elastic
    assert launcher._hosts_store == (rendezvous == "c10d")
    assert launcher._place() is place
    assert len(parses) == 1


def test_a_main_address_given_later_is_parsed_again_once(parses, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29655")
    launcher = SubprocessLauncher(num_nodes=2, node_rank=1, max_restarts=1, rendezvous="c10d")
    assert launcher._place().endpoint == "127.0.0.1:29655"
    monkeypatch.setenv("MASTER_PORT", "29656")  # as an environment given to the launcher after it was made
    assert launcher._place().endpoint == "127.0.0.1:29656"
    launcher.explain()
    assert len(parses) == 2


#: A job whose ranks wait until the test says, then end well.
HELD_JOB = """
import os, time, phalanx
strategy = phalanx.resolve()
def main(strategy):
    while os.path.exists({hold!r}):
        time.sleep(0.1)
    strategy.barrier()
strategy.launch(main)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("restarts", [0, 1], ids=["fixed-nodes", "rounds"])
def test_a_node_holds_at_most_two_connections_to_the_jobs_store(tmp_path, restarts):
    # The rendezvous, the heartbeat and the node watch's posts share one
    # connection (a job of fixed nodes: the one its static rendezvous
    # made), the watch's wait has the other.
    import socket
    import subprocess
    import sys
    import time

    from phalanx_core.testing.processes import connections_to, new_tag, reap, scheduler_free_environment
    from phalanx_torch._nodes.job_store import CONNECTIONS

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    hold = tmp_path / "hold"
    hold.touch()
    script = tmp_path / "held.py"
    script.write_text(HELD_JOB.format(hold=str(hold)))
    tag = new_tag()
    env = scheduler_free_environment(PHALANX_TEST_TAG=tag)
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "phalanx.cli",
                "run",
                "--strategy",
                "ddp",
                "--accelerator",
                "cpu",
                "--devices",
                "1",
                "--num-nodes",
                "2",
                "--node-rank",
                str(node),
                "--main-address",
                "127.0.0.1",
                "--main-port",
                str(port),
                "--max-restarts",
                str(restarts),
                str(script),
            ],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        pids = [node.pid for node in nodes]
        held: dict[int, int] = {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # every part connected once the ranks run
            held = connections_to(pids, port)
            if all(count >= CONNECTIONS for count in held.values()):
                break
            time.sleep(0.2)
        time.sleep(2)  # a part that connects late would show now
        held = connections_to(pids, port)
        hold.unlink()
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        left = reap(tag)
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert not left
    assert set(held.values()) == {CONNECTIONS}, held
