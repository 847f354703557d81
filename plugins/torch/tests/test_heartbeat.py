"""The nodes' heartbeats (``_nodes.heartbeat.Heartbeat``) on a real ``TCPStore``
on loopback, the nodes as threads of this process, with beats a twentieth
of a second apart: a node that stops beating is named by the node that
watches it, and only by it; a node that ended its launch well is not; a
new round watches the nodes of that round; every node makes the same two
small requests a beat, whatever the number of nodes. The whole job, with
a host cut off its network and killed, is in
tests/multihost/test_elastic.py.
"""

from __future__ import annotations

import datetime
import time
from collections import Counter
from typing import Any

import pytest
import torch.distributed as dist
from counting_store import Counted

from phalanx_core.launching import hosted_store
from phalanx_torch._nodes.heartbeat import Heartbeat

BEAT = 0.05
LOST_AFTER = 1.5  # 30 beats: a thread starved that long under load is rare


@pytest.fixture
def store() -> Any:
    return hosted_store("127.0.0.1", 0)


def _beating(store: Any, count: int, counts: Counter[str] | None = None) -> list[Heartbeat]:
    clients: list[Any] = []

    def connect() -> Any:
        client = dist.TCPStore(
            "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30)
        )
        clients.append(client)  # a Python store must outlive the C++ ones wrapping it
        return Counted(client, counts) if counts is not None else client

    beats = [Heartbeat(connect, BEAT, LOST_AFTER) for _ in range(count)]
    for beat in beats:
        beat.lost_after = LOST_AFTER  # (not the 5 beats' floor)
        beat._clients = clients  # type: ignore[attr-defined]
    return beats


def _until(condition: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_node_that_stops_beating_is_named_by_the_node_that_watches_it(store):
    beats = _beating(store, 4)
    try:
        for rank, beat in enumerate(beats):
            beat.start_round(0, rank, 4)
        time.sleep(LOST_AFTER * 2)
        assert all(beat.lost is None for beat in beats)  # all beat: none lost
        beats[2].close()  # node 2 stops, without a word
        _until(lambda: beats[1].lost is not None, 10, "node 1 never saw node 2 stop")
        assert beats[1].lost == (2, __import__("socket").gethostname())
        assert beats[0].lost is None and beats[3].lost is None  # each node watches one
    finally:
        for beat in beats:
            beat.close()


def test_a_node_that_ended_well_is_not_taken_for_lost(store):
    beats = _beating(store, 2)
    try:
        for rank, beat in enumerate(beats):
            beat.start_round(0, rank, 2)
        time.sleep(LOST_AFTER)
        beats[1].done()  # its launch ended; node 0 still finishes
        time.sleep(LOST_AFTER * 3)
        assert beats[0].lost is None
    finally:
        for beat in beats:
            beat.close()


def test_a_new_round_watches_its_own_nodes(store):
    # Round 0 had three nodes; node 2 of it is lost; in round 1 the two
    # left are nodes 0 and 1, and node 1 watches node 0, not the lost one.
    beats = _beating(store, 3)
    try:
        for rank, beat in enumerate(beats):
            beat.start_round(0, rank, 3)
        beats[2].close()
        _until(lambda: beats[1].lost is not None, 10, "node 1 never saw node 2 stop")
        beats[0].start_round(1, 0, 2)
        beats[1].start_round(1, 1, 2)
        assert beats[1].lost is None  # the new round starts clean
        time.sleep(LOST_AFTER * 3)
        assert beats[0].lost is None and beats[1].lost is None
    finally:
        for beat in beats:
            beat.close()


def test_each_node_makes_the_same_few_requests_a_beat_whatever_the_number_of_nodes(store):
    for count in (2, 16):
        counts: Counter[str] = Counter()
        beats = _beating(store, count, counts)
        try:
            for rank, beat in enumerate(beats):
                beat.start_round(count, rank, count)  # a round of its own for each size
            time.sleep(20 * BEAT)
        finally:
            for beat in beats:
                beat.close()
        time.sleep(2 * BEAT)
        per_node_and_beat = counts["add"] / count / 20
        assert 1.0 <= per_node_and_beat <= 2.2, (count, counts)  # its own add and the watched one's
        assert counts["set"] == count and not counts["get"], counts  # its host, once a round
