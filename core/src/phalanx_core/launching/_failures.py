"""How a launcher reports a failed job: one record per failed rank, one rule
for which came first, one error that keeps them all."""

from __future__ import annotations

import signal
import textwrap
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import WorkerFailedError

__all__ = [
    "EXCERPT_LINES",
    "PEER_LOST_MARKS",
    "PEER_LOST_SHORTENED",
    "RankFailure",
    "root_cause",
    "signal_name",
    "warn_died_after_delivery",
    "worker_failed",
]

#: Text in the last line of a traceback whose error a peer's failure causes
#: (a collective that timed out, a connection the peer's death closed): such
#: a rank lost a peer, and is never taken for the cause while another rank
#: failed otherwise. A backend adds its own with ``peer_lost_marks=``.
PEER_LOST_MARKS: tuple[str, ...] = (
    "CollectiveTimeoutError",
    "CollectiveConnectionError",
    "Connection closed by peer",
    "Connection reset by peer",
    "failed to pass monitoredBarrier",
    "DistNetworkError",
)
#: What a rank that lost a peer writes after its error's last line, in
#: place of its traceback, where its launcher prints the whole traceback
#: of the job's first failure (``run_as_rank(peer_lost_in_one_line=True)``).
PEER_LOST_SHORTENED = "(this rank lost a peer; its traceback is shown only if no rank failed before)"
#: Lines of a traceback quoted in the error's message (all of it is in
#: ``WorkerFailedError.traceback``).
EXCERPT_LINES = 30


def signal_name(exitcode: int | None, *, shell: bool = False) -> str | None:
    """The name of the signal that ended a process with ``exitcode``: a
    negative code (``-9``, as ``subprocess`` and ``multiprocessing`` give
    it), or with ``shell=True`` also 128 + N (``137``, as a shell that ran
    the process reports it). ``None`` when no signal did."""
    if exitcode is None or exitcode == 0:
        return None
    number = -exitcode if exitcode < 0 else exitcode - 128 if shell and exitcode > 128 else 0
    if not number:
        return None
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class RankFailure:
    """What a launcher knows about one rank that failed.

    Attributes:
        rank: its global rank.
        exitcode: how its process ended: the exit code, negative for a
            signal (``-9``); ``None`` where it could not be seen.
        traceback: the text of the exception it raised, where it lived to
            write it.
        when: when it failed, in seconds since the epoch, as near as the
            launcher can tell (the time the rank wrote its error, else the
            time its death was seen).
        started: ``False`` for a rank known to have failed before it could
            run the job's function (a spawned process that failed while
            importing the main script).
        node, host: where it ran, where the launcher knows.
        died: for a rank whose process died where its exit status cannot
            be seen (a Ray actor), the launcher's words about it.
    """

    rank: int
    exitcode: int | None = None
    traceback: str | None = None
    when: float = 0.0
    started: bool = True
    node: int | None = None
    host: str | None = None
    died: str | None = None
    peer_lost_marks: tuple[str, ...] = field(default=(), compare=False, repr=False)

    @property
    def signal(self) -> str | None:
        """The name of the signal that killed it, if one did."""
        return signal_name(self.exitcode)

    @property
    def raised(self) -> bool:
        """Whether it left a traceback."""
        return bool(self.traceback) and self.traceback != "<NONE>"

    @property
    def lost_a_peer(self) -> bool:
        """Whether its error is one that a peer's failure causes
        (:data:`PEER_LOST_MARKS`, and the backend's own marks)."""
        last = (self.traceback or "").strip().splitlines()[-1:]
        return bool(last) and any(mark in last[0] for mark in (*PEER_LOST_MARKS, *self.peer_lost_marks))

    def order(self) -> tuple[int, float, int]:
        """Its place in :func:`root_cause`'s rule: the smaller, the likelier
        the cause. Four kinds, then time, then rank:

        0. killed by a signal other than SIGTERM (SIGKILL from the
           out-of-memory killer, SIGSEGV), or dead where its status cannot
           be seen: a cause, never a consequence;
        1. raised anything but a lost peer's error (even if SIGTERM reached
           it as it exited), or exited non-zero without a word;
        2. raised a lost peer's error: a rank that raises tears its group
           down on the way out, so its peers' errors can be written before
           its own;
        3. stopped by SIGTERM: how launchers stop ranks after a failure.
        """
        if self.died is not None:
            kind = 0
        elif self.raised and not self.lost_a_peer:
            kind = 1
        elif self.exitcode == -signal.SIGTERM:
            kind = 3
        elif self.signal is not None:
            kind = 0
        elif self.lost_a_peer:
            kind = 2
        else:
            kind = 1
        return kind, self.when, self.rank

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON), for a record that crosses nodes."""
        data = asdict(self)
        data["peer_lost_marks"] = list(self.peer_lost_marks)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankFailure:
        return cls(**{**data, "peer_lost_marks": tuple(data.get("peer_lost_marks", ()))})


def root_cause(failures: Iterable[RankFailure]) -> RankFailure:
    """The failure that came first by :meth:`RankFailure.order`, the rule
    every launcher uses. Raises ``ValueError`` for no failures."""
    found = sorted(failures, key=RankFailure.order)
    if not found:
        raise ValueError("root_cause() of no failures")
    return found[0]


def worker_failed(
    launcher: str,
    failures: Sequence[RankFailure],
    world_size: int,
    *,
    stopped: str = "Every other rank was stopped",
) -> WorkerFailedError:
    """The :class:`~phalanx_core.WorkerFailedError` for a job whose ranks
    failed: the root cause (:func:`root_cause`) named in four parts (what
    failed, which rank, where and how; its traceback; what was done to the
    others, ``stopped``; what to do), with every failure kept in
    ``.failures``, the root cause first."""
    ordered = sorted(failures, key=RankFailure.order)
    first = root_cause(ordered)
    where = ""
    if first.node is not None:
        where = f" on node {first.node}" + (f" (host {first.host})" if first.host else "")
    who = f"rank {first.rank} of {world_size}{where} (launcher {launcher!r})"
    if first.died is not None:
        how = "it died without a Python traceback, and how it ended cannot be seen from here"
    elif first.signal is not None:
        how = f"killed by {first.signal} (exit code {first.exitcode})"
    elif first.exitcode is None:
        how = "raising" if first.raised else "with an exit code that could not be read"
    else:
        how = f"with exit code {first.exitcode}"
    lines = [f"the launched job failed: {who} failed first, {how}."]
    if first.raised:
        tb = (first.traceback or "").rstrip().splitlines()
        cut = len(tb) > EXCERPT_LINES
        lines.append(
            f"Its traceback{' (last lines; all of it is in .traceback)' if cut else ''}:\n"
            + textwrap.indent("\n".join(tb[-EXCERPT_LINES:]), "    ")
        )
        todo = f"Fix the error rank {first.rank} raised, shown above"
    elif first.died is not None:
        todo = first.died
    elif first.exitcode == -signal.SIGKILL:
        todo = (
            "It had no chance to write a traceback: SIGKILL usually comes from the out-of-memory "
            "killer or a scheduler; check the memory use and the system log (dmesg)"
        )
    elif not first.started:
        todo = (
            "It failed before it could run fn: a process that launcher 'spawn' starts first imports "
            "your main script again (as __mp_main__) and unpickles fn, and the error that stopped it "
            "is printed above. The usual cause is code that resolves and launches outside "
            '`if __name__ == "__main__":`'
        )
    elif first.signal is not None:
        todo = (
            "It left no Python traceback: a crash in native code; its output above may say more, "
            "and `python -X faulthandler` prints the Python stack of such a crash"
        )
    else:
        todo = (
            "It left no Python traceback: it exited without raising (sys.exit, os._exit, or a crash "
            "in native code) or before it could run fn; its own output above may say why"
        )
    lines.append(f"{stopped}. {todo.rstrip('.')}.")
    return WorkerFailedError(
        "\n".join(lines),
        rank=first.rank,
        exitcode=None if first.died is not None else first.exitcode,
        signal=first.signal,
        traceback=first.traceback if first.raised else None,
        node=first.node,
        host=first.host,
        failures=ordered,
    )


def warn_died_after_delivery(launcher: str, failure: RankFailure, world_size: int) -> None:
    """Warn about a rank that handed its result back and then died by a
    signal while exiting: its work is done and its result is good, so the
    launch returns; the death is reported, never hidden."""
    warnings.warn(
        f"rank {failure.rank} of {world_size} (launcher {launcher!r}) returned its result, then was "
        f"killed by {failure.signal} while exiting (exit code {failure.exitcode}); the launch returns "
        "every rank's result. If it happens again, run with `python -X faulthandler` to see where",
        RuntimeWarning,
        stacklevel=3,
    )
