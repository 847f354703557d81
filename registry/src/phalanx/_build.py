"""Resolution, step 3: build the parts a plan chose, in order."""

from __future__ import annotations

import copy
import functools
import inspect
import os
from typing import Any

from phalanx_core import (
    Launcher,
    MisconfigurationError,
    PluginError,
    Strategy,
)
from phalanx_core.specs import Kind, StrategySpec
from phalanx_core.strategy import set_attribute_hint

from ._entry import Catalog, Entry
from ._flags import INTERFACES, RUN_FLAGS_VAR
from ._plan import Choice, Plan
from ._resolve import ACROSS_OPTIONS, _check_external_world, _external_world, runs_per_node
from ._similar import close_matches as _close_matches

__all__ = ["build"]


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
        "across",
    ),
}


def _target(registry: Catalog, choice: Choice) -> tuple[Entry, type] | None:
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


#: What torchrun calls the launcher options a scheduler's processes cannot take.
_SCHEDULER_FLAGS = {
    "max_restarts": "torchrun --max-restarts, say",
    "min_nodes": "torchrun --nnodes MIN:MAX, say",
    "rendezvous": "torchrun --rdzv-backend and --rdzv-endpoint, say",
}


def _replaced_launcher(registry: Catalog, plan: Plan) -> tuple[str, type[Launcher]] | None:
    """The launcher the plan's launcher stands in for (the strategy's
    default, where the processes existed already), and its class."""
    replaces = plan.launcher.replaces if plan.launcher is not None else None
    if replaces is None:
        return None
    entry = registry.get(Kind.LAUNCHER, replaces)
    launcher_class: type[Launcher] = entry.load()
    return entry.name, launcher_class


def _name(choice: Choice | None) -> str:
    return choice.name if choice is not None else "?"


def _route(
    registry: Catalog, plan: Plan, targets: dict[Kind, tuple[Entry, type] | None]
) -> dict[Kind, dict[str, Any]]:
    """Give each user option to the one part whose constructor takes it."""
    routed: dict[Kind, dict[str, Any]] = {kind: {} for kind in targets}
    takes: dict[Kind, set[str]] = {}
    for kind, found in targets.items():
        if found is not None:
            accepted = _accepted_options(found[1])
            takes[kind] = (accepted if accepted is not None else set()) - set(_GIVEN[kind])
    replaced = _replaced_launcher(registry, plan)
    for key, value in plan.options.items():
        if key in ACROSS_OPTIONS and plan.across is not None:
            continue  # the collective between replica groups: _across_collective
        takers = [kind for kind, names in takes.items() if key in names]
        if len(takers) == 1:
            routed[takers[0]][key] = value
            continue
        if not takers and replaced is not None and key in (_accepted_options(replaced[1]) or set()):
            name, launcher_class = replaced
            if launcher_class.started_this_process():
                continue  # taken by that launcher, in the process that started this rank
            raise MisconfigurationError(
                f"option {key}={value!r} is launcher {name!r}'s, and launcher {name!r} did not start "
                f"these processes: environment {_name(plan.environment)!r} did (torchrun, or a scheduler), "
                f"and here launcher {_name(plan.launcher)!r} runs fn in them. Give {key} to what started "
                f"them ({_SCHEDULER_FLAGS.get(key, 'its own flag')}), or start the script with phalanx run "
                "or python"
            )
        if not takers:
            accepted_by = "; ".join(
                f"{kind} {targets[kind][0].name!r} takes {', '.join(sorted(names)) or 'none'}"  # type: ignore[index]
                for kind, names in takes.items()
            )
            close = _close_matches(key, {name for names in takes.values() for name in names}, n=1)
            guess = ""
            if close:
                owner = next(kind for kind, names in takes.items() if close[0] in names)
                guess = f" Did you mean {close[0]!r}, an option of {owner} {targets[owner][0].name!r}?"  # type: ignore[index]
            raise MisconfigurationError(
                f"option {key}={value!r} is taken by no part of this plan.{guess} What each part takes: "
                f"{accepted_by}. Check the spelling, or pass a ready instance of the part that should get it"
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


def _across_collective(
    registry: Catalog,
    plan: Plan,
    spec: StrategySpec,
    targets: dict[Kind, tuple[Entry, type] | None],
    options: dict[str, Any],
) -> Any:
    """The collective between the replica groups of a strategy that needs
    one, never set up (the strategy reconfigures it for each step's
    members): the one the option ``across`` named, with
    ``across_options``; else a second collective of the kind and options of
    the strategy's own."""
    coll = plan.collective
    assert coll is not None
    if plan.across is not None and plan.across_named:
        found = _target(registry, plan.across)
        given = dict(plan.options.get("across_options", {}))
        try:
            made = _construct(found, plan.across, given)
        except TypeError as exc:
            raise MisconfigurationError(
                f"option across={plan.across.name!r}: across_options={given!r} are not its options ({exc})"
            ) from None
        _check_built_capabilities(spec, plan.across, made)
        return made
    made = (
        copy.deepcopy(coll.instance)
        if coll.instance is not None
        else _construct(targets[Kind.COLLECTIVE], coll, options)
    )
    _check_built_capabilities(spec, coll, made)
    return made


def _check_built_capabilities(spec: StrategySpec, choice: Choice, collective: Any) -> None:
    """The collective as built has the capabilities the strategy needs
    (a ready instance, or a composed one whose part was given as one, is
    seen only here)."""
    missing = sorted(set(spec.collective_needs) - set(getattr(collective, "fault_tolerance", ())))
    if missing:
        raise MisconfigurationError(
            f"strategy {spec.name!r} needs a collective with the capabilities "
            f"{' and '.join(spec.collective_needs)} (its replica groups come and go), and the collective "
            f"{choice.name!r} ({choice.reason}) lacks {' and '.join(missing)} (its fault_tolerance: "
            f"{', '.join(sorted(getattr(collective, 'fault_tolerance', ()))) or 'none'}); give a collective "
            "that declares them, e.g. collective='torch' (phalanx list shows what each one declares)"
        )


def _attribute_hint(registry: Catalog, strategy: Any, name: str) -> str:
    """What :class:`~phalanx_core.strategy.MissingAttributeError` adds: the
    installed strategies whose class has ``name``, and how to run one (a
    script written for one of them run with plain ``python`` resolved
    another). Imports the strategies' classes: only when the error is shown."""
    plan = vars(strategy).get("plan")
    chosen = getattr(getattr(plan, "strategy", None), "name", None)
    owners = []
    for entry in registry.entries("strategy"):
        try:
            target = entry.load()
        except Exception:  # noqa: BLE001 - a plugin that cannot load has nothing to offer here
            continue
        if entry.name != chosen and hasattr(target, name):
            owners.append(entry.name)
    if not owners:
        return ""
    words = f"; {', '.join(owners)} {'have' if len(owners) > 1 else 'has'} it"
    reason = str(getattr(getattr(plan, "strategy", None), "reason", ""))
    if not os.environ.get(RUN_FLAGS_VAR) and reason.startswith("auto"):
        return words + (
            f". This process was not started by phalanx run, and phalanx.resolve() was given no "
            f"strategy name, so it chose {chosen!r}: start the script with phalanx run --strategy "
            f"{owners[0]} [options] script.py (see phalanx run --help), or name the strategy in resolve()"
        )
    return words + f": resolve {owners[0]!r} (phalanx run --strategy {owners[0]})"


def build(registry: Catalog, plan: Plan) -> Strategy:
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
    options = _route(registry, plan, targets)
    accelerator = _construct(targets[Kind.ACCELERATOR], acc, options[Kind.ACCELERATOR])
    devices = plan.devices
    environment = _construct(targets[Kind.ENVIRONMENT], env, options[Kind.ENVIRONMENT])
    found = targets[Kind.LAUNCHER]
    # A launcher run once per node by a scheduler (srun --ntasks-per-node=1)
    # starts the node's ranks: the scheduler's processes are one per node.
    per_node = found is not None and runs_per_node(found[1], type(environment))
    if isinstance(spec, StrategySpec) and not spec.parallel and devices in ("auto", -1, "-1"):
        devices = 1
    elif devices in ("auto", -1, "-1") and not per_node:
        # Inside processes torchrun / srun / mpirun started, 'auto' is what
        # they started on this node (not the accelerator's own count).
        devices = _external_world(environment, plan.num_nodes) or devices
    parallel_devices = accelerator.parallel_devices(devices)
    started = 1 if per_node else len(parallel_devices)
    if per_node and environment.world_size != plan.num_nodes:
        raise MisconfigurationError(
            f"launcher {launch.name!r} runs once on each node and starts that node's "
            f"{len(parallel_devices)} rank(s) itself, but environment {env.name!r} started "
            f"{environment.world_size} process(es) for num_nodes={plan.num_nodes}: start one process per "
            "node (srun --ntasks-per-node=1, mpirun --map-by ppr:1:node), or set num_nodes to the nodes "
            "it started them on"
        )
    environment.validate(num_devices=started, num_nodes=plan.num_nodes)
    _check_external_world(environment, started, plan.num_nodes)
    precision = _construct(targets[Kind.PRECISION], prec, options[Kind.PRECISION], accelerator=accelerator)
    collective = _construct(targets[Kind.COLLECTIVE], coll, options[Kind.COLLECTIVE])
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
    across = {}
    if isinstance(spec, StrategySpec) and spec.collective_needs:
        across["across"] = _across_collective(registry, plan, spec, targets, options[Kind.COLLECTIVE])
    strategy: Strategy = _construct(
        targets[Kind.STRATEGY],
        plan.strategy,
        options[Kind.STRATEGY],
        **across,
        accelerator=accelerator,
        environment=environment,
        collective=collective,
        precision=precision,
        launcher=launcher,
        parallel_devices=parallel_devices,
        num_nodes=plan.num_nodes,
    )
    strategy.plan = plan
    set_attribute_hint(functools.partial(_attribute_hint, registry))
    return strategy
