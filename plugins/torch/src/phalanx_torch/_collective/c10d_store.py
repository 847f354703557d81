"""What the ``torch`` collective keeps in c10d's store, beside the group:
the plans of the nodes, compared before the group is made, and the board
on which ranks post what they wait in (:mod:`phalanx_core.hangs`)."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch.distributed as dist

from phalanx_core import ClusterEnvironment, PlanMismatchError, plan_mismatch


def compare_plans(
    store: Any,
    prefix: str,
    facts: dict[str, Any],
    environment: ClusterEnvironment,
    seen_as: str | None,
    *,
    where: str,
) -> str | None:
    """Compare the plans of every node through the rendezvous store,
    before the group is made: each node's local rank 0 posts its plan
    (``facts``, and the address its route to the main address reaches it
    at, ``seen_as``), global rank 0 compares them and posts the verdict,
    every rank reads it (a node whose plan differs would otherwise wait for
    its peers in other places, or forever). Returns the address the nodes
    whose route to the main address leaves their host reach it at, if
    any. ``where`` is this rank in words, for the error."""
    plans = dist.PrefixStore(f"{prefix}/plans", store)  # type: ignore[attr-defined]
    if environment.local_rank == 0:
        plans.set(f"node{environment.node_rank}", json.dumps({"facts": facts, "seen_as": seen_as}))
    if environment.global_rank == 0:
        # The nodes of this round where torch elastic started the ranks (a
        # job of MIN:MAX nodes may have fewer than its plan's most).
        nodes = int(os.environ.get("GROUP_WORLD_SIZE") or facts.get("nodes", "1"))
        posts = {n: json.loads(plans.get(f"node{n}")) for n in range(nodes)}
        error = plan_mismatch({n: post["facts"] for n, post in posts.items()})
        seen = sorted({post["seen_as"] for post in posts.values() if post["seen_as"]})
        verdict: dict[str, Any] = {"seen_as": seen[0] if len(seen) == 1 else None}
        if error is not None:
            verdict.update(message=str(error), differences=error.differences)
        plans.set("verdict", json.dumps(verdict))
    verdict = json.loads(plans.get("verdict"))
    if "message" in verdict:
        differences = {
            name: {int(node): value for node, value in values.items()}
            for name, values in verdict["differences"].items()
        }
        raise PlanMismatchError(
            f"setup() on the 'torch' collective ({where}): {verdict['message']}",
            differences=differences,
        )
    return verdict["seen_as"]  # type: ignore[no-any-return]


class StoreBoard:
    """:class:`phalanx_core.hangs.Board` over a c10d store."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def post(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def read(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key)).decode()

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, amount))

    def close(self) -> None:
        self._store = None


def tcp_address(store: Any) -> tuple[str, int] | None:
    """The host and port of the TCPStore under ``store`` (through prefix
    stores), or None for another kind."""
    while store is not None:
        if isinstance(store, dist.TCPStore):  # type: ignore[attr-defined]
            return str(store.host), int(store.port)
        store = getattr(store, "underlying_store", None)
    return None


def open_board(address: tuple[str, int], prefix: str) -> StoreBoard | None:
    """A new client of the TCPStore at ``address`` (its own connection: the
    group's may be busy in a barrier), under ``prefix``; None where it
    cannot connect."""
    host, port = address
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, is_master=False, timeout=datetime.timedelta(seconds=30)
        )
    except (RuntimeError, ValueError):
        return None
    return StoreBoard(dist.PrefixStore(prefix, store))  # type: ignore[attr-defined]
