"""The rendezvous store a launcher hosts, listening where it is told."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

__all__ = ["GLOO_INTERFACE_VAR", "LOOPBACK", "hosted_store", "listen_variables", "listening_socket"]

#: Where everything of a one-node job listens: nothing of it can be reached
#: from another machine.
LOOPBACK = "127.0.0.1"


#: Where gloo (torch's CPU backend) listens: the interface it names; else
#: the address of this host's name, which may be any interface.
GLOO_INTERFACE_VAR = "GLOO_SOCKET_IFNAME"


def listen_variables(address: str = LOOPBACK) -> dict[str, str]:
    """The variables that make a rank's gloo listen on the interface that
    has ``address`` (``lo`` for :data:`LOOPBACK`): give them to the ranks
    of a job. Nothing when the user set ``GLOO_SOCKET_IFNAME``, or when no
    interface has ``address``."""
    from ..network import interface_of

    if os.environ.get(GLOO_INTERFACE_VAR):
        return {}
    interface = interface_of(address)
    return {GLOO_INTERFACE_VAR: interface} if interface else {}


def listening_socket(address: str, port: int = 0) -> socket.socket:
    """A TCP socket listening on ``address:port`` only (port 0: one the
    kernel gives; no port is chosen by binding and closing a socket)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def hosted_store(address: str = LOOPBACK, port: int = 0, **options: Any) -> Any:
    """A ``torch.distributed.TCPStore`` server listening on ``address:port``
    only (``""``: every interface; port 0: one the kernel gives; read it
    from ``store.port``), with
    the other ``TCPStore`` options given. torch's own ``TCPStore(host, 0,
    is_master=True)`` listens on every interface whatever ``host`` says;
    this one does not. Imports torch when called."""
    import torch.distributed as dist

    sock = listening_socket(address, port)
    bound = sock.getsockname()[1]
    # The store owns the socket from here on, and closes it when it goes;
    # its own client connects to the address (loopback for "", every
    # interface).
    return dist.TCPStore(  # type: ignore[attr-defined]
        address or LOOPBACK, bound, is_master=True, master_listen_fd=sock.detach(), **options
    )


@contextlib.contextmanager
def script_store() -> Iterator[dict[str, str]]:
    """For a script run as every rank's program on one node (``phalanx
    run``): a rendezvous store hosted here on 127.0.0.1 while the job runs,
    and the variables that send the ranks' torch group to it
    (``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_USE_AGENT_STORE``:
    rank 0 joins it instead of hosting a ``TCPStore`` of its own, which
    torch binds to every interface). On the port in ``MASTER_PORT`` where
    the user set one; nothing where the user set ``MASTER_ADDR`` to an
    address that is not loopback: the ranks meet there, as torch does it."""
    from ..network import is_loopback

    address = os.environ.get("MASTER_ADDR")
    if address and address != "localhost" and not is_loopback(address):
        yield {}
        return
    port = os.environ.get("MASTER_PORT", "")
    store = hosted_store(LOOPBACK, int(port) if port.isdigit() else 0, wait_for_workers=False)
    try:
        yield {
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    finally:
        del store
