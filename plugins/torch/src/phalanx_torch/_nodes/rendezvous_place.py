"""Where the nodes of a job meet, from ``--rendezvous``: parsed once into a
:class:`RendezvousPlace` (node 0's store at the main address, or an etcd
cluster, its job name, and how its members are reached: TLS files, a
user). Imports no torch."""

from __future__ import annotations

import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from phalanx_core import MisconfigurationError

__all__ = ["ETCD_PASSWORD_VAR", "ETCD_PORT", "RendezvousPlace", "parse_rendezvous"]

#: etcd's client port, where an address gives none.
ETCD_PORT = 2379


@dataclass(frozen=True)
class RendezvousPlace:
    """Where the nodes of a job meet: ``kind`` ``"c10d"`` (a store node 0's
    launching process hosts at ``main_address:main_port``) or ``"etcd"``
    (the members at ``endpoints``), and the job's name there."""

    kind: str
    endpoints: tuple[tuple[str, int], ...]
    name: str
    #: How the etcd members are reached (``etcd3.Access``: TLS, a user).
    access: Any = None

    @property
    def endpoint(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)

    def describe(self) -> str:
        if self.kind == "etcd":
            tls = " over TLS" if self.access is not None and self.access.tls else ""
            return f"etcd at {self.endpoint}{tls} (job {self.name!r})"
        return f"node 0's store at {self.endpoint}"


#: The environment variable that holds the password of ``user=`` in an
#: etcd rendezvous (never in the URL: a command line is visible to every
#: user of the host).
ETCD_PASSWORD_VAR = "PHALANX_ETCD_PASSWORD"
#: The query parameters of an etcd rendezvous.
_ETCD_PARAMETERS = ("cacert", "cert", "key", "user")


def parse_rendezvous(value: str | None, main_address: str, main_port: int) -> RendezvousPlace:
    """The ``rendezvous`` option: None or ``"c10d"`` (node 0 hosts the
    store at the main address and port), or
    ``"etcd://HOST[:PORT],HOST[:PORT].../NAME"`` (an etcd cluster, 3.4 or
    later, spoken to on its v3 API; ``NAME``, default ``phalanx-<main port>``, tells jobs that share
    the cluster apart); ``etcd+https://`` reaches the members over TLS.
    Query parameters: ``cacert``, ``cert``, ``key`` (TLS: the CA of the
    members' certificates, this client's certificate and key) and
    ``user`` (its password in ``PHALANX_ETCD_PASSWORD``)."""
    if value is None or value == "c10d":
        return RendezvousPlace("c10d", ((main_address, main_port),), f"phalanx-{main_address}:{main_port}")
    wrong = MisconfigurationError(
        f"launcher 'subprocess': rendezvous={value!r}; give 'c10d' (node 0 hosts the store, the "
        "default) or 'etcd://HOST[:PORT],HOST[:PORT]/NAME' (an etcd cluster, 3.4 or later, one member or "
        "more; NAME tells jobs apart; etcd+https:// for TLS, with ?cacert=PATH&cert=PATH&key=PATH)"
    )
    if not isinstance(value, str):
        raise wrong
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("etcd", "etcd+https"):
        raise wrong
    rest, _, query = rest.partition("?")
    access = _etcd_access(value, scheme == "etcd+https", query)
    hosts, _, name = rest.partition("/")
    endpoints = []
    for item in hosts.split(","):
        parsed = urllib.parse.urlsplit(f"//{item.strip()}")
        try:
            port = parsed.port or ETCD_PORT
        except ValueError:
            raise wrong from None
        if not parsed.hostname:
            raise wrong
        endpoints.append((parsed.hostname, port))
    name = name.strip("/") or f"phalanx-{main_port}"
    return RendezvousPlace("etcd", tuple(endpoints), name, access)


def _etcd_access(value: str, tls: bool, query: str) -> Any:
    """The ``etcd3.Access`` that an etcd rendezvous' scheme and query
    parameters ask for; what is wrong with them, named."""
    from . import etcd3

    try:
        pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        pairs = [("", query)]
    given: dict[str, str] = {}
    for name, text in pairs:
        if name not in _ETCD_PARAMETERS or name in given or not text:
            raise MisconfigurationError(
                f"launcher 'subprocess': rendezvous={value!r}: "
                + (f"{name!r} is given twice" if name in given else f"{name}={text!r} is not a parameter")
                + f"; its parameters are {', '.join(p + '=...' for p in _ETCD_PARAMETERS)}, each once, "
                "with a value"
            )
        given[name] = text
    files = {name: given[name] for name in ("cacert", "cert", "key") if name in given}
    if files and not tls:
        raise MisconfigurationError(
            f"launcher 'subprocess': rendezvous={value!r}: {', '.join(files)} are TLS's; "
            "reach the members over TLS with etcd+https://"
        )
    if "key" in files and "cert" not in files:
        raise MisconfigurationError(
            f"launcher 'subprocess': rendezvous={value!r}: key= without cert=; give the client's "
            "certificate too (cert=PATH)"
        )
    for name, path in files.items():
        full = os.path.abspath(os.path.expanduser(path))
        if not os.access(full, os.R_OK) or not os.path.isfile(full):
            raise MisconfigurationError(
                f"launcher 'subprocess': rendezvous={value!r}: {name}={path!r}: no file to read at {full} "
                "on this host (each node reads its own)"
            )
        files[name] = full
    user = given.get("user")
    password = os.environ.get(ETCD_PASSWORD_VAR) if user else None
    if user and password is None:
        raise MisconfigurationError(
            f"launcher 'subprocess': rendezvous={value!r}: user={user!r} needs its password in "
            f"{ETCD_PASSWORD_VAR}, on every node (not in the URL, which every user of the host can see)"
        )
    return etcd3.Access(tls=tls, user=user, password=password, **files)
