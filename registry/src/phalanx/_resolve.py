"""Resolution in three steps: check the flags, plan, build."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx_core import (
    Accelerator,
    ClusterEnvironment,
    Collective,
    Launcher,
    MisconfigurationError,
    PhalanxError,
    PluginError,
    Precision,
    Strategy,
    UnavailableError,
)
from phalanx_core.specs import CollectiveSpec, Kind, LauncherSpec, StrategySpec

from ._plan import Choice, Plan

if TYPE_CHECKING:
    from ._registry import Entry, Registry

__all__ = ["RUN_FLAGS_VAR", "build", "plan"]

#: The flags ``phalanx run`` was given (JSON), which ``resolve()`` in the
#: script's ranks takes as its defaults.
RUN_FLAGS_VAR = "PHALANX_RUN_FLAGS"
#: Each flag's value when the code does not give it.
_DEFAULTS: dict[str, Any] = {
    "strategy": "auto",
    "accelerator": "auto",
    "devices": "auto",
    "num_nodes": 1,
    "precision": "32-true",
    "collective": None,
}
_KIND_OF = {
    "strategy": Kind.STRATEGY,
    "accelerator": Kind.ACCELERATOR,
    "precision": Kind.PRECISION,
    "collective": Kind.COLLECTIVE,
}

#: The interface each kind's instances and targets must have.
INTERFACES: dict[Kind, type] = {
    Kind.ACCELERATOR: Accelerator,
    Kind.ENVIRONMENT: ClusterEnvironment,
    Kind.LAUNCHER: Launcher,
    Kind.COLLECTIVE: Collective,
    Kind.PRECISION: Precision,
    Kind.STRATEGY: Strategy,
}
_PARTS = (Kind.ACCELERATOR, Kind.ENVIRONMENT, Kind.PRECISION, Kind.COLLECTIVE, Kind.LAUNCHER)


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


# -- step 1: the flags ---------------------------------------------------------


def _check_flags(flags: Mapping[str, Any]) -> None:
    for kind in (Kind.STRATEGY, Kind.ACCELERATOR, *_PARTS[1:]):
        value = flags[str(kind)]
        if value is None or isinstance(value, (str, INTERFACES[kind])):
            continue
        if kind is Kind.PRECISION and isinstance(value, int) and not isinstance(value, bool):
            continue
        raise MisconfigurationError(
            f"{kind}={value!r}: expected a name (str) or a {INTERFACES[kind].__name__} instance, "
            f"got {type(value).__name__}. `phalanx list --kind {kind}` shows the names"
        )
    if flags["strategy"] is None or flags["accelerator"] is None:
        which = "strategy" if flags["strategy"] is None else "accelerator"
        raise MisconfigurationError(f"{which}=None: name one, or pass 'auto'")
    devices = flags["devices"]
    ok_devices = (
        (isinstance(devices, int) and not isinstance(devices, bool))
        or isinstance(devices, str)
        or (
            isinstance(devices, Sequence)
            and all(isinstance(d, int) and not isinstance(d, bool) for d in devices)
        )
    )
    if not ok_devices:
        raise MisconfigurationError(
            f"devices={devices!r}: expected an int, a list of ints, a string like '0,2', or 'auto'"
        )
    if (isinstance(devices, int) and devices == 0) or devices in ((), []):
        raise MisconfigurationError(
            f"devices={devices!r} asks for no device; ask for at least 1, or -1 / 'auto' for all"
        )
    if isinstance(devices, int) and devices < -1:
        raise MisconfigurationError(
            f"devices={devices}: a count must be at least 1 (-1 and 'auto' mean all devices)"
        )
    if isinstance(devices, str) and devices.strip() not in ("auto", "-1"):
        items = [d.strip() for d in devices.split(",")]
        if not all(d.isdigit() for d in items if d) or not any(items) or "" in items[:-1]:
            raise MisconfigurationError(
                f"devices={devices!r}: expected 'auto', a count like '2', or device indices like '0,2'"
            )
        if devices.strip().isdigit() and int(devices) == 0:
            raise MisconfigurationError(
                f"devices={devices!r} asks for no device; ask for at least 1, or -1 / 'auto' for all"
            )
    if isinstance(devices, Sequence) and not isinstance(devices, str) and any(d < 0 for d in devices):
        raise MisconfigurationError(f"devices={list(devices)!r}: device indices start at 0")
    nodes = flags["num_nodes"]
    if nodes is not None and (not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1):
        raise MisconfigurationError(f"num_nodes={nodes!r}: expected an int of at least 1")
    if isinstance(flags["strategy"], Strategy):
        _check_beside_instance(flags)


def _check_beside_instance(flags: Mapping[str, Any]) -> None:
    """Beside a ready strategy, a part or option given is refused (it has
    its parts), and ``devices`` / ``num_nodes`` must be what it was built
    with: none is dropped without a word."""
    ready = flags["strategy"]
    given = [str(k) for k in _PARTS if flags[str(k)] not in (None, "auto")]
    if given or flags["options"]:
        raise MisconfigurationError(
            f"strategy is a ready {type(ready).__name__} instance, so it already has "
            f"its parts; you also passed {', '.join(given + list(flags['options']))}. Give "
            "the strategy by name to choose its parts with flags, or set them on the instance"
        )
    has = {"devices": len(getattr(ready, "parallel_devices", ()) or ()), "num_nodes": ready.num_nodes}
    devices = flags["devices"]
    count = _device_count(devices) if devices not in ("auto", -1, "-1") else None
    asked = {"devices": count, "num_nodes": flags["num_nodes"]}
    differ = [k for k in ("devices", "num_nodes") if asked[k] is not None and asked[k] != has[k]]
    if differ:
        raise MisconfigurationError(
            f"strategy is a ready {type(ready).__name__} instance built for devices={has['devices']}, "
            f"num_nodes={has['num_nodes']}, and you also passed "
            f"{', '.join(f'{k}={flags[k]!r}' for k in differ)}; it cannot change now. Give the strategy "
            "by name with those flags, or drop them"
        )


def _with_plugins(flags: dict[str, Any]) -> dict[str, Any]:
    """Give each ready part in ``plugins=[...]`` to its kind's flag (and a
    CheckpointIO to the strategy's ``checkpoint_io``); a kind given twice is
    an error that names both."""
    from phalanx_core import CheckpointIO

    plugins = flags.get("plugins") or ()
    if not isinstance(plugins, (list, tuple)):
        raise MisconfigurationError(
            f"plugins={plugins!r}: expected a list of ready parts (an environment, a precision, "
            "a collective, a launcher, an accelerator or a CheckpointIO instance)"
        )
    merged = {k: v for k, v in flags.items() if k != "plugins"}
    merged["options"] = dict(flags["options"])
    seen: dict[str, Any] = {}
    for item in plugins:
        if isinstance(item, CheckpointIO):
            kind_name, flag = "checkpoint_io", "checkpoint_io"
        else:
            kinds = [k for k in _PARTS if isinstance(item, INTERFACES[k])]
            if not kinds:
                what = "a strategy: pass it as the first argument" if isinstance(item, Strategy) else ""
                raise MisconfigurationError(
                    f"plugins=[..., {item!r}, ...]: not a part phalanx composes{'; ' + what if what else ''}"
                    ". plugins= takes ready environments, precisions, collectives, launchers, "
                    "accelerators and CheckpointIO instances"
                )
            kind_name = flag = str(kinds[0])
        if kind_name in seen:
            raise MisconfigurationError(
                f"plugins= has two {kind_name} parts, {type(seen[kind_name]).__name__} and "
                f"{type(item).__name__}; a strategy has one {kind_name}: keep the one you mean"
            )
        seen[kind_name] = item
        if flag == "checkpoint_io":
            given = merged["options"].get("checkpoint_io")
        else:
            given = merged[flag]
            if (flag, given) == ("accelerator", "auto"):
                given = None
        if given is not None:
            raise MisconfigurationError(
                f"the {kind_name} is given twice: {flag}={given!r} and plugins=[{type(item).__name__}(...)]"
                "; give it in one place"
            )
        if flag == "checkpoint_io":
            merged["options"]["checkpoint_io"] = item
        else:
            merged[flag] = item
    return merged


def _device_count(devices: Any) -> int | None:
    """How many devices a flag asks for, where that is known without the hardware."""
    if isinstance(devices, int) and devices > 0:
        return devices
    if isinstance(devices, str) and devices not in ("auto", "-1"):
        items = [d for d in devices.split(",") if d.strip()]
        return len(items) if "," in devices else (int(devices) if devices.strip().isdigit() else None)
    if isinstance(devices, Sequence) and not isinstance(devices, str):
        return len(devices)
    return None


def _same(registry: Registry, flag: str, a: Any, b: Any) -> bool:
    """Whether two values of a flag mean the same (an alias and its name)."""
    if flag in _KIND_OF:
        a, b = (str(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in (a, b))
        if isinstance(a, str) and isinstance(b, str):
            try:
                return registry.get(_KIND_OF[flag], a).spec is registry.get(_KIND_OF[flag], b).spec
            except PhalanxError:
                return a == b
    if flag == "devices":
        a, b = (int(v) if isinstance(v, str) and v.strip().lstrip("-").isdigit() else v for v in (a, b))
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return list(a) == list(b)
    return bool(a == b)


def _with_run_flags(registry: Registry, flags: dict[str, Any]) -> dict[str, Any]:
    """Under ``phalanx run``, its flags fill the flags the code left at
    their defaults; a flag given both ways with different values is an
    error that names both."""
    raw = os.environ.get(RUN_FLAGS_VAR)
    if not raw:
        return flags
    try:
        given = json.loads(raw)
    except ValueError as exc:
        raise MisconfigurationError(
            f"{RUN_FLAGS_VAR}={raw!r} is not the JSON `phalanx run` writes ({exc}); unset it"
        ) from exc
    if isinstance(flags["strategy"], Strategy) and given:
        shown = " ".join(
            " ".join(f"--option {n}={v!r}" for n, v in v.items())
            if k == "options"
            else f"--{k.replace('_', '-')} {v}"
            for k, v in given.items()
        )
        raise MisconfigurationError(
            f"`phalanx run {shown}` chose the strategy's parts, and the script passes a ready "
            f"{type(flags['strategy']).__name__} instance to resolve(); call phalanx.resolve() "
            "without it, or drop the flags from phalanx run"
        )
    merged = dict(flags)
    options = given.pop("options", None) or {}
    if options:
        merged["options"] = dict(flags["options"])
        for name, value in options.items():
            if name not in flags["options"]:
                merged["options"][name] = value
            elif flags["options"][name] != value:
                raise MisconfigurationError(
                    f"`phalanx run --option {name}={value!r}` and resolve({name}={flags['options'][name]!r}) "
                    f"in the script disagree; give {name} in one place (the command line, or the code)"
                )
    for name, value in given.items():
        code = flags.get(name, _DEFAULTS.get(name))
        if code is None or (name in _DEFAULTS and _same(registry, name, code, _DEFAULTS[name])):
            merged[name] = value
        elif not _same(registry, name, code, value):
            raise MisconfigurationError(
                f"`phalanx run --{name.replace('_', '-')} {value}` and resolve({name}={code!r}) in the "
                f"script disagree; give {name} in one place (the command line, or the code)"
            )
    return merged


# -- step 2: the plan ------------------------------------------------------------


def _named(registry: Registry, kind: Kind, value: Any, reason: str) -> Choice:
    if isinstance(value, INTERFACES[kind]):
        # Planned under the part's own name (an Accelerator's is its device
        # type: a custom 'xla' accelerator fits the xla strategies).
        name = getattr(value, "name", None)
        name = name if isinstance(name, str) and name else type(value).__name__
        return Choice(kind, name, "an instance you passed", instance=value)
    entry = registry.get(kind, str(value))
    return Choice(kind, entry.name, reason, entry.spec, entry.provider, options=entry.spec.options)


def _choice(entry: Entry, reason: str) -> Choice:
    return Choice(entry.kind, entry.name, reason, entry.spec, entry.provider, options=entry.spec.options)


def _pick_accelerator(registry: Registry, allowed: Sequence[str]) -> Choice:
    candidates = [e for e in registry.entries(Kind.ACCELERATOR) if not allowed or e.name in allowed]
    candidates.sort(key=lambda e: (-e.spec.priority, e.name))
    skipped = []
    for entry in candidates:
        missing = entry.missing()
        if missing:
            todo = entry.spec.install or f"pip install {' '.join(missing)}"
            skipped.append(f"{entry.name}: {', '.join(missing)} not installed ({todo})")
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


def _pick_strategy(registry: Registry, accelerator: str, count: int | None, num_nodes: int) -> Choice:
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


def _auto_count(registry: Registry, accelerator: Choice, flags: Mapping[str, Any]) -> int | None:
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


def _runs_interactively(registry: Registry, entry: Entry) -> bool:
    """Whether a strategy's default launcher works where there is no script."""
    assert isinstance(entry.spec, StrategySpec)
    try:
        launcher = registry.get(Kind.LAUNCHER, entry.spec.launcher)
    except PhalanxError:
        return False
    return isinstance(launcher.spec, LauncherSpec) and launcher.spec.interactive


def _detect_environment(registry: Registry) -> Choice:
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


def _launchers_environment(registry: Registry, launcher: Any, detected: Choice) -> Choice:
    """The environment the chosen launcher's ranks run in, where its spec
    names one (``ray``), instead of the one detected; unless what was
    detected already started the processes (a scheduler's ranks, or this
    launcher's own, where that environment detects itself)."""
    if not isinstance(launcher, str):
        return detected
    try:
        spec = registry.get(Kind.LAUNCHER, launcher).spec
    except PhalanxError:
        return detected  # unknown: _pick_launcher says so
    brought = spec.environment if isinstance(spec, LauncherSpec) else None
    if brought is None or detected.name == brought:
        return detected
    env_class = type(detected.instance) if detected.instance is not None else None
    if env_class is None:
        env_class = registry.get(Kind.ENVIRONMENT, _qualified(detected)).load()
    if getattr(env_class, "creates_processes_externally", False):
        return detected  # _pick_launcher refuses a launcher that makes processes there
    return _named(registry, Kind.ENVIRONMENT, brought, f"where launcher {spec.name!r} runs its ranks")


def _qualified(choice: Choice) -> str:
    """The name that finds exactly this choice's entry again."""
    if choice.provider is not None and choice.provider.distribution:
        return f"{choice.provider.distribution}:{choice.name}"
    return choice.name


def _launcher_spec(choice: Choice) -> LauncherSpec | None:
    return choice.spec if isinstance(choice.spec, LauncherSpec) else None


def _pick_launcher(registry: Registry, flag: Any, default: str, environment: Choice) -> Choice:
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
    entry = registry.get(Kind.LAUNCHER, default)
    if external and isinstance(entry.spec, LauncherSpec) and entry.spec.creates_processes:
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
        return _choice(passive[0], f"environment {environment.name!r} already started one process per rank")
    return _choice(entry, "the strategy's default")


def plan(registry: Registry, flags: dict[str, Any]) -> Plan:
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
        environment = _named(registry, Kind.ENVIRONMENT, spec.environment, "the strategy's default")
    else:
        environment = _launchers_environment(
            registry, flags["launcher"] or spec.launcher, _detect_environment(registry)
        )
    precision_flag = flags["precision"]
    if isinstance(precision_flag, int) and not isinstance(precision_flag, bool):
        precision_flag = str(precision_flag)
    precision = _named(registry, Kind.PRECISION, precision_flag, "asked for")
    if flags["collective"] is not None:
        collective = _named(registry, Kind.COLLECTIVE, flags["collective"], "asked for")
    else:
        collective = _named(registry, Kind.COLLECTIVE, spec.collective, "the strategy's default")
    launcher = _pick_launcher(registry, flags["launcher"], spec.launcher, environment)
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
        _composition(registry, collective, flags["options"]),
    )


def _composition(registry: Registry, collective: Choice, options: Mapping[str, Any]) -> tuple[Choice, ...]:
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
            part = _named(registry, Kind.COLLECTIVE, name, f"{role} of {collective.name!r}")
            chosen.append(dataclasses.replace(part, name=f"{role}: {part.name}"))
    return tuple(chosen)


# -- step 3: build ----------------------------------------------------------------


#: What build passes to each kind itself; users cannot set these as options.
_GIVEN: dict[Kind, tuple[str, ...]] = {
    Kind.ACCELERATOR: (),
    Kind.ENVIRONMENT: (),
    Kind.PRECISION: ("accelerator",),
    Kind.COLLECTIVE: (),
    Kind.LAUNCHER: ("environment", "num_processes", "num_nodes", "accelerator"),
    Kind.STRATEGY: (
        "accelerator",
        "environment",
        "collective",
        "precision",
        "launcher",
        "parallel_devices",
        "num_nodes",
    ),
}


def _target(registry: Registry, choice: Choice) -> tuple[Entry, type] | None:
    """The entry and class a choice builds, or None for a ready instance."""
    if choice.instance is not None:
        return None
    qualified = (
        f"{choice.provider.distribution}:{choice.name}"
        if choice.provider and choice.provider.distribution
        else choice.name
    )
    entry = registry.get(choice.kind, qualified)
    target = entry.load()
    interface = INTERFACES[choice.kind]
    if not (isinstance(target, type) and issubclass(target, interface)):
        raise PluginError(
            f"{entry.describe()}: its target {entry.spec.target!r} is {target!r}, not a subclass "
            f"of phalanx_core.{interface.__name__}. Fix or uninstall {entry.owner()}"
        )
    return entry, target


def _route(plan: Plan, targets: dict[Kind, tuple[Entry, type] | None]) -> dict[Kind, dict[str, Any]]:
    """Give each user option to the one part whose constructor takes it."""
    routed: dict[Kind, dict[str, Any]] = {kind: {} for kind in targets}
    takes: dict[Kind, set[str]] = {}
    for kind, found in targets.items():
        if found is not None:
            accepted = _accepted_options(found[1])
            takes[kind] = (accepted if accepted is not None else set()) - set(_GIVEN[kind])
    for key, value in plan.options.items():
        takers = [kind for kind, names in takes.items() if key in names]
        if len(takers) == 1:
            routed[takers[0]][key] = value
            continue
        if not takers:
            accepted_by = "; ".join(
                f"{kind} {targets[kind][0].name!r} takes {', '.join(sorted(names)) or 'none'}"  # type: ignore[index]
                for kind, names in takes.items()
            )
            raise MisconfigurationError(
                f"option {key}={value!r} is taken by no part of this plan ({accepted_by}). Check "
                "the spelling, or pass a ready instance of the part that should get it"
            )
        raise MisconfigurationError(
            f"option {key}={value!r} is taken by more than one part: "
            f"{', '.join(f'{k} {targets[k][0].name!r}' for k in takers)}; pass a ready instance "  # type: ignore[index]
            "of the part you mean instead (e.g. collective=TorchCollective(timeout=60))"
        )
    return routed


def _construct(
    found: tuple[Entry, type] | None, choice: Choice, options: dict[str, Any], **given: Any
) -> Any:
    if found is None:
        return choice.instance
    return found[1](**{**choice.options, **options, **given})


def _accepted_options(cls: type) -> set[str] | None:
    """The keyword arguments ``cls(...)`` accepts, following ``**kwargs`` up
    the base classes; ``None`` when any are accepted."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        if klass is object:
            return names
        params = inspect.signature(init).parameters.values()
        names.update(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD))
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            names.discard("self")
            return names
    return None


def build(registry: Registry, plan: Plan) -> Strategy:
    """Import the chosen targets and construct the parts in order; each
    part validates itself in its constructor."""
    if plan.strategy.instance is not None:
        return plan.strategy.instance  # type: ignore[no-any-return]
    acc, env, prec, coll, launch = (
        plan.accelerator,
        plan.environment,
        plan.precision,
        plan.collective,
        plan.launcher,
    )
    if acc is None or env is None or prec is None or coll is None or launch is None:
        raise MisconfigurationError(f"build(): the plan has unchosen parts: {plan!r}")
    spec = plan.strategy.spec
    targets = {choice.kind: _target(registry, choice) for choice in plan.parts()}
    for kind, found in targets.items():
        if found is not None:
            choice = getattr(plan, str(kind))
            accepted = _accepted_options(found[1])
            bad = sorted(set(choice.options) - accepted) if accepted is not None else []
            if bad:
                raise PluginError(
                    f"{found[0].describe()}: its spec gives option(s) {', '.join(map(repr, bad))}, "
                    f"which {found[1].__qualname__} does not take. Fix or uninstall {found[0].owner()}"
                )
    options = _route(plan, targets)
    accelerator = _construct(targets[Kind.ACCELERATOR], acc, options[Kind.ACCELERATOR])
    devices = plan.devices
    environment = _construct(targets[Kind.ENVIRONMENT], env, options[Kind.ENVIRONMENT])
    if isinstance(spec, StrategySpec) and not spec.parallel and devices in ("auto", -1, "-1"):
        devices = 1
    elif devices in ("auto", -1, "-1"):
        # Inside processes torchrun / srun / mpirun started, 'auto' is what
        # they started on this node (not the accelerator's own count).
        devices = _external_world(environment, plan.num_nodes) or devices
    parallel_devices = accelerator.parallel_devices(devices)
    environment.validate(num_devices=len(parallel_devices), num_nodes=plan.num_nodes)
    _check_external_world(environment, len(parallel_devices), plan.num_nodes)
    precision = _construct(targets[Kind.PRECISION], prec, options[Kind.PRECISION], accelerator=accelerator)
    collective = _construct(targets[Kind.COLLECTIVE], coll, options[Kind.COLLECTIVE])
    found = targets[Kind.LAUNCHER]
    takes_accelerator = found is not None and "accelerator" in (_accepted_options(found[1]) or ())
    launcher = _construct(
        found,
        launch,
        options[Kind.LAUNCHER],
        environment=environment,
        num_processes=len(parallel_devices),
        num_nodes=plan.num_nodes,
        **({"accelerator": accelerator} if takes_accelerator else {}),
    )
    strategy: Strategy = _construct(
        targets[Kind.STRATEGY],
        plan.strategy,
        options[Kind.STRATEGY],
        accelerator=accelerator,
        environment=environment,
        collective=collective,
        precision=precision,
        launcher=launcher,
        parallel_devices=parallel_devices,
        num_nodes=plan.num_nodes,
    )
    strategy.plan = plan
    return strategy
