"""The ``horovod`` launcher: ranks started by ``horovod.runner.run`` (the
Gloo controller, no MPI), ``fn`` run in each. Imports horovod and torch only
when it launches."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError, WorkerFailedError
from phalanx_core.launching import (
    LINES_PREFIXED_VAR,
    LOOPBACK,
    RANK_LINE,
    RankFailure,
    check_count,
    exit_process,
    failure_text,
    hosted_store,
    last_tracebacks,
    listen_variables,
    rank_variables,
    relay_output,
    run_program,
    script_store,
    signal_name,
    worker_failed,
    write_whole,
)
from phalanx_core.network import interface_of

from ._hvd import PEER_LOST
from .environment import HorovodEnvironment

if TYPE_CHECKING:
    from phalanx_core import ClusterEnvironment

__all__ = ["HorovodLauncher"]

T = TypeVar("T")

#: Horovod's own summary of the first process that exited non-zero (its
#: rank, here, where every rank is on this machine).
_HOROVOD_FIRST = re.compile(r"Process name:\s*(\d+)\s*Exit code:\s*(-?\d+)")
#: The tag horovodrun puts before a rank's output: ``[1]<stderr>:``.
_TAG = re.compile(r"\[(\d+)\]<(?:stdout|stderr)>:")
#: The last lines of horovodrun's stderr kept to find the failures in.
_KEPT_LINES = 5000
#: What happens to the other ranks when one fails, for the error's message.
_STOPPED = "Horovod stopped every other rank"


class HorovodLauncher(Launcher):
    """Starts ``num_processes`` ranks on this machine through
    ``horovod.runner.run`` (what ``horovodrun --gloo`` runs) and runs ``fn``
    in each; returns every rank's result, indexed by rank.

    ``fn``, its arguments and its result travel with cloudpickle, as
    ``horovod.run`` sends them, so ``fn`` may be defined in a notebook or in
    ``__main__``: the launcher works interactively, and no main guard is
    needed. Each rank also gets the rank protocol of phalanx's launchers
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so the ``local``
    environment reads its rank there and a torch process group can be made
    beside Horovod's (``resolve("ddp", collective="horovod",
    launcher="horovod")``).

    Under ``horovodrun`` (the ``horovod`` environment) the processes exist
    already: the launcher runs ``fn`` in this one and returns ``[result]``,
    as ``in_process`` does.

    **Failures.** Horovod stops every rank when one exits non-zero (SIGTERM,
    then SIGKILL after 5 s). Each rank leaves the traceback of an exception
    of ``fn`` in a folder of the launch; the caller gets
    :class:`~phalanx_core.WorkerFailedError` built by
    :func:`phalanx_core.launching.worker_failed`, with every failure seen
    (each traceback, and the rank Horovod saw exit first, with its exit
    code: 137, a shell's report of SIGKILL, becomes -9) and the root cause
    chosen by the launchers' one rule; errors a peer's failure causes ("Horovod
    has been shut down", a lost connection) are never taken for it.

    **Listening.** Everything of a launch listens on 127.0.0.1 only: the
    store of the rank protocol, Horovod's HTTP servers in this process (see
    :mod:`phalanx_horovod._loopback`), Horovod's gloo (its network interface
    is the loopback one) and a torch gloo group beside it
    (``GLOO_SOCKET_IFNAME``, unless you set it). A script run as every
    rank's program (``phalanx run``) meets at a store this process hosts on
    127.0.0.1 too (:func:`~phalanx_core.launching.script_store`). Horovod 0.28 itself keeps the
    gloo of a job on this host to the interface that has 127.0.0.1 (it
    refuses another in ``network_interfaces``, and sets
    ``HOROVOD_GLOO_IFACE`` in the ranks, over yours).

    Options:
        start_timeout: seconds Horovod waits for the ranks to start (30).
        verbose: Horovod's launcher log (``0``, ``1``, ``2``).

    One node only: for several nodes start the script with ``horovodrun
    -H host1:N,host2:N`` and let the ranks run in place.
    """

    is_interactive_compatible: ClassVar[bool] = True

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        if num_nodes != 1:  # only in the ranks horovodrun started, where it runs in place
            return "nothing that phalanx opens; horovodrun's ranks listen where horovodrun and torch put them"
        return (
            "127.0.0.1 only: the launcher's rendezvous store, Horovod's HTTP servers and gloo, every "
            "rank's torch gloo"
        )

    def __init__(
        self,
        *,
        environment: ClusterEnvironment | None = None,
        num_processes: int = 1,
        num_nodes: int = 1,
        start_timeout: int = 30,
        verbose: int = 0,
    ) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        check_count("horovod", "num_processes", num_processes)
        self._in_place = isinstance(environment, HorovodEnvironment)
        if num_nodes != 1 and not self._in_place:
            raise MisconfigurationError(
                f"launcher 'horovod' starts ranks on this machine only, but num_nodes={num_nodes} was "
                "asked for; start the script on every node with `horovodrun -np N -H host1:n,host2:n "
                "python script.py` (the ranks then run in place)"
            )
        if isinstance(start_timeout, bool) or not isinstance(start_timeout, int) or start_timeout < 1:
            raise MisconfigurationError(
                f"launcher 'horovod': start_timeout={start_timeout!r}; give whole seconds (at least 1)"
            )
        self.start_timeout = start_timeout
        self.verbose = verbose

    @classmethod
    def runs_in_existing_processes(cls, environment: type[ClusterEnvironment]) -> bool:
        """Yes under ``horovodrun``: ``fn`` runs in the ranks it started."""
        return issubclass(environment, HorovodEnvironment)

    def runs_in_place(self) -> bool:
        """In a rank horovodrun (or this launcher) started."""
        return bool(self._in_place)

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        if self._in_place:
            return self.placed(fn(*args, **kwargs))  # type: ignore[return-value]
        import horovod.runner  # type: ignore[import-not-found, import-untyped, unused-ignore]

        from ._loopback import servers_on_loopback

        size = self.num_processes
        interface = _loopback_interface()
        # The rendezvous of a torch group made beside Horovod's, hosted here
        # for the whole launch (see phalanx-torch's rank protocol).
        store = hosted_store(LOOPBACK, wait_for_workers=False)
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        with tempfile.TemporaryDirectory(prefix="phalanx-horovod-") as box:
            try:
                with servers_on_loopback():
                    results = horovod.runner.run(
                        _rank,
                        args=(box, (LOOPBACK, store.port), listen_variables(LOOPBACK), fn, args, kwargs),
                        num_proc=size,
                        hosts=f"localhost:{size}",
                        use_gloo=True,
                        start_timeout=self.start_timeout,
                        disable_cache=True,
                        verbose=self.verbose,
                        network_interfaces=[interface] if interface else None,
                    )
            except Exception as exc:  # noqa: BLE001 - horovod.run raises RuntimeError and others
                raise _failure(Path(box), size, exc) from None
            finally:
                # horovod.run leaves its own SIGINT/SIGTERM handlers in this process.
                for sig, handler in handlers.items():
                    with contextlib.suppress(TypeError, ValueError):
                        signal.signal(sig, handler)
                del store
        return list(results)

    def run_script(self, command: Sequence[str]) -> None:
        """Run a Python program as every rank's main program (``phalanx
        run``): ``horovodrun --gloo -np N`` starts ``python *command`` on
        this machine (``python -m phalanx_core.launching.rank_program``), each
        line a rank writes marked ``[rankN]: `` (from Horovod's tags);
        under horovodrun the program runs in this
        process. A failing rank stops the others and raises
        :class:`~phalanx_core.WorkerFailedError` for the rank that failed
        first by the launchers' one rule, from the tracebacks in the ranks'
        output and the rank Horovod saw exit first."""
        command = list(command)
        if self._in_place:
            run_program(command)
            return
        size = self.num_processes
        interface = _loopback_interface()
        # horovodrun, with its HTTP servers on loopback (phalanx_horovod._loopback).
        horovodrun = [sys.executable, "-m", "phalanx_horovod._loopback", "--gloo", "-np", str(size)]
        horovodrun += ["-H", f"localhost:{size}", "--disable-cache"]
        horovodrun += ["--start-timeout", str(self.start_timeout)]
        if interface:
            horovodrun += ["--network-interfaces", interface]
        if self.verbose:
            horovodrun.append("--verbose")
        said: collections.deque[tuple[float, str]] = collections.deque(maxlen=_KEPT_LINES)
        program = [sys.executable, "-u", "-m", "phalanx_core.launching.rank_program", *command]
        with script_store() as store_variables:
            env = {**os.environ, **listen_variables(LOOPBACK), **store_variables, LINES_PREFIXED_VAR: "1"}
            with subprocess.Popen(
                [*horovodrun, *program], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            ) as proc:
                # horovodrun's own errors, and the ranks' output as whole lines marked [rankN]:
                readers = [
                    relay_output(proc.stderr, sys.stderr, _TAG, said),  # type: ignore[arg-type]
                    relay_output(proc.stdout, sys.stdout, _TAG),  # type: ignore[arg-type]
                ]
                code = proc.wait()
                for reader in readers:
                    reader.join(timeout=10)
        if code == 0:
            return
        raised = {
            rank: RankFailure(rank, traceback=text, when=when, peer_lost_marks=PEER_LOST)
            for rank, (text, when) in last_tracebacks(said, RANK_LINE).items()
        }
        failures = _with_first_exit(raised, "".join(line for _, line in said))
        if not failures:
            raise WorkerFailedError(
                f"the launched job failed: horovodrun exited with code {code}, and which rank failed is "
                "unknown: no rank's traceback is in its output and Horovod named none (so "
                "WorkerFailedError.rank is -1). Its output above says why",
                rank=-1,
                exitcode=code,
            )
        raise worker_failed("horovod", failures, size, stopped=_STOPPED)


def _loopback_interface() -> str | None:
    """The name of the loopback interface (``lo``), where it can be told."""
    return interface_of(LOOPBACK)


def _rank(
    box: str,
    main: tuple[str, int],
    variables: Mapping[str, str],
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Any,
) -> Any:
    """What every rank runs: the rank protocol's variables (from Horovod's,
    the store at ``main``), ``variables``, then ``fn``; an exception's
    traceback is left in ``box`` for the launching process."""
    env = os.environ
    rank, size = int(env.get("HOROVOD_RANK", "0")), int(env.get("HOROVOD_SIZE", "1"))
    env.update(variables)
    env.update(
        rank_variables(
            rank=rank,
            world_size=size,
            local_rank=int(env.get("HOROVOD_LOCAL_RANK", rank)),
            local_world_size=int(env.get("HOROVOD_LOCAL_SIZE", size)),
            node_rank=int(env.get("HOROVOD_CROSS_RANK", "0")),
            main_address=main[0],
            main_port=main[1],
            agent_store=True,
        )
    )
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            text = failure_text(exc, skip_frames=1)  # from fn's frame on
            write_whole(
                Path(box, f"{rank}.error"), json.dumps({"traceback": text, "time": time.time()}).encode()
            )
        raise
    _deliver_and_leave(str(rank), result)
    return result


def _deliver_and_leave(rank: str, result: Any) -> None:
    """Hand ``result`` to horovod.run's driver as its ``run_task`` would, then
    leave the process without the interpreter's finalization, in which the
    threads of a torch gloo group beside Horovod abort a finished rank
    ("terminate called without an active exception": 1 of 4 runs of the
    horovod strategy tests). Only where this process is horovod.run's task
    (``python -m horovod.runner.run_task ADDR PORT``, horovod 0.28); anywhere
    else, return and let the caller deliver."""
    argv = sys.argv
    if len(argv) != 3 or not argv[0].endswith(os.path.join("horovod", "runner", "run_task.py")):
        return
    try:
        from horovod.runner.http.http_client import (  # type: ignore[import-not-found, import-untyped, unused-ignore]
            put_data_into_kvstore,
        )

        port = int(argv[2])
    except (ImportError, ValueError):
        return
    put_data_into_kvstore(argv[1], port, "runfunc_result", rank, result)
    exit_process(0)


def _exit_code(code: int) -> int:
    """Horovod's exit code for a rank, with a shell's report of a signal
    (128 + N: Horovod starts each rank through ``sh -c``) as a signal's
    (-N)."""
    return (
        -(code - 128) if code > 128 and signal_name(code, shell=True) in signal.Signals.__members__ else code
    )


def _with_first_exit(raised: dict[int, RankFailure], said: str) -> list[RankFailure]:
    """The failures: ``raised`` (the ranks' tracebacks), with the exit code
    of the rank Horovod names in ``said`` as the first to exit non-zero
    (seen now, where it left no traceback)."""
    failures = dict(raised)
    found = _HOROVOD_FIRST.search(said)
    if found is not None:
        rank, code = int(found.group(1)), _exit_code(int(found.group(2)))
        known = failures.get(rank)
        failures[rank] = RankFailure(
            rank,
            exitcode=code,
            traceback=known.traceback if known else None,
            when=known.when if known else time.time(),
            peer_lost_marks=PEER_LOST,
        )
    return list(failures.values())


def _failure(box: Path, size: int, exc: Exception) -> Exception:
    """The WorkerFailedError for a launch that ``horovod.run`` ended with
    ``exc``; ``exc`` itself when no rank failed (Horovod could not start)."""
    raised = {}
    for path in box.glob("*.error"):
        with contextlib.suppress(Exception):
            data = json.loads(path.read_text())
            rank = int(path.stem)
            # An exception leaves fn and horovod's run_task: Python exits with 1.
            raised[rank] = RankFailure(
                rank, exitcode=1, traceback=data["traceback"], when=data["time"], peer_lost_marks=PEER_LOST
            )
    failures = _with_first_exit(raised, str(exc))
    if not failures:
        return exc  # no rank ran: Horovod's own error (no start, bad hosts) says why
    return worker_failed("horovod", failures, size, stopped=_STOPPED)
