"""The Registry: every part of every plugin, by kind and name."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

from phalanx_core import hookspecs
from phalanx_core.errors import MisconfigurationError, PluginError, UnknownNameError
from phalanx_core.hookspecs import HOOKS, PROJECT
from phalanx_core.specs import SPEC_TYPES, Kind, Spec

from ._discovery import (
    ALLOW_VAR,
    DENY_VAR,
    PluginRecord,
    Provider,
    debug_logging,
    debugging,
    normalize,
    plugin_filters,
    select_entry_points,
)
from ._entry import RUNTIME, Entry
from ._plan import Plan
from ._similar import close_matches as _close_matches

if TYPE_CHECKING:
    from phalanx_core import Strategy
    from phalanx_core.accelerator import DevicesFlag

__all__ = ["Entry", "Registry"]

logger = logging.getLogger(__name__)


class Registry:
    """Every part of every installed plugin, by kind and name.

    Built with a pluggy ``PluginManager`` of its own: with ``autoload`` every
    entry point of the ``phalanx.plugins`` group is loaded (filtered by
    ``PHALANX_PLUGINS`` / ``PHALANX_DISABLE_PLUGINS``, read now), each on
    its own; then each object in ``plugins`` (modules or objects with
    hook implementations) is registered. A plugin that fails is recorded in
    :attr:`plugins` and the others go on.
    """

    def __init__(self, plugins: Iterable[Any] = (), *, autoload: bool = True) -> None:
        self._pm = pluggy.PluginManager(PROJECT)
        self._pm.add_hookspecs(hookspecs)
        debug_logging(("phalanx", "phalanx_core"))
        if debugging():
            self._pm.trace.root.setwriter(lambda text: logger.debug(text.rstrip("\n")))
            self._pm.enable_tracing()
        self._trace = self._pm.trace.root.get("phalanx")
        self._all: dict[Kind, list[Entry]] = {kind: [] for kind in Kind}
        self._by_name: dict[Kind, dict[str, list[Entry]]] = {kind: {} for kind in Kind}
        self._aliases: dict[Kind, dict[str, list[Entry]]] = {kind: {} for kind in Kind}
        #: Every plugin seen, loaded or not, in load order.
        self.plugins: list[PluginRecord] = []
        #: Names in PHALANX_PLUGINS / PHALANX_DISABLE_PLUGINS that match no
        #: installed plugin, each said in a sentence.
        self.filter_problems: list[str] = []
        if autoload:
            self._autoload()
        for plugin in plugins:
            self.register_plugin(plugin)

    # -- loading -------------------------------------------------------------

    def _autoload(self) -> None:
        allow, deny = plugin_filters()
        seen: set[str] = set()
        for ep, provider, why in select_entry_points(allow, deny):
            seen |= {normalize(ep.name)} | ({provider.distribution} if provider.distribution else set())
            record = PluginRecord(provider, ep.value)
            self.plugins.append(record)
            if why is not None:
                record.status, record.error = "disabled", why
                self._pm.set_blocked(ep.name)
                continue
            self._trace(f"loading {provider}: {ep.value}")
            started = time.perf_counter()
            try:
                module = ep.load()
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                record.fail(f"importing {ep.value!r} raised {type(exc).__name__}: {exc}", exc)
                continue
            finally:
                record.import_seconds = time.perf_counter() - started
            self._add(module, record)
            debug_logging([ep.value.split(":")[0].split(".")[0]])
        installed = ", ".join(str(p.provider) for p in self.plugins) or "none"
        for var, names in ((ALLOW_VAR, allow or set()), (DENY_VAR, deny)):
            for name in sorted(names - seen):
                close = _close_matches(name, sorted(seen), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                self.filter_problems.append(
                    f"{var} names {name!r}, which is no installed plugin{hint}; the installed plugins: "
                    f"{installed}"
                )

    def register_plugin(self, plugin: Any, name: str | None = None) -> PluginRecord:
        """Register a plugin object (a module or any object with hook
        implementations) at run time; return its record. Its specs are
        added as if it came from an entry point; a failure raises
        :class:`PluginError` at once."""
        plugin_name = name or getattr(plugin, "__name__", None) or type(plugin).__name__
        record = PluginRecord(Provider(plugin_name), repr(plugin))
        self.plugins.append(record)
        self._add(plugin, record)
        if record.status == "failed":
            raise PluginError(f"plugin {record.provider}: {record.error}")
        return record

    def _add(self, plugin: Any, record: PluginRecord) -> None:
        name = record.provider.plugin
        if self._pm.has_plugin(name) or self._pm.is_blocked(name):
            name = f"{record.provider.distribution}:{name}"
        try:
            self._pm.register(plugin, name=name)
            self._pm.check_pending()
        except (ValueError, pluggy.PluginValidationError) as exc:
            if self._pm.is_registered(plugin):
                self._pm.unregister(plugin)
            record.fail(self._explain_invalid(plugin, exc), exc)
            self._trace(f"{record.provider} failed validation: {record.error}")
            return
        for hook_name in HOOKS.values():
            caller = getattr(self._pm.hook, hook_name)
            for impl in caller.get_hookimpls():
                if impl.plugin is plugin:
                    record.hooks.append(hook_name)
                    self._call(impl, hook_name, record)

    def _explain_invalid(self, plugin: Any, exc: Exception) -> str:
        known = list(HOOKS.values())
        wrong = [attr for attr in dir(plugin) if attr.startswith(f"{PROJECT}_") and attr not in known] or [
            attr for attr in dir(plugin) if attr.startswith(f"{PROJECT}")
        ]
        hints = []
        for attr in wrong:
            close = _close_matches(attr, known, n=1)
            hints.append(f"{attr!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        what = f"it implements unknown hook(s) {', '.join(hints)}" if hints else str(exc)
        return f"{what}; the hooks are {', '.join(known)}. ({type(exc).__name__}: {exc})"

    def _call(self, impl: pluggy.HookImpl, hook_name: str, record: PluginRecord) -> None:
        kind = Kind(next(k for k, h in HOOKS.items() if h == hook_name))
        spec_type = SPEC_TYPES[kind]
        try:
            result = impl.function()
        except Exception as exc:  # noqa: BLE001 - a plugin's failure is recorded, the rest go on
            record.fail(f"hook {hook_name} raised {type(exc).__name__}: {exc}", exc)
            self._trace(f"{hook_name} of {record.provider} failed: {record.error}")
            return
        self._trace(f"{hook_name} of {record.provider} returned {result!r}")
        if result is None:
            return
        if isinstance(result, (str, bytes, Spec)) or not isinstance(result, Iterable):
            record.fail(
                f"hook {hook_name} returned {type(result).__name__}; it must return an iterable "
                f"of {spec_type.__name__} (a list, or None for none)"
            )
            return
        specs = list(result)
        wrong = [s for s in specs if not isinstance(s, spec_type)]
        if wrong:
            record.fail(
                f"hook {hook_name} returned {type(wrong[0]).__name__} {wrong[0]!r} among its "
                f"results; every item must be a {spec_type.__name__}"
            )
            return
        for spec in specs:
            self._store(Entry(spec, record.provider))

    def _store(self, entry: Entry, *, replace: bool = False) -> None:
        kind = entry.kind
        self._all[kind].append(entry)
        if replace:
            self._by_name[kind][entry.name] = [entry]
        else:
            self._by_name[kind].setdefault(entry.name, []).append(entry)
        for alias in entry.spec.aliases:
            self._aliases[kind].setdefault(alias, []).append(entry)

    def register(self, spec: Spec, *, replace: bool = False) -> Entry:
        """Register a part at run time and return its entry.

        A name that an installed plugin already gives is refused with
        :class:`MisconfigurationError` unless ``replace`` is true; then the
        bare name means this spec (the plugin's stays reachable by its
        qualified name).
        """
        if not isinstance(spec, Spec) or type(spec) is Spec:
            raise MisconfigurationError(
                f"register({spec!r}): give a spec of one kind, e.g. CollectiveSpec(name=..., "
                "target='module:Class')"
            )
        existing = self._by_name[spec.kind].get(spec.name, [])
        if existing and not replace:
            raise MisconfigurationError(
                f"register(): {spec.kind} {spec.name!r} already exists, given by "
                f"{', '.join(str(e.provider) for e in existing)}; pass replace=True to make the "
                "name mean yours, or choose another name"
            )
        entry = Entry(spec, Provider(RUNTIME))
        self._store(entry, replace=replace)
        return entry

    # -- lookup --------------------------------------------------------------

    def entries(self, kind: Kind | str | None = None) -> Iterator[Entry]:
        """Every entry of ``kind`` (or of every kind), in registration order."""
        kinds = [Kind(kind)] if kind is not None else list(Kind)
        for k in kinds:
            yield from self._all[k]

    def names(self, kind: Kind | str) -> list[str]:
        """The names of ``kind`` that exist, sorted."""
        return sorted(self._by_name[Kind(kind)])

    @property
    def failures(self) -> list[PluginRecord]:
        """The plugins that failed to load."""
        return [p for p in self.plugins if p.status == "failed"]

    def get(self, kind: Kind | str, name: str) -> Entry:
        """Return the entry for ``name`` (bare, alias, or qualified
        ``"distribution:name"``). Raises :class:`UnknownNameError` for a
        name no plugin gives and :class:`PluginError` for a bare name two
        plugins give."""
        kind = Kind(kind)
        if not isinstance(name, str):
            raise MisconfigurationError(f"{kind}={name!r}: expected a name (str)")
        if ":" in name:
            dist, _, bare = name.partition(":")
            found = [
                e
                for e in self._all[kind]
                if e.name == bare and normalize(e.provider.distribution or RUNTIME) == normalize(dist)
            ]
        else:
            found = self._by_name[kind].get(name) or self._aliases[kind].get(name, [])
        if not found:
            raise UnknownNameError(self._unknown_message(kind, name))
        if len(found) > 1:
            raise PluginError(
                f"{kind} {name!r} is given by {len(found)} plugins: "
                f"{'; '.join(f'{e.provider} as {e.qualified_name!r}' for e in found)}. Use a "
                "qualified name to choose one, or uninstall one of them"
            )
        return found[0]

    def _unknown_message(self, kind: Kind, name: str) -> str:
        names = self.names(kind)
        for entry in self._all[kind] if kind in (Kind.STRATEGY, Kind.COLLECTIVE) else ():
            variants = {k.lower(): v for k, v in getattr(entry.spec, "variants", {}).items()}
            options = variants.get(name.lower())
            if options is None:
                continue
            keywords = ", ".join(f"{k}={v!r}" for k, v in options.items())
            if kind is Kind.COLLECTIVE:
                flags = " ".join(f"-o {k}={v}" for k, v in options.items())
                return (
                    f"collective {name!r} is not a collective of its own: collective {entry.name!r} "
                    f"speaks it, with {keywords}: resolve(..., collective={entry.name!r}, {keywords}) "
                    f"(phalanx run: --collective {entry.name} {flags})"
                )
            return (
                f"{kind} {name!r} is another library's name (Fabric's) for strategy {entry.name!r} with "
                f"{keywords}; phalanx names the strategy and its options apart: "
                f"resolve({entry.name!r}, {keywords})"
            )
        same_letters = [n for n in names if n.lower() == name.lower()]
        close = same_letters or _close_matches(name.lower(), names, n=3)
        parts = [f"unknown {kind} {name!r}."]
        if same_letters:
            parts.append(f"Did you mean {same_letters[0]!r}? Names are case-sensitive.")
        elif close:
            parts.append(f"Did you mean {' or '.join(map(repr, close))}?")
        parts.append(f"The {kind} names that exist: {', '.join(names) or '(none)'}.")
        if self.failures:
            broken = "; ".join(f"{p.provider}: {p.error}" for p in self.failures)
            parts.append(f"Plugins that failed to load (the name may be in one): {broken}.")
        parts.extend(f"{problem}." for problem in self.filter_problems)
        disabled = [p for p in self.plugins if p.status == "disabled"]
        if disabled:
            parts.append(
                "Disabled plugins: " + ", ".join(f"{p.provider} ({p.error})" for p in disabled) + "."
            )
        parts.append("Install the plugin that gives it (`phalanx list` shows what is installed).")
        return " ".join(parts)

    # -- resolution ------------------------------------------------------------

    def plan(
        self,
        strategy: Any = "auto",
        *,
        accelerator: Any = "auto",
        devices: DevicesFlag = "auto",
        num_nodes: int | None = None,
        precision: Any = None,
        collective: Any = None,
        launcher: Any = None,
        environment: Any = None,
        plugins: Sequence[Any] = (),
        **options: Any,
    ) -> Plan:
        """Check the flags and choose every part, building nothing.

        Each flag is a name (bare, alias or ``"distribution:name"``), a
        ready instance, or ``"auto"`` / ``None`` for the default: the
        strategy spec's default part, the available accelerator of highest
        priority, the detected environment, ``precision="32-true"``,
        ``num_nodes=1``. A value given is a value given, even the default's
        (``precision="32-true"`` and a precision in ``plugins`` is the
        precision given twice). ``plugins`` is a list of ready
        parts, each given to its kind (Lightning's habit): the same kind
        twice, or both there and as a flag, is an error. ``options`` go to
        the one part whose constructor takes each. Raises :class:`MisconfigurationError`,
        :class:`UnknownNameError`, :class:`PluginError` or
        :class:`UnavailableError` — never falls back to something not asked
        for.
        """
        flags = {
            "strategy": strategy,
            "accelerator": accelerator,
            "devices": devices,
            "num_nodes": num_nodes,
            "precision": precision,
            "collective": collective,
            "launcher": launcher,
            "environment": environment,
            "plugins": plugins,
            "options": options,
        }
        from ._resolve import plan  # what resolving needs loads here, not at `import phalanx`

        return plan(self, flags)

    def build(self, plan: Plan) -> Strategy:
        """Import the plan's targets and construct its parts, in order."""
        from ._build import build

        return build(self, plan)

    def resolve(self, strategy: Any = "auto", **flags: Any) -> Strategy:
        """``self.build(self.plan(strategy, **flags))``: a name to a
        composed, ready strategy."""
        return self.build(self.plan(strategy, **flags))

    def __repr__(self) -> str:
        counts = ", ".join(f"{len(self._all[k])} {k}" for k in Kind)
        return f"Registry({len(self.plugins)} plugins: {counts})"
