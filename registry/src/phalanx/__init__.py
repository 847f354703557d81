"""phalanx: names to composed distributed-training strategies.

    import phalanx
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    results = strategy.launch(train, 100)

Parts come from plugins installed as distributions with entry points in
the ``phalanx.plugins`` group; :class:`Registry` finds them,
:func:`resolve` composes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from phalanx_core.errors import (
    CollectiveConnectionError,
    CollectiveTimeoutError,
    MisconfigurationError,
    NodeLostError,
    NotInGroupError,
    PhalanxError,
    PlanMismatchError,
    PluginError,
    UnavailableError,
    UnknownNameError,
    WorkerFailedError,
)

from ._discovery import PluginRecord, Provider
from ._entry import Entry
from ._plan import Choice, Plan
from ._registry import Registry

if TYPE_CHECKING:
    from phalanx_core import Strategy

__all__ = [
    "Choice",
    "CollectiveConnectionError",
    "CollectiveTimeoutError",
    "Entry",
    "MisconfigurationError",
    "NotInGroupError",
    "NodeLostError",
    "PhalanxError",
    "Plan",
    "PlanMismatchError",
    "PluginError",
    "PluginRecord",
    "Provider",
    "Registry",
    "UnavailableError",
    "UnknownNameError",
    "WorkerFailedError",
    "default_registry",
    "plan",
    "resolve",
    "run_flags",
    "under_run",
]

__version__ = "0.1.0"

_default: Registry | None = None


def default_registry() -> Registry:
    """The registry :func:`resolve` uses, built from the installed plugins
    on first use."""
    global _default
    if _default is None:
        _default = Registry()
    return _default


def under_run() -> bool:
    """Whether this process runs under ``phalanx run``, whose flags are then
    the defaults of :func:`resolve`."""
    import os

    from ._flags import RUN_FLAGS_VAR

    return bool(os.environ.get(RUN_FLAGS_VAR))


def run_flags() -> dict[str, Any]:
    """The flags ``phalanx run`` was given (``strategy``, ``accelerator``,
    ``devices``, ``num_nodes``, ``precision``, ``collective``, and
    ``options`` from ``--option``), as :func:`resolve` in this process
    takes them; empty outside ``phalanx run``. What was built from them is
    ``strategy.plan``."""
    import json
    import os

    from ._flags import RUN_FLAGS_VAR

    raw = os.environ.get(RUN_FLAGS_VAR)
    return dict(json.loads(raw)) if raw else {}


def plan(strategy: Any = "auto", **flags: Any) -> Plan:
    """:meth:`Registry.plan` on the default registry."""
    return default_registry().plan(strategy, **flags)


def resolve(
    strategy: Any = "auto",
    *,
    accelerator: Any = "auto",
    devices: Any = "auto",
    num_nodes: int | None = None,
    precision: Any = None,
    collective: Any = None,
    launcher: Any = None,
    environment: Any = None,
    plugins: Sequence[Any] = (),
    **options: Any,
) -> Strategy:
    """Turn names into a composed, ready :class:`~phalanx_core.Strategy`.

    ``resolve("ddp", collective="mpi")`` is DDP over the MPI collective. Each
    flag is a name, a ready instance, or the default; ``plugins`` is a list
    of ready parts, each given to its kind; each of ``options`` goes to the
    one part whose constructor takes it (``find_unused_parameters`` to DDP,
    ``timeout`` to the collective). Runs on the default registry
    (:func:`default_registry`); see :meth:`Registry.plan` for the rules.
    """
    return default_registry().resolve(
        strategy,
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        precision=precision,
        collective=collective,
        launcher=launcher,
        environment=environment,
        plugins=plugins,
        **options,
    )
