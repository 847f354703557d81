"""The ``subprocess`` launcher: the script re-run under torch.distributed.elastic.

Imports no torch at import time; see :mod:`phalanx_torch.launchers`."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from phalanx_core import Launcher, MisconfigurationError, NodeLostError, WorkerFailedError

if TYPE_CHECKING:
    from phalanx_core import ClusterEnvironment

from phalanx_core.launching import (
    LINES_PREFIXED_VAR,
    LOOPBACK,
    STOP_GRACE,
    RankFailure,
    check_count,
    hosted_store,
    listen_variables,
    root_cause,
    signal_name,
    warn_died_after_delivery,
    worker_failed,
)

from ._arrivals import meet
from ._listen import listen_address, one_thread
from ._ranks import (
    _LAUNCH_INDEX_VAR,
    _LAUNCHER_PID_VAR,
    _LAUNCHES,
    MIN_NODES_VAR,
    RESULTS_DIR_VAR,
    T,
    _run_here,
)
from ._rounds import KEEP_ALIVE, MET, RendezvousPlace, job_store, parse_rendezvous
from ._rounds import register as register_rounds

__all__ = ["SubprocessLauncher"]


class SubprocessLauncher(Launcher):
    """Re-runs this process's script once per local rank under
    ``torch.distributed.elastic`` (its agent, rendezvous and error files),
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
            ``node_rank`` (``NODE_RANK``), else 0.
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
            (an etcd cluster with its v2 API: no node is then a single
            point of failure).
        last_call: seconds a round that has ``min_nodes`` waits for more
            nodes before it starts (default 3; only where ``min_nodes`` is
            below ``num_nodes``).
        monitor_interval: seconds between elastic's checks of the ranks.
        rendezvous_timeout: seconds to wait for every node to join.

    One node (like ``torchrun --standalone``): a rendezvous of this module
    that gives every round, the first and each restart, a new TCPStore
    listening on ``127.0.0.1`` only, on a port the kernel gives; the agent
    keeps it and the ranks join it as clients, and their gloo listens on
    ``127.0.0.1`` too. Several nodes: elastic's static rendezvous at the
    environment's ``main_address``/``main_port`` (``MASTER_ADDR`` /
    ``MASTER_PORT``), which node 0 hosts, listening (as the ranks' gloo) on
    the address this node reaches the main address from (see
    :mod:`._listen`); start the same script on every node with its
    ``NODE_RANK``. A failure stops this node's ranks; the
    other nodes learn of it when their collectives fail or time out.
    """

    is_interactive_compatible: ClassVar[bool] = False

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
    ) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        check_count("subprocess", "num_processes", num_processes)
        check_count("subprocess", "num_nodes", num_nodes)
        if node_rank is None:
            node_rank = (
                environment.node_rank if environment is not None else int(os.environ.get("NODE_RANK", 0))
            )
        if not isinstance(node_rank, int) or isinstance(node_rank, bool) or not 0 <= node_rank < num_nodes:
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
        ):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise MisconfigurationError(
                    f"launcher 'subprocess': {name}={value!r}; expected a number of seconds above 0"
                )
        self.node_rank = node_rank
        self.max_restarts = max_restarts
        self.min_nodes = min_nodes
        self.rendezvous = rendezvous
        self.last_call = float(last_call)
        if num_nodes == 1 and rendezvous not in (None, "c10d"):
            raise MisconfigurationError(
                f"launcher 'subprocess': rendezvous={rendezvous!r} with num_nodes=1: one node meets "
                "no other (its store is on 127.0.0.1); give num_nodes, or leave rendezvous out"
            )
        if rendezvous is not None:
            self._place()  # checks the address now
        self.monitor_interval = float(monitor_interval)
        self.rendezvous_timeout = float(rendezvous_timeout)

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        if num_nodes == 1:
            return "127.0.0.1 only: the agent's rendezvous store and every rank's gloo"
        return (
            "node 0's rendezvous store (MASTER_PORT) and every rank's gloo on the address that reaches "
            "MASTER_ADDR (the route's source address); on every interface where that is a loopback address"
        )

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
        if self.elastic and _LAST_ROUND:
            group_rank, group_world_size = _LAST_ROUND[-1]
            first = group_rank * self.num_processes
            return range(first, first + self.num_processes), group_world_size * self.num_processes
        first = self.node_rank * self.num_processes
        return range(first, first + self.num_processes), self.world_size

    def _all_delivered(self, folder: Path) -> bool:
        ranks, _ = self._this_node()
        return all((folder / f"{rank}.pkl").exists() for rank in ranks)

    def run_script(self, command: Sequence[str]) -> None:
        """Run ``python *command`` as every rank's program under torch
        elastic, each output line prefixed with the rank (``[rank1]: ...``),
        as ``phalanx run`` does; raise :class:`~phalanx_core.WorkerFailedError`
        for the rank that failed first."""
        # Elastic's agent logs each stop, signal and failure; phalanx run
        # says what failed once, from the WorkerFailedError.
        with _quiet("torch.distributed.elastic"), tempfile.TemporaryDirectory(prefix="phalanx-run-") as tmp:
            variables = {LINES_PREFIXED_VAR: "1", _LAUNCHER_PID_VAR: str(os.getpid())}
            self._run_elastic([*_RANK_PROGRAM, *command], variables, Path(tmp, "logs"), prefix_lines=True)

    def _run_elastic(
        self, command: list[str], variables: dict[str, str], logs: Path, *, prefix_lines: bool = False
    ) -> None:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        newer: dict[str, Any] = {}
        if "shutdown_timeout" in {f.name for f in dataclasses.fields(LaunchConfig)}:
            # How long a stopped job's ranks get between SIGTERM and SIGKILL,
            # where torch has it (2.13 does, 2.11 does not: it waits 30 s).
            newer["shutdown_timeout"] = STOP_GRACE
        who = "phalanx run" if prefix_lines else "launcher 'subprocess'"
        rendezvous = self._rendezvous()
        rendezvous.setdefault("rdzv_configs", {})["say"] = functools.partial(_say, who)
        gloo = listen_variables(rendezvous.pop("listen"))
        min_nodes = rendezvous.pop("min_nodes", self.num_nodes)
        variables = {**variables, "NODE_RANK": str(self.node_rank), **gloo, **one_thread(self.num_processes)}
        if self.elastic:
            variables[MIN_NODES_VAR] = str(min_nodes)
        config = LaunchConfig(
            min_nodes=min_nodes,
            max_nodes=self.num_nodes,
            nproc_per_node=self.num_processes,
            role="phalanx",
            max_restarts=self.max_restarts,
            monitor_interval=self.monitor_interval,
            start_method="spawn",
            logs_specs=DefaultLogsSpecs(
                log_dir=str(logs),
                redirects=Std.ALL if prefix_lines else Std.NONE,
                tee=Std.ALL if prefix_lines else Std.NONE,
            ),
            log_line_prefix_template="[rank${rank}]: " if prefix_lines else None,
            **newer,
            **rendezvous,
        )
        watch = _NodeWatch(self._watch_store(), self.node_rank, self.num_nodes, hosts_store=self._hosts_store)
        node = self.node_rank if self.num_nodes > 1 else None
        with (
            _variables(variables),
            _signal_handlers_kept(),
            watch,
            _agent_class(who, self.max_restarts, node, elastic=self.elastic),
        ):
            try:
                elastic_launch(config, sys.executable)(*command)
            except _store_lost_errors() as exc:
                if not self.elastic or self._hosts_store or self._place().kind != "c10d":
                    raise
                raise self._node_zero_lost(exc) from exc
            except ChildFailedError as exc:
                ranks, _ = self._this_node()
                node_now = ranks[0] // self.num_processes  # in rounds, this node's rank in the last one
                failures = _failures(exc, node_now if self.num_nodes > 1 else None)
                local = root_cause(failures)
                try:
                    first = watch.settle(local)
                except SignalException:  # the watch's signal, sent as this node's ranks failed too
                    first = root_cause([local] + ([watch.remote] if watch.remote is not None else []))
                if first is not local and prefix_lines:
                    _print_elsewhere(first)
                stopped = _stopped(self.num_nodes)
                raise worker_failed(
                    "subprocess", [first, *failures], self.world_size, stopped=stopped
                ) from exc
            except SignalException as exc:
                if watch.remote is not None:  # another node's rank failed; the agent stopped ours
                    if prefix_lines:
                        _print_elsewhere(watch.remote)
                    stopped = _stopped(self.num_nodes)
                    raise worker_failed(
                        "subprocess", [watch.remote], self.world_size, stopped=stopped
                    ) from None
                # The agent has stopped every rank. SIGINT ends this process
                # as Ctrl-C does; any other signal as its default action
                # would, with the status a shell shows for it (143 for
                # SIGTERM), rather than elastic's traceback.
                if exc.sigval == signal.SIGINT:
                    raise KeyboardInterrupt from None
                raise SystemExit(128 + int(exc.sigval)) from None

    @property
    def elastic(self) -> bool:
        """Whether the nodes meet in rounds that may restart or change size
        (torch elastic's dynamic rendezvous, :mod:`._rounds`): on several
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
        return parse_rendezvous(self.rendezvous, *self._main())

    @property
    def _hosts_store(self) -> bool:
        """This node's launching process hosts the job's store (node 0,
        unless the store is in etcd)."""
        return self.num_nodes > 1 and self.node_rank == 0 and self._place().kind == "c10d"

    def _watch_store(self) -> Callable[[], Any] | None:
        """How the node watch reaches the job's store (None on one node)."""
        if self.num_nodes == 1:
            return None
        place, timeout = self._place(), self.rendezvous_timeout
        return lambda: job_store(place, host=None, timeout=timeout)

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
        """LaunchConfig's rendezvous fields, and under ``"listen"`` the
        address this node's sockets listen on (see :mod:`._listen`)."""
        timeout = int(self.rendezvous_timeout)
        if self.elastic:
            return self._rounds(timeout)
        if self.num_nodes == 1:
            return {
                "run_id": f"phalanx-{uuid.uuid4().hex}",
                "rdzv_backend": _register_rendezvous(_ONE_NODE, _create_one_node_rendezvous),
                "rdzv_configs": {"timeout": timeout},
                "local_addr": LOOPBACK,
                "listen": LOOPBACK,
            }
        if self.environment is not None:
            address, port = self.environment.main_address, self.environment.main_port
        else:
            address, port = (
                os.environ.get("MASTER_ADDR", "127.0.0.1"),
                int(os.environ.get("MASTER_PORT", 29500)),
            )
        return {
            "run_id": f"phalanx-{address}:{port}",  # the same on every node
            "rdzv_backend": _register_rendezvous(_STATIC, _create_static_rendezvous),
            "rdzv_endpoint": f"{address}:{port}",
            "rdzv_configs": {"rank": self.node_rank, "timeout": timeout},
            "listen": listen_address(address, port, self.num_nodes),
        }

    def _rounds(self, timeout: int) -> dict[str, Any]:
        """The rendezvous of a job in rounds (:mod:`._rounds`)."""
        place = self._place()
        host, port = place.endpoints[0]
        listen = listen_address(host, port, self.num_nodes)
        store = job_store(place, host=listen, timeout=timeout) if self._hosts_store else None
        return {
            "run_id": place.name,
            "rdzv_backend": register_rounds(),
            "rdzv_endpoint": place.endpoint,
            "rdzv_configs": {
                "place": place,
                "listen": listen,
                "store": store,
                "timeout": timeout,
                "join_timeout": timeout,
                "last_call_timeout": max(1, math.ceil(self.last_call)),
                "close_timeout": 30,
                "keep_alive_interval": KEEP_ALIVE,
                "keep_alive_max_attempt": 3,
            },
            "local_addr": listen or None,
            "listen": listen,
            "min_nodes": self.min_nodes,
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


_ONE_NODE = "phalanx-one-node"
_STATIC = "phalanx-static"


def _register_rendezvous(name: str, create: Callable[[Any], Any]) -> str:
    """Register (once) one of this module's elastic rendezvous; return its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(name, create)
    return name


def _create_static_rendezvous(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    static: Any = create_rdzv_handler(params)  # checks the endpoint and the rank
    timeout = int(static.timeout.total_seconds())
    handler = _static_rendezvous_class()(
        static.master_addr, static.master_port, static.rank, static.world_size, static.run_id, timeout
    )
    handler.say = params.config.get("say")
    return handler


@functools.cache
def _static_rendezvous_class() -> type:
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class StaticRendezvous(StaticTCPRendezvous):
        """Elastic's static rendezvous (several nodes; node 0's agent hosts
        the store), with node 0's store listening on the address the other
        nodes reach it by (see :mod:`._listen`), not on every interface."""

        def get_backend(self) -> str:
            return _STATIC

        say: Callable[[str], None] | None = None

        def next_rendezvous(self) -> Any:
            if self._store is None:
                # Every node says it arrived; node 0 waits for all, saying
                # what it waits for, and names a node that never comes.
                def host() -> Any:
                    address = listen_address(self.master_addr, self.master_port, self.world_size)
                    return hosted_store(
                        address,
                        self.master_port,
                        world_size=self.world_size,
                        timeout=self.timeout,
                        wait_for_workers=False,
                    )

                self._store = meet(
                    node_rank=self.rank,
                    num_nodes=self.world_size,
                    address=self.master_addr,
                    port=self.master_port,
                    timeout=self.timeout.total_seconds(),
                    host_store=host,
                    say=self.say,
                )
            info = super().next_rendezvous()
            MET.set()  # node 0's store is up: the node watch may connect
            return info

    return StaticRendezvous


def _create_one_node_rendezvous(params: Any) -> Any:
    return _one_node_rendezvous_class()(params.run_id, int(params.config.get("timeout", 900)))


@functools.cache
def _one_node_rendezvous_class() -> type:
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    class OneNodeRendezvous(RendezvousHandler):
        """One node (``torchrun --standalone``): every round, the first and
        each restart, gets a new TCPStore on a port the kernel gives, which
        the agent keeps and the ranks join as clients. A new store per round
        means a restarted rank never reads the keys of the attempt before
        (torch 2.13's c10d rendezvous keeps one store across restarts, and
        restarted ranks then connect to the dead ranks' addresses)."""

        def __init__(self, run_id: str, timeout: int) -> None:
            self._run_id = run_id
            self._timeout = datetime.timedelta(seconds=timeout)
            self._store: Any = None
            self._round = 0
            self._closed = False

        def get_backend(self) -> str:
            return _ONE_NODE

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> Any:
            self._store = None  # the ranks of the round before are stopped
            self._store = hosted_store(LOOPBACK, wait_for_workers=False, timeout=self._timeout)
            self._round += 1
            prefixed = dist.PrefixStore(f"{self._run_id}/{self._round}", self._store)  # type: ignore[attr-defined]
            return RendezvousInfo(prefixed, 0, 1, RendezvousStoreInfo(LOOPBACK, self._store.port))

        def is_closed(self) -> bool:
            return self._closed

        def set_closed(self) -> None:
            self._closed = True

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self._run_id

        def shutdown(self) -> bool:
            self._store = None
            return True

    return OneNodeRendezvous


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


#: What every rank runs before the program (see :mod:`phalanx_torch._rank_program`).
_RANK_PROGRAM = ("-m", "phalanx_torch._rank_program")


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
def _variables(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables (which the ranks inherit) for a launch;
    restore them, and the one elastic sets, afterwards."""
    names = [*values, "TORCHELASTIC_SIGNALS_TO_HANDLE"]
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _quiet(prefix: str) -> Iterator[None]:
    """Only critical records from the loggers under ``prefix`` (elastic sets
    a level on each of its module loggers, so the parent's is not enough)."""
    import torch.distributed.elastic.agent.server.api  # noqa: F401 - its loggers exist from here on

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


def _say(who: str, line: str) -> None:
    sys.stderr.write(f"{who}: {line}\n")
    sys.stderr.flush()


def _say_restart(who: str, result: Any, restart: int, max_restarts: int, node_rank: int | None) -> None:
    """Say on stderr which rank failed (phalanx's root-cause rule over every
    failed rank of this node) and that every rank starts again."""
    failures = _failures(result, node_rank)
    what = "a rank failed"
    if failures:
        first = root_cause(failures)
        killed = signal_name(first.exitcode)
        how = f"killed by {killed}" if killed else f"exit code {first.exitcode}"
        last = (first.traceback or "").strip().splitlines()[-1:]
        what = f"rank {first.rank} failed ({how}{': ' + last[0] if last else ''})"
    sys.stderr.write(
        f"{who}: {what}; every rank is stopped and started again (restart {restart} of {max_restarts})\n"
    )
    sys.stderr.flush()


@contextlib.contextmanager
def _agent_class(who: str, max_restarts: int, node_rank: int | None, *, elastic: bool) -> Iterator[None]:
    """While elastic's launch runs, its agent (torch's LocalElasticAgent)
    is this subclass, which says each restart and the rank that caused it
    (:func:`_say_restart`; elastic's own log line names the rank its
    whole-second timestamps make first, often a rank it stopped itself),
    and, for a job in rounds (:mod:`._rounds`), counts restarts for the
    job rather than for this node and gives the ranks their node's rank in
    the round (``NODE_RANK``)."""
    if not max_restarts and not elastic:
        yield
        return
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.launcher import api

    launcher_api: Any = api
    base = launcher_api.LocalElasticAgent

    class PhalanxAgent(base):  # type: ignore[misc, valid-type]  # a class made at run time
        _last: Any = None
        _joining = False

        def _rounds(self) -> Any:
            handler = self._worker_group.spec.rdzv_handler
            return handler if hasattr(handler, "count_failure") else None

        def _monitor_workers(self, worker_group: Any) -> Any:
            self._last = result = super()._monitor_workers(worker_group)
            self._joining = False
            rounds = self._rounds()
            if rounds is not None and result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                if not rounds.failed() and rounds.nodes_waiting_now():
                    # A node waits to join and no node saw this round fail:
                    # another node has stopped its ranks for the new round,
                    # and ours lost their peers. A change of members, not a
                    # failure (not counted).
                    self._joining = True
                    self._remaining_restarts = max(1, max_restarts - rounds.restarts() + 1)
                else:
                    # The job's count, this round's failure included; elastic
                    # then restarts while its own count stays above 0.
                    self._remaining_restarts = max(0, max_restarts - rounds.count_failure() + 1)
            return result

        def _rendezvous(self, worker_group: Any) -> None:
            super()._rendezvous(worker_group)
            rounds = self._rounds()
            if rounds is not None:
                self._remaining_restarts = max(0, max_restarts - rounds.restarts())
                os.environ["NODE_RANK"] = str(worker_group.group_rank)  # the ranks' node, this round
                _LAST_ROUND.append((worker_group.group_rank, worker_group.group_world_size))
                results = os.environ.get(RESULTS_DIR_VAR)
                if results:  # what ranks of a round before left is not this round's
                    for stale in Path(results).glob("*.pkl"):
                        stale.unlink(missing_ok=True)

        def _restart_workers(self, worker_group: Any) -> None:
            last = self._last
            failed = last is not None and last.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            if failed and not self._joining:
                restart = max_restarts - self._remaining_restarts
                _say_restart(who, last, restart, max_restarts, node_rank)
            elif last is not None:
                waiting = self._worker_group.spec.rdzv_handler.num_nodes_waiting()
                sys.stderr.write(
                    f"{who}: {waiting or 'a'} node{'s' if waiting > 1 else ''} asked to join; every rank "
                    "is stopped and the nodes meet in a new round (not counted as a restart)\n"
                )
                sys.stderr.flush()
            self._last = None
            super()._restart_workers(worker_group)

    launcher_api.LocalElasticAgent = PhalanxAgent  # what elastic_launch makes its agent of
    _LAST_ROUND.clear()
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = base


#: This node's rank and the number of nodes in each round of the launch
#: under way (a job in rounds), the last one last.
_LAST_ROUND: list[tuple[int, int]] = []


@contextlib.contextmanager
def _signal_handlers_kept() -> Iterator[None]:
    """Elastic's agent replaces the handlers of SIGTERM, SIGINT, SIGHUP and
    SIGQUIT to stop the ranks; put this process's own back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def _failures(exc: Any, node_rank: int | None) -> list[RankFailure]:
    """Every failed rank of elastic's ChildFailedError, each at the time its
    error file was written where there is one (elastic orders by whole
    seconds, which often names a rank that only lost its peer; the file's
    time is finer). ``node_rank``: this node's, in a job of several."""
    failures = []
    host = socket.gethostname() if node_rank is not None else None
    for rank, failure in exc.failures.items():
        traceback_text: str | None = None
        when = float(failure.timestamp)
        message = failure.error_file_data.get("message")
        if isinstance(message, dict):
            traceback_text = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
        elif isinstance(message, str) and message != "<NONE>":
            traceback_text = message
        with contextlib.suppress(OSError):
            when = os.stat(failure.error_file).st_mtime
        failures.append(
            RankFailure(int(rank), failure.exitcode, traceback_text, when, node=node_rank, host=host)
        )
    return failures


def _stopped(num_nodes: int) -> str:
    return "Every other rank was stopped" + (", on every node" if num_nodes > 1 else "")


def _print_elsewhere(failure: RankFailure) -> None:
    """Another node's failure, in the lines its rank would have written
    here: its traceback, each line marked ``[rankN]:``."""
    text = failure.traceback or f"(no traceback; exit code {failure.exitcode})"
    lines = [f"[rank{failure.rank}]: (on node {failure.node}, host {failure.host})"]
    lines += [f"[rank{failure.rank}]: {line}" for line in text.rstrip().splitlines()]
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()


def _store_lost_errors() -> tuple[type[BaseException], ...]:
    """What elastic's launch raises when the job's store stops answering."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    return (RendezvousConnectionError, dist.DistNetworkError)


class _NodeWatch:
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

    def __enter__(self) -> _NodeWatch:
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
