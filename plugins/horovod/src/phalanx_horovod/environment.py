"""The ``horovod`` environment: processes started by ``horovodrun`` or
``horovod.run``. Reads variables only; imports neither horovod nor torch."""

from __future__ import annotations

import os
import zlib
from typing import ClassVar

from phalanx_core import ClusterEnvironment, MisconfigurationError

__all__ = ["HorovodEnvironment"]

_LOOPBACK = "127.0.0.1"


def _var(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _int(name: str, default: int | None = None) -> int:
    value = _var(name)
    if value is None:
        if default is not None:
            return default
        raise MisconfigurationError(
            f"environment 'horovod' needs {name}, which is not set; start the script with "
            "`horovodrun -np N python script.py` (which sets it in every rank), or name another "
            "environment (environment=...)"
        )
    try:
        return int(value)
    except ValueError:
        raise MisconfigurationError(
            f"environment variable {name}={value!r} is not an integer; horovodrun sets it to the "
            "rank's number: start the script with horovodrun, or fix or unset it"
        ) from None


class HorovodEnvironment(ClusterEnvironment):
    """Processes started by ``horovodrun`` (gloo or MPI controller), by
    ``horovod.run`` or by the ``horovod`` launcher.

    Detected by ``HOROVOD_RANK`` and ``HOROVOD_SIZE``, which horovodrun sets
    in every rank it starts; ranks from ``HOROVOD_RANK``, ``HOROVOD_SIZE``,
    ``HOROVOD_LOCAL_RANK``, ``HOROVOD_LOCAL_SIZE`` and ``HOROVOD_CROSS_RANK``
    / ``HOROVOD_CROSS_SIZE`` (the node, and the number of nodes).

    Horovod's own rendezvous needs nothing from this environment. The main
    address and port are for a torch process group made beside Horovod's
    (``resolve("ddp", collective="horovod")``): ``MASTER_ADDR`` /
    ``MASTER_PORT`` when set, else ``127.0.0.1`` on one node and a port in
    20000-29999 every rank derives from horovodrun's rendezvous address and
    port, which name the job. On several nodes ``MASTER_ADDR`` must name
    rank 0's host (reading :attr:`main_address` without it says so).
    """

    creates_processes_externally: ClassVar[bool] = True

    @classmethod
    def detect(cls) -> bool:
        return _var("HOROVOD_RANK") is not None and _var("HOROVOD_SIZE") is not None

    @property
    def main_address(self) -> str:
        address = _var("MASTER_ADDR")
        if address is None and self._nodes > 1:
            raise MisconfigurationError(
                f"environment 'horovod': a torch process group beside Horovod's needs rank 0's host, "
                f"and horovodrun runs on {self._nodes} nodes without saying which it is; set "
                "MASTER_ADDR to rank 0's host (horovodrun -x MASTER_ADDR=host1 ...), or use "
                "strategy 'horovod', whose collective needs no address"
            )
        return address or _LOOPBACK

    @property
    def main_port(self) -> int:
        job = f"{_var('HOROVOD_GLOO_RENDEZVOUS_ADDR')}:{_var('HOROVOD_GLOO_RENDEZVOUS_PORT')}"
        return _int("MASTER_PORT", 20000 + zlib.crc32(job.encode()) % 10000)

    @property
    def world_size(self) -> int:
        return _int("HOROVOD_SIZE")

    @property
    def global_rank(self) -> int:
        return _int("HOROVOD_RANK")

    @property
    def local_rank(self) -> int:
        return _int("HOROVOD_LOCAL_RANK", self.global_rank if self._nodes == 1 else None)

    @property
    def node_rank(self) -> int:
        return _int("HOROVOD_CROSS_RANK", 0)

    @property
    def _nodes(self) -> int:
        return _int("HOROVOD_CROSS_SIZE", 1)

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        size, nodes = self.world_size, self._nodes
        local = _int("HOROVOD_LOCAL_SIZE", size // max(nodes, 1))
        fix = f"horovodrun -np {num_devices * num_nodes} -H host1:{num_devices},... python script.py"
        if nodes != num_nodes:
            raise MisconfigurationError(
                f"horovodrun runs on HOROVOD_CROSS_SIZE={nodes} node(s), but num_nodes={num_nodes} was "
                f"asked for; pass num_nodes={nodes}, or start the job on {num_nodes} node(s) ({fix})"
            )
        if size != num_devices * num_nodes:
            raise MisconfigurationError(
                f"horovodrun started HOROVOD_SIZE={size} process(es), but devices={num_devices} x "
                f"num_nodes={num_nodes} = {num_devices * num_nodes} were asked for; pass "
                f"devices={local} to match the job, or start {num_devices} per node ({fix})"
            )
        if local != num_devices:
            raise MisconfigurationError(
                f"horovodrun placed HOROVOD_LOCAL_SIZE={local} process(es) on this node, but "
                f"devices={num_devices} needs {num_devices} on every node; start them evenly ({fix})"
            )
