"""Hang reports: what a rank says when it has waited too long.

A collective that waits for a rank that never comes waits until its
timeout (30 minutes by default), silently. A :class:`HangWatch` in every
rank says much earlier what is going on: when an operation the strategy
runs (a collective, ``backward`` with DDP's gradient reduction in it,
``optimizer_step``, ``setup``, a checkpoint) has waited longer than the
report interval, the rank prints, once, which operation it waits in, for
how long, and its Python stack. Where the collective gives a
:class:`Board` (a key-value store the ranks share, such as torch's
rendezvous store), every other rank then prints where it is, and the
lowest waiting rank prints which ranks have not arrived. The timeout
itself is unchanged: a report is a diagnosis, not a failure.

Costs nothing measurable: entering and leaving an operation sets one
attribute each, and the watching thread wakes once a second (or more
rarely) to read it.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TextIO, TypeVar

T = TypeVar("T")

__all__ = [
    "DEFAULT_HANG_REPORT",
    "HANG_REPORT_VAR",
    "Board",
    "HangWatch",
    "hang_report_seconds",
    "watch_methods",
]

#: Seconds an operation waits before its rank reports it (``hang_report=``).
DEFAULT_HANG_REPORT = 300.0
#: Sets the default of ``hang_report`` (``phalanx run --hang-report``).
HANG_REPORT_VAR = "PHALANX_HANG_REPORT"


class Board(Protocol):
    """A key-value store every rank of the job reaches, for hang reports.
    Every call returns promptly: it never waits for a key to appear."""

    def post(self, key: str, value: str) -> None:
        """Set ``key`` to ``value``."""

    def read(self, key: str) -> str | None:
        """The value of ``key``, or ``None`` when nobody has set it."""

    def add(self, key: str, amount: int) -> int:
        """Add ``amount`` to the counter ``key`` (0 when new); return it."""

    def close(self) -> None:
        """Release the connection."""


def hang_report_seconds(value: object, *, where: str) -> float:
    """``hang_report`` checked: seconds above 0, or 0 for never (then
    ``float('inf')``). A string is read as a number (the variable)."""
    seconds: object = value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            seconds = float(value)
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds >= 0:
        from .errors import MisconfigurationError

        raise MisconfigurationError(
            f"{where}: hang_report={value!r}; give the seconds an operation may wait before its rank "
            f"reports where every rank is (default {DEFAULT_HANG_REPORT:g}), or 0 for no reports"
        )
    return float(seconds) if seconds else float("inf")


class HangWatch:
    """Watches the operations of one rank; see the module's docstring.

    ``enter(name)`` / ``leave(token)`` bracket an operation (nested ones
    count as the innermost); ``start()`` starts the watching thread and
    ``stop()`` stops it. ``stream`` is where reports go (this process's
    stderr by default); ``timeout`` is the collective's, which the report
    quotes.
    """

    def __init__(
        self,
        after: float,
        rank: int,
        world_size: int,
        board: Board | None = None,
        stream: TextIO | None = None,
        timeout: float | None = None,
    ) -> None:
        self.after = after
        self.timeout = timeout
        self.rank = rank
        self.world_size = world_size
        self.board = board
        self.stream = stream
        #: (operation, monotonic start, call number, thread id) or None.
        self.current: tuple[str, float, int, int] | None = None
        self._calls = itertools.count(1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = min(1.0, after / 4)

    # -- the rank's side -------------------------------------------------

    def enter(self, operation: str) -> tuple[str, float, int, int] | None:
        """Mark ``operation`` as started; return what to give ``leave()``."""
        outer = self.current
        self.current = (operation, time.monotonic(), next(self._calls), threading.get_ident())
        return outer

    def leave(self, outer: tuple[str, float, int, int] | None) -> None:
        self.current = outer

    # -- the watching thread ------------------------------------------------

    def start(self) -> None:
        if self._thread is None and self.after != float("inf"):
            self._thread = threading.Thread(target=self._watch, name="phalanx-hang-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        self._thread = None
        if self.board is not None:
            with contextlib.suppress(Exception):
                self.board.close()
            self.board = None

    def _watch(self) -> None:
        reported = 0  # the call number of the last operation this rank reported
        answered = 0  # the last round of reports this rank answered
        summary_at: float | None = None
        while not self._stop.wait(self._tick):
            current, now = self.current, time.monotonic()
            if current is not None and now - current[1] >= self.after and current[2] != reported:
                reported = current[2]
                answered = self._report(current, now, waiting=True)
                summary_at = now + 2 * self._tick + 1.0  # time for the others to answer
            if self.board is None:
                continue
            try:
                rounds = self.board.add("reports", 0)
                if rounds > answered:
                    answered = rounds
                    self._report(self.current, time.monotonic(), waiting=False, round_=rounds)
                if summary_at is not None and time.monotonic() >= summary_at:
                    summary_at = None
                    self._summarise(answered)
            except Exception:  # noqa: BLE001 - the store is gone (the job is ending): report alone
                self.board = None

    def _report(
        self,
        current: tuple[str, float, int, int] | None,
        now: float,
        *,
        waiting: bool,
        round_: int | None = None,
    ) -> int:
        """Print where this rank is; post it for the others. Returns the round."""
        who = f"rank {self.rank} of {self.world_size}"
        if current is None:
            head = f"phalanx: {who} is not in any operation of the strategy"
            thread_id = threading.main_thread().ident
            state = "-"
        else:
            operation, since, number, thread_id = current
            head = f"phalanx: {who} has waited {now - since:.0f} s in {operation} (its call {number})"
            state = f"{operation}|{number}|{now - since:.0f}"
        if waiting:
            head += f", longer than the report interval ({self.after:g} s"
            head += f"; it fails at the timeout, {self.timeout:g} s)" if self.timeout else ")"
            if self.board is not None:
                with contextlib.suppress(Exception):
                    round_ = self.board.add("reports", 1)
        elif round_ is not None:
            head += " (another rank reported a wait)"
        if self.board is not None and round_ is not None:
            with contextlib.suppress(Exception):
                self.board.post(f"rank/{self.rank}", f"{round_}|{'wait' if waiting else 'seen'}|{state}")
        self._print(head + ". Its Python stack:\n" + _stack(thread_id))
        return round_ or 0

    def _summarise(self, round_: int) -> None:
        """The lowest waiting rank says which ranks have not arrived."""
        assert self.board is not None
        states: dict[int, list[str] | None] = {}
        for rank in range(self.world_size):
            raw = self.board.read(f"rank/{rank}")
            parts = raw.split("|") if raw else None
            states[rank] = parts if parts and parts[0] == str(round_) else None
        waiting = {r: s for r, s in states.items() if s is not None and s[1] == "wait"}
        if not waiting or min(waiting) != self.rank:
            return
        operation = waiting[self.rank][2]
        same = [r for r, s in waiting.items() if s[2] == operation]
        lines = [f"phalanx: ranks {same} wait in {operation}; the ranks that have not arrived:"]
        for rank, state in states.items():
            if rank in same:
                continue
            if state is None:
                lines.append(f"  rank {rank}: no answer (its process may be dead, or hold the GIL)")
            elif state[2] == "-":
                lines.append(f"  rank {rank}: in no operation of the strategy (its stack is in its report)")
            else:
                lines.append(f"  rank {rank}: in {state[2]} (its call {state[3]}) for {state[4]} s")
        if len(lines) == 1:
            lines.append("  none: every rank waits there (a backend or network problem?)")
        elif any(s is not None and s[2] not in ("-", operation) for s in states.values()):
            lines.append(
                "  the ranks wait in different calls: every rank makes the strategy's calls in the same "
                "order, and a call made on some ranks only (a save or an evaluation under `if rank == 0:`, "
                "or under a decision made from one rank's numbers) waits for the others forever; make such "
                "a decision every rank's first: `improved = strategy.broadcast(improved)` (rank 0's), or "
                "`strategy.all_reduce(tensor, op='max')`"
            )
        self._print("\n".join(lines))

    def _print(self, text: str) -> None:
        stream = self.stream or sys.stderr
        with contextlib.suppress(Exception):
            stream.write(text.rstrip("\n") + "\n")
            stream.flush()


def _stack(thread_id: int | None) -> str:
    """The Python stack of a thread, without the frames of the machinery
    that runs a rank (runpy, a launcher's rank program: see
    :data:`phalanx_core.launching.RANK_MACHINERY`) and the watch's own
    wrappers."""
    from .launching import is_rank_machinery

    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "  (not available)\n"
    frames = []
    while frame is not None:
        code = frame.f_code
        watched = code.co_name == "watched" and code.co_filename == __file__
        if not (is_rank_machinery(frame) or code.co_filename.startswith("<frozen") or watched):
            frames.append((frame, frame.f_lineno))
        frame = frame.f_back
    return "".join(traceback.StackSummary.extract(reversed(frames)).format())


def watch_methods(cls: type, names: Sequence[str], operations: Sequence[str]) -> None:
    """Wrap the methods of ``names`` that ``cls`` defines itself so that
    the strategy's :class:`HangWatch` (its ``_hang_watch``) sees them; an
    operation of ``operations`` that fails is first checked with the
    strategy's ``_not_set_up``."""
    for name in names:
        method = cls.__dict__.get(name)
        if callable(method) and not getattr(method, "_phalanx_watched", False):
            setattr(cls, name, _watched(name, method, name in operations))


def _watched(name: str, method: Callable[..., T], operation: bool) -> Callable[..., T]:

    @functools.wraps(method)
    def watched(self: Any, *args: Any, **kwargs: Any) -> T:
        watch = self._hang_watch
        outer = watch.enter(name) if watch is not None else None
        try:
            return method(self, *args, **kwargs)
        except Exception:
            if operation:
                # Before set-up the backend's own words mislead ("Default
                # process group has not been initialized"): say why.
                self._not_set_up(name)
            raise
        finally:
            if watch is not None:
                watch.leave(outer)

    watched._phalanx_watched = True  # type: ignore[attr-defined]
    return watched
