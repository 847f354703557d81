"""A Plan: the parts chosen for a strategy, each with who gave it and why."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx_core.specs import Kind, Spec, StrategySpec

from ._discovery import Provider

if TYPE_CHECKING:
    from phalanx_core.accelerator import DevicesFlag

__all__ = ["Choice", "Plan"]

#: The order parts are built in, and shown in.
BUILD_ORDER = (
    Kind.STRATEGY,
    Kind.ACCELERATOR,
    Kind.ENVIRONMENT,
    Kind.PRECISION,
    Kind.COLLECTIVE,
    Kind.LAUNCHER,
)


@dataclass(frozen=True)
class Choice:
    """One chosen part: its name, who gave it, and why it was chosen.

    ``instance`` is set when the caller passed a ready object instead of a
    name (then ``spec`` and ``provider`` are ``None``).
    """

    kind: Kind
    name: str
    reason: str
    spec: Spec | None = None
    provider: Provider | None = None
    instance: Any = None
    options: Mapping[str, Any] = field(default_factory=dict)
    #: For a launcher chosen because the processes exist already: the
    #: (qualified) launcher it stands in for, the strategy's default.
    replaces: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": str(self.kind),
            "name": self.name,
            "target": self.spec.target if self.spec else None,
            "plugin": self.provider.plugin if self.provider else None,
            "distribution": self.provider.distribution if self.provider else None,
            "version": self.provider.version if self.provider else None,
            "reason": self.reason,
            "options": {k: repr(v) for k, v in self.options.items()},
        }


@dataclass(frozen=True)
class Plan:
    """Plain data: every part of a strategy, chosen but not built.

    ``registry.build(plan)`` imports the targets and constructs the parts;
    :meth:`explain` renders the plan for people, :meth:`to_dict` for scripts.
    """

    strategy: Choice
    accelerator: Choice | None
    environment: Choice | None
    precision: Choice | None
    collective: Choice | None
    launcher: Choice | None
    devices: DevicesFlag = "auto"
    num_nodes: int = 1
    #: The user's options, given at build to the one part whose constructor takes each.
    options: Mapping[str, Any] = field(default_factory=dict)
    #: The collectives the chosen collective is made of (a composed one's:
    #: ``compressed``'s inner collective), each named ``"<role>: <name>"``.
    composition: tuple[Choice, ...] = ()
    #: For a strategy whose replica groups come and go, the collective
    #: between the groups: the collective's own choice, or the one the
    #: option ``across`` names (and its parts).
    across: Choice | None = None
    across_composition: tuple[Choice, ...] = ()

    @property
    def across_named(self) -> bool:
        """Whether the option ``across`` chose another collective for
        between the groups than the one within them."""
        return self.across is not None and self.across is not self.collective

    def parts(self) -> list[Choice]:
        """The chosen parts in build order (a strategy instance has none)."""
        return [c for c in (getattr(self, str(k)) for k in BUILD_ORDER) if c is not None]

    def traffic(self) -> str | None:
        """Where the training traffic goes, as the strategy's spec says for
        the chosen collective (``StrategySpec.traffic``); ``None`` when it
        does not say, or for a strategy or collective passed as an instance."""
        spec = self.strategy.spec
        if not isinstance(spec, StrategySpec) or self.collective is None:
            return None
        if self.collective.spec is None:
            return None
        across = self.across.name if self.across is not None else None
        return spec.traffic_through(self.collective.name, across=across)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": self.devices if isinstance(self.devices, (int, str)) else list(self.devices),
            "num_nodes": self.num_nodes,
            "options": {k: repr(v) for k, v in self.options.items()},
            "parts": {str(c.kind): c.to_dict() for c in self.parts()},
            "composition": [c.to_dict() for c in self.composition],
            "across": self.across.to_dict() if self.across is not None and self.across_named else None,
            "traffic": self.traffic(),
        }

    def explain(self, devices_here: int | None = None) -> str:
        """The plan as aligned text: one line per part, then its reason; a
        composed collective's parts indented under it. ``devices_here``:
        the number of devices (ranks per node) the built strategy took for
        ``devices``, said where the flag does not say it (``-1``, ``auto``)."""
        rows = []
        for c in self.parts():
            rows.append((str(c.kind), c.name, _source(c), c.reason))
            if c.kind is Kind.COLLECTIVE:
                rows.extend(("", f"  {part.name}", _source(part), part.reason) for part in self.composition)
                if self.across is not None and self.across_named:
                    across = self.across
                    rows.append(("", f"  across: {across.name}", _source(across), across.reason))
                    rows.extend(
                        ("", f"    {part.name}", _source(part), part.reason)
                        for part in self.across_composition
                    )
        width = [max(len(r[i]) for r in rows) for i in range(3)]
        devices = f"devices={self.devices!r}"
        if devices_here is not None and (isinstance(self.devices, str) or self.devices == -1):
            devices += f" ({devices_here} on this machine)"
        lines = [f"{devices} num_nodes={self.num_nodes}"]
        if self.options:
            lines[0] += " options: " + ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        for kind, name, source, reason in rows:
            lines.append(f"{kind:<{width[0]}}  {name:<{width[1]}}  {source:<{width[2]}}  {reason}")
        traffic = self.traffic()
        if traffic:
            lines.append(f"{'traffic':<{width[0]}}  {traffic}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _source(choice: Choice) -> str:
    return str(choice.provider) if choice.provider else "an instance you passed"
