"""The job's state in etcd over its v3 API (``phalanx_torch._etcd3``), on a
real etcd cluster of three members on loopback (Debian's etcd 3.4, started
as etcd 3.6 always runs: without the v2 API): the store's operations, its
blocking waits, counts that stay exact while the member every client talks
to is killed with SIGKILL, and the dynamic rendezvous' compare-and-swap.
The whole job over etcd, across hosts, is in test_elastic.py.
"""

from __future__ import annotations

import datetime
import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from phalanx_torch import _etcd3


def _free_ports(count: int) -> list[int]:
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


class Cluster:
    """Three etcd members on loopback; ``kill(i)`` ends member ``i`` with
    SIGKILL."""

    def __init__(self, folder: Path) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            pytest.fail("the multihost session installs etcd-server (Debian's etcd 3.4); it is missing")
        ports = _free_ports(6)
        self.clients = ports[:3]
        peers = ports[3:]
        names = [f"m{i}" for i in range(3)]
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, peers, strict=True))
        self.members = []
        for name, client, peer in zip(names, self.clients, peers, strict=True):
            argv = [
                etcd, "--name", name, "--data-dir", str(folder / name), "--log-level", "error",
                "--listen-client-urls", f"http://127.0.0.1:{client}",
                "--advertise-client-urls", f"http://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new",
            ]  # fmt: skip
            self.members.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.endpoints = [("127.0.0.1", port) for port in self.clients]

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 60
        for port in self.clients:
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                        if json.load(answer).get("health") == "true":
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "the etcd cluster did not become healthy"
                time.sleep(0.2)

    def kill(self, index: int) -> None:
        self.members[index].kill()
        self.members[index].wait(30)

    def close(self) -> None:
        for member in self.members:
            if member.poll() is None:
                member.kill()
            member.wait(30)


@pytest.fixture
def cluster(tmp_path):
    found = Cluster(tmp_path)
    try:
        found.wait_healthy()
        yield found
    finally:
        found.close()
    assert all(member.poll() is not None for member in found.members)


def test_the_store_sets_reads_waits_and_counts_on_the_v3_api(cluster):
    store = _etcd3.job_store(cluster.endpoints, "/phalanx/test/store", 30)
    store.set("a", b"\x00\xffbytes")
    assert store.get("a") == b"\x00\xffbytes"
    assert store.check(["a"]) and not store.check(["a", "b"])
    assert [store.add("n", 3), store.add("n", -1), store.add("n", 0)] == [3, 2, 2]
    # A blocking read returns when another client writes the key.
    threading.Timer(
        0.5, lambda: _etcd3.job_store(cluster.endpoints, "/phalanx/test/store", 30).set("b", "x")
    ).start()
    started = time.monotonic()
    assert store.get("b") == b"x"
    assert 0.4 < time.monotonic() - started < 10
    with pytest.raises(LookupError, match=r"etcd: no key /phalanx/test/store/never within 0.5 s"):
        store.wait(["never"], datetime.timedelta(seconds=0.5))
    # Through torch's PrefixStore, as the rounds and the node watch use it.
    import torch.distributed as dist

    prefixed = dist.PrefixStore("round/1", store)
    prefixed.set("k", "v")
    assert store.get("round/1/k") == b"v" and prefixed.add("c", 2) == 2


def test_counts_stay_exact_while_the_member_every_client_talks_to_is_killed(cluster):
    # Four threads add 1 a hundred times each, every client starting with
    # member 0; member 0 is killed with SIGKILL midway. A request whose
    # answer the kill lost is sent again to another member: it must count
    # once (the v2 store's compare-and-set, sent again, counted twice).
    stores = [_etcd3.job_store(cluster.endpoints, "/phalanx/test/count", 30) for _ in range(4)]
    done = [0] * 4
    errors: list[Exception] = []

    def count(index: int) -> None:
        try:
            for _ in range(100):
                stores[index].add("n", 1)
                done[index] += 1
        except Exception as exc:  # noqa: BLE001 - any error of a thread fails the test
            errors.append(exc)

    threads = [threading.Thread(target=count, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    while sum(done) < 120:
        time.sleep(0.01)
    cluster.kill(0)
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    assert done == [100] * 4
    assert stores[0].add("n", 0) == 400


def test_a_member_that_stops_answering_is_passed_over_by_every_new_client(cluster, monkeypatch):
    # A member that takes connections but never answers (SIGSTOP: as a
    # host lost without a word, or a hung etcd): a request to it times
    # out, the request goes to the next member, and a client made later in
    # this process starts with that next member rather than waiting out
    # the same timeout again (the rendezvous makes a new client per round).
    import signal

    monkeypatch.setattr(_etcd3, "REQUEST_TIMEOUT", 1.0)
    endpoints = [cluster.endpoints[2], *cluster.endpoints[:2]]
    cluster.members[2].send_signal(signal.SIGSTOP)
    try:
        store = _etcd3.job_store(endpoints, "/phalanx/test/stopped", 30)
        # Member 2 times out; member 0 answers, or member 1 where member 2
        # was the leader and the others were still electing one (member 0
        # timed out too: once in 6 runs of the loop under load).
        store.set("a", "1")
        answered = store.client._member()
        assert answered != cluster.endpoints[2]
        assert _etcd3.Etcd3(endpoints)._member() == answered
        assert _etcd3.job_store(endpoints, "/phalanx/test/stopped", 30).get("a") == b"1"
    finally:
        cluster.members[2].send_signal(signal.SIGCONT)


def test_the_rendezvous_state_is_swapped_on_its_revision(cluster):
    backend = _etcd3.rendezvous_backend(cluster.endpoints, "/phalanx/test/rendezvous/run")
    assert backend.get_state() is None
    state, token, wrote = backend.set_state(b"first")
    assert (state, wrote) == (b"first", True)
    assert backend.set_state(b"second", token)[::2] == (b"second", True)
    # A write against a revision already replaced fails and reads the state.
    assert backend.set_state(b"stale", token)[::2] == (b"second", False)
    # A new state (no token) where one exists fails too.
    assert backend.set_state(b"new")[::2] == (b"second", False)
    cluster.kill(1)  # a member lost: the next member answers
    assert backend.get_state()[0] == b"second"


def test_a_cluster_without_a_majority_is_named_with_what_to_do(cluster):
    from phalanx_core import UnavailableError
    from phalanx_torch._rounds import RendezvousPlace, _check_etcd

    cluster.kill(0)
    cluster.kill(1)
    place = RendezvousPlace("etcd", tuple(cluster.endpoints), "job")
    with pytest.raises(UnavailableError) as info:
        _check_etcd(place, 3)
    said = str(info.value)
    assert "answered, but no read of the job's keys succeeded within 3 s" in said, said
    assert "Bring a majority of its members up" in said and "--rendezvous c10d" in said, said
