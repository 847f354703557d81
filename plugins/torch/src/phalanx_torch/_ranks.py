"""What the launchers share: the rank protocol's variables, running fn in a
rank, and turning a failed rank into WorkerFailedError. Imports no torch."""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import signal
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from phalanx_core import MisconfigurationError, WorkerFailedError

if TYPE_CHECKING:
    pass

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


def _run_here(index: int, fn: Callable[..., T], args: Sequence[Any], kwargs: Mapping[str, Any]) -> T:
    """Run ``fn`` in this process, leaving its result and its traceback where
    a launching process looks for them (see :class:`InProcessLauncher`).
    ``index`` numbers this launch among this process's launches; the result
    is left only for the launch the launching process waits for."""
    error_file = os.environ.get(_ERROR_FILE_VAR)
    results_dir = os.environ.get(RESULTS_DIR_VAR)
    wanted = os.environ.get(_LAUNCH_INDEX_VAR, str(index))
    if wanted != str(index):
        raise MisconfigurationError(
            f"launch() number {index} of a script that launcher 'subprocess' (strategy 'ddp', 'fsdp', "
            f"'manual') re-runs in every rank; this rank was started for launch number {wanted}. Every "
            "rank runs the whole script again, so each further launch would run its function again in "
            "every rank of every launch. Call launch once per script (one function for every phase), "
            "or use a launcher that does not re-run the script (strategy 'ddp_spawn')"
        )
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
    #: False for a rank known to have failed before it could run fn (a
    #: spawned process that failed while importing the main script).
    started: bool = True
    #: Where it ran, in a job of several nodes.
    node: int | None = None
    host: str | None = None

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
        SIGTERM is how ranks are stopped after another failed (but a rank
        that raised is a cause even if SIGTERM reached it as it exited). A rank whose
        error says that a peer was lost (a collective that timed out or
        lost its connection) comes after one that raised anything else: a
        rank that raises tears its group down on the way out, so its peers'
        errors can be written before its own."""
        raised = bool(self.traceback) and self.traceback != "<NONE>"
        if raised and not self.lost_a_peer:
            kind = 1  # even if SIGTERM stopped it while it was exiting
        elif self.exitcode == -signal.SIGTERM:
            kind = 3
        elif self.signal is not None:
            kind = 0
        elif self.lost_a_peer:
            kind = 2
        else:
            kind = 1
        return kind, self.when, self.rank

    @property
    def lost_a_peer(self) -> bool:
        """Whether the rank's error is one a peer's failure causes."""
        last = (self.traceback or "").strip().splitlines()[-1:]
        return bool(last) and any(mark in last[0] for mark in _PEER_LOST)


#: The last traceback lines of errors that a peer's failure causes.
_PEER_LOST = (
    "CollectiveTimeoutError",
    "Connection closed by peer",
    "Connection reset by peer",
    "failed to pass monitoredBarrier",
    "DistNetworkError",
)


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
    where = ""
    if first.node is not None:
        where = f" on node {first.node}" + (f" (host {first.host})" if first.host else "")
    who = f"rank {first.rank} of {world_size}{where} (launcher {launcher!r})"
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
    elif not first.started:
        todo = (
            "It failed before it could run fn: a process that launcher 'spawn' starts first imports "
            "your main script again (as __mp_main__) and unpickles fn, and the error that stopped it "
            "is printed above. The usual cause is code that resolves and launches outside "
            '`if __name__ == "__main__":`'
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
        node=first.node,
        host=first.host,
    )


def _warn_died_after_delivery(launcher: str, failure: _Failure, world_size: int) -> None:
    """A rank that handed its result back and then died by a signal while
    exiting: its work is done and its result is good, so the launch
    returns; the death is reported, never hidden. (phalanx's ranks leave
    without the interpreter's finalization, where gloo's threads abort, so
    this is something else: a native library's exit handler, or a kill
    from outside just then.)"""
    import warnings

    warnings.warn(
        f"rank {failure.rank} of {world_size} (launcher {launcher!r}) returned its result, then was "
        f"killed by {failure.signal} while exiting (exit code {failure.exitcode}); the launch returns "
        "every rank's result. If it happens again, run with `python -X faulthandler` to see where",
        RuntimeWarning,
        stacklevel=3,
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


def _refuse_unforkable() -> None:
    """Refuse to fork a process whose children could not train: CUDA is
    initialised in it, or torch's autograd has started its device threads."""
    torch = sys.modules.get("torch")  # not imported: neither can have happened
    if torch is None:
        return
    if torch.cuda.is_initialized():
        raise MisconfigurationError(
            "launcher 'fork' cannot fork this process: CUDA is already initialised in it "
            "(torch.cuda.is_initialized() is True), and a forked child cannot use CUDA. Use the "
            "'spawn' launcher (strategy 'ddp_spawn'), or move every CUDA call (torch.cuda.*, "
            ".cuda(), tensors on a GPU) after strategy.launch(...)"
        )
    if _autograd_device_threads():
        raise MisconfigurationError(
            "launcher 'fork' cannot fork this process: it has run a backward pass on a machine with "
            "a GPU, so torch's autograd has started threads, and a forked child's backward fails "
            "(torch: 'Unable to handle autograd's threading in combination with fork-based "
            "multiprocessing'). Use the 'spawn' launcher (strategy 'ddp_spawn'), or run every "
            "backward pass inside the launched function"
        )


def _autograd_device_threads() -> bool:
    """Whether torch's autograd engine has started its per-device threads in
    this process (named ``pt_autograd_N``). It does at the first backward
    pass on a machine with a non-CPU device, and from then on a forked
    child's backward raises. Where threads cannot be listed (no ``/proc``),
    False."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().startswith("pt_autograd_"):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False
