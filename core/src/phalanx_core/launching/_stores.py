"""The rendezvous store a launcher hosts, listening where it is told."""

from __future__ import annotations

import os
import socket
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
    only (port 0: one the kernel gives; read it from ``store.port``), with
    the other ``TCPStore`` options given. torch's own ``TCPStore(host, 0,
    is_master=True)`` listens on every interface whatever ``host`` says;
    this one does not. Imports torch when called."""
    import torch.distributed as dist

    sock = listening_socket(address, port)
    bound = sock.getsockname()[1]
    # The store owns the socket from here on, and closes it when it goes.
    return dist.TCPStore(  # type: ignore[attr-defined]
        address, bound, is_master=True, master_listen_fd=sock.detach(), **options
    )
