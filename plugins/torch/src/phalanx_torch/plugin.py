"""phalanx-torch's entry module: specs only, no torch import.

Declared in pyproject.toml as the ``torch`` entry point of the
``phalanx.plugins`` group.
"""

from __future__ import annotations

from phalanx_core import (
    AcceleratorSpec,
    CollectiveSpec,
    EnvironmentSpec,
    LauncherSpec,
    PrecisionSpec,
    StrategySpec,
    hookimpl,
)

_INSTALL = "pip install torch"
_PKG = "phalanx_torch"


@hookimpl
def phalanx_accelerators() -> list[AcceleratorSpec]:
    return [
        AcceleratorSpec(
            name="cpu",
            target=f"{_PKG}.accelerators:CPUAccelerator",
            summary="the CPU; devices=N runs N processes on it",
            needs=("torch",),
            install=_INSTALL,
            priority=0,
        ),
    ]


@hookimpl
def phalanx_environments() -> list[EnvironmentSpec]:
    return [
        EnvironmentSpec(
            name="local",
            target=f"{_PKG}.environments:LocalEnvironment",
            summary="this machine; ranks from the launcher (the default)",
            priority=0,
        ),
    ]


@hookimpl
def phalanx_launchers() -> list[LauncherSpec]:
    return [
        LauncherSpec(
            name="in_process",
            target=f"{_PKG}.launchers:InProcessLauncher",
            summary="runs fn in this process (alone, or in processes torchrun/srun/mpirun made)",
            interactive=True,
            creates_processes=False,
        ),
    ]


@hookimpl
def phalanx_collectives() -> list[CollectiveSpec]:
    return [
        CollectiveSpec(
            name="single_device",
            target=f"{_PKG}.collectives:SingleDeviceCollective",
            summary="a world of one process: every operation is local",
            needs=("torch",),
            install=_INSTALL,
        ),
    ]


@hookimpl
def phalanx_precisions() -> list[PrecisionSpec]:
    return [
        PrecisionSpec(
            name="32-true",
            target=f"{_PKG}.precisions:FullPrecision",
            summary="float32 weights and compute",
            needs=("torch",),
            install=_INSTALL,
            aliases=("32",),
        ),
    ]


@hookimpl
def phalanx_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="single_device",
            target=f"{_PKG}.strategies:SingleDeviceStrategy",
            summary="one process on one device",
            needs=("torch",),
            install=_INSTALL,
            launcher="in_process",
            collective="single_device",
            parallel=False,
        ),
    ]
