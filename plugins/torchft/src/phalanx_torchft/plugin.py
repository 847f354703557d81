"""phalanx-torchft's entry module: specs only; imports neither torchft nor torch.

Declared in pyproject.toml as the ``torchft`` entry point of the
``phalanx.plugins`` group. Installed without torchft, the parts are still
listed, as unavailable, with :data:`INSTALL` as what to do.
"""

from __future__ import annotations

from phalanx_core import LauncherSpec, StrategySpec, hookimpl

#: What to run when torchft is missing.
INSTALL = "pip install 'torchft>=0.2,<0.3' (torchft 0.2, torch>=2.9; phalanx-torchft itself is installed)"
#: torch's range is phalanx-torch's (these parts are built on its DDP and its
#: subprocess launcher); torchft's is the release line phalanx is tested on.
_NEEDS = ("torchft>=0.2,<0.3", "torch>=2.9")
_PKG = "phalanx_torchft"


@hookimpl
def phalanx_launchers() -> list[LauncherSpec]:
    return [
        LauncherSpec(
            name="replica_groups",
            target=f"{_PKG}.launcher:ReplicaGroupsLauncher",
            summary="TorchFT's lighthouse and N replica groups of ranks, each restarted on its own",
            needs=_NEEDS,
            install=INSTALL,
        ),
        LauncherSpec(
            name="ray_replica_groups",
            target=f"{_PKG}.ray_groups:RayReplicaGroupsLauncher",
            summary="replica_groups on the nodes Ray gives: an actor a node runs its groups, each "
            "restarted on its own",
            # The launching process is placed by Ray, as launcher ray's: its
            # environment (the ranks are the groups', torch elastic's).
            environment="ray",
            needs=(*_NEEDS, "ray", "phalanx_ray"),
            install=(
                f"{INSTALL}, and phalanx-ray with ray (pip install 'phalanx-ray[ray]'; from a clone of "
                "phalanx: pip install -e 'plugins/ray[ray]')"
            ),
        ),
    ]


@hookimpl
def phalanx_strategies() -> list[StrategySpec]:
    return [
        StrategySpec(
            name="ddp_ft",
            target=f"{_PKG}.strategy:DDPFTStrategy",
            summary="DDP across TorchFT replica groups: a lost group drops out at the next step, "
            "the others go on, and it heals from a peer when it is back",
            launcher="replica_groups",
            collective="torch",
            parallel=True,
            priority=-40,
            needs=_NEEDS,
            install=INSTALL,
            traffic={
                "torch": "gradients: DDP's buckets within the replica group through the torch "
                "collective's c10d group, then across the step's groups through a 'torch' collective "
                "of their own (gloo), formed again at each TorchFT quorum (reconfigure)",
                "*": "gradients: DDP's buckets within the replica group through the {collective!r} "
                "collective, then across the step's groups through a {across!r} collective of their "
                "own, formed again at each TorchFT quorum (reconfigure)",
            },
            collective_needs=("liveness", "reconfigure"),
        ),
        StrategySpec(
            name="hsdp_ft",
            target=f"{_PKG}.hsdp:HSDPFTStrategy",
            summary="FSDP within each TorchFT replica group, fault tolerant across groups: a lost "
            "group drops out at the next step, the others go on, and it heals from a peer when it is back",
            launcher="replica_groups",
            collective="torch",
            parallel=True,
            priority=-41,
            needs=_NEEDS,
            install=INSTALL,
            traffic={
                "torch": "parameters and gradients: FSDP's all-gathers and reduce-scatters within the "
                "replica group through the torch collective's c10d group; each gradient shard then "
                "averaged across the step's groups through a 'torch' collective of their own (gloo), "
                "formed again at each TorchFT quorum (reconfigure)",
                "*": "parameters and gradients: FSDP's all-gathers and reduce-scatters within the "
                "replica group through the {collective!r} collective; each gradient shard then "
                "averaged across the step's groups through a {across!r} collective of their own, "
                "formed again at each TorchFT quorum (reconfigure)",
            },
            collective_needs=("liveness", "reconfigure"),
        ),
        StrategySpec(
            name="local_sgd_ft",
            target=f"{_PKG}.windowed:LocalSGDFTStrategy",
            summary="Local SGD across TorchFT replica groups: each group trains sync_every steps on its "
            "own, then their parameters are averaged; a lost group drops out at the next sync, and it "
            "heals from a peer when it is back",
            launcher="replica_groups",
            collective="torch",
            parallel=True,
            priority=-42,
            needs=_NEEDS,
            install=INSTALL,
            traffic={
                "torch": "gradients: DDP's buckets within the replica group through the torch "
                "collective's c10d group each step; between the groups only at a sync, every "
                "sync_every steps (default 16): each rank's parameters averaged across the sync's "
                "groups through a 'torch' collective of their own (gloo), formed again at each TorchFT "
                "quorum (reconfigure)",
                "*": "gradients: DDP's buckets within the replica group through the {collective!r} "
                "collective each step; between the groups only at a sync, every sync_every steps "
                "(default 16): each rank's parameters averaged across the sync's groups through a "
                "{across!r} collective of their own, formed again at each TorchFT quorum (reconfigure)",
            },
            collective_needs=("liveness", "reconfigure"),
        ),
        StrategySpec(
            name="diloco_ft",
            target=f"{_PKG}.windowed:DiLoCoFTStrategy",
            summary="DiLoCo across TorchFT replica groups: each group trains sync_every steps on its "
            "own, then an outer optimizer steps the model with their averaged change (fragments: "
            "Streaming DiLoCo); a lost group drops out at the next sync, and it heals from a peer",
            launcher="replica_groups",
            collective="torch",
            parallel=True,
            priority=-43,
            needs=_NEEDS,
            install=INSTALL,
            traffic={
                "torch": "gradients: DDP's buckets within the replica group through the torch "
                "collective's c10d group each step; between the groups only at a sync, every "
                "sync_every steps (default 500; a fragment every sync_every / fragments): each rank's "
                "change of the parameters over the window (all of the model, or a fragment's part), "
                "averaged across the sync's groups through a 'torch' collective of their own (gloo), "
                "formed again at each TorchFT quorum (reconfigure), then stepped by the outer optimizer "
                "(SGD, lr 0.7, momentum 0.9, Nesterov, unless outer_lr, outer_momentum or "
                "outer_optimizer say otherwise)",
                "*": "gradients: DDP's buckets within the replica group through the {collective!r} "
                "collective each step; between the groups only at a sync, every sync_every steps "
                "(default 500; a fragment every sync_every / fragments): each rank's change of the "
                "parameters over the window (all of the model, or a fragment's part), averaged across "
                "the sync's groups through a {across!r} collective of their own, formed again at each "
                "TorchFT quorum (reconfigure), then stepped by the outer optimizer (SGD, lr 0.7, "
                "momentum 0.9, Nesterov, unless outer_lr, outer_momentum or outer_optimizer say otherwise)",
            },
            collective_needs=("liveness", "reconfigure"),
        ),
        StrategySpec(
            name="diloco_hsdp_ft",
            target=f"{_PKG}.windowed:DiLoCoHSDPFTStrategy",
            summary="DiLoCo across TorchFT replica groups, FSDP within each: as diloco_ft, the "
            "model and both optimizers' state sharded over a group's ranks",
            launcher="replica_groups",
            collective="torch",
            parallel=True,
            priority=-44,
            needs=_NEEDS,
            install=INSTALL,
            traffic={
                "torch": "parameters and gradients: FSDP's all-gathers and reduce-scatters within the "
                "replica group through the torch collective's c10d group each step; between the groups "
                "only at a sync, every sync_every steps (default 500; a fragment every sync_every / "
                "fragments): each rank's change of its shard over the window, averaged across the "
                "sync's groups (rank r of each) through a 'torch' collective of their own (gloo), "
                "formed again at each TorchFT quorum (reconfigure), then stepped by the outer optimizer "
                "(SGD, lr 0.7, momentum 0.9, Nesterov, unless outer_lr, outer_momentum or "
                "outer_optimizer say otherwise)",
                "*": "parameters and gradients: FSDP's all-gathers and reduce-scatters within the "
                "replica group through the {collective!r} collective each step; between the groups "
                "only at a sync, every sync_every steps (default 500; a fragment every sync_every / "
                "fragments): each rank's change of its shard over the window, averaged across the "
                "sync's groups (rank r of each) through a {across!r} collective of their own, formed "
                "again at each TorchFT quorum (reconfigure), then stepped by the outer optimizer (SGD, "
                "lr 0.7, momentum 0.9, Nesterov, unless outer_lr, outer_momentum or outer_optimizer say "
                "otherwise)",
            },
            collective_needs=("liveness", "reconfigure"),
        ),
    ]
