"""The errors phalanx-torchft raises of its own. Imports no torch."""

from __future__ import annotations

from phalanx_core import PhalanxError

__all__ = ["NoQuorumError"]


class NoQuorumError(PhalanxError, TimeoutError):
    """A replica group got no quorum for its step: TorchFT's lighthouse is
    lost or cannot be reached from this host (or the group's rank 0, which
    asks it for the group, is gone). The group's ranks stop with it; the
    launcher starts the group again, and it heals from a peer once the
    lighthouse answers."""
