"""Heartbeats of the nodes of a job of several nodes, in the job's store: a
host lost without a word (its power, its network) is seen within
:data:`LOST_AFTER` seconds, and the job restarts without it (a job in
rounds) or ends naming it (a job of fixed nodes without restarts, whose
node watch posts the loss: ``on_lost``).

A host whose processes are killed closes their connections as they end,
and the ranks of the other nodes fail at once in their next collective. A
host that is lost without a word closes nothing: the other ranks wait in
their collective until gloo's timeout (30 minutes), and their launching processes,
whose own ranks look healthy, see nothing wrong. So each node's launching
process adds 1 to a counter of its own in the job's store every
:func:`interval_for` seconds, and reads the counter of the next node of
the round (node ``r`` watches node ``r + 1``, the last node node 0): a
fixed two small requests a beat per node, whatever the number of nodes,
and every node watched by one. A counter that has not moved for
:data:`LOST_AFTER` seconds of this node's own answered reads means its
node is lost (a store that stops answering stops this node's reads too,
which then count no time). A node that ends its launch well says so
first, so that a node still finishing is not taken for lost. Imports no
torch.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import job_keys
from .ledger import RanksStopper

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

logger = logging.getLogger(__name__)


#: Seconds without a beat of the watched node after which it is lost.
LOST_AFTER = 15.0
#: What a node's counter is set to as its launch ends well.
_DONE = 1 << 40


def interval_for(num_nodes: int, kind: str) -> float:
    """Seconds between a node's beats: 1, and more from 1,000 nodes on
    node 0's store (``c10d``, two small requests a beat per node) or from
    250 in etcd (each beat is a write every member makes durable)."""
    return max(1.0, num_nodes / (250 if kind == "etcd" else 1000))


class Heartbeat:
    """This node's beats and its look at the next node's, in a thread of
    its own on a connection of its own (``connect()``), from the round
    given by :meth:`start_round` on; :attr:`lost` says which node stopped."""

    def __init__(
        self,
        connect: Callable[[], Store],
        interval: float,
        lost_after: float = LOST_AFTER,
        *,
        on_silent: Callable[[Heartbeat, float], None] | None = None,
        on_lost: Callable[[int, str, float], None] | None = None,
    ) -> None:
        self.connect = connect
        self.interval = interval
        self.lost_after = max(lost_after, 5 * interval)
        #: Called (once, from a thread of its own) when a request to the
        #: store has waited ``lost_after`` seconds without an answer, with
        #: those seconds: node 0's store lost without a word, where every
        #: request waits for TCP to give up (a quarter of an hour). It is
        #: given this heartbeat (its :attr:`loop`) and the seconds.
        self.on_silent = on_silent
        #: Called (from the heartbeat's thread) when the watched node is
        #: found lost, with its node rank, its host and the seconds it was
        #: silent; else only :attr:`lost` says so (the rank loop reads it).
        self.on_lost = on_lost
        #: This node's rank loop (``_launch.rank_loop.RankLoop``), once a round has started.
        self.loop: RanksStopper | None = None
        self._asking_since: float | None = None
        #: The watched node and its host, once it is lost: (node rank, host).
        self.lost: tuple[int, str] | None = None
        self._round: tuple[int, int, int] | None = None
        self._store: Store | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def _key(round_: int, rank: int, what: str) -> str:
        return job_keys.beat(round_, rank, what)

    def start_round(self, round_: int, rank: int, world_size: int) -> None:
        """This node is node ``rank`` of round ``round_``'s ``world_size``."""
        with self._lock:
            self._round = (round_, rank, world_size)
            self.lost = None
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="phalanx-heartbeat", daemon=True)
            self._thread.start()
            if self.on_silent is not None:
                threading.Thread(target=self._watch_store, name="phalanx-store-watch", daemon=True).start()

    def _watch_store(self) -> None:
        while not self._stop.wait(self.interval):
            since = self._asking_since
            if since is not None and time.monotonic() - since >= self.lost_after:
                assert self.on_silent is not None
                self.on_silent(self, time.monotonic() - since)
                return

    def done(self) -> None:
        """This node's launch ended well: it is not to be taken for lost."""
        self._stop.set()
        with self._lock:
            here = self._round
        if here is None:
            return
        from . import etcd3

        with contextlib.suppress(RuntimeError, ValueError, OSError), etcd3.briefly():
            self._connection().add(self._key(here[0], here[1], "beats"), _DONE)

    def close(self) -> None:
        self._stop.set()

    def _connection(self) -> Store:
        if self._store is None:
            self._store = self.connect()
        return self._store

    def _run(self) -> None:
        watched: tuple[int, int] | None = None  # (round, rank) of the node watched
        seen, since = -1, 0.0
        while not self._stop.wait(self.interval):
            with self._lock:
                here = self._round
            if here is None:
                continue
            round_, rank, world_size = here
            if world_size < 2:
                continue
            self._asking_since = time.monotonic()
            try:
                store = self._connection()
                if watched is None or watched[0] != round_:
                    store.set(self._key(round_, rank, "host"), socket.gethostname())
                store.add(self._key(round_, rank, "beats"), 1)
                other = (rank + 1) % world_size
                beats = int(store.add(self._key(round_, other, "beats"), 0))
            except (RuntimeError, ValueError, OSError):
                continue  # the store does not answer: no time counts
            finally:
                self._asking_since = None
            now = time.monotonic()
            if watched != (round_, other) or beats != seen:
                watched, seen, since = (round_, other), beats, now
                continue
            if beats >= _DONE or now - since < self.lost_after:
                continue
            host = "?"
            with contextlib.suppress(RuntimeError, ValueError, OSError):
                if store.check([self._key(round_, other, "host")]):  # a get would wait for it
                    host = bytes(store.get(self._key(round_, other, "host"))).decode()
            with self._lock:
                found = self._round == here
                if found:
                    self.lost = (other, host)
                    logger.debug("node %d (host %s) silent for %.1f s: lost", other, host, now - since)
            if found and self.on_lost is not None:
                self.on_lost(other, host, now - since)
            since = now  # said once a lost_after
