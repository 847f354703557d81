"""What every rank of ``phalanx run`` and of the ``subprocess`` launcher runs:
``python -m phalanx_torch._rank_program SCRIPT ARGS...`` (or ``-m MODULE
ARGS...``). It runs the program as ``python SCRIPT ARGS...`` would, with
three differences that make a rank end the way it should:

- the kernel kills the rank when the launching process dies, even by
  SIGKILL (``PR_SET_PDEATHSIG``, armed before the program starts);
- Ctrl-C ends the rank quietly (exit code 130): the launching process says
  once that the job was interrupted, instead of one traceback per rank;
- the rank ends with :func:`~phalanx_core.launching.exit_process` once the
  program is done: its threads joined, its ``atexit`` handlers run, its
  namespace cleared (unclosed files flushed) and its output flushed, then
  ``os._exit`` with the program's exit code. Python's finalization, in
  which gloo's worker threads abort the process (see ``exit_process``),
  never runs.

Imports no torch itself; the program does.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from types import TracebackType
from typing import NoReturn

from phalanx_core.launching import (
    RANK_MACHINERY,
    die_with_parent,
    exit_code_of,
    exit_process,
    is_rank_machinery,
    run_program,
)

from ._ranks import _LAUNCHER_PID_VAR

#: Its frames are left out of tracebacks and hang reports.
globals()[RANK_MACHINERY] = True


def main(argv: list[str]) -> NoReturn:
    launcher = os.environ.get(_LAUNCHER_PID_VAR, "")
    if launcher.isdigit() and int(launcher) == os.getppid():
        die_with_parent(int(launcher))
    if sys.path and sys.path[0] in ("", os.getcwd()):
        # python -m put the working directory first; python SCRIPT would
        # not (the program's own folder goes there instead).
        del sys.path[0]
    code = _run(argv)
    exit_process(code)


def _run(command: list[str]) -> int:
    """Run the program; return its exit code as ``python`` would set it."""
    namespace: dict[str, object] = {}
    try:
        namespace = run_program(command)
    except SystemExit as exc:
        return exit_code_of(exc.code)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # noqa: BLE001 - the program's error, shown as python shows it
        _record(exc)
        sys.excepthook(type(exc), exc, _from_program(exc.__traceback__))
        return 1
    finally:
        # What the interpreter's finalization would do: drop the program's
        # globals (closing its files, running its finalizers) while every
        # thread can still take the GIL.
        namespace.clear()
        with contextlib.suppress(BaseException):
            gc.collect()
    return 0


def _from_program(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the program's first frame on (this module's and
    runpy's and core's ``run_program``'s frames left out), as python would
    print it."""
    start = tb
    while tb is not None:
        if not is_rank_machinery(tb.tb_frame):
            return tb
        tb = tb.tb_next
    return start


def _record(exc: BaseException) -> None:
    """Leave the traceback in torch elastic's error file, where the
    launching process reads it, unless the failing launch left it there."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    with contextlib.suppress(Exception):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)


if __name__ == "__main__":
    main(sys.argv[1:])
