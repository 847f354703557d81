"""Where a job's sockets listen: the rendezvous store a launcher hosts, and
gloo's connections between the ranks. Imports no torch.

One node: ``127.0.0.1`` only; nothing of the job can be reached from
another machine. Several nodes: the address this node sends from to reach
the main address (the source address of the kernel's route to it, asked
with a UDP ``connect()``, which sends nothing), so the one interface that
joins the nodes. Where that is a loopback address (node 0 of a cluster
whose hosts file maps its own name to ``127.0.1.1``, or a main address of
``127.0.0.1`` there) nothing better can be known, and torch's own choice
stays: the store on every interface, gloo on the address of this host's
name.

torch 2.13 has no option for the address a ``TCPStore`` server binds (it
binds every interface); it does take a socket already listening
(``master_listen_fd``), which core's
:func:`~phalanx_core.launching.hosted_store` gives it. Gloo takes
its interface from ``GLOO_SOCKET_IFNAME``, read each time a gloo group is
made (the default group, ``new_group``, ``monitored_barrier``'s helper);
core's :func:`~phalanx_core.launching.listen_variables` gives it to the ranks, unless the user set it.
"""

from __future__ import annotations

import dataclasses
import os
import socket

from phalanx_core.launching import LOOPBACK
from phalanx_core.network import interface_of, interfaces, is_loopback, route, route_source

__all__ = [
    "LOOPBACK",
    "Network",
    "choose_network",
    "interface_of",
    "listen_address",
    "route_source",
]


def listen_address(main_address: str, main_port: int, num_nodes: int) -> str:
    """The local address this node's listening sockets bind: ``127.0.0.1``
    on one node; on several, the source address of the route to
    ``main_address``, or ``""`` (every interface) where that is loopback or
    cannot be found."""
    if num_nodes == 1:
        return LOOPBACK
    try:
        source = route_source(main_address, main_port)
    except OSError:
        return ""
    return "" if is_loopback(source) else source


#: The variable each c10d backend reads its network interface from.
INTERFACE_VARS = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


@dataclasses.dataclass(frozen=True)
class Network:
    """The network interface a rank's collective traffic uses, and why."""

    #: The interface (``"eth0"``), or ``None``: the backend's own choice.
    interface: str | None
    #: Why, in a sentence's worth of words (for ``phalanx explain``).
    reason: str
    #: The variables to set in the rank before its group is made.
    variables: dict[str, str] = dataclasses.field(default_factory=dict)
    #: What stops the rank from reaching the main address, or ``None``.
    problem: str | None = None
    #: The address the main address resolves to, where the route to it
    #: leaves this host (so other hosts know it as that address).
    main_seen_as: str | None = None

    def describe(self, backend: str) -> str:
        if self.interface is None:
            return f"{backend}'s own choice: {self.reason}"
        return f"{backend} on {self.interface}: {self.reason}"


def choose_network(main_address: str, main_port: int, backend: str, interface: str | None = None) -> Network:
    """The interface for the ranks' connections to each other: ``interface``
    where given (the collective's option); else the one set in
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``; else the interface the
    route to ``main_address`` leaves from. A route over loopback (one host)
    sets nothing: the backend's own choice stays."""
    names = [INTERFACE_VARS["gloo"]] + ([INTERFACE_VARS[backend]] if backend in INTERFACE_VARS else [])
    names = list(dict.fromkeys(names))
    try:
        source, target = route(main_address, main_port)
        failure: OSError | None = None
    except OSError as exc:
        source, target, failure = "", "", exc
    # Where the route leaves this host, the other hosts know the main
    # address as ``target`` too: node 0, whose own name may lead to
    # loopback, learns its address from them.
    seen_as = target if source and not is_loopback(source) else None
    if interface is not None:
        if interface not in interfaces():
            raise ValueError(
                f"interface={interface!r} is not a network interface of this host; it has "
                f"{', '.join(interfaces())}"
            )
        clashes = [f"{n}={os.environ[n]}" for n in names if os.environ.get(n) and os.environ[n] != interface]
        if clashes:
            raise ValueError(
                f"interface={interface!r}, but {' and '.join(clashes)} is set in the environment; "
                "name the interface in one place"
            )
        variables = {n: interface for n in names}
        return Network(interface, "the collective's option interface=", variables, main_seen_as=seen_as)
    given = {n: os.environ[n] for n in names if os.environ.get(n)}
    if len(given) == len(names):
        first, value = next(iter(given.items()))
        return Network(value, f"{first}={value} in the environment", main_seen_as=seen_as)
    if isinstance(failure, socket.gaierror):
        problem = (
            f"the main address {main_address!r} (MASTER_ADDR) does not resolve on this host "
            f"({socket.gethostname()}): {failure.strerror}. Give node 0's address as this host can "
            "resolve it (an IP address works everywhere)"
        )
        return Network(None, problem, problem=problem)
    if failure is not None:
        problem = (
            f"no route from this host ({socket.gethostname()}) to the main address {main_address} "
            f"(MASTER_ADDR): {failure.strerror}. Check that node 0 is on a network this host reaches"
        )
        return Network(None, problem, problem=problem)
    if is_loopback(source):
        return Network(
            None,
            f"the main address {main_address} leads to this host's loopback; with nodes on other "
            "hosts, this host takes the interface of the address they reach it at, when the group is made",
        )
    found = interface_of(source)
    if found is None:
        return Network(None, f"the interface of {source}, the route's source address, cannot be told")
    variables = {n: found for n in names if n not in given}
    reason = f"{found} ({source}) is where the route to the main address {main_address} leaves from"
    return Network(found, reason, variables, main_seen_as=seen_as)


def main_host_network(seen_as: str, backend: str) -> Network | None:
    """On the host of the main address, where its name leads to loopback:
    the interface that has ``seen_as``, the address the other hosts reach
    the main address at (they say it through the rendezvous store)."""
    found = interface_of(seen_as)
    if found is None:
        return None
    names = list(dict.fromkeys([INTERFACE_VARS["gloo"], INTERFACE_VARS.get(backend, INTERFACE_VARS["gloo"])]))
    variables = {n: found for n in names if not os.environ.get(n)}
    reason = f"{found} has {seen_as}, the address the other nodes reach the main address at"
    return Network(found, reason, variables)


def one_thread(num_processes: int) -> dict[str, str]:
    """``OMP_NUM_THREADS=1`` for the ranks where several share this machine
    and the user set no thread count, as torchrun does: ranks that each
    start a thread per core slow each other down, and a port of a torchrun
    script computes with the thread count it had there (kernels that split
    a reduction among threads round it differently)."""
    if num_processes > 1 and "OMP_NUM_THREADS" not in os.environ:
        return {"OMP_NUM_THREADS": "1"}
    return {}
