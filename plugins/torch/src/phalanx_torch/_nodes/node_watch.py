"""The node watch of a job of the ``subprocess`` launcher on several nodes:
each node posts its ranks' failure in the job's store and watches for the
others', so that every node stops its ranks within seconds of a failure on
any node, and all name the same root cause (:meth:`NodeWatch.settle`).
Imports no torch at import time."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from phalanx_core.launching import RankFailure, root_cause

from . import job_keys
from .job_secret import SECRET_VAR, Signed
from .ledger import JobLedger

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

    from .heartbeat import Heartbeat

logger = logging.getLogger(__name__)

#: What the nodes post (:func:`job_keys.posted`): a failure seen, one settled.
POST, CAUSE = "post", "cause"


#: What a node posts, in place of a failure, to wake its own watch as its
#: launch ends: well (every node's watch leaves), or otherwise (the others
#: read on).
_ENDED = "ended"
_WOKEN = "woken"


class NodeWatch:
    """Tells every node of a job when it ends with a failure on one of
    them, through the job's store (node 0's, or etcd), so that no node
    waits for a peer that is gone.

    A node whose launch fails (out of restarts) posts its failure (rank,
    node, host, exit code, traceback, time) as ``post/<i>``, and, where
    the failure is a cause rather than a consequence (a rank that raised or
    was killed, not one that lost its peer or was stopped: the first two of
    :meth:`~phalanx_core.launching.RankFailure.order`'s kinds), again as
    ``cause/<j>``. A thread on every node waits for the next post, blocked
    in the store's ``wait`` on a connection of its own (a push: no request
    while nothing fails, however many nodes there are); on a node whose
    ranks still run, a post stops them (through the launch's ledger, which
    the rank loop watches), and :attr:`remote`
    holds the failure the node reports. Which failure is the root cause is
    decided by :func:`~phalanx_core.launching.root_cause`: a rank that
    raised comes before a rank that lost its peer as a result. Nodes read
    the causes, which are few, rather than every node's post (with
    thousands of nodes, every node reading every post is millions of
    reads); only where no cause is posted within ``HOLD`` seconds do they
    take the likeliest of the first ``FIRST_POSTS`` posts. The node that
    hosts the store (node 0, unless it is in etcd) waits after a failure,
    at most ``HOLD`` seconds, until every other node has said it is done
    reading the posts. One node: nothing to watch.
    """

    #: Seconds between looks at what changes only in this process (whether
    #: this node met the others) and, while a failure is being settled, at
    #: the causes posted.
    POLL = 0.2
    #: Seconds of one blocking wait for the next post; the watch then waits
    #: again. Long: the launch's end wakes its own watch with a post, and
    #: c10d prints two warning lines ("waitForInput: poll ... returned 0,
    #: likely a timeout") for every wait that times out (with 30 s, two
    #: lines every 30 s on every node of a long job).
    WAIT = 3600.0
    #: Where no node posted a cause: how many of the first posts are read
    #: for the likeliest consequence.
    FIRST_POSTS = 8
    #: How long a node whose rank lost a peer waits for the post of the
    #: rank that caused it, and node 0 for the others to read the posts.
    HOLD = 5.0
    #: How long the node that hosts the store waits, at a launch that ended
    #: well, for the others to leave it (a round may have fewer nodes than
    #: the job's most, which never come).
    LEAVE = 2.0

    def __init__(
        self,
        connect: Callable[[], Store] | None,
        node_rank: int | None,
        num_nodes: int,
        *,
        hosts_store: bool,
        heartbeat: Heartbeat | None = None,
        ledger: JobLedger | None = None,
        connect_waiter: Callable[[], Store] | None = None,
    ) -> None:
        #: The connection the watch's posts and reads go through (the
        #: launch's connection for requests that answer at once), and the
        #: one it waits on for the next post (``connect`` again where none
        #: is given: a new client each call).
        self.connect = connect
        self.connect_waiter = connect_waiter
        #: The launch's shared facts: the watch connects once it says this
        #: node met the others (a ledger of its own where none is given).
        self.ledger = ledger if ledger is not None else JobLedger()
        #: A job of fixed nodes: the heartbeat this watch starts once the
        #: nodes have met (one round, numbered 0) and ends with the launch;
        #: its :attr:`~Heartbeat.on_lost` should call :meth:`post_cause`.
        self.heartbeat = heartbeat
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.hosts_store = hosts_store
        self.remote: RankFailure | None = None
        #: When the watch stopped this node's ranks (seconds since the epoch).
        self.interrupted_at: float | None = None
        #: This node among the posts: its host and launching process.
        self.me = f"{socket.gethostname()}-{os.getpid()}"
        self._store: Store | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._signal_lock = threading.Lock()
        #: The posts the watch has read, and whether it is blocked waiting for the next.
        self._seen = 0
        self._waiting = False
        #: Whether this node has said it is done reading the posts.
        self._said_done = False
        #: Whether a post that does not prove the job's secret was said.
        self._unproven = False

    def __enter__(self) -> NodeWatch:
        if self.connect is not None and threading.current_thread() is threading.main_thread():
            self._thread = threading.Thread(target=self._watch, name="phalanx-node-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._signal_lock:  # no signal once the launch is over
            self._stop.set()
        ended = exc_info[0] is None
        if self.heartbeat is not None:
            if ended:
                self.heartbeat.done()  # the others finishing do not take this node for lost
            self.heartbeat.close()
        self._wake(ended=ended)
        if self._thread is not None:
            self._thread.join(self.POLL * 5)
        if ended:
            self._leave()

    def _leave(self) -> None:
        """At the end of a launch that ended well: each node says it has
        left the job's store, and the node that hosts it waits for the
        others (``LEAVE`` seconds at most) before it goes, its store with it.
        A request of another node still in flight then (its end-of-job
        barrier, its watch's wake) would fail, and c10d prints a warning
        with a C++ stack for each."""
        if self.connect is None or self.num_nodes == 1:
            return
        from . import etcd3

        with contextlib.suppress(RuntimeError, ValueError, OSError), etcd3.briefly():
            store = self._connect()
            if not self.hosts_store:
                store.add(job_keys.WATCH_LEFT, 1)
                return
            deadline = time.monotonic() + self.LEAVE
            while store.add(job_keys.WATCH_LEFT, 0) < self.num_nodes - 1 and time.monotonic() < deadline:
                time.sleep(self.POLL / 4)

    def _interrupt(self) -> None:
        """Stop this node's ranks: ask the launch's main thread through the
        ledger (its rank loop stops them and raises ``StopRequested``); not
        once this node's own failure is being settled, or the launch is over."""
        with self._signal_lock:
            if not self._stop.is_set():
                self.interrupted_at = time.time()
                self.ledger.request_stop()

    def post_cause(self, failure: RankFailure) -> None:
        """A failure this node saw elsewhere (a node lost without a word,
        which posts nothing itself): post it as a cause, so that every node
        names it, and stop this node's ranks, as another node's post does."""
        with self._signal_lock:
            if self._stop.is_set():
                return
        from . import etcd3

        with contextlib.suppress(RuntimeError, ValueError, OSError), etcd3.briefly():
            store = self._connect()
            text = json.dumps(failure.to_dict())
            self._post(store, POST, text)
            self._post(store, CAUSE, text)
        if self.remote is None:
            self.remote = failure
        self._interrupt()
        self._stop.set()  # the watch reads this post as its own, and leaves

    def _connect(self) -> Store:
        with self._lock:
            if self._store is None:
                import torch.distributed as dist

                assert self.connect is not None
                self._store = dist.PrefixStore(job_keys.FAILURES, self.connect())  # type: ignore[attr-defined]
            return self._store

    def _connect_waiter(self) -> Store:
        """The watch's own connection to the job's store: a blocked wait
        holds its client, and settle() and __exit__ post on the other one
        meanwhile."""
        import torch.distributed as dist

        connect = self.connect_waiter or self.connect
        assert connect is not None
        return dist.PrefixStore(job_keys.FAILURES, connect())  # type: ignore[attr-defined]

    def _post(self, store: Store, kind: str, text: str) -> None:
        """Post ``text`` as the next ``kind`` (``post`` or ``cause``), with
        this node's name and the proof of the job's secret."""
        index = int(store.add(job_keys.posted(kind), 1))
        body = f"{self.me} {text}"
        store.set(
            job_keys.posted(kind, index), f"{self.ledger.secret.sign(Signed(kind), index, body)} {body}"
        )
        logger.debug("posted %s %d: %s", kind, index, body[:200])

    def _open(self, kind: str, index: int, value: str) -> tuple[str, str] | None:
        """``(who, text)`` of post ``kind``/``index``; ``None``, said once,
        where it does not prove the job's secret (a post made by something
        that is not a node of this job is not a failure of the job's)."""
        proof, _, body = value.partition(" ")
        if self.ledger.secret.proves(proof, Signed(kind), index, body):
            who, _, text = body.partition(" ")
            return who, text
        if not self._unproven and self.ledger.say is not None:
            self.ledger.say(
                f"a failure posted in the job's store ({kind} {index}: {body[:80]!r}) does not prove the "
                f"job's secret ({SECRET_VAR}): ignored; no node of this job posted it"
            )
        self._unproven = True
        return None

    def _read(
        self, store: Store, kind: str, first: int = 1, last: int | None = None
    ) -> list[tuple[str, RankFailure]]:
        """The posts of ``kind`` (``post`` or ``cause``) numbered ``first``
        to ``last`` (to the count posted so far where None)."""
        if last is None:
            last = int(store.add(job_keys.posted(kind), 0))
        found = []
        for index in range(first, last + 1):
            key = job_keys.posted(kind, index)
            if not store.check([key]):
                # Counted but not written yet (perhaps by settle() on this
                # very client, whose set would wait behind a blocking get):
                # read it next time.
                continue
            opened = self._open(kind, index, store.get(key).decode())
            if opened is None:
                continue
            who, text = opened
            if who != self.me and text not in (_ENDED, _WOKEN):
                found.append((who, RankFailure.from_dict(json.loads(text))))
        return found

    def _causes(self) -> list[RankFailure]:
        """The other nodes' causes posted so far."""
        return [failure for _, failure in self._read(self._connect(), CAUSE)]

    def _first_posts(self) -> list[RankFailure]:
        """The other nodes' posts among the first :attr:`FIRST_POSTS`."""
        store = self._connect()
        count = int(store.add(job_keys.posted(POST), 0))
        return [failure for _, failure in self._read(store, POST, 1, min(count, self.FIRST_POSTS))]

    def _watch(self) -> None:
        # Connect once this node has met the others at the job's store (not
        # while the rendezvous' own client is still connecting to it).
        while not self.ledger.wait_met(self.POLL):
            if self._stop.is_set():
                return
        if self.heartbeat is not None:  # a job of fixed nodes, each given its rank
            assert self.node_rank is not None
            self.heartbeat.start_round(0, self.node_rank, self.num_nodes)
        try:
            import torch.distributed as dist

            waiter = self._connect_waiter()
            store = self._connect()
            with self._lock:
                self._waiting = True
            while not self._stop.is_set():
                try:
                    waiter.wait(
                        [job_keys.posted(POST, self._seen + 1)], datetime.timedelta(seconds=self.WAIT)
                    )
                except (dist.DistStoreError, LookupError):  # nothing posted (TCPStore, EtcdStore)
                    continue
                self._seen += 1
                if self._stop.is_set():
                    return
                opened = self._open(POST, self._seen, store.get(job_keys.posted(POST, self._seen)).decode())
                if opened is None:
                    continue  # not a node of this job's: read on
                who, text = opened
                if text == _ENDED:
                    return  # a node's launch ended well: so does every node's
                if text == _WOKEN or who == self.me:
                    continue
                causes = self._causes()
                self.remote = root_cause(causes) if causes else RankFailure.from_dict(json.loads(text))
                self._interrupt()
                # What stopped this node may be only a consequence (a rank
                # that lost its peer): wait a little for a cause before
                # saying this node is done reading (node 0 may then leave,
                # its store with it), unless this node settles a failure of
                # its own meanwhile (which may be that cause).
                deadline = time.monotonic() + self.HOLD
                while self.remote.order()[0] >= 2 and time.monotonic() < deadline and not self._stop.is_set():
                    time.sleep(self.POLL)
                    causes = self._causes()
                    if causes:
                        self.remote = root_cause(causes)
                self._say_done(store)
                return
        except (RuntimeError, ValueError, OSError):
            return  # the job's store is gone: the job has ended, or node 0 with it
        finally:
            with self._lock:
                self._waiting = False

    def _say_done(self, store: Store) -> None:
        """Count this node among those done reading the posts, once
        whichever of its watch and its settle() gets there first, and never
        on the node that hosts the store, which counts the others: with a
        count of its own, or two from one node, the host left (its store
        with it) before the last node had read the cause, which then named
        its own rank that only lost a peer."""
        with self._lock:
            if self._said_done or self.hosts_store:
                return
            self._said_done = True
        store.add(job_keys.WATCH_DONE, 1)

    def _wake(self, ended: bool) -> None:
        """Wake this node's watch out of its blocked wait, and let it leave:
        a thread left blocked in the store's ``wait`` (C++ without the GIL)
        that wakes while the interpreter is finalizing aborts the process
        ("terminate called without an active exception", exit status
        134). The
        wake is a post of its own that the other nodes skip; where the
        launch ended well it says so, and the other nodes' watches leave
        too (the job is over for all), so that the wakes of a job's end
        cost one read per node, not one per node and post."""
        with self._lock:
            waiting = self._waiting
        if not waiting or self._thread is None:
            return
        from . import etcd3  # a store in etcd that cannot answer: the launch ends all the same

        with contextlib.suppress(RuntimeError, ValueError, OSError), etcd3.briefly():
            store = self._connect()
            self._post(store, POST, _ENDED if ended else _WOKEN)
        self._thread.join(self.HOLD)

    def cause(self) -> RankFailure | None:
        """What this node reports after the watch stopped its ranks: the
        failure that stopped them or, where that is only a consequence (a
        rank that lost its peer), the cause another node posts within
        ``HOLD`` seconds (the watch waits for it)."""
        if self.remote is not None and self._thread is not None:  # else: the watch stopped nothing
            self._thread.join(self.HOLD + 1)
        return self.remote

    def settle(self, local: RankFailure) -> RankFailure:
        """Post this node's first failure; return the job's root cause, this
        one or another node's."""
        if self.connect is None:
            return local
        with self._signal_lock:
            self._stop.set()
        # What the watch already read counts even if node 0's store is gone
        # by now (node 0 leaves once every node has read the posts).
        known = [local] + ([self.remote] if self.remote is not None else [])
        posts = known
        try:
            store = self._connect()
            text = json.dumps(local.to_dict())
            self._post(store, POST, text)
            if local.order()[0] < 2:
                self._post(store, CAUSE, text)
            deadline = time.monotonic() + self.HOLD
            posts = self._causes() + known
            # A rank that lost a peer (or was stopped) is rarely the cause:
            # while the likeliest failure known is only that, wait a little
            # for the node whose rank is the cause to post it (with three
            # nodes or more, another node's lost-peer post came first, and
            # waiting only while this node's own was the likeliest named
            # the wrong cause on half the nodes of a 128-node simulation).
            while root_cause(posts).order()[0] >= 2 and time.monotonic() < deadline:
                time.sleep(self.POLL)
                posts = self._causes() + known
            if root_cause(posts).order()[0] >= 2:  # no cause at all: the likeliest of the first posts
                posts += self._first_posts()
            if self.hosts_store:  # the store goes with this process: let the others read it
                while store.add(job_keys.WATCH_DONE, 0) < self.num_nodes - 1 and time.monotonic() < deadline:
                    time.sleep(self.POLL)
            else:
                self._say_done(store)
        except (RuntimeError, ValueError, OSError):
            pass  # the job's store is gone: what was read before counts
        # The watch may have read another node's post while this settle ran
        # (it sets remote before it says it is done, and node 0 may leave
        # with its store as soon as it has): what it read counts too.
        if self.remote is not None:
            posts = [*posts, self.remote]
        first = root_cause(posts)
        return local if first == local else first
