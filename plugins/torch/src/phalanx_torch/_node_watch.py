"""The node watch of a job of the ``subprocess`` launcher on several nodes:
each node posts its ranks' failure in the job's store and watches for the
others', so that every node stops its ranks within seconds of a failure on
any node, and all name the same root cause (:meth:`NodeWatch.settle`).
Imports no torch at import time."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from phalanx_core.launching import RankFailure, root_cause

from ._rounds import MET


class NodeWatch:
    """Tells every node of a job when it ends with a failure on one of
    them, through the job's store (node 0's, or etcd), so that no node
    waits for a peer that is gone.

    A node whose launch fails (out of restarts) posts its failure (rank,
    node, host, exit code, traceback, time). A thread on every node reads
    the count of posts every ``POLL`` seconds; on a node whose ranks still
    run, a post stops them (SIGTERM to this process, which elastic's agent
    turns into stopping its ranks), and :attr:`remote` holds the failure
    the node reports. Which failure is the root cause is decided by
    :func:`~phalanx_core.launching.root_cause` over every post: a rank that raised comes before
    a rank that lost its peer as a result. The node that hosts the store
    (node 0, unless it is in etcd) waits after a failure, at most ``HOLD``
    seconds, until every other node has said it is done reading the posts.
    One node: nothing to watch.
    """

    POLL = 0.2
    #: How long a node whose rank lost a peer waits for the post of the
    #: rank that caused it, and node 0 for the others to read the posts.
    HOLD = 5.0

    def __init__(
        self, connect: Callable[[], Any] | None, node_rank: int, num_nodes: int, *, hosts_store: bool
    ) -> None:
        self.connect = connect
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.hosts_store = hosts_store
        self.remote: RankFailure | None = None
        #: This node among the posts: its host and launching process.
        self.me = f"{socket.gethostname()}-{os.getpid()}"
        self._store: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._signal_lock = threading.Lock()

    def __enter__(self) -> NodeWatch:
        MET.clear()
        if self.connect is not None and threading.current_thread() is threading.main_thread():
            self._thread = threading.Thread(target=self._watch, name="phalanx-node-watch", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._signal_lock:  # no signal once the launch is over
            self._stop.set()
        if self._thread is not None:
            self._thread.join(self.POLL * 5)

    def _interrupt(self) -> None:
        """Stop this node's ranks: SIGTERM, which elastic's agent handles by
        stopping them, and which ends its run with a SignalException; not
        once this node's own failure is being settled, or the launch is over."""
        with self._signal_lock:
            if not self._stop.is_set():
                os.kill(os.getpid(), signal.SIGTERM)

    def _connect(self) -> Any:
        with self._lock:
            if self._store is None:
                import torch.distributed as dist

                assert self.connect is not None
                self._store = dist.PrefixStore("phalanx/failed", self.connect())  # type: ignore[attr-defined]
            return self._store

    def _posts(self) -> list[tuple[str, RankFailure]]:
        store = self._connect()
        found = []
        for index in range(1, int(store.add("posts", 0)) + 1):
            key = f"post/{index}"
            if not store.check([key]):
                # Counted but not written yet (perhaps by settle() on this
                # very client, whose set would wait behind a blocking get):
                # read it next time.
                continue
            who, _, text = store.get(key).decode().partition(" ")
            found.append((who, RankFailure.from_dict(json.loads(text))))
        return found

    def _others(self) -> list[RankFailure]:
        return [failure for who, failure in self._posts() if who != self.me]

    def _watch(self) -> None:
        # Connect once this node has met the others at the job's store (not
        # while the agent's own client is still connecting to it).
        while not MET.wait(self.POLL):
            if self._stop.is_set():
                return
        try:
            store = self._connect()
            while not self._stop.wait(self.POLL):
                if store.add("posts", 0):
                    posts = self._others()
                    if posts:
                        self.remote = root_cause(posts)
                        store.add("done", 1)
                        self._interrupt()
                        return
        except (RuntimeError, ValueError, OSError):
            return  # the job's store is gone: the job has ended, or node 0 with it

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
            index = store.add("posts", 1)
            store.set(f"post/{index}", f"{self.me} {json.dumps(local.to_dict())}")
            deadline = time.monotonic() + self.HOLD
            posts = self._others() + known
            # A rank that lost a peer (or was stopped) is rarely the cause:
            # while the likeliest cause posted is only that, wait a little
            # for the post of the node whose rank is the cause (with three
            # nodes or more, another node's lost-peer post came first, and
            # waiting only while this node's own was the likeliest named
            # the wrong cause on half the nodes of a 128-node simulation).
            while root_cause(posts).order()[0] >= 2 and time.monotonic() < deadline:
                time.sleep(self.POLL)
                posts = self._others() + known
            if self.hosts_store:  # the store goes with this process: let the others read it
                while store.add("done", 0) < self.num_nodes - 1 and time.monotonic() < deadline:
                    time.sleep(self.POLL)
            else:
                store.add("done", 1)
        except (RuntimeError, ValueError, OSError):
            pass  # the job's store is gone: what was read before counts
        first = root_cause(posts)
        return local if first == local else first
