"""How a ``replica_groups`` job ends: what this host's launcher knows of
the other groups' end.

The job is *finished* once any of its groups has ended with status 0: the
groups train in lockstep, so that group holds the job's result, and the
others end within a step of it. From then on a group that fails is not
started again: alone, it would find no peer to heal from and train from its
own step to the end by itself.

On several hosts, node 0's launching process also hosts the lighthouse and
must not take it away while another host's groups still train (they would
end with ``NoQuorumError``, and fail past their restarts, in the job's last
steps). So node 0 hosts a small store beside the lighthouse, at the main
address and the main port + 1, in which

* every launcher writes ``finished`` when one of its groups ended with 0,
  and reads it before it starts a failed group again;
* every other host's launcher counts a heartbeat each second while it runs
  and writes ``ended`` once its groups have ended;
* node 0, its own groups ended, keeps the lighthouse until every other host
  has ended or has not counted a heartbeat for :data:`LOST_AFTER` seconds.

A group started again just before the job finished may come up after it,
with no peer to heal from. Each host's launcher writes a file once it knows
the job finished (its path in the groups' ``PHALANX_JOB_FINISHED``); a rank
that gets a quorum while that file exists stops with
:class:`~phalanx_torchft.JobFinishedError` instead of training alone from
its own step, and its group is not started again.

If node 0's host is lost, so are the lighthouse and this store: the other
hosts go on as the lighthouse's loss makes them (``NoQuorumError`` in each
group, then their restarts run out).

Where a group spans several hosts, its parts meet in a store of the group's
own, which the group's first host (its part 0) starts anew at each start of
the group, on a port the kernel gives. This store tells the other parts
where: part 0 offers each start's address under the start's number
(:meth:`JobEnd.offer_group_store`); another part claims the newest start
that has no such part yet (:meth:`JobEnd.take_group_store`: so it never
meets an old start of the group that is stopping, its own or a lost host's
that it replaces); part 0 says when the group is gone for good
(:meth:`JobEnd.group_gone`). A part whose start part 0 no longer runs (it
offered a newer one, or the group is gone) stops it
(:meth:`JobEnd.newest_offer`): part 0's host may be lost after it offered a
start, and a part that took that start would wait for its store until
``rendezvous_timeout``.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from phalanx_core import MisconfigurationError
from phalanx_torch.nodes import Signed

__all__ = ["JobEnd"]

#: Seconds without a heartbeat after which node 0 stops waiting for a host.
LOST_AFTER = 10.0
#: Seconds between a host's heartbeats.
BEAT = 1.0
#: Seconds one store operation may take before it counts as failed.
PATIENCE = 2.0
_PREFIX = "phalanx/replica_groups/"
_FINISHED = _PREFIX + "finished"
_COMMITTED = _PREFIX + "committed"
_FAILED_ALIKE = _PREFIX + "failed_alike"


class JobEnd:
    """This host's view of whether the job has finished (see the module's
    docstring). ``address``/``port``: node 0's store, as the other hosts
    reach it (node 0 listens on ``listen``); unused on one host and where
    ``address`` is ``None`` (a lighthouse run elsewhere: it outlives the
    hosts, and only this host's own groups are known)."""

    def __init__(
        self,
        node_rank: int,
        num_nodes: int,
        address: str | None,
        port: int,
        listen: str,
        marker: Path,
        store: Any = None,
    ) -> None:
        #: The file that exists once this host knows the job has finished.
        self.marker = marker
        self.node_rank = node_rank
        self.num_nodes = num_nodes
        self.address = address
        self.port = port
        self.listen = listen
        #: A group that ended with status 0, where this host knows of one.
        self.finished_by: int | None = None
        #: The file a rank here creates at its first committed step.
        self.committed_file = marker.with_name("committed")
        self._committed = False
        #: The groups' failures before the job's first committed step (their
        #: root causes' tracebacks), as this host knows them.
        self._early: dict[int, str] = {}
        self._next_read = 0.0
        self._beats = 0
        #: The failure every group had before the job's first committed
        #: step, once a host found it so: the job ends.
        self.failed_alike: str | None = None
        #: Whether the shared store was reached and then failed a request
        #: (node 0 lost): what the other hosts say is unknown until it answers.
        self.lost = False
        self._store: Any = None
        #: Where the store is another than node 0's (the rendezvous' etcd):
        #: what makes a client of it.
        self._make_store = store
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._beating: threading.Thread | None = None

    @property
    def shared(self) -> bool:
        return self.num_nodes > 1 and self.address is not None

    def start(self) -> None:
        """Node 0: host the store (a clear error where its port is taken).
        Other nodes: connect to it and beat, in a thread of their own."""
        if not self.shared:
            return
        if self._make_store is not None:
            self._store = _Signed(self._make_store())
        elif self.node_rank == 0:
            from phalanx_core.launching import hosted_store  # imports torch

            try:
                self._store = _Signed(
                    hosted_store(
                        self.listen, self.port, wait_for_workers=False, timeout=timedelta(seconds=PATIENCE)
                    )
                )
            except (OSError, RuntimeError) as exc:
                raise MisconfigurationError(
                    f"launcher 'replica_groups': node 0 cannot listen on {self.listen}:{self.port}, "
                    f"the port after the main port, where the hosts tell each other that the job has "
                    f"ended ({exc}); give a --main-port whose next port is free too"
                ) from None
        self._beating = threading.Thread(target=self._beat, name="phalanx-job-end", daemon=True)
        self._beating.start()

    def group_ended(self, index: int) -> None:
        """Group ``index`` (of this host) ended with status 0."""
        self._learned(index)
        self._call(lambda store: store.set(_FINISHED, str(index)))

    def finished(self) -> int | None:
        """A group that ended with status 0, here or on another host (asked
        of node 0's store now); ``None`` while none has, or where no host
        can be asked."""
        if self.finished_by is None:
            self._ask()
        return self.finished_by

    def _ask(self) -> None:
        found = self._call(lambda store: store.read(_FINISHED))
        if found is not None:
            self._learned(int(found))

    def _learned(self, index: int) -> None:
        if self.finished_by is not None:
            return
        self.finished_by = index
        written = self.marker.with_name(self.marker.name + ".tmp")
        written.write_text(f"{index}\n")
        written.rename(self.marker)

    # -- a job that fails before its first step -----------------------------

    def has_committed(self) -> bool:
        """Whether the job has committed a step: a rank here said so (its
        file), or another host did (read at each beat)."""
        if not self._committed and self.committed_file.exists():
            self._committed = True
            self._call(lambda store: store.set(_COMMITTED, "1"))
        return self._committed

    def failed_early(self, group: int, failure: str) -> None:
        """Group ``group`` failed before the job committed a step, its
        first failed rank with the traceback ``failure``."""
        self._early[group] = failure
        self._call(lambda store: store.set(f"{_PREFIX}early/{group}", failure))

    def forget_early(self, group: int) -> None:
        """Group ``group`` starts again: its failure no longer counts."""
        self._early.pop(group, None)
        self._call(lambda store: store.set(f"{_PREFIX}early/{group}", ""))  # empty: none

    def early_failures(self, groups: int) -> dict[int, str]:
        """The failures of the job's ``groups`` groups before its first
        committed step, as far as known: this host's, and (read at most
        once a second) those the other hosts wrote to node 0's store."""
        if self.shared and time.monotonic() >= self._next_read:
            self._next_read = time.monotonic() + BEAT

            def read(store: Any) -> dict[int, str]:
                keys = {f"{_PREFIX}early/{g}": g for g in range(groups) if g not in self._early}
                return {keys[key]: text for key in keys if (text := store.read(key))}

            self._early.update({g: text for g, text in (self._call(read) or {}).items() if text})
        return dict(self._early)

    def fail_alike(self, failure: str) -> None:
        """Every group failed with ``failure`` before the job committed a
        step: tell the other hosts (they stop their groups)."""
        self.failed_alike = failure
        self._call(lambda store: store.set(_FAILED_ALIKE, failure))

    def host_ended(self) -> None:
        """Every group of this host has ended: say so to node 0 and stop
        beating."""
        self._stopping.set()
        if self._beating is not None:
            self._beating.join(timeout=PATIENCE + BEAT)
        if self.node_rank != 0:
            self._call(lambda store: store.set(f"{_PREFIX}ended/{self.node_rank}", "1"))

    def wait_for_other_hosts(self, say: Any, stopped: list[int]) -> None:
        """Node 0, its groups ended: return when every other host has ended
        or is lost (no heartbeat for :data:`LOST_AFTER` s), or once
        ``stopped`` (the signals this process was sent) is not empty."""
        if not self.shared or self.node_rank != 0:
            return
        waiting = set(range(1, self.num_nodes))
        beats = dict.fromkeys(waiting, -1)
        changed = dict.fromkeys(waiting, time.monotonic())
        said = False
        while waiting and not stopped:
            for node in sorted(waiting):
                if self._store.read(f"{_PREFIX}ended/{node}") is not None:
                    waiting.discard(node)
                    continue
                beat = self._store.read(f"{_PREFIX}beat/{node}")
                if beat != beats[node]:
                    beats[node], changed[node] = beat, time.monotonic()
                elif time.monotonic() - changed[node] > LOST_AFTER:
                    say(f"phalanx run: node {node} silent for {LOST_AFTER:g} s; not waiting for it")
                    waiting.discard(node)
            if waiting and not said:
                say(
                    "phalanx run: this host's groups have ended; the lighthouse stays until the groups of "
                    f"node(s) {', '.join(map(str, sorted(waiting)))} have ended"
                )
                said = True
            if waiting:
                time.sleep(0.2)

    def offer_group_store(self, group: int, address: str, port: int) -> int | None:
        """Part 0 of ``group``: the group's next start has its store at
        ``address:port``; return the start's number, or ``None`` where
        node 0's store cannot be reached."""

        def offer(store: Any) -> int:
            number = int(store.add(f"{_PREFIX}group/{group}/starts", 1))
            store.set(f"{_PREFIX}group/{group}/store/{number}", f"{address} {port}")
            store.set(f"{_PREFIX}group/{group}/offered", str(number))
            return number

        return self._call_when_connected(offer)

    def take_group_store(
        self, group: int, part: int, timeout: float, stopped: list[int]
    ) -> tuple[int, str, int] | str:
        """Another part of ``group``: the newest start of the group that
        had no such part yet (its number, address and port), once part 0
        has offered one; else why there is none (the group is gone, the job
        has finished, node 0's store lost, ``timeout`` passed, or this
        process was ``stopped``). A start is taken once by each part: a
        part started again, or on a host that replaces a lost one, waits
        for the group's next start (the one it had, or the lost host had,
        is stopping)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stopped:
            if self.finished() is not None:
                return f"group {self.finished_by} had ended the job"
            found = self._call(lambda store: _newest_start(store, f"{_PREFIX}group/{group}/", part))
            if found is not None:
                return found
            time.sleep(0.2)
        if stopped:
            return "this process was stopped"
        lost = "" if self._connect() else f"; node 0's store at {self.address}:{self.port} is lost"
        return (
            "its first host (the part that starts the group's store) offered no new start within "
            f"{timeout:g} s{lost}"
        )

    def newest_offer(self, group: int) -> int | str | None:
        """The number of ``group``'s newest start that part 0 offered, or
        why the group is gone; ``None`` where neither is known."""

        def read(store: Any) -> int | str | None:
            prefix = f"{_PREFIX}group/{group}/"
            gone = store.read(prefix + "gone")
            if gone is not None:
                return gone
            offered = store.read(prefix + "offered")
            return int(offered) if offered is not None else None

        return self._call(read)  # type: ignore[no-any-return]

    def joined(self, group: int, number: int, parts: int) -> bool:
        """Whether every other part of ``group`` took its start ``number``."""
        keys = [f"{_PREFIX}group/{group}/joined/{number}/{part}" for part in range(1, parts)]
        found = self._call(lambda store: store.check(keys))
        return found is None or bool(found)  # not known (node 0's store lost): not to be stopped for it

    def group_gone(self, group: int, why: str) -> None:
        """Part 0 of ``group``: the group is not started again (``why``)."""
        self._call(lambda store: store.set(f"{_PREFIX}group/{group}/gone", why))

    def _call_when_connected(self, operation: Any, timeout: float = 60.0) -> Any:
        """``_call`` once connected to node 0's store (which may not be up
        yet at a job's start), trying for ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self._connect() and time.monotonic() < deadline:
            time.sleep(0.2)
        return self._call(operation)

    def close(self) -> None:
        self._stopping.set()
        with self._lock:
            self._store = None
        for path in (self.marker, self.marker.with_name(self.marker.name + ".tmp")):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def _beat(self) -> None:
        """Count this host's heartbeats (not node 0's: it waits for the
        others) and learn of the job's end, each :data:`BEAT` s."""
        key = f"{_PREFIX}beat/{self.node_rank}"
        while not self._stopping.is_set():
            if self._connect():
                if self.node_rank != 0:
                    self._beats += 1
                    self._call(lambda store: store.set(key, str(self._beats)))
                if self.finished_by is None:
                    self._ask()
                if not self._committed or self.failed_alike is None:
                    self.has_committed()  # this host's groups' first commit, told to the others
                    self._ask_early()
            self._stopping.wait(BEAT)

    def _ask_early(self) -> None:
        """Whether another host saw the job commit a step, or every group
        fail alike before it did."""

        def read(store: Any) -> tuple[bool, str | None]:
            return store.read(_COMMITTED) is not None, store.read(_FAILED_ALIKE)

        found = self._call(read)
        if found is not None:
            committed, alike = found
            self._committed = self._committed or committed
            if alike is not None and self.failed_alike is None:
                self.failed_alike = alike

    def _connect(self) -> bool:
        with self._lock:
            if self._store is not None:
                return True
            if self._make_store is not None:  # in etcd: a client again (it connects per request)
                self._store = _Signed(self._make_store())
                self.lost = False
                return True
            if self.node_rank == 0:
                return False  # its own store, gone with close()
        import torch.distributed as dist

        try:  # a plain connection first: torch's client logs every refused try
            socket.create_connection((self.address, self.port), timeout=PATIENCE).close()
        except OSError:
            return False
        try:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                self.address, self.port, is_master=False, timeout=timedelta(seconds=PATIENCE)
            )
        except (OSError, RuntimeError):
            return False  # node 0 not up yet, or lost: try again at the next beat
        with self._lock:
            self._store = _Signed(store)
        return True

    def _call(self, operation: Any) -> Any:
        """``operation(store)``, or ``None`` where there is no store or it
        failed (node 0 lost, or not reached yet). A client whose request
        failed is dropped, and connected again at the next beat after a
        plain connection succeeds: torch's client logs a C++ stack (about 25
        lines) at each request on a connection that broke, and the hosts
        ask once a second while node 0 is lost."""
        with self._lock:
            store = self._store
        if store is None:
            return None
        if self.node_rank != 0 and self._make_store is None and not self._answers():
            with self._lock:  # node 0 lost: no request on the broken connection (torch logs its C++ stack)
                if self._store is store:
                    self._store, self.lost = None, True
            return None
        try:
            return operation(store)
        except (OSError, RuntimeError):
            with self._lock:
                if self._store is store and not (self.node_rank == 0 and self._make_store is None):
                    self._store = None
                    self.lost = True
            return None

    def _answers(self) -> bool:
        """Whether node 0's store takes a connection now (a plain one)."""
        try:
            socket.create_connection((self.address, self.port), timeout=PATIENCE / 4).close()
        except OSError:
            return False
        return True


class _Signed:
    """The job's end store, each value written with the proof of the job's
    secret (``PHALANX_JOB_SECRET``: an HMAC of the key and the value, as the
    elastic rounds sign theirs); a value read without a good proof is taken
    as absent, and said once for each key (a process not of this job
    reaches the store). Counters (``add``: the numbers of a group's starts,
    the parts that took one) are not signed: a stranger can only skip a
    number or take a start away, never end the job or place a part."""

    def __init__(self, store: Any) -> None:
        from phalanx_torch.nodes import JobSecret

        self._store = store
        self._secret = JobSecret.from_environment()
        self._said: set[str] = set()

    def set(self, key: str, value: str) -> None:
        self._store.set(key, f"{self._secret.sign(Signed.END, key, value)} {value}")

    def read(self, key: str) -> str | None:
        """The value at ``key``, where one with a good proof is there."""
        if not self._store.check([key]):
            return None
        proof, _, value = bytes(self._store.get(key)).decode(errors="replace").partition(" ")
        if self._secret.proves(proof, Signed.END, key, value):
            return value
        if key not in self._said:
            self._said.add(key)
            sys.stderr.write(
                f"phalanx run: the job's end store holds {key!r} written without the proof of the job's "
                "secret (PHALANX_JOB_SECRET): ignored. A process that is not of this job reaches the "
                "store, or a host of the job has another secret\n"
            )
            sys.stderr.flush()
        return None

    def check(self, keys: list[str]) -> bool:
        return bool(self._store.check(keys))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))


def _newest_start(store: Any, prefix: str, part: int) -> tuple[int, str, int] | str | None:
    """In node 0's store, under a group's ``prefix``: why the group is gone,
    else its newest start, claimed for ``part`` (number, address, port),
    else ``None`` (no start yet, or the newest one already had this part:
    this part's earlier run, or the run of a host this one replaces)."""
    gone = store.read(prefix + "gone")
    if gone is not None:
        return gone
    offered = store.read(prefix + "offered")
    if offered is None:
        return None
    number = int(offered)
    if store.add(f"{prefix}joined/{number}/{part}", 1) != 1:
        return None
    where = store.read(f"{prefix}store/{number}")
    if where is None:
        return None
    address, port = where.rsplit(" ", 1)
    return number, address, int(port)
