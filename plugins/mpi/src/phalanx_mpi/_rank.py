"""A rank of the ``mpirun`` launcher: ``python -m phalanx_mpi._rank FOLDER
ADDRESS PORT``.

Sets torch's rank variables from OpenMPI's (the store at ``ADDRESS:PORT``
is the launching process's), prepares itself as a spawned process
(``FOLDER/prepare.pkl``: what :func:`multiprocessing.spawn.get_preparation_data`
gives), reads ``FOLDER/job.pkl`` (fn, args, kwargs), runs fn, and leaves
``FOLDER/<rank>.pkl`` (the pickled result) or ``FOLDER/<rank>.err`` (JSON:
the traceback and when it was raised) for the launching process, each
written whole or not at all. A rank that raised exits with 1 at once,
without MPI_Finalize, so that mpirun stops the others; a rank that finished
finalizes MPI and leaves without Python's finalization (no abort at exit).
"""

from __future__ import annotations

import json
import multiprocessing.spawn
import os
import pickle
import sys
import time
from pathlib import Path

from phalanx_core.launching import dumps_result, exit_process, failure_text, rank_variables, write_whole


def main(folder: Path, main_address: str, main_port: int) -> int:
    env = os.environ
    rank, size = int(env["OMPI_COMM_WORLD_RANK"]), int(env["OMPI_COMM_WORLD_SIZE"])
    env.update(
        rank_variables(
            rank=rank,
            world_size=size,
            local_rank=int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", rank)),
            local_world_size=int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)),
            main_address=main_address,
            main_port=main_port,
            agent_store=True,
        )
    )
    try:
        # As a spawned process does: the parent's sys.path and working
        # directory, and its main script imported as __mp_main__ (guarded
        # code does not run), so that fn may come from the script.
        multiprocessing.spawn.prepare(pickle.loads((folder / "prepare.pkl").read_bytes()))
        fn, args, kwargs = pickle.loads((folder / "job.pkl").read_bytes())
        result = dumps_result(fn(*args, **kwargs), rank)
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, then the rank exits 1
        text = failure_text(exc, skip_frames=1)  # from fn's frame on, not this one
        write_whole(folder / f"{rank}.err", json.dumps({"traceback": text, "time": time.time()}).encode())
        sys.stderr.write(text)
        return 1
    write_whole(folder / f"{rank}.pkl", result)
    return 0


def _exit_failed() -> None:
    """Leave without MPI_Finalize: mpi4py finalizes at exit, and finalizing
    waits for the other ranks, which may be blocked in a collective this
    rank never joins (a 3-rank job hung there). A rank that exits without
    finalizing makes mpirun stop the others. It leaves at once: no thread
    of ``fn`` waited for, no exit handler run."""
    exit_process(1, run_atexit=False, join_threads=False)


def _exit_done() -> None:
    """Leave after the result is written: MPI finalized here (mpirun counts
    a rank that exits without it as failed), then without the interpreter's
    finalization, in which gloo's worker threads (a torch group the job made
    beside MPI) can abort the process (see :func:`exit_process`)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    exit_process(0)


if __name__ == "__main__":
    if main(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])) != 0:
        _exit_failed()
    _exit_done()
