"""The job's state in an etcd cluster, over etcd's v3 API: a small client of
its JSON gateway (HTTP, the standard library only), the job's store on it
(:class:`Etcd3Store`, a ``torch.distributed.Store``), on which the nodes
meet in phalanx's counted rounds as they do on node 0's store.

Why not a library: torch's etcd rendezvous and store speak the v2 API
(python-etcd), which etcd 3.4 and 3.5 serve only with ``--enable-v2`` and
etcd 3.6 not at all; python-etcd3 (gRPC) is unmaintained and does not
install beside protobuf 4 and later; etcd3gw talks to one member per
client, so a lost member ends the job. The gateway is in every etcd since
3.4 (``/v3/...``).

Every request goes to one member and, where that member cannot answer (no
connection, a leader being elected, "request timed out"), to the next, for
up to :data:`PATIENCE` seconds: losing a member, the leader included,
costs a job a few seconds, not its life. Imports no torch at import time.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import functools
import http.client
import json
import ssl
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

#: How long a request is tried again, member after member, while none can
#: answer (a member lost, a leader being elected: a few seconds).
PATIENCE = 60.0
#: Seconds one request may take (a watch is given its own time).
REQUEST_TIMEOUT = 10.0
#: The longest one watch request waits before the keys are read again.
WATCH_SPAN = 60.0
#: The patience of a request made within :func:`briefly`.
BRIEF_PATIENCE = 2.0
#: gRPC status codes that a moment later may be otherwise: deadline
#: exceeded, aborted, internal ("leader changed"), unavailable ("request
#: timed out, possibly due to previous leader failure").
_TRANSIENT_CODES = frozenset({4, 10, 13, 14})
#: gRPC's "not found": a lease that expired.
_NOT_FOUND = 5
#: gRPC's "unauthenticated": an auth token that expired (etcd's simple
#: tokens after 5 idle minutes, a JWT at its end); a new one is asked for.
_UNAUTHENTICATED = 16
#: gRPC's "out of range": a read at a revision that was compacted away.
_OUT_OF_RANGE = 11


@dataclass(frozen=True)
class Access:
    """How this process reaches the members: over TLS (``tls``; the CA
    that signed the members' certificates, ``cacert``, else the system's;
    this client's certificate and key, ``cert`` and ``key``, where the
    members ask for one), and as ``user`` with ``password`` where the
    cluster has authentication on."""

    tls: bool = False
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def context(self) -> ssl.SSLContext | None:
        """The TLS context of every connection (None: plain HTTP)."""
        return _context(self.cacert, self.cert, self.key) if self.tls else None

    def connection(self, host: str, port: int, timeout: float) -> http.client.HTTPConnection:
        if self.tls:
            return http.client.HTTPSConnection(host, port, timeout=timeout, context=self.context())
        return http.client.HTTPConnection(host, port, timeout=timeout)


@functools.cache
def _context(cacert: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=cacert)
    if cert:
        context.load_cert_chain(cert, key)
    return context


PLAIN = Access()


_PATIENCE_HERE = threading.local()


@contextlib.contextmanager
def briefly(patience: float = BRIEF_PATIENCE) -> Iterator[None]:
    """Requests of this thread within try for ``patience`` seconds only:
    for what a job can do without (the rank loop's look for joining nodes
    while the ranks train, the writes at the job's end), so that a cluster
    that cannot answer does not hold the job up for :data:`PATIENCE`."""
    before = getattr(_PATIENCE_HERE, "value", None)
    _PATIENCE_HERE.value = patience
    try:
        yield
    finally:
        _PATIENCE_HERE.value = before


class EtcdUnavailable(ConnectionError):
    """No member of the etcd cluster answered for :data:`PATIENCE` seconds."""


class EtcdTLSError(ConnectionError):
    """A member's TLS could not be agreed with (a certificate this
    client does not trust or that names another host, a member that
    speaks plain HTTP, or one that wants a client certificate): asking
    again will not change it."""


class EtcdRequestError(RuntimeError):
    """etcd answered a request with an error that asking again will not
    change (a bad request, a lease not found)."""

    def __init__(self, message: str, code: int | None) -> None:
        super().__init__(message)
        self.code = code


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _put(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
    if lease:
        body["lease"] = str(lease)
    return body


def _after(prefix: bytes) -> bytes:
    """The end of the range of the keys that start with ``prefix``."""
    end = bytearray(prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return b"\0"  # every key
    end[-1] += 1
    return bytes(end)


def _records(answer: dict[str, Any]) -> list[dict[str, Any] | None]:
    """The record each range of a transaction's answer found, or None."""
    found: list[dict[str, Any] | None] = []
    for item in answer.get("responses", []):
        kvs = item.get("response_range", {}).get("kvs") or []
        found.append(kvs[0] if kvs else None)
    return found


#: For each cluster (its members, as given) the member this process's
#: clients go to first: the one after the last member that could not
#: answer, so that a new client does not wait out a lost member's timeout
#: again (a host lost without a word: every new client's first request
#: waited :data:`REQUEST_TIMEOUT`).
_FIRST: dict[tuple[tuple[str, int], ...], int] = {}
_FIRST_LOCK = threading.Lock()
#: For each cluster, user and password, the auth token this process's
#: clients send.
_TOKENS: dict[tuple[tuple[tuple[str, int], ...], str, str], str] = {}
_TOKENS_LOCK = threading.Lock()


class Etcd3:
    """A client of the members at ``endpoints`` ((host, port) pairs)."""

    def __init__(
        self, endpoints: Sequence[tuple[str, int]], *, patience: float = PATIENCE, access: Access = PLAIN
    ) -> None:
        self.endpoints = list(endpoints)
        self.patience = patience
        self.access = access
        self._cluster = tuple(self.endpoints)
        self._user_key = (self._cluster, access.user or "", access.password or "")
        with _FIRST_LOCK:
            self._next = _FIRST.get(self._cluster, 0)
        self._lock = threading.Lock()

    # -- requests --------------------------------------------------------

    def _member(self) -> tuple[str, int]:
        with self._lock:
            return self.endpoints[self._next % len(self.endpoints)]

    def _skip(self, member: tuple[str, int]) -> None:
        """``member`` could not answer: the next request goes to the next."""
        with self._lock:
            if self.endpoints[self._next % len(self.endpoints)] == member:
                self._next += 1
            following = self._next % len(self.endpoints)
        with _FIRST_LOCK:
            _FIRST[self._cluster] = following

    def _sent_token(self, path: str) -> str | None:
        """The auth token a request to ``path`` carries, if any."""
        return self._token_now() if self.access.user and path != "auth/authenticate" else None

    def _once(
        self, member: tuple[str, int], path: str, body: dict[str, Any], timeout: float, token: str | None
    ) -> Any:
        """One request to one member: its connection, with the response
        not yet read (a watch streams)."""
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        connection = self.access.connection(*member, timeout=timeout)
        try:
            connection.request("POST", f"/v3/{path}", json.dumps(body), headers)
            return connection, connection.getresponse()
        except ssl.SSLError as exc:
            connection.close()
            raise _tls_error(member, exc, self.access) from None
        except BaseException:
            connection.close()
            raise

    def _token_now(self) -> str:
        """The auth token of this client's user, shared by this process's
        clients of the cluster: etcd checks a password with bcrypt, some
        50 ms of its time, and the rendezvous makes new clients every
        round. Asked for again once :meth:`call` finds it expired."""
        with _TOKENS_LOCK:
            token = _TOKENS.get(self._user_key)
        if token is None:
            answer = self.call(
                "auth/authenticate", {"name": self.access.user, "password": self.access.password}
            )
            token = str(answer["token"])
            with _TOKENS_LOCK:
                _TOKENS[self._user_key] = token
        return token

    def _expired(self, sent: str | None) -> None:
        """The token sent with a request was refused: the next request asks
        for a new one (unless another client has already)."""
        with _TOKENS_LOCK:
            if sent is not None and _TOKENS.get(self._user_key) == sent:
                del _TOKENS[self._user_key]

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v3/<path>``, tried member after member while none can
        answer; the answer's JSON."""
        patience = getattr(_PATIENCE_HERE, "value", None) or self.patience
        deadline = time.monotonic() + patience
        # One member's turn: at most half the patience, so that a member whose
        # host vanished without a word (no reset: the attempt waits its whole
        # timeout) leaves time for the next. Elastic's heartbeat tries
        # briefly (2 s) and drops a node whose heartbeat is 3 s old: with the
        # full REQUEST_TIMEOUT, a heartbeat sent to a lost host's member
        # missed that window, the node fell out of the running round, and
        # waited for its ranks' collective (gloo: 30 minutes) instead of
        # joining the next.
        attempt = min(REQUEST_TIMEOUT, max(1.0, patience / 2))
        last = ""
        renewed = False
        while True:
            member = self._member()
            sent = self._sent_token(path)
            try:
                connection, response = self._once(member, path, body, attempt, sent)
                try:
                    text = response.read()
                finally:
                    connection.close()
            except EtcdTLSError:  # this member's TLS: asking again will not change it
                raise
            except (OSError, http.client.HTTPException) as exc:
                last = f"{member[0]}:{member[1]}: {type(exc).__name__}: {exc}"
            else:
                try:
                    answer = json.loads(text) if text else {}
                except ValueError:
                    answer = {}
                    if response.status == 404:  # a server without /v3/ (etcd before 3.4, or not etcd)
                        raise EtcdRequestError(
                            f"{member[0]}:{member[1]} has no /v3/{path} (HTTP 404: {text[:80]!r})", None
                        ) from None
                    if 400 <= response.status < 500 or response.status == 501:
                        # Not an answer of etcd's gateway, which always
                        # answers JSON: another server (501: no POST).
                        raise EtcdRequestError(
                            f"{member[0]}:{member[1]} answered HTTP {response.status}: {text[:120]!r}", None
                        ) from None
                if "error" not in answer and "code" not in answer and response.status < 500:
                    return answer
                code = answer.get("code")
                message = str(answer.get("message") or answer.get("error") or f"HTTP {response.status}")
                if code == _UNAUTHENTICATED and self.access.user and not renewed:
                    self._expired(sent)  # expired: a new token, and once more
                    renewed = True
                    continue
                if code not in _TRANSIENT_CODES and response.status < 500:
                    raise EtcdRequestError(f"etcd at {member[0]}:{member[1]}: {message}", code)
                last = f"{member[0]}:{member[1]}: {message}"
            self._skip(member)
            if time.monotonic() > deadline:
                members = ", ".join(f"{host}:{port}" for host, port in self.endpoints)
                raise EtcdUnavailable(
                    f"no member of the etcd cluster ({members}) answered for {patience:g} s (last: {last})"
                )
            time.sleep(0.2)

    # -- keys ------------------------------------------------------------

    def read(self, keys: Sequence[bytes]) -> tuple[list[dict[str, Any] | None], int]:
        """Each key's record (value, mod_revision) or None, read at one
        revision (up to :data:`TXN_OPS` keys; more are read
        :data:`TXN_OPS` at a time); that revision (the first, for more)."""
        found: list[dict[str, Any] | None] = []
        revisions = []
        for first in range(0, max(1, len(keys)), TXN_OPS):
            reads = [{"request_range": {"key": _b64(k)}} for k in keys[first : first + TXN_OPS]]
            answer = self.call("kv/txn", {"success": reads})
            found += _records(answer)
            revisions.append(int(answer["header"]["revision"]))
        return found, min(revisions)

    def put_many(self, puts: Sequence[tuple[bytes, bytes]]) -> None:
        """Write the ``(key, value)`` pairs, :data:`TXN_OPS` at a time."""
        for first in range(0, len(puts), TXN_OPS):
            chunk = puts[first : first + TXN_OPS]
            self.call("kv/txn", {"success": [{"request_put": _put(k, v)} for k, v in chunk]})

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self.call("kv/put", _put(key, value, lease))

    def swap(
        self,
        key: bytes,
        expected: int | None,
        puts: Sequence[tuple[bytes, bytes, int]],
        reads: Sequence[bytes],
    ) -> tuple[bool, int, list[dict[str, Any] | None]]:
        """Where ``key`` was last changed at revision ``expected`` (or,
        for None, does not exist): write ``puts`` (key, value, lease), all
        at once. Else read ``reads``. Whether it wrote; the revision; what
        it read."""
        compare: dict[str, Any] = {"key": _b64(key), "result": "EQUAL"}
        if expected is None:
            compare.update(target="CREATE", create_revision="0")
        else:
            compare.update(target="MOD", mod_revision=str(expected))
        answer = self.call(
            "kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": _put(*put)} for put in puts],
                "failure": [{"request_range": {"key": _b64(k)}} for k in reads],
            },
        )
        revision = int(answer["header"]["revision"])
        if answer.get("succeeded"):  # absent where false
            return True, revision, []
        return False, revision, _records(answer)

    def keys(self, prefix: bytes, created_by: int | None = None) -> int:
        """How many keys start with ``prefix`` (made at revision
        ``created_by`` or before, where given: for keys that are never
        deleted). With a revision it is the count as the store was at that
        revision, one small read; etcd's ``count`` ignores the
        ``max_create_revision`` filter, and reading the keys themselves
        makes a round of N nodes read N * N / 2 keys (bench/README.md). Where the store has compacted that
        revision away, the keys made by then are read (not their values)."""
        body: dict[str, Any] = {"key": _b64(prefix), "range_end": _b64(_after(prefix))}
        if created_by is None:
            return int(self.call("kv/range", {**body, "count_only": True}).get("count", 0))
        try:
            answer = self.call("kv/range", {**body, "count_only": True, "revision": str(created_by)})
            return int(answer.get("count", 0))
        except EtcdRequestError as exc:
            if exc.code != _OUT_OF_RANGE:
                raise
        body.update(keys_only=True, max_create_revision=str(created_by))
        return len(self.call("kv/range", body).get("kvs") or [])

    def grant(self, ttl: int) -> int:
        """A new lease of ``ttl`` seconds; its id."""
        return int(self.call("lease/grant", {"TTL": str(ttl)})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``: the seconds it now has, 0 where it has expired."""
        answer = self.call("lease/keepalive", {"ID": str(lease)})
        return int(answer.get("result", {}).get("TTL", 0) or 0)

    def revoke(self, lease: int) -> None:
        """End ``lease`` now (its keys go with it); one that expired is let be."""
        try:
            self.call("lease/revoke", {"ID": str(lease)})
        except EtcdRequestError as exc:
            if exc.code != _NOT_FOUND:
                raise

    def watch(self, key: bytes, after: int, timeout: float) -> None:
        """Return once ``key`` is written after revision ``after``, or
        ``timeout`` seconds have passed, or the member watched is lost
        (the caller reads again, and asks again)."""
        member = self._member()
        body = {"create_request": {"key": _b64(key), "start_revision": str(after + 1)}}
        deadline = time.monotonic() + timeout
        created = False
        connection = None
        try:
            # A member says at once that the watch is made: one that does
            # not within REQUEST_TIMEOUT is passed over, as in call().
            wait = max(0.05, min(timeout, REQUEST_TIMEOUT))
            connection, response = self._once(member, "watch", body, wait, self._sent_token("watch"))
            while time.monotonic() < deadline:
                line = response.readline()
                if not line:  # the member closed the stream
                    self._skip(member)
                    return
                message = json.loads(line)
                result = message.get("result", {})
                if result.get("events") or "error" in message or result.get("canceled"):
                    return
                if not created and connection.sock is not None:  # now wait as long as asked
                    created = True
                    connection.sock.settimeout(max(0.05, deadline - time.monotonic()))
        except (OSError, http.client.HTTPException, ValueError):
            if not created:  # no connection, or no word from the member
                self._skip(member)
            # else its time is up, or the member was lost while watching: the caller reads again
        finally:
            if connection is not None:
                connection.close()


@functools.cache
def _store_class() -> type:
    import torch.distributed as dist

    class Etcd3Store(dist.Store):  # type: ignore[misc,name-defined]
        """A ``torch.distributed.Store`` whose keys live in etcd under
        ``prefix``: ``set``, ``get`` and ``wait`` (blocking, through etcd's
        watch), ``check``, ``add``, ``compare_set``, ``multi_get`` and
        ``multi_set``: what phalanx's counted rounds ask of a store.

        ``add`` is a compare-and-swap that counts once even where its
        answer was lost and the request was sent again: the swap also
        writes a key of its own (under ``<prefix>/.adds/``, on a lease of
        :attr:`ADD_TTL` seconds), and a swap that fails reads it back."""

        #: Seconds the record of one ``add`` is kept (for a request sent
        #: again after its answer was lost).
        ADD_TTL = 600

        def __init__(self, client: Etcd3, prefix: str, timeout: float = 300.0) -> None:
            super().__init__()
            self.client = client
            self.prefix = prefix.rstrip("/") + "/"
            self.set_timeout(datetime.timedelta(seconds=timeout))
            self._lease = 0
            self._leased_at = 0.0
            self._lease_lock = threading.Lock()

        def _key(self, key: str | bytes) -> bytes:
            return self.prefix.encode() + _bytes(key)

        def set(self, key: str, value: str | bytes) -> None:
            self.client.put(self._key(key), _bytes(value))

        def get(self, key: str) -> bytes:
            (record,) = self._wait_for([self._key(key)], self.timeout.total_seconds())
            return _unb64(record.get("value"))

        def check(self, keys: list[str]) -> bool:
            found, _ = self.client.read([self._key(k) for k in keys])
            return all(record is not None for record in found)

        def wait(self, keys: list[str], override_timeout: datetime.timedelta | None = None) -> None:
            timeout = self.timeout if override_timeout is None else override_timeout
            self._wait_for([self._key(k) for k in keys], timeout.total_seconds())

        def _wait_for(self, keys: list[bytes], timeout: float) -> list[dict[str, Any]]:
            deadline = time.monotonic() + timeout
            while True:
                found, revision = self.client.read(keys)
                missing = [key for key, record in zip(keys, found, strict=True) if record is None]
                if not missing:
                    return found  # type: ignore[return-value]
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(key.decode(errors="replace") for key in missing)
                    raise LookupError(f"etcd: no key {names} within {timeout:g} s")
                self.client.watch(missing[0], revision, min(left, WATCH_SPAN))

        def multi_get(self, keys: list[str]) -> list[bytes]:
            found = self._wait_for([self._key(k) for k in keys], self.timeout.total_seconds())
            return [_unb64(record.get("value")) for record in found]

        def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
            self.client.put_many([(self._key(k), _bytes(v)) for k, v in zip(keys, values, strict=True)])

        def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
            """As ``TCPStore``'s: ``desired_value`` where the key holds
            ``expected_value`` (``""``: where it does not exist); the key's
            value after (the one that won)."""
            target, expected, desired = self._key(key), _bytes(expected_value), _bytes(desired_value)
            found, _ = self.client.read([target])
            while True:
                current = found[0]
                if current is None and expected:
                    return expected  # TCPStore's answer for a missing key and a value expected
                if current is not None and _unb64(current.get("value")) != expected:
                    return _unb64(current.get("value"))
                revision = int(current["mod_revision"]) if current is not None else None
                wrote, _, found = self.client.swap(target, revision, [(target, desired, 0)], [target])
                if wrote:
                    return desired

        def enter(self, key: str) -> int:
            """This client's place among those that entered ``key`` (1 for
            the first): what ``add(key, 1)`` gives, without its races. Each
            entrant writes a key of its own under ``key``, and its place is
            the number of those made at its key's revision or before (etcd
            numbers its writes). ``add``'s compare-and-swaps, all on one
            key, lose to each other, more the more nodes join at once
            (bench/README.md)."""
            mine = self._key(f"{key}/entrant/{uuid.uuid4().hex}")
            self.client.put(mine, b"1")  # sent again where its answer was lost: the same key
            (record,), _ = self.client.read([mine])
            assert record is not None  # written above; entries are never deleted
            return self.client.keys(self._key(f"{key}/entrant/"), int(record["create_revision"]))

        def entered(self, key: str) -> int:
            """How many have entered ``key`` (:meth:`enter`): one small read."""
            return self.client.keys(self._key(f"{key}/entrant/"))

        def _add_lease(self) -> int:
            with self._lease_lock:
                if not self._lease or time.monotonic() - self._leased_at > self.ADD_TTL / 2:
                    self._lease = self.client.grant(self.ADD_TTL)
                    self._leased_at = time.monotonic()
                return self._lease

        def add(self, key: str, amount: int) -> int:
            target = self._key(key)
            found, _ = self.client.read([target])
            if amount == 0:  # a read (a count looked at): no write
                return int(_unb64(found[0].get("value"))) if found[0] else 0
            record_key = self.prefix.encode() + b".adds/" + uuid.uuid4().hex.encode()
            while True:
                current = found[0]
                value = int(_unb64(current.get("value"))) + amount if current else amount
                expected = int(current["mod_revision"]) if current else None
                text = str(value).encode()
                try:
                    puts = [(target, text, 0), (record_key, text, self._add_lease())]
                    wrote, _, found_now = self.client.swap(target, expected, puts, [target, record_key])
                except EtcdRequestError as exc:
                    if exc.code != _NOT_FOUND:
                        raise
                    self._lease = 0  # the lease expired: a new one, and again
                    continue
                if wrote:
                    return value
                if found_now[1] is not None:  # an earlier try wrote, its answer lost
                    return int(_unb64(found_now[1].get("value")))
                found = found_now[:1]  # another writer won: again, from its value

    return Etcd3Store


#: The most operations etcd takes in one transaction (its
#: ``--max-txn-ops``, 128 unless the cluster was started with more).
TXN_OPS = 128


def job_store(
    endpoints: Sequence[tuple[str, int]], prefix: str, timeout: float, access: Access = PLAIN
) -> Any:
    """The job's store in etcd under ``prefix``."""
    return _store_class()(Etcd3(endpoints, access=access), prefix, timeout)


def _tls_error(member: tuple[str, int], exc: ssl.SSLError, access: Access) -> EtcdTLSError:
    """What went wrong with ``member``'s TLS, and what to do. A member that
    speaks plain HTTP and one that wants a client certificate both close
    the connection (TLS 1.3): a handshake without checks tells them apart."""
    where = f"{member[0]}:{member[1]}"
    reason = getattr(exc, "reason", None) or str(exc)
    if isinstance(exc, ssl.SSLCertVerificationError):
        hint = (
            f"the member's certificate is not one this client trusts ({exc.verify_message}): give the CA "
            "that signed it (cacert=PATH)"
        )
        if exc.verify_code == 62:  # "hostname mismatch"
            hint += ", and reach the member at a name or address that its certificate names"
    elif not speaks_tls([member]):
        hint = "the member speaks plain HTTP, not TLS: use etcd://, not etcd+https://"
    elif not access.cert:
        hint = "the member asks for a client certificate: give cert=PATH and key=PATH"
    else:
        hint = "the member refused this client's certificate: is it signed by a CA the member trusts?"
    return EtcdTLSError(f"etcd at {where}: TLS failed ({reason}): {hint}")


def versions(endpoints: Sequence[tuple[str, int]], access: Access = PLAIN) -> dict[str, str]:
    """The members that answer etcd's ``/version`` (any etcd does), with
    their versions."""
    found = {}
    for host, port in endpoints:
        connection = access.connection(host, port, timeout=2)
        try:
            connection.request("GET", "/version")
            found[f"{host}:{port}"] = str(json.loads(connection.getresponse().read())["etcdserver"])
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
            continue
        finally:
            connection.close()
    return found


def speaks_tls(endpoints: Sequence[tuple[str, int]]) -> list[str]:
    """The members that complete a TLS handshake (their certificates not
    checked): what a plain-HTTP client cannot reach (etcd closes the
    connection without a word)."""
    import socket

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    found = []
    for host, port in endpoints:
        try:
            with socket.create_connection((host, port), timeout=2) as raw, context.wrap_socket(raw):
                found.append(f"{host}:{port}")
        except OSError:
            continue
    return found


def check_reachable(endpoints: Sequence[tuple[str, int]], patience: float, access: Access = PLAIN) -> None:
    """Raise :class:`EtcdUnavailable` unless a member answers a v3 read
    within ``patience`` seconds (:class:`EtcdTLSError` at once where TLS
    cannot be agreed with a member)."""
    Etcd3(endpoints, patience=patience, access=access).read([b"/phalanx/.ping"])
