"""What torch's launchers share beyond core's toolkit
(:mod:`phalanx_core.launching`): the rank protocol's variables, running fn
in a rank, and the checks before forking. Imports no torch."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from phalanx_core import MisconfigurationError
from phalanx_core.launching import PARENT_PID_VAR, die_with_parent, dumps_result, write_whole

T = TypeVar("T")

#: Set by the ``subprocess`` launcher for the ranks it starts: the folder in
#: which each rank leaves its return value, as ``<RANK>.pkl``.
RESULTS_DIR_VAR = "PHALANX_LAUNCH_RESULTS_DIR"
_ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
_LAUNCH_INDEX_VAR = "PHALANX_LAUNCH_INDEX"
_LAUNCHER_PID_VAR = PARENT_PID_VAR
#: In the ranks of a job of ``MIN:MAX`` nodes: MIN (``num_nodes`` is MAX).
MIN_NODES_VAR = "PHALANX_LAUNCH_MIN_NODES"
#: Counts the launches of this process, in every launcher here. A script
#: re-run by the ``subprocess`` launcher makes the same launches in the same
#: order, so a rank answers the launch of the same number.
_LAUNCHES = itertools.count(1)


# -- in_process ------------------------------------------------------------------


def record_exception(exc: BaseException) -> None:
    """Leave ``exc`` in torch elastic's error file (``TORCHELASTIC_ERROR_FILE``)
    as its ``ErrorHandler`` writes it, but whole or not at all: written
    beside it, then renamed onto it. The launching process stops every rank once one
    has failed; a rank stopped while its handler wrote would leave the file
    cut short, and elastic's process layer, which parses it, raises
    ``JSONDecodeError`` in place of the job's failure."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    path = os.environ.get(_ERROR_FILE_VAR)
    if not path:
        ErrorHandler().record_exception(exc)
        return
    partial = f"{path}.{os.getpid()}.partial"
    os.environ[_ERROR_FILE_VAR] = partial  # where the handler writes
    try:
        ErrorHandler().record_exception(exc)
    finally:
        os.environ[_ERROR_FILE_VAR] = path
    try:
        os.replace(partial, path)
    except OSError:
        Path(partial).unlink(missing_ok=True)


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
        die_with_parent(int(launcher))
    if not error_file and not results_dir:
        return fn(*args, **kwargs)
    try:
        result = fn(*args, **kwargs)
        if results_dir:
            rank = os.environ.get("RANK", "0")
            write_whole(Path(results_dir, f"{rank}.pkl"), dumps_result(result, rank))
    except Exception as exc:
        if error_file:
            record_exception(exc)
        raise
    return result


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
