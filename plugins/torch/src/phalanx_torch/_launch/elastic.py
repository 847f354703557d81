"""The ``subprocess`` launcher: the script re-run under torch.distributed.elastic.

Imports no torch at import time; see :mod:`phalanx_torch.launchers`."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import pickle
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from phalanx_core import Launcher, MisconfigurationError, NodeLostError, WorkerFailedError
from phalanx_core.network import is_loopback

if TYPE_CHECKING:
    from phalanx_core import ClusterEnvironment

from phalanx_core.launching import (
    LINES_PREFIXED_VAR,
    LOOPBACK,
    RankFailure,
    check_count,
    listen_variables,
    root_cause,
    warn_died_after_delivery,
    worker_failed,
)

from .._nodes.elastic_rendezvous import (
    ONE_NODE,
    STATIC,
    create_one_node_rendezvous,
    create_static_rendezvous,
)
from .._nodes.heartbeat import LOST_AFTER, Heartbeat, interval_for
from .._nodes.job_store import CONNECTIONS, JobStore, allow_connections
from .._nodes.ledger import JobLedger, StopRequested
from .._nodes.node_watch import NodeWatch
from .._nodes.rendezvous_place import RendezvousPlace, parse_rendezvous
from .._nodes.rounds import ELASTIC as ROUNDS
from .._nodes.rounds import create as create_rounds
from ..environments import node_rank_needed
from .failures import (
    failures_of,
    print_elsewhere,
    print_if_shortened,
    raised_before,
    say,
    signal_handlers_kept,
    stopped_words,
    store_lost_errors,
)
from .listen import listen_address, one_thread
from .rank_loop import RankLoop, signals_variable
from .ranks import (
    _LAUNCH_INDEX_VAR,
    _LAUNCHER_PID_VAR,
    _LAUNCHES,
    MIN_NODES_VAR,
    RESULTS_DIR_VAR,
    T,
    _run_here,
)
from .scheduler_vars import _int_var

__all__ = ["SubprocessLauncher"]


class SubprocessLauncher(Launcher):
    """Re-runs this process's script once per local rank under
    ``torch.distributed.elastic``'s process layer, rendezvous interface and error files,
    like ``torchrun``, and waits for the ranks.

    The command is ``sys.executable`` with this interpreter's options (from
    ``sys.orig_argv``), then the script (``__main__.__file__``) or ``-m
    module`` (``__main__.__spec__``), then ``sys.argv[1:]``. In each rank the
    script runs again from the top: there torch elastic's variables are set,
    the registry chooses the ``in_process`` launcher, and ``launch`` runs
    ``fn`` in the rank (this class does the same if it is used there). So
    the code of the script around ``launch`` runs in every rank too: call
    ``launch`` once per script.

    Return values cross by pickling (they must be picklable): each rank
    leaves its value in a temporary folder (``PHALANX_LAUNCH_RESULTS_DIR``), and
    ``launch`` returns a list of ``world_size`` values indexed by global
    rank. On several nodes each node's launching process has only its own
    node's values: the entries of the other nodes' ranks are ``None``.

    Options:
        node_rank: this node's rank; default the environment's
            ``node_rank`` (``NODE_RANK``). Several nodes that meet once
            need it; nodes that meet in rounds (``max_restarts``,
            ``min_nodes`` or etcd) need none: the rendezvous numbers them,
            and with ``c10d`` the node on the host whose address is the
            main address hosts the store (as torchrun decides it); given,
            it is the rank a node asks for in its first round, and node 0
            hosts the store.
        max_restarts: how many times the job's ranks are stopped and
            started again after a failure before ``launch`` raises
            (default 0); on several nodes every node stops its ranks and
            the nodes meet in a new round, and the count is the job's.
        min_nodes: on several nodes, the fewest nodes a round may have
            (default ``num_nodes``, which is then the most): a job of
            ``min_nodes .. num_nodes`` nodes (``phalanx run --num-nodes
            MIN:MAX``) goes on without a lost node after a restart, and
            takes in a node that joins at the next round.
        rendezvous: where the nodes meet on several nodes: ``"c10d"``
            (default; a store that node 0's launching process hosts at the
            main address and port) or ``"etcd://HOST:PORT,HOST:PORT/NAME"``
            (an etcd cluster, 3.4 or later, spoken to on its v3 API: no
            node is then a single point of failure; ``etcd+https://``
            over TLS, with ``?cacert=...&cert=...&key=...&user=...``).
        last_call: seconds a round that has ``min_nodes`` waits for more
            nodes before it starts (default 3; only where ``min_nodes`` is
            below ``num_nodes``).
        monitor_interval: seconds between elastic's checks of the ranks.
        rendezvous_timeout: seconds to wait for every node to join.
        listen_on: one node only: the address of this host its store and
            its ranks' gloo listen on (default ``127.0.0.1``: nothing of
            the job is reachable from another host). Another address of
            this host makes them reachable over its interface, which a
            job whose ranks other hosts must reach needs: each replica
            group of ``ddp_ft`` on several hosts (phalanx-torchft), whose
            groups meet in one group's store.
        host_lost_after: on several nodes, seconds without a beat of a
            node's launching process in the job's store after which its
            host is taken for lost (default 15, at least 5: five beats,
            one a second up to 1,000 nodes, more beyond): a host cut off
            the network or without power, which closes no connection, is
            seen no sooner. Shorter notices it sooner; too short takes a
            host whose launching process cannot run for that long (a
            machine swapping) for lost.

    One node (like ``torchrun --standalone``): a rendezvous of
    :mod:`.._nodes.elastic_rendezvous` that gives every round, the first and each
    restart, a new TCPStore listening on ``127.0.0.1`` (or ``listen_on``)
    only, on a port the kernel gives; the launching process keeps it and the ranks join
    it as clients, and their gloo listens there too. Several nodes: start the same
    script on every node with its ``NODE_RANK``. Without restarts, MIN:MAX
    or etcd, the nodes meet once at the environment's ``main_address`` /
    ``main_port`` (``MASTER_ADDR`` / ``MASTER_PORT``), on a store node 0
    hosts, listening (as the ranks' gloo) on the address this node reaches
    the main address from (see :mod:`.listen`); with any of them they meet
    in rounds (:mod:`.._nodes.rounds`). Either way a failure on one node stops the
    ranks of every node within seconds (:mod:`.._nodes.node_watch`), and every node
    names the same rank as the one that failed first.
    """

    is_interactive_compatible: ClassVar[bool] = False
    #: Whether several nodes that meet in rounds may come without a node
    #: rank (the rendezvous numbers them); a subclass that places work by
    #: node rank says False.
    node_ranks_from_rounds: ClassVar[bool] = True

    def __init__(
        self,
        *,
        environment: ClusterEnvironment | None = None,
        num_processes: int = 1,
        num_nodes: int = 1,
        node_rank: int | None = None,
        max_restarts: int = 0,
        min_nodes: int | None = None,
        rendezvous: str | None = None,
        last_call: float = 3.0,
        monitor_interval: float = 0.1,
        rendezvous_timeout: float = 900.0,
        listen_on: str = LOOPBACK,
        host_lost_after: float = LOST_AFTER,
    ) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        check_count("subprocess", "num_processes", num_processes)
        _check_listen_on(listen_on, num_nodes)
        self.listen_on = listen_on
        check_count("subprocess", "num_nodes", num_nodes)
        if node_rank is None:
            node_rank = _given_node_rank(environment)
        if node_rank is not None and (
            not isinstance(node_rank, int) or isinstance(node_rank, bool) or not 0 <= node_rank < num_nodes
        ):
            raise MisconfigurationError(
                f"launcher 'subprocess': node_rank={node_rank!r} is not a node of num_nodes={num_nodes} "
                f"(0 .. {num_nodes - 1}); set NODE_RANK on each node, or pass node_rank="
            )
        if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
            raise MisconfigurationError(
                f"launcher 'subprocess': max_restarts={max_restarts!r}; expected an int of at least 0"
            )
        if min_nodes is None:
            min_nodes = num_nodes
        if not isinstance(min_nodes, int) or isinstance(min_nodes, bool) or not 1 <= min_nodes <= num_nodes:
            raise MisconfigurationError(
                f"launcher 'subprocess': min_nodes={min_nodes!r}; expected an int from 1 to "
                f"num_nodes={num_nodes} (the most nodes), as in --num-nodes "
                f"{max(1, num_nodes - 1)}:{num_nodes}"
            )
        if rendezvous is not None and not isinstance(rendezvous, str):
            raise MisconfigurationError(
                f"launcher 'subprocess': rendezvous={rendezvous!r}; give 'c10d' or 'etcd://HOST:PORT,.../NAME'"
            )
        for name, value in (
            ("last_call", last_call),
            ("monitor_interval", monitor_interval),
            ("rendezvous_timeout", rendezvous_timeout),
            ("host_lost_after", host_lost_after),
        ):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise MisconfigurationError(
                    f"launcher 'subprocess': {name}={value!r}; expected a number of seconds above 0"
                )
        self.max_restarts = max_restarts
        self.min_nodes = min_nodes
        self.rendezvous = rendezvous
        #: The rendezvous parsed, and from what (see :meth:`_place`).
        self._parsed: tuple[tuple[Any, ...], RendezvousPlace] | None = None
        self.last_call = float(last_call)
        if num_nodes == 1 and rendezvous not in (None, "c10d"):
            raise MisconfigurationError(
                f"launcher 'subprocess': rendezvous={rendezvous!r} with num_nodes=1: one node meets "
                "no other (its store is on 127.0.0.1); give num_nodes, or leave rendezvous out"
            )
        if rendezvous is not None:
            self._place()  # checks the address now
        if node_rank is None and num_nodes == 1:
            node_rank = 0
        self.node_rank = node_rank
        #: Without a node rank, whether this host is the main address's
        #: (its launching process then hosts node 0's store).
        self._main_here = False
        if node_rank is None:
            if not (self.node_ranks_from_rounds and self.elastic):
                raise MisconfigurationError(node_rank_needed(num_nodes))
            if self._place().kind == "c10d":
                self._main_here = _is_this_host(*self._main())
        self.monitor_interval = float(monitor_interval)
        self.rendezvous_timeout = float(rendezvous_timeout)
        if host_lost_after < 5:
            raise MisconfigurationError(
                f"launcher 'subprocess': host_lost_after={host_lost_after!r}; a host is taken for lost "
                "after 5 missed beats of its launching process at the least (one a second): give 5 or more"
            )
        self.host_lost_after = float(host_lost_after)
        #: The launch under way's (or the last one's) shared facts.
        self._ledger = JobLedger()

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        if num_nodes == 1:
            return "127.0.0.1 only: the launching process's rendezvous store and every rank's gloo"
        return (
            "node 0's rendezvous store (MASTER_PORT) and every rank's gloo on the address that reaches "
            "MASTER_ADDR (the route's source address); on every interface where that is a loopback address"
        )

    def listening(self) -> str | None:
        if self.num_nodes > 1 and self._place().kind == "etcd":
            return (
                "no store of the job's (its keys are in etcd); each round's node 0 hosts its ranks' "
                "store on a port the kernel gives, and every rank's gloo, on the address that reaches "
                "the first etcd member (the route's source address)"
            )
        return type(self).listens(self.num_nodes)

    def explain(self) -> dict[str, str]:
        if self.num_nodes == 1:
            return {}
        place = self._place()
        if not self.elastic:
            return {"rendezvous": f"once, at {place.describe()}: node {self.node_rank} of {self.num_nodes}"}
        nodes = (
            f"{self.num_nodes} nodes"
            if self.min_nodes == self.num_nodes
            else f"{self.min_nodes} to {self.num_nodes} nodes (a round closes when {self.num_nodes} have "
            f"joined, or {self.last_call:g} s after {self.min_nodes} have)"
        )
        if place.kind == "etcd":
            host = "none: the keys are in etcd, and the job goes on where any node is lost"
        elif self.node_rank is not None:
            host = f"node rank 0{' (this node)' if self.node_rank == 0 else ''}"
        else:
            host = f"the main address's host{' (this one)' if self._main_here else ' (not this one)'}"
        rank = "" if self.node_rank is None else f"; this node would like rank {self.node_rank}"
        return {
            "rendezvous": f"in rounds, at {place.describe()}: {nodes}; the store's host: {host}{rank}",
            "restarts": f"up to {self.max_restarts} for the job (a round whose ranks failed counts once; a "
            "node joining is no restart); a node silent for "
            f"{self.host_lost_after:g} s is taken for lost",
        }

    @classmethod
    def runs_in_existing_processes(cls, environment: type[ClusterEnvironment]) -> bool:
        """Yes inside a torch elastic rank (``TORCHELASTIC_RUN_ID`` set: this
        launcher's own re-run of the script, or torchrun's), where
        ``launch()`` runs ``fn`` in place; no under any other scheduler."""
        return bool(os.environ.get("TORCHELASTIC_RUN_ID"))

    @classmethod
    def started_this_process(cls) -> bool:
        """In a rank this launcher's re-run of the script made (torch
        elastic's variables and this launcher's own)."""
        return bool(os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get(_LAUNCHER_PID_VAR))

    def runs_in_place(self) -> bool:
        """In a torch elastic rank (this launcher's re-run, or torchrun's)."""
        return bool(os.environ.get("TORCHELASTIC_RUN_ID"))

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        index = next(_LAUNCHES)
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            # This is a rank already (the script re-run, or torchrun): run here.
            return self.placed(_run_here(index, fn, args, kwargs))  # type: ignore[return-value]
        command = _script_command()
        with tempfile.TemporaryDirectory(prefix="phalanx-launch-") as tmp:
            results = Path(tmp, "results")
            results.mkdir()
            variables = {
                RESULTS_DIR_VAR: str(results),
                _LAUNCH_INDEX_VAR: str(index),
                _LAUNCHER_PID_VAR: str(os.getpid()),
            }
            try:
                self._run_elastic(command, variables, Path(tmp, "logs"))
            except WorkerFailedError as exc:
                if exc.signal is None or not self._all_delivered(results):
                    raise
                # Killed while exiting, after every rank had handed back its result.
                warn_died_after_delivery("subprocess", RankFailure(exc.rank, exc.exitcode), self.world_size)
            return self._results(results, index)

    def _this_node(self) -> tuple[range, int]:
        """This node's global ranks and the world, in the last round of a
        job in rounds (given by the rendezvous), else as configured."""
        last = self._ledger.last_round
        if self.elastic and last is not None:
            group_rank, group_world_size = last
            first = group_rank * self.num_processes
            return range(first, first + self.num_processes), group_world_size * self.num_processes
        first = (self.node_rank or 0) * self.num_processes  # None: no round met, no rank ran
        return range(first, first + self.num_processes), self.world_size

    def _all_delivered(self, folder: Path) -> bool:
        ranks, _ = self._this_node()
        return all((folder / f"{rank}.pkl").exists() for rank in ranks)

    def run_script(
        self, command: Sequence[str], *, variables: Mapping[str, str] | None = None, restarts_before: int = 0
    ) -> None:
        """Run ``python *command`` as every rank's program under torch
        elastic, each output line prefixed with the rank (``[rank1]: ...``),
        as ``phalanx run`` does; raise :class:`~phalanx_core.WorkerFailedError`
        for the rank that failed first. ``variables``: more for every
        rank's environment (a launcher that runs its script through this one
        marks its ranks so); ``restarts_before``: the job's restarts before
        this run (a launcher that restarts it by running it again), which
        the ranks' restart count starts from."""
        # Elastic's process layer logs each stop, signal and failure; phalanx run
        # says what failed once, from the WorkerFailedError.
        with _quiet("torch.distributed.elastic"), tempfile.TemporaryDirectory(prefix="phalanx-run-") as tmp:
            given = {**(variables or {}), LINES_PREFIXED_VAR: "1", _LAUNCHER_PID_VAR: str(os.getpid())}
            self._run_elastic(
                [*_RANK_PROGRAM, *command],
                given,
                Path(tmp, "logs"),
                prefix_lines=True,
                restarts_before=restarts_before,
            )

    def _run_elastic(
        self,
        command: list[str],
        variables: dict[str, str],
        logs: Path,
        *,
        prefix_lines: bool = False,
        restarts_before: int = 0,
    ) -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.elastic.rendezvous import RendezvousParameters

        who = "phalanx run" if prefix_lines else "launcher 'subprocess'"
        if self._hosts_store:
            allow_connections(CONNECTIONS * self.num_nodes)
        rendezvous = self._rendezvous()
        # The launch's view of the job's store (rounds: the one the rendezvous
        # uses; fixed nodes: the heartbeat's and the watch's, beside the
        # static rendezvous' own client).
        job: JobStore | None = rendezvous.pop("job_store", None)
        if job is None and self.num_nodes > 1:
            job = JobStore(self._place(), host=None, timeout=self.rendezvous_timeout)
        # What this launch's parts tell each other (it keeps node 0's store
        # of a static rendezvous until the node watch has left it).
        self._ledger = ledger = JobLedger(functools.partial(say, who))
        ledger.job_store = job
        create = rendezvous.pop("create")
        gloo = listen_variables(rendezvous.pop("listen"))
        min_nodes = rendezvous.pop("min_nodes", self.num_nodes)
        parameters = RendezvousParameters(
            backend=rendezvous["backend"],
            endpoint=rendezvous.get("endpoint", ""),
            run_id=rendezvous["run_id"],
            min_nodes=min_nodes,
            max_nodes=self.num_nodes,
            local_addr=rendezvous.get("local_addr"),
            **rendezvous["configs"],
            ledger=ledger,
        )
        variables = {
            **variables,
            **gloo,
            **one_thread(self.num_processes),
            **signals_variable(),
        }
        if self.node_rank is not None:  # else each round gives the ranks their node's (NODE_RANK)
            variables["NODE_RANK"] = str(self.node_rank)
        if self.elastic:
            variables[MIN_NODES_VAR] = str(min_nodes)
        logs_specs = DefaultLogsSpecs(
            log_dir=str(logs),
            redirects=Std.ALL if prefix_lines else Std.NONE,
            tee=Std.ALL if prefix_lines else Std.NONE,
        )
        heartbeat = None
        if job is not None:  # several nodes: a host lost without a word fails the round, or ends the job
            silent = None
            if self._place().kind == "c10d" and not self._hosts_store:
                silent = functools.partial(self._store_silent, who)
            interval = interval_for(self.num_nodes, self._place().kind)
            heartbeat = Heartbeat(job.requests, interval, self.host_lost_after, on_silent=silent)
        # A job in rounds: its rank loop watches the heartbeat; of fixed nodes, the node watch.
        watch = NodeWatch(
            job.requests if job is not None else None,
            self.node_rank,
            self.num_nodes,
            hosts_store=self._hosts_store,
            heartbeat=None if self.elastic else heartbeat,
            ledger=ledger,
            connect_waiter=job.waits if job is not None else None,
        )
        if heartbeat is not None and not self.elastic:
            heartbeat.on_lost = functools.partial(self._host_lost, watch)
        loop = RankLoop(
            functools.partial(create, parameters),
            command,
            num_processes=self.num_processes,
            max_restarts=self.max_restarts,
            monitor_interval=self.monitor_interval,
            logs_specs=logs_specs,
            prefix_lines=prefix_lines,
            who=who,
            ledger=ledger,
            several_nodes=self.num_nodes > 1,
            heartbeat=heartbeat if self.elastic else None,
            variables=variables,
            results=Path(variables[RESULTS_DIR_VAR]) if RESULTS_DIR_VAR in variables else None,
            restarts_before=restarts_before,
        )
        with ledger, signal_handlers_kept(), watch:  # the ledger left last
            try:
                try:
                    loop.run()
                except store_lost_errors() as exc:
                    if not self.elastic or self._hosts_store or self._place().kind != "c10d":
                        raise
                    raise self._node_zero_lost(exc) from exc
                except ChildFailedError as exc:
                    ranks, _ = self._this_node()
                    node_now = ranks[0] // self.num_processes  # in rounds, this node's rank in the last one
                    failures = failures_of(exc, node_now if self.num_nodes > 1 else None)
                    local = root_cause(failures)
                    first = watch.settle(local)
                    if first is not local and prefix_lines:
                        print_elsewhere(first)
                    elif prefix_lines:
                        print_if_shortened(first)
                    stopped = stopped_words(self.num_nodes)
                    raise worker_failed(
                        "subprocess", [first, *failures], self.world_size, stopped=stopped
                    ) from exc
            except (StopRequested, SignalException) as exc:
                if watch.interrupted_at is not None:  # another node's rank failed; the loop stopped ours
                    # This node's own ranks may have failed a moment before
                    # the post came (the watch is quicker than the loop's
                    # look at the ranks): settle what they raised as a failure of this
                    # node, at once, so that every node weighs it (the other
                    # nodes wait for a cause only so long).
                    ranks, _ = self._this_node()
                    node_now = ranks[0] // self.num_processes
                    own = raised_before(logs, ranks, node_now, watch.interrupted_at)
                    cause = watch.settle(root_cause(own)) if own else watch.cause()
                    assert cause is not None  # the watch read a post before it stopped the ranks
                    if cause.died is not None and cause.node is not None:  # a host lost: _host_lost
                        raise NodeLostError(
                            f"node {cause.node} (host {cause.host}) is lost: {cause.died}",
                            node=cause.node,
                            address=cause.host or "?",
                        ) from None
                    if prefix_lines and all(cause is not failure for failure in own):
                        print_elsewhere(cause)  # the ranks of another node failed first
                    elif prefix_lines:
                        print_if_shortened(cause)
                    stopped = stopped_words(self.num_nodes)
                    failed = [cause, *own]
                    raise worker_failed("subprocess", failed, self.world_size, stopped=stopped) from None
                # The loop has stopped every rank. SIGINT ends this process
                # as Ctrl-C does; any other signal as its default action
                # would, with the status a shell shows for it (143 for
                # SIGTERM), rather than elastic's traceback.
                sigval = int(getattr(exc, "sigval", signal.SIGTERM))
                if sigval == signal.SIGINT:
                    raise KeyboardInterrupt from None
                raise SystemExit(128 + sigval) from None

    @property
    def elastic(self) -> bool:
        """Whether the nodes meet in rounds that may restart or change size
        (:mod:`.._nodes.rounds`): on several
        nodes with ``max_restarts``, ``min_nodes`` below ``num_nodes``, or
        a rendezvous in etcd. Else several nodes meet once, in elastic's
        static rendezvous, each with the rank it was given."""
        return self.num_nodes > 1 and (
            self.max_restarts > 0 or self.min_nodes < self.num_nodes or self._place().kind == "etcd"
        )

    def _main(self) -> tuple[str, int]:
        if self.environment is not None:
            return self.environment.main_address, self.environment.main_port
        return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500))

    def _place(self) -> RendezvousPlace:
        """Where the nodes meet: ``rendezvous`` parsed once (a frozen
        :class:`RendezvousPlace`: its TLS files checked and its password
        read once), and again only where the main address it defaults to
        changed (an environment given to the launcher after it was made)."""
        given = (self.rendezvous, *self._main())
        if self._parsed is None or self._parsed[0] != given:
            self._parsed = (given, parse_rendezvous(*given))
        return self._parsed[1]

    @property
    def _hosts_store(self) -> bool:
        """This node's launching process hosts the job's store (node 0, or
        without node ranks the main address's host; none in etcd)."""
        if self.num_nodes == 1 or self._place().kind != "c10d":
            return False
        return self.node_rank == 0 if self.node_rank is not None else self._main_here

    def _store_silent(self, who: str, heartbeat: Heartbeat, seconds: float) -> None:
        """Node 0's store has not answered the heartbeat for ``seconds``:
        node 0 is lost without a word, and every request to its store waits
        for TCP to give up (a quarter of an hour), the rank loop's among
        them. Stop this node's ranks, say so, and end this process: nothing
        else can end the loop's wait."""
        error = self._node_zero_lost(TimeoutError(f"no answer for {seconds:.0f} s"))
        with contextlib.suppress(Exception):  # stopping what can be stopped; the exit follows
            if heartbeat.loop is not None:
                heartbeat.loop.kill_ranks()
        say(who, str(error))
        sys.stdout.flush()
        os._exit(1)

    def _host_lost(self, watch: NodeWatch, node: int, host: str, seconds: float) -> None:
        """A job of fixed nodes: the heartbeat found node ``node`` lost
        without a word; every node ends with a :class:`NodeLostError` that
        names it (posted as a failure of its first rank, ``died``)."""
        watch.post_cause(
            RankFailure(
                node * self.num_processes,
                when=time.time(),
                node=node,
                host=host,
                died=(
                    f"its launching process stopped beating in the job's store {seconds:.0f} s ago, "
                    "as a host that loses its power or its network does (its ranks' peers would "
                    "have waited for them in a collective until gloo's timeout), so every node "
                    "stops. With --num-nodes MIN:MAX and --max-restarts the job goes on without it"
                ),
            )
        )

    def _node_zero_lost(self, exc: BaseException) -> WorkerFailedError:
        place = self._place()
        return NodeLostError(
            f"node 0 is lost: the job's rendezvous store that its launching "
            f"process held ({place.endpoint}) no longer answers ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else 'no message'}), so no node can "
            "meet the others again and every node stops. To keep a job running when any one node "
            "is lost, node 0's included, keep its rendezvous outside the nodes: "
            "--rendezvous etcd://HOST:2379,HOST:2379,HOST:2379/NAME (an etcd cluster; see nodes.md)",
            node=0,
            address=place.endpoint,
        )

    def _rendezvous(self) -> dict[str, Any]:
        """How this node meets the others: the handler's factory
        (``create``, given elastic's ``RendezvousParameters``), the fields of
        those parameters (``backend``, ``endpoint``, ``run_id``,
        ``local_addr``, ``configs``), and under ``"listen"`` the address
        this node's sockets listen on (see :mod:`.listen`)."""
        timeout = int(self.rendezvous_timeout)
        if self.elastic:
            return self._rounds(timeout)
        if self.num_nodes == 1:
            return {
                "create": create_one_node_rendezvous,
                "backend": ONE_NODE,
                "run_id": f"phalanx-{uuid.uuid4().hex}",
                "configs": {"timeout": timeout, "address": self.listen_on},
                "local_addr": self.listen_on,
                "listen": self.listen_on,
            }
        address, port = self._main()
        return {
            "create": create_static_rendezvous,
            "backend": STATIC,
            "run_id": f"phalanx-{address}:{port}",  # the same on every node
            "endpoint": f"{address}:{port}",
            "configs": {"rank": self.node_rank, "timeout": timeout, "address": address, "port": port},
            "listen": listen_address(address, port, self.num_nodes),
        }

    def _rounds(self, timeout: int) -> dict[str, Any]:
        """The rendezvous of a job in rounds (:mod:`.._nodes.rounds`)."""
        place = self._place()
        host, port = place.endpoints[0]
        listen = listen_address(host, port, self.num_nodes)
        job = JobStore(place, host=listen if self._hosts_store else None, timeout=timeout)
        if job.hosted:
            job.requests()  # node 0's store up before the others ask for it
        return {
            "create": create_rounds,
            "backend": ROUNDS,
            "run_id": place.name,
            "endpoint": place.endpoint,
            "configs": {
                "place": place,
                "listen": listen,
                "job_store": job,
                "timeout": timeout,
                "join_timeout": timeout,
                "last_call_timeout": max(1, math.ceil(self.last_call)),
                "node_rank": self.node_rank,
            },
            "local_addr": listen or None,
            "listen": listen,
            "min_nodes": self.min_nodes,
            "job_store": job,
        }

    def _results(self, folder: Path, index: int) -> list[Any]:
        ranks, world = self._this_node()
        values: list[Any] = [None] * world
        for rank in ranks:
            path = folder / f"{rank}.pkl"
            if not path.exists():
                raise WorkerFailedError(
                    f"rank {rank} of {world} (launcher 'subprocess') exited with code 0 "
                    f"but left no result for this launch (the script's launch number {index}): the "
                    "re-run script made fewer launches in the rank than here. Make the script call "
                    "launch the same way on every rank, once (not only under `if RANK == 0`)",
                    rank=rank,
                    exitcode=0,
                )
            values[rank] = pickle.loads(path.read_bytes())
        return values


def _given_node_rank(environment: ClusterEnvironment | None) -> int | None:
    """This node's rank as the environment gives it; None where it gives
    none (the local environment without ``NODE_RANK``)."""
    if environment is not None and environment.node_rank_given:
        return environment.node_rank
    if environment is None and "NODE_RANK" in os.environ:
        return _int_var("NODE_RANK", 0)
    return None


def _is_this_host(address: str, port: int) -> bool:
    """Whether the main address is this host's (its name, or an address
    one of its interfaces has): without node ranks, that node hosts the
    job's store, as torchrun's c10d rendezvous decides it."""
    if address in (socket.gethostname(), socket.getfqdn()):
        return True
    try:
        found = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)
    except OSError as exc:
        raise MisconfigurationError(
            f"launcher 'subprocess': the main address {address!r} (MASTER_ADDR, --main-address) does "
            f"not resolve ({exc}); give the address of the host whose node hosts the job's store"
        ) from None
    if any(is_loopback(str(info[4][0])) for info in found):
        raise MisconfigurationError(
            f"launcher 'subprocess': the main address {address!r} is a loopback address, so no node "
            "can tell whether it is the one that hosts the job's store: give each node --node-rank "
            "(node 0 hosts it; nodes on one machine need that), or give --main-address the address "
            "the other hosts reach the store's host at"
        )
    for family, kind, _, _, where in found:
        with contextlib.suppress(OSError), socket.socket(family, kind) as probe:
            probe.bind((str(where[0]), 0))  # only an address of this host binds
            return True
    return False


def _check_listen_on(address: Any, num_nodes: int) -> None:
    """``listen_on`` is an address of this host, given for one node only."""
    from phalanx_core.network import interface_of

    if address == LOOPBACK:
        return
    if num_nodes != 1:
        raise MisconfigurationError(
            f"launcher 'subprocess': listen_on={address!r} with num_nodes={num_nodes}: on several "
            "nodes each node listens on the address that reaches the main address; leave listen_on out"
        )
    if not isinstance(address, str) or interface_of(address) is None:
        raise MisconfigurationError(
            f"launcher 'subprocess': listen_on={address!r} is not an address of this host's network "
            "interfaces; give one of them (ip -brief address lists them), or leave listen_on out "
            "for 127.0.0.1"
        )


def _script_command() -> list[str]:
    """The arguments after ``sys.executable`` that re-run this process's script."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    file = getattr(main, "__file__", None)
    if spec is not None and spec.name != "__main__":  # python -m module
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        target = ["-m", name]
    elif file and sys.argv and sys.argv[0] not in ("", "-c"):
        # A script (__file__ is absolute), or a folder / zip run as a script.
        target = [os.path.abspath(sys.argv[0]) if spec is not None else file]
    else:
        raise MisconfigurationError(
            "launcher 'subprocess' re-runs this process's script once per rank, but this process "
            f"did not start from a script (sys.argv[0] is {sys.argv[0] if sys.argv else ''!r}: "
            "python -c, a notebook or a REPL). Run it as `python script.py` or `python -m module`, "
            "or use launcher='spawn' or launcher='fork' (strategies ddp_spawn, ddp_notebook)"
        )
    return [*_interpreter_options(len(target)), *_RANK_PROGRAM, *target, *sys.argv[1:]]


#: What every rank runs before the program (see :mod:`phalanx_torch._launch.rank_program`).
_RANK_PROGRAM = ("-m", "phalanx_torch._launch.rank_program")


def _interpreter_options(target_length: int) -> list[str]:
    """This interpreter's own options (``-u``, ``-X dev``, ``-W error``): what
    ``sys.orig_argv`` holds before the script or ``-m module``; none where
    that cannot be told apart (``-um module``, or a changed ``sys.argv``)."""
    orig = list(getattr(sys, "orig_argv", ()))
    user = sys.argv[1:]
    if len(orig) < 1 + target_length + len(user) or orig[len(orig) - len(user) :] != user:
        return []
    head = orig[1 : len(orig) - len(user)]
    if target_length == 2 and head[-2:-1] != ["-m"]:
        return []
    return head[:-target_length]


@contextlib.contextmanager
def _quiet(prefix: str) -> Iterator[None]:
    """Only critical records from the loggers under ``prefix`` (elastic sets
    a level on each of its module loggers, so the parent's is not enough)."""
    # Its loggers exist from here on.
    import torch.distributed.elastic.multiprocessing
    import torch.distributed.elastic.rendezvous  # noqa: F401

    loggers = [logging.getLogger(prefix)] + [
        logger
        for name, logger in logging.root.manager.loggerDict.items()
        if name.startswith(prefix + ".") and isinstance(logger, logging.Logger)
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
