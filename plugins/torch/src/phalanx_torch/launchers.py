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
rendezvous); ``subprocess`` does the same through elastic's agent.

**The failure contract** (see :class:`phalanx_core.Launcher`): the first rank
to fail is reported as :class:`~phalanx_core.WorkerFailedError` with its exit
code or signal and its own traceback, after every other rank was stopped
(``SIGTERM``, then ``SIGKILL`` after :data:`STOP_GRACE` seconds).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import pickle
import signal
import sys
import tempfile
import textwrap
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError, WorkerFailedError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.process import BaseProcess

    from phalanx_core import ClusterEnvironment

__all__ = [
    "RESULTS_DIR_VAR",
    "STOP_GRACE",
    "InProcessLauncher",
    "MultiprocessingLauncher",
    "SubprocessLauncher",
]

T = TypeVar("T")

#: Set by the ``subprocess`` launcher for the ranks it starts: the folder in
#: which each rank leaves its return value, as ``<RANK>.pkl``.
RESULTS_DIR_VAR = "PHALANX_RESULTS_DIR"
#: Seconds a rank has to exit after ``SIGTERM`` before it gets ``SIGKILL``.
STOP_GRACE = 5
_ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
_LAUNCH_INDEX_VAR = "PHALANX_LAUNCH_INDEX"
_LAUNCHER_PID_VAR = "PHALANX_LAUNCHER_PID"
#: Counts the launches of this process, in every launcher here. A script
#: re-run by the ``subprocess`` launcher makes the same launches in the same
#: order, so a rank answers the launch of the same number.
_LAUNCHES = itertools.count(1)
_EXCERPT_LINES = 30


# -- in_process ------------------------------------------------------------------


class InProcessLauncher(Launcher):
    """Runs ``fn`` in this process and returns ``[result]``.

    For one process alone, or for a process that torchrun, srun or mpirun
    already made (then the list holds this rank's result only). Nothing is
    created, so nothing needs stopping: an exception of ``fn`` reaches the
    caller unchanged.

    Under torch elastic (``TORCHELASTIC_ERROR_FILE`` set: torchrun, or the
    ``subprocess`` launcher) an exception of ``fn`` is also written to the
    rank's error file, where the launching process reads the traceback.
    Under the ``subprocess`` launcher (``PHALANX_RESULTS_DIR`` set) the
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
        return [_run_here(next(_LAUNCHES), fn, args, kwargs)]


def _run_here(index: int, fn: Callable[..., T], args: Sequence[Any], kwargs: Mapping[str, Any]) -> T:
    """Run ``fn`` in this process, leaving its result and its traceback where
    a launching process looks for them (see :class:`InProcessLauncher`).
    ``index`` numbers this launch among this process's launches; the result
    is left only for the launch the launching process waits for."""
    error_file = os.environ.get(_ERROR_FILE_VAR)
    results_dir = os.environ.get(RESULTS_DIR_VAR)
    if os.environ.get(_LAUNCH_INDEX_VAR, str(index)) != str(index):
        results_dir = None  # another launch of the re-run script
    launcher = os.environ.get(_LAUNCHER_PID_VAR, "")
    if launcher.isdigit() and int(launcher) == os.getppid():  # a rank the subprocess launcher started
        _die_with(int(launcher))
    if not error_file and not results_dir:
        return fn(*args, **kwargs)
    try:
        result = fn(*args, **kwargs)
        if results_dir:
            rank = os.environ.get("RANK", "0")
            path = Path(results_dir, f"{rank}.pkl")
            partial = path.with_name(f"{rank}.{os.getpid()}.partial")
            partial.write_bytes(_dumps_result(result, rank))
            partial.replace(path)  # whole or not at all
    except Exception as exc:
        if error_file:
            from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

            ErrorHandler().record_exception(exc)
        raise
    return result


def _dumps_result(result: Any, rank: object) -> bytes:
    try:
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise MisconfigurationError(
            f"rank {rank}: the value fn returned ({type(result).__qualname__}) cannot be pickled to "
            f"carry it back to the launching process ({type(exc).__name__}: {exc}). Return picklable "
            "values (numbers, tensors, dicts of them), or save it to a file and return the path"
        ) from exc


# -- failures, shared by the launchers that create processes ---------------------------


@dataclass(frozen=True)
class _Failure:
    rank: int
    exitcode: int | None
    traceback: str | None
    when: float  # seconds since the epoch: when it failed, as near as can be told

    @property
    def signal(self) -> str | None:
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return f"signal {-self.exitcode}"

    def order(self) -> tuple[int, float, int]:
        """Which failure came first. A rank killed by a signal other than
        SIGTERM (SIGKILL from the OOM killer, SIGSEGV) is a cause, never a
        consequence; a rank that raised may have raised because a peer died;
        SIGTERM is how ranks are stopped after another failed."""
        if self.exitcode == -signal.SIGTERM:
            kind = 2
        elif self.signal is not None:
            kind = 0
        else:
            kind = 1
        return kind, self.when, self.rank


def _worker_failed(
    launcher: str, first: _Failure, world_size: int, stopped: str = "Every other rank was stopped"
) -> WorkerFailedError:
    """WorkerFailedError in four parts: what failed, which rank and how, its
    traceback, what to do."""
    if first.signal is not None:
        how = f"killed by {first.signal} (exit code {first.exitcode})"
    elif first.exitcode is None:
        how = "with an exit code that could not be read"
    else:
        how = f"with exit code {first.exitcode}"
    who = f"rank {first.rank} of {world_size} (launcher {launcher!r})"
    lines = [f"the launched job failed: {who} failed first, {how}."]
    if first.traceback:
        tb = first.traceback.rstrip().splitlines()
        cut = len(tb) > _EXCERPT_LINES
        lines.append(
            f"Its traceback{' (last lines; all of it is in .traceback)' if cut else ''}:\n"
            + textwrap.indent("\n".join(tb[-_EXCERPT_LINES:]), "    ")
        )
        todo = f"Fix the error rank {first.rank} raised, shown above"
    elif first.exitcode == -signal.SIGKILL:
        todo = (
            "It had no chance to write a traceback: SIGKILL usually comes from the out-of-memory "
            "killer or a scheduler; check the memory use and the system log (dmesg)"
        )
    elif first.signal is not None:
        todo = (
            "It left no Python traceback: a crash in native code; its output above may say more, "
            "and `python -X faulthandler` prints the Python stack of such a crash"
        )
    else:
        todo = (
            "It left no Python traceback: it exited without raising (sys.exit, os._exit, or a crash "
            "in native code) or before it could run fn; its own output above may say why"
        )
    lines.append(f"{stopped}. {todo}.")
    return WorkerFailedError(
        "\n".join(lines),
        rank=first.rank,
        exitcode=first.exitcode,
        signal=first.signal,
        traceback=first.traceback,
    )


def _check_count(launcher: str, name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MisconfigurationError(f"launcher {launcher!r}: {name}={value!r}; expected an int of at least 1")


def _die_with(parent: int) -> None:
    """On Linux, have the kernel kill this rank when ``parent``, the process
    that launched it, dies (even by SIGKILL, when it can stop no one)."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before that took effect
            os._exit(1)


def _signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group a rank leads (the rank and what it
    started), or to the rank alone if it has not made its group yet."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


# -- spawn and fork ---------------------------------------------------------------------


def _start_methods() -> list[str]:
    import multiprocessing

    return list(multiprocessing.get_all_start_methods())


def _refuse_fork_after_cuda() -> None:
    torch = sys.modules.get("torch")  # not imported: CUDA cannot be initialised
    if torch is not None and torch.cuda.is_initialized():
        raise MisconfigurationError(
            "launcher 'fork' cannot fork this process: CUDA is already initialised in it "
            "(torch.cuda.is_initialized() is True), and a forked child cannot use CUDA. Use the "
            "'spawn' launcher (strategy 'ddp_spawn'), or move every CUDA call (torch.cuda.*, "
            ".cuda(), tensors on a GPU) after strategy.launch(...)"
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
            raise MisconfigurationError(
                f"launcher start_method={start_method!r}: not a start method of this platform; it has "
                f"{', '.join(methods)}. Use launcher='spawn' or launcher='fork'"
            )
        self.start_method = start_method
        _check_count(start_method, "num_processes", num_processes)
        if num_nodes != 1:
            raise MisconfigurationError(
                f"launcher {start_method!r} starts processes on this machine only, but num_nodes="
                f"{num_nodes} was asked for; use launcher='subprocess' (strategy 'ddp') started on "
                "every node, or a scheduler (torchrun, srun) that starts the processes"
            )
        if start_method == "fork":
            _refuse_fork_after_cuda()
        # Per instance: "fork" works in a notebook, "spawn" does not.
        self.is_interactive_compatible = start_method == "fork"  # type: ignore[misc]

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        import torch.distributed as dist
        import torch.multiprocessing as mp

        next(_LAUNCHES)
        if self.start_method == "fork":
            _refuse_fork_after_cuda()
        ctx: Any = mp.get_context(self.start_method)
        size = self.num_processes
        # Kept alive until every rank has finished: the ranks' rendezvous.
        # (torch.distributed re-exports TCPStore without listing it)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
        common = {
            "WORLD_SIZE": str(size),
            "LOCAL_WORLD_SIZE": str(size),
            "NODE_RANK": "0",
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        try:
            for rank in range(size):
                env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                reader, writer = ctx.Pipe(duplex=False)
                conns.append(reader)
                proc = ctx.Process(
                    target=_mp_rank,
                    args=(env, os.getpid(), writer, fn, args, kwargs),
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
            results, failures = _collect(procs, conns)
            if failures:
                _stop(procs, spare={f.rank for f in failures})
                first = min(failures, key=_Failure.order)
                first = _Failure(first.rank, procs[first.rank].exitcode, first.traceback, first.when)
                raise _worker_failed(self.start_method, first, size)
            return [results[rank] for rank in range(size)]
        finally:
            _stop(procs)
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
) -> None:
    """A rank of a spawn/fork launch: report fn's result, or its traceback,
    to the launching process through ``conn``."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # its own group: stopping it stops what it starts
    _die_with(parent)
    os.environ.update(env)
    try:
        payload = _dumps_result(("result", fn(*args, **kwargs)), env["RANK"])
    except BaseException as exc:
        with contextlib.suppress(Exception):
            tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # from fn's frame on
            text = "".join(traceback.format_exception(type(exc), exc, tb))
            conn.send_bytes(pickle.dumps(("error", text, time.time())))
        conn.close()
        raise  # multiprocessing prints it to this rank's stderr and exits with 1
    conn.send_bytes(payload)
    conn.close()


def _collect(
    procs: Sequence[BaseProcess], conns: Sequence[Connection]
) -> tuple[dict[int, Any], list[_Failure]]:
    """Wait for every rank's result, or until ranks fail; return the results
    and the failures seen first (possibly several at once)."""
    from multiprocessing.connection import wait

    results: dict[int, Any] = {}
    failures: list[_Failure] = []
    reported: set[int] = set()
    open_conns = {conn: rank for rank, conn in enumerate(conns)}
    running = {proc.sentinel: rank for rank, proc in enumerate(procs)}

    def receive(rank: int, conn: Connection) -> None:
        del open_conns[conn]
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # closed without a word: it died; its exit code tells how
        except Exception as exc:  # noqa: BLE001 - a result this process cannot unpickle: that rank failed
            message = ("error", f"its result could not be unpickled here: {type(exc).__name__}: {exc}", 0.0)
        reported.add(rank)
        if message[0] == "result":
            results[rank] = message[1]
        else:
            failures.append(_Failure(rank, None, message[1], message[2] or time.time()))

    while running and not failures:
        ready = wait([*open_conns, *running])
        for conn in conns:
            if conn in ready and conn in open_conns:
                receive(open_conns[conn], conn)
        for sentinel, rank in list(running.items()):
            if sentinel not in ready:
                continue
            del running[sentinel]
            procs[rank].join()
            if conns[rank] in open_conns and conns[rank].poll():  # what it sent just before it exited
                receive(rank, conns[rank])
            code = procs[rank].exitcode
            if rank not in reported or (code != 0 and rank in results):  # died, or died after returning
                failures.append(_Failure(rank, code, None, time.time()))
    return results, failures


def _stop(procs: Sequence[BaseProcess], spare: set[int] | frozenset[int] = frozenset()) -> None:
    """Stop every rank still running (SIGTERM to its group, SIGKILL after
    :data:`STOP_GRACE` seconds) and whatever its group still holds. Ranks in
    ``spare`` are exiting on their own: they get the grace but no SIGTERM."""
    for rank, proc in enumerate(procs):
        if rank not in spare and proc.is_alive():
            _signal_group(proc.pid, signal.SIGTERM)  # type: ignore[arg-type]
    deadline = time.monotonic() + STOP_GRACE
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            _signal_group(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        proc.join(STOP_GRACE)  # bounded: a process stuck in the kernel cannot even be killed
        # What the rank started and left in its group (a worker of its own).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]


# -- subprocess (script mode, torch elastic) ---------------------------------------------------


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
    leaves its value in a temporary folder (``PHALANX_RESULTS_DIR``), and
    ``launch`` returns a list of ``world_size`` values indexed by global
    rank. On several nodes each node's launching process has only its own
    node's values: the entries of the other nodes' ranks are ``None``.

    Options:
        node_rank: this node's rank; default the environment's
            ``node_rank`` (``NODE_RANK``), else 0.
        max_restarts: how many times elastic restarts the ranks of this node
            after a failure before ``launch`` raises (default 0).
        monitor_interval: seconds between elastic's checks of the ranks.
        rendezvous_timeout: seconds to wait for every node to join.

    One node (like ``torchrun --standalone``): a rendezvous of this module
    that gives every round, the first and each restart, a new TCPStore on
    ``127.0.0.1`` on a port the kernel gives; the agent keeps it and the
    ranks join it as clients. Several nodes: elastic's static rendezvous at
    the environment's ``main_address``/``main_port`` (``MASTER_ADDR`` /
    ``MASTER_PORT``), which node 0 hosts; start the same script on every
    node with its ``NODE_RANK``. A failure stops this node's ranks; the
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
        monitor_interval: float = 0.1,
        rendezvous_timeout: float = 900.0,
    ) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        _check_count("subprocess", "num_processes", num_processes)
        _check_count("subprocess", "num_nodes", num_nodes)
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
        if max_restarts and num_nodes > 1:
            raise MisconfigurationError(
                f"launcher 'subprocess': max_restarts={max_restarts} with num_nodes={num_nodes}: a "
                "restart would start this node's ranks again while the other nodes' ranks go on, "
                "in a world that no longer exists; restart whole jobs with the scheduler instead "
                "(max_restarts=0), or use max_restarts on one node"
            )
        for name, value in (
            ("monitor_interval", monitor_interval),
            ("rendezvous_timeout", rendezvous_timeout),
        ):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise MisconfigurationError(
                    f"launcher 'subprocess': {name}={value!r}; expected a number of seconds above 0"
                )
        self.node_rank = node_rank
        self.max_restarts = max_restarts
        self.monitor_interval = float(monitor_interval)
        self.rendezvous_timeout = float(rendezvous_timeout)

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_nodes

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        index = next(_LAUNCHES)
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            # This is a rank already (the script re-run, or torchrun): run here.
            return [_run_here(index, fn, args, kwargs)]
        command = _script_command()
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

        with tempfile.TemporaryDirectory(prefix="phalanx-launch-") as tmp:
            results = Path(tmp, "results")
            results.mkdir()
            config = LaunchConfig(
                min_nodes=self.num_nodes,
                max_nodes=self.num_nodes,
                nproc_per_node=self.num_processes,
                role="phalanx",
                max_restarts=self.max_restarts,
                monitor_interval=self.monitor_interval,
                start_method="spawn",
                logs_specs=DefaultLogsSpecs(log_dir=str(Path(tmp, "logs"))),
                shutdown_timeout=STOP_GRACE,
                **self._rendezvous(),
            )
            variables = {
                RESULTS_DIR_VAR: str(results),
                _LAUNCH_INDEX_VAR: str(index),
                _LAUNCHER_PID_VAR: str(os.getpid()),
                "NODE_RANK": str(self.node_rank),
            }
            with _variables(variables), _signal_handlers_kept():
                try:
                    elastic_launch(config, sys.executable)(*command)
                except ChildFailedError as exc:
                    raise _from_child_failed(exc, self.world_size, self.num_nodes) from exc
                except SignalException as exc:
                    if exc.sigval == signal.SIGINT:
                        raise KeyboardInterrupt from exc
                    raise
            return self._results(results, index)

    def _rendezvous(self) -> dict[str, Any]:
        timeout = int(self.rendezvous_timeout)
        if self.num_nodes == 1:
            return {
                "run_id": f"phalanx-{uuid.uuid4().hex}",
                "rdzv_backend": _register_one_node_rendezvous(),
                "rdzv_configs": {"timeout": timeout},
                "local_addr": "127.0.0.1",
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
            "rdzv_backend": "static",
            "rdzv_endpoint": f"{address}:{port}",
            "rdzv_configs": {"rank": self.node_rank, "timeout": timeout},
        }

    def _results(self, folder: Path, index: int) -> list[Any]:
        values: list[Any] = [None] * self.world_size
        first = self.node_rank * self.num_processes
        for rank in range(first, first + self.num_processes):
            path = folder / f"{rank}.pkl"
            if not path.exists():
                raise WorkerFailedError(
                    f"rank {rank} of {self.world_size} (launcher 'subprocess') exited with code 0 "
                    f"but left no result for this launch (the script's launch number {index}): the "
                    "re-run script made fewer launches in the rank than here. Make the script call "
                    "launch the same way on every rank, once (not only under `if RANK == 0`)",
                    rank=rank,
                    exitcode=0,
                )
            values[rank] = pickle.loads(path.read_bytes())
        return values


_ONE_NODE = "phalanx-one-node"


def _register_one_node_rendezvous() -> str:
    """Register (once) elastic's rendezvous for one node and return its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(_ONE_NODE, _create_one_node_rendezvous)
    return _ONE_NODE


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
            self._store = dist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=self._timeout
            )
            self._round += 1
            prefixed = dist.PrefixStore(f"{self._run_id}/{self._round}", self._store)  # type: ignore[attr-defined]
            return RendezvousInfo(prefixed, 0, 1, RendezvousStoreInfo("127.0.0.1", self._store.port))

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
    return [*_interpreter_options(len(target)), *target, *sys.argv[1:]]


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


def _from_child_failed(exc: Any, world_size: int, num_nodes: int) -> WorkerFailedError:
    """Elastic's ChildFailedError as WorkerFailedError, for the rank that
    failed first (elastic orders by whole seconds; the error file's time of
    writing, where there is one, is finer)."""
    failures = []
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
        failures.append(_Failure(int(rank), failure.exitcode, traceback_text, when))
    stopped = "Every other rank was stopped"
    if num_nodes > 1:
        stopped = (
            "Every other rank of this node was stopped; the other nodes' ranks stop when their "
            "collectives fail or time out"
        )
    return _worker_failed("subprocess", min(failures, key=_Failure.order), world_size, stopped)
