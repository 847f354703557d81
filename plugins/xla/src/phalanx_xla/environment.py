"""The ``xla`` environment: ranks from ``torch_xla.runtime``."""

from __future__ import annotations

import os
from typing import ClassVar

from phalanx_core import ClusterEnvironment

from . import _runtime

__all__ = ["XLAEnvironment"]

#: The port torch_xla's multi-host runtime coordinates on by default.
XLA_COORDINATOR_PORT = 8476


class XLAEnvironment(ClusterEnvironment):
    """Where XLA replicas get their ranks: ``torch_xla.runtime``.

    ``global_rank`` is ``xr.global_ordinal()``, ``world_size``
    ``xr.world_size()``, ``local_rank`` ``xr.local_ordinal()`` and
    ``node_rank`` ``xr.host_index()``, read in the replica that asks (on
    the CPU runtime the replicas are threads of one process, so each thread
    gets its own). They exist only inside a replica the ``xla`` launcher
    started: asked anywhere else they raise
    :class:`~phalanx_core.MisconfigurationError`, because asking torch_xla
    would start its runtime in a process that must still launch replicas.

    Never detected (:meth:`detect` is false): the ``xla`` and
    ``xla_single`` strategies name it. The rendezvous is torch_xla's own;
    ``main_address`` / ``main_port`` are ``MASTER_ADDR`` / ``MASTER_PORT``
    where set, else ``127.0.0.1`` and torch_xla's coordinator port 8476.
    """

    creates_processes_externally: ClassVar[bool] = False

    @classmethod
    def detect(cls) -> bool:
        return False

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        raw = os.environ.get("MASTER_PORT", "")
        return int(raw) if raw.isdigit() else XLA_COORDINATOR_PORT

    @property
    def world_size(self) -> int:
        _runtime.require_replica("world_size")
        import torch_xla.runtime as xr

        return int(xr.world_size())

    @property
    def global_rank(self) -> int:
        _runtime.require_replica("global_rank")
        import torch_xla.runtime as xr

        return int(xr.global_ordinal())

    @property
    def local_rank(self) -> int:
        _runtime.require_replica("local_rank")
        import torch_xla.runtime as xr

        return int(xr.local_ordinal())

    @property
    def node_rank(self) -> int:
        _runtime.require_replica("node_rank")
        import torch_xla.runtime as xr

        return int(xr.host_index())
