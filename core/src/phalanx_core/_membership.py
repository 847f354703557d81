"""What a collective can do when its peers come and go (the fault-tolerance
capabilities of the contract), and :class:`Membership`, the members a
collective that reconfigures forms its next group of."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import MisconfigurationError

__all__ = ["FAULT_TOLERANCE", "Membership", "check_capabilities"]

#: The capabilities a collective may declare in ``fault_tolerance``:
#:
#: - ``"liveness"``: an operation whose peer died or stalled raises a named
#:   error (:class:`~phalanx_core.CollectiveConnectionError` or
#:   :class:`~phalanx_core.CollectiveTimeoutError`) within the collective's
#:   timeout, never hangs; :meth:`~phalanx_core.Collective.abort` ends every
#:   pending operation of this rank.
#: - ``"reconfigure"``: :meth:`~phalanx_core.Collective.reconfigure` forms a
#:   new group of the members it is given, in place, as often as asked in one
#:   process; no operation of one configuration meets another's.
#: - ``"shrink"``: :meth:`~phalanx_core.Collective.shrink` drops ranks from
#:   the group in place, without a new rendezvous (torch's ``shrink_group``).
FAULT_TOLERANCE: tuple[str, ...] = ("liveness", "reconfigure", "shrink")

_ADDRESS = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):(?P<port>\d+)(?:/(?P<prefix>.*))?$")


def check_capabilities(names: object, *, where: str) -> frozenset[str]:
    """``names`` (capability names) as a frozenset, or a
    :class:`~phalanx_core.MisconfigurationError` naming ``where`` and the
    capabilities that exist."""
    if isinstance(names, str) or not isinstance(names, Iterable):
        names = [names]
    found = frozenset(names)
    unknown = sorted(map(repr, found - set(FAULT_TOLERANCE)))
    if unknown:
        raise MisconfigurationError(
            f"{where}: {', '.join(unknown)} is no fault-tolerance capability; "
            f"the capabilities are {', '.join(FAULT_TOLERANCE)}"
        )
    return frozenset(str(name) for name in found)


@dataclass(frozen=True)
class Membership:
    """One configuration of a collective that reconfigures: this rank's
    place among the members, their number, and where they meet.

    Every member of one configuration is given the same ``host``,
    ``port`` and ``prefix`` and its own ``rank``; each configuration has a
    ``prefix`` of its own (TorchFT's quorum id is in it), so that no key of
    one configuration is read by another.

    Attributes:
        rank: this process's rank among the members, ``0 .. world_size - 1``.
        world_size: how many members the group has.
        host: the host of the key-value store the members meet at (a
            server of torch's ``TCPStore`` protocol).
        port: its port.
        prefix: the keys of this configuration in that store.
        label: the configuration in words, for messages (``"quorum 7"``).
        timeout: seconds each operation of this configuration (and its
            forming) may take; ``None``: the collective's own timeout.
    """

    rank: int
    world_size: int
    host: str
    port: int
    prefix: str
    label: str = ""
    timeout: float | None = None

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise MisconfigurationError(f"Membership({name}={value!r}): expected an int")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise MisconfigurationError(
                f"Membership(rank={self.rank}, world_size={self.world_size}): the rank is one of "
                "0 .. world_size - 1, and a group has at least one member"
            )
        if not self.host or not 0 < self.port < 65536:
            raise MisconfigurationError(
                f"Membership(host={self.host!r}, port={self.port}): give the store's host and a port "
                "of 1 .. 65535"
            )
        if self.timeout is not None and (
            isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout <= 0
        ):
            raise MisconfigurationError(f"Membership(timeout={self.timeout!r}): a positive number of seconds")
        if not self.prefix:
            raise MisconfigurationError(
                "Membership(prefix=''): give each configuration a prefix of its own (its keys in the store)"
            )

    @classmethod
    def at(
        cls, address: str, *, rank: int, world_size: int, label: str = "", timeout: float | None = None
    ) -> Membership:
        """From a store address with the configuration's prefix after the
        port, as TorchFT gives one (``"10.0.0.1:29500/torchft/7/0"``)."""
        found = _ADDRESS.match(address) if isinstance(address, str) else None
        if found is None or not found["prefix"]:
            raise MisconfigurationError(
                f"Membership.at({address!r}): expected HOST:PORT/PREFIX, the store the members meet "
                "at and this configuration's keys in it"
            )
        return cls(
            rank=rank,
            world_size=world_size,
            host=found["host"].strip("[]"),
            port=int(found["port"]),
            prefix=found["prefix"],
            label=label,
            timeout=timeout,
        )

    def describe(self) -> str:
        """The configuration in words: ``quorum 7: rank 1 of 3 at 10.0.0.1:29500``."""
        where = f"rank {self.rank} of {self.world_size} at {self.host}:{self.port}/{self.prefix}"
        return f"{self.label}: {where}" if self.label else where
