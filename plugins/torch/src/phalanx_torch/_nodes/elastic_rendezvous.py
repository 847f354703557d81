"""The rendezvous of a job of the ``subprocess`` launcher that does not meet
in rounds (:mod:`.rounds` is the other): every node once, on node 0's
store (``phalanx-static``), or one node alone (``phalanx-one-node``), each
a torch elastic ``RendezvousHandler``. Imports no torch at import time."""

from __future__ import annotations

import functools
from typing import Any

from phalanx_core.launching import LOOPBACK, hosted_store

from .._launch.listen import listen_address
from .arrivals import meet
from .ledger import JobLedger

ONE_NODE = "phalanx-one-node"
STATIC = "phalanx-static"


def create_static_rendezvous(params: Any) -> Any:
    """Every node once (elastic's ``RendezvousParameters`` ``params``: the
    main address and port, this node's rank, the timeout in its config)."""
    config = params.config
    handler = _static_rendezvous_class()(
        config["address"],
        int(config["port"]),
        int(config["rank"]),
        params.max_nodes,
        params.run_id,
        int(config.get("timeout", 900)),
    )
    handler.ledger = config.get("ledger")
    return handler


@functools.cache
def _static_rendezvous_class() -> type:
    import datetime

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    class StaticRendezvous(RendezvousHandler):
        """Several nodes, once, each with the rank it was given: node 0's
        launching process hosts the store (listening on the address the
        other nodes reach it by, see :mod:`.._launch.listen`, not on every
        interface), every node says it arrived, and node 0 waits for all,
        saying what it waits for and naming a node that never comes
        (:func:`.arrivals.meet`)."""

        #: The launch's shared facts (:class:`~phalanx_torch._nodes.ledger.JobLedger`):
        #: where lines go, and who keeps node 0's store once made, until
        #: the node watch has left it.
        ledger: JobLedger | None = None

        def __init__(
            self, address: str, port: int, rank: int, num_nodes: int, run_id: str, timeout: int
        ) -> None:
            self.address, self.port = address, port
            self.rank, self.num_nodes = rank, num_nodes
            self.run_id = run_id
            self.timeout = datetime.timedelta(seconds=timeout)
            self.store: Any = None

        def get_backend(self) -> str:
            return STATIC

        @property
        def use_agent_store(self) -> bool:
            return True

        def next_rendezvous(self) -> Any:
            if self.store is None:

                def host() -> Any:
                    address = listen_address(self.address, self.port, self.num_nodes)
                    return hosted_store(
                        address,
                        self.port,
                        world_size=self.num_nodes,
                        timeout=self.timeout,
                        wait_for_workers=False,
                    )

                self.store = meet(
                    node_rank=self.rank,
                    num_nodes=self.num_nodes,
                    address=self.address,
                    port=self.port,
                    timeout=self.timeout.total_seconds(),
                    host_store=host,
                    say=self.ledger.say if self.ledger is not None else None,
                )
                if self.ledger is not None:
                    self.ledger.keep(self.store)
                    if self.ledger.job_store is not None:  # the heartbeat's and the watch's requests too
                        self.ledger.job_store.adopt(self.store)
            if self.ledger is not None:
                self.ledger.met()  # node 0's store is up: the node watch may connect
            prefixed = dist.PrefixStore(self.run_id, self.store)  # type: ignore[attr-defined]
            return RendezvousInfo(
                prefixed, self.rank, self.num_nodes, RendezvousStoreInfo(self.address, self.port)
            )

        def is_closed(self) -> bool:
            return False

        def set_closed(self) -> None:
            pass

        def num_nodes_waiting(self) -> int:
            return 0

        def get_run_id(self) -> str:
            return self.run_id

        def shutdown(self) -> bool:
            return True

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
        the launching process keeps and the ranks join as clients. A new store per round
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
