"""A part's entry in the registry: its spec and who gave it; and what
resolution needs of a registry, so that it needs no registry module."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from phalanx_core.errors import PluginError, UnavailableError
from phalanx_core.specs import Kind, Need, Spec

from ._discovery import Provider, distribution_version

__all__ = ["RUNTIME", "Backend", "Catalog", "Entry", "backends", "installed_version"]

RUNTIME = "<runtime>"


@dataclass(frozen=True)
class Entry:
    """A spec and who gave it."""

    spec: Spec
    provider: Provider

    @property
    def kind(self) -> Kind:
        return self.spec.kind

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def qualified_name(self) -> str:
        return f"{self.provider.distribution or RUNTIME}:{self.spec.name}"

    def unmet(self) -> list[tuple[Need, str | None]]:
        """The spec's needs that are not met, each with the version
        installed (None: not installed). Nothing is imported: versions are
        read from the installed distributions' metadata."""
        unmet: list[tuple[Need, str | None]] = []
        for text in self.spec.needs:
            need = Need.parse(text)
            if not is_installed(need.name):
                unmet.append((need, None))
                continue
            found = installed_version(need.name) if need.versions else None
            if found is not None and not need.admits(found):
                unmet.append((need, found))
        return unmet

    def missing(self) -> list[str]:
        """The unmet needs in a few words each: ``"torch"`` (not
        installed), ``"torch>=2.9 (2.5.1 is installed)"``."""
        unmet = self.unmet()
        return [need.name if found is None else f"{need} ({found} is installed)" for need, found in unmet]

    def todo(self) -> str:
        """What to run to meet the spec's needs: its ``install`` when one is
        not installed, else a pip command for the versions it supports."""
        unmet = self.unmet()
        absent = [need.name for need, found in unmet if found is None]
        if absent:
            return self.spec.install or f"pip install {' '.join(absent)}"
        return "pip install " + " ".join(f"'{need}'" for need, _ in unmet)

    def describe(self) -> str:
        return f"{self.kind} {self.name!r} from {self.provider}"

    def check_installed(self) -> None:
        """Raise :class:`UnavailableError` when the spec's needs are not met."""
        unmet = self.unmet()
        absent = [need.name for need, found in unmet if found is None]
        if absent:
            raise UnavailableError(
                f"{self.describe()} needs {', '.join(absent)}, which "
                f"{'is' if len(absent) == 1 else 'are'} not installed; run: {self.todo()}"
            )
        if unmet:
            said = ", ".join(f"{need} ({need.name} {found} is installed)" for need, found in unmet)
            raise UnavailableError(f"{self.describe()} supports {said}; run: {self.todo()}")

    def load(self) -> Any:
        """Import the spec's target and return it. Raises
        :class:`UnavailableError` when its needs are missing and
        :class:`PluginError`, naming the distribution, when the target does
        not exist."""
        self.check_installed()
        module_name, _, attr = self.spec.target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
        except Exception as exc:
            raise PluginError(
                f"{self.describe()}: its target {self.spec.target!r} cannot be imported "
                f"({type(exc).__name__}: {exc}). Fix or uninstall {self.owner()}"
            ) from exc
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError as exc:
                raise PluginError(
                    f"{self.describe()}: its target {self.spec.target!r} does not exist (module "
                    f"{module_name!r} has no {part!r}). Fix or uninstall {self.owner()}"
                ) from exc
        return obj

    def owner(self) -> str:
        """Who to ask about this part: its distribution, or the code that registered it."""
        return self.provider.distribution or f"the code that registered {self.name!r}"


class Catalog(Protocol):
    """What planning and building read from a registry
    (:class:`~phalanx.Registry` is one)."""

    def entries(self, kind: Kind | str | None = None) -> Iterator[Entry]: ...

    def names(self, kind: Kind | str) -> list[str]: ...

    def get(self, kind: Kind | str, name: str) -> Entry: ...


#: Within :func:`one_look`: what each import name's lookup found.
_LOOKED: contextvars.ContextVar[dict[str, bool] | None] = contextvars.ContextVar(
    "phalanx_looked", default=None
)


@contextlib.contextmanager
def one_look() -> Iterator[None]:
    """Within, each import name is looked up once (``phalanx list`` asks
    whether torch is installed for every part that needs it); outside,
    every look is made again, so that a backend installed while a process
    runs is seen."""
    token = _LOOKED.set({})
    try:
        yield
    finally:
        _LOOKED.reset(token)


def is_installed(name: str) -> bool:
    """Whether the top-level package of import name ``name`` can be
    imported (:func:`importlib.util.find_spec`, which imports nothing)."""
    top = name.partition(".")[0]
    looked = _LOOKED.get()
    if looked is None:
        return importlib.util.find_spec(top) is not None
    if top not in looked:
        looked[top] = importlib.util.find_spec(top) is not None
    return looked[top]


@functools.lru_cache(maxsize=64)
def _version(name: str, path: tuple[str, ...]) -> str | None:
    return distribution_version(name)


def installed_version(name: str) -> str | None:
    """The version of the installed distribution ``name`` (from its
    metadata, importing nothing); None when none is installed under that
    name. Read once per ``sys.path``."""
    return _version(name, tuple(sys.path))


@dataclass(frozen=True)
class Backend:
    """A library that parts need within a range of versions (``torch``),
    what is installed of it, and which distributions say which versions."""

    name: str
    installed: str | None
    #: (distribution, the versions it supports), one per distribution.
    ranges: tuple[tuple[str, str], ...]

    @property
    def supported(self) -> bool:
        """Whether the installed version is in every distribution's range
        (nothing installed: not supported)."""
        if self.installed is None:
            return False
        return all(Need(self.name, versions).admits(self.installed) for _, versions in self.ranges)

    def say(self) -> str:
        """``torch 2.13.0: in the range of phalanx-torch 0.1.0 (>=2.9)``;
        ranges that differ are each said with their verdict."""
        by_range: dict[str, list[str]] = {}
        for who, versions in self.ranges:
            by_range.setdefault(versions, []).append(who)
        said = []
        for versions, givers in by_range.items():
            if self.installed is None:
                verdict = "supported by"
            elif Need(self.name, versions).admits(self.installed):
                verdict = "in the range of"
            else:
                verdict = "NOT in the range of"
            said.append(f"{verdict} {', '.join(givers)} ({versions})")
        return f"{self.name} {self.installed or '(not installed)'}: {'; '.join(said)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "installed": self.installed,
            "supported": self.supported,
            "ranges": [{"distribution": who, "versions": versions} for who, versions in self.ranges],
        }


def backends(entries: Iterator[Entry] | list[Entry]) -> list[Backend]:
    """The libraries the entries' specs need with a version range, by
    name: what is installed and each distribution's range."""
    ranges: dict[str, dict[str, str]] = {}
    for entry in entries:
        for text in entry.spec.needs:
            need = Need.parse(text)
            if need.versions:
                provider = entry.provider
                who = f"{provider.distribution} {provider.version}" if provider.distribution else RUNTIME
                ranges.setdefault(need.name, {}).setdefault(who, need.versions)
    return [
        Backend(name, installed_version(name), tuple(sorted(by.items())))
        for name, by in sorted(ranges.items())
    ]
