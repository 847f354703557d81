"""Launchers: how a job's processes come to exist. Imports no torch.

``in_process`` runs ``fn`` here; ``spawn`` and ``fork`` start one process per
local rank with :mod:`torch.multiprocessing`; ``subprocess`` re-runs the
script once per local rank under ``torch.distributed.elastic``. Each imports
torch only when it launches.

**The rank protocol.** Every launcher that creates processes runs each rank
with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``NODE_RANK`` (= ``GROUP_RANK``), ``MASTER_ADDR`` and ``MASTER_PORT`` set,
which the ``local`` environment reads when asked. No port is chosen by
binding a socket and closing it again: ``spawn`` and ``fork`` host a
``TCPStore`` on a port the kernel gives, in the launching process, for the
whole launch, and tell the ranks to join it as clients
(``TORCHELASTIC_USE_AGENT_STORE=True``, read by torch's ``env://``
rendezvous); ``subprocess`` does the same through its agent loop.

**Where a job listens** (see :mod:`phalanx_torch._launch.listen`): on one node, the
store and the ranks' gloo listen on ``127.0.0.1`` only; on several, on the
address that reaches node 0, not on every interface.

**The failure contract** (see :class:`phalanx_core.Launcher`): the first rank
to fail is reported as :class:`~phalanx_core.WorkerFailedError` with its exit
code or signal and its own traceback, after every other rank was stopped
(``SIGTERM``, then ``SIGKILL`` after :data:`STOP_GRACE` seconds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from phalanx_core import Launcher, MisconfigurationError
from phalanx_core.launching import (
    CAUSE_GRACE,
    LOOPBACK,
    STOP_GRACE,
    RankFailure,
    check_count,
    die_with_parent,
    dumps_result,
    exit_process,
    failure_text,
    hosted_store,
    listen_variables,
    rank_variables,
    run_program,
    stop_processes,
    warn_died_after_delivery,
    worker_failed,
)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from phalanx_core import ClusterEnvironment

from ._launch.elastic import SubprocessLauncher
from ._launch.listen import one_thread
from ._launch.ranks import (
    _LAUNCHES,
    RESULTS_DIR_VAR,
    T,
    _refuse_unforkable,
    _run_here,
    _start_methods,
)

#: Set in the ranks a spawn or fork launcher's run_script started.
RERUN_VAR = "PHALANX_LAUNCH_RERUN_BY"

__all__ = [
    "RESULTS_DIR_VAR",
    "STOP_GRACE",
    "InProcessLauncher",
    "MultiprocessingLauncher",
    "SubprocessLauncher",
]


class InProcessLauncher(Launcher):
    """Runs ``fn`` in this process and returns ``[result]``.

    For one process alone, or for a process that torchrun, srun or mpirun
    already made: then the list is indexed by global rank, as every
    launch's is, and holds this rank's result at its rank, ``None`` at the
    others' (which are in other processes). Nothing is
    created, so nothing needs stopping: an exception of ``fn`` reaches the
    caller unchanged.

    Under torch elastic (``TORCHELASTIC_ERROR_FILE`` set: torchrun, or the
    ``subprocess`` launcher) an exception of ``fn`` is also written to the
    rank's error file, where the launching process reads the traceback.
    Under the ``subprocess`` launcher (``PHALANX_LAUNCH_RESULTS_DIR`` set) the
    result is also pickled to ``<dir>/<RANK>.pkl`` for the launching process:
    the result of this process's launch with the same number as the launch
    that started it (the re-run script launches in the same order).
    """

    is_interactive_compatible: ClassVar[bool] = True
    creates_processes: ClassVar[bool] = False

    def __init__(self, *, environment: Any = None, num_processes: int = 1, num_nodes: int = 1) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        external = bool(getattr(environment, "creates_processes_externally", False))
        if num_processes * num_nodes > 1 and not external:
            raise MisconfigurationError(
                f"launcher 'in_process' runs in this one process, but {num_processes} processes per "
                f"node on {num_nodes} node(s) were asked for and no scheduler made them; use a "
                "launcher that creates processes, or start this script with torchrun / srun"
            )

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        return self.placed(_run_here(next(_LAUNCHES), fn, args, kwargs))  # type: ignore[return-value]

    def run_script(self, command: Sequence[str]) -> None:
        """Run the program in this process, as ``python *command`` would:
        ``sys.argv`` and ``sys.path[0]`` set, ``__name__ == "__main__"``.
        Its globals are dropped afterwards (its unclosed files flushed and
        closed), as the interpreter's exit would, which ``phalanx run``
        leaves without."""
        import gc

        run_program(list(command)).clear()
        gc.collect()

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        return (
            "nothing that phalanx opens; ranks that torchrun, srun or mpirun started listen where those "
            "tools and torch put them"
        )


class MultiprocessingLauncher(Launcher):
    """Starts one process per local rank with :mod:`torch.multiprocessing`
    and runs ``fn`` in each; returns every rank's result, indexed by global
    rank.

    Options:
        start_method: ``"spawn"`` (a fresh interpreter per rank: ``fn``, its
            arguments and its result must be picklable, and ``fn`` importable
            by name) or ``"fork"`` (a copy of this process: works in a
            notebook, but not once CUDA is initialised here); also
            ``"forkserver"`` where the platform has it.

    One node only: for several nodes use the ``subprocess`` launcher, or a
    scheduler (torchrun, srun) with ``in_process``. The ranks join a
    ``TCPStore`` this process hosts for the whole launch (see the module's
    rank protocol). Each rank leads its own process group, so stopping it
    stops what it started; on Linux a rank is killed if this process dies.
    """

    is_interactive_compatible: ClassVar[bool] = False

    def __init__(
        self,
        *,
        environment: ClusterEnvironment | None = None,
        num_processes: int = 1,
        num_nodes: int = 1,
        start_method: str = "spawn",
    ) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        methods = _start_methods()
        if start_method not in methods:
            usable = [f"launcher={m!r}" for m in ("spawn", "fork") if m in methods]
            instead = (
                f"use {' or '.join(usable)}"
                if usable
                else "use launcher='subprocess', which re-runs the script"
            )
            raise MisconfigurationError(
                f"launcher start_method={start_method!r}: this platform cannot start processes that "
                f"way (its start methods: {', '.join(methods) or 'none'}); {instead}"
            )
        self.start_method = start_method
        check_count(start_method, "num_processes", num_processes)
        if num_nodes != 1:
            raise MisconfigurationError(
                f"launcher {start_method!r} starts processes on this machine only, but num_nodes="
                f"{num_nodes} was asked for; use launcher='subprocess' (strategy 'ddp') started on "
                "every node, or a scheduler (torchrun, srun) that starts the processes"
            )
        if start_method == "fork":
            _refuse_unforkable()
        # Per instance: "fork" works in a notebook, "spawn" does not.
        self.is_interactive_compatible = start_method == "fork"  # type: ignore[misc]

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        return "127.0.0.1 only: the launcher's rendezvous store and every rank's gloo"

    def run_script(self, command: Sequence[str]) -> None:
        """A program cannot be forked or spawned as a function: its ranks
        are started as fresh interpreters under torch elastic, as the
        ``subprocess`` launcher does (each line prefixed with its rank).
        They are marked as this launcher's (``PHALANX_LAUNCH_RERUN_BY``), so that
        a script naming it (``launcher="spawn"``, then ``launch()``) sets
        up in them, where under torchrun it would be refused."""
        SubprocessLauncher(environment=self.environment, num_processes=self.num_processes).run_script(
            command, variables={RERUN_VAR: "1"}
        )

    @classmethod
    def runs_in_existing_processes(cls, environment: type[ClusterEnvironment]) -> bool:
        """Yes in the ranks of its own script re-run (:meth:`run_script`)."""
        return bool(os.environ.get(RERUN_VAR))

    def runs_in_place(self) -> bool:
        return bool(os.environ.get(RERUN_VAR))

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        import torch.multiprocessing as mp

        if self.runs_in_place():  # a rank of its own script re-run: run here
            return self.placed(_run_here(next(_LAUNCHES), fn, args, kwargs))  # type: ignore[return-value]
        next(_LAUNCHES)
        if self.start_method == "fork":
            _refuse_unforkable()
        ctx: Any = mp.get_context(self.start_method)
        size = self.num_processes
        # Kept alive until every rank has finished: the ranks' rendezvous,
        # on loopback only, as the ranks' gloo (see _launch/listen.py).
        store = hosted_store(LOOPBACK, wait_for_workers=False)
        common = {**listen_variables(LOOPBACK), **one_thread(size)}
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        # No rank connects to the store before the last one is started: the
        # store's thread takes glibc's resolver lock for each connection
        # (c10d names the peer with getnameinfo), and a rank forked while
        # it holds that lock inherits it held, and hangs in its own first
        # connection, for good (seen in CI: a third forked rank in
        # getnameinfo, the other two waiting for it at set-up).
        go = ctx.Event()
        try:
            for rank in range(size):
                env = {
                    **rank_variables(
                        rank=rank, world_size=size, local_rank=rank, local_world_size=size,
                        main_address=LOOPBACK, main_port=store.port, agent_store=True,
                    ),
                    **common,
                }  # fmt: skip
                reader, writer = ctx.Pipe(duplex=False)
                conns.append(reader)
                proc = ctx.Process(
                    target=_mp_rank,
                    args=(env, os.getpid(), writer, fn, args, kwargs, self.start_method, go),
                    name=f"phalanx-rank-{rank}",
                )
                try:
                    proc.start()
                except (pickle.PicklingError, AttributeError, TypeError) as exc:
                    raise MisconfigurationError(
                        f"launcher {self.start_method!r} sends fn and its arguments to each new process "
                        f"by pickling them, and {getattr(fn, '__qualname__', fn)!r} or an argument cannot "
                        f"be pickled ({type(exc).__name__}: {exc}). Define fn at the top level of an "
                        "importable module (not a lambda or a local function), or use launcher='fork'"
                    ) from exc
                finally:
                    writer.close()
                procs.append(proc)
            go.set()
            results, failures, died_late = _collect(procs, conns)
            if failures:
                stop_processes(procs, spare={f.rank for f in failures})
                # Each failed rank's exit code, as it is once it has exited.
                failures = [dataclasses.replace(f, exitcode=procs[f.rank].exitcode) for f in failures]
                raise worker_failed(self.start_method, failures, size)
            for failure in died_late:
                warn_died_after_delivery(self.start_method, failure, size)
            return [results[rank] for rank in range(size)]
        finally:
            stop_processes(procs)
            for conn in conns:
                conn.close()
            for proc in procs:
                with contextlib.suppress(ValueError):  # one that could not be stopped stays open
                    proc.close()
            del store


def _mp_rank(
    env: dict[str, str],
    parent: int,
    conn: Connection,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    start_method: str,
    go: Any,
) -> None:
    """A rank of a spawn/fork launch: report fn's result, or its traceback,
    to the launching process through ``conn``. A forked rank computes with
    one intra-op thread (see below). ``go``: set once every rank is
    started (see the launch)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # its own group: stopping it stops what it starts
    die_with_parent(parent)
    conn.send_bytes(_STARTED)  # past spawn's import of the main script
    go.wait()
    os.environ.update(env)
    if start_method == "fork" or env.get("OMP_NUM_THREADS") == "1":
        # libgomp (torch's OpenMP) cannot run a parallel region in a child
        # forked after the parent ran one: the child's first parallel matmul
        # never returns (seen with bf16 autocast in the parent). One thread
        # runs inline; ranks sharing a CPU want one each anyway (torchrun
        # sets OMP_NUM_THREADS=1 for the same reason).
        import torch

        torch.set_num_threads(1)
    try:
        payload = dumps_result(("result", fn(*args, **kwargs)), env["RANK"], before_exit=True)
    except BaseException as exc:
        told = False
        with contextlib.suppress(Exception):
            text = failure_text(exc, skip_frames=1)  # from fn's frame on
            conn.send_bytes(pickle.dumps(("error", text, time.time())))
            told = True
        conn.close()
        if told and not isinstance(exc, SystemExit):
            # The launching process raises WorkerFailedError with this
            # traceback in it: shown once, there, not also here.
            del exc
            exit_process(1, run_atexit=start_method != "fork")
        raise  # multiprocessing prints it to this rank's stderr and exits with 1
    conn.send_bytes(payload)
    conn.close()
    # The result is delivered: end here, not through the interpreter's
    # finalization, in which gloo's threads can abort the rank.
    del payload
    exit_process(0, run_atexit=start_method != "fork")


#: What a rank sends first: it runs (spawn has imported the main script).
_STARTED = pickle.dumps(("started",))


def _collect(
    procs: Sequence[BaseProcess], conns: Sequence[Connection]
) -> tuple[dict[int, Any], list[RankFailure], list[RankFailure]]:
    """Wait for every rank's result, or until ranks fail; return the results,
    the failures seen first (possibly several at once), and the ranks that
    returned their result and were then killed by a signal while exiting."""
    from multiprocessing.connection import wait

    results: dict[int, Any] = {}
    failures: list[RankFailure] = []
    late: list[RankFailure] = []
    reported: set[int] = set()
    started: set[int] = set()
    open_conns = {conn: rank for rank, conn in enumerate(conns)}
    running = {proc.sentinel: rank for rank, proc in enumerate(procs)}

    def receive(rank: int, conn: Connection) -> None:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            del open_conns[conn]
            return  # closed without a word: it died; its exit code tells how
        except Exception as exc:  # noqa: BLE001 - a result this process cannot unpickle: that rank failed
            message = ("error", f"its result could not be unpickled here: {type(exc).__name__}: {exc}", 0.0)
        if message[0] == "started":
            started.add(rank)
            return
        del open_conns[conn]
        reported.add(rank)
        if message[0] == "result":
            results[rank] = message[1]
        else:
            failures.append(RankFailure(rank, traceback=message[1], when=message[2] or time.time()))

    def take(ready: list[Any]) -> None:
        for conn in conns:
            if conn in ready and conn in open_conns:
                receive(open_conns[conn], conn)
        for sentinel, rank in list(running.items()):
            if sentinel not in ready:
                continue
            del running[sentinel]
            procs[rank].join()
            while conns[rank] in open_conns and conns[rank].poll():  # what it sent just before it exited
                receive(rank, conns[rank])
            code = procs[rank].exitcode
            if rank not in reported:  # died without a word
                failures.append(RankFailure(rank, code, when=time.time(), started=rank in started))
            elif code != 0 and rank in results:  # died after returning its result
                late.append(RankFailure(rank, code, when=time.time()))

    while running and not failures:
        take(wait([*open_conns, *running]))
    # A rank that raises tears its group down on the way out, so a peer's
    # "connection closed" can arrive before the error that caused it: while
    # every failure seen is such a consequence, wait a moment for the cause.
    settle = time.monotonic() + CAUSE_GRACE
    while running and failures and all(f.lost_a_peer for f in failures):
        left = settle - time.monotonic()
        if left <= 0:
            break
        take(wait([*open_conns, *running], timeout=left))
    return (
        results,
        failures + [f for f in late if f.signal is None],
        [f for f in late if f.signal is not None],
    )


# -- subprocess (script mode, torch elastic) ---------------------------------------------------
