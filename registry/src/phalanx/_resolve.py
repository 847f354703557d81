"""Resolution in three steps: check the flags, plan, build."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx_core import (
    Launcher,
    MisconfigurationError,
    PhalanxError,
    Strategy,
    UnavailableError,
    UnknownNameError,
)
from phalanx_core.specs import CollectiveSpec, Kind, LauncherSpec, Spec, StrategySpec

from ._entry import Catalog, Entry
from ._flags import (
    _DEFAULTS,
    INTERFACES,
    _check_flags,
    _device_count,
    _with_plugins,
    _with_run_flags,
)
from ._plan import Choice, Plan

__all__ = ["plan"]


def _is_interactive() -> bool:
    """A notebook or a REPL (``__main__`` has no file), or code read from
    standard input (``python -``: its file is ``"<stdin>"``): nothing that
    a new process could import or re-run."""
    main = sys.modules.get("__main__")
    if main is None:
        return False
    file = getattr(main, "__file__", None)
    return file is None or (file.startswith("<") and file.endswith(">"))


def _spawn_bootstrapping() -> bool:
    """Whether this is a process multiprocessing's spawn started, still
    importing the parent's main module."""
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


# -- step 2: the plan ------------------------------------------------------------


def _named(registry: Catalog, kind: Kind, value: Any, reason: str) -> Choice:
    if isinstance(value, INTERFACES[kind]):
        # Planned under the part's own name (an Accelerator's is its device
        # type: a custom 'xla' accelerator fits the xla strategies).
        name = getattr(value, "name", None)
        name = name if isinstance(name, str) and name else type(value).__name__
        return Choice(kind, name, "an instance you passed", instance=value)
    entry = registry.get(kind, str(value))
    if any(found is not None for _, found in entry.unmet()):
        # A backend installed in a version the part does not support: said
        # now, before any other check takes the part for missing.
        entry.check_installed()
    return Choice(kind, entry.name, reason, entry.spec, entry.provider, options=entry.spec.options)


def _default_entry(registry: Catalog, kind: Kind, name: str, owner: Choice | Entry | None) -> Entry:
    """The entry of a part a spec names as its default (a strategy's
    collective, launcher or environment; a composed collective's parts):
    looked up in the distribution of the plugin that gave the spec first,
    which meant its own part, so that another installed plugin giving the
    same name takes no default away. Where that distribution has none, the
    name as any plugin gives it (and refused as ambiguous as ever). A name
    the user types is never looked up this way."""
    provider = owner.provider if owner is not None else None
    if ":" not in name and provider is not None and provider.distribution:
        with contextlib.suppress(UnknownNameError):
            return registry.get(kind, f"{provider.distribution}:{name}")
    return registry.get(kind, name)


def _default(registry: Catalog, kind: Kind, name: Any, owner: Choice | Entry, reason: str) -> Choice:
    if not isinstance(name, str):
        return _named(registry, kind, name, reason)
    return _choice(_default_entry(registry, kind, name, owner), reason)


def _qualified_entry(entry: Entry) -> str:
    dist = entry.provider.distribution
    return f"{dist}:{entry.name}" if dist else entry.name


def _choice(entry: Entry, reason: str) -> Choice:
    return Choice(entry.kind, entry.name, reason, entry.spec, entry.provider, options=entry.spec.options)


def _pick_accelerator(registry: Catalog, allowed: Sequence[str]) -> Choice:
    candidates = [e for e in registry.entries(Kind.ACCELERATOR) if not allowed or e.name in allowed]
    candidates.sort(key=lambda e: (-e.spec.priority, e.name))
    skipped = []
    for entry in candidates:
        missing = entry.missing()
        if missing:
            absent = [need.name for need, found in entry.unmet() if found is None]
            said = f"{', '.join(absent)} not installed" if absent else f"needs {', '.join(missing)}"
            skipped.append(f"{entry.name}: {said} ({entry.todo()})")
            continue
        availability = entry.load().availability()
        if availability:
            why = "auto: the available accelerator of highest priority"
            return _choice(entry, why + (f" (skipped {'; '.join(skipped)})" if skipped else ""))
        skipped.append(f"{entry.name}: {availability.reason}")
    raise UnavailableError(
        "accelerator='auto' found no available accelerator"
        + (f" among {', '.join(allowed)}" if allowed else "")
        + (
            f": {'; '.join(skipped)}. Install what it needs, or name another accelerator"
            if skipped
            else ": none is installed. Install a plugin that gives one (pip install phalanx-torch)"
        )
    )


def _pick_strategy(registry: Catalog, accelerator: str, count: int | None, num_nodes: int) -> Choice:
    parallel = num_nodes > 1 or (count is not None and count > 1)
    fits = [
        e
        for e in registry.entries(Kind.STRATEGY)
        if isinstance(e.spec, StrategySpec)
        and e.spec.parallel == parallel
        and (not e.spec.accelerators or accelerator in e.spec.accelerators)
        and not e.missing()
    ]
    if not fits:
        raise MisconfigurationError(
            f"strategy='auto' found no {'parallel' if parallel else 'single-device'} strategy for "
            f"accelerator {accelerator!r}; the strategies that exist: "
            f"{', '.join(registry.names(Kind.STRATEGY)) or '(none)'}. Name one, or install a plugin "
            "that gives one"
        )
    fits.sort(key=lambda e: (-e.spec.priority, e.name))
    which = "parallel" if parallel else "single-device"
    if parallel and _is_interactive() and not getattr(fits[0].spec, "accelerators", ()):
        # A notebook has no script to re-run: the strategies whose default
        # launcher works here (ddp_notebook's fork), as Fabric picks; not in
        # place of a strategy made for this accelerator only (xla).
        here = [
            e for e in fits if _runs_interactively(registry, e) and not getattr(e.spec, "accelerators", ())
        ]
        if here:
            return _choice(
                here[0],
                f"auto: the {which} strategy of highest priority whose launcher works in a notebook or REPL",
            )
    return _choice(fits[0], f"auto: the {which} strategy of highest priority")


def _external_world(env: Any, num_nodes: int) -> int | None:
    """Processes per node that a scheduler or launcher already started
    (torchrun, srun, mpirun), or ``None`` where the environment starts none."""
    if env is None or not getattr(type(env), "creates_processes_externally", False):
        return None
    try:
        size = int(env.world_size)
    except (PhalanxError, ValueError, TypeError):
        return None
    return max(1, size // max(1, num_nodes))


def _check_external_world(environment: Any, num_devices: int, num_nodes: int) -> None:
    """For every environment whose processes were started outside phalanx
    (a third party's too, whatever its own ``validate`` checks): as many as
    ``devices x num_nodes``, or one rank would train alone."""
    if not getattr(type(environment), "creates_processes_externally", False):
        return
    size = environment.world_size
    wanted = num_devices * num_nodes
    if size != wanted and num_nodes > 1 and getattr(environment, "local_world_size", None) == num_devices:
        # This node started what was asked; another did not. The plan check
        # across the nodes, when the collective is set up, shows which node
        # differs in what, side by side.
        return
    if size != wanted:
        raise MisconfigurationError(
            f"environment {type(environment).__name__} started {size} process(es) (its world_size), but "
            f"devices={num_devices} x num_nodes={num_nodes} = {wanted} were asked for; start {wanted}, or "
            f"set devices / num_nodes to the {size} that exist"
        )


def _auto_count(registry: Catalog, accelerator: Choice, flags: Mapping[str, Any]) -> int | None:
    """What ``devices='auto'`` / ``-1`` counts when choosing a strategy: the
    processes a launcher already started, else every device of the
    accelerator (4 GPUs: DDP on 4, as Fabric does)."""
    if flags["environment"] is None:
        detected = _detect_environment(registry)
        env_class = type(detected.instance) if detected.instance is not None else None
        if env_class is None:
            env_class = registry.get(Kind.ENVIRONMENT, _qualified(detected)).load()
        if getattr(env_class, "creates_processes_externally", False):
            return _external_world(env_class(), flags["num_nodes"])
    cls = (
        type(accelerator.instance)
        if accelerator.instance is not None
        else registry.get(Kind.ACCELERATOR, _qualified(accelerator)).load()
    )
    return int(cls.device_count()) or None


def _runs_interactively(registry: Catalog, entry: Entry) -> bool:
    """Whether a strategy's default launcher works where there is no script."""
    assert isinstance(entry.spec, StrategySpec)
    try:
        launcher = registry.get(Kind.LAUNCHER, entry.spec.launcher)
    except PhalanxError:
        return False
    return isinstance(launcher.spec, LauncherSpec) and launcher.spec.interactive


def _detect_environment(registry: Catalog) -> Choice:
    entries = sorted(registry.entries(Kind.ENVIRONMENT), key=lambda e: (-e.spec.priority, e.name))
    for entry in entries:
        if entry.missing():
            continue
        if entry.load().detect():
            return _choice(entry, f"detected (priority {entry.spec.priority})")
    raise UnavailableError(
        "no cluster environment detected and none is installed as a default; install "
        "phalanx-torch (which gives 'local') or pass environment="
    )


def _launchers_environment(
    registry: Catalog, launcher: Any, detected: Choice, *, owner: Choice | None = None
) -> Choice:
    """The environment the chosen launcher's ranks run in, where its spec
    names one (``ray``), instead of the one detected; unless what was
    detected already started the processes (a scheduler's ranks, or this
    launcher's own, where that environment detects itself)."""
    if not isinstance(launcher, str):
        return detected
    try:
        entry = _default_entry(registry, Kind.LAUNCHER, launcher, owner)
    except PhalanxError:
        return detected  # unknown: _pick_launcher says so
    spec = entry.spec
    brought = spec.environment if isinstance(spec, LauncherSpec) else None
    if brought is None or detected.name == brought:
        return detected
    env_class = type(detected.instance) if detected.instance is not None else None
    if env_class is None:
        env_class = registry.get(Kind.ENVIRONMENT, _qualified(detected)).load()
    if getattr(env_class, "creates_processes_externally", False):
        return detected  # _pick_launcher refuses a launcher that makes processes there
    reason = f"where launcher {spec.name!r} runs its ranks"
    return _default(registry, Kind.ENVIRONMENT, brought, entry, reason)


def _qualified(choice: Choice) -> str:
    """The name that finds exactly this choice's entry again."""
    if choice.provider is not None and choice.provider.distribution:
        return f"{choice.provider.distribution}:{choice.name}"
    return choice.name


def _launcher_spec(choice: Choice) -> LauncherSpec | None:
    return choice.spec if isinstance(choice.spec, LauncherSpec) else None


def runs_per_node(launcher_class: type[Launcher], env_class: type[Any]) -> bool:
    """Whether the launcher runs once per node where ``env_class`` (a
    scheduler's) started one process per node, and starts the node's ranks
    (:meth:`~phalanx_core.Launcher.runs_per_node`), rather than running in
    the processes it started."""
    return bool(
        getattr(env_class, "creates_processes_externally", False)
        and launcher_class.runs_per_node(env_class)
        and not launcher_class.runs_in_existing_processes(env_class)
    )


#: Why a launcher that starts processes is kept where a scheduler started them.
_PER_NODE = (
    "environment {!r} started one process per node, and this launcher runs in it and starts the node's ranks"
)


def _pick_launcher(
    registry: Catalog, flag: Any, default: str, environment: Choice, strategy: Choice
) -> Choice:
    env_class = type(environment.instance) if environment.instance is not None else None
    if env_class is None and environment.spec is not None:
        env_class = registry.get(Kind.ENVIRONMENT, _qualified(environment)).load()
    external = bool(getattr(env_class, "creates_processes_externally", False))
    if flag is not None:
        choice = _named(registry, Kind.LAUNCHER, flag, "asked for")
        if not external or env_class is None:
            return choice
        launcher_class = (
            type(choice.instance)
            if choice.instance is not None
            else registry.get(Kind.LAUNCHER, _qualified(choice)).load()
        )
        if runs_per_node(launcher_class, env_class):
            return dataclasses.replace(choice, reason=f"asked for; {_PER_NODE.format(environment.name)}")
        if launcher_class.runs_in_existing_processes(env_class):
            if launcher_class.creates_processes:
                reason = f"asked for; it runs fn in the processes {environment.name!r} already started"
                return Choice(
                    choice.kind,
                    choice.name,
                    reason,
                    choice.spec,
                    choice.provider,
                    choice.instance,
                    choice.options,
                )
            return choice
        raise MisconfigurationError(
            f"launcher={choice.name!r} creates processes, but environment "
            f"{environment.name!r} already started one process per rank; drop launcher= (the "
            "processes that exist are used), or pass environment='local' to start them yourself"
        )
    entry = _default_entry(registry, Kind.LAUNCHER, default, strategy)
    if external and isinstance(entry.spec, LauncherSpec) and entry.spec.creates_processes:
        if env_class is not None and runs_per_node(entry.load(), env_class):
            return _choice(entry, f"the strategy's default; {_PER_NODE.format(environment.name)}")
        passive = sorted(
            (
                e
                for e in registry.entries(Kind.LAUNCHER)
                if isinstance(e.spec, LauncherSpec) and not e.spec.creates_processes
            ),
            key=lambda e: (-e.spec.priority, e.name),
        )
        if not passive:
            raise UnavailableError(
                f"environment {environment.name!r} already started the processes, but no installed "
                "launcher runs in existing processes; install phalanx-torch (launcher 'in_process')"
            )
        return dataclasses.replace(
            _choice(passive[0], f"environment {environment.name!r} already started one process per rank"),
            replaces=_qualified_entry(entry),
        )
    return _choice(entry, "the strategy's default")


def plan(registry: Catalog, flags: dict[str, Any]) -> Plan:
    """Check the flags, then choose every part; import only what choosing
    needs (accelerator availability for ``"auto"``, environment detection)."""
    flags = _with_run_flags(registry, _with_plugins(flags))
    for name in ("precision", "num_nodes"):
        if flags[name] is None and not isinstance(flags["strategy"], Strategy):
            flags[name] = _DEFAULTS[name]
    _check_flags(flags)
    strategy_flag = flags["strategy"]
    if isinstance(strategy_flag, Strategy):
        return Plan(
            Choice(
                Kind.STRATEGY, type(strategy_flag).__name__, "an instance you passed", instance=strategy_flag
            ),
            None,
            None,
            None,
            None,
            None,
            flags["devices"],
            strategy_flag.num_nodes,
        )
    count = _device_count(flags["devices"])
    accelerator_flag = flags["accelerator"]
    spec: StrategySpec | None = None
    if strategy_flag != "auto":
        strategy = _named(registry, Kind.STRATEGY, strategy_flag, "asked for")
        assert isinstance(strategy.spec, StrategySpec)
        spec = strategy.spec
    allowed = spec.accelerators if spec else ()
    if accelerator_flag == "auto":
        accelerator = _pick_accelerator(registry, allowed)
    else:
        accelerator = _named(registry, Kind.ACCELERATOR, accelerator_flag, "asked for")
        if allowed and accelerator.name not in allowed:
            raise MisconfigurationError(
                f"strategy {spec.name!r} works with accelerator(s) {', '.join(allowed)}, not "  # type: ignore[union-attr]
                f"{accelerator.name!r}; drop accelerator= or choose a strategy for "
                f"{accelerator.name!r}"
            )
    if spec is None:
        if count is None:  # devices 'auto' / -1: every device, or every process a launcher started
            count = _auto_count(registry, accelerator, flags)
        strategy = _pick_strategy(registry, accelerator.name, count, flags["num_nodes"])
        assert isinstance(strategy.spec, StrategySpec)
        spec = strategy.spec
    if not spec.parallel and ((count or 1) > 1 or flags["num_nodes"] > 1):
        parallel = [
            e.name
            for e in registry.entries(Kind.STRATEGY)
            if isinstance(e.spec, StrategySpec) and e.spec.parallel
        ]
        raise MisconfigurationError(
            f"strategy {spec.name!r} runs on one device in one process, but devices="
            f"{flags['devices']!r} and num_nodes={flags['num_nodes']} ask for more; use devices=1, "
            f"or a parallel strategy ({', '.join(parallel) or 'none installed: pip install phalanx-torch'})"
        )
    if flags["environment"] is not None:
        environment = _named(registry, Kind.ENVIRONMENT, flags["environment"], "asked for")
    elif spec.environment is not None:
        default = "the strategy's default"
        environment = _default(registry, Kind.ENVIRONMENT, spec.environment, strategy, default)
    else:
        launcher_flag = flags["launcher"]
        environment = _launchers_environment(
            registry,
            launcher_flag if launcher_flag is not None else spec.launcher,
            _detect_environment(registry),
            owner=None if launcher_flag is not None else strategy,
        )
    precision_flag = flags["precision"]
    if isinstance(precision_flag, int) and not isinstance(precision_flag, bool):
        precision_flag = str(precision_flag)
    precision = _named(registry, Kind.PRECISION, precision_flag, "asked for")
    if flags["collective"] is not None:
        collective = _named(registry, Kind.COLLECTIVE, flags["collective"], "asked for")
    else:
        collective = _default(registry, Kind.COLLECTIVE, spec.collective, strategy, "the strategy's default")
    launcher = _pick_launcher(registry, flags["launcher"], spec.launcher, environment, strategy)
    if _is_interactive():
        lspec = _launcher_spec(launcher)
        if lspec is not None and not lspec.interactive and _spawn_bootstrapping():
            raise MisconfigurationError(
                f"resolve() ran while a process that launcher 'spawn' started was importing your main "
                "script (spawn runs it again in every new process, under the name __mp_main__), and "
                f"would start processes from there with launcher {launcher.name!r}. Put the code that "
                'resolves and launches under `if __name__ == "__main__":`'
            )
        if lspec is not None and not lspec.interactive:
            several = (count or 1) > 1 or flags["num_nodes"] > 1
            ok = [
                e.name
                for e in registry.entries(Kind.LAUNCHER)
                if isinstance(e.spec, LauncherSpec)
                and e.spec.interactive
                and (e.spec.creates_processes or not several)
                and not e.missing()
            ]
            raise MisconfigurationError(
                f"launcher {launcher.name!r} cannot run in a notebook or REPL (it re-runs the "
                "script, and here there is none); pass an interactive launcher: "
                f"{', '.join(f'launcher={n!r}' for n in ok) or '(none installed)'}"
            )
    composition = _composition(registry, collective, flags["options"])
    across, across_composition = _across(registry, strategy, collective, composition, flags["options"])
    return Plan(
        strategy,
        accelerator,
        environment,
        precision,
        collective,
        launcher,
        flags["devices"],
        flags["num_nodes"],
        dict(flags["options"]),
        composition,
        across,
        across_composition,
    )


#: The options that name the collective between a fault-tolerant
#: strategy's replica groups, and its options.
ACROSS_OPTIONS = ("across", "across_options")


def _across(
    registry: Catalog,
    strategy: Choice,
    collective: Choice,
    composition: tuple[Choice, ...],
    options: Mapping[str, Any],
) -> tuple[Choice | None, tuple[Choice, ...]]:
    """The collective between the replica groups of a strategy that needs
    one (``StrategySpec.collective_needs``), and its parts: the one named
    by the option ``across`` (with ``across_options``), else another of the
    strategy's collective; checked for the capabilities the strategy
    needs. ``None`` for other strategies (which refuse the options)."""
    spec = strategy.spec
    named = options.get("across")
    if not isinstance(spec, StrategySpec) or not spec.collective_needs:
        given = [name for name in ACROSS_OPTIONS if name in options]
        if given:
            ones = sorted(
                entry.name
                for entry in registry.entries(Kind.STRATEGY)
                if isinstance(entry.spec, StrategySpec) and entry.spec.collective_needs
            )
            raise MisconfigurationError(
                f"option {given[0]} names the collective between the replica groups of a strategy whose "
                f"groups come and go ({', '.join(ones) or 'none installed'}); strategy {strategy.name!r} has "
                "none. Name its one collective with collective="
            )
        return None, ()
    extra = options.get("across_options", {})
    if not isinstance(extra, Mapping):
        raise MisconfigurationError(
            f"option across_options={extra!r}: give a dict of the options of the collective across groups"
        )
    if named is None:
        if extra:
            raise MisconfigurationError(
                "option across_options is for the collective named by across=; without it the collective "
                "between the groups is another of the one named with collective=, with its options"
            )
        _check_capabilities(registry, strategy, collective, composition)
        return collective, composition
    if not isinstance(named, str) or not named:
        raise MisconfigurationError(
            f"option across={named!r}: name a collective (e.g. 'compressed'), as collective= takes it"
        )
    across = _named(registry, Kind.COLLECTIVE, named, "asked for (option across)")
    parts = _composition(registry, across, extra)
    _check_capabilities(registry, strategy, across, parts)
    return across, parts


def capabilities_of(
    registry: Catalog, spec: CollectiveSpec, parts: Sequence[Spec | None] | None = None
) -> set[str]:
    """The fault-tolerance capabilities of a collective by its spec: what
    it declares, and for a composed one what every part has as well
    (``parts``: the chosen parts' specs; ``None``: its default parts)."""
    has = set(spec.fault_tolerance)
    if parts is None:
        parts = []
        for name in spec.parts.values():
            try:
                parts.append(registry.get(Kind.COLLECTIVE, name).spec)
            except PhalanxError:
                parts.append(None)  # not installed: it has nothing
    for part in parts:
        has &= set(part.fault_tolerance) if isinstance(part, CollectiveSpec) else set()
    return has


def _check_capabilities(
    registry: Catalog, strategy: Choice, collective: Choice, composition: Sequence[Choice]
) -> None:
    """Refuse a collective without the fault-tolerance capabilities the
    strategy needs (``StrategySpec.collective_needs``), naming them and the
    installed collectives that have them. A ready instance is checked when
    the strategy is built."""
    spec = strategy.spec
    if not isinstance(spec, StrategySpec) or not spec.collective_needs:
        return
    if not isinstance(collective.spec, CollectiveSpec):
        return
    needs = set(spec.collective_needs)
    has = capabilities_of(registry, collective.spec, [part.spec for part in composition])
    if needs <= has:
        return
    able = sorted(
        entry.name
        for entry in registry.entries(Kind.COLLECTIVE)
        if isinstance(entry.spec, CollectiveSpec) and needs <= capabilities_of(registry, entry.spec)
    )
    example = "torch" if "torch" in able else (able or ["torch"])[0]
    lacking = [
        f"{who} declares {', '.join(sorted(declared)) or 'none'}"
        for who, declared in (
            (
                f"collective {collective.name!r} ({_source_of(collective)})",
                set(collective.spec.fault_tolerance),
            ),
            *(
                (f"its part {part.name!r}", set(getattr(part.spec, "fault_tolerance", ())))
                for part in composition
            ),
        )
        if not needs <= declared
    ]
    raise MisconfigurationError(
        f"strategy {spec.name!r} needs a collective with the capabilities {' and '.join(sorted(needs))} "
        "(its replica groups come and go: each step's members form a group of their own), and "
        f"{'; '.join(lacking)}. Collectives that have them: "
        f"{', '.join(able) or 'none installed (pip install phalanx-torch)'}; e.g. collective={example!r}"
    )


def _source_of(choice: Choice) -> str:
    return str(choice.provider) if choice.provider else choice.reason


def _composition(registry: Catalog, collective: Choice, options: Mapping[str, Any]) -> tuple[Choice, ...]:
    """The collectives a composed collective is made of (``compressed``'s
    inner one), as its spec's ``parts`` names the options that choose them,
    each chosen as ``collective=`` would be; none for another collective.
    Imports nothing."""
    spec = collective.spec
    if not isinstance(spec, CollectiveSpec):
        return ()
    chosen = []
    for role, default in spec.parts.items():
        name = options.get(role, default)
        if isinstance(name, str):
            reason = f"{role} of {collective.name!r}"
            if role in options:  # the user's name
                part = _named(registry, Kind.COLLECTIVE, name, reason)
            else:
                part = _default(registry, Kind.COLLECTIVE, name, collective, reason)
            chosen.append(dataclasses.replace(part, name=f"{role}: {part.name}"))
    return tuple(chosen)
