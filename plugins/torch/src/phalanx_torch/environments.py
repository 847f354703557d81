"""Cluster environments that read this machine's variables. Imports no torch."""

from __future__ import annotations

import os
from typing import ClassVar

from phalanx_core import ClusterEnvironment, MisconfigurationError

__all__ = ["LocalEnvironment"]


def _int_var(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise MisconfigurationError(
            f"environment variable {name}={value!r} is not an integer; fix or unset it"
        ) from None


class LocalEnvironment(ClusterEnvironment):
    """This machine, with ranks given by a launcher (or one process alone).

    Reads ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` where a launcher set them; without
    them it is rank 0 of a world of one on ``127.0.0.1``. Always detected:
    it is the default, with the lowest priority.
    """

    creates_processes_externally: ClassVar[bool] = False

    def __init__(self, *, main_address: str = "127.0.0.1", main_port: int = 29500) -> None:
        self._main_address = main_address
        self._main_port = main_port

    @classmethod
    def detect(cls) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", self._main_address)

    @property
    def main_port(self) -> int:
        return _int_var("MASTER_PORT", self._main_port)

    @property
    def world_size(self) -> int:
        return _int_var("WORLD_SIZE", 1)

    @property
    def global_rank(self) -> int:
        return _int_var("RANK", 0)

    @property
    def local_rank(self) -> int:
        return _int_var("LOCAL_RANK", 0)

    @property
    def node_rank(self) -> int:
        return _int_var("NODE_RANK", 0)

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        if num_nodes != 1 and "NODE_RANK" not in os.environ:
            raise MisconfigurationError(
                f"num_nodes={num_nodes} on the local environment needs NODE_RANK set on each node "
                "(and MASTER_ADDR pointing at node 0); set them, or use a scheduler's environment "
                "(slurm, torchelastic)"
            )
