"""The ClusterEnvironment interface: where ranks come from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

__all__ = ["ClusterEnvironment"]


class ClusterEnvironment(ABC):
    """Where this process's ranks, world size and rendezvous address come from.

    An environment reads a scheduler's variables (``SLURM_PROCID``,
    ``RANK``, ``OMPI_COMM_WORLD_RANK``) or, for ``local``, the values a
    launcher set. Constructed by the registry with the spec's options as
    keyword arguments; when no environment is named, the registry calls
    :meth:`detect` on each installed environment class, highest spec
    priority first, and uses the first that says yes.

    Attributes:
        creates_processes_externally: the scheduler already started one
            process per rank (torchrun, srun, mpirun). The registry then
            chooses a launcher that creates no processes, and refuses one that
            would.
    """

    creates_processes_externally: ClassVar[bool] = False

    @classmethod
    @abstractmethod
    def detect(cls) -> bool:
        """Return whether this process runs under this environment.

        Reads environment variables only: it must not import a backend nor
        raise.
        """

    @property
    @abstractmethod
    def main_address(self) -> str:
        """The address of rank 0's rendezvous (``127.0.0.1`` on one node)."""

    @property
    @abstractmethod
    def main_port(self) -> int:
        """The port of rank 0's rendezvous."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The number of ranks in the job."""

    @property
    @abstractmethod
    def global_rank(self) -> int:
        """This process's rank in the job, ``0 .. world_size - 1``."""

    @property
    @abstractmethod
    def local_rank(self) -> int:
        """This process's rank on its node."""

    @property
    @abstractmethod
    def node_rank(self) -> int:
        """The rank of this process's node."""

    @property
    def node_rank_given(self) -> bool:
        """Whether this environment gives the node's rank (a scheduler's
        does). ``False`` where none was given for nodes that the rendezvous
        numbers (nodes that meet in rounds); ``node_rank`` then raises
        :class:`~phalanx_core.MisconfigurationError`. ``True`` by default."""
        return True

    def validate(self, *, num_devices: int, num_nodes: int) -> None:  # noqa: B027 - optional check
        """Check that this environment can run ``num_devices`` processes per
        node on ``num_nodes`` nodes; raise
        :class:`~phalanx_core.MisconfigurationError` saying what to change
        when it cannot (a Slurm job of 4 tasks asked for 2 devices on 1
        node). Called by the registry after construction. The default
        accepts anything."""

    def teardown(self) -> None:  # noqa: B027 - optional hook
        """Undo what the environment changed in this process (variables it set)."""
