"""What a rank runs when a launcher runs a script in every rank (``phalanx
run``, a flat script's ``strategy.launch()``)::

    python -m phalanx_core.launching.rank_program SCRIPT ARGS...
    python -m phalanx_core.launching.rank_program -m MODULE ARGS...

It runs the program as ``python SCRIPT ARGS...`` would, with the
differences that make a rank end the way it should:

- with :data:`~phalanx_core.launching.PARENT_PID_VAR` set to the pid of the
  process that started it, the kernel kills the rank when that process
  dies, even by SIGKILL (:func:`~phalanx_core.launching.die_with_parent`,
  armed before the program starts);
- Ctrl-C ends the rank quietly (exit code 130): the launching process says
  once that the job was interrupted, instead of one traceback per rank;
- where the launcher marks each line a rank writes with the rank
  (:data:`~phalanx_core.launching.LINES_PREFIXED_VAR` set), ``sys.stdout``
  and ``sys.stderr`` pass on whole lines only: a line written in several
  writes, flushed between them, leaves in one write when it ends (a tool
  that reads the rank's output as it comes would otherwise mark each
  piece, and another rank's line could come between them); what is left
  without a line end goes at exit (so a progress bar that redraws its line
  with ``\r`` shows once its line ends);
- a program that raises prints its traceback (from the program's first
  frame; for a launcher that asks, only the last line of an error that a
  peer's failure causes) and leaves at once with exit code 1: no thread joined, no
  ``atexit`` handler run. Its peers may be blocked in a collective it will
  never join, and a teardown that waits for them (MPI's finalization, an
  XLA runtime's) would hang the rank, and with it the job;
- a program that ends leaves with :func:`~phalanx_core.launching.exit_process`:
  its threads joined, its ``atexit`` handlers run, its namespace cleared
  (unclosed files flushed) and its output flushed, then ``os._exit`` with
  the program's exit code, so Python's finalization, in which gloo's worker
  threads abort a process, never runs.

A launcher with more to do around the program (phalanx-torch's records the
traceback in torch elastic's error file) calls :func:`run_as_rank` from a
program of its own. Imports no backend.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import sys
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn, TextIO

from ._failures import PEER_LOST_MARKS, PEER_LOST_SHORTENED
from ._ranks import (
    LINES_PREFIXED_VAR,
    PARENT_PID_VAR,
    RANK_MACHINERY,
    die_with_parent,
    exit_code_of,
    exit_process,
    is_rank_machinery,
    run_program,
)

__all__ = ["run_as_rank"]

#: Its frames are left out of tracebacks and hang reports.
globals()[RANK_MACHINERY] = True


def run_as_rank(
    argv: list[str],
    *,
    on_error: Callable[[BaseException], None] | None = None,
    peer_lost_in_one_line: bool = False,
) -> NoReturn:
    """Run ``python *argv`` as this rank's program and end the process as
    the module's docstring says. ``on_error`` is called with the program's
    exception before its traceback is printed. ``peer_lost_in_one_line``:
    an error that a peer's failure causes (:data:`PEER_LOST_MARKS`) prints
    its last line only, for a launcher that prints the whole traceback
    (from ``on_error``'s record) where that rank's failure is the job's
    first: the consequences of one rank's failure are then a line each."""
    parent = os.environ.get(PARENT_PID_VAR, "")
    if parent.isdigit() and int(parent) == os.getppid():
        die_with_parent(int(parent))
    if sys.path and sys.path[0] in ("", os.getcwd()):
        # python -m put the working directory first; python SCRIPT would
        # not (the program's own folder goes there instead).
        del sys.path[0]
    if os.environ.get(LINES_PREFIXED_VAR):
        sys.stdout, sys.stderr = _WholeLines(sys.stdout), _WholeLines(sys.stderr)
    code, failed = _run(argv, on_error, peer_lost_in_one_line)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, _WholeLines):
            stream.end()
    if failed:
        exit_process(code, run_atexit=False, join_threads=False)
    exit_process(code)


def _run(
    command: list[str], on_error: Callable[[BaseException], None] | None, peer_lost_in_one_line: bool
) -> tuple[int, bool]:
    """Run the program; return its exit code as ``python`` would set it, and
    whether it raised."""
    namespace: dict[str, object] = {}
    try:
        namespace = run_program(command)
    except SystemExit as exc:
        return exit_code_of(exc.code), False
    except KeyboardInterrupt:
        return 130, False
    except BaseException as exc:  # noqa: BLE001 - the program's error, shown as python shows it
        if on_error is not None:
            with contextlib.suppress(BaseException):
                on_error(exc)
        last = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        if peer_lost_in_one_line and any(mark in last.splitlines()[-1] for mark in PEER_LOST_MARKS):
            sys.stderr.write(f"{last} {PEER_LOST_SHORTENED}\n")
            return 1, True
        # The hook prints the exception's own traceback, whatever it is given.
        exc.__traceback__ = _from_program(exc.__traceback__)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1, True
    finally:
        # What the interpreter's finalization would do: drop the program's
        # globals (closing its files, running its finalizers) while every
        # thread can still take the GIL.
        namespace.clear()
        with contextlib.suppress(BaseException):
            gc.collect()
    return 0, False


class _WholeLines(io.TextIOBase):
    """A text stream that passes whole lines on to ``stream``, each in one
    write; ``flush()`` keeps a line not yet ended, :meth:`end` sends it."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._open = ""

    def write(self, text: str) -> int:
        done, end, rest = (self._open + text).rpartition("\n")
        if end:
            self._stream.write(done + end)
            self._stream.flush()
        self._open = rest
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def end(self) -> None:
        if self._open:
            self._stream.write(self._open + "\n")
            self._open = ""
        self._stream.flush()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._stream.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return self._stream.errors

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    def __getattr__(self, name: str) -> Any:  # encoding, errors, buffer, ...
        return getattr(self._stream, name)


def _from_program(tb: TracebackType | None) -> TracebackType | None:
    """The traceback from the program's first frame on (this module's,
    runpy's and :func:`run_program`'s frames left out), as python would
    print it."""
    start = tb
    while tb is not None:
        if not is_rank_machinery(tb.tb_frame):
            return tb
        tb = tb.tb_next
    return start


if __name__ == "__main__":
    run_as_rank(sys.argv[1:])
