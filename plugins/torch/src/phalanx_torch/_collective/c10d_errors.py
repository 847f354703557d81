"""What c10d's errors mean: its messages read for a rank that could not be
reached, a timeout and the ranks that did not arrive, and raised again as
the contract's errors, which say what to do."""

from __future__ import annotations

import re

from phalanx_core import CollectiveConnectionError, CollectiveTimeoutError, timed_out
from phalanx_core.network import is_loopback

_TIMED_OUT = re.compile(r"timed?[ _-]?out|failed to pass monitoredBarrier", re.IGNORECASE)
_UNREACHABLE = re.compile(
    r"(?P<what>Connection refused|No route to host|Network is unreachable|Host is unreachable)"
    r", remote=(?P<address>\[?[0-9a-fA-F:.]+\]?:\d+)",
    re.IGNORECASE,
)
_MISSING_RANKS = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")
_CLOSED = re.compile(
    r"(?P<what>Connection closed by peer|Connection reset by peer)"
    r"[^\[\d]*(?P<address>\[?[0-9a-fA-F:.]+\]?:\d+)?",
    re.IGNORECASE,
)
#: What a barrier's error adds: the likeliest reason a rank is not there.
EVERY_RANK_CALLS = (
    "Every rank calls barrier(), and every call that waits for the others: save_checkpoint and "
    "load_checkpoint too (an `if rank == 0: save` leaves the other ranks out)"
)


def translate(exc: BaseException, operation: str, *, where: str, timeout: float) -> BaseException:
    """``exc``, which c10d raised in ``operation``, as the contract's error
    where its message says what happened (a rank unreachable, a timeout),
    else ``exc`` itself. ``where`` is the rank in words (``gloo, rank 1 of 2``)."""
    message = str(exc)
    refused = _UNREACHABLE.search(message)
    if refused:
        what, address = refused.group("what"), refused.group("address")
        host = address.rsplit(":", 1)[0].strip("[]")
        why = (
            f" {host} is a loopback address: the rank there listens where no other host reaches it "
            "(GLOO_SOCKET_IFNAME names a loopback interface there, or its host name maps to loopback "
            "and no interface was chosen). Give the collective interface= (or set GLOO_SOCKET_IFNAME) "
            "on every node: the interface that joins the nodes"
            if is_loopback(host)
            else " Check that the rank there is running, and that no firewall stands between the hosts"
        )
        return CollectiveConnectionError(
            f"{operation}() on the 'torch' collective ({where}) could not connect to another rank "
            f"at {address}: {what}.{why}",
            operation=operation,
        )
    closed = None if _TIMED_OUT.search(message) else _CLOSED.search(message)
    if closed:
        # The host only: gloo's pair names its peer's port with its bytes
        # swapped (torch 2.13: 58084 for the peer's 58594, as ss showed it).
        address = closed.group("address")
        at = f" at {address.rsplit(':', 1)[0].strip('[]')}" if address else ""
        hint = f" {EVERY_RANK_CALLS}" if operation == "barrier" else ""
        return CollectiveConnectionError(
            f"{operation}() on the 'torch' collective ({where}) lost its connection to the rank{at}: "
            f"{closed.group('what')}. That rank's process ended (it failed, was killed, or left "
            f"{operation}() out and exited); its own error says why.{hint}",
            operation=operation,
        )
    if not _TIMED_OUT.search(message):
        return exc
    missing = _MISSING_RANKS.search(message)
    ranks = tuple(int(r) for r in missing.group(1).replace(" ", "").split(",") if r) if missing else None
    return timed_out(
        "torch",
        operation,
        timeout,
        where=where,
        then="raise timeout= if the work is just slow",
        missing_ranks=ranks or None,
    )


def left_barrier(translated: BaseException, waited: float, *, where: str, timeout: float) -> BaseException:
    """gloo's monitored barrier says "failed to pass ... in <timeout>"
    also when the missing ranks closed their connections long before
    (they exited): say that, instead of a timeout that did not happen."""
    if not isinstance(translated, CollectiveTimeoutError) or waited >= 0.9 * timeout:
        return translated
    ranks = translated.missing_ranks
    who = f"ranks {list(ranks)}" if ranks else "a rank"
    return CollectiveTimeoutError(
        f"barrier() on the 'torch' collective ({where}) "
        f"failed after {waited:.1f} s: {who} left without calling it (exited, or failed). {EVERY_RANK_CALLS}",
        operation="barrier",
        timeout=timeout,
        missing_ranks=ranks,
    )
