"""Entry-point discovery: load each plugin on its own, record what fails."""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from importlib import metadata

__all__ = ["GROUP", "PluginRecord", "Provider", "normalize", "plugin_filters", "select_entry_points"]

GROUP = "phalanx.plugins"
ALLOW_VAR = "PHALANX_PLUGINS"
DENY_VAR = "PHALANX_DISABLE_PLUGINS"
DEBUG_VAR = "PHALANX_DEBUG"


def normalize(name: str) -> str:
    """A distribution name as PEP 503 normalises it (``Phalanx_Torch`` -> ``phalanx-torch``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Provider:
    """Who gave a part: an entry point (``plugin``) of a distribution, or
    code that registered it at run time (``distribution`` is ``None``)."""

    plugin: str
    distribution: str | None = None
    version: str | None = None

    def __str__(self) -> str:
        if self.distribution is None:
            return f"{self.plugin!r} (registered at run time)"
        return f"{self.plugin!r} ({self.distribution} {self.version})"


@dataclass
class PluginRecord:
    """One plugin: where it came from, what it implements, and whether it loaded.

    ``status`` is ``"loaded"``, ``"failed"`` (``error`` and ``traceback``
    say why) or ``"disabled"`` (by ``PHALANX_PLUGINS`` /
    ``PHALANX_DISABLE_PLUGINS``; ``error`` says which).
    """

    provider: Provider
    value: str
    status: str = "loaded"
    hooks: list[str] = field(default_factory=list)
    error: str | None = None
    traceback: str | None = None
    #: Seconds its entry module took to import (None: not imported).
    import_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.provider.plugin,
            "distribution": self.provider.distribution,
            "version": self.provider.version,
            "value": self.value,
            "status": self.status,
            "hooks": list(self.hooks),
            "error": self.error,
            "traceback": self.traceback,
            "import_seconds": self.import_seconds,
        }

    def fail(self, error: str, exc: BaseException | None = None) -> None:
        self.status = "failed"
        self.error = error
        if exc is not None:
            self.traceback = "".join(traceback.format_exception(exc))


def _split(value: str) -> set[str]:
    return {normalize(part.strip()) for part in value.split(",") if part.strip()}


def plugin_filters(environ: Mapping[str, str] | None = None) -> tuple[set[str] | None, set[str]]:
    """Read the allowlist and denylist: ``(allow, deny)``; ``allow`` is
    ``None`` when ``PHALANX_PLUGINS`` is unset (load all), empty when it is
    empty (load none)."""
    env = os.environ if environ is None else environ
    allow = _split(env[ALLOW_VAR]) if ALLOW_VAR in env else None
    deny = _split(env.get(DENY_VAR, ""))
    return allow, deny


def select_entry_points(
    allow: set[str] | None, deny: set[str]
) -> Iterable[tuple[metadata.EntryPoint, Provider, str | None]]:
    """Yield ``(entry point, provider, why disabled or None)`` for every
    entry point of the group, once each."""
    seen: set[tuple[str, str, str | None]] = set()
    from importlib import metadata  # loaded by Registry(), not by `import phalanx`

    for ep in metadata.entry_points(group=GROUP):
        dist = ep.dist
        dist_name = version = None
        if dist is not None:
            meta = dist.metadata  # parsed once: dist.name and dist.version would parse it twice
            dist_name, version = normalize(meta["Name"]), meta["Version"]
        key = (ep.name, ep.value, dist_name)
        if key in seen:  # the same distribution twice on sys.path
            continue
        seen.add(key)
        provider = Provider(ep.name, dist_name, version)
        names = {normalize(ep.name)} | ({dist_name} if dist_name else set())
        why = None
        if allow is not None and not names & allow:
            why = f"not in {ALLOW_VAR}={','.join(sorted(allow))!s}" if allow else f"{ALLOW_VAR} is empty"
        elif names & deny:
            why = f"in {DENY_VAR}"
        yield ep, provider, why
