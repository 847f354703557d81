"""The ``mpirun`` launcher: ranks started by OpenMPI's ``mpirun`` from a
plain ``python`` process, running ``fn`` in each.

The rank protocol: what ``spawn`` sends a new process (``sys.path``, the
working directory, the main script to import as ``__mp_main__``), then
``fn``, its arguments and keyword arguments, are pickled to a temporary
folder; ``mpirun -np N python -m phalanx_mpi._rank FOLDER ADDRESS PORT``
starts the ranks; each sets torch's rank variables from OpenMPI's
(``OMPI_COMM_WORLD_RANK``, ...), runs ``fn`` and leaves its pickled result
(or its traceback) in the folder. torch groups the strategy makes (DDP's)
meet at a ``TCPStore`` this process hosts at ``ADDRESS:PORT`` (127.0.0.1
only, on a port the kernel gives), as the ``spawn`` launcher does, and
gloo's own connections are kept on the loopback interface too. A script run
as every rank's program (``phalanx run``) meets at such a store as well
(:func:`~phalanx_core.launching.script_store`), instead of one its rank 0 would host on every
interface.

The failure contract: a rank that raises writes its traceback and exits
with 1; OpenMPI then stops every other rank (its default on a non-zero
exit) and ``mpirun`` exits non-zero; a rank killed by a signal, or that
exited non-zero first, is named by ``mpirun``'s own report. ``launch``
raises :class:`~phalanx_core.WorkerFailedError` built by
:func:`phalanx_core.launching.worker_failed`: every failure seen, the root
cause by the launchers' one rule. ``mpirun`` runs in its own session, and is
stopped with everything under it if this process is interrupted.
"""

from __future__ import annotations

import collections
import contextlib
import json
import multiprocessing.spawn
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError, UnavailableError, WorkerFailedError
from phalanx_core.launching import (
    LINES_PREFIXED_VAR,
    LOOPBACK,
    RANK_LINE,
    RankFailure,
    check_count,
    hosted_store,
    last_tracebacks,
    listen_variables,
    relay_output,
    script_store,
    stop_processes,
    worker_failed,
)

if TYPE_CHECKING:
    from phalanx_core import ClusterEnvironment

__all__ = ["MPIRunLauncher"]

T = TypeVar("T")

#: mpirun's report of a rank a signal killed.
_SIGNALLED = re.compile(r"process rank (\d+) with PID \d+ on node \S+ exited on signal (\d+)")
#: The tag ``mpirun --tag-output`` puts before each write of a rank:
#: ``[1,0]<stderr>:`` (the job, then the rank).
_TAG = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr|stddiag)>:")
#: mpirun's report of the first rank that exited non-zero: ``Process name:
#: [[37893,1],1]`` (the job, then the rank), and on the next line ``Exit code: 1``.
_PROCESS = re.compile(r"Process name:\s*\[\[\d+,\d+\],(\d+)\]")
_EXIT_CODE = re.compile(r"Exit code:\s*(-?\d+)")
#: The last lines of mpirun's stderr kept to find the failures in.
_KEPT_LINES = 5000
#: What happens to the other ranks when one fails, for the error's message.
_STOPPED = "Every other rank was stopped (by mpirun)"


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

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        return (
            "127.0.0.1: the launcher's rendezvous store, every rank's gloo, mpirun's PMIx server (MPI "
            "between the ranks over shared memory: OMPI_MCA_btl=self,vader); every interface: mpirun's "
            "own out-of-band channel, which Open MPI binds there whatever its settings"
        )

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
        check_count("mpirun", "num_processes", num_processes)
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
        # The rendezvous of torch groups the strategy makes, for the whole
        # launch, on loopback only: every rank runs on this machine.
        store = hosted_store(LOOPBACK, wait_for_workers=False)
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
            program = [sys.executable, "-m", "phalanx_mpi._rank", str(folder), LOOPBACK, str(store.port)]
            code, report = _run(self._command(program), _one_node_environment(), tagged=False)
            if code == 0:
                return [pickle.loads((folder / f"{r}.pkl").read_bytes()) for r in range(self.num_processes)]
            raise _failure(folder, code, report, self.num_processes)

    def run_script(self, command: Sequence[str]) -> None:
        """``mpirun -np N python -m phalanx_core.launching.rank_program
        *command``: each line a rank writes is marked ``[rankN]: `` (from
        OpenMPI's tags on each write, put back together into lines), and a
        rank whose program raises leaves at once, so that MPI's finalization
        does not wait for peers it left in a collective."""
        program = [sys.executable, "-m", "phalanx_core.launching.rank_program", *command]
        command = self._command(program, tag_output=True)
        with script_store() as variables:
            env = {**_one_node_environment(), **variables, LINES_PREFIXED_VAR: "1"}
            code, report = _run(command, env, tagged=True)
        if code != 0:
            raise _failure(None, code, report, self.num_processes)


def _one_node_environment() -> dict[str, str]:
    """The environment of mpirun and its ranks, all on this machine: this
    one, with nothing of the job listening beyond loopback, except where
    you chose otherwise.

    - torch's gloo on the loopback interface (``GLOO_SOCKET_IFNAME``; left
      alone, gloo listens on the address of this host's name), unless it is
      set.
    - OpenMPI's transports kept to shared memory (``OMPI_MCA_btl=self,vader``;
      ranks on one machine talk through it anyway): its TCP transport binds
      its listening sockets to every interface whatever
      ``btl_tcp_if_include`` says, and libfabric's (``btl ofi``) listens on
      the host's address. Not where ``OMPI_MCA_btl`` is set (or
      ``mpirun_args`` name ``--mca btl``, which wins over this).
    """
    env = {**os.environ, **listen_variables(LOOPBACK)}
    env.setdefault("OMPI_MCA_btl", "self,vader")
    return env


def _run(command: list[str], env: dict[str, str], *, tagged: bool) -> tuple[int, Sequence[tuple[float, str]]]:
    """Run mpirun in its own session, passing its output through; return its
    exit code and the last lines of its stderr, each with when it was read
    (for its report of a failed rank, and a rank's traceback). ``tagged``:
    the ranks' writes carry OpenMPI's tags (``--tag-output``), and both
    streams are passed on as whole lines marked ``[rankN]: ``."""
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE if tagged else None,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: collections.deque[tuple[float, str]] = collections.deque(maxlen=_KEPT_LINES)
    tag = _TAG if tagged else None
    readers = [relay_output(process.stderr, sys.stderr, tag, lines)]  # type: ignore[arg-type]
    if tagged:
        readers.append(relay_output(process.stdout, sys.stdout, tag))  # type: ignore[arg-type]
    try:
        code = process.wait()
    except BaseException:  # interrupted (Ctrl-C) or killed: take the job down with this process
        stop_processes([process])
        raise
    finally:
        for reader in readers:
            reader.join(timeout=10)
    return code, lines


def _ends(report: Iterable[tuple[float, str]]) -> dict[int, tuple[int, float]]:
    """The ranks mpirun says failed, each with its exit code (negative: the
    signal that killed it) and when mpirun said so."""
    ended: dict[int, tuple[int, float]] = {}
    named: tuple[int, float] | None = None
    for when, line in report:
        if found := _SIGNALLED.search(line):
            ended.setdefault(int(found.group(1)), (-int(found.group(2)), when))
        elif found := _PROCESS.search(line):
            named = (int(found.group(1)), when)
        elif named is not None and (found := _EXIT_CODE.search(line)):
            ended.setdefault(named[0], (int(found.group(1)), named[1]))
            named = None
    return ended


def _failure(
    folder: Path | None, code: int, report: Sequence[tuple[float, str]], size: int
) -> WorkerFailedError:
    """The WorkerFailedError of a job that mpirun ended with ``code``: a
    record for every rank known to have failed (one that left its traceback
    in ``folder``, or in its tagged output; one that mpirun saw killed by a
    signal or exit non-zero), the root cause chosen by the launchers' one
    rule (:func:`phalanx_core.launching.root_cause`)."""
    ended = _ends(report)
    # A script's ranks (run_script): seen in their output, exit code unknown.
    raised = last_tracebacks(report, RANK_LINE)
    for path in sorted(folder.glob("*.err")) if folder is not None else []:
        with contextlib.suppress(OSError, ValueError, KeyError):
            data = json.loads(path.read_text())
            raised[int(path.stem)] = (str(data["traceback"]), float(data["time"]))
            ended.setdefault(int(path.stem), (1, 0.0))  # phalanx_mpi._rank exits with 1 once it wrote it
    failures = []
    for rank in sorted(raised.keys() | ended.keys()):
        if rank in raised:
            text, when = raised[rank]
            exitcode = ended[rank][0] if rank in ended else None
            failures.append(RankFailure(rank, exitcode=exitcode, traceback=text, when=when))
        else:
            exitcode, when = ended[rank]
            failures.append(RankFailure(rank, exitcode=exitcode, when=when))
    if failures:
        return worker_failed("mpirun", failures, size, stopped=_STOPPED)
    return WorkerFailedError(
        f"the launched job failed: mpirun exited with code {code}, and which rank failed is unknown: no "
        "rank left a traceback and mpirun named none (so WorkerFailedError.rank is -1). Its output above "
        "says why: mpirun's own error, or a rank that ended without a word",
        rank=-1,
        exitcode=code,
    )
