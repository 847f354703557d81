"""The host's network as a job across hosts needs it: which local address
and interface the route to an address leaves from, and that interface's
network. Linux (``ioctl``); elsewhere the functions that need it say they
cannot tell (``None``). Imports no backend; sends nothing.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket

__all__ = ["interface_network", "interface_of", "interfaces", "is_loopback", "route", "route_source"]

_SIOCGIFADDR = 0x8915  # Linux
_SIOCGIFNETMASK = 0x891B


def route(address: str, port: int = 9) -> tuple[str, str]:
    """The local address this host sends from to reach ``address`` (the
    source address of the kernel's route to it, asked with a UDP
    ``connect()``, which sends nothing), and the address ``address``
    resolves to. Raises ``OSError`` where the name does not resolve
    (``socket.gaierror``) or no route leads there."""
    family, _, _, _, target = socket.getaddrinfo(address, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0]).split("%")[0], str(target[0])


def route_source(address: str, port: int = 9) -> str:
    """The first half of :func:`route`: the local address the route to
    ``address`` leaves from."""
    return route(address, port)[0]


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address (``127.0.1.1`` too)."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def interfaces() -> list[str]:
    """The names of this host's network interfaces."""
    return sorted(name for _, name in socket.if_nameindex())


def _ipv4_ioctl(request: int, name: str) -> str | None:
    try:
        import fcntl
        import struct
    except ImportError:  # not a POSIX system
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            reply = fcntl.ioctl(probe.fileno(), request, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address, or not Linux
            return None
    return socket.inet_ntoa(reply[20:24])


def interface_of(address: str) -> str | None:
    """The name of the network interface that has ``address`` (Linux; an
    IPv4 address must be the interface's first), or ``None`` where it
    cannot be told."""
    if not address:
        return None
    try:
        wanted = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    if wanted.version == 6:
        with contextlib.suppress(OSError, ValueError), open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) == 6 and ipaddress.IPv6Address(int(fields[0], 16)) == wanted:
                    return fields[5]
        return None
    for _, name in socket.if_nameindex():
        if _ipv4_ioctl(_SIOCGIFADDR, name) == str(wanted):
            return name
    return None


def interface_network(name: str) -> str | None:
    """The IPv4 network of interface ``name`` (``"192.168.77.0/24"``), or
    ``None`` where it has none or it cannot be told."""
    address, mask = _ipv4_ioctl(_SIOCGIFADDR, name), _ipv4_ioctl(_SIOCGIFNETMASK, name)
    if address is None or mask is None:
        return None
    return str(ipaddress.ip_network(f"{address}/{mask}", strict=False))
