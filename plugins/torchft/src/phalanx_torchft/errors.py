"""The errors phalanx-torchft raises of its own. Imports no torch."""

from __future__ import annotations

from phalanx_core import PhalanxError

__all__ = ["JobFinishedError", "NoQuorumError"]


class NoQuorumError(PhalanxError, TimeoutError):
    """A replica group got no quorum for its step: TorchFT's lighthouse is
    lost or cannot be reached from this host (or the group's rank 0, which
    asks it for the group, is gone). The group's ranks stop with it; the
    launcher starts the group again, and it heals from a peer once the
    lighthouse answers."""


class JobFinishedError(PhalanxError):
    """A replica group got a quorum after the job had finished (another
    group ended its script): it was started again too late to heal from a
    peer, and stops instead of training alone from its own step. Launcher
    ``replica_groups`` does not start it again; the job's result is in the
    groups that ended."""
