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
