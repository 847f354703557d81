"""What the parts of one node's launch tell each other: one object, made
by the ``subprocess`` launcher for each launch and handed to each part
(the rendezvous handler through its configuration, the rank loop, the node
watch), in place of module-level events and lists that every launch in
the process shared. Imports no torch."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .job_secret import JobSecret

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

    from .job_store import JobStore

__all__ = ["JobLedger", "JobRounds", "RanksStopper", "StopRequested"]


class JobRounds(Protocol):
    """What the rank loop asks of the rounds of a job that meets in rounds
    (``rounds.RoundRendezvous``, the handler that says so in the ledger)."""

    #: The round this node met last (-1: none yet).
    round: int

    def restarts(self) -> int:
        """The job's restarts so far."""

    def count_failure(self) -> int:
        """Count this round's failure for the job (once, whichever node
        sees it first); the job's restarts with it."""

    def failed(self) -> bool:
        """Whether a node counted this round's failure."""

    def nodes_waiting_now(self) -> int:
        """The nodes waiting for the next round, proven (read now)."""


class RanksStopper(Protocol):
    """What the heartbeat asks of a node's rank loop when the job's store
    goes silent (``_launch.rank_loop.RankLoop``)."""

    def kill_ranks(self) -> None:
        """Kill this node's ranks at once (from any thread)."""


class StopRequested(Exception):
    """The node watch asked this node to stop its ranks (another node
    posted a failure): raised in the launch's main thread, by the rank loop
    or the rounds' wait, once it has stopped what it started."""


class JobLedger:
    """One launch's shared facts on this node.

    - whether this node has met the others (the rendezvous says so; the
      node watch connects to the job's store from then on);
    - the rounds it met, as ``(node rank, number of nodes)`` (the rank loop
      says each; the launcher reads the last for the ranks' results);
    - the rounds' handler, where the job meets in rounds (it says so as
      it is made; the rank loop asks it for the job's restart count and for
      the nodes waiting to join);
    - the stores the launch must keep until its watch has left them (a
      static rendezvous hosts node 0's store, and elastic drops its
      handler, and the store with it, as its launch returns);
    - where lines about the job go (``say``);
    - whether the node watch asked this node to stop its ranks (an Event
      the rank loop waits on between its looks at the ranks, and the
      rounds' wait between its looks at the store)."""

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self.say = say
        #: The rounds' handler (``rounds.RoundRendezvous``), or ``None``.
        self.rounds: JobRounds | None = None
        self._met = threading.Event()
        self._rounds: list[tuple[int, int]] = []
        self._kept: list[Any] = []
        #: What this node's writes to the job's store prove, and what it
        #: checks of the others' (the job's secret, from the environment).
        self.secret = JobSecret.from_environment()
        #: The launch's view of the job's store (``job_store.JobStore``), on
        #: several nodes: a rendezvous that makes its own connection hands
        #: it over (:meth:`JobStore.adopt`).
        self.job_store: JobStore | None = None
        #: Set by the node watch: stop this node's ranks (:class:`StopRequested`).
        self.stop_requested = threading.Event()

    # -- meeting ------------------------------------------------------------------

    def met(self) -> None:
        """This node has met the others (the job's store is up)."""
        self._met.set()

    def wait_met(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for :meth:`met`; whether it was."""
        return self._met.wait(timeout)

    # -- rounds -------------------------------------------------------------------

    def round_met(self, node_rank: int, num_nodes: int) -> None:
        """This node met a round as node ``node_rank`` of ``num_nodes``."""
        self._rounds.append((node_rank, num_nodes))

    @property
    def last_round(self) -> tuple[int, int] | None:
        """``(node rank, number of nodes)`` of the last round met, if any."""
        return self._rounds[-1] if self._rounds else None

    def request_stop(self) -> None:
        """Have the launch's main thread stop this node's ranks and raise
        :class:`StopRequested` (from any thread)."""
        self.stop_requested.set()

    # -- stores -------------------------------------------------------------------

    def keep(self, store: Store) -> None:
        """Hold ``store`` until the launch ends (:meth:`__exit__`)."""
        self._kept.append(store)

    def __enter__(self) -> JobLedger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._kept.clear()  # the launch is over: its stores close as they go
