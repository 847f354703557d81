"""The ``xla`` launcher: torch_xla's replicas, in a process this launcher owns.

**How replicas come to exist.** ``launch`` pickles ``fn`` and its arguments
to a temporary folder and starts one process (multiprocessing, start method
``spawn``, in a session of its own). That process starts the XLA runtime
and runs the replicas the way ``torch_xla.launch`` does:

- one replica (``devices=1``): ``torch_xla.launch(..., debug_single_process=True)``;
- one process per host holding every device (the CPU runtime, CUDA):
  what ``torch_xla.launch`` runs in the one process its pool starts,
  ``torch_xla._internal.pjrt._run_thread_per_device``, with torch_xla's own
  initializer: one thread per device. Run directly, without torch_xla's
  process pool, so that the process holding the replicas is this
  launcher's own child, whose exit code and signal it sees;
- several processes per host (TPU VMs): ``torch_xla.launch(...)`` itself.

So the launching process never starts the XLA runtime (torch_xla refuses
to launch from a process that did), and can launch again.

**Results** come back as pickles in the folder, one per replica; ``launch``
returns them by global rank.

**Failures.** A replica that raises writes its traceback to the folder and
ends the process at once (``os._exit``): the replicas are threads, and a
thread waiting in an XLA collective for the failed one cannot be stopped in
any other way. ``launch`` then raises
:class:`~phalanx_core.WorkerFailedError` naming that replica and carrying
its traceback. A process killed by a signal stops every replica it holds at
the same instant; the error then names the process's first rank, the
signal, and every rank that stopped with it. If the launching process is
interrupted (Ctrl-C, a test's time limit), the replicas' session is killed
before the exception goes on. On Linux the replicas' process also dies with
the launching process.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import pickle
import shutil
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError, WorkerFailedError

from . import _runtime

if TYPE_CHECKING:
    from phalanx_core import ClusterEnvironment

__all__ = ["STOP_GRACE", "XLALauncher"]

T = TypeVar("T")

#: Seconds between SIGTERM and SIGKILL when the replicas are stopped.
STOP_GRACE = 3.0
_POLL = 0.05
_FIRST_FAILURE = "first-failure"


class XLALauncher(Launcher):
    """Runs ``fn`` once per XLA replica (see the module's docstring) and
    returns every replica's result, indexed by global rank. ``fn``, its
    arguments and its result must be picklable, and ``fn`` importable by
    name (as for ``spawn``).

    One host: ``num_nodes`` is 1 (a TPU pod runs the script on every host
    with torch_xla's own tooling). ``num_processes`` is the number of
    replicas, one per device: 1, or every device of the host.
    """

    is_interactive_compatible: ClassVar[bool] = False

    def __init__(
        self,
        *,
        environment: ClusterEnvironment | None = None,
        num_processes: int = 1,
        num_nodes: int = 1,
    ) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        if num_nodes != 1:
            raise MisconfigurationError(
                f"launcher 'xla' with num_nodes={num_nodes}: it starts the replicas of this host only; "
                "on a TPU pod, run the script on every host (gcloud ... tpu-vm ssh --worker=all) with "
                "num_nodes=1"
            )
        if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
            raise MisconfigurationError(
                f"launcher 'xla' with num_processes={num_processes!r}: give the number of replicas, "
                "at least 1"
            )

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        import multiprocessing

        folder = Path(tempfile.mkdtemp(prefix="phalanx-xla-"))
        try:
            (folder / "job.pkl").write_bytes(pickle.dumps((fn, args, kwargs)))
            context = multiprocessing.get_context("spawn")
            process = context.Process(
                target=_host_main, args=(str(folder), self.num_processes), name="phalanx-xla-replicas"
            )
            process.start()
            try:
                exitcode = self._wait(process, folder)
            except BaseException:
                _stop(process)
                raise
            return self._results(folder, exitcode)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _wait(self, process: Any, folder: Path) -> int:
        """Wait for the replicas' process; stop it as soon as a replica
        reports a failure. Returns its exit code."""
        failure = folder / _FIRST_FAILURE
        while process.is_alive():
            if failure.exists():
                process.join(STOP_GRACE)  # the failing replica ends the process itself
                _stop(process)
                break
            process.join(_POLL)
        process.join()
        return int(process.exitcode if process.exitcode is not None else -signal.SIGKILL)

    def _results(self, folder: Path, exitcode: int) -> list[Any]:
        n = self.num_processes
        failure = folder / _FIRST_FAILURE
        if failure.exists():
            rank = int(failure.read_text().strip() or 0)
            text = _read(folder / f"traceback-{rank}.txt")
            last = text.strip().splitlines()[-1] if text.strip() else "(no traceback)"
            raise WorkerFailedError(
                f"replica {rank} of {n} failed: {last}. Every replica was stopped (launcher 'xla'); "
                "its traceback follows:\n" + text,
                rank=rank,
                exitcode=exitcode,
                traceback=text,
            )
        missing = [r for r in range(n) if not (folder / f"result-{r}.pkl").exists()]
        if exitcode != 0 or missing:
            signame = None
            if exitcode < 0:
                with contextlib.suppress(ValueError):
                    signame = signal.Signals(-exitcode).name
            how = f"was killed by {signame}" if signame else f"exited with code {exitcode}"
            raise WorkerFailedError(
                f"the process running replicas {list(range(n))} (threads of one process where the "
                f"runtime runs several replicas per process) {how} before replica(s) {missing} returned; "
                "every replica in it stopped at that moment. Its output above says why (XLA aborts the "
                "process when a collective waits 15 s for a replica that does not come)",
                rank=missing[0] if missing else 0,
                exitcode=exitcode,
                signal=signame,
            )
        return [pickle.loads((folder / f"result-{r}.pkl").read_bytes()) for r in range(n)]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _stop(process: Any) -> None:
    """SIGTERM to the replicas' session, then SIGKILL after the grace."""
    pid = process.pid
    if pid is None:
        return
    for sig, wait in ((signal.SIGTERM, STOP_GRACE), (signal.SIGKILL, STOP_GRACE)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        process.join(wait)
        if process.exitcode is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            return


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the launching process dies."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# -- in the replicas' process ------------------------------------------------------


def _host_main(folder: str, num_replicas: int) -> None:
    """The replicas' process: start them as torch_xla does, then leave
    without running the XLA runtime's exit handlers (which can wait on
    replicas that are gone)."""
    os.setsid()
    _die_with_parent()
    # A crash in the runtime (SIGSEGV, SIGABRT) prints every thread's Python
    # stack to stderr, so the job's output says where each replica was.
    faulthandler.enable(all_threads=True)
    job = Path(folder)
    code = 0
    try:
        _run_replicas(job, num_replicas)
    except BaseException:  # noqa: BLE001 - reported through the folder, then the exit code
        if not (job / _FIRST_FAILURE).exists():
            _report(job, 0, traceback.format_exc())
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_replicas(job: Path, num_replicas: int) -> None:
    import torch_xla

    replica = _Replica(str(job))
    if num_replicas == 1:
        torch_xla.launch(replica, debug_single_process=True)
        return
    if _runtime.device_type() == "TPU":
        torch_xla.launch(replica)
        return
    from torch_xla._internal import pjrt

    # What torch_xla.launch's process pool runs in its one process on this host.
    pjrt._run_thread_per_device(
        local_rank=0,
        local_world_size=1,
        fn=lambda: replica(None),
        initializer_fn=pjrt.initialize_multiprocess,
    )
    if not all((job / f"result-{r}.pkl").exists() for r in range(num_replicas)):
        raise RuntimeError(
            f"torch_xla ran {len(list(job.glob('result-*.pkl')))} replica(s) on this host, and "
            f"{num_replicas} were asked for"
        )


class _Replica:
    """What each replica runs: ``fn`` with its arguments, the result or the
    traceback written to the folder."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, index: int | None) -> None:
        import torch_xla.runtime as xr

        job = Path(self.folder)
        rank = int(xr.global_ordinal())
        _runtime.enter_replica(rank)
        try:
            fn, args, kwargs = pickle.loads((job / "job.pkl").read_bytes())
            result = fn(*args, **kwargs)
            data = pickle.dumps(result)
        except BaseException:  # noqa: BLE001 - every failure stops the job, reported by rank
            _report(job, rank, traceback.format_exc())
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        partial = job / f"result-{rank}.pkl.part"
        partial.write_bytes(data)
        partial.rename(job / f"result-{rank}.pkl")


def _report(job: Path, rank: int, text: str) -> None:
    """Write ``rank``'s traceback; the first replica to fail names itself
    in the first-failure file."""
    (job / f"traceback-{rank}.txt").write_text(text)
    with contextlib.suppress(FileExistsError):
        fd = os.open(job / _FIRST_FAILURE, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as file:
            file.write(str(rank))
