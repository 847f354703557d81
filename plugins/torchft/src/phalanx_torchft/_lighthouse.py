"""The way to TorchFT's lighthouse on several hosts: a guard in front of
it, a forwarder on each host, and (with an etcd rendezvous) a lighthouse
elected among the hosts, so that losing its host loses no group.

TorchFT's lighthouse is a gRPC server that asks nothing of who calls it:
whoever reaches it can join the quorum, and heal from the groups (receive
the weights). So on several hosts

* the host that runs the lighthouse binds it to ``127.0.0.1`` and a port
  the kernel gives, and runs a :class:`Guard` on the address and port the
  other hosts reach: each connection first proves the job's secret
  (``PHALANX_JOB_SECRET``, in the handshake of :func:`_client_handshake`:
  each side shows an HMAC of the other's random challenge), then its bytes
  go to the lighthouse and back. A connection that cannot prove it is
  closed, and the guard names its address;
* every host runs a :class:`Forwarder` on ``127.0.0.1``: the groups'
  managers are given its URL as the lighthouse's. It connects to the guard
  of the lighthouse it follows, proves the secret and relays. Where the
  lighthouse moves (below), it closes its connections to the old one, and
  TorchFT's client connects again, through it, to the new one.

With the rendezvous in etcd (``--rendezvous etcd://...``) every host stands
for the lighthouse (:class:`Election`): the one that creates the job's key
``/phalanx/<job>/lighthouse`` under a lease of :data:`LEASE` seconds runs it,
and renews the lease while it does. It stops serving once no renewal has
succeeded for a while (:func:`step_down_after`), less than the lease: a
host cut off the network stops before etcd lets the lease go, and only
then can another host create the key, so two lighthouses never serve at
once. What keeps a part of the job cut off from the rest from committing a
step alone is the quorum's rule: with an elected lighthouse a step needs a
majority of the groups (the launcher's ``min_replicas`` default), which
only one part can have; with ``min_replicas`` given lower, the host stops
serving within half ``heartbeat_timeout``, before its lighthouse could
drop the groups it no longer hears. The others follow the key's value
(the new guard's address) and its creation revision, the lighthouse's
*term*: each host writes the term to a file (``PHALANX_LIGHTHOUSE_TERM``)
that the groups read when they form their group across the quorum, so that
a new lighthouse, whose quorums are numbered from 1 again, never meets
what an old quorum of the same number left in a group's store.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx_torch.nodes import Signed

__all__ = ["LEASE", "STEP_DOWN_AFTER", "Election", "Forwarder", "Guard", "step_down_after"]

#: Seconds of the lighthouse's lease in etcd: how long a lost host's
#: lighthouse holds the job's key (then another host runs one). A step
#: waits ``quorum_timeout`` for its quorum: well above this (10 s by default).
LEASE = 3
#: How often the lighthouse's host renews its lease.
RENEW_EVERY = 0.2
#: Seconds without a renewal after which the lighthouse's host stops
#: serving, where a step needs a majority of the groups
#: (:func:`step_down_after`): less than :data:`LEASE`, so that it stops
#: before another host can start one; long enough to ride out etcd electing
#: a new leader of its own (up to 2 s with etcd's default election timeout,
#: where its leader's member is lost or, without pre-vote, one cut off comes
#: back), during which no renewal succeeds.
STEP_DOWN_AFTER = 2.5


def step_down_after(min_replicas: int, replica_groups: int, heartbeat_timeout: float) -> float:
    """How long the lighthouse's host serves without renewing its lease.
    Where a step needs a majority of the groups, a part of the job cut off
    from the rest never commits alone, and :data:`STEP_DOWN_AFTER`. With
    fewer (``min_replicas`` given lower), the host must stop before its
    lighthouse could drop the groups it no longer hears (after
    ``heartbeat_timeout``) and make a quorum of its own groups alone: half
    ``heartbeat_timeout``, at most 0.6 s (a hiccup of etcd's then moves the
    lighthouse, at the cost of a stall)."""
    if min_replicas > replica_groups // 2:
        return STEP_DOWN_AFTER
    return min(0.6, heartbeat_timeout / 2)


#: Seconds a handshake may take.
HANDSHAKE_TIMEOUT = 5.0
#: Seconds the forwarder's connection to a guard may take to open (a host
#: cut off answers nothing): then it tries again, the lighthouse it follows
#: by then.
CONNECT_TIMEOUT = 1.0
#: Seconds a connection through the forwarder waits for a lighthouse to
#: follow (one being elected), then is closed (TorchFT's client retries).
FOLLOW_WAIT = 10.0
_HELLO = b"phalanx-lighthouse/1"


def _say(line: str) -> None:
    sys.stderr.write(f"phalanx run: {line}\n")
    sys.stderr.flush()


class _Proofs:
    """The handshake's proofs, with the job's secret (``JobSecret``)."""

    def __init__(self) -> None:
        from phalanx_torch.nodes import JobSecret

        self.secret = JobSecret.from_environment()

    def of(self, role: str, *nonces: str) -> str:
        return self.secret.sign(Signed.LIGHTHOUSE, role, *nonces)

    def proves(self, proof: str, role: str, *nonces: str) -> bool:
        return self.secret.proves(proof, Signed.LIGHTHOUSE, role, *nonces)


def _read_line(sock: socket.socket, limit: int = 256) -> str:
    """One line from ``sock`` (without its end), read a byte at a time: the
    bytes after it are the relay's."""
    data = bytearray()
    while len(data) < limit:
        byte = sock.recv(1)
        if not byte:
            raise ConnectionError("closed in the handshake")
        if byte == b"\n":
            return data.decode(errors="replace")
        data += byte
    raise ConnectionError("a handshake line too long")


def _client_handshake(sock: socket.socket, proofs: _Proofs) -> str | None:
    """The forwarder's side: ``None`` where both sides proved the secret,
    else why not."""
    mine = secrets.token_hex(16)
    sock.sendall(_HELLO + b" " + mine.encode() + b"\n")
    theirs, _, proof = _read_line(sock).partition(" ")
    if proofs.secret.on and not proofs.proves(proof, "guard", mine, theirs):
        return "it did not prove the job's secret (its PHALANX_JOB_SECRET is another, or it has none)"
    sock.sendall(proofs.of("forwarder", theirs, mine).encode() + b"\n")
    if _read_line(sock) != "ok":
        return "it refused this host's proof: this host's PHALANX_JOB_SECRET is not the job's, or it has none"
    return None


def _server_handshake(sock: socket.socket, proofs: _Proofs) -> bool:
    """The guard's side: whether the other side proved the secret."""
    hello, _, theirs = _read_line(sock).partition(" ")
    if hello.encode() != _HELLO or not theirs:
        return False
    mine = secrets.token_hex(16)
    sock.sendall(f"{mine} {proofs.of('guard', theirs, mine)}\n".encode())
    proof = _read_line(sock)
    if not proofs.proves(proof, "forwarder", mine, theirs):
        with contextlib.suppress(OSError):
            sock.sendall(b"refused\n")
        return False
    sock.sendall(b"ok\n")
    return True


class _Relays:
    """The connections a guard or forwarder relays, each a pair of sockets
    copied both ways by two threads; all of them closed at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()

    def start(self, a: socket.socket, b: socket.socket) -> None:
        for sock in (a, b):
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = (a, b)
        with self._lock:
            self._pairs.add(pair)
        for source, sink in ((a, b), (b, a)):
            threading.Thread(target=self._copy, args=(source, sink, pair), daemon=True).start()

    def _copy(
        self, source: socket.socket, sink: socket.socket, pair: tuple[socket.socket, socket.socket]
    ) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        self._end(pair)

    def _end(self, pair: tuple[socket.socket, socket.socket]) -> None:
        with self._lock:
            self._pairs.discard(pair)
        for sock in pair:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def close_all(self) -> None:
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            self._end(pair)


class _Listener:
    """A listening socket and the thread that takes its connections."""

    def __init__(
        self, address: str, port: int, name: str, handle: Callable[[socket.socket, Any], None]
    ) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((address, port))
        self._socket.listen(64)
        self.port = int(self._socket.getsockname()[1])
        self._handle = handle
        self._closed = False
        threading.Thread(target=self._accept, name=name, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._socket.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._handle, args=(conn, peer), daemon=True).start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._socket.close()


class _Relaying:
    """A listener and the connections it relays (a guard, a forwarder)."""

    _listener: _Listener
    _relays: _Relays

    def close(self) -> None:
        self._listener.close()
        self._relays.close_all()


class Guard(_Relaying):
    """In front of the lighthouse at ``127.0.0.1:target``: listens on
    ``address:port`` and relays each connection that proves the job's
    secret; names (once each) the addresses of those that do not."""

    def __init__(self, address: str, port: int, target: int) -> None:
        self._proofs = _Proofs()
        self._target = target
        self._relays = _Relays()
        self._named: set[str] = set()
        self._listener = _Listener(address, port, "phalanx-lighthouse-guard", self._serve)
        self.port = self._listener.port

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT)
            proved = _server_handshake(conn, self._proofs)
        except OSError:
            proved = False
        if not proved:
            with contextlib.suppress(OSError):
                conn.close()
            who = str(peer[0])
            if who not in self._named:
                self._named.add(who)
                _say(
                    f"the lighthouse refused a connection from {who}: it did not prove the job's secret "
                    "(PHALANX_JOB_SECRET; every host of the job has the same one in its environment). "
                    "It joins no quorum and heals from no group"
                )
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self._target), timeout=HANDSHAKE_TIMEOUT)
        except OSError:
            conn.close()
            return
        self._relays.start(conn, upstream)


class Forwarder(_Relaying):
    """On ``127.0.0.1`` and a port the kernel gives (:attr:`port`): relays
    each connection (a manager's, to the lighthouse) to the guard it
    follows (:meth:`follow`), after proving the job's secret to it."""

    def __init__(self, term_file: Path | None = None) -> None:
        self._proofs = _Proofs()
        self._target: tuple[str, int] | None = None
        self._term = 0
        self._term_file = term_file
        self._changed = threading.Condition()
        self._relays = _Relays()
        self._refused_said: set[tuple[str, int]] = set()
        #: Why the lighthouse followed did not let this host in, once it did not.
        self.refused: str | None = None
        self._listener = _Listener("127.0.0.1", 0, "phalanx-lighthouse-forwarder", self._serve)
        self.port = self._listener.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def follow(self, address: str, port: int, term: int = 0) -> None:
        """Relay to the guard at ``address:port`` (the lighthouse of
        ``term``) from now on; connections to another one are closed."""
        target = (address, port)
        with self._changed:
            if target == self._target and term == self._term:
                return
            moved = self._target is not None and target != self._target
            self._target, self._term = target, term
            if self._term_file is not None:
                written = self._term_file.with_name(self._term_file.name + ".tmp")
                written.write_text(f"{term}\n")
                written.replace(self._term_file)
            self._changed.notify_all()
        if moved:
            self._relays.close_all()

    def lose(self) -> None:
        """The lighthouse followed is gone: close its connections, and hold
        new ones until another is followed."""
        with self._changed:
            self._target = None
        self._relays.close_all()

    def _serve(self, conn: socket.socket, _peer: Any) -> None:
        """Relay ``conn`` once the lighthouse followed answers: held open
        (TorchFT's client waits in its request) while none is followed or
        the one followed does not answer (its host lost, another being
        elected), for up to :data:`FOLLOW_WAIT` seconds, then closed."""
        deadline = time.monotonic() + FOLLOW_WAIT
        while True:
            with self._changed:
                while self._target is None and time.monotonic() < deadline:
                    self._changed.wait(deadline - time.monotonic())
                target = self._target
            if target is None:
                conn.close()
                return
            try:
                upstream = socket.create_connection(target, timeout=CONNECT_TIMEOUT)
                upstream.settimeout(HANDSHAKE_TIMEOUT)
                refused = _client_handshake(upstream, self._proofs)
                break
            except OSError:
                if time.monotonic() >= deadline:
                    conn.close()
                    return
                with self._changed:  # a moment, or until another lighthouse is followed
                    if self._target == target:
                        self._changed.wait(0.1)
        if refused is not None:
            conn.close()
            upstream.close()
            if target not in self._refused_said:
                self._refused_said.add(target)
                _say(f"the lighthouse at {target[0]}:{target[1]} did not let this host in: {refused}")
            self.refused = f"the lighthouse at {target[0]}:{target[1]} did not let this host in: {refused}"
            return
        self._relays.start(conn, upstream)


class Election:
    """This host's stand for the job's lighthouse in etcd (see the
    module's docstring): it runs one (``start_lighthouse()``, which returns
    the lighthouse's local port and a function that stops it) behind a
    :class:`Guard` on ``address:port`` while it holds the key, and has
    ``forwarder`` follow the one that holds it."""

    def __init__(
        self,
        client: Any,
        job: str,
        address: str,
        port: int,
        start_lighthouse: Callable[[], tuple[int, Callable[[], None]]],
        forwarder: Forwarder,
        step_down_after: float = STEP_DOWN_AFTER,
    ) -> None:
        self._client = client
        self._key = f"/phalanx/{job}/lighthouse".encode()
        self._address, self._port = address, port
        self._start_lighthouse = start_lighthouse
        self._forwarder = forwarder
        self._stopping = threading.Event()
        self._serving: tuple[Guard, Callable[[], None], int] | None = None
        self._renewed = 0.0
        self._step_down_after = step_down_after
        #: Whether this host runs the lighthouse now.
        self.leading = False
        self._thread = threading.Thread(target=self._run, name="phalanx-lighthouse-election", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        from phalanx_torch.nodes import EtcdRequestError

        while not self._stopping.is_set():
            try:
                self._round()
            except (OSError, EtcdRequestError) as exc:  # etcd not reached: again, soon
                self._step_down(f"etcd did not answer ({exc})")
                self._stopping.wait(RENEW_EVERY)

    def _round(self) -> None:
        """Stand once: lead while the lease holds, or follow the leader
        until its key changes."""
        from base64 import b64decode

        client = self._client
        records, _ = client.read([self._key])
        record = records[0]
        if record is None:  # no lighthouse: stand for it
            lease = client.grant(LEASE)
            value = f"{self._address} {self._port}".encode()
            won, revision, found = client.swap(self._key, None, [(self._key, value, lease)], [self._key])
            if won:
                self._lead(lease, revision)
                return
            with contextlib.suppress(Exception):
                client.revoke(lease)
            record = found[0] if found else None
            if record is None:
                return  # gone between the two: stand again
        address, _, port = b64decode(record.get("value", "")).decode().rpartition(" ")
        self._forwarder.follow(address, int(port), int(record["create_revision"]))
        # Until the key changes (its lease ends with its host, or it steps down).
        client.watch(self._key, int(record["mod_revision"]), timeout=5.0)

    def _lead(self, lease: int, term: int) -> None:
        port, stop = self._start_lighthouse()
        guard = Guard(self._address, self._port, port)
        self._serving = (guard, stop, term)
        self.leading = True
        self._renewed = time.monotonic()
        self._forwarder.follow(self._address, guard.port, term)
        _say(f"this host runs the job's lighthouse now (term {term}), at {self._address}:{guard.port}")
        watchdog = threading.Thread(target=self._watch_renewals, daemon=True)
        watchdog.start()
        try:
            while not self._stopping.is_set() and self.leading:
                sent = time.monotonic()
                try:
                    left = self._client.keepalive(lease)
                except (OSError, RuntimeError) as exc:  # etcd unreachable, or refused the renewal
                    self._step_down(f"etcd did not renew its lease ({exc})")
                    return
                if left <= 0:
                    self._step_down("its lease in etcd ended")
                    return
                if self.leading:
                    self._renewed = sent
                self._stopping.wait(RENEW_EVERY)
        finally:
            if self.leading:
                self._step_down("")
            with contextlib.suppress(Exception):
                self._client.revoke(lease)

    def _watch_renewals(self) -> None:
        """Step down once no renewal has succeeded for ``step_down_after`` s."""
        while self.leading and not self._stopping.is_set():
            if time.monotonic() - self._renewed > self._step_down_after:
                self._step_down(f"no renewal of its lease in etcd for {self._step_down_after:g} s")
                return
            time.sleep(0.05)

    def _step_down(self, why: str) -> None:
        serving, self._serving = self._serving, None
        self.leading = False
        if serving is None:
            return
        guard, stop, term = serving
        guard.close()  # from here on no connection reaches the lighthouse
        self._forwarder.lose()
        if why:
            _say(f"this host stops running the job's lighthouse (term {term}): {why}")
        # TorchFT's shutdown waits for the quorum requests it holds (a group
        # waiting for a quorum that cannot form: up to quorum_timeout).
        threading.Thread(target=stop, name="phalanx-lighthouse-stop", daemon=True).start()

    def close(self) -> None:
        """Stop standing; step down where this host leads (another host
        takes over)."""
        self._stopping.set()
        self._step_down("")
        self._thread.join(timeout=2 * LEASE)


def term_of(path: str | None) -> int:
    """The lighthouse's term a host's forwarder follows (its file), 0 where
    there is none."""
    if not path:
        return 0
    try:
        return int(Path(path).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


#: The file with the term of the lighthouse a host's forwarder follows.
TERM_FILE_VAR = "PHALANX_LIGHTHOUSE_TERM"

if os.name != "posix":  # pragma: no cover - phalanx runs on Linux
    raise ImportError("phalanx_torchft._lighthouse needs a POSIX host")
