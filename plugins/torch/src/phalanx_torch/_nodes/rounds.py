"""Rounds of a job of several nodes that restarts: membership and
``MIN:MAX`` nodes, met by phalanx's counted rounds (:mod:`.counted_rounds`)
on a store that either node 0 hosts or an etcd cluster keeps, with a new
store for the ranks of every round.

Used by the ``subprocess`` launcher on several nodes when the job restarts
(``max_restarts``), changes size (``min_nodes``) or keeps its rendezvous in
etcd; see :class:`~phalanx_torch.launchers.SubprocessLauncher`. Imports no
torch at import time.

A round forms once ``min_nodes`` nodes have joined and
either ``max_nodes`` have, or ``last_call`` seconds have passed since the
``min_nodes``-th joined; a node that joins a running job waits, and the
running nodes start a new round when they see it. (Elastic's dynamic
rendezvous, which keeps every node and its heartbeat in one record
rewritten with a compare-and-set, does not hold for thousands of nodes:
bench/README.md, ``rendezvous_scale.py``.) What this module adds:

- every round's ranks get a store of their own, made by the round's node 0
  on a port the kernel gives (torch's shared store keeps the keys of the
  round before, so a restarted rank connects to a dead rank's address);
- restarts are counted for the job, not per node: a round whose ranks
  failed counts once, whatever number of nodes saw it fail, and every
  node reads the count at every round (elastic counts per agent, so a node
  that joined late, or restarted because another node joined, counted
  differently, and the nodes disagreed on when the job is out of restarts);
- the store that node 0 hosts listens on the address the other nodes
  reach it by, not on every interface.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import threading
import time
from typing import TYPE_CHECKING, Any

from phalanx_core.launching import hosted_store

from . import job_keys
from .job_secret import SECRET_VAR, JobSecret, SecretRefused, Signed
from .job_store import JobStore, read_when_set
from .ledger import StopRequested
from .rendezvous_place import RendezvousPlace

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

__all__ = ["ELASTIC", "create"]

#: How long the node that hosts the job's store keeps it up at most after
#: its own wait for a round timed out, for the other nodes to time out too.
TIMED_OUT_HOLD = 10.0

#: The name of this module's rendezvous (its handler's backend).
ELASTIC = "phalanx-elastic"


#: Seconds a node waits for the node that counts a round's failure to say
#: the job's count (two store requests away; it is gone if it takes this).
COUNT_WAIT = 10.0


def create(params: Any) -> Any:
    """The rounds' handler for elastic's ``RendezvousParameters`` ``params``."""
    config = params.config
    place: RendezvousPlace = config["place"]
    timeout = float(config["timeout"])
    job: JobStore = config["job_store"]
    store = job.requests()
    from .counted_rounds import CountedRounds

    # The same rounds on both stores: counters on node 0's store, and in
    # etcd (whose store counts with its compare-and-swap).
    inner = CountedRounds(
        store,
        params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout=float(config.get("join_timeout", timeout)),
        last_call=float(config.get("last_call_timeout", 3)),
        address=params.local_addr,
        node_rank=config.get("node_rank"),
        by_entries=place.kind == "etcd",
    )
    handler = _handler_class()(inner, store, config["listen"], timeout, place.describe())
    ledger = config.get("ledger")
    handler.ledger = ledger
    if ledger is not None:
        ledger.rounds = handler  # the rank loop's to ask
        inner.stop = ledger.stop_requested
        inner.secret = handler.secret = ledger.secret
    handler.say = ledger.say if ledger is not None else None
    handler.hosts_store = job.hosted
    handler.in_etcd = place.kind == "etcd"
    return handler


@functools.cache
def _handler_class() -> type:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    class RoundRendezvous(RendezvousHandler):
        """Counted rounds (on node 0's store or in etcd), with a store of
        their own for each round's ranks (hosted by the round's node 0)
        and the job's restart count kept in the job's store."""

        #: Where lines about the wait go, and the launch's shared facts
        #: (:class:`~phalanx_torch._nodes.ledger.JobLedger`; the launcher sets them).
        say: Any = None
        ledger: Any = None
        #: This node's launching process hosts the job's store.
        hosts_store = False
        #: What the writes prove (:mod:`.job_secret`; the ledger's).
        secret = JobSecret(None)
        #: The job's store is in etcd (else node 0 hosts it).
        in_etcd = False
        #: Leave the rendezvous open when this node ends (it timed out).
        _keep_open = False
        #: etcd did not answer the last look for joining nodes (said once).
        _etcd_silent = False
        #: The nodes in the round being formed, as this node last read them.
        joined: list[str] = []  # noqa: RUF012 - replaced, never changed in place

        def __init__(self, inner: Any, store: Store, listen: str, timeout: float, place: str = "") -> None:
            self._inner = inner
            self._place_text = place
            self.job_store = store
            self._listen = listen
            self._timeout = datetime.timedelta(seconds=timeout)
            self._round_store: Any = None
            #: This round's prefixed store in the job's store; its number.
            self.round_store: Store | None = None
            self.round = -1
            self.group_rank = -1
            self.group_world_size = 0

        def get_backend(self) -> str:
            return ELASTIC

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> Any:
            from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousTimeoutError

            self._round_store = None  # the ranks of the round before are stopped
            try:
                with _saying_who_waits(self, self._timeout):
                    store, rank, world_size, address = self._inner.next_rendezvous()
            except RendezvousTimeoutError:
                with contextlib.suppress(Exception):  # read for the message: the store may be gone
                    self.joined = self._inner.joined()
                self._timed_out()
                self._keep_open = True  # each node says for itself that the nodes never met
                raise self._never_met() from None
            except SecretRefused:
                from phalanx_core import MisconfigurationError

                self._keep_open = True  # the job goes on without this node
                raise MisconfigurationError(
                    f"this node was refused by the job at {self._place_text}: it did not prove the job's "
                    f"secret ({SECRET_VAR}), and gets no rank. Give every node of the job the "
                    f"same {SECRET_VAR} (or none on every node), then start this node again"
                ) from None
            except RendezvousClosedError:
                from phalanx_core import MisconfigurationError, NodeLostError

                if self.in_etcd and self.round < 0 and not self._inner.joined_any:
                    # Closed before this node joined any round: not this job's end.
                    name = self._inner.get_run_id()
                    raise MisconfigurationError(
                        f"the job name {name!r} belongs to a job that ended ({self._place_text}): its "
                        "rendezvous is closed for good, and no node can join it. Give this job a name of "
                        f"its own (--rendezvous etcd://.../NEWNAME), or delete the ended job's keys "
                        f"(etcdctl del --prefix /phalanx/{name}/) and start every node again"
                    ) from None
                raise NodeLostError(
                    f"another node ended the job while this one waited to meet the others at "
                    f"{self._place_text} (it closed the rendezvous); its output says why",
                    node=-1,
                    address=self._place_text,
                ) from None
            self.round = int(self._inner.round)
            self.round_store = store
            self.group_rank, self.group_world_size = rank, world_size
            if rank == 0:
                self._round_store = hosted_store(self._listen or "", 0, timeout=self._timeout)
                where = f"{self._listen or address} {self._round_store.port}"
                proof = self.secret.sign(Signed.RANKS_STORE, self.round, where)
                store.set(job_keys.RANKS_STORE, f"{where} {proof}")
            (written,) = read_when_set(
                store,
                [job_keys.RANKS_STORE],
                interval=self._inner.poll(),
                stop=self._inner.stop,
                stopped=StopRequested,
            )
            address, port, proof = bytes(written).decode().split()
            if not self.secret.proves(proof, Signed.RANKS_STORE, self.round, f"{address} {port}"):
                from phalanx_core import MisconfigurationError

                raise MisconfigurationError(
                    f"where the ranks of round {self.round} meet ({address}:{port}) was written by something "
                    f"that did not prove the job's secret ({SECRET_VAR}); this node does not send its ranks "
                    "there. Keep the job's store on a private network (see the security page) and start the "
                    "job again"
                )
            if self._inner.left and self.say is not None:
                self.say(self.left_words())
            for _, where, host in self._inner.refused if self.say is not None else ():
                self.say(
                    f"a node at {where} (host {host or '?'}) joined round {self.round} without proving the "
                    f"job's secret ({SECRET_VAR}): refused, it has no rank; the round goes on with "
                    f"{self.group_world_size} node{'s' if self.group_world_size > 1 else ''}"
                )
            if self.ledger is not None:
                self.ledger.met()
            return RendezvousInfo(store, rank, world_size, RendezvousStoreInfo(address, int(port)))

        def left_words(self) -> str:
            """The nodes of the round met before that did not join this one."""
            inner = self._inner
            nodes = [
                f"node {rank} (host {host or '?'}, address {address})" for rank, address, host in inner.left
            ]
            were = "was" if len(nodes) == 1 else "were"
            return (
                f"{' and '.join(nodes)} of round {inner.previous} did not join round {self.round}: "
                f"{'it' if len(nodes) == 1 else 'they'} {were} lost (the host, its network, or its "
                f"phalanx run ended); the job goes on with {self.group_world_size} "
                f"node{'s' if self.group_world_size > 1 else ''}"
            )

        def _timed_out(self) -> None:
            """Count this node's timeout in the job's store; on the node that
            hosts it, wait (at most ``TIMED_OUT_HOLD`` seconds) until every
            node that joined has timed out too. Each started its wait when
            it joined, so the others time out a moment later; the store
            must stay up until they have, or they would say "node 0 lost"
            instead of the same verdict."""
            try:
                self.job_store.add(job_keys.TIMED_OUT, 1)
                if not self.hosts_store:
                    return
                deadline = time.monotonic() + TIMED_OUT_HOLD
                while self.job_store.add(job_keys.TIMED_OUT, 0) < len(self.joined):
                    if time.monotonic() >= deadline:
                        return
                    time.sleep(0.05)
            except (RuntimeError, ValueError, OSError):
                return  # the store is gone: nothing to hold

        def _never_met(self) -> Exception:
            from phalanx_core import NodeLostError

            least, most = self._inner.min_nodes, self._inner.max_nodes
            joined = self.joined
            seconds = self._timeout.total_seconds()
            return NodeLostError(
                f"the nodes did not meet within rendezvous_timeout={seconds:g} s: "
                f"{len(joined)} joined ({', '.join(joined) or 'none'}), and a round needs "
                f"{least}{'' if least == most else ' at least'}. "
                "A node that was lost, never started, or failed before joining is missing; start "
                "phalanx run on it with the same --main-address / --main-port (or --rendezvous), or "
                "let the job go on with fewer nodes (--num-nodes MIN:MAX)",
                node=-1,
                address=self._place_text,
            )

        def count_failure(self) -> int:
            """Count this round's failure for the job (once, whichever node
            reports it first); the job's restarts so far, this one included."""
            if self.round_store is None:
                return 0
            counted = job_keys.RESTARTS_COUNTED
            if self.round_store.add(job_keys.ROUND_FAILED, 1) == 1:
                restarts = int(self.job_store.add(job_keys.RESTARTS, 1))
                self.round_store.set(counted, str(restarts))
                return restarts
            # Another node counts it: read the count it made, not the job's
            # count, which its add may not have reached yet (read too soon,
            # this round's failure is missed, and a job out of restarts
            # restarts once more).
            deadline = time.monotonic() + COUNT_WAIT
            while not self.round_store.check([counted]) and time.monotonic() < deadline:
                time.sleep(0.01)
            if self.round_store.check([counted]):
                return int(self.round_store.get(counted))
            return int(self.job_store.add(job_keys.RESTARTS, 0))  # the counting node is gone

        def nodes_waiting_now(self) -> int:
            """:meth:`num_nodes_waiting` read from the store now, not the
            count read up to a second ago (a node that has just asked to
            join is then not seen yet)."""
            return self._waiting(self._inner.waiting_now)

        def failed(self) -> bool:
            """Whether a node counted this round's failure already."""
            return self.round_store is not None and bool(self.round_store.check([job_keys.ROUND_FAILED]))

        def restarts(self) -> int:
            """How many rounds of this job failed and were started again."""
            return int(self.job_store.add(job_keys.RESTARTS, 0))

        def is_closed(self) -> bool:
            return bool(self._inner.is_closed())

        def set_closed(self) -> None:
            self._inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return self._waiting(self._inner.num_nodes_waiting)

        def _waiting(self, read: Any) -> int:
            waiting = self._read_waiting(read)
            turned_away, self._inner.turned_away = self._inner.turned_away, []
            for _, where, host in turned_away if self.say is not None else ():
                self.say(
                    f"a node at {where} (host {host or '?'}) asked to join the job without proving its "
                    f"secret ({SECRET_VAR}): refused; the ranks train on"
                )
            return waiting

        def _read_waiting(self, read: Any) -> int:
            if not self.in_etcd:  # node 0's store: its loss ends the job (NodeLostError)
                return int(read())
            # etcd, asked every monitor interval while the ranks train: if
            # the cluster cannot answer, the job goes on (no node joins
            # until it can), said once, rather than end at the patience's end.
            from . import etcd3

            try:
                with etcd3.briefly():
                    waiting = int(read())
            except etcd3.EtcdUnavailable as exc:
                if not self._etcd_silent and self.say is not None:
                    self.say(
                        f"{self._place_text} does not answer ({exc}); the ranks train on, but no node "
                        "can join, and a failure cannot start a new round, until a majority of its "
                        "members answers again"
                    )
                self._etcd_silent = True
                return 0
            if self._etcd_silent and self.say is not None:
                self.say(f"{self._place_text} answers again")
            self._etcd_silent = False
            return waiting

        def get_run_id(self) -> str:
            return str(self._inner.get_run_id())

        def shutdown(self) -> bool:
            self._round_store = None
            if self._keep_open:
                return True
            from . import etcd3

            # The job's store may be gone (node 0), or etcd not answer: the job is over either way.
            with contextlib.suppress(Exception), etcd3.briefly():
                return bool(self._inner.shutdown())
            return False

    del dist
    return RoundRendezvous


@contextlib.contextmanager
def _saying_who_waits(handler: Any, timeout: datetime.timedelta) -> Any:
    """While this node waits for a round: the nodes that joined, as this
    node last read them, kept in ``handler.joined`` every second; after
    5 s, and every 30 s after, a line saying so and how long is left."""
    done = threading.Event()
    start = time.monotonic()
    handler.joined = []

    def tell() -> None:
        next_say = 5.0
        while not done.wait(1.0):
            waited = time.monotonic() - start
            saying = handler.say is not None and waited >= next_say
            # The nodes are read from the store only to say them.
            with contextlib.suppress(Exception):  # the store does not answer: read it next time
                # The most seen: a node that gave up waiting first leaves
                # the round, and the nodes that joined are what is said.
                now = list(handler._inner.joined()) if saying else handler.joined
                if len(now) >= len(handler.joined):
                    handler.joined = now
            if saying:
                next_say += 30.0 if next_say > 5.0 else 25.0
                handler.say(
                    f"waiting for the nodes to meet: {len(handler.joined)} joined "
                    f"({', '.join(handler.joined)}), a round needs {handler._inner.min_nodes}; "
                    f"{timeout.total_seconds() - waited:.0f} s left of rendezvous_timeout"
                )

    thread = threading.Thread(target=tell, name="phalanx-rendezvous-wait", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
