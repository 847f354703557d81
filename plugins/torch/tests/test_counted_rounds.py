"""phalanx's counted rounds (``_nodes/counted_rounds.py``) on a real TCPStore on
loopback: nodes are threads, each with a client of its own, as each node's
launching process has one. What the multi-node launches do with them is in
tests/multihost/test_elastic.py and test_nodes.py."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections import Counter
from typing import Any

import pytest

dist = pytest.importorskip("torch.distributed")

from counting_store import Counted  # noqa: E402

from phalanx_core.launching import hosted_store  # noqa: E402
from phalanx_torch._nodes.counted_rounds import CountedRounds  # noqa: E402


@pytest.fixture
def store():
    # On loopback only (a TCPStore server made by torch listens on every
    # interface, and test_launchers checks that this process listens on
    # none but loopback).
    return hosted_store("127.0.0.1", 0, timeout=datetime.timedelta(seconds=30))


def client(server: Any, counts: Counter[str] | None = None) -> Any:
    inner = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=30))
    return Counted(inner, counts) if counts is not None else inner


def node(
    server: Any,
    name: str,
    *,
    least: int,
    most: int,
    timeout: float = 20.0,
    last_call: float = 1.0,
    counts: Counter[str] | None = None,
    node_rank: int | None = None,
) -> CountedRounds:
    return CountedRounds(
        client(server, counts),
        "job",
        min_nodes=least,
        max_nodes=most,
        join_timeout=timeout,
        last_call=last_call,
        address=name,
        node_rank=node_rank,
    )


def meet(nodes: list[CountedRounds], delays: dict[int, float] | None = None) -> dict[int, Any]:
    """Every node's next_rendezvous in a thread of its own: {index: (rank, world, round) or the error}."""
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        time.sleep((delays or {}).get(i, 0.0))
        try:
            store, rank, world, address = nodes[i].next_rendezvous()
            store.set(f"hello/{rank}", address)  # the round's store works
            results[i] = (rank, world, nodes[i].round)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads), "a node never left its rendezvous"
    return results


def test_a_full_round_closes_at_once_with_a_rank_for_each_node(store):
    counts: Counter[str] = Counter()
    nodes = [node(store, f"n{i}", least=3, most=4, last_call=30, counts=counts) for i in range(4)]
    start = time.monotonic()
    results = meet(nodes)
    took = time.monotonic() - start
    assert took < 10  # max_nodes joined: no last call (30 s) waited
    assert sorted(r[0] for r in results.values()) == [0, 1, 2, 3]
    assert {r[1:] for r in results.values()} == {(4, 0)}
    # A few small requests a node, whatever the number of nodes (no state
    # blob), less meet()'s own set in the round's store; and the looks at
    # one key while the others join, one every poll.
    assert (sum(counts.values()) - counts["check"] - 4) / 4 <= 8, counts
    assert counts["check"] <= 4 * (took / nodes[0].poll() + 3), (counts, took)


def test_with_min_nodes_the_round_closes_after_the_last_call_and_a_late_node_waits_in_the_next(store):
    nodes = [node(store, f"n{i}", least=2, most=3, last_call=1.0) for i in range(3)]
    first = meet(nodes[:2])
    assert sorted(first.values()) == [(0, 2, 0), (1, 2, 0)]
    assert nodes[0].num_nodes_waiting() == 0
    # The third node comes after the round closed: it joins round 1, and the
    # nodes of round 0 see it waiting (what makes the rank loop restart).
    late: dict[int, Any] = {}
    thread = threading.Thread(target=lambda: late.update(meet([nodes[2]])))
    thread.start()
    deadline = time.monotonic() + 10
    while nodes[0].waiting_now() == 0:
        assert time.monotonic() < deadline, "the late node was never seen waiting"
        time.sleep(0.05)
    again = meet(nodes[:2])  # the agents restart: all three meet in round 1
    thread.join(30)
    assert sorted([*again.values(), *late.values()]) == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]


def test_a_node_that_restarts_meets_the_others_in_the_next_round(store):
    nodes = [node(store, f"n{i}", least=2, most=2) for i in range(2)]
    assert {r[2] for r in meet(nodes).values()} == {0}
    assert {r[2] for r in meet(nodes, delays={1: 0.5}).values()} == {1}
    assert {r[2] for r in meet(nodes, delays={0: 0.5}).values()} == {2}


def test_too_few_nodes_time_out_and_a_node_that_comes_after_meets_none_of_them(store):
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    nodes = [node(store, f"n{i}", least=3, most=3, timeout=1.5) for i in range(2)]
    results = meet(nodes)
    assert all(isinstance(r, RendezvousTimeoutError) for r in results.values()), results
    assert nodes[0].joined() == ["n0", "n1"]  # for the message: who joined
    # Round 0 was left (and round 1 too, where the node that timed out
    # second went on to first): a node that comes now does not close a
    # round with nodes that are gone; it meets in a round of its own.
    later = node(store, "n2", least=1, most=3, last_call=0.2)
    (rank, world, round_) = meet([later])[0]
    assert (rank, world) == (0, 1) and round_ in (1, 2)


def test_a_closed_job_stops_the_nodes_waiting_to_meet(store):
    from torch.distributed.elastic.rendezvous import RendezvousClosedError

    nodes = [node(store, f"n{i}", least=3, most=3, timeout=60) for i in range(3)]
    closer = threading.Timer(0.5, nodes[2].shutdown)
    closer.start()
    start = time.monotonic()
    results = meet(nodes[:2])
    assert all(isinstance(r, RendezvousClosedError) for r in results.values()), results
    assert time.monotonic() - start < 30  # a look (every 1 s) after the close, not the 60 s join timeout
    assert nodes[0].is_closed()


def test_many_nodes_form_one_round_with_a_bounded_number_of_requests_each(store):
    counts: Counter[str] = Counter()
    n = 48
    nodes = [node(store, f"n{i}", least=n - 1, most=n, last_call=1.0, counts=counts) for i in range(n)]
    start = time.monotonic()
    results = meet(nodes)
    took = time.monotonic() - start
    assert sorted(r[0] for r in results.values()) == list(range(n))
    assert {r[1] for r in results.values()} == {n}
    # Joining and closing: a few requests a node (less meet()'s own set in
    # the round's store; with the read of who left the round before);
    # waiting: one look every poll (0.1 s here).
    assert (sum(counts.values()) - counts["check"] - n) / n <= 7, counts
    assert counts["check"] <= n * (took / nodes[0].poll() + 3), (counts, took)


def test_node_ranks_follow_the_ranks_the_nodes_were_started_with_and_stay_where_they_were(store):
    # A last call long enough that the node joining 0.6 s late is in the
    # first round however loaded the machine (the full round closes at once).
    nodes = [node(store, f"n{i}", least=2, most=3, node_rank=i, last_call=3.0) for i in range(3)]
    # Node 2 joins first, node 0 last: the ranks are still the started ones.
    first = meet(nodes, delays={0: 0.6, 1: 0.3})
    assert {i: r[0] for i, r in first.items()} == {0: 0, 1: 1, 2: 2}
    # Node 1 is lost: the others keep their order (0 stays 0, 2 becomes 1),
    # and meet again in that order whichever joins first.
    second = meet([nodes[0], nodes[2]], delays={0: 0.3})
    assert {i: r[:2] for i, r in second.items()} == {0: (0, 2), 1: (1, 2)}
    # Every node that met is told which node of the round before did not
    # come back (node rank, address, host name), and which round that was.
    host = socket.gethostname()
    assert [(n.previous, n.left) for n in (nodes[0], nodes[2])] == [(0, [(1, "n1", host)])] * 2
    third = meet([nodes[0], nodes[2]], delays={0: 0.3})
    assert {i: r[:2] for i, r in third.items()} == {0: (0, 2), 1: (1, 2)}
    assert [(n.previous, n.left) for n in (nodes[0], nodes[2])] == [(1, [])] * 2
    # A new node started with the lost node's rank is not taken for it: it
    # is another node (another launching process), and node 2 of round 2
    # is the one that did not come back (its rank there was 1).
    fourth = meet([nodes[0], node(store, "n3", least=2, most=3, node_rank=1, last_call=3.0)], delays={0: 0.3})
    assert {i: r[:2] for i, r in fourth.items()} == {0: (0, 2), 1: (1, 2)}
    assert (nodes[0].previous, nodes[0].left) == (2, [(1, "n2", host)])


class _SlowToCount:
    """A node's client whose add to the job's restart count reaches the
    store ``delay`` seconds late (as on a loaded host)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self._inner, self._delay = inner, delay

    def add(self, key: str, amount: int) -> int:
        if key == "phalanx/restarts" and amount:
            time.sleep(self._delay)
        return int(self._inner.add(key, amount))


def test_a_rounds_failure_is_counted_once_and_read_the_same_on_every_node(store):
    """Two nodes see round 0 fail: the one that counts it is slow to add to
    the job's count; the other must still read the count with this
    failure in it (read too soon, a job out of restarts restarted once more)."""
    from phalanx_torch._nodes.rounds import _handler_class

    handlers = []
    for slow in (True, False):
        job = client(store)
        handler = _handler_class()(None, _SlowToCount(job, 1.0) if slow else job, "", 30.0)
        handler.round_store = dist.PrefixStore("round-0", client(store))
        handlers.append(handler)
    counts: dict[str, int] = {}
    first = threading.Thread(target=lambda: counts.setdefault("slow", handlers[0].count_failure()))
    first.start()
    deadline = time.monotonic() + 10
    while not handlers[1].failed() and time.monotonic() < deadline:  # the slow node took the count
        time.sleep(0.01)
    counts["other"] = handlers[1].count_failure()
    first.join(10)
    assert counts == {"slow": 1, "other": 1}
    assert handlers[1].restarts() == 1  # counted once


# -- the job's secret ------------------------------------------------------------------


def secret_nodes(store: Any, secrets: list[str | None], **options: Any) -> list[CountedRounds]:
    from phalanx_torch._nodes.job_secret import JobSecret

    nodes = [node(store, f"n{i}", node_rank=i, **options) for i in range(len(secrets))]
    for made, secret in zip(nodes, secrets, strict=True):
        made.secret = JobSecret(secret)
    return nodes


def test_a_node_without_the_jobs_secret_gets_no_rank_and_is_named(store):
    from phalanx_torch._nodes.job_secret import SecretRefused

    # n2 joins last with another secret: the round of 3 closes with it, and
    # gives ranks to the two nodes that proved the job's.
    nodes = secret_nodes(store, ["s3cret", "s3cret", "other"], least=3, most=3)
    results = meet(nodes, delays={2: 0.3})
    assert isinstance(results[2], SecretRefused), results
    assert results[0] == (0, 2, 0) and results[1] == (1, 2, 0), results
    assert nodes[0].refused == nodes[1].refused == [(2, "n2", socket.gethostname())]
    *members, proof = bytes(store.get("phalanx/rdzv/0/members")).decode().splitlines()
    assert [line.split()[1] for line in members] == ["n0", "n1"] and proof.startswith("proof ")


def test_a_node_with_no_secret_is_refused_by_a_job_that_has_one(store):
    from phalanx_torch._nodes.job_secret import SecretRefused

    nodes = secret_nodes(store, ["s3cret", None], least=2, most=2)
    results = meet(nodes, delays={1: 0.3})
    assert isinstance(results[1], SecretRefused), results
    assert results[0] == (0, 1, 0), results


def test_a_node_without_the_secret_in_the_first_place_gives_ranks_to_no_node_of_the_jobs(store):
    from phalanx_torch._nodes.job_secret import SecretRefused

    # It joins first (as a node that asks to join a running job does): its
    # place is 1, where the ranks are given; the job's nodes take them from
    # the first place that proves the secret.
    nodes = secret_nodes(store, [None, "s3cret", "s3cret"], least=3, most=3)
    results = meet(nodes, delays={1: 0.3, 2: 0.3})
    assert isinstance(results[0], SecretRefused), results
    assert results[1] == (0, 2, 0) and results[2] == (1, 2, 0), results


def test_a_node_with_another_secret_in_the_first_place_is_refused_too(store):
    from phalanx_torch._nodes.job_secret import SecretRefused

    nodes = secret_nodes(store, ["other", "s3cret", "s3cret"], least=3, most=3)
    results = meet(nodes, delays={1: 0.3, 2: 0.3})
    assert isinstance(results[0], SecretRefused), results
    assert results[1] == (0, 2, 0) and results[2] == (1, 2, 0), results


def test_ranks_that_do_not_prove_the_secret_are_refused_naming_their_giver(store):
    from phalanx_core import MisconfigurationError
    from phalanx_torch._nodes.job_secret import JobSecret, Signed

    class Forged(JobSecret):
        """Proves its node's entry, but not the ranks it gives: ranks
        rewritten by something that is not a node of the job's."""

        def sign(self, message: Signed, *fields: object) -> str:
            return "0" * 64 if message is Signed.RANK else super().sign(message, *fields)

    nodes = secret_nodes(store, ["s3cret", "s3cret"], least=2, most=2)
    nodes[0].secret = Forged("s3cret")
    results = meet(nodes, delays={1: 0.3})
    assert isinstance(results[1], MisconfigurationError), results
    assert "did not prove the job's secret" in str(results[1]) and "(address n0" in str(results[1])


def test_with_one_secret_every_node_meets_as_without(store):
    nodes = secret_nodes(store, ["s3cret"] * 3, least=3, most=3)
    results = meet(nodes)
    assert sorted(results.values()) == [(0, 3, 0), (1, 3, 0), (2, 3, 0)], results
    assert nodes[0].refused == []


@pytest.mark.parametrize("secret", ["other", None], ids=["another secret", "no secret"])
def test_a_stranger_asking_to_join_a_running_job_starts_no_round_and_is_refused_within_seconds(store, secret):
    from phalanx_torch._nodes.job_secret import SecretRefused

    job = secret_nodes(store, ["s3cret", "s3cret"], least=2, most=3)
    assert sorted(meet(job).values()) == [(0, 2, 0), (1, 2, 0)]
    stranger = secret_nodes(store, [secret], least=2, most=3, timeout=60.0)[0]
    stranger.address, stranger.wanted = "n9", None
    result: list[Any] = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: result.append(meet([stranger])[0]))
    thread.start()
    # The running job's nodes look for nodes waiting to join, as the rank
    # loop does: the stranger is not counted (no new round), and is named
    # by the node that marked it refused first.
    seen = []
    while thread.is_alive() and time.monotonic() - started < 30:
        seen.append([member.waiting_now() for member in job])
        time.sleep(0.2)
    thread.join(30)
    assert isinstance(result[0], SecretRefused), result
    assert time.monotonic() - started < 20, "the stranger waited out its patience instead of being refused"
    assert not any(any(counts) for counts in seen), seen
    named = job[0].turned_away + job[1].turned_away
    assert named == [(-1, "n9", socket.gethostname())], named
    # A node of the job's that asks to join after it is counted, and meets.
    late = secret_nodes(store, ["s3cret"], least=2, most=3)[0]
    late.address, late.wanted = "n2", None
    thread = threading.Thread(target=lambda: result.append(meet([late])[0]))
    thread.start()
    deadline = time.monotonic() + 10
    while job[0].waiting_now() == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job[0].waiting_now() == job[1].waiting_now() == 1
    again = meet(job)
    thread.join(30)
    # The stranger's place in that round does not count among its three
    # nodes, and it is not named again.
    assert sorted([*again.values(), result[1]]) == [(0, 3, 1), (1, 3, 1), (2, 3, 1)], (again, result)
    assert job[0].refused == job[1].refused == []


def test_a_proof_covers_its_messages_fields_and_proves_no_other_message():
    from phalanx_torch._nodes.job_secret import FIELDS, JobSecret, Signed

    secret = JobSecret("s3cret")
    with pytest.raises(TypeError, match="a proof of NODE covers run id, round, place, entry; given 2"):
        secret.sign(Signed.NODE, "job", 1)
    with pytest.raises(TypeError, match="covers"):  # checked without a secret too
        JobSecret(None).proves("-", Signed.RANK, "job")
    proof = secret.sign(Signed.RANK, "job", 1, 2, "3")
    assert secret.proves(proof, Signed.RANK, "job", 1, 2, "3")
    assert not secret.proves(proof, Signed.NODE, "job", 1, 2, "3")  # the same fields, another message
    assert not JobSecret("other").proves(proof, Signed.RANK, "job", 1, 2, "3")
    assert set(FIELDS) == set(Signed)
