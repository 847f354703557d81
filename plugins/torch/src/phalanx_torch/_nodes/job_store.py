"""The job's store that outlives its rounds, on either place
(:mod:`.rendezvous_place`): node 0's ``TCPStore``, hosted by node 0's
launching process or reached from the others, or the job's keys in an
etcd cluster, whose members are checked first (and what is wrong with
them named); one launch's view of it (:class:`JobStore`: its two
connections, and reads that look rather than wait); and the open-file
limit that node 0's store needs. Imports no torch at import time."""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from phalanx_core import UnavailableError
from phalanx_core.launching import hosted_store

from .rendezvous_place import ETCD_PASSWORD_VAR, RendezvousPlace

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

__all__ = ["CONNECTIONS", "JobStore", "allow_connections", "job_store", "read_when_set"]

logger = logging.getLogger(__name__)


def job_store(place: RendezvousPlace, *, host: str | None, timeout: float) -> Store:
    """The job's store that outlives its rounds: node 0's ``TCPStore``
    (hosted here, listening on ``host``, where ``host`` is not None; a
    client elsewhere), or a store in the etcd cluster (:mod:`.etcd3`)."""
    import torch.distributed as dist

    if place.kind == "etcd":
        from . import etcd3

        _check_etcd(place, timeout)
        logger.debug("a client of the job's keys in %s", place.describe())
        in_etcd: Store = etcd3.job_store(
            place.endpoints, f"/phalanx/{place.name}/store", timeout, place.access
        )
        return in_etcd
    address, port = place.endpoints[0]
    wait = datetime.timedelta(seconds=timeout)
    logger.debug(
        "%s node 0's store at %s:%d", "hosting" if host is not None else "a client of", address, port
    )
    if host is not None:
        hosted: Store = hosted_store(host, port, timeout=wait)
        return hosted
    return dist.TCPStore(address, port, is_master=False, timeout=wait)  # type: ignore[attr-defined]


#: The longest a node waits at its start for a member of the etcd cluster
#: to answer (the members of a cluster started with the job elect a
#: leader first: a few seconds).
ETCD_START_WAIT = 30.0


def _check_etcd(place: RendezvousPlace, timeout: float) -> None:
    """Raise what to do unless a member of the etcd cluster answers a read
    on its v3 API within ``min(timeout, ETCD_START_WAIT)`` seconds."""
    from . import etcd3

    wait = min(timeout, ETCD_START_WAIT)
    access = place.access or etcd3.PLAIN
    try:
        etcd3.check_reachable(place.endpoints, wait, access)
    except etcd3.EtcdTLSError as exc:
        raise UnavailableError(f"rendezvous in etcd ({place.endpoint}): {exc}") from None
    except etcd3.EtcdRequestError as exc:
        if "CommonName of client" in str(exc):
            raise UnavailableError(
                f"rendezvous in etcd ({place.endpoint}): etcd refused the job's first read ({exc}): with "
                "authentication on, etcd's JSON gateway (the API phalanx speaks) refuses a client "
                "certificate that has a CommonName; give a client certificate without one (the user "
                "is then user=NAME's)"
            ) from None
        if exc.code is not None:  # etcd's own refusal: authentication
            what = (
                f"check user={access.user!r} and its password in {ETCD_PASSWORD_VAR}; the user needs a "
                "role that may read and write the keys under /phalanx/"
                if access.user
                else f"a cluster with authentication on needs ?user=NAME in --rendezvous and its password "
                f"in {ETCD_PASSWORD_VAR}"
            )
            raise UnavailableError(
                f"rendezvous in etcd ({place.endpoint}): etcd refused the job's first read ({exc}): {what}"
            ) from None
        answered = etcd3.versions(place.endpoints, access)
        found = ", ".join(f"etcd {version} at {member}" for member, version in answered.items())
        raise UnavailableError(
            f"rendezvous in etcd ({place.endpoint}): {found or 'a server'} answered, but not on etcd's "
            f"v3 API (its JSON gateway at /v3/, which etcd 3.4 and later serve): {exc}. Use etcd 3.4 "
            "or later, or meet on node 0's store instead (--rendezvous c10d)"
        ) from None
    except etcd3.EtcdUnavailable as exc:
        members = ", ".join(f"{host}:{port}" for host, port in place.endpoints)
        tls = [] if access.tls else etcd3.speaks_tls(place.endpoints)
        if tls:
            raise UnavailableError(
                f"rendezvous in etcd ({place.endpoint}): {', '.join(tls)} "
                f"speak{'s' if len(tls) == 1 else ''} TLS, and a plain-HTTP request is closed unanswered: "
                "reach the members with etcd+https://..., with ?cacert=PATH (and cert=PATH&key=PATH "
                "where they ask for a client certificate)"
            ) from None
        answered = etcd3.versions(place.endpoints, access)
        if answered:
            found = ", ".join(f"etcd {version} at {member}" for member, version in answered.items())
            raise UnavailableError(
                f"rendezvous in etcd ({place.endpoint}): {found} answered, but no read of the job's "
                f"keys succeeded within {wait:g} s ({exc}): a cluster without a leader (are most of "
                "its members down?). Bring a majority of its members up, or meet on node 0's store "
                "instead (--rendezvous c10d)"
            ) from None
        raise UnavailableError(
            f"rendezvous in etcd ({place.endpoint}): no member of the etcd cluster answered at "
            f"{members} within {wait:g} s ({exc}). Start etcd there (3.4 or later), check the "
            "addresses and ports in --rendezvous, or meet on node 0's store instead "
            "(--rendezvous c10d)"
        ) from None


#: The connections a node opens to the job's store (:class:`JobStore`).
CONNECTIONS = 2


class JobStore:
    """One launch's view of the job's store on its place, for every part
    of the launch (the rounds, the heartbeat, the node watch, the rank
    loop): two connections a node, each made on first use and kept for the
    launch.

    - :meth:`requests`: every request that answers at once (the rounds',
      the heartbeat's beats, the watch's posts and reads, the rank loop's).
      A ``TCPStore`` client is safe to share between threads, but a
      request that waits holds the connection until it returns: reads of
      keys not written yet look instead (:func:`read_when_set`), so that
      the heartbeat's beats never wait behind them. On node 0 of a store
      it hosts, the hosted store itself.
    - :meth:`waits`: the node watch's ``wait`` for the next failure
      posted (a push, held for as long as nothing is posted).
    """

    def __init__(self, place: RendezvousPlace, *, host: str | None, timeout: float) -> None:
        self.place = place
        #: Where this node's launching process hosts node 0's store (None:
        #: it reaches the store, or the store is in etcd).
        self.host = host
        self.timeout = timeout
        self._requests: Store | None = None
        self._waits: Store | None = None
        self._lock = threading.Lock()

    @classmethod
    def given(cls, place: RendezvousPlace, store: Store, *, timeout: float, hosted: bool = False) -> JobStore:
        """A view whose requests go through ``store``, a client made
        elsewhere (a simulation's counting client; ``hosted``: as node 0's
        store, where this node's launching process hosts it)."""
        job = cls(place, host="" if hosted else None, timeout=timeout)
        job._requests = store
        return job

    def adopt(self, store: Store) -> None:
        """Make ``store``, a connection a rendezvous of its own made (a
        job of fixed nodes meets once, at node 0's store), the one for
        requests, unless one was made already; its requests then wait as
        long as this view's (the rendezvous' client gave up sooner)."""
        with self._lock:
            if self._requests is None:
                store.set_timeout(datetime.timedelta(seconds=self.timeout))
                self._requests = store

    @property
    def hosted(self) -> bool:
        """Whether this node's launching process hosts the job's store."""
        return self.host is not None

    def requests(self) -> Store:
        """The connection for requests that answer at once (made on first use)."""
        with self._lock:
            if self._requests is None:
                self._requests = job_store(self.place, host=self.host, timeout=self.timeout)
            return self._requests

    def waits(self) -> Store:
        """The connection the node watch waits on (made on first use)."""
        with self._lock:
            if self._waits is None:
                self._waits = job_store(self.place, host=None, timeout=self.timeout)
            return self._waits

    @property
    def connections(self) -> int:
        """The connections made so far (at most :data:`CONNECTIONS`)."""
        return (self._requests is not None) + (self._waits is not None)

    @contextlib.contextmanager
    def briefly(self) -> Iterator[None]:
        """Requests in this block give up quickly where the store is in
        etcd (a member that does not answer is not waited for); nothing
        on node 0's store."""
        if self.place.kind != "etcd":
            yield
            return
        from . import etcd3

        with etcd3.briefly():
            yield


def read_when_set(
    store: Store,
    keys: Sequence[str],
    *,
    interval: float = 0.1,
    stop: threading.Event | None = None,
    stopped: type[BaseException] | None = None,
    look_now: bool = True,
) -> list[bytes]:
    """The values of ``keys`` once all are written, looked for (``check``)
    now and then every ``interval`` seconds, for as long as the store's own
    timeout: what ``multi_get`` gives, without holding the connection while
    it waits (:class:`JobStore`), at the rounds' pace (a node asks once an
    interval, whatever the number of nodes). Where ``stop`` is set
    meanwhile, raise ``stopped()``; past the timeout, the store's own
    ``DistStoreError``. ``look_now=False``: the first look after an
    interval (keys that another node writes only once it has looked at the
    store itself)."""
    import torch.distributed as dist

    wanted = list(keys)
    timeout = store.timeout.total_seconds()  # type: ignore[attr-defined]  # the stubs lack it
    deadline = time.monotonic() + timeout
    first = look_now
    while not (first and store.check(wanted)):
        first = True
        if stop is not None and stopped is not None and stop.wait(interval):
            raise stopped()
        if stop is None or stopped is None:
            time.sleep(interval)
        if time.monotonic() >= deadline:
            raise dist.DistStoreError(f"wait timeout after {timeout * 1000:.0f}ms, keys: {wanted}")
    return list(store.multi_get(wanted))


def allow_connections(count: int) -> None:
    """Raise this process's open-file limit (the soft one, up to the hard
    one) so that the store it hosts can hold ``count`` connections
    (:data:`CONNECTIONS` a node), which at thousands of nodes is above the
    usual soft limit of 1,024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = count + 256  # and the process's own files
    if soft != resource.RLIM_INFINITY and soft < wanted:
        top = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if top > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (top, hard))
