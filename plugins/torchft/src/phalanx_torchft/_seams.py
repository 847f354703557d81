"""The seams between phalanx-torchft's parts, typed: what the quorum loader
asks of its strategy, what the optimizer ``setup`` returns and DDP's comm
hook ask of it, what the strategy asks of its loaders, and what the group
across the replica groups tells it at each quorum. Each part is typed by
the Protocol of what it uses, not by the class that gives it (the loader
cannot import the strategy, which imports the loader). Imports nothing of
torch or TorchFT."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

__all__ = ["QuorumSide", "StepDealer", "StepOwner", "StepSettled"]


class StepOwner(Protocol):
    """The strategy's side of a training step (``FaultTolerant``): what
    the optimizer ``setup`` returns and DDP's comm hook call."""

    def open_step(self, timeout: float | None = None) -> None:
        """Ask for the next step's quorum (once a step: the first caller)."""

    def wait_quorum(self) -> None:
        """Wait for the step's quorum; where none comes, raise the named error."""

    def commit_step(self) -> bool:
        """Whether the step is committed (the optimizer steps only then);
        the step's verdict goes to each loader (:class:`StepSettled`)."""


class StepDealer(Protocol):
    """What the quorum loader asks of its strategy: where it is, and the
    members a step's batches are dealt to."""

    replica_group: int
    replica_groups: int
    global_rank: int
    world_size: int
    name: str

    def open_step(self, timeout: float | None = None) -> None:
        """As :meth:`StepOwner.open_step`."""

    def deal_basis(self) -> tuple[int, int]:
        """``(members, this group's index among them)``: the last quorum
        this group saw, the step's batches dealt over it."""


class StepSettled(Protocol):
    """What the strategy asks of each of its loaders (``QuorumLoader``)."""

    def settle(self, committed: bool, members: int = 0, trained: frozenset[int] = frozenset()) -> None:
        """A step's verdict: committed or not, over how many members, and
        which of them trained their batches (the others' shares are dealt
        again)."""

    def heal(self, state: Mapping[str, Any]) -> None:
        """Take a peer's position (TorchFT's heal of this group)."""

    def state_dict(self) -> dict[str, Any]:
        """The loader's position, for a peer's heal and for checkpoints."""


class QuorumSide(Protocol):
    """What the group across the replica groups tells its strategy as
    TorchFT's Manager configures it at each new quorum."""

    def quorum_configured(self, quorum_id: int, members: int, rank: int) -> None:
        """The quorum ``quorum_id`` has ``members`` groups; this group's
        rank among them is ``rank``."""
