"""A job in rounds at scale, by simulation: the rendezvous, the restart round
and the failure watch of N nodes against node 0's one job store.

    python bench/rendezvous_scale.py [--nodes 256] [--procs 8] [--steady 10] [--repeats 3]
        [--capacity 3] [--keep-alive 1] [--last-call 3] [--watch poll|push] [--timeout 180]
        [--target 4096] [--json]
    python bench/rendezvous_scale.py --nodes 32,64,128,256 --timeout 120   # growth; 4,096 by the model

The driver hosts the job's store on 127.0.0.1 with
``phalanx_core.launching.hosted_store`` (a ``TCPStore`` server, its libuv
thread in the driver process). Each simulated node is a thread in one of
``--procs`` worker processes (256 processes that import torch would need
about 60 GB); each does what a node's launching process does with the
job's store and nothing else:

* phalanx's ``RoundRendezvous`` over elastic's dynamic rendezvous, as
  ``_rounds.create`` made it for node 0's store until the counted rounds
  took its place (``elastic_dynamic``; bench/rounds_scale.py measures
  both), from the
  ``RendezvousParameters`` that ``SubprocessLauncher._rounds()`` gives
  elastic (min_nodes N-1, max_nodes N, join/last_call/close timeouts,
  ``keep_alive_interval`` = ``KEEP_ALIVE``, 3 attempts), on a
  ``TCPStore`` client of its own (elastic's ``_NodeDescGenerator`` gives
  every handler of a process its own local id, so the node descriptors
  differ). It joins with ``next_rendezvous()``, then loops as elastic's
  agent does: every ``monitor_interval`` (0.1 s) ``num_nodes_waiting()``,
  a new round when a node waits; after each round the agent's
  ``_assign_worker_ranks`` on the round's store and ``restarts()``; on a
  failure ``count_failure()`` and a new round. Heartbeats are elastic's
  own timer thread.
* phalanx's node watch: ``_node_watch.NodeWatch`` itself (a blocking
  ``wait`` for the next post's key on a connection of its own, the causes
  read apart from the other posts), where interrupting the node records
  the time instead of sending SIGTERM. ``--watch poll`` runs instead the
  watch it replaced (``add("posts", 0)`` every ``POLL`` = 0.2 s, every
  post read), for comparison.

Every client is made up front, one at a time: ``TCPStore``'s constructor
looks its own address up in the DNS, and this sandbox's resolver stalls
5-10 s when many lookups come at once.

Requests are counted at the client: every store a node uses is wrapped in
a ``torch.distributed.Store`` subclass that counts each call, the bytes of
the values sent and received, and failed ``compare_set`` calls, and hands
the call on (``PrefixStore`` calls come back through it). ``TCPStore.get``
is two requests on the wire (a WAIT, then the GET: checked at a TCP proxy
while writing this), so the server requests are the calls with each get
counted twice.

Per N it measures, in order:

A. join: from every node calling ``next_rendezvous()`` at once to every
   node back from it in one round (a late node that ends on the wait list
   makes the others start a round again, as the agent would: counted);
B. steady (``--steady`` s): requests per second at the store by kind,
   payload bytes per second, failed ``compare_set``, the rendezvous
   state's blob (base64 as stored, and pickled), each heartbeat's
   duration, the oldest heartbeat in the state (a node is dropped at
   3 x keep-alive), the CPU of the store's thread, of the driver and of
   the workers, how late the 0.1 s monitor ticks fire (the simulation's
   own saturation) and the load average;
C. the failure watch (``--repeats`` times): one node posts a failure as
   ``_NodeWatch.settle`` does; the time until every other node's watch
   has seen it;
C2. the cascade: the same post while every other node settles a "lost a
   peer" failure of its own at that moment (what every node of a job does
   when one rank dies); the time until every settle returned, and the reads;
D. the restart round: one node dies (its heartbeats and threads stop),
   every other node calls ``next_rendezvous()`` again at once; the time
   until every one is back in a new round of N-1, with when the dead node
   left the stored state, the round went up, N-1 had joined (last call
   begins) and the round completed (from a sampler reading the state
   every 0.25 s);
E. the store's cost: every node calls ``add`` in a loop for ``--capacity``
   s on a client of its own (requests per second, the store thread's CPU
   per request), then reads a state of ``--target`` nodes in a loop (its
   CPU per byte);
F. one read-modify-write of the state blob (get, unpickle, a heartbeat,
   pickle, compare_set) with nobody else writing: the window during which
   a heartbeat's write can be beaten by another node's; of this job's
   state once its workers have exited, and at the end of states made with
   up to 2 x ``--target`` nodes.

A phase that does not end within ``--timeout`` prints the stored state
every 2 s and ends that size's run.

It then prints a table per N, the growth between sizes and an
extrapolation to ``--target`` nodes (4,096) by the model stated next to
each line. On a machine of few cores the simulation itself (N Python
threads unpickling the state) takes the CPU the store would have: the
CPU figures say how much. This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import base64
import collections
import contextlib
import datetime
import json
import logging
import math
import multiprocessing as mp
import os
import pickle
import queue
import random
import resource
import statistics
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousParameters

from phalanx_core.launching import RankFailure, hosted_store, root_cause
from phalanx_torch._nodes import job_keys
from phalanx_torch._nodes import job_store as _job_store
from phalanx_torch._nodes import rendezvous_place as _rendezvous_place
from phalanx_torch._nodes import rounds as _rounds
from phalanx_torch._nodes.node_watch import NodeWatch as _NodeWatch

LOOPBACK = "127.0.0.1"
MONITOR = 0.1  # elastic's monitor_interval, as the launcher sets it
TARGET = 4096
RAISED = 'Traceback (most recent call last):\n  File "train.py", line 9\nValueError: boom'
LOST_PEER = (
    'Traceback (most recent call last):\n  File "train.py", line 9\nRuntimeError: Connection reset by peer'
)


# --------------------------------------------------------------------------- counting


#: Seconds between a node's heartbeats in elastic's dynamic rendezvous (in
#: etcd), up to about 500 nodes (see :func:`keep_alive_for`); a node is
#: dropped after three missed.
KEEP_ALIVE = 1

#: The seconds one heartbeat's write of elastic's rendezvous state takes per
#: node in it (read, unpickle, change, pickle, compare_set of one blob that
#: holds every node: 6-8 ms at 4,096 nodes on loopback, bench/README.md).
_WRITE_PER_NODE = 1.6e-6


def keep_alive_for(num_nodes: int) -> int:
    """Seconds between heartbeats in a job of at most ``num_nodes`` nodes.

    Elastic keeps every node's heartbeat in one stored blob that each node
    rewrites with a compare-and-set; a write fails when another lands in
    its window, which grows with the blob (``N x 1.6 us``). Heartbeats
    collide rarely only while ``N / interval x window`` stays below about
    0.5, so the interval grows as ``2 N^2 x 1.6 us``: 1 s up to about 550
    nodes, 4 s at 1,024, 54 s at 4,096 (a lost node is then seen after
    three intervals). Measured by bench/rendezvous_scale.py: with 1 s at
    256 simulated nodes, 97 % of the writes failed and no round formed."""
    return max(KEEP_ALIVE, math.ceil(2 * num_nodes * num_nodes * _WRITE_PER_NODE))


class Counts:
    """Calls, payload bytes out and in, and failures, per (kind, op), for a
    whole worker process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.table: dict[tuple[str, str], list[int]] = {}
        #: For each compare_set of the state: how old the state it replaces
        #: was (s since this client read it), and whether it failed.
        self.ages: list[tuple[float, bool]] = []

    def take_ages(self) -> list[tuple[float, bool]]:
        with self.lock:
            ages, self.ages = self.ages, []
        return ages

    def add(self, kind: str, op: str, out: int = 0, back: int = 0, failed: int = 0, calls: int = 1) -> None:
        with self.lock:
            row = self.table.setdefault((kind, op), [0, 0, 0, 0])
            row[0] += calls
            row[1] += out
            row[2] += back
            row[3] += failed

    def snapshot(self) -> dict[str, list[int]]:
        with self.lock:
            return {f"{kind}|{op}": list(row) for (kind, op), row in self.table.items()}


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (bytes, str)) else 0


class CountedStore(dist.Store):
    """Counts every call and hands it on to ``inner``. ``kind`` names the
    client; calls on the rendezvous state's key count as ``state``."""

    def __init__(self, inner: Any, counts: Counts, kind: str, state_key: str = "") -> None:
        super().__init__()
        self.inner, self.counts, self.kind, self.state_key = inner, counts, kind, state_key
        self.read_at = 0.0  # when this client last read the state (a get, or a compare_set's answer)

    def _kind(self, key: str) -> str:
        return "state" if key == self.state_key else self.kind

    def set(self, key: str, value: Any) -> None:
        self.counts.add(self._kind(key), "set", out=_size(value))
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        value = self.inner.get(key)
        if key == self.state_key:
            self.read_at = time.monotonic()
        self.counts.add(self._kind(key), "get", back=len(value))
        return value

    def add(self, key: str, amount: int) -> int:
        self.counts.add(self._kind(key), "add")
        return int(self.inner.add(key, amount))

    def enter(self, key: str) -> int:  # the etcd store's add(key, 1) (counted rounds in etcd)
        self.counts.add(self._kind(key), "enter")
        return int(self.inner.enter(key))

    def entered(self, key: str) -> int:
        self.counts.add(self._kind(key), "entered")
        return int(self.inner.entered(key))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value = self.inner.compare_set(key, expected, desired)
        wanted = desired.encode() if isinstance(desired, str) else bytes(desired)
        failed = int(value != wanted)
        self.counts.add(self._kind(key), "compare_set", _size(expected) + _size(desired), len(value), failed)
        if key == self.state_key:
            answered = time.monotonic()
            if self.read_at and expected:  # a write over a state read before (not the first, empty one)
                with self.counts.lock:
                    if len(self.counts.ages) < 200_000:
                        self.counts.ages.append((answered - self.read_at, bool(failed)))
            self.read_at = answered
        return value

    def check(self, keys: list[str]) -> bool:
        self.counts.add(self.kind, "check")
        return bool(self.inner.check(keys))

    def wait(self, keys: list[str], timeout: Any = None) -> None:
        self.counts.add(self.kind, "wait")
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self.inner.multi_get(keys)
        self.counts.add(self.kind, "multi_get", back=sum(len(v) for v in values))
        return values

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.counts.add(self.kind, "multi_set", out=sum(_size(v) for v in values))
        self.inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        self.counts.add(self.kind, "delete_key")
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)


# --------------------------------------------------------------------------- one node


class SimWatch(_NodeWatch):
    """phalanx's node watch, whose interrupt records the time instead of
    sending SIGTERM to the process (which holds 32 nodes here).
    ``--watch push`` runs its watch as it is (a blocking wait for the next
    post); ``--watch poll`` the one it replaced (the count of posts read
    every ``POLL`` seconds), for comparison."""

    def __init__(self, connect: Any, waiter: Any, index: int, num_nodes: int, seen: Any, mode: str) -> None:
        super().__init__(connect, index, num_nodes, hosts_store=False)
        self.waiter_client = waiter
        self.me = f"sim-{index}"
        self.seen = seen
        self.mode = mode

    def start(self) -> None:
        self.ledger.met()  # the job's store is up from the start here
        watch = self._watch if self.mode == "push" else self._watch_poll
        phase = random.uniform(0, self.POLL)  # nodes' polls are not in step

        def target() -> None:
            if not self._stop.wait(phase):
                watch()

        self._thread = threading.Thread(target=target, name="sim-watch", daemon=True)
        self._thread.start()

    def _interrupt(self) -> None:
        with self._signal_lock:
            if not self._stop.is_set():
                self.seen(time.monotonic())

    def _connect_waiter(self) -> Any:
        return dist.PrefixStore(job_keys.FAILURES, self.waiter_client())

    def _watch_poll(self) -> None:
        """The watch before the push: the count of posts every ``POLL``
        seconds, and every post read when it grew."""
        while not self.ledger.wait_met(self.POLL):
            if self._stop.is_set():
                return
        try:
            store = self._connect()
            while not self._stop.wait(self.POLL):
                if store.add("posts", 0):
                    posts = [failure for _, failure in self._read(store, "post")]
                    if posts:
                        self.remote = root_cause(posts)
                        store.add("done", 1)
                        self._interrupt()
                        return
        except (RuntimeError, ValueError, OSError):
            return


def elastic_dynamic(params: Any, client: Any, place: Any, timeout: float) -> Any:
    """phalanx's round handler over elastic's dynamic rendezvous with its
    c10d backend on ``client``: what ``_rounds.create`` made for node 0's
    store before the counted rounds took its place (2026-11-26), and
    still makes for etcd."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dynamic
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

    backend = C10dRendezvousBackend(client, place.name)
    inner = _DynamicAsRounds(dynamic.create_handler(client, backend, params))
    return _rounds._handler_class()(inner, client, LOOPBACK, timeout, place.describe())


class _DynamicAsRounds:
    """Elastic's dynamic handler (``dynamic``) as the counted rounds are
    to phalanx's round handler: ``next_rendezvous`` gives ``(store, node
    rank, nodes, address)`` and ``round``; nothing is said of the nodes
    of the round before (``left``); the rest is the dynamic handler's."""

    left: list[Any] = []  # noqa: RUF012 - never changed
    previous = -1

    def __init__(self, dynamic: Any) -> None:
        self.dynamic = dynamic

    def next_rendezvous(self) -> tuple[Any, int, int, str]:
        info = self.dynamic.next_rendezvous()
        return info.store, info.rank, info.world_size, LOOPBACK

    @property
    def round(self) -> int:
        return int(self.dynamic._state_holder.state.round)

    def joined(self) -> list[str]:
        return [str(node) for node in self.dynamic._state_holder.state.participants]

    def waiting_now(self) -> int:
        return int(self.dynamic.num_nodes_waiting())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dynamic, name)


class SimNode:
    """One node's launching process, as far as the job's store sees it."""

    def __init__(self, index: int, cfg: SimpleNamespace, counts: Counts, events: Any) -> None:
        self.index, self.cfg, self.counts, self.events = index, cfg, counts, events
        place = _rendezvous_place.parse_rendezvous(None, LOOPBACK, cfg.port)
        wait = datetime.timedelta(seconds=cfg.timeout)
        self.client = CountedStore(
            dist.TCPStore(LOOPBACK, cfg.port, is_master=False, timeout=wait),
            counts,
            "agent",
            f"torch.rendezvous.{place.name}",
        )
        # What SubprocessLauncher._rounds() gives elastic's launch, and
        # elastic's launch gives RendezvousParameters (the store: this
        # node's own client rather than one job_store() would connect).
        configs = {
            "place": place,
            "listen": LOOPBACK,
            "job_store": _job_store.JobStore.given(place, self.client, timeout=cfg.timeout, hosted=True),
            "timeout": cfg.timeout,
            "join_timeout": cfg.timeout,
            "last_call_timeout": max(1, math.ceil(cfg.last_call)),
            "close_timeout": 30,
            "keep_alive_interval": cfg.keep_alive,
            "keep_alive_max_attempt": 3,
            "say": None,
        }
        params = RendezvousParameters(
            backend=_rounds.ELASTIC,
            endpoint=place.endpoint,
            run_id=place.name,
            min_nodes=cfg.min_nodes,
            max_nodes=cfg.num_nodes,
            local_addr=LOOPBACK,
            **configs,
        )
        self.handler = elastic_dynamic(params, self.client, place, cfg.timeout)
        self.handler.hosts_store = False  # only node 0's launching process hosts it
        self.desc = repr(self.handler._inner.dynamic._this_node)
        self.heartbeats: list[float] = []
        inner = self.handler._inner.dynamic
        keep_alive = inner._keep_alive

        def timed_keep_alive() -> None:  # elastic's timer calls self._keep_alive()
            start = time.monotonic()
            keep_alive()
            self.heartbeats.append(time.monotonic() - start)

        inner._keep_alive = timed_keep_alive
        self.watch: SimWatch | None = None
        # Every client made now, one at a time: TCPStore's constructor looks
        # its own address up in the DNS, and on this sandbox's resolver many
        # lookups at once stall for 5-10 s (a Python store object must also
        # outlive the C++ ones that wrap it).
        self.reader = CountedStore(
            dist.TCPStore(LOOPBACK, cfg.port, is_master=False, timeout=wait), counts, "watch"
        )
        self.waiter: CountedStore | None = None
        self.cap_client = dist.TCPStore(LOOPBACK, cfg.port, is_master=False, timeout=wait)  # E only
        if cfg.watch == "push":
            self.waiter = CountedStore(
                dist.TCPStore(LOOPBACK, cfg.port, is_master=False, timeout=wait), counts, "watch"
            )
        self.stop = threading.Event()
        self.restart = threading.Event()
        self.late: list[float] = []
        self.in_round = False
        self.thread = threading.Thread(target=self.run, name=f"sim-node-{index}", daemon=True)

    def emit(self, *event: Any) -> None:
        self.events.put(event)

    def connect(self, rep: int, waiter: bool = False) -> Any:
        """The watch's client of the job's store (``_NodeWatch.connect``
        makes a new one per launch; here they are made once, up front),
        with keys of this repetition's own (``rep<N>/phalanx/failed/...``)."""
        return dist.PrefixStore(f"rep{rep}", self.waiter if waiter else self.reader)

    def arm(self, rep: int) -> None:
        """A fresh watch, as every launch has."""
        if self.watch is not None:  # the launch before is over: its watch leaves
            self.watch.__exit__(None, None, None)
        self.watch = SimWatch(
            lambda: self.connect(rep),
            lambda: self.connect(rep, waiter=True),
            self.index,
            self.cfg.num_nodes,
            lambda when: self.emit("seen", self.index, rep, when),
            self.cfg.watch,
        )
        self.watch.start()

    def _join(self) -> None:
        self.emit("rdzv", self.index, time.monotonic())
        info = self.handler.next_rendezvous()
        spec = SimpleNamespace(role="phalanx", local_world_size=1)
        SimpleElasticAgent._assign_worker_ranks(None, info.store, info.rank, info.world_size, spec)  # type: ignore[arg-type]
        self.handler.restarts()
        self.emit("joined", self.index, self.handler.round, info.rank, info.world_size, time.monotonic())

    def run(self) -> None:
        try:
            self._join()
            every = max(1, round(self.cfg.waiting_every / MONITOR))
            tick = 0
            while not self.stop.is_set():
                before = time.monotonic()
                if self.stop.wait(MONITOR):
                    break
                self.late.append(time.monotonic() - before - MONITOR)
                if self.restart.is_set():  # this node's ranks failed: the agent counts it, meets again
                    self.restart.clear()
                    self.handler.count_failure()
                    self._join()
                    continue
                tick += 1
                if tick % every == 0 and self.handler.num_nodes_waiting() > 0:
                    self.emit("waiting", self.index, time.monotonic())
                    self._join()
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which prints it
            if not self.stop.is_set():
                self.emit("error", self.index, f"{type(exc).__name__}: {exc}"[:300])

    def kill(self) -> None:
        """As if the node's host went away: no more heartbeats, no threads."""
        self.stop.set()
        self.handler._inner.dynamic._stop_heartbeats()
        if self.watch is not None:
            self.watch._stop.set()

    def settle(self, rep: int, failure: RankFailure) -> None:
        assert self.watch is not None
        start = time.monotonic()
        first = self.watch.settle(failure)
        self.emit("settled", self.index, rep, start, time.monotonic(), first.traceback == RAISED)

    def hammer(self, seconds: float, key: str) -> None:
        """E: small adds (``key`` empty) or reads of ``key`` in a loop, on a
        client of their own (counted here, not call by call)."""
        client = self.cap_client
        deadline = time.monotonic() + seconds
        calls = size = 0
        while time.monotonic() < deadline:
            if key:
                size += len(client.get(key))
            else:
                client.add("cap", 0)
            calls += 1
        self.counts.add("cap", "get" if key else "add", back=size, calls=calls)


class _CountingHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def _worker(wid: int, indices: list[int], cfg: SimpleNamespace, commands: Any, events: Any) -> None:
    """One worker process: the nodes ``indices``, driven by ``commands``."""
    warnings = _CountingHandler()
    for name in ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "torch.distributed.elastic"):
        log = logging.getLogger(name)
        log.addHandler(warnings)
        log.propagate = False
    counts = Counts()
    nodes = {index: SimNode(index, cfg, counts, events) for index in indices}
    events.put(("ready", wid, {index: node.desc for index, node in nodes.items()}))
    while True:
        command, *args = commands.get()
        if command == "go":
            for node in nodes.values():
                node.arm(0)
                node.thread.start()
        elif command == "stats":
            late: list[float] = []
            beats: list[float] = []
            for node in nodes.values():
                late += node.late
                beats += node.heartbeats
                node.late, node.heartbeats = [], []
            cpu = time.process_time()
            events.put(
                ("stats", wid, counts.snapshot(), cpu, late, beats, warnings.count, counts.take_ages())
            )
        elif command == "arm":
            for node in nodes.values():
                if not node.stop.is_set():
                    node.arm(args[0])
        elif command == "post":
            index, rep = args
            failure = RankFailure(index, 1, RAISED, time.time(), node=index, host="sim")
            threading.Thread(target=nodes[index].settle, args=(rep, failure), daemon=True).start()
        elif command == "cascade":
            rep, root = args
            for index, node in nodes.items():
                text = RAISED if index == root else LOST_PEER
                failure = RankFailure(index, 1, text, time.time(), node=index, host="sim")
                threading.Thread(target=node.settle, args=(rep, failure), daemon=True).start()
        elif command == "kill":
            nodes[args[0]].kill()
        elif command == "restart":
            for node in nodes.values():
                node.restart.set()
        elif command == "hammer":
            threads = [
                threading.Thread(target=node.hammer, args=tuple(args), daemon=True)
                for node in nodes.values()
                if not node.stop.is_set()
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            events.put(("hammered", wid))
        elif command == "stop":
            for node in nodes.values():
                node.kill()
            events.put(("stopped", wid))
            return


def _worker_main(wid: int, indices: list[int], cfg: SimpleNamespace, commands: Any, events: Any) -> None:
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # what _rounds sets around each round
    try:
        _worker(wid, indices, cfg, commands, events)
    except Exception as exc:  # noqa: BLE001 - reported to the driver, which prints it
        events.put(("error", -1 - wid, f"worker {wid}: {type(exc).__name__}: {exc}"[:300]))


# --------------------------------------------------------------------------- driver side


class Collector:
    """Every event from the workers, in the driver."""

    def __init__(self, events: Any) -> None:
        self.events = events
        self.cond = threading.Condition()
        self.items: list[tuple[Any, ...]] = []
        self.errors: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        while not self.done.is_set():
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                continue
            except (EOFError, OSError):
                return
            with self.cond:
                self.items.append(event)
                if event[0] == "error":
                    self.errors.append(str(event[2]))
                self.cond.notify_all()

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        with self.cond:
            return [event for event in self.items if event[0] == kind]

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
            return True


class Sampler:
    """Reads the rendezvous state from the store every ``every`` seconds
    (its own client, not counted)."""

    def __init__(self, port: int, key: str, every: float) -> None:
        self.client = dist.TCPStore(LOOPBACK, port, is_master=False, timeout=datetime.timedelta(seconds=30))
        self.key, self.every = key, every
        self.samples: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def read(self) -> dict[str, Any] | None:
        if not self.client.check([self.key]):
            return None
        raw = self.client.get(self.key)
        if raw == b"Y2FuaW1hZGFt":  # elastic's empty state
            return None
        bits = base64.b64decode(raw)
        state = pickle.loads(bits)
        now = datetime.datetime.now(datetime.timezone.utc)
        ages = [(now - beat).total_seconds() for beat in state.last_heartbeats.values()]
        return {
            "t": time.monotonic(),
            "b64": len(raw),
            "pickled": len(bits),
            "round": state.round,
            "complete": state.complete,
            "deadline": state.deadline is not None,
            "participants": {repr(node) for node in state.participants},
            "wait_list": len(state.wait_list),
            "beats": {repr(node) for node in state.last_heartbeats},
            "max_age": max(ages, default=0.0),
        }

    def _run(self) -> None:
        while not self.stop.wait(self.every):
            with contextlib.suppress(Exception):
                sample = self.read()
                if sample is not None:
                    self.samples.append(sample)

    def between(self, start: float, end: float) -> list[dict[str, Any]]:
        return [s for s in self.samples if start <= s["t"] <= end]


def _made_state(size: int) -> Any:
    """Elastic's rendezvous state of a complete round of ``size`` nodes,
    each with a heartbeat, addressed as nodes of a cluster are."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

    state = _RendezvousState()
    now = datetime.datetime.now(datetime.timezone.utc)
    for index in range(size):
        node = _NodeDesc(f"10.{index >> 16 & 255}.{index >> 8 & 255}.{index & 255}", 4000 + index % 60000, 0)
        state.participants[node] = index
        state.last_heartbeats[node] = now
    state.complete = True
    return state


def _read_modify_write(client: Any, key: str, repeats: int = 9) -> float:
    """The least time of ``repeats`` heartbeats' writes as elastic's state
    holder makes them: get, decode, unpickle, one heartbeat, pickle, encode,
    compare_set (on this machine's loopback: add the network's round trips)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        raw = client.get(key)
        state = pickle.loads(base64.b64decode(raw))
        node = next(iter(state.last_heartbeats))
        state.last_heartbeats[node] = datetime.datetime.now(datetime.timezone.utc)
        new = base64.b64encode(pickle.dumps(state)).decode()
        client.compare_set(key, raw.decode(), new)
        times.append(time.perf_counter() - start)
    return min(times)  # the cost itself, the least disturbed by the machine


def made_windows(sizes: list[int], timeout: float) -> dict[int, tuple[float, int]]:
    """F for states of ``sizes`` nodes made here, on a store of their own:
    the least read-modify-write time and the blob's size."""
    store = hosted_store(LOOPBACK, 0, timeout=datetime.timedelta(seconds=timeout))
    client = dist.TCPStore(LOOPBACK, store.port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    windows = {}
    for size in sorted(set(sizes)):
        key = f"bench/state-{size}"
        client.set(key, base64.b64encode(pickle.dumps(_made_state(size))).decode())
        windows[size] = (_read_modify_write(client, key, repeats=15), len(client.get(key)))
    return windows


def _store_thread_cpu() -> float:
    """CPU seconds of the store server's threads in this process."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("pt_tcpstore"):
                    continue
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Stuck(Exception):
    """A phase that did not end within the time limit (the later ones are skipped)."""


class Run:
    """One simulated job of ``n`` nodes."""

    def __init__(self, n: int, args: argparse.Namespace, ctx: Any) -> None:
        self.n, self.args, self.ctx = n, args, ctx
        self.wait = datetime.timedelta(seconds=args.timeout)
        self.store = hosted_store(LOOPBACK, 0, timeout=self.wait)
        self.port = self.store.port
        place = _rendezvous_place.parse_rendezvous(None, LOOPBACK, self.port)
        self.key = f"torch.rendezvous.{place.name}"
        self.procs = min(args.procs, n)
        self.cfg = SimpleNamespace(
            port=self.port,
            num_nodes=n,
            min_nodes=max(1, n - 1),
            timeout=args.timeout,
            last_call=args.last_call,
            keep_alive=args.keep_alive,
            watch=args.watch,
            waiting_every=args.waiting_every,
        )
        self.events = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(self.procs)]
        self.owner = {index: index % self.procs for index in range(n)}
        self.collector = Collector(self.events)
        self.workers: list[Any] = []
        self.desc: dict[int, str] = {}
        self.result: dict[str, Any] = {"nodes": n, "procs": self.procs, "keep_alive": args.keep_alive}

    def send(self, wid: int, *command: Any) -> None:
        self.commands[wid].put(command)

    def send_all(self, *command: Any) -> None:
        for wid in range(self.procs):
            self.send(wid, *command)

    def start(self) -> None:
        for wid in range(self.procs):
            indices = [index for index, owner in self.owner.items() if owner == wid]
            worker = self.ctx.Process(
                target=_worker_main,
                args=(wid, indices, self.cfg, self.commands[wid], self.events),
                daemon=True,
            )
            worker.start()
            self.workers.append(worker)
        ok = self.collector.wait_for(
            lambda: len(self.collector.of("ready")) == self.procs or bool(self.collector.errors), 180
        )
        if not ok or self.collector.errors:
            raise RuntimeError(f"workers did not start: {self.collector.errors[:3]}")
        for event in self.collector.of("ready"):
            self.desc.update(event[2])

    def stats(self) -> dict[str, Any]:
        before = len(self.collector.of("stats"))
        self.send_all("stats")
        self.collector.wait_for(lambda: len(self.collector.of("stats")) >= before + self.procs, 30)
        replies = self.collector.of("stats")[before:]
        table: dict[str, list[int]] = {}
        cpu = 0.0
        late: list[float] = []
        beats: list[float] = []
        warnings = 0
        ages: list[tuple[float, bool]] = []
        for _, _, counts, worker_cpu, worker_late, worker_beats, worker_warnings, worker_ages in replies:
            ages += worker_ages
            for key, row in counts.items():
                table[key] = [a + b for a, b in zip(table.get(key, [0, 0, 0, 0]), row, strict=True)]
            cpu += worker_cpu
            late += worker_late
            beats += worker_beats
            warnings += worker_warnings
        return {
            "t": time.monotonic(),
            "table": table,
            "workers_cpu": cpu,
            "late": late,
            "beats": beats,
            "warnings": warnings,
            "ages": ages,
            "store_cpu": _store_thread_cpu(),
            "driver_cpu": _self_cpu(),
            "load": os.getloadavg()[0],
        }

    def latest_rounds(self, alive: set[int]) -> tuple[dict[int, tuple[int, float]], set[int]]:
        joined: dict[int, tuple[int, float]] = {}
        pending: set[int] = set()
        with self.collector.cond:
            for event in self.collector.items:
                if event[0] == "rdzv" and event[1] in alive:
                    pending.add(event[1])
                elif event[0] == "joined" and event[1] in alive:
                    pending.discard(event[1])
                    joined[event[1]] = (event[2], event[5])
        return joined, pending

    def settled_round(self, alive: set[int], above: int) -> tuple[int, float] | None:
        joined, pending = self.latest_rounds(alive)
        if pending or len(joined) < len(alive):
            return None
        rounds = {r for r, _ in joined.values()}
        if len(rounds) != 1 or next(iter(rounds)) <= above:
            return None
        return next(iter(rounds)), max(t for _, t in joined.values())

    def trajectory(self, start: float, end: float, every: float = 2.0) -> list[str]:
        """The stored state every ``every`` s between ``start`` and ``end``."""
        lines = []
        next_t = start
        for sample in self.sampler.between(start, end):
            if sample["t"] < next_t:
                continue
            next_t = sample["t"] + every
            lines.append(
                f"{sample['t'] - start:6.1f} s: round {sample['round']}"
                f"{' complete' if sample['complete'] else ''}, {len(sample['participants'])} participants, "
                f"{sample['wait_list']} waiting, {len(sample['beats'])} heartbeats (oldest "
                f"{sample['max_age']:.1f} s), blob {_bytes(sample['b64'])}"
            )
        return lines

    # ------------------------------------------------------------------ phases

    def _busy(self, name: str, first: dict[str, Any], last: dict[str, Any]) -> None:
        """CPU (cores) and the state's compare_set between two stats()."""
        span = last["t"] - first["t"]
        cas = [
            b - a
            for a, b in zip(
                first["table"].get("state|compare_set", [0, 0, 0, 0]),
                last["table"].get("state|compare_set", [0, 0, 0, 0]),
                strict=True,
            )
        ]
        self.result[f"{name}_workers_cpu"] = (last["workers_cpu"] - first["workers_cpu"]) / span
        self.result[f"{name}_store_cpu"] = (last["store_cpu"] - first["store_cpu"]) / span
        self.result[f"{name}_cas"] = cas[0]
        self.result[f"{name}_cas_failed"] = cas[3] / cas[0] if cas[0] else 0.0
        self.result[f"{name}_load"] = last["load"]
        ages = [age for age, _ in last["ages"]]
        self.result[f"{name}_age_median_s"] = statistics.median(ages) if ages else float("nan")

    def phase_join(self) -> None:
        alive = set(range(self.n))
        before = self.stats()
        start = time.monotonic()
        self.send_all("go")
        ok = self.collector.wait_for(
            lambda: self.settled_round(alive, -1) is not None or bool(self.collector.errors),
            self.args.timeout,
        )
        self._busy("join", before, self.stats())
        settled = self.settled_round(alive, -1)
        if not ok or settled is None:
            joined, pending = self.latest_rounds(alive)
            self.result["join_s"] = float("nan")
            self.result["trajectory"] = self.trajectory(start, time.monotonic())
            self.result["join_stuck"] = (
                f"after {self.args.timeout} s: {len(joined)} nodes back from next_rendezvous "
                f"(rounds {sorted({r for r, _ in joined.values()})}), {len(pending)} still in it"
            )
            raise _Stuck("join")
        self.round, end = settled
        samples = self.sampler.between(start, end + 1)
        self.result["join_s"] = end - start
        self.result["join_round"] = self.round
        self.result["join_rounds_started"] = len(self.collector.of("waiting"))
        self.result["join_min_reached_s"] = next(
            (s["t"] - start for s in samples if s["deadline"] or s["complete"]), float("nan")
        )

    def phase_steady(self) -> None:
        time.sleep(2.0)
        first = self.stats()
        time.sleep(self.args.steady)
        last = self.stats()
        span = last["t"] - first["t"]
        table = {
            key: [b - a for a, b in zip(first["table"].get(key, [0, 0, 0, 0]), row, strict=True)]
            for key, row in last["table"].items()
        }
        calls = sum(row[0] for row in table.values())
        requests = calls + sum(row[0] for key, row in table.items() if key.endswith("|get"))
        by_kind: dict[str, float] = {}
        for key, row in table.items():
            by_kind[key] = row[0] / span
        state_bytes = sum(row[1] + row[2] for key, row in table.items() if key.startswith("state|"))
        all_bytes = sum(row[1] + row[2] for row in table.values())
        cas = table.get("state|compare_set", [0, 0, 0, 0])
        samples = self.sampler.between(first["t"], last["t"])
        # A compare_set fails when another node's write landed since its
        # state was read: with writes landing at rate lam, at 1 - exp(-lam * age).
        landed = (cas[0] - cas[3]) / span
        ages = last["ages"]
        predicted = statistics.fmean(1 - math.exp(-landed * age) for age, _ in ages) if ages else float("nan")
        self.result.update(
            cas_age_median_s=statistics.median(age for age, _ in ages) if ages else float("nan"),
            cas_age_p90_s=_pct([age for age, _ in ages], 0.9),
            cas_failed_predicted=predicted,
            cas_landed_per_s=landed,
        )
        self.result.update(
            steady_s=span,
            calls_per_s=calls / span,
            requests_per_s=requests / span,
            by_op_per_s={key: round(value, 1) for key, value in sorted(by_kind.items())},
            state_bytes_per_s=state_bytes / span,
            bytes_per_s=all_bytes / span,
            cas_per_s=cas[0] / span,
            cas_failed=cas[3] / cas[0] if cas[0] else 0.0,
            blob_b64=max((s["b64"] for s in samples), default=0),
            blob_pickled=max((s["pickled"] for s in samples), default=0),
            oldest_beat_s=max((s["max_age"] for s in samples), default=float("nan")),
            fewest_in_state=min((len(s["beats"]) for s in samples), default=0),
            heartbeat_median_s=statistics.median(last["beats"]) if last["beats"] else float("nan"),
            heartbeat_p99_s=_pct(last["beats"], 0.99),
            heartbeat_max_s=max(last["beats"], default=float("nan")),
            heartbeat_warnings=last["warnings"] - first["warnings"],
            late_median_s=statistics.median(last["late"]) if last["late"] else float("nan"),
            late_p99_s=_pct(last["late"], 0.99),
            store_cpu=(last["store_cpu"] - first["store_cpu"]) / span,
            driver_cpu=(last["driver_cpu"] - first["driver_cpu"]) / span,
            workers_cpu=(last["workers_cpu"] - first["workers_cpu"]) / span,
            load=(first["load"] + last["load"]) / 2,
        )

    def phase_watch(self) -> None:
        latencies: list[float] = []
        medians: list[float] = []
        for rep in range(self.args.repeats):
            if rep:
                self.send_all("arm", rep)
                time.sleep(1.0)
            poster = (rep * 7919 + 3) % self.n
            self.send(self.owner[poster], "post", poster, rep)
            want = self.n - 1
            ok = self.collector.wait_for(
                lambda rep=rep, want=want: (
                    len([e for e in self.collector.of("seen") if e[2] == rep]) >= want
                    and any(e[2] == rep for e in self.collector.of("settled"))
                ),
                30,
            )
            settled = [e for e in self.collector.of("settled") if e[2] == rep]
            seen = [e[3] for e in self.collector.of("seen") if e[2] == rep]
            if not ok or not settled:
                latencies.append(float("nan"))
                continue
            start = settled[0][3]
            latencies.append(max(seen) - start)
            medians.append(statistics.median(seen) - start)
        self.result["watch_max_s"] = latencies
        self.result["watch_median_s"] = medians

    def phase_cascade(self) -> None:
        rep = self.args.repeats
        self.send_all("arm", rep)
        time.sleep(1.0)
        first = self.stats()
        start = time.monotonic()
        self.send_all("cascade", rep, 0)
        ok = self.collector.wait_for(
            lambda: len([e for e in self.collector.of("settled") if e[2] == rep]) >= self.n, 120
        )
        last = self.stats()
        settled = [e for e in self.collector.of("settled") if e[2] == rep]
        table = last["table"]
        gets = table.get("watch|get", [0])[0] - first["table"].get("watch|get", [0])[0]
        calls = sum(row[0] for row in table.values()) - sum(row[0] for row in first["table"].values())
        self.result.update(
            cascade_s=(max(e[4] for e in settled) - start) if ok else float("nan"),
            cascade_median_s=statistics.median(e[4] - start for e in settled) if settled else float("nan"),
            cascade_right=sum(1 for e in settled if e[5]),
            cascade_post_gets=gets,
            cascade_calls=calls,
        )

    def phase_restart(self) -> None:
        self.send_all("arm", self.args.repeats + 1)
        time.sleep(1.5)
        victim = self.n - 1
        alive = set(range(self.n)) - {victim}
        desc = self.desc[victim]
        before = self.round
        first_stats = self.stats()
        start = time.monotonic()
        self.send(self.owner[victim], "kill", victim)
        self.send_all("restart")
        ok = self.collector.wait_for(
            lambda: self.settled_round(alive, before) is not None or bool(self.collector.errors),
            self.args.timeout,
        )
        self._busy("restart", first_stats, self.stats())
        settled = self.settled_round(alive, before)
        samples = self.sampler.between(start, time.monotonic() + 1)

        def first(test: Any) -> float:
            return next((s["t"] - start for s in samples if test(s)), float("nan"))

        self.result["restart_trajectory"] = self.trajectory(start, time.monotonic(), every=1.0)
        self.result.update(
            restart_s=(settled[1] - start) if ok and settled else float("nan"),
            restart_dead_gone_s=first(lambda s: desc not in s["beats"]),
            restart_round_up_s=first(lambda s: s["round"] > before),
            restart_min_reached_s=first(lambda s: s["round"] > before and (s["deadline"] or s["complete"])),
            restart_complete_s=first(lambda s: s["round"] > before and s["complete"]),
            restart_round=settled[0] if settled else None,
        )

    def _hammer(self, key: str) -> dict[str, float]:
        first = self.stats()
        before = len(self.collector.of("hammered"))
        self.send_all("hammer", self.args.capacity, key)
        self.collector.wait_for(
            lambda: len(self.collector.of("hammered")) >= before + self.procs, self.args.capacity + 30
        )
        last = self.stats()
        span = last["t"] - first["t"]
        diff = {
            name: [b - a for a, b in zip(first["table"].get(name, [0, 0, 0, 0]), row, strict=True)]
            for name, row in last["table"].items()
        }
        op = "cap|get" if key else "cap|add"
        return {
            "calls": diff.get(op, [0])[0] / span,
            "requests": sum(row[0] * (2 if name.endswith("|get") else 1) for name, row in diff.items()),
            "bytes": sum(row[1] + row[2] for row in diff.values()),
            "store_cpu": last["store_cpu"] - first["store_cpu"],
            "span": span,
        }

    def phase_capacity(self) -> None:
        if self.args.capacity <= 0:
            return
        small = self._hammer("")
        self.result.update(
            capacity_adds_per_s=small["calls"],
            capacity_store_cpu=small["store_cpu"] / small["span"],
            capacity_us_per_request=1e6 * small["store_cpu"] / max(1, small["requests"]),
        )
        # Reads of a state as large as the target's (made here): the store's
        # cost per byte, its cost per request taken away.
        key = "bench/state-read"
        self.sampler.client.set(key, base64.b64encode(pickle.dumps(_made_state(self.args.target))).decode())
        big = self._hammer(key)
        per_request = small["store_cpu"] / max(1, small["requests"])
        self.result.update(
            capacity_blob_reads_per_s=big["calls"],
            capacity_blob_bytes_per_s=big["bytes"] / big["span"],
            capacity_blob_store_cpu=big["store_cpu"] / big["span"],
            capacity_ns_per_byte=1e9
            * max(0.0, big["store_cpu"] - per_request * big["requests"])
            / max(1, big["bytes"]),
        )

    def phase_window(self) -> None:
        """F: one heartbeat's read-modify-write of this job's state, nobody
        else writing (the workers have exited)."""
        self.result["cas_window_s"] = _read_modify_write(self.sampler.client, self.key)

    def run(self) -> dict[str, Any]:
        self.began = time.monotonic()
        self.start()
        self.sampler = Sampler(self.port, self.key, 0.25)
        try:
            for phase in (
                self.phase_join,
                self.phase_steady,
                self.phase_watch,
                self.phase_cascade,
                self.phase_restart,
                self.phase_capacity,
            ):
                print(
                    f"  {self.n} nodes: {phase.__name__[6:]} ({time.monotonic() - self.began:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
                phase()
        except _Stuck as stuck:
            self.result["stuck"] = str(stuck)
        finally:
            self.send_all("stop")
            self.collector.wait_for(lambda: len(self.collector.of("stopped")) >= self.procs, 30)
            self.sampler.stop.set()
            self.sampler.thread.join(2)
        self.result["errors"] = self.collector.errors[:5]
        return self.result

    def close(self) -> None:
        for worker in self.workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()  # by its own pid, started here
                worker.join(5)
        with contextlib.suppress(Exception):
            self.phase_window()
        self.collector.done.set()
        self.collector.thread.join(2)
        with contextlib.suppress(Exception):
            del self.sampler
        del self.store


# --------------------------------------------------------------------------- report


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{1000 * value:.0f} ms"


def _s(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f} s"


def _bytes(value: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.1f} GB"


def print_size(result: dict[str, Any], args: argparse.Namespace) -> None:
    r: dict[str, Any] = collections.defaultdict(lambda: float("nan"), result)
    r.setdefault("by_op_per_s", {})
    for key in ("watch_max_s", "watch_median_s", "errors", "trajectory", "restart_trajectory"):
        r.setdefault(key, [])
    n = r["nodes"]
    print(
        f"\n== {n} nodes ({r['procs']} processes), keep-alive {args.keep_alive} s x 3, last call "
        f"{max(1, math.ceil(args.last_call))} s, min_nodes {max(1, n - 1)}, watch {args.watch} =="
    )
    rows = [
        ("A. join: all nodes in one round", _s(r["join_s"])),
        ("   N-1 joined (last call began)", _s(r["join_min_reached_s"])),
        ("   extra rounds (a late node waited)", str(r["join_rounds_started"] and r["join_round"])),
        (
            "   compare_set, failed; CPU workers/store",
            f"{r['join_cas']}, {100 * r['join_cas_failed']:.0f} % "
            f"(state's age {_ms(r['join_age_median_s'])}); "
            f"{100 * r['join_workers_cpu']:.0f} % / {100 * r['join_store_cpu']:.0f} % of a core "
            f"(load {r['join_load']:.1f})",
        ),
        ("B. requests/s at the store (get = 2)", f"{r['requests_per_s']:.0f} ({r['calls_per_s']:.0f} calls)"),
        ("   per node", f"{r['requests_per_s'] / n:.2f}"),
        ("   calls/s by kind|op", ", ".join(f"{k} {v:g}" for k, v in r["by_op_per_s"].items())),
        (
            "   rendezvous state payload",
            f"{_bytes(r['state_bytes_per_s'])}/s (all: {_bytes(r['bytes_per_s'])}/s)",
        ),
        ("   state blob (base64 / pickled)", f"{_bytes(r['blob_b64'])} / {_bytes(r['blob_pickled'])}"),
        ("   compare_set/s, failed", f"{r['cas_per_s']:.0f}, {100 * r['cas_failed']:.0f} %"),
        (
            "   age of the state each one replaced",
            f"median {_ms(r['cas_age_median_s'])}, p90 {_ms(r['cas_age_p90_s'])}: "
            f"1-exp(-{r['cas_landed_per_s']:.0f}/s x age) predicts "
            f"{100 * r['cas_failed_predicted']:.0f} % failed",
        ),
        (
            "   heartbeat op median/p99/max",
            f"{_ms(r['heartbeat_median_s'])} / {_ms(r['heartbeat_p99_s'])} / {_ms(r['heartbeat_max_s'])}",
        ),
        (
            "   oldest heartbeat in the state",
            f"{_s(r['oldest_beat_s'])} (dropped at {3 * args.keep_alive} s)",
        ),
        ("   fewest nodes in the state", str(r["fewest_in_state"])),
        ("   heartbeat warnings", str(r["heartbeat_warnings"])),
        (
            "   CPU: store thread / driver / workers",
            f"{100 * r['store_cpu']:.0f} % / {100 * r['driver_cpu']:.0f} % / "
            f"{100 * r['workers_cpu']:.0f} % of a core",
        ),
        ("   monitor tick late median/p99", f"{_ms(r['late_median_s'])} / {_ms(r['late_p99_s'])}"),
        ("   load average (1 min)", f"{r['load']:.1f}"),
        ("C. one post to every watch: max", ", ".join(_ms(v) for v in r["watch_max_s"])),
        ("   median", ", ".join(_ms(v) for v in r["watch_median_s"])),
        (
            "C2. cascade: every node settled",
            f"{_s(r['cascade_s'])} (median {_s(r['cascade_median_s'])}), "
            f"{r['cascade_right']}/{n} named the raised rank",
        ),
        ("   post reads / all calls", f"{r['cascade_post_gets']} / {r['cascade_calls']}"),
        ("D. node lost to a new round of N-1", _s(r["restart_s"])),
        ("   dead node out of the stored state", _s(r["restart_dead_gone_s"])),
        ("   round went up", _s(r["restart_round_up_s"])),
        ("   N-1 joined (last call began)", _s(r["restart_min_reached_s"])),
        ("   round complete", _s(r["restart_complete_s"])),
        (
            "   compare_set, failed; CPU workers/store",
            f"{r['restart_cas']}, {100 * r['restart_cas_failed']:.0f} % "
            f"(state's age {_ms(r['restart_age_median_s'])}); "
            f"{100 * r['restart_workers_cpu']:.0f} % / {100 * r['restart_store_cpu']:.0f} % of a core "
            f"(load {r['restart_load']:.1f})",
        ),
    ]
    if "capacity_adds_per_s" in r:
        rows += [
            ("E. small adds/s, everyone hammering", f"{r['capacity_adds_per_s']:.0f}"),
            (
                "   store thread CPU, per request",
                f"{100 * r['capacity_store_cpu']:.0f} %, {r['capacity_us_per_request']:.1f} us",
            ),
            (
                f"E. reads of a {args.target}-node state, all at once",
                f"{r['capacity_blob_reads_per_s']:.0f}/s, {_bytes(r['capacity_blob_bytes_per_s'])}/s",
            ),
            (
                "   store thread CPU, per byte",
                f"{100 * r['capacity_blob_store_cpu']:.0f} %, {r['capacity_ns_per_byte']:.2f} ns",
            ),
        ]
    rows.append(("F. state read-modify-write alone", f"{1000 * r['cas_window_s']:.2f} ms"))

    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    if "stuck" in result:
        print(f"   STUCK in phase {r['stuck']}: {r.get('join_stuck', '')}")
        for line in r["trajectory"]:
            print(f"     {line}")
    if r["restart_trajectory"]:
        print("   D. the stored state after the node was lost:")
        for line in r["restart_trajectory"]:
            print(f"     {line}")
    for error in r["errors"]:
        print(f"   error: {error}")


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def _exponent(xs: list[float], ys: list[float]) -> float:
    good = [(x, y) for x, y in zip(xs, ys, strict=True) if not math.isnan(y) and y > 0]
    if len(good) < 2:
        return float("nan")
    return _fit([math.log(x) for x, _ in good], [math.log(y) for _, y in good])[1]


def print_growth(every: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    results = [r for r in every if "requests_per_s" in r and "capacity_us_per_request" in r]
    if not results:
        return {}
    ns = [float(r["nodes"]) for r in results]
    target = args.target
    keep = args.keep_alive
    if len(results) > 1:
        print("\n== growth (exponent k of a fit value ~ N^k over the sizes run) ==")
        metrics = [
            ("join_s", "A. join"),
            ("requests_per_s", "B. requests/s"),
            ("state_bytes_per_s", "B. state bytes/s"),
            ("blob_b64", "B. state blob"),
            ("cas_failed", "B. compare_set failed"),
            ("heartbeat_median_s", "B. heartbeat op"),
            ("store_cpu", "B. store CPU"),
            ("cascade_s", "C2. cascade"),
            ("restart_s", "D. restart"),
        ]
        head = "".join(f"{int(n):>11}" for n in ns)
        print(f"{'':<24}{head}{'k':>7}")
        for key, label in metrics:
            values = [float(r.get(key, float("nan"))) for r in results]
            row = "".join(f"{v:>11.4g}" for v in values)
            print(f"{label:<24}{row}{_exponent(ns, values):>7.2f}")
        watch = [max(r["watch_max_s"]) if r["watch_max_s"] else float("nan") for r in results]
        print(f"{'C. watch, worst':<24}{''.join(f'{v:>11.4g}' for v in watch)}{_exponent(ns, watch):>7.2f}")
    big = results[-1]
    n = big["nodes"]
    keep_run = big.get("keep_alive", keep)
    made = big.get("made_windows", {})
    window, blob = made.get(target, (float("nan"), float("nan")))
    span = big["steady_s"]
    per_node = {key: value / n for key, value in big["by_op_per_s"].items()}
    reads = per_node.get(
        "state|get", 0.0
    )  # elastic's state cache: about one read a second, whatever keep-alive
    writes = 1 / keep  # one heartbeat per keep-alive, with no collision at all (a lower bound)
    watch = per_node.get("watch|add", 0.0)
    other = sum(v for k, v in per_node.items() if not k.startswith(("state|", "watch|")))
    requests = target * (2 * reads + writes + watch + other)
    state_bytes = target * blob * (reads + 3 * writes)  # a compare_set sends two blobs, gets one back
    us = big.get("capacity_us_per_request", float("nan"))
    per_byte = big.get("capacity_ns_per_byte", float("nan")) / 1e9
    store_cpu = requests * us / 1e6 + state_bytes * per_byte
    rho_now = n / keep_run * big["made_windows"].get(n, (big["cas_window_s"], 0))[0]
    rho = target / keep * window
    capacity = 1e6 / us if us else float("nan")  # small requests a second, one core of the store's
    poll = _NodeWatch.POLL
    burst = (
        5 * target
    )  # after the post, per node: add, get (2 requests), add("done"), and the poll that saw it
    push = args.watch == "push"
    grown = keep_alive_for(target)
    waits = target / _NodeWatch.WAIT
    # push: each settling node reads the causes (usually one: a count and a
    # get); poll (the watch before): every post so far.
    cascade_reads = target * 2 if push else target * (target - 1) / 2
    last_call = max(1, math.ceil(args.last_call))
    print(
        f"\n== {target:,} nodes, by the model: measured per-node rates of the {n}-node run "
        f"({span:.0f} s steady, keep-alive {keep_run} s), the made {target}-node state (F), the store's "
        f"cost per request and per byte (E); keep-alive {keep} s =="
    )
    lines = [
        ("state blob", f"{_bytes(blob)} base64", f"measured: a made state of {target} nodes (F)"),
        (
            "write window w",
            _ms(window),
            "measured: get, unpickle, one heartbeat, pickle, compare_set of that blob, on loopback (F); "
            "a network adds 3 round trips and 3 blobs' transfer",
        ),
        (
            "heartbeat load rho",
            f"{rho:,.1f}",
            f"N / keep-alive x w (the {n}-node run: {rho_now:.2f}); every write of the one key must fit "
            "in a window no other write lands in: above ~0.5 most collide, above 1 they cannot all land "
            "and nodes are dropped after 3 keep-alives",
        ),
        (
            "keep-alive for rho 0.5",
            f"{2 * target * window:,.0f} s",
            "2 x N x w; a lost node is then seen 3x later",
        ),
        (
            "state traffic",
            f"{_bytes(state_bytes)}/s",
            f"N x blob x ({reads:.2f} reads + 3 x {writes:g} writes) per node-second, no collision counted",
        ),
        (
            "requests",
            f"{requests:,.0f}/s",
            f"N x ({2 * reads:.2f} state + {writes:g} writes + {watch:.2f} watch polls + {other:.2f} other) "
            "per node-second (measured rates)",
        ),
        (
            "store thread CPU",
            f"{100 * store_cpu:,.0f} % of a core",
            f"{us:.1f} us per request + {per_byte * 1e9:.2f} ns per byte (E, this VM)",
        ),
        (
            "watch: while nothing fails",
            f"{waits:,.0f} waits/s = {100 * waits * us / 1e6:.1f} % of a core"
            if push
            else f"{target / poll:,.0f} adds/s = {100 * target / poll * us / 1e6:.0f} % of a core",
            f"push: one wait per node held open, asked again every {_NodeWatch.WAIT:g} s"
            if push
            else "poll: N / 0.2 s, always",
        ),
        (
            "watch: one post to all",
            f"{burst / capacity:.2f} s" if push else f"{poll:.1f} s + {burst / capacity:.2f} s",
            f"{burst:,} requests at {capacity:,.0f}/s"
            + (" (push: each wait answered at once)" if push else ", after the poll interval"),
        ),
        (
            "cascade: post reads",
            f"{cascade_reads:,.0f} gets = {2 * cascade_reads / capacity:,.1f} s of the store",
            "every node that settles reads the causes (usually one), not every post: 2 N"
            if push
            else "every node that settles reads every post so far: N(N-1)/2 gets of 2 requests",
        ),
        (
            "restart after a lost node",
            f">= {3 * keep + last_call + 1 + 3 * target * window:,.0f} s",
            f"3 x keep-alive + last call {last_call} s + 1 s (elastic's SYNC sleep) + 3 N w: each node "
            "leaves, waits, joins: 3 writes of the one key, one at a time at best",
        ),
        (
            "the same, phalanx's keep-alive",
            f">= {3 * grown + last_call + 1 + 3 * target * window:,.0f} s",
            f"keep-alive {grown} s at {target:,} nodes (_rounds.keep_alive_for: 2 N^2 x 1.6 us, rho 0.5)",
        ),
        (
            "connections at node 0",
            f"{3 * target:,}",
            "3 per node (agent, and the watch's two); node 0 raises its RLIMIT_NOFILE for them",
        ),
    ]
    width = max(len(a) for a, _, _ in lines)
    vwidth = max(len(b) for _, b, _ in lines)
    for label, value, model in lines:
        print(f"{label:<{width}}  {value:>{vwidth}}  {model}")
    return {
        "target": target,
        "keep_alive": keep,
        "blob_b64": blob,
        "write_window_s": window,
        "rho": rho,
        "rho_measured_run": rho_now,
        "keep_alive_for_rho_half": 2 * target * window,
        "state_bytes_per_s": state_bytes,
        "requests_per_s": requests,
        "store_cpu": store_cpu,
        "cascade_reads": cascade_reads,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="256", help="comma list of node counts (default 256)")
    parser.add_argument("--procs", type=int, default=8, help="worker processes the nodes are spread over")
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of steady state measured (B)")
    parser.add_argument("--repeats", type=int, default=3, help="failure posts timed (C)")
    parser.add_argument("--capacity", type=float, default=3.0, help="seconds of hammering (E); 0: skip")
    parser.add_argument("--keep-alive", type=int, default=KEEP_ALIVE, help="heartbeat interval, s")
    parser.add_argument("--last-call", type=float, default=3.0, help="the launcher's last_call, s")
    parser.add_argument(
        "--waiting-every",
        type=float,
        default=MONITOR,
        help="seconds between num_nodes_waiting() calls (elastic: monitor_interval)",
    )
    parser.add_argument(
        "--watch",
        choices=("poll", "push"),
        default="push",
        help="push: _NodeWatch as it is (a blocking wait for the next post); poll: the watch it replaced",
    )
    parser.add_argument("--timeout", type=int, default=180, help="rendezvous and phase time limit, s")
    parser.add_argument("--target", type=int, default=TARGET, help="node count to extrapolate to")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON too")
    args = parser.parse_args()
    sizes = [int(item) for item in args.nodes.split(",") if item.strip()]
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # a timed-out wait logs a warning per call
    ctx = mp.get_context("spawn")
    print(
        f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; "
        f"python {sys.version.split()[0]}"
    )
    results = []
    for n in sizes:
        run = Run(n, args, ctx)
        try:
            results.append(run.run())
        finally:
            run.close()
        print_size(results[-1], args)
    print(
        "\n== F. one heartbeat's write of a made state "
        f"(least of 15; load average {os.getloadavg()[0]:.1f}) =="
    )
    windows = made_windows([*sizes, 512, 1024, 2048, args.target, 2 * args.target], args.timeout)
    for size, (window, blob) in windows.items():
        print(f"{size:>6} nodes: {1000 * window:8.2f} ms, blob {_bytes(blob)} base64")
    for result in results:
        result["made_windows"] = windows
    model = print_growth(results, args)
    if args.json:
        print(json.dumps({"sizes": results, "model": model}, indent=1, default=str))


if __name__ == "__main__":
    main()
