"""A part's entry in the registry: its spec and who gave it; and what
resolution needs of a registry, so that it needs no registry module."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from phalanx_core.errors import PluginError, UnavailableError
from phalanx_core.specs import Kind, Spec

from ._discovery import Provider

__all__ = ["RUNTIME", "Catalog", "Entry"]

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

    def missing(self) -> list[str]:
        """The import names in ``needs`` that are not installed (nothing is imported)."""
        return [n for n in self.spec.needs if importlib.util.find_spec(n.partition(".")[0]) is None]

    def describe(self) -> str:
        return f"{self.kind} {self.name!r} from {self.provider}"

    def check_installed(self) -> None:
        """Raise :class:`UnavailableError` when the spec's needs are missing."""
        missing = self.missing()
        if missing:
            todo = self.spec.install or f"pip install {' '.join(missing)}"
            raise UnavailableError(
                f"{self.describe()} needs {', '.join(missing)}, which "
                f"{'is' if len(missing) == 1 else 'are'} not installed; run: {todo}"
            )

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
