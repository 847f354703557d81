"""The ``mpirun`` launcher: ranks started by OpenMPI's ``mpirun`` from a
plain ``python`` process, running ``fn`` in each.

The rank protocol: what ``spawn`` sends a new process (``sys.path``, the
working directory, the main script to import as ``__mp_main__``), then
``fn``, its arguments and keyword arguments, are pickled to a temporary
folder; ``mpirun -np N python -m phalanx_mpi._rank FOLDER``
starts the ranks; each sets ``RANK`` / ``LOCAL_RANK`` from OpenMPI's
``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_LOCAL_RANK``, runs ``fn`` and
leaves its pickled result (or its traceback) in the folder. torch groups
the strategy makes (DDP's) meet at a ``TCPStore`` this process hosts on a
port the kernel gives, as the ``spawn`` launcher does.

The failure contract: a rank that raises writes its traceback and exits
with 1; OpenMPI then stops every other rank (its default on a non-zero
exit) and ``mpirun`` exits non-zero; a rank killed by a signal is named by
``mpirun``'s own report. ``launch`` raises :class:`~phalanx_core.WorkerFailedError`
for the rank that failed first. ``mpirun`` runs in its own session, and is
killed with everything under it if this process is interrupted.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.spawn
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError, UnavailableError, WorkerFailedError

if TYPE_CHECKING:
    from phalanx_core import ClusterEnvironment

__all__ = ["MPIRunLauncher"]

T = TypeVar("T")

#: Seconds mpirun gets to stop its ranks after SIGTERM before SIGKILL.
STOP_GRACE = 5.0
#: The last traceback lines of errors a peer's failure causes: never the cause.
_PEER_LOST = (
    "CollectiveTimeoutError",
    "Connection closed by peer",
    "Connection reset by peer",
    "DistNetworkError",
)
_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")


class MPIRunLauncher(Launcher):
    """Starts ``num_processes`` ranks on this machine with ``mpirun`` and
    runs ``fn`` in each; returns every rank's result, indexed by rank.
    ``fn``, its arguments and its result must be picklable, and ``fn``
    importable by name (as for ``spawn``).

    Inside ranks that ``mpirun`` already started (``OMPI_COMM_WORLD_SIZE``
    set: ``mpirun -np 2 python train.py``), ``launch`` runs ``fn`` in place;
    the registry then chooses ``in_process`` with phalanx-torch's ``mpi``
    environment anyway.

    Options:
        mpirun: the command (``"mpirun"``, found on ``PATH``).
        mpirun_args: more arguments for it (``["--mca", "btl", "self,tcp"]``).

    One node: for several, start the script with ``mpirun`` and a hostfile
    yourself; the ``mpi`` environment reads the ranks there.
    """

    is_interactive_compatible: ClassVar[bool] = False

    def __init__(
        self,
        *,
        environment: ClusterEnvironment | None = None,
        num_processes: int = 1,
        num_nodes: int = 1,
        mpirun: str = "mpirun",
        mpirun_args: Sequence[str] = (),
    ) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        if not isinstance(num_processes, int) or isinstance(num_processes, bool) or num_processes < 1:
            raise MisconfigurationError(
                f"launcher 'mpirun': num_processes={num_processes!r}; expected an int of at least 1"
            )
        if num_nodes != 1:
            raise MisconfigurationError(
                f"launcher 'mpirun' starts ranks on this machine, but num_nodes={num_nodes}; for several "
                "nodes run `mpirun --hostfile H -np N python script.py` yourself (the 'mpi' environment "
                "reads the ranks there)"
            )
        if isinstance(mpirun_args, str) or not all(isinstance(a, str) for a in mpirun_args):
            raise MisconfigurationError(
                f"launcher 'mpirun': mpirun_args={mpirun_args!r}; give a list of strings"
            )
        self.mpirun = mpirun
        self.mpirun_args = list(mpirun_args)

    @classmethod
    def runs_in_existing_processes(cls, environment: type[ClusterEnvironment]) -> bool:
        """Yes inside ranks mpirun started, where ``launch`` runs ``fn`` in place."""
        return bool(os.environ.get("OMPI_COMM_WORLD_SIZE"))

    def _command(self, program: list[str], *, tag_output: bool = False) -> list[str]:
        found = shutil.which(self.mpirun)
        if found is None:
            raise UnavailableError(
                f"launcher 'mpirun': {self.mpirun!r} is not on PATH; install an MPI (apt-get install "
                "openmpi-bin), or pass mpirun='/path/to/mpirun'"
            )
        command = [found, "-np", str(self.num_processes), "--oversubscribe", "--bind-to", "none"]
        if os.geteuid() == 0:
            command.append("--allow-run-as-root")
        if tag_output:
            command.append("--tag-output")
        return [*command, *self.mpirun_args, *program]

    def runs_in_place(self) -> bool:
        """In a rank mpirun started."""
        return bool(os.environ.get("OMPI_COMM_WORLD_SIZE"))

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        if self.runs_in_place():  # a rank mpirun started: run here
            return self.placed(fn(*args, **kwargs))  # type: ignore[return-value]
        import torch.distributed as dist

        # The rendezvous of torch groups the strategy makes, for the whole launch.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
        with tempfile.TemporaryDirectory(prefix="phalanx-mpirun-") as tmp:
            folder = Path(tmp)
            # What spawn sends first: sys.path, the working directory and the
            # main script, which each rank imports as __mp_main__ (so fn may be
            # defined in the script, as under spawn).
            preparation = multiprocessing.spawn.get_preparation_data("phalanx-mpirun")
            preparation.pop("authkey", None)  # not picklable, and unused: no multiprocessing manager
            (folder / "prepare.pkl").write_bytes(pickle.dumps(preparation))
            try:
                (folder / "job.pkl").write_bytes(pickle.dumps((fn, args, kwargs)))
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                raise MisconfigurationError(
                    f"launcher 'mpirun' sends fn and its arguments to the ranks by pickling them, and "
                    f"{getattr(fn, '__qualname__', fn)!r} or an argument cannot be pickled "
                    f"({type(exc).__name__}: {exc}). Define fn at the top level of an importable module"
                ) from exc
            variables = {
                "WORLD_SIZE": str(self.num_processes),
                "LOCAL_WORLD_SIZE": str(self.num_processes),
                "NODE_RANK": "0",
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
            program = [sys.executable, "-m", "phalanx_mpi._rank", str(folder)]
            code, report = _run(self._command(program), {**os.environ, **variables})
            if code == 0:
                return [pickle.loads((folder / f"{r}.pkl").read_bytes()) for r in range(self.num_processes)]
            raise _failure(folder, code, report, self.num_processes)

    def run_script(self, command: Sequence[str]) -> None:
        """``mpirun -np N python *command``, each line tagged by OpenMPI
        with the rank (``[1,0]<stdout>:``)."""
        code, report = _run(self._command([sys.executable, *command], tag_output=True), dict(os.environ))
        if code != 0:
            raise _failure(None, code, report, self.num_processes)


def _run(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run mpirun in its own session, passing its output through; return its
    exit code and its stderr (for its report of a signalled rank)."""
    process = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []

    def relay() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.append(line)
            sys.stderr.write(line)
        sys.stderr.flush()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        code = process.wait()
    except BaseException:  # interrupted (Ctrl-C) or killed: take the job down with this process
        _stop(process)
        raise
    finally:
        reader.join(timeout=10)
    return code, "".join(lines)


def _stop(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _failure(folder: Path | None, code: int, report: str, size: int) -> WorkerFailedError:
    """WorkerFailedError for the rank that failed first: a rank that raised
    (not because a peer was lost), earliest first; else the rank mpirun
    says a signal killed."""
    raised = []
    for path in sorted(folder.glob("*.err")) if folder is not None else []:
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            last = data["traceback"].strip().splitlines()[-1:]
            lost = bool(last) and any(mark in last[0] for mark in _PEER_LOST)
            raised.append((lost, float(data["time"]), int(path.stem), data["traceback"]))
    signalled = _SIGNALLED.search(report)
    stopped = "Every other rank was stopped (by mpirun)."
    if raised and not (signalled and all(lost for lost, *_ in raised)):
        _, _, rank, text = min(raised)
        return WorkerFailedError(
            f"the launched job failed: rank {rank} of {size} (launcher 'mpirun') raised first.\n"
            f"Its traceback:\n{_indent(text)}\n{stopped} Fix the error rank {rank} raised, shown above.",
            rank=rank,
            exitcode=1,
            traceback=text,
        )
    if signalled:
        rank, number = int(signalled.group(1)), int(signalled.group(2))
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return WorkerFailedError(
            f"the launched job failed: rank {rank} of {size} (launcher 'mpirun') was killed by {name} "
            f"first. {stopped} It left no traceback: see its output above (a SIGKILL is often the "
            "out-of-memory killer)",
            rank=rank,
            exitcode=-number,
            signal=name,
        )
    return WorkerFailedError(
        f"the launched job failed: mpirun exited with code {code} and no rank left a traceback; its "
        "output above says why (mpirun's own error, or a rank that exited without raising)",
        rank=-1,
        exitcode=code,
    )


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())
