"""phalanx-horovod's entry module: specs only; imports neither horovod nor torch.

Declared in pyproject.toml as the ``horovod`` entry point of the
``phalanx.plugins`` group. Every part needs horovod (with its PyTorch
extension) and torch; installed without them, the parts are still listed,
as unavailable, with :data:`INSTALL` as what to do.
"""

from __future__ import annotations

from phalanx_core import CollectiveSpec, EnvironmentSpec, LauncherSpec, StrategySpec, hookimpl

#: What to run when horovod is missing. horovod 0.28.1, the newest release,
#: pins C++14 while torch >= 2.1 needs C++17: a plain ``pip install horovod``
#: fails to compile against current torch (the docs page says how to build it).
INSTALL = (
    "pip install torch, then HOROVOD_WITH_PYTORCH=1 pip install --no-build-isolation "
    "'phalanx-horovod[horovod]' (with torch >= 2.1, horovod 0.28.1 builds only with C++17: "
    "phalanx-horovod's scripts/install-horovod.sh does it)"
)
_NEEDS = ("horovod", "torch>=2.9")
_PKG = "phalanx_horovod"


@hookimpl
def phalanx_collectives() -> list[CollectiveSpec]:
    return [
        CollectiveSpec(
            name="horovod",
            target=f"{_PKG}.collective:HorovodCollective",
            summary="horovod.torch: allreduce (with adasum), allgather, alltoall, reducescatter, "
            "process sets; no send/recv",
            needs=_NEEDS,
            install=INSTALL,
        )
    ]


@hookimpl
def phalanx_environments() -> list[EnvironmentSpec]:
    # Above slurm (80) and mpi (50): horovodrun sets HOROVOD_RANK only in the
    # ranks it starts, also inside a Slurm job or over mpirun, and then the
    # ranks are horovod's. Below torchelastic (100).
    return [
        EnvironmentSpec(
            name="horovod",
            target=f"{_PKG}.environment:HorovodEnvironment",
            summary="processes started by horovodrun / horovod.run: ranks from HOROVOD_RANK, ...",
            priority=90,
        )
    ]


@hookimpl
def phalanx_launchers() -> list[LauncherSpec]:
    return [
        LauncherSpec(
            name="horovod",
            target=f"{_PKG}.launcher:HorovodLauncher",
            summary="starts the ranks through horovod.runner.run (gloo) and runs fn in each",
            interactive=True,
            needs=_NEEDS,
            install=INSTALL,
        )
    ]


@hookimpl
def phalanx_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="horovod",
            target=f"{_PKG}.strategy:HorovodStrategy",
            summary="data parallel with hvd.DistributedOptimizer; parameters broadcast from rank 0",
            launcher="horovod",
            collective="horovod",
            parallel=True,
            priority=-30,
            needs=_NEEDS,
            install=INSTALL,
            traffic={
                "horovod": "gradients go through Horovod itself (hvd.DistributedOptimizer)",
                "*": "gradients go through the {collective!r} collective's all_reduce, in buckets "
                "(phalanx's version of hvd.DistributedOptimizer)",
            },
        )
    ]
