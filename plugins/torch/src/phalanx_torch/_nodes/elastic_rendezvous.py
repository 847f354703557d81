"""The rendezvous of a job of the ``subprocess`` launcher that does not meet
in rounds (:mod:`.rounds` is the other): every node once, on node 0's
store (``phalanx-static``), or one node alone (``phalanx-one-node``),
registered as torch elastic rendezvous handlers. Imports no torch at import
time."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from phalanx_core.launching import LOOPBACK, hosted_store

from .._launch.listen import listen_address
from .arrivals import meet
from .ledger import JobLedger

ONE_NODE = "phalanx-one-node"
STATIC = "phalanx-static"


def register_rendezvous(name: str, create: Callable[[Any], Any]) -> str:
    """Register (once) one of this module's elastic rendezvous; return its name."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(name, create)
    return name


def create_static_rendezvous(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import create_rdzv_handler

    static: Any = create_rdzv_handler(params)  # checks the endpoint and the rank
    timeout = int(static.timeout.total_seconds())
    handler = _static_rendezvous_class()(
        static.master_addr, static.master_port, static.rank, static.world_size, static.run_id, timeout
    )
    handler.ledger = params.config.get("ledger")
    return handler


@functools.cache
def _static_rendezvous_class() -> type:
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    class StaticRendezvous(StaticTCPRendezvous):
        """Elastic's static rendezvous (several nodes; node 0's agent hosts
        the store), with node 0's store listening on the address the other
        nodes reach it by (see :mod:`.._launch.listen`), not on every interface."""

        def get_backend(self) -> str:
            return STATIC

        #: The launch's shared facts (:class:`~phalanx_torch._nodes.ledger.JobLedger`):
        #: where lines go, and who keeps node 0's store once made, after
        #: elastic has dropped this handler, until the node watch has left.
        ledger: JobLedger | None = None

        def next_rendezvous(self) -> Any:
            if self._store is None:
                # Every node says it arrived; node 0 waits for all, saying
                # what it waits for, and names a node that never comes.
                def host() -> Any:
                    address = listen_address(self.master_addr, self.master_port, self.world_size)
                    return hosted_store(
                        address,
                        self.master_port,
                        world_size=self.world_size,
                        timeout=self.timeout,
                        wait_for_workers=False,
                    )

                self._store = meet(
                    node_rank=self.rank,
                    num_nodes=self.world_size,
                    address=self.master_addr,
                    port=self.master_port,
                    timeout=self.timeout.total_seconds(),
                    host_store=host,
                    say=self.ledger.say if self.ledger is not None else None,
                )
                if self.ledger is not None:
                    self.ledger.keep(self._store)
            info = super().next_rendezvous()
            if self.ledger is not None:
                self.ledger.met()  # node 0's store is up: the node watch may connect
            return info

    return StaticRendezvous


def create_one_node_rendezvous(params: Any) -> Any:
    return _one_node_rendezvous_class()(
        params.run_id, int(params.config.get("timeout", 900)), params.config.get("address", LOOPBACK)
    )


@functools.cache
def _one_node_rendezvous_class() -> type:
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    class OneNodeRendezvous(RendezvousHandler):
        """One node (``torchrun --standalone``): every round, the first and
        each restart, gets a new TCPStore on a port the kernel gives, which
        the agent keeps and the ranks join as clients. A new store per round
        means a restarted rank never reads the keys of the attempt before
        (torch 2.13's c10d rendezvous keeps one store across restarts, and
        restarted ranks then connect to the dead ranks' addresses)."""

        def __init__(self, run_id: str, timeout: int, address: str) -> None:
            self._run_id = run_id
            self._address = address
            self._timeout = datetime.timedelta(seconds=timeout)
            self._store: Any = None
            self._round = 0
            self._closed = False

        def get_backend(self) -> str:
            return ONE_NODE

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> Any:
            self._store = None  # the ranks of the round before are stopped
            self._store = hosted_store(self._address, wait_for_workers=False, timeout=self._timeout)
            self._round += 1
            prefixed = dist.PrefixStore(f"{self._run_id}/{self._round}", self._store)  # type: ignore[attr-defined]
            return RendezvousInfo(prefixed, 0, 1, RendezvousStoreInfo(self._address, self._store.port))

        def is_closed(self) -> bool:
            return self._closed

        def set_closed(self) -> None:
            self._closed = True

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self._run_id

        def shutdown(self) -> bool:
            self._store = None
            return True

    return OneNodeRendezvous
