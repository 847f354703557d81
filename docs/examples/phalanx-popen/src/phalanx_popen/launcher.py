"""The ``popen`` launcher: one ``python -m phalanx_popen._rank FOLDER`` per
rank, on this machine. ``fn`` and its arguments go to the ranks pickled (by
reference: ``fn`` must be importable), the results come back the same way,
and a rank's failure comes back as the toolkit's record."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from phalanx_core import Launcher, MisconfigurationError
from phalanx_core.launching import (
    CAUSE_GRACE,
    LOOPBACK,
    RankFailure,
    hosted_store,
    listen_variables,
    rank_variables,
    stop_processes,
    worker_failed,
)

T = TypeVar("T")
#: Tells a rank which process launched it (it dies with it).
PARENT_VAR = "PHALANX_POPEN_PARENT"


class PopenLauncher(Launcher):
    """One process per rank on this machine; nothing listens beyond loopback."""

    is_interactive_compatible: ClassVar[bool] = False

    def __init__(self, *, environment: Any = None, num_processes: int = 1, num_nodes: int = 1) -> None:
        super().__init__(environment=environment, num_processes=num_processes, num_nodes=num_nodes)
        if num_nodes != 1:
            raise MisconfigurationError(
                f"launcher 'popen' starts processes on this machine only, but num_nodes={num_nodes} was "
                "asked for; use launcher='subprocess' on every node"
            )

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        return "127.0.0.1 only: the launcher's rendezvous store and every rank's gloo"

    def launch(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> list[T]:
        size = self.num_processes
        store = hosted_store(LOOPBACK, wait_for_workers=False)  # the ranks' rendezvous, loopback only
        processes: list[subprocess.Popen[bytes]] = []
        with tempfile.TemporaryDirectory(prefix="phalanx-popen-") as tmp:
            folder = Path(tmp)
            (folder / "job.pkl").write_bytes(pickle.dumps((fn, args, kwargs)))
            try:
                for rank in range(size):
                    env = {
                        **os.environ,
                        **rank_variables(
                            rank=rank, world_size=size, local_rank=rank, local_world_size=size,
                            main_address=LOOPBACK, main_port=store.port, agent_store=True,
                        ),
                        **listen_variables(LOOPBACK),
                        PARENT_VAR: str(os.getpid()),
                    }  # fmt: skip
                    command = [sys.executable, "-m", "phalanx_popen._rank", str(folder)]
                    processes.append(subprocess.Popen(command, env=env, start_new_session=True))
                failures = _wait(processes, folder)
                if failures:
                    stop_processes(processes)
                    raise worker_failed("popen", failures, size)
                return [pickle.loads((folder / f"{rank}.pkl").read_bytes()) for rank in range(size)]
            finally:
                stop_processes(processes)  # nothing is left, whatever happened
                del store


def _wait(processes: list[subprocess.Popen[bytes]], folder: Path) -> list[RankFailure]:
    """Wait until every rank has exited, or one failed; return the failures.
    While every failure seen only says that a peer was lost, wait up to
    ``CAUSE_GRACE`` seconds more for the rank that caused it."""
    failures: list[RankFailure] = []
    running = dict(enumerate(processes))
    settle = None
    while running:
        for rank, process in list(running.items()):
            code = process.poll()
            if code is None:
                continue
            del running[rank]
            if code != 0:
                failures.append(_failure(rank, code, folder))
        if failures:
            settle = settle or time.monotonic() + CAUSE_GRACE
            if not all(f.lost_a_peer for f in failures) or time.monotonic() > settle:
                break
        time.sleep(0.01)
    return failures


def _failure(rank: int, code: int, folder: Path) -> RankFailure:
    """What rank ``rank``, which exited with ``code``, left: its traceback
    and when it raised, if it lived to write them."""
    error = folder / f"{rank}.err"
    if error.exists():
        data = json.loads(error.read_text())
        return RankFailure(rank, code, traceback=data["traceback"], when=data["when"])
    return RankFailure(rank, code, when=time.time())
