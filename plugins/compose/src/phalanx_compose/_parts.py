"""What a composed collective shares: finding the collectives it is made
of, by name, through the registry users resolve with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from phalanx_core import Collective, MisconfigurationError


def make_collective(role: str, name: Any, options: Mapping[str, Any], *, owner: str) -> Collective:
    """The collective named ``name`` (or ``name`` itself, a ready
    instance), built with ``options``: found as ``resolve(collective=...)``
    finds it, so a third party's collective composes as the built-in ones
    do. ``role`` and ``owner`` name the option in messages (``inner`` of
    ``compressed``)."""
    if isinstance(name, Collective):
        return name
    if not isinstance(name, str) or not name:
        raise MisconfigurationError(
            f"collective {owner!r}: {role}={name!r}; name a collective (e.g. 'torch', 'mpi'), as "
            "resolve(collective=...) takes it"
        )
    import phalanx

    entry = phalanx.default_registry().get("collective", name)  # unknown: says which exist
    cls = entry.load()  # missing needs: says what to install
    if not (isinstance(cls, type) and issubclass(cls, Collective)):
        raise MisconfigurationError(f"collective {owner!r}: {role}={name!r} is not a collective ({cls!r})")
    try:
        return cls(**options)
    except TypeError as exc:
        raise MisconfigurationError(
            f"collective {owner!r}: {role}={name!r} does not take the options {dict(options)!r} "
            f"({exc}); give {role}_options= only what {cls.__qualname__} takes"
        ) from None
