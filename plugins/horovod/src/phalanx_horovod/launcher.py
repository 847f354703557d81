"""The ``horovod`` launcher: ranks started by ``horovod.runner.run`` (the
Gloo controller, no MPI), ``fn`` run in each. Imports horovod and torch only
when it launches."""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError, WorkerFailedError

from ._hvd import PEER_LOST
from .environment import HorovodEnvironment

if TYPE_CHECKING:
    from phalanx_core import ClusterEnvironment

__all__ = ["HorovodLauncher"]

T = TypeVar("T")

#: Lines of a rank's traceback quoted in the error (all of it is in ``.traceback``).
_EXCERPT_LINES = 30
#: A rank's stderr line as horovodrun marks it, ending a traceback:
#: ``[1]<stderr>:ValueError: ...``.
_RANK_ERROR = re.compile(r"^\[(\d+)\]<stderr>:([A-Za-z_][\w.]*(?:Error|Exception|Interrupt)\b.*)$")
#: Horovod's own summary of the first process that exited non-zero.
_HOROVOD_FIRST = re.compile(r"Process name:\s*(\d+)\s*Exit code:\s*(-?\d+)")


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
    :class:`~phalanx_core.WorkerFailedError` naming the first rank that
    failed: one that raised anything but the "Horovod has been shut down"
    error its peers get when a rank leaves, else the first that exited
    without a traceback (killed), with Horovod's exit code for it.

    Options:
        start_timeout: seconds Horovod waits for the ranks to start (30).
        verbose: Horovod's launcher log (``0``, ``1``, ``2``).

    One node only: for several nodes start the script with ``horovodrun
    -H host1:N,host2:N`` and let the ranks run in place.
    """

    is_interactive_compatible: ClassVar[bool] = True

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
        if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
            raise MisconfigurationError(
                f"launcher 'horovod': num_processes={num_processes!r}; expected an int of at least 1"
            )
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
        import torch.distributed as dist

        size = self.num_processes
        # The rendezvous of a torch group made beside Horovod's, hosted here
        # for the whole launch (see phalanx-torch's rank protocol).
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined, unused-ignore]
        protocol = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        with tempfile.TemporaryDirectory(prefix="phalanx-horovod-") as box:
            try:
                results = horovod.runner.run(
                    _rank,
                    args=(box, protocol, fn, args, kwargs),
                    num_proc=size,
                    hosts=f"localhost:{size}",
                    use_gloo=True,
                    start_timeout=self.start_timeout,
                    disable_cache=True,
                    verbose=self.verbose,
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
        this machine, and Horovod prefixes each output line with its rank
        (``[0]<stdout>:``); under horovodrun the program runs in this
        process. A failing rank stops the others and raises
        :class:`~phalanx_core.WorkerFailedError` naming the rank Horovod
        saw exit first, with its exit code (its traceback is in its output,
        marked with its rank)."""
        command = list(command)
        if self._in_place:
            _run_program(command)
            return
        size = self.num_processes
        horovodrun = [sys.executable, "-m", "horovod.runner.launch", "--gloo", "-np", str(size)]
        horovodrun += ["-H", f"localhost:{size}", "--disable-cache"]
        horovodrun += ["--start-timeout", str(self.start_timeout)]
        if self.verbose:
            horovodrun.append("--verbose")
        with subprocess.Popen(
            [*horovodrun, sys.executable, "-u", *command], stderr=subprocess.PIPE, text=True
        ) as proc:
            said: list[str] = []
            raised: dict[int, str] = {}  # each rank's last exception line
            for line in proc.stderr or ():  # horovodrun's own errors, and the ranks' stderr
                sys.stderr.write(line)
                said.append(line)
                del said[:-50]
                marked = _RANK_ERROR.match(line)
                if marked:
                    raised[int(marked.group(1))] = marked.group(2)
            code = proc.wait()
        if code == 0:
            return
        found = _HOROVOD_FIRST.search("".join(said))
        rank, exitcode = (int(found.group(1)), int(found.group(2))) if found else (0, None)
        # Horovod names the first process to exit, which may be a peer that
        # lost its connection to the rank that raised (seen under load):
        # name a rank whose own exception is the cause instead.
        causes = sorted(r for r, text in raised.items() if not any(m in text for m in PEER_LOST))
        if causes and rank not in causes:
            rank, exitcode = causes[0], 1  # an uncaught exception: Python exits with 1
        raise _worker_failed(_Failed(rank, None, 0.0), exitcode, size, where="its output above")


def _rank(
    box: str, protocol: Mapping[str, str], fn: Callable[..., Any], args: Sequence[Any], kwargs: Any
) -> Any:
    """What every rank runs: the rank protocol's variables, then ``fn``; an
    exception's traceback is left in ``box`` for the launching process."""
    env = os.environ
    rank = env.get("HOROVOD_RANK", "0")
    env.update(
        {
            **protocol,
            "RANK": rank,
            "WORLD_SIZE": env.get("HOROVOD_SIZE", "1"),
            "LOCAL_RANK": env.get("HOROVOD_LOCAL_RANK", rank),
            "LOCAL_WORLD_SIZE": env.get("HOROVOD_LOCAL_SIZE", env.get("HOROVOD_SIZE", "1")),
            "NODE_RANK": env.get("HOROVOD_CROSS_RANK", "0"),
            "GROUP_RANK": env.get("HOROVOD_CROSS_RANK", "0"),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # from fn's frame on
            text = "".join(traceback.format_exception(type(exc), exc, tb))
            path = Path(box, f"{rank}.error")
            partial = path.with_suffix(".partial")
            partial.write_bytes(pickle.dumps((text, time.time())))
            partial.replace(path)
        raise
    _deliver_and_leave(rank, result)
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
    from phalanx_core._process import exit_process

    exit_process(0)


@dataclass(frozen=True)
class _Failed:
    rank: int
    traceback: str | None
    when: float
    exitcode: int | None = None

    @property
    def lost_a_peer(self) -> bool:
        last = (self.traceback or "").strip().splitlines()[-1:]
        return bool(last) and any(mark in last[0] for mark in PEER_LOST)


def _failure(box: Path, size: int, exc: Exception) -> Exception:
    """The WorkerFailedError for a launch that ``horovod.run`` ended with
    ``exc``; ``exc`` itself when no rank failed (Horovod could not start)."""
    raised = []
    for path in box.glob("*.error"):
        with contextlib.suppress(Exception):
            text, when = pickle.loads(path.read_bytes())
            raised.append(_Failed(int(path.stem), text, when))
    found = _HOROVOD_FIRST.search(str(exc))
    first_exit = (int(found.group(1)), int(found.group(2))) if found else None
    causes = sorted((f for f in raised if not f.lost_a_peer), key=lambda f: f.when)
    if causes:
        first = causes[0]
    elif first_exit is not None and first_exit[0] not in {f.rank for f in raised}:
        first = _Failed(first_exit[0], None, 0.0)  # it left no traceback: killed, or exited
    elif raised:
        first = min(raised, key=lambda f: f.when)
    elif first_exit is not None:
        first = _Failed(first_exit[0], None, 0.0)
    else:
        return exc  # no rank ran: Horovod's own error (no start, bad hosts) says why
    code = first_exit[1] if first_exit is not None and first_exit[0] == first.rank else None
    if code is None and first.traceback:
        code = 1
    return _worker_failed(first, code, size)


def _signal_of(code: int | None) -> str | None:
    """A signal's name from an exit code: ``-9``, or ``137`` (128 + 9) as the
    shell through which Horovod starts each rank reports a rank killed by
    SIGKILL."""
    if code is None or code == 0:
        return None
    number = -code if code < 0 else code - 128 if code > 128 else 0
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return None


def _worker_failed(
    first: _Failed,
    exitcode: int | None,
    size: int,
    where: str = "its own output above, prefixed with its rank",
) -> WorkerFailedError:
    sig = _signal_of(exitcode)
    if sig is not None:
        how = f"killed by {sig} (exit code {exitcode})"
    elif exitcode is None:
        how = "with an exit code Horovod did not report"
    else:
        how = f"with exit code {exitcode}"
    lines = [
        f"the launched job failed: rank {first.rank} of {size} (launcher 'horovod') failed first, {how}."
    ]
    if first.traceback:
        tb = first.traceback.rstrip().splitlines()
        cut = len(tb) > _EXCERPT_LINES
        lines.append(
            f"Its traceback{' (last lines; all of it is in .traceback)' if cut else ''}:\n"
            + "\n".join(f"    {line}" for line in tb[-_EXCERPT_LINES:])
        )
        todo = f"Fix the error rank {first.rank} raised, shown above"
    elif sig == "SIGKILL":
        todo = (
            "It had no chance to write a traceback: SIGKILL usually comes from the out-of-memory killer "
            "or a scheduler; check the memory use and the system log (dmesg)"
        )
    else:
        todo = (
            "It left no Python traceback here (killed, a crash in native code, an exit without raising, "
            f"or a program whose traceback is in its output); {where} may say why"
        )
    lines.append(f"Horovod stopped every other rank. {todo}.")
    return WorkerFailedError(
        "\n".join(lines), rank=first.rank, exitcode=exitcode, signal=sig, traceback=first.traceback
    )


def _run_program(command: list[str]) -> None:
    """``python *command`` in this process (a script, or ``-m module``)."""
    import runpy

    saved = sys.argv
    try:
        if command[:1] == ["-m"]:
            if len(command) < 2:
                raise MisconfigurationError("phalanx run -m: name the module to run")
            sys.argv = [command[1], *command[2:]]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(command[0])
            if not os.path.exists(script):
                raise MisconfigurationError(f"phalanx run: no script at {command[0]!r}")
            sys.argv = list(command)
            sys.path.insert(0, os.path.dirname(script))
            runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved
