"""What runs inside a rank: its variables, its program, its result or its
failure written for the launching process, and its way out."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import runpy
import signal
import sys
import threading
import traceback as traceback_module
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from ..errors import MisconfigurationError

#: A module global that marks the machinery which runs a rank's program
#: (this module, runpy, a launcher's rank program): a module that sets it
#: true has its frames left out of the tracebacks and hang reports a user
#: reads, which start at the user's own code.
RANK_MACHINERY = "__phalanx_rank_machinery__"
globals()[RANK_MACHINERY] = True


def is_rank_machinery(frame: Any) -> bool:
    """Whether ``frame`` belongs to the machinery that runs a rank
    (:data:`RANK_MACHINERY`, or runpy)."""
    scope = frame.f_globals
    return bool(scope.get(RANK_MACHINERY)) or scope.get("__name__") == "runpy"


__all__ = [
    "LAUNCH_PRIVATE_PREFIX",
    "LINES_PREFIXED_VAR",
    "PARENT_PID_VAR",
    "RANK_MACHINERY",
    "RESTART_COUNT_VAR",
    "RUN_FLAGS_VAR",
    "carried_variables",
    "before_threads_join",
    "die_with_parent",
    "dumps_result",
    "exit_code_of",
    "exit_process",
    "failure_text",
    "is_rank_machinery",
    "rank_variables",
    "run_program",
    "write_whole",
]


#: The prefix of the variables one launch sets for its own ranks (where a
#: rank leaves its result, which launch of the script it answers, the pid of
#: the process that started it). Such a variable is not carried into the
#: ranks of another launcher started from inside a rank: those ranks belong
#: to a launch of their own. Every other ``PHALANX_*`` variable is the
#: user's setting and is carried (:func:`carried_variables`).
LAUNCH_PRIVATE_PREFIX = "PHALANX_LAUNCH_"

#: The flags ``phalanx run`` was given (JSON), which ``resolve()`` in the
#: script's ranks takes as its defaults (the registry writes and reads it).
RUN_FLAGS_VAR = "PHALANX_RUN_FLAGS"


def run_flags_changed(**changes: Any) -> dict[str, str]:
    """``{RUN_FLAGS_VAR: ...}`` for ranks whose job differs from what
    ``phalanx run`` was given in ``changes`` (the ranks of one replica
    group are a one-node job in a job of several hosts: ``num_nodes=1``);
    ``{}`` where this process was not started by ``phalanx run``."""
    import json

    raw = os.environ.get(RUN_FLAGS_VAR)
    if not raw:
        return {}
    return {RUN_FLAGS_VAR: json.dumps({**json.loads(raw), **changes})}


#: The pid of the process that started a rank (set by its launcher): a
#: rank run by :mod:`phalanx_core.launching.rank_program` dies with it.
PARENT_PID_VAR = "PHALANX_LAUNCH_PARENT_PID"

#: Set by a launcher that marks every line a rank writes with
#: ``[rankN]: `` itself: the rank then leaves its tracebacks unmarked
#: (torch marks them where it sets up a process group).
LINES_PREFIXED_VAR = "PHALANX_LINES_PREFIXED"

#: How many times a launcher started the job's ranks again after a failure
#: (``strategy.restart_count`` reads it): torchrun's name, which every
#: launcher of phalanx's gives its ranks too, so that a script reads one
#: variable whoever started it.
RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"


def carried_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``PHALANX_*`` variables of ``environ`` (this process's by
    default) that a launcher gives the ranks it starts where they do not
    inherit its environment (actors of a Ray cluster, processes on other
    hosts): every one but those of :data:`LAUNCH_PRIVATE_PREFIX`."""
    source = os.environ if environ is None else environ
    return {
        key: value
        for key, value in source.items()
        if key.startswith("PHALANX_") and not key.startswith(LAUNCH_PRIVATE_PREFIX)
    }


def rank_variables(
    *,
    rank: int,
    world_size: int,
    local_rank: int,
    local_world_size: int,
    node_rank: int = 0,
    main_address: str | None = None,
    main_port: int | None = None,
    agent_store: bool = False,
) -> dict[str, str]:
    """The variables that tell a rank who it is, as torchrun sets them
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``NODE_RANK``/``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), which
    every environment that reads torchrun's reads. ``agent_store=True``:
    the store at the main address is a launcher's, already up
    (``TORCHELASTIC_USE_AGENT_STORE``): the ranks join it, none hosts it."""
    variables = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "NODE_RANK": str(node_rank),
        "GROUP_RANK": str(node_rank),
    }
    if main_address is not None:
        variables["MASTER_ADDR"] = main_address
    if main_port is not None:
        variables["MASTER_PORT"] = str(main_port)
    if agent_store:
        variables["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return variables


def write_whole(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` whole or not at all: a reader never sees
    part of it (written beside it, then renamed over it)."""
    path = Path(path)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(data)
        partial.replace(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()


def dumps_result(result: Any, rank: object, *, before_exit: bool = False) -> bytes:
    """``result`` pickled to carry it to the launching process; a value that
    cannot be is the user's to change, and the error says so.

    ``before_exit``: the rank leaves right after (through
    :func:`exit_process`), so the garbage collector is turned off first and
    left off. A collection while pickling freed the last owner of a process
    group whose teardown then waited forever for its gloo threads (a forked
    rank of ``tests/test_checkpoint_worlds.py`` hung so, once in six loops
    under load); the process's exit frees everything without running it."""
    if before_exit:
        gc.disable()
    try:
        return pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise MisconfigurationError(
            f"rank {rank}: the value fn returned ({type(result).__qualname__}) cannot be pickled to "
            f"carry it back to the launching process ({type(exc).__name__}: {exc}). Return picklable "
            "values (numbers, tensors, dicts of them), or save it to a file and return the path"
        ) from exc


def failure_text(exc: BaseException, *, skip_frames: int = 0) -> str:
    """The traceback of ``exc`` as Python prints it, without its first
    ``skip_frames`` frames (the launcher's own, above the user's code)."""
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is None or tb.tb_next is None:
            break
        tb = tb.tb_next
    return "".join(traceback_module.format_exception(type(exc), exc, tb))


def die_with_parent(parent: int) -> None:
    """On Linux, have the kernel kill this process when ``parent``, the
    process that launched it, dies (even by SIGKILL, when it can stop no
    one). If the parent died before this took effect, exit at once."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before that took effect
        os._exit(1)


def run_program(command: list[str]) -> dict[str, Any]:
    """Run ``python *command`` in this process (a script's path, or ``-m
    module``, then its arguments) as ``__main__``, with ``sys.argv`` and
    ``sys.path[0]`` as ``python`` would set them; return the program's
    globals. ``sys.argv`` and ``sys.path`` are restored after."""
    if not command:
        raise MisconfigurationError("phalanx run: name the script to run (or -m module)")
    saved_argv, saved_path0 = sys.argv, sys.path[0] if sys.path else None
    try:
        if command[0] == "-m":
            if len(command) < 2:
                raise MisconfigurationError("phalanx run -m: name the module to run")
            sys.argv = [command[1], *command[2:]]
            sys.path.insert(0, os.getcwd())
            return runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        script = os.path.abspath(command[0])
        if not os.path.exists(script):
            raise MisconfigurationError(f"phalanx run: no script at {command[0]!r}")
        sys.argv = [command[0], *command[1:]]
        sys.path.insert(0, os.path.dirname(script))
        return runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path and sys.path[0] != saved_path0:
            sys.path.pop(0)


def exit_code_of(code: object) -> int:
    """``SystemExit.code`` as the exit status ``python`` gives it (a message
    is printed to stderr, and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(BaseException):
        sys.stderr.write(f"{code}\n")
    return 1


#: What :func:`before_threads_join` registered and has not run yet.
_BEFORE_JOIN: list[Callable[[], object]] = []
_BEFORE_JOIN_LOCK = threading.Lock()
_WATCHING: list[bool] = []  # the daemon thread that waits for the main thread runs


def before_threads_join(fn: Callable[[], object]) -> None:
    """Run ``fn`` once when this process exits, before its non-daemon
    threads are waited for: for a part whose threads end only when told
    (TorchFT's manager serves checkpoints and runs quorums on such
    threads), so that a script that ends without a teardown still exits.

    Both ways out call it: :func:`exit_process` (a rank of ``phalanx run``)
    first thing, and Python's own exit (a script under torchrun or plain
    ``python``) from a daemon thread that wakes when the main thread is
    done, before Python joins the others. Not where a failed rank leaves
    at once (``exit_process(join_threads=False)``). An exception of ``fn`` is
    printed, as an ``atexit`` handler's is."""
    with _BEFORE_JOIN_LOCK:
        first = not _BEFORE_JOIN and not _WATCHING
        _BEFORE_JOIN.append(fn)
        if first:
            _WATCHING.append(True)
            threading.Thread(target=_after_main_thread, name="phalanx-before-join", daemon=True).start()


def _after_main_thread() -> None:
    threading.main_thread().join()
    _run_before_join()


def _run_before_join() -> None:
    while True:
        with _BEFORE_JOIN_LOCK:
            if not _BEFORE_JOIN:
                return
            fn = _BEFORE_JOIN.pop()
        try:
            fn()
        except BaseException:  # noqa: BLE001 - printed, as an atexit handler's is
            traceback_module.print_exc()


def _join_threads() -> None:
    """What Python's own exit does with threads: its threading exit hooks
    (``concurrent.futures`` tells the idle workers of every pool left open
    to end: without this, a script that leaves a ``ThreadPoolExecutor``
    open, as many libraries do, waits for its workers forever), then every
    non-daemon thread joined. Python's own exit calls ``threading._shutdown``
    for it; from another thread than the main one the threads are joined
    as they are."""
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and threading.current_thread() is threading.main_thread():
        shutdown()
        return
    main = threading.main_thread()
    for thread in threading.enumerate():
        if thread is not main and not thread.daemon and thread is not threading.current_thread():
            thread.join()


def exit_process(code: int, *, run_atexit: bool = True, join_threads: bool = True) -> NoReturn:
    """End this process with ``code``, after what Python's own exit does
    that matters (the non-daemon threads joined, the ``atexit`` handlers
    run, stdout and stderr flushed), but without the interpreter's
    finalization. Every rank leaves this way.

    Why: gloo's worker threads (``pt_gloo_runloop``) release the tensors of
    a finished operation a moment after the waiting thread has woken up,
    and torch's DDP keeps its gloo group alive past
    ``destroy_process_group()``. If the interpreter is finalizing by then,
    the release takes the GIL, the finalizing interpreter ends that thread
    with ``pthread_exit``, and the unwinding through a ``noexcept``
    destructor calls ``std::terminate``: the rank dies by SIGABRT
    ("terminate called without an active exception") after its work was
    done. ``os._exit`` ends every thread at once, with no finalization in
    which a thread could be ended that way. In a launching process it also
    saves the 0.3-0.8 s of tearing torch's modules down after the job.

    ``run_atexit=False`` in a forked child: the handlers it has are its
    parent's (a notebook's), not its own. A rank that failed leaves at once,
    with ``run_atexit=False, join_threads=False``: its output flushed, no
    thread waited for (one may be blocked in a collective its peers never
    join), no handler run (MPI's finalization waits for the other ranks, an
    XLA runtime's for replicas that are gone).
    """
    if join_threads:
        _run_before_join()
        with contextlib.suppress(BaseException):
            _join_threads()
    if run_atexit:
        import atexit

        # Each handler's exception is printed, as at a normal exit, and does
        # not change the exit code.
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(BaseException):
            if stream is not None:
                stream.flush()
    os._exit(code)
