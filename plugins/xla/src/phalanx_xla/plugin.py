"""phalanx-xla's entry module: specs only; imports neither torch nor torch_xla.

Declared in pyproject.toml as the ``xla`` entry point of the
``phalanx.plugins`` group. Every part needs torch_xla (and the torch release
it was built for): installed without it, each part is still listed, as
unavailable, with :data:`INSTALL` as what to run.

Precisions are not declared here: ``"32-true"`` and ``"bf16-true"`` are
phalanx-torch's, and the xla strategies accept those two (and refuse the
others, saying so). Declaring the same names again would make every bare
``"32-true"`` ambiguous for the registry.
"""

from __future__ import annotations

from phalanx_core import (
    AcceleratorSpec,
    CollectiveSpec,
    EnvironmentSpec,
    LauncherSpec,
    StrategySpec,
    hookimpl,
)

#: What to install for every part here (also in the parts' refusals). Here,
#: not in ``_runtime``: the entry module imports phalanx_core only, so that
#: listing the plugins stays fast (docs/content/publish.md).
INSTALL = "pip install 'torch==2.9.0' 'torch_xla==2.9.0'  (or: pip install 'phalanx-xla[xla]')"

_PKG = "phalanx_xla"
_NEEDS = ("torch>=2.9", "torch_xla")


@hookimpl
def phalanx_accelerators() -> list[AcceleratorSpec]:
    return [
        AcceleratorSpec(
            name="xla",
            target=f"{_PKG}.accelerator:XLAAccelerator",
            summary="XLA devices through torch_xla (TPU, or PJRT_DEVICE=CPU/CUDA); one replica per device",
            # Above the CPU (0), below the GPUs (cuda 20, mps 10): "auto" picks
            # XLA where torch_xla is installed and PJRT_DEVICE names a device.
            priority=5,
            aliases=("tpu",),
            needs=_NEEDS,
            install=INSTALL,
        )
    ]


@hookimpl
def phalanx_collectives() -> list[CollectiveSpec]:
    return [
        CollectiveSpec(
            name="xla",
            target=f"{_PKG}.collective:XLACollective",
            summary="torch_xla.core.xla_model collectives between XLA replicas (no send/recv)",
            needs=_NEEDS,
            install=INSTALL,
        )
    ]


@hookimpl
def phalanx_launchers() -> list[LauncherSpec]:
    return [
        LauncherSpec(
            name="xla",
            target=f"{_PKG}.launcher:XLALauncher",
            summary="torch_xla.launch: one replica per XLA device (threads of one process on CPU)",
            needs=_NEEDS,
            install=INSTALL,
        )
    ]


@hookimpl
def phalanx_environments() -> list[EnvironmentSpec]:
    return [
        EnvironmentSpec(
            name="xla",
            target=f"{_PKG}.environment:XLAEnvironment",
            summary="ranks from torch_xla.runtime (named by the xla strategies; never auto-detected)",
            # Never detected (detect() is false): the xla strategies name it.
            priority=-10,
            needs=_NEEDS,
            install=INSTALL,
        )
    ]


@hookimpl
def phalanx_strategies() -> list[StrategySpec]:
    common = {"environment": "xla", "accelerators": ("xla",), "needs": _NEEDS, "install": INSTALL}
    return [
        StrategySpec(
            name="xla",
            target=f"{_PKG}.strategies:XLAStrategy",
            summary="data parallel across XLA devices: gradients all-reduced by xm.optimizer_step",
            launcher="xla",
            collective="xla",
            parallel=True,
            # The only parallel strategy for accelerator 'xla' ("auto" with
            # xla picks it over ddp, priority 10); it never fits another one.
            priority=50,
            traffic={"xla": "gradients go through torch_xla itself (xm.optimizer_step's all_reduce)"},
            **common,  # type: ignore[arg-type]
        ),
        StrategySpec(
            name="xla_single",
            target=f"{_PKG}.strategies:XLASingleStrategy",
            summary="one XLA device, one replica",
            launcher="xla",
            collective="xla",
            parallel=False,
            priority=50,
            **common,  # type: ignore[arg-type]
        ),
    ]
