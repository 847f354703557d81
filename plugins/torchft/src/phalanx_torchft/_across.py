"""The process group TorchFT's ``Manager`` talks across the replica groups
through: the collective the user named, formed again at each quorum.

TorchFT stays the engine (its lighthouse decides each step's members, its
manager drops a failed step and heals a group that comes back); what
carries the bytes between the groups is a phalanx collective with the
``reconfigure`` and ``liveness`` capabilities: at each new quorum TorchFT
calls ``configure`` with the quorum's store address (its prefix holds the
quorum's id), this replica's rank and their number, and the collective
forms its group of them (:meth:`~phalanx_core.Collective.reconfigure`).
The gradients' all-reduce and a healing group's state (TorchFT's
``PGTransport``: send and recv) then go through the collective's own
operations, through phalanx's ``CollectiveProcessGroup``.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from typing import Any

from phalanx_core import Collective, Membership

from ._lighthouse import TERM_FILE_VAR, term_of
from ._seams import QuorumSide

__all__ = ["across_groups"]


def across_groups(strategy: QuorumSide, collective: Collective, timeout: timedelta) -> Any:
    """A TorchFT ``ProcessGroup`` over ``collective`` (never set up; each
    quorum reconfigures it, its operations bounded by ``timeout``), which
    tells ``strategy`` each quorum's members as it forms their group
    (:meth:`~phalanx_torchft._seams.QuorumSide.quorum_configured`)."""
    from torchft.process_group import ProcessGroupWrapper

    from phalanx_torch.process_group import CollectiveProcessGroup

    class AcrossGroups(ProcessGroupWrapper):  # type: ignore[misc]
        """TorchFT's process group over the named collective."""

        def configure(  # type: ignore[no-untyped-def]
            self,
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id=None,
            group_rank=None,
            group_world_size=None,
            global_ranks=None,
        ) -> None:
            self._replica_id, self._rank, self._quorum_id = replica_id, rank, quorum_id
            self._group_rank, self._group_world_size = group_rank, group_world_size
            self._global_ranks = global_ranks
            self._pg = None
            # A lighthouse elected after another numbers its quorums from 1
            # again: its term keeps them apart in the groups' stores.
            term = term_of(os.environ.get(TERM_FILE_VAR))
            membership = Membership.at(
                f"{store_addr}/lighthouse{term}" if term else store_addr,
                rank=int(rank),
                world_size=int(world_size),
                label=f"quorum {quorum_id}",
                timeout=timeout.total_seconds(),
            )
            collective.reconfigure(membership)
            self._pg = CollectiveProcessGroup(collective, name=f"phalanx-across:{quorum_id}")
            strategy.quorum_configured(int(quorum_id or 0), int(world_size), int(rank))

        def abort(self, errored: bool = True) -> None:
            self._pg = None
            with contextlib.suppress(Exception):  # a group already gone
                collective.abort()

        def shutdown(self) -> None:
            self._pg = None
            with contextlib.suppress(Exception):
                collective.teardown()

        def errored(self) -> Exception | None:
            return None

        def set_timeout(self, timeout: timedelta) -> None:
            self._timeout = timeout

        def getBackendName(self) -> str:
            return f"phalanx-{collective.name}"

    return AcrossGroups(timeout=timeout)
