"""phalanx-core: the interfaces, hook specs, specs and errors every phalanx
plugin is written against. Depends on pluggy only; imports no backend."""

from .accelerator import Accelerator, Availability, DevicesFlag, parse_device_indices
from .checkpoint import CheckpointIO, TorchCheckpointIO, check_module_keys
from .checkpoint_directory import CheckpointDirectory
from .collective import (
    DEFAULT_TIMEOUT,
    OPERATIONS,
    REDUCE_OPS,
    Collective,
    CompletedWork,
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
from .launcher import Launcher
from .precision import Precision
from .saving import SaveHandle
from .specs import (
    AcceleratorSpec,
    CollectiveSpec,
    EnvironmentSpec,
    Kind,
    LauncherSpec,
    PrecisionSpec,
    Spec,
    StrategySpec,
)
from .strategy import Strategy, teardown_kept_ranks

__all__ = [
    "DEFAULT_TIMEOUT",
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
    "MisconfigurationError",
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
