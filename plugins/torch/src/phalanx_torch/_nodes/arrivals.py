"""Nodes meeting at node 0's store once (a job of several nodes without
restarts): each node says it arrived, node 0 waits for every one, and a
node that never comes is named, on every node, after a bounded wait that
says what it waits for as it goes (never a silent ``rendezvous_timeout``).

Imports torch when called."""

from __future__ import annotations

import datetime
import socket
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx_core import NodeLostError

from . import job_keys

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import Store

__all__ = ["FIRST_SAY", "SAY_EVERY", "meet"]

#: Seconds before a waiting node first says what it waits for on stderr,
#: and between the lines after that.
FIRST_SAY, SAY_EVERY = 5.0, 30.0

_POLL = 0.2


def meet(
    *,
    node_rank: int,
    num_nodes: int,
    address: str,
    port: int,
    timeout: float,
    host_store: Callable[[], Any],
    say: Callable[[str], None] | None = None,
) -> Any:
    """Meet the other nodes at ``address:port``; return the store (hosted
    here by ``host_store()`` on node 0, a client elsewhere) once every node
    has arrived. Raises :class:`~phalanx_core.NodeLostError` naming the
    nodes that did not come within ``timeout`` seconds (every node raises
    the same), or node 0 when it never answered."""
    import torch.distributed as dist

    say = say or _stderr
    deadline = time.monotonic() + timeout
    where = f"{address}:{port}"
    if node_rank == 0:
        store = host_store()
        store.set(job_keys.arrived(0), socket.gethostname())
        expected = [job_keys.arrived(node) for node in range(1, num_nodes)]
        next_say = time.monotonic() + FIRST_SAY
        while not store.check(expected):
            now = time.monotonic()
            missing = [node for node in range(1, num_nodes) if not store.check([job_keys.arrived(node)])]
            if now > deadline:
                message = _never_came(missing, num_nodes, where, timeout)
                store.set(job_keys.MISSING, message)
                _linger_for_readers(store, num_nodes)
                raise NodeLostError(message, node=missing[0], address=where)
            if now > next_say:
                say(_waiting(missing, num_nodes, where, deadline - now))
                next_say = now + SAY_EVERY
            time.sleep(_POLL)
        store.set(job_keys.MET, "1")
        return store
    store = _connect(dist, address, port, deadline, where, say)
    store.set(job_keys.arrived(node_rank), socket.gethostname())
    next_say = time.monotonic() + FIRST_SAY
    while not store.check([job_keys.MET]):
        if store.check([job_keys.MISSING]):
            message = store.get(job_keys.MISSING).decode()
            store.add(job_keys.MISSING_READ, 1)
            raise NodeLostError(message, node=-1, address=where)
        now = time.monotonic()
        if now > deadline + 5 * _POLL:  # node 0 says who is missing; it may be node 0 that went
            raise NodeLostError(
                f"node {node_rank} reached node 0's store at {where}, but the nodes did not all meet "
                f"within rendezvous_timeout={timeout:g} s and node 0 said nothing more: node 0 is gone",
                node=0,
                address=where,
            )
        if now > next_say:
            say(f"node {node_rank} waits at {where} for every node to arrive; {deadline - now:.0f} s left")
            next_say = now + SAY_EVERY
        time.sleep(_POLL)
    return store


def _connect(
    dist: Any, address: str, port: int, deadline: float, where: str, say: Callable[[str], None]
) -> Any:
    next_say = time.monotonic() + FIRST_SAY
    while True:
        left = deadline - time.monotonic()
        try:
            return dist.TCPStore(
                address, port, is_master=False, timeout=datetime.timedelta(seconds=max(1.0, min(left, 5.0)))
            )
        except (RuntimeError, OSError) as exc:
            now = time.monotonic()
            if now > deadline:
                raise NodeLostError(
                    f"node 0 never answered at {where} within rendezvous_timeout ({_first_line(exc)}): "
                    "start phalanx run on node 0 too (--node-rank 0), with the same --main-address "
                    "and --main-port on every node, and check that this host reaches that address",
                    node=0,
                    address=where,
                ) from None
            if now > next_say:
                say(f"waiting for node 0 at {where} (not answering yet); {deadline - now:.0f} s left")
                next_say = now + SAY_EVERY


def _never_came(missing: list[int], num_nodes: int, where: str, timeout: float) -> str:
    names = ", ".join(map(str, missing))
    return (
        f"node{'s' if len(missing) > 1 else ''} {names} of {num_nodes} never arrived at node 0's store "
        f"({where}) within rendezvous_timeout={timeout:g} s: {'their' if len(missing) > 1 else 'its'} "
        "phalanx run failed before meeting the others, was not started, or cannot reach this address "
        "(start it with --node-rank and the same --main-address / --main-port; a job that should go "
        "on without a node needs --num-nodes MIN:MAX)"
    )


def _waiting(missing: list[int], num_nodes: int, where: str, left: float) -> str:
    names = ", ".join(map(str, missing))
    return (
        f"node 0 waits at {where} for node{'s' if len(missing) > 1 else ''} {names} "
        f"({num_nodes - len(missing)} of {num_nodes} arrived); {left:.0f} s left of rendezvous_timeout"
    )


def _linger_for_readers(store: Store, num_nodes: int) -> None:
    """Keep node 0's store up a moment, until the nodes that arrived have
    read who is missing (at most 2 s)."""
    arrived = sum(store.check([job_keys.arrived(node)]) for node in range(1, num_nodes))
    end = time.monotonic() + 2.0
    while store.add(job_keys.MISSING_READ, 0) < arrived and time.monotonic() < end:
        time.sleep(_POLL)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _stderr(line: str) -> None:
    sys.stderr.write(f"phalanx: {line}\n")
    sys.stderr.flush()
