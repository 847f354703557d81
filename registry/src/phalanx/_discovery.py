"""Entry-point discovery: load each plugin on its own, record what fails."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "GROUP",
    "EntryPoint",
    "PluginRecord",
    "Provider",
    "debug_logging",
    "debugging",
    "entry_points",
    "normalize",
    "plugin_filters",
    "select_entry_points",
]

GROUP = "phalanx.plugins"
ALLOW_VAR = "PHALANX_PLUGINS"
DENY_VAR = "PHALANX_DISABLE_PLUGINS"
DEBUG_VAR = "PHALANX_DEBUG"


def debugging() -> bool:
    """Whether ``PHALANX_DEBUG`` asks for tracing (set, and not empty or ``0``)."""
    return os.environ.get(DEBUG_VAR, "").strip() not in ("", "0")


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler that writes to whatever ``sys.stderr`` is when it writes."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


_HANDLER = _Stderr()
_HANDLER.setFormatter(logging.Formatter("%(name)s: %(message)s"))


def debug_logging(packages: Iterable[str]) -> None:
    """With ``PHALANX_DEBUG``, the tracing of ``packages`` (each module of
    phalanx's logs through ``logging.getLogger(__name__)``): their loggers
    at DEBUG, written to stderr as ``module: message`` (and to whatever
    handlers the program gave the root logger). Without it, nothing."""
    if not debugging():
        return
    for name in packages:
        logger = logging.getLogger(name)
        logger.setLevel(logging.DEBUG)
        if _HANDLER not in logger.handlers:
            logger.addHandler(_HANDLER)


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
            import traceback  # a failed plugin only: a listing without one stays light

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


@dataclass(frozen=True)
class EntryPoint:
    """One entry point of a group: ``name = value``, ``value`` being
    ``module`` or ``module:attr.attr`` (extras in brackets are ignored, as
    ``importlib.metadata`` ignores them when it loads)."""

    name: str
    value: str
    #: The distribution's name as its metadata writes it, and its version
    #: (``None`` for both where no distribution is known).
    distribution: str | None = None
    version: str | None = None

    def load(self) -> Any:
        """Import the module and return the object the value names."""
        import importlib

        match = _TARGET.match(self.value)
        if match is None:
            raise ValueError(f"entry point {self.name!r}: {self.value!r} is not 'module' or 'module:attr'")
        found: Any = importlib.import_module(match["module"])
        for attr in filter(None, (match["attr"] or "").split(".")):
            found = getattr(found, attr)
        return found


# importlib.metadata's own pattern for an entry point's value.
_TARGET = re.compile(r"(?P<module>[\w.]+)\s*(:\s*(?P<attr>[\w.]+)\s*)?((?P<extras>\[.*\])\s*)?$")
_INFO = (".dist-info", ".egg-info")


def entry_points(group: str) -> list[EntryPoint]:
    """Every entry point of ``group``, as ``importlib.metadata.entry_points``
    gives them (each distribution once, the first on ``sys.path`` winning).

    Where ``sys.path`` holds only folders and the standard path finder is
    the only finder that knows distributions (every virtual environment and
    editable install), the ``*.dist-info`` / ``*.egg-info`` folders are read
    here: importing ``importlib.metadata`` costs 18-20 ms (it imports
    ``email``, ``zipfile``, ``csv`` and ``pathlib``), a third of what a
    ``phalanx list`` costs above a bare interpreter. Anything else (a zip or
    an ``.egg`` on ``sys.path``, a finder of another package) goes through
    ``importlib.metadata`` itself.
    """
    found = _read_folders(group)
    return _from_importlib_metadata(group) if found is None else found


def _info_folders() -> list[tuple[str, str]] | None:
    """Every distribution's ``*.dist-info`` / ``*.egg-info`` folder on
    ``sys.path``, as (normalized name, path), the first of each name only;
    ``None`` where a case needs importlib.metadata (another package's
    finder, a zip or an ``.egg`` on ``sys.path``)."""
    for finder in sys.meta_path:
        standard = getattr(finder, "__module__", "") == "_frozen_importlib_external"
        if hasattr(finder, "find_distributions") and not standard:
            return None
    seen: set[str] = set()
    folders: list[tuple[str, str]] = []
    for entry in sys.path:
        root = entry or "."
        if root.lower().endswith(".egg"):
            return None
        try:
            children = os.listdir(root)
        except NotADirectoryError:
            return None  # a zip file on sys.path
        except OSError:
            continue  # a folder that is not there
        for child in children:
            if not child.lower().endswith(_INFO):
                continue
            key = normalize(os.path.splitext(child)[0].partition("-")[0])
            if key not in seen:
                seen.add(key)
                folders.append((key, os.path.join(root, child)))
    return folders


def _read_folders(group: str) -> list[EntryPoint] | None:
    """The folders' entry points, or ``None`` where a case needs importlib.metadata."""
    folders = _info_folders()
    if folders is None:
        return None
    found: list[EntryPoint] = []
    for _, folder in folders:
        text = _read(os.path.join(folder, "entry_points.txt"))
        pairs = _section(text, group) if text else []
        if pairs:
            name, version = _name_and_version(folder)
            found += [EntryPoint(ep, value, name, version) for ep, value in pairs]
    return found


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return None


def _section(text: str, group: str) -> list[tuple[str, str]]:
    """``name = value`` pairs of ``[group]``, read as importlib.metadata reads them."""
    pairs: list[tuple[str, str]] = []
    section = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line.strip("[]").strip()
        elif section == group:
            name, _, value = line.partition("=")
            pairs.append((name.strip(), value.strip()))
    return pairs


def _name_and_version(folder: str) -> tuple[str | None, str | None]:
    """``Name`` and ``Version`` from the metadata's headers (they end at the first empty line)."""
    text = _read(os.path.join(folder, "METADATA")) or _read(os.path.join(folder, "PKG-INFO")) or ""
    headers: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and key in ("Name", "Version") and key not in headers:
            headers[key] = value.strip()
    return headers.get("Name"), headers.get("Version")


def distribution_version(name: str) -> str | None:
    """The version of the installed distribution ``name`` (the first on
    ``sys.path``), read from its metadata as :func:`entry_points` reads
    them (``importlib.metadata`` only where the folders cannot say); None
    when none is installed."""
    folders = _info_folders()
    if folders is not None:
        key = normalize(name)
        return next((_name_and_version(folder)[1] for k, folder in folders if k == key), None)
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _from_importlib_metadata(group: str) -> list[EntryPoint]:
    from importlib import metadata

    found = []
    for ep in metadata.entry_points(group=group):
        dist = ep.dist
        meta = (
            dist.metadata if dist is not None else None
        )  # parsed once, not once for each of name and version
        found.append(
            EntryPoint(
                ep.name, ep.value, *((meta["Name"], meta["Version"]) if meta is not None else (None, None))
            )
        )
    return found


def select_entry_points(
    allow: set[str] | None, deny: set[str]
) -> Iterable[tuple[EntryPoint, Provider, str | None]]:
    """Yield ``(entry point, provider, why disabled or None)`` for every
    entry point of the group, once each."""
    seen: set[tuple[str, str, str | None]] = set()
    for ep in entry_points(GROUP):
        dist_name = normalize(ep.distribution) if ep.distribution is not None else None
        key = (ep.name, ep.value, dist_name)
        if key in seen:  # the same distribution twice on sys.path
            continue
        seen.add(key)
        provider = Provider(ep.name, dist_name, ep.version)
        names = {normalize(ep.name)} | ({dist_name} if dist_name else set())
        why = None
        if allow is not None and not names & allow:
            why = f"not in {ALLOW_VAR}={','.join(sorted(allow))!s}" if allow else f"{ALLOW_VAR} is empty"
        elif names & deny:
            why = f"in {DENY_VAR}"
        yield ep, provider, why
