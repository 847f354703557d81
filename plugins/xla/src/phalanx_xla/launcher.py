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

**Failures.** A replica is a rank, and a rank's failure is one of two
kinds. A replica that raises writes its traceback to the folder and ends
the process at once (``exit_process`` joining nothing): the replicas are threads, and a thread
waiting in an XLA collective for the failed one cannot be stopped in any
other way; each replica that raised is a failure, with its traceback and
the process's exit code. A process that ends otherwise (killed by a signal,
aborted by the runtime) before every replica returned stops every replica
it holds at the same instant: each replica without a result is then a
failure, with the process's exit code. ``launch`` raises the
:class:`~phalanx_core.WorkerFailedError` of
:func:`phalanx_core.launching.worker_failed`, naming the root cause
(:func:`~phalanx_core.launching.root_cause`: a replica that raised other
than because a peer was lost; else the first rank of a process that died)
and keeping every failure. A process killed by a signal after every
replica returned gives the results, with a warning
(:func:`~phalanx_core.launching.warn_died_after_delivery`). If the
launching process is interrupted (Ctrl-C, a test's time limit), the
replicas' session is stopped (:func:`~phalanx_core.launching.stop_processes`)
before the exception goes on. On Linux the replicas' process also dies with
the launching process (:func:`~phalanx_core.launching.die_with_parent`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError
from phalanx_core.launching import (
    RankFailure,
    die_with_parent,
    exit_process,
    failure_text,
    stop_processes,
    warn_died_after_delivery,
    worker_failed,
    write_whole,
)

from . import _runtime

if TYPE_CHECKING:
    from phalanx_core import ClusterEnvironment

__all__ = ["XLALauncher"]

T = TypeVar("T")

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
                target=_host_main,
                args=(str(folder), self.num_processes, os.getpid()),
                name="phalanx-xla-replicas",
            )
            process.start()
            try:
                exitcode = self._wait(process, folder)
            except BaseException:
                stop_processes([process])
                raise
            return self._results(folder, exitcode, ended=time.time())
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _wait(self, process: Any, folder: Path) -> int:
        """Wait for the replicas' process; stop it as soon as a replica
        reports a failure. Returns its exit code."""
        failure = folder / _FIRST_FAILURE
        while process.is_alive():
            if failure.exists():
                # The failing replica ends the process itself: the grace,
                # with no SIGTERM; then the signals for what is left.
                stop_processes([process], spare={0})
                break
            process.join(_POLL)
        process.join()
        return int(process.exitcode if process.exitcode is not None else -signal.SIGKILL)

    def _results(self, folder: Path, exitcode: int, *, ended: float) -> list[Any]:
        """Every replica's result, by global rank; or the job's failure."""
        n = self.num_processes
        raised = [
            RankFailure(r, exitcode=exitcode, traceback=_read(path), when=path.stat().st_mtime)
            for r in range(n)
            if (path := folder / f"traceback-{r}.txt").exists()
        ]
        missing = [r for r in range(n) if not (folder / f"result-{r}.pkl").exists()]
        if raised:
            raise worker_failed(
                "xla",
                raised,
                n,
                stopped="Every replica was stopped (the replicas are threads of one process)",
            )
        if exitcode < 0 and not missing:
            # Killed while exiting, after every replica had handed back its result.
            warn_died_after_delivery("xla", RankFailure(0, exitcode=exitcode, when=ended), n)
        elif exitcode != 0 or missing:
            # Ended with no replica's word: every replica without a result
            # stopped with the process, at the same instant.
            died = [RankFailure(r, exitcode=exitcode, when=ended) for r in missing or range(n)]
            raise worker_failed(
                "xla",
                died,
                n,
                stopped=(
                    "Every replica in its process stopped with it (the replicas are threads of one "
                    "process: which one its end came from cannot be told). XLA aborts the process when a "
                    "collective waits 15 s for a replica that does not come"
                ),
            )
        return [pickle.loads((folder / f"result-{r}.pkl").read_bytes()) for r in range(n)]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# -- in the replicas' process ------------------------------------------------------


def _host_main(folder: str, num_replicas: int, parent: int) -> None:
    """The replicas' process: start them as torch_xla does, then leave
    without running the XLA runtime's exit handlers (which can wait on
    replicas that are gone) or waiting for its threads:
    :func:`~phalanx_core.launching.exit_process` with neither."""
    os.setsid()
    die_with_parent(parent)
    # A crash in the runtime (SIGSEGV, SIGABRT) prints every thread's Python
    # stack to stderr, so the job's output says where each replica was.
    faulthandler.enable(all_threads=True)
    job = Path(folder)
    code = 0
    try:
        _run_replicas(job, num_replicas)
    except BaseException as exc:  # noqa: BLE001 - reported through the folder, then the exit code
        if not (job / _FIRST_FAILURE).exists():
            _report(job, 0, failure_text(exc))
        code = 1
    finally:
        exit_process(code, run_atexit=False, join_threads=False)


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
        except BaseException as exc:  # noqa: BLE001 - every failure stops the job, reported by rank
            _report(job, rank, failure_text(exc, skip_frames=1))
            exit_process(1, run_atexit=False, join_threads=False)
        write_whole(job / f"result-{rank}.pkl", data)


def _report(job: Path, rank: int, text: str) -> None:
    """Write ``rank``'s traceback (its time is the file's); the first
    replica to fail names itself in the first-failure file, which tells the
    launching process to stop the rest."""
    (job / f"traceback-{rank}.txt").write_text(text)
    with contextlib.suppress(FileExistsError):
        fd = os.open(job / _FIRST_FAILURE, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        with os.fdopen(fd, "w") as file:
            file.write(str(rank))
