"""Resolution, step 1: the flags, checked before anything is chosen."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx_core import (
    Accelerator,
    ClusterEnvironment,
    Collective,
    Launcher,
    MisconfigurationError,
    PhalanxError,
    Precision,
    Strategy,
)
from phalanx_core.launching import RUN_FLAGS_VAR
from phalanx_core.specs import Kind

from ._entry import Catalog

__all__ = ["INTERFACES", "RUN_FLAGS_VAR"]

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


def _same(registry: Catalog, flag: str, a: Any, b: Any) -> bool:
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


def _with_run_flags(registry: Catalog, flags: dict[str, Any]) -> dict[str, Any]:
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
