"""The node watch of a job on several nodes (``_nodes.node_watch.NodeWatch``),
on a real ``TCPStore`` on loopback, with the watches of several "nodes" as
threads of this process: a failure posted on one node reaches every other
node's blocked wait; a node asks the store nothing while nothing fails;
the nodes of a cascade (one rank raised, every other lost its peer) all
name the rank that raised, reading the causes rather than every post; a
launch's end wakes its watch out of the store's wait, so that no thread is
left blocked in C++ while the process exits (one that wakes then aborts
the process). The whole job, with real hosts and kills, is in
tests/multihost/test_elastic.py and test_nodes.py.
"""

from __future__ import annotations

import datetime
import resource
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from typing import Any

import pytest
import torch.distributed as dist
from counting_store import Counted

from phalanx_core.launching import RankFailure, hosted_store
from phalanx_torch._nodes import job_keys
from phalanx_torch._nodes import job_store as _job_store
from phalanx_torch._nodes.node_watch import NodeWatch

RAISED = 'Traceback (most recent call last):\n  File "train.py", line 9\nValueError: boom'
LOST_PEER = (
    'Traceback (most recent call last):\n  File "train.py", line 9\nRuntimeError: Connection reset by peer'
)


class Node(NodeWatch):
    """One node's watch, whose interrupt records the time instead of
    sending SIGTERM to this process."""

    def __init__(
        self, port: int, index: int, num_nodes: int, counts: Counter[str], *, hosts_store: bool = False
    ) -> None:
        self.clients: list[Any] = []

        def connect() -> Any:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
            self.clients.append(client)  # a Python store must outlive the C++ ones wrapping it
            counted = Counted(client, counts)
            self.clients.append(counted)
            return counted

        super().__init__(connect, index, num_nodes, hosts_store=hosts_store)
        self.me = f"node{index}"
        self.stopped_at: float | None = None

    def _interrupt(self) -> None:
        with self._signal_lock:
            if not self._stop.is_set():
                self.stopped_at = time.monotonic()


@pytest.fixture
def store() -> Any:
    return hosted_store("127.0.0.1", 0)


def _watching(store: Any, count: int, counts: Counter[str], *, host: int | None = None) -> list[Node]:
    """``count`` nodes watching; node ``host`` (if any) as the one whose
    process hosts the store (it waits for the others to read before it
    leaves)."""
    nodes = [Node(store.port, i, count, counts, hosts_store=i == host) for i in range(count)]
    for node in nodes:
        node.__enter__()
    for node in nodes:
        node.ledger.met()  # every node has met the others
    deadline = time.monotonic() + 30
    while not all(node._waiting for node in nodes):
        assert time.monotonic() < deadline, "the watches never began to wait"
        time.sleep(0.05)
    return nodes


def _failure(index: int, text: str) -> RankFailure:
    return RankFailure(index, 1, text, time.time(), node=index, host=f"node{index}")


def test_a_post_reaches_every_blocked_watch_and_nothing_is_asked_while_nothing_fails(store):
    counts: Counter[str] = Counter()
    nodes = _watching(store, 4, counts)
    try:
        before = sum(counts.values())
        time.sleep(1.5)  # a poll would have asked 7 times per node by now
        assert sum(counts.values()) == before, counts
        posted = time.monotonic()
        first = nodes[2].settle(_failure(2, RAISED))
        assert first.rank == 2
        deadline = time.monotonic() + 10
        while any(n.stopped_at is None for i, n in enumerate(nodes) if i != 2):
            assert time.monotonic() < deadline, [n.stopped_at for n in nodes]
            time.sleep(0.01)
        for i, node in enumerate(nodes):
            if i != 2:
                assert node.remote is not None and node.remote.rank == 2
                assert node.cause() == node.remote
                assert node.stopped_at is not None and node.stopped_at - posted < 5
    finally:
        for node in nodes:
            node.__exit__(None, None, None)
    assert not any(node._thread is not None and node._thread.is_alive() for node in nodes)


def test_a_cascade_names_the_rank_that_raised_on_every_node_reading_the_causes_only(store):
    counts: Counter[str] = Counter()
    size = 12
    nodes = _watching(store, size, counts)
    named: dict[int, RankFailure] = {}
    try:
        before = counts["get"]

        def settle(i: int) -> None:
            # The rank that raised posts last: every other node's lost-peer
            # post is in the store before it.
            if i == 5:
                time.sleep(0.5)
            named[i] = nodes[i].settle(_failure(i, RAISED if i == 5 else LOST_PEER))

        threads = [threading.Thread(target=settle, args=(i,)) for i in range(size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(named) == size
        assert {failure.rank for failure in named.values()} == {5}, named
        # Each node reads the one cause (and the post that woke its watch,
        # if it woke): about two gets a node, not one for every post so far.
        assert counts["get"] - before <= 3 * size, counts
    finally:
        for node in nodes:
            node.__exit__(None, None, None)


def test_with_no_cause_posted_the_nodes_name_a_lost_peer_after_the_hold(store, monkeypatch):
    monkeypatch.setattr(NodeWatch, "HOLD", 1.0)
    counts: Counter[str] = Counter()
    nodes = _watching(store, 3, counts)
    named: dict[int, RankFailure] = {}
    try:
        threads = [
            threading.Thread(target=lambda i=i: named.update({i: nodes[i].settle(_failure(i, LOST_PEER))}))
            for i in range(3)
        ]
        start = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert time.monotonic() - start >= 1.0  # each waited HOLD for a cause
        # Every node names one of the lost-peer failures (all alike: the
        # earliest of those it read).
        assert len(named) == 3 and all(f.traceback == LOST_PEER for f in named.values())
    finally:
        for node in nodes:
            node.__exit__(None, None, None)


def _settle_aside(
    nodes: list[Node], index: int, text: str, named: dict[int, RankFailure], done: dict
) -> None:
    """Node ``index`` settles a failure in a thread of its own; what it
    names goes into ``named``, and into ``done`` the nodes that had said
    they were done reading when its settle() returned (for the host: the
    nodes it may leave, its store with it)."""
    node = nodes[index]

    def settle() -> None:
        named[index] = node.settle(_failure(index, text))
        done[index] = {n.node_rank for n in nodes if n._said_done}

    threading.Thread(target=settle).start()


def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_the_store_host_waits_for_the_node_that_lost_its_peer_to_read_the_cause(store):
    # Node 1's rank lost its peer and its node posted that first; node 1
    # then looks for a cause only every second. Node 0's watch reads node
    # 1's post, and node 0 settles the cause: node 0 hosts the store and
    # must not leave (its store with it) before node 1 has read the cause,
    # whatever its own watch did meanwhile (it used to count itself done).
    counts: Counter[str] = Counter()
    nodes = _watching(store, 2, counts, host=0)
    nodes[1].POLL = 1.0
    try:
        named: dict[int, RankFailure] = {}
        done: dict[int, set[int]] = {}
        _settle_aside(nodes, 1, LOST_PEER, named, done)
        _until(lambda: nodes[0].remote is not None, "node 0's watch never read node 1's post")
        _settle_aside(nodes, 0, RAISED, named, done)
        _until(lambda: len(named) == 2, "a node never settled")
        assert {i: f.rank for i, f in named.items()} == {0: 0, 1: 0}
        assert done[0] == {1}, "node 0 left before node 1 had read its cause"
    finally:
        for node in nodes:
            node.__exit__(None, None, None)


def test_each_node_counts_once_among_those_done_reading(store):
    # Node 1's watch reads node 0's cause and says node 1 is done; node 1's
    # own lost-peer failure, settled after, must not count node 1 again:
    # two counts from one node let node 0 leave before node 2 (slow to
    # look) had read the cause.
    counts: Counter[str] = Counter()
    nodes = _watching(store, 3, counts, host=0)
    nodes[2].POLL = 1.0
    try:
        named: dict[int, RankFailure] = {}
        done: dict[int, set[int]] = {}
        _settle_aside(nodes, 2, LOST_PEER, named, done)
        _until(lambda: nodes[2]._stop.is_set(), "node 2 never began to settle")
        _settle_aside(nodes, 0, RAISED, named, done)
        _until(
            lambda: nodes[1].remote is not None and nodes[1]._said_done, "node 1's watch never read the cause"
        )
        _settle_aside(nodes, 1, LOST_PEER, named, done)
        _until(lambda: len(named) == 3, "a node never settled")
        assert {i: f.rank for i, f in named.items()} == {0: 0, 1: 0, 2: 0}
        assert done[0] == {1, 2}, "node 0 left before node 2 had read its cause"
        assert int(store.add(f"{job_keys.FAILURES}/done", 0)) == 2  # node 1 once, node 2 once
    finally:
        for node in nodes:
            node.__exit__(None, None, None)


def test_a_launch_that_ends_well_wakes_every_watch_out_of_its_wait(store):
    counts: Counter[str] = Counter()
    nodes = _watching(store, 3, counts)
    start = time.monotonic()
    nodes[0].__exit__(None, None, None)  # ended well: the job is over for all
    deadline = time.monotonic() + 10
    while any(n._thread is not None and n._thread.is_alive() for n in nodes):
        assert time.monotonic() - deadline < 0, "a watch stayed blocked after the job ended"
        time.sleep(0.01)
    assert time.monotonic() - start < NodeWatch.WAIT
    assert all(n.stopped_at is None and n.remote is None for n in nodes)  # no failure taken
    for node in nodes[1:]:
        node.__exit__(None, None, None)


def test_a_launch_that_ends_with_an_error_wakes_its_own_watch_only(store):
    counts: Counter[str] = Counter()
    nodes = _watching(store, 3, counts)
    try:
        nodes[1].__exit__(KeyboardInterrupt, KeyboardInterrupt(), None)
        assert nodes[1]._thread is not None and not nodes[1]._thread.is_alive()
        time.sleep(0.3)
        # The others still watch, and take no failure from that wake.
        assert nodes[0]._waiting and nodes[2]._waiting
        nodes[0].settle(_failure(0, RAISED))
        deadline = time.monotonic() + 10
        while nodes[2].stopped_at is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert nodes[2].remote is not None and nodes[2].remote.rank == 0
    finally:
        for node in nodes:
            node.__exit__(None, None, None)


# A process whose launch has ended and which exits while the job's store
# goes away. Before the watch was woken at the launch's end, its thread sat
# in TCPStore.wait; the store's end woke it while the interpreter was
# finalizing, and the process aborted ("terminate called without an active
# exception", exit status 134).
_EXITING = textwrap.dedent(
    """
    import datetime, subprocess, sys, time
    import torch.distributed as dist
    from phalanx_torch._nodes.node_watch import NodeWatch

    port, server_pid = int(sys.argv[1]), int(sys.argv[2])
    connect = lambda: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    with NodeWatch(connect, 1, 2, hosts_store=False) as watch:
        watch.ledger.met()
        while not watch._waiting:
            time.sleep(0.01)
    # The store's process is killed as this one finalizes.
    subprocess.Popen(["sh", "-c", f"sleep 0.05; kill -9 {server_pid}"])
    """
)

_SERVER = textwrap.dedent(
    """
    import sys, time
    from phalanx_core.launching import hosted_store
    store = hosted_store("127.0.0.1", 0)
    print(store.port, flush=True)
    time.sleep(120)
    """
)


def test_a_node_exits_cleanly_when_the_store_goes_away_as_it_exits():
    for _ in range(3):
        server = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout is not None
            port = int(server.stdout.readline())
            done = subprocess.run(
                [sys.executable, "-c", _EXITING, str(port), str(server.pid)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            assert "terminate called" not in done.stderr
        finally:
            server.kill()
            server.wait(30)


def test_heartbeats_slow_down_with_the_node_count():
    """One beat a second per node, then fewer: from 1,000 nodes on node 0's
    store, from 250 in etcd (each beat a write its members make durable)."""
    from phalanx_torch._nodes.heartbeat import interval_for

    assert interval_for(2, "c10d") == interval_for(1000, "c10d") == interval_for(250, "etcd") == 1.0
    assert interval_for(4096, "c10d") == 4.096
    assert interval_for(1024, "etcd") == 4.096


def test_the_store_host_may_open_three_connections_a_node():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 1024)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        _job_store.allow_connections(3 * 4096)  # a 4,096-node job's store, and 256 files of its own
        wanted = 3 * 4096 + 256
        top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (max(low, top), hard)
        _job_store.allow_connections(10)  # never lowered
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (max(low, top), hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_post_that_does_not_prove_the_jobs_secret_stops_no_node_and_is_said(store):
    from phalanx_torch._nodes.job_secret import JobSecret

    counts: Counter[str] = Counter()
    said: list[str] = []
    nodes = [Node(store.port, i, 3, counts) for i in range(3)]
    for node in nodes:
        node.ledger.secret = JobSecret("s3cret")
        node.ledger.say = said.append
        node.__enter__()
        node.ledger.met()
    stranger = Node(store.port, 9, 3, counts)  # no secret: what it posts proves nothing
    try:
        deadline = time.monotonic() + 30
        while not all(node._waiting for node in nodes):
            assert time.monotonic() < deadline, "the watches never began to wait"
            time.sleep(0.05)
        stranger.settle(_failure(9, RAISED))
        time.sleep(1.0)
        assert all(node.stopped_at is None for node in nodes), "a stranger's post stopped a node"
        assert any("does not prove the job's secret" in line for line in said), said
        first = nodes[1].settle(_failure(1, RAISED))  # a node of the job's: it stops the others
        assert first.rank == 1
        deadline = time.monotonic() + 10
        while nodes[0].stopped_at is None or nodes[2].stopped_at is None:
            assert time.monotonic() < deadline, "a post of the job's stopped no node"
            time.sleep(0.01)
        assert nodes[0].remote is not None and nodes[0].remote.rank == 1
    finally:
        for node in [*nodes, stranger]:
            node.__exit__(None, None, None)


@pytest.mark.parametrize(
    ("line", "said"),
    [
        (
            "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            "[192.168.77.1]:28059: Connection reset by peer. This is typically caused by a remote worker hanging "
            "or bugs in the application. Check the logs of the remote worker before reporting an error. GLHF! 🏖️",
            "RuntimeError: Read error [192.168.77.1]: Connection reset by peer",
        ),
        (
            "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection "
            "closed by peer [10.79.0.1]:58084. This is typically caused by a remote worker crashing. Check the "
            "logs of the remote worker before reporting an error. GLHF! 🏖️",
            "RuntimeError: Connection closed by peer [10.79.0.1]",
        ),
    ],
    ids=["read error", "closed by peer"],
)
def test_a_lost_peers_gloo_line_is_said_without_gloos_source_guess_and_port(line, said):
    from phalanx_torch._launch.failures import what_happened

    assert what_happened(line) == said
