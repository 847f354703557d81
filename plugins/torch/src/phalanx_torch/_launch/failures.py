"""What a node's launch says of failed ranks and reads of them: the line
that says a restart and its cause (phalanx's root-cause rule over the
node's failed ranks, a lost peer told from a failure of its own), a node
lost, the failures of elastic's ``ChildFailedError`` and of the ranks'
error files as core's records, the signal handlers kept, and the errors
that mean node 0's store is gone. Imports no torch at import time."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phalanx_core.launching import RankFailure, root_cause, signal_name


def say(who: str, line: str) -> None:
    sys.stderr.write(f"{who}: {line}\n")
    sys.stderr.flush()


def say_restart(who: str, result: Any, restart: int, max_restarts: int, node_rank: int | None) -> None:
    """Say on stderr which rank failed (phalanx's root-cause rule over every
    failed rank of this node) and that every rank starts again."""
    failures = failures_of(result, node_rank)
    what = "a rank failed"
    if failures:
        first = root_cause(failures)
        killed = signal_name(first.exitcode)
        how = f"killed by {killed}" if killed else f"exit code {first.exitcode}"
        last = (first.traceback or "").strip().splitlines()[-1:]
        what = f"rank {first.rank} failed ({how}{': ' + last[0] if last else ''})"
        if first.raised and first.lost_a_peer:
            # The likeliest cause is the one this node's ranks cannot see.
            said = what_happened(last[0]) if last else ""
            what = (
                f"rank {first.rank} lost a peer ({how}{': ' + said if said else ''}); no rank of "
                "this node failed of itself: the cause is on another node (its output names the rank), "
                "or that node was lost (the next round names it)"
            )
    sys.stderr.write(
        f"{who}: {what}; every rank is stopped and started again (restart {restart} of {max_restarts})\n"
    )
    sys.stderr.flush()


#: What a line of gloo's says besides what happened: where in gloo's
#: source it was raised, and its guess at the cause with its advice to read
#: the other worker's logs ("... a remote worker crashing. Check ...",
#: "... a remote worker hanging or bugs in the application. Check ...").
_GLOO_SOURCE = re.compile(r"\[[^\]\s]*gloo/[^\]\s]*:\d+\] ")
_GLOO_ADVICE = re.compile(r"\. This is typically caused by a remote worker .*$")
#: The port gloo names a lost peer by ("Connection closed by peer [A]:P",
#: "Read error [A]:P"): its bytes swapped (torch 2.13's gloo printed 58084
#: for a peer whose socket ss showed on 58594).
_GLOO_PEER_PORT = re.compile(r"((?:by peer|error) \[[^\]\s]+\]):\d+")


def what_happened(line: str) -> str:
    """A rank's last error line that says it lost a peer, without gloo's
    source location, guess and advice, and the port it names the peer by."""
    return _GLOO_PEER_PORT.sub(r"\1", _GLOO_SOURCE.sub("", _GLOO_ADVICE.sub("", line)))


def lost_words(lost: tuple[int, str], seconds: float) -> str:
    node, host = lost
    return (
        f"node {node} (host {host}) is lost: its launching process stopped beating in the job's store "
        f"{seconds:g} s ago or more (a host lost without a word: its power, its network), and the ranks "
        "wait for it in vain"
    )


@contextlib.contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """Elastic's process layer replaces the handlers of SIGTERM, SIGINT, SIGHUP and
    SIGQUIT as it starts the ranks; put this process's own back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def failures_of(exc: Any, node_rank: int | None) -> list[RankFailure]:
    """Every failed rank of elastic's ChildFailedError, each at the time its
    error file was written where there is one (elastic orders by whole
    seconds, which often names a rank that only lost its peer; the file's
    time is finer), and the ranks of this node that raised but that elastic
    stopped before it saw them fail (:func:`_raised_unseen`).
    ``node_rank``: this node's, in a job of several."""
    failures = []
    host = socket.gethostname() if node_rank is not None else None
    for rank, failure in exc.failures.items():
        when = float(failure.timestamp)
        with contextlib.suppress(OSError):
            when = os.stat(failure.error_file).st_mtime
        traceback_text = _traceback_of(failure.error_file_data)
        failures.append(
            RankFailure(int(rank), failure.exitcode, traceback_text, when, node=node_rank, host=host)
        )
    return failures + _raised_unseen(exc, node_rank)


def _raised_unseen(exc: Any, node_rank: int | None) -> list[RankFailure]:
    """This node's ranks that wrote an error file in the failed attempt (so
    raised: a rank stopped by a signal writes none) but are not among
    ``exc``'s failures. Elastic reports the ranks that had exited when it
    looked and stops the rest: a rank whose exception tore its group down
    may still be exiting when its peer, which only lost it, has exited."""
    known = {int(rank): failure for rank, failure in exc.failures.items()}
    if not known:
        return []
    rank, failure = next(iter(known.items()))
    first = rank - int(failure.local_rank)  # this node's first rank: local ranks are consecutive
    attempt = Path(failure.error_file).parent.parent
    if not attempt.name.startswith("attempt_"):  # not elastic's folder of the attempt's error files
        return []
    unseen = []
    for path in attempt.glob("*/error.json"):
        if path.parent.name.isdigit() and first + int(path.parent.name) not in known:
            unseen += _read_error_file(path, first + int(path.parent.name), node_rank)
    return unseen


def _read_error_file(path: Path, rank: int, node_rank: int | None) -> list[RankFailure]:
    """The failure that rank ``rank``'s error file records (none where it
    cannot be read)."""
    try:
        when = path.stat().st_mtime
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    host = socket.gethostname() if node_rank is not None else None
    return [RankFailure(rank, 1, _traceback_of(data), when, node=node_rank, host=host)]


def _traceback_of(error_file_data: dict[str, Any]) -> str | None:
    """The traceback in a rank's elastic error file (its JSON), if any."""
    message = error_file_data.get("message")
    if isinstance(message, dict):
        text = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
        return str(text) if text else None
    if isinstance(message, str) and message != "<NONE>":
        return message
    return None


def raised_before(logs: Path, ranks: range, node_rank: int | None, before: float) -> list[RankFailure]:
    """This node's ranks that raised in the last attempt before ``before``
    (seconds since the epoch), from the error files they wrote under
    elastic's ``logs`` folder (``.../attempt_<n>/<local rank>/error.json``):
    what the node's own ranks did when the node watch stopped them for
    another node's post (elastic's SignalException then carries none)."""
    files = [path for path in logs.rglob("error.json") if path.parent.parent.name.startswith("attempt_")]
    if not files:
        return []
    last = max(int(path.parent.parent.name.removeprefix("attempt_")) for path in files)
    failures = []
    for path in files:
        if path.parent.parent.name != f"attempt_{last}" or not path.parent.name.isdigit():
            continue
        local = int(path.parent.name)
        if local >= len(ranks):
            continue  # not a rank of this round
        failures += [f for f in _read_error_file(path, ranks[local], node_rank) if f.when < before]
    return failures


def stopped_words(num_nodes: int) -> str:
    return "Every other rank was stopped" + (", on every node" if num_nodes > 1 else "")


def print_elsewhere(failure: RankFailure) -> None:
    """Another node's failure, in the lines its rank would have written
    here: its traceback, each line marked ``[rankN]:``."""
    _print_traceback(failure, f"(on node {failure.node}, host {failure.host})")


def print_if_shortened(failure: RankFailure) -> None:
    """This node's rank whose failure is the job's first, if it wrote its
    error's last line only (it lost a peer: see ``rank_program``): its
    whole traceback, from its error file, marked as its own lines are."""
    if failure.raised and failure.lost_a_peer:
        _print_traceback(failure, "(its traceback, which it left out above: no rank failed before it)")


def _print_traceback(failure: RankFailure, header: str) -> None:
    text = failure.traceback or f"(no traceback; exit code {failure.exitcode})"
    lines = [f"[rank{failure.rank}]: {header}"]
    lines += [f"[rank{failure.rank}]: {line}" for line in text.rstrip().splitlines()]
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()


def store_lost_errors() -> tuple[type[BaseException], ...]:
    """What elastic's launch raises when the job's store stops answering."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    return (RendezvousConnectionError, dist.DistNetworkError)
