"""The job's state in etcd over its v3 API (``phalanx_torch._nodes.etcd3``), on a
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
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from phalanx_core.testing.processes import scheduler_free_environment
from phalanx_torch._nodes import etcd3 as _etcd3


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
    """``size`` etcd members on loopback (clients over TLS where ``tls``
    gives the certificates' folder: :func:`_certificates`'s); ``kill(i)``
    ends member ``i`` with SIGKILL."""

    def __init__(self, folder: Path, size: int = 3, tls: Path | None = None, *flags: str) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            pytest.fail("the multihost session installs etcd-server (Debian's etcd 3.4); it is missing")
        ports = _free_ports(2 * size)
        self.clients = ports[:size]
        peers = ports[size:]
        names = [f"m{i}" for i in range(size)]
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(names, peers, strict=True))
        self.scheme = "https" if tls else "http"
        served = []
        if tls:  # every client shows a certificate the CA signed
            served = ["--cert-file", str(tls / "server.pem"), "--key-file", str(tls / "server.key"),
                      "--trusted-ca-file", str(tls / "ca.pem"), "--client-cert-auth"]  # fmt: skip
        self.tls = tls
        self.members = []
        for name, client, peer in zip(names, self.clients, peers, strict=True):
            argv = [
                etcd, "--name", name, "--data-dir", str(folder / name), "--log-level", "error",
                "--listen-client-urls", f"{self.scheme}://127.0.0.1:{client}",
                "--advertise-client-urls", f"{self.scheme}://127.0.0.1:{client}",
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", cluster, "--initial-cluster-state", "new", *served, *flags,
            ]  # fmt: skip
            self.members.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.endpoints = [("127.0.0.1", port) for port in self.clients]

    def access(self, **given: str) -> _etcd3.Access:
        """This test's client: over TLS with the test CA and client
        certificate where the cluster speaks TLS."""
        if not self.tls:
            return _etcd3.Access(**given)
        files = {name: str(self.tls / f) for name, f in (("cacert", "ca.pem"), ("cert", "client.pem"),
                                                         ("key", "client.key"))}  # fmt: skip
        return _etcd3.Access(tls=True, **{**files, **given})

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + 60
        context = self.access().context()
        for port in self.clients:
            while True:
                try:
                    url = f"{self.scheme}://127.0.0.1:{port}/health"
                    with urllib.request.urlopen(url, timeout=2, context=context) as answer:
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


def test_compare_set_and_the_multi_key_calls_behave_as_tcpstores(cluster):
    """What the counted rounds ask of a store, as ``TCPStore`` answers it:
    ``compare_set`` with ``""`` sets a missing key once (the first writer
    wins, every caller reads the winner), swaps an expected value, and
    leaves another; ``multi_set`` writes at once, ``multi_get`` reads."""
    import torch.distributed as dist

    store = _etcd3.job_store(cluster.endpoints, "/phalanx/test/swap", 30)
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for each in (store, tcp):
        assert each.compare_set("end", "", "3") == b"3"
        assert each.compare_set("end", "", "2") == b"3"  # closed already: the first end stays
        assert each.compare_set("end", "3", "4") == b"4"
        assert each.compare_set("end", "9", "5") == b"4"
        assert each.compare_set("none", "x", "y") == b"x"  # TCPStore's answer, missing key
        assert not each.check(["none"])
        each.multi_set(["r/1", "r/2"], ["0", "1"])
        assert each.multi_get(["r/2", "r/1"]) == [b"1", b"0"]
        many = [f"m/{i}" for i in range(300)]  # more than etcd's 128 operations in one transaction
        each.multi_set(many, [str(i) for i in range(300)])
        assert each.multi_get(many) == [str(i).encode() for i in range(300)]
    cluster.kill(1)  # a member lost: the next member answers
    assert store.compare_set("end", "4", "6") == b"6"


def test_nodes_entering_at_once_get_every_place_once(cluster):
    """``enter``, how a node joins a round in etcd: 40 clients at once get
    the places 1..40, each once; ``entered`` counts them."""
    from concurrent.futures import ThreadPoolExecutor

    stores = [_etcd3.job_store(cluster.endpoints, "/phalanx/test/enter", 30) for _ in range(40)]
    assert stores[0].entered("r/0/joined") == 0
    with ThreadPoolExecutor(40) as pool:
        places = sorted(pool.map(lambda store: store.enter("r/0/joined"), stores))
    assert places == list(range(1, 41))
    assert stores[1].entered("r/0/joined") == 40 and stores[1].entered("r/1/joined") == 0


def test_a_place_is_counted_as_the_store_was_and_where_that_was_compacted_from_the_keys(cluster):
    """A place (``enter``) is the count of entrants as the store was at the
    entrant's own revision: one small read, whatever the number of nodes.
    Where etcd has compacted that revision away, the keys made by then are
    counted instead: the same answer."""
    client = _etcd3.Etcd3(cluster.endpoints)
    client.put(b"/phalanx/test/history/e/1", b"1")
    client.put(b"/phalanx/test/history/e/2", b"1")
    (second,), now = client.read([b"/phalanx/test/history/e/2"])
    assert second is not None
    made = int(second["create_revision"])
    client.put(b"/phalanx/test/history/e/3", b"1")
    assert client.keys(b"/phalanx/test/history/e/", made) == 2  # at its revision: the third not yet there
    assert client.keys(b"/phalanx/test/history/e/") == 3
    (_,), now = client.read([b"/phalanx/test/history/e/3"])
    client.call("kv/compaction", {"revision": str(now), "physical": True})
    with pytest.raises(_etcd3.EtcdRequestError, match="compacted"):  # what etcd says of such a read
        client.call("kv/range", {"key": _etcd3._b64(b"/x"), "count_only": True, "revision": str(made)})
    assert client.keys(b"/phalanx/test/history/e/", made) == 2


def test_a_cluster_without_a_majority_is_named_with_what_to_do(cluster):
    from phalanx_core import UnavailableError
    from phalanx_torch._nodes.job_store import _check_etcd
    from phalanx_torch._nodes.rendezvous_place import RendezvousPlace

    cluster.kill(0)
    cluster.kill(1)
    place = RendezvousPlace("etcd", tuple(cluster.endpoints), "job")
    with pytest.raises(UnavailableError) as info:
        _check_etcd(place, 3)
    said = str(info.value)
    assert "answered, but no read of the job's keys succeeded within 3 s" in said, said
    assert "Bring a majority of its members up" in said and "--rendezvous c10d" in said, said


# -- TLS and users ---------------------------------------------------------


def _certificates(folder: Path) -> Path:
    """A throw-away CA (``ca.pem``), the members' certificate for
    127.0.0.1 (``server.pem``/``.key``) and two clients', one without a
    CommonName (``client``) and one with (``named``), made with openssl."""
    folder.mkdir()

    def openssl(*argv: str) -> None:
        subprocess.run(["openssl", *argv], cwd=folder, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(
        "req",
        "-x509",
        *key,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=phalanx test CA",
    )
    # The client's certificate has no CommonName: with authentication on,
    # etcd's gateway refuses one that has (named in the last test).
    for name, usage, subject in (
        ("server", "serverAuth,clientAuth", "/CN=server"),
        ("client", "clientAuth", "/O=phalanx"),
        ("named", "clientAuth", "/CN=job"),
    ):
        (folder / f"{name}.ext").write_text(f"subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n")
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")  # fmt: skip
    return folder


@pytest.fixture
def tls_cluster(tmp_path):
    found = Cluster(tmp_path, 1, _certificates(tmp_path / "certificates"))
    try:
        found.wait_healthy()
        yield found
    finally:
        found.close()


def test_over_tls_with_a_client_certificate_the_store_works_and_what_is_missing_is_named(tls_cluster):
    from phalanx_core import UnavailableError
    from phalanx_torch._nodes.job_store import _check_etcd
    from phalanx_torch._nodes.rendezvous_place import parse_rendezvous

    store = _etcd3.job_store(tls_cluster.endpoints, "/phalanx/tls/store", 30, tls_cluster.access())
    store.set("a", "1")
    threading.Timer(0.3, lambda: store.set("b", "2")).start()
    assert store.get("b") == b"2" and store.add("n", 2) == 2  # a watch over TLS too
    assert store.compare_set("end", "", "1") == b"1"

    port = tls_cluster.clients[0]
    certificates = tls_cluster.tls
    query = f"cacert={certificates}/ca.pem&cert={certificates}/client.pem&key={certificates}/client.key"
    place = parse_rendezvous(f"etcd+https://127.0.0.1:{port}/job?{query}", "127.0.0.1", 29500)
    assert place.access.tls and place.access.cert == f"{certificates}/client.pem"
    _check_etcd(place, 5)  # answers
    assert "over TLS" in place.describe()

    def refused(url: str) -> str:
        with pytest.raises(UnavailableError) as info:
            _check_etcd(parse_rendezvous(url, "127.0.0.1", 29500), 5)
        return str(info.value)

    # Plain HTTP to a member that speaks TLS.
    said = refused(f"etcd://127.0.0.1:{port}/job")
    assert "speaks TLS, and a plain-HTTP request is closed unanswered" in said and "etcd+https://" in said, (
        said
    )
    # The member's certificate, without the CA that signed it.
    said = refused(
        f"etcd+https://127.0.0.1:{port}/job?cert={certificates}/client.pem&key={certificates}/client.key"
    )
    assert "not one this client trusts" in said and "cacert=PATH" in said, said
    # No client certificate where the member asks for one.
    said = refused(f"etcd+https://127.0.0.1:{port}/job?cacert={certificates}/ca.pem")
    assert "TLS failed" in said, said
    assert "asks for a client certificate: give cert=PATH and key=PATH" in said, said


def test_tls_to_a_member_that_speaks_plain_http_is_named(cluster):
    from phalanx_core import UnavailableError
    from phalanx_torch._nodes.job_store import _check_etcd
    from phalanx_torch._nodes.rendezvous_place import parse_rendezvous

    with pytest.raises(
        UnavailableError, match=r"speaks plain HTTP, not TLS: use etcd://, not etcd\+https://"
    ):
        _check_etcd(parse_rendezvous(f"etcd+https://127.0.0.1:{cluster.clients[0]}/job", "127.0.0.1", 1), 5)


def _enable_auth(cluster: Cluster, password: str) -> None:
    """Users ``root`` and ``job`` (read and write under ``/phalanx/``),
    both with ``password``; authentication on."""
    client = _etcd3.Etcd3(cluster.endpoints, access=cluster.access())
    prefix = _etcd3._b64(b"/phalanx/")
    end = _etcd3._b64(b"/phalanx0")  # the end of the prefix's range ("/" + 1)
    for path, body in (
        ("auth/role/add", {"name": "root"}),
        ("auth/user/add", {"name": "root", "password": password}),
        ("auth/user/grant", {"user": "root", "role": "root"}),
        ("auth/role/add", {"name": "jobs"}),
        (
            "auth/role/grant",
            {"name": "jobs", "perm": {"permType": "READWRITE", "key": prefix, "range_end": end}},
        ),
        ("auth/user/add", {"name": "job", "password": password}),
        ("auth/user/grant", {"user": "job", "role": "jobs"}),
        ("auth/enable", {}),
    ):
        client.call(path, body)


def test_a_user_with_its_password_reaches_a_cluster_with_authentication_on(tmp_path, monkeypatch):
    # Tokens live 2 s here (etcd's default: 300 s idle): a client whose
    # token expired asks for a new one and goes on.
    from phalanx_core import MisconfigurationError, UnavailableError
    from phalanx_torch._nodes.job_store import _check_etcd
    from phalanx_torch._nodes.rendezvous_place import parse_rendezvous

    cluster = Cluster(tmp_path, 1, None, "--auth-token-ttl", "2")
    try:
        cluster.wait_healthy()
        _enable_auth(cluster, "s3cret")
        port = cluster.clients[0]
        monkeypatch.setenv("PHALANX_ETCD_PASSWORD", "s3cret")
        place = parse_rendezvous(f"etcd://127.0.0.1:{port}/job?user=job", "127.0.0.1", 1)
        assert place.access.user == "job" and "s3cret" not in repr(place)
        _check_etcd(place, 5)
        store = _etcd3.job_store(place.endpoints, "/phalanx/job/store", 30, place.access)
        assert store.add("n", 1) == 1

        def token() -> str:
            return _etcd3._TOKENS[store.client._user_key]

        first = token()
        # Another client of this process sends the same token (etcd spends
        # some 50 ms of bcrypt on each authentication).
        _etcd3.job_store(place.endpoints, "/phalanx/job/store", 30, place.access).set("x", "1")
        assert token() == first
        time.sleep(3.5)  # the token expires
        assert store.add("n", 1) == 2 and token() != first
        threading.Timer(0.3, lambda: store.set("w", "1")).start()
        assert store.get("w") == b"1"
        # Outside its role's keys, the user is refused, not retried.
        with pytest.raises(_etcd3.EtcdRequestError, match="permission denied"):
            store.client.put(b"/elsewhere", b"x")

        monkeypatch.setenv("PHALANX_ETCD_PASSWORD", "wrong")
        with pytest.raises(UnavailableError) as info:
            _check_etcd(parse_rendezvous(f"etcd://127.0.0.1:{port}/job?user=job", "127.0.0.1", 1), 5)
        said = str(info.value)
        assert "etcd refused the job's first read" in said and "authentication failed" in said, said
        assert "check user='job' and its password in PHALANX_ETCD_PASSWORD" in said, said
        with pytest.raises(UnavailableError, match=r"authentication on needs \?user=NAME in --rendezvous"):
            _check_etcd(parse_rendezvous(f"etcd://127.0.0.1:{port}/job", "127.0.0.1", 1), 5)
        monkeypatch.delenv("PHALANX_ETCD_PASSWORD")
        with pytest.raises(
            MisconfigurationError, match="user='job' needs its password in PHALANX_ETCD_PASSWORD"
        ):
            parse_rendezvous(f"etcd://127.0.0.1:{port}/job?user=job", "127.0.0.1", 1)
    finally:
        cluster.close()


def _two_nodes(url: str, tag: str, **variables: str) -> tuple[list[int], list[tuple[str, str]]]:
    """``phalanx run`` of run_scripts/report.py on two nodes on loopback
    that meet at ``url``: their exit codes and (stdout, stderr)."""
    script = str(Path(__file__).resolve().parents[1] / "run_scripts" / "report.py")
    run = [sys.executable, "-m", "phalanx", "run", "--strategy", "ddp", "--accelerator", "cpu",
           "--devices", "1", "--num-nodes", "2", "--main-address", "127.0.0.1", "--rendezvous", url]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [*run, "--node-rank", str(node), script, tag],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=scheduler_free_environment(**variables),
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=180) for node in nodes]
    return [int(node.returncode) for node in nodes], outputs


def test_a_job_on_two_nodes_meets_in_etcd_over_tls_as_a_user(tmp_path, monkeypatch):
    # phalanx run on two nodes (loopback), the rendezvous in a 1-member etcd
    # that speaks only TLS with client certificates, with authentication on.
    cluster = Cluster(tmp_path, 1, _certificates(tmp_path / "certificates"))
    try:
        cluster.wait_healthy()
        _enable_auth(cluster, "pw")
        certificates = cluster.tls
        url = (f"etcd+https://127.0.0.1:{cluster.clients[0]}/tls-job?cacert={certificates}/ca.pem"
               f"&cert={certificates}/client.pem&key={certificates}/client.key&user=job")  # fmt: skip
        codes, outputs = _two_nodes(url, "TLS", PHALANX_ETCD_PASSWORD="pw")
        lines = []
        for code, (out, err) in zip(codes, outputs, strict=True):
            assert code == 0, err[-3000:]
            lines += [line for line in out.splitlines() if "TLS strategy=" in line]
        assert sorted(line.split()[-2:] for line in lines) == [["world=2", "rank=0"], ["world=2", "rank=1"]]
        # The job's state is where the URL said, written as the user.
        client = _etcd3.Etcd3(cluster.endpoints, access=cluster.access(user="job", password="pw"))
        found, _ = client.read([b"/phalanx/tls-job/store/phalanx/rdzv/0/closed"])  # the first round's end
        assert found[0] is not None
        # A client certificate with a CommonName, which the gateway refuses
        # while authentication is on, is named with what to do.
        from phalanx_core import UnavailableError
        from phalanx_torch._nodes.job_store import _check_etcd
        from phalanx_torch._nodes.rendezvous_place import parse_rendezvous

        named = url.replace("client.pem", "named.pem").replace("client.key", "named.key")
        monkeypatch.setenv("PHALANX_ETCD_PASSWORD", "pw")
        with pytest.raises(UnavailableError, match="give a client certificate without one"):
            _check_etcd(parse_rendezvous(named, "127.0.0.1", 1), 5)
    finally:
        cluster.close()


def test_a_job_name_that_an_ended_job_used_is_refused_naming_it(cluster):
    # A job on two nodes (loopback) ends well; the same command again finds
    # the name's rendezvous closed for good: every node says so, and what
    # to do, instead of "another node ended the job".
    url = f"etcd://127.0.0.1:{cluster.clients[0]}/reused"
    for attempt in ("first", "again"):
        codes, outputs = _two_nodes(url, "REUSED")
        if attempt == "first":
            assert codes == [0, 0], outputs
            continue
        assert codes == [1, 1], outputs
        for _, err in outputs:
            assert (
                "phalanx run: error: the job name 'reused' belongs to a job that ended (etcd at "
                f"127.0.0.1:{cluster.clients[0]} (job 'reused')): its rendezvous is closed for good"
            ) in err, err[-3000:]
            assert "etcdctl del --prefix /phalanx/reused/" in err
            assert "REUSED strategy=" not in err


def test_a_server_that_is_not_etcd_is_named_as_such(tmp_path):
    # A web server where the URL says etcd (a wrong port, a proxy):
    # Python's own, which answers POST with 501 and has no /version.
    from phalanx_core import UnavailableError
    from phalanx_torch._nodes.job_store import _check_etcd
    from phalanx_torch._nodes.rendezvous_place import parse_rendezvous

    (port,) = _free_ports(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the web server did not start"
                time.sleep(0.1)
        started = time.monotonic()
        with pytest.raises(UnavailableError) as info:
            _check_etcd(parse_rendezvous(f"etcd://127.0.0.1:{port}/job", "127.0.0.1", 1), 20)
        said = str(info.value)
        assert "a server answered, but not on etcd's v3 API" in said and "HTTP 501" in said, said
        assert "Use etcd 3.4 or later" in said, said
        assert time.monotonic() - started < 10  # named at once, not after the 20 s of patience
    finally:
        server.kill()
        server.wait(30)
