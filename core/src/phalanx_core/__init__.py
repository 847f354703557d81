"""phalanx-core: the interfaces, hook specs, specs and errors every phalanx
plugin is written against. Depends on pluggy only; imports no backend."""

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    CheckpointSaveError,
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
from .hookspecs import PROJECT, hookimpl
from .specs import (
    AcceleratorSpec,
    CollectiveSpec,
    EnvironmentSpec,
    Kind,
    LauncherSpec,
    Need,
    PrecisionSpec,
    Spec,
    StrategySpec,
)

if TYPE_CHECKING:
    from .accelerator import Accelerator, Availability, DevicesFlag, parse_device_indices
    from .checkpoint import CheckpointIO, TorchCheckpointIO, check_module_keys
    from .checkpoint_directory import CheckpointDirectory
    from .collective import (
        DEFAULT_TIMEOUT,
        FAULT_TOLERANCE,
        OPERATIONS,
        REDUCE_OPS,
        Collective,
        CompletedWork,
        Membership,
        NonMember,
        Work,
        check_into,
        check_one_per_rank,
        check_rank,
        check_reduce_op,
        check_scatter_list,
        plan_mismatch,
        poll,
        timed_out,
    )
    from .environment import ClusterEnvironment
    from .launcher import Launcher
    from .precision import Precision
    from .saving import SaveHandle
    from .strategy import Strategy, teardown_kept_ranks

#: Where each name that is imported on first use lives. Importing
#: ``phalanx_core`` (which every plugin's entry module does, and ``phalanx
#: list`` does for every plugin) loads only the errors, the specs and the
#: hook specs; the interfaces, the strategy and the checkpoint code (with
#: ``zipfile``, ``hashlib`` and ``concurrent.futures`` behind them) load
#: when a name of theirs is first used.
_LAZY = {
    "Accelerator": "accelerator",
    "Availability": "accelerator",
    "DevicesFlag": "accelerator",
    "parse_device_indices": "accelerator",
    "CheckpointIO": "checkpoint",
    "TorchCheckpointIO": "checkpoint",
    "check_module_keys": "checkpoint",
    "CheckpointDirectory": "checkpoint_directory",
    "DEFAULT_TIMEOUT": "collective",
    "FAULT_TOLERANCE": "collective",
    "Membership": "collective",
    "OPERATIONS": "collective",
    "REDUCE_OPS": "collective",
    "Collective": "collective",
    "CompletedWork": "collective",
    "NonMember": "collective",
    "Work": "collective",
    "check_into": "collective",
    "check_one_per_rank": "collective",
    "check_rank": "collective",
    "check_reduce_op": "collective",
    "check_scatter_list": "collective",
    "plan_mismatch": "collective",
    "poll": "collective",
    "timed_out": "collective",
    "ClusterEnvironment": "environment",
    "Launcher": "launcher",
    "Precision": "precision",
    "SaveHandle": "saving",
    "Strategy": "strategy",
    "teardown_kept_ranks": "strategy",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "DEFAULT_TIMEOUT",
    "FAULT_TOLERANCE",
    "OPERATIONS",
    "PROJECT",
    "REDUCE_OPS",
    "Accelerator",
    "AcceleratorSpec",
    "Availability",
    "CheckpointDirectory",
    "CheckpointIO",
    "CheckpointSaveError",
    "ClusterEnvironment",
    "Collective",
    "CollectiveSpec",
    "CollectiveConnectionError",
    "CollectiveTimeoutError",
    "CompletedWork",
    "DevicesFlag",
    "EnvironmentSpec",
    "Kind",
    "Launcher",
    "LauncherSpec",
    "Membership",
    "MisconfigurationError",
    "Need",
    "NonMember",
    "NotInGroupError",
    "PhalanxError",
    "PlanMismatchError",
    "PluginError",
    "Precision",
    "PrecisionSpec",
    "SaveHandle",
    "Spec",
    "Strategy",
    "StrategySpec",
    "TorchCheckpointIO",
    "UnavailableError",
    "UnknownNameError",
    "Work",
    "NodeLostError",
    "WorkerFailedError",
    "check_module_keys",
    "check_into",
    "check_one_per_rank",
    "check_rank",
    "check_reduce_op",
    "check_scatter_list",
    "plan_mismatch",
    "poll",
    "timed_out",
    "hookimpl",
    "parse_device_indices",
    "teardown_kept_ranks",
]

__version__ = "0.1.0"
