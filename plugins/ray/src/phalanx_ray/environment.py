"""The ``ray`` environment: where a rank that the ``ray`` launcher started
is, read from the variables the launcher set in its actor. Imports no ray."""

from __future__ import annotations

import os
from typing import Any

from phalanx_core import ClusterEnvironment, MisconfigurationError

#: Set in every rank's actor by the ``ray`` launcher: the job it belongs to.
JOB_VAR = "PHALANX_RAY_JOB"
#: The job's number of nodes, set with it.
NODES_VAR = "PHALANX_RAY_NUM_NODES"

__all__ = ["JOB_VAR", "NODES_VAR", "RayEnvironment"]


def in_rank() -> bool:
    """Whether this process is a rank the ``ray`` launcher started."""
    return bool(os.environ.get(JOB_VAR))


class _InRank:
    """``creates_processes_externally``, read on the class: true in a rank
    (the launcher made the process, so a script resolving there runs in
    place), false in the process that launches (where the ranks are still
    to be made)."""

    def __get__(self, instance: Any, owner: Any = None) -> bool:
        return in_rank()


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise MisconfigurationError(
            f"environment 'ray': {name}={raw!r} is not an int; the ray launcher sets it in every rank, "
            "so something else changed it"
        ) from None


class RayEnvironment(ClusterEnvironment):
    """Ranks that the ``ray`` launcher started, one Ray actor each.

    In a rank, it reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
    ``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``,
    which the launcher set in the rank's actor, and is detected by
    ``PHALANX_RAY_JOB``. In the process that launches (the one that called
    ``phalanx.resolve(..., launcher="ray")``), it is rank 0 of a world of
    one, as ``local`` is before a launch: the registry takes it there because
    the ``ray`` launcher's spec names it.
    """

    creates_processes_externally = _InRank()

    def __init__(self, *, main_address: str = "127.0.0.1", main_port: int = 29500) -> None:
        self._main_address = main_address
        self._main_port = main_port

    @classmethod
    def detect(cls) -> bool:
        return in_rank()

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", self._main_address)

    @property
    def main_port(self) -> int:
        return _int("MASTER_PORT", self._main_port)

    @property
    def world_size(self) -> int:
        return _int("WORLD_SIZE", 1)

    @property
    def global_rank(self) -> int:
        return _int("RANK", 0)

    @property
    def local_rank(self) -> int:
        return _int("LOCAL_RANK", 0)

    @property
    def node_rank(self) -> int:
        return _int("NODE_RANK", 0)

    @property
    def local_world_size(self) -> int:
        return _int("LOCAL_WORLD_SIZE", 1)

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        """In a rank: the layout the launcher started is the one asked for
        (a script that resolves with other flags than the launch had is
        refused, naming both). In the launching process: anything, since
        the launcher places the ranks."""
        if not in_rank():
            return
        started = (self.local_world_size, _int(NODES_VAR, 1))
        if started != (num_devices, num_nodes):
            raise MisconfigurationError(
                f"environment 'ray': the ray launcher started {started[0]} rank(s) per node on "
                f"{started[1]} node(s), but this rank resolved devices={num_devices}, num_nodes={num_nodes}; "
                "resolve with the flags the launch was made with (phalanx run passes them to "
                "phalanx.resolve() in the script when it names none)"
            )
