"""How a launching process stops the ranks it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Collection, Sequence
from typing import Any

__all__ = ["CAUSE_GRACE", "STOP_GRACE", "check_count", "signal_group", "stop_processes"]

#: Seconds a rank has to exit after SIGTERM before it gets SIGKILL, in
#: every launcher.
STOP_GRACE = 5.0
#: Seconds a launcher waits for the failure that caused the ones it saw
#: first, while those only say that a peer was lost
#: (:attr:`RankFailure.lost_a_peer <phalanx_core.launching.RankFailure.lost_a_peer>`):
#: a rank that raises tears its group down on the way out, so its peers'
#: errors can arrive before its own.
CAUSE_GRACE = 2.0


def check_count(launcher: str, name: str, value: object) -> int:
    """``value`` if it is an int of at least 1 (``num_processes``,
    ``num_nodes``); else the error that says so, naming ``launcher``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        from ..errors import MisconfigurationError

        raise MisconfigurationError(f"launcher {launcher!r}: {name}={value!r}; expected an int of at least 1")
    return value


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads (a rank and what it
    started), or to ``pid`` alone if it leads none; a process already gone
    is no error."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _alive(process: Any) -> bool:
    if isinstance(process, subprocess.Popen):
        return process.poll() is None
    return bool(process.is_alive())


def _wait(process: Any, timeout: float) -> None:
    if isinstance(process, subprocess.Popen):
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout)
    else:
        process.join(timeout)


def stop_processes(
    processes: Sequence[Any], *, grace: float = STOP_GRACE, spare: Collection[int] = ()
) -> list[int]:
    """Stop every process still running and what its group holds: SIGTERM
    to each one's group, SIGKILL to those left after ``grace`` seconds, and
    SIGKILL to whatever their groups still hold. ``processes`` are
    ``subprocess.Popen`` or ``multiprocessing`` processes; those at the
    indices in ``spare`` are exiting on their own: they get the grace but
    no SIGTERM. Bounded: returns after at most about ``2 * grace`` seconds,
    with the pids that had to be killed."""
    for index, process in enumerate(processes):
        if index not in spare and _alive(process):
            signal_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for process in processes:
        _wait(process, max(0.0, deadline - time.monotonic()))
    killed = []
    for process in processes:
        if _alive(process):
            killed.append(process.pid)
            signal_group(process.pid, signal.SIGKILL)
        _wait(process, grace)  # bounded: a process stuck in the kernel cannot even be killed
        # What the rank started and left in its group (a worker of its own).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
    return killed
