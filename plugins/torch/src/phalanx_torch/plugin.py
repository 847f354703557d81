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

#: The torch releases phalanx-torch supports: the oldest is torch_xla 2.9's
#: torch and the oldest tested (nox -s torch_range); no newer release is
#: known to break. pyproject.toml's ``torch`` extra says the same to pip.
TORCH = "torch>=2.9"
_INSTALL = f"pip install '{TORCH}'"
_PKG = "phalanx_torch"
_NEEDS = (TORCH,)


@hookimpl
def phalanx_accelerators() -> list[AcceleratorSpec]:
    return [
        AcceleratorSpec(
            name="cuda",
            target=f"{_PKG}.accelerators:CUDAAccelerator",
            summary="NVIDIA GPUs (torch.cuda); collectives default to nccl",
            priority=20,
            aliases=("gpu",),
            needs=_NEEDS,
            install=_INSTALL,
        ),
        AcceleratorSpec(
            name="mps",
            target=f"{_PKG}.accelerators:MPSAccelerator",
            summary="Apple silicon GPUs (torch.backends.mps)",
            priority=10,
            needs=_NEEDS,
            install=_INSTALL,
        ),
        AcceleratorSpec(
            name="cpu",
            target=f"{_PKG}.accelerators:CPUAccelerator",
            summary="the CPU; devices=N runs N processes on it",
            priority=0,
            needs=_NEEDS,
            install=_INSTALL,
        ),
    ]


@hookimpl
def phalanx_environments() -> list[EnvironmentSpec]:
    # Detection order, highest priority first: torchelastic, slurm, lsf,
    # kubeflow, mpi, variables, local. local always detects, so it comes last.
    env = f"{_PKG}.environments"
    table = (
        ("torchelastic", "TorchElasticEnvironment", 100, "processes started by torchrun / torch elastic"),
        ("slurm", "SLURMEnvironment", 80, "a Slurm job step (srun): ranks from SLURM_PROCID, ..."),
        ("lsf", "LSFEnvironment", 70, "an IBM Spectrum LSF job (jsrun): ranks from JSM_NAMESPACE_*"),
        ("kubeflow", "KubeflowEnvironment", 60, "a Kubeflow PyTorchJob: one process per pod"),
        ("mpi", "MPIEnvironment", 50, "processes started by mpirun (OpenMPI) or a PMI launcher"),
        (
            "variables",
            "VariablesEnvironment",
            10,
            "processes you started, with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set",
        ),
        ("local", "LocalEnvironment", 0, "this machine; ranks from the launcher (the default)"),
    )
    return [
        EnvironmentSpec(name=name, target=f"{env}:{cls}", priority=priority, summary=summary)
        for name, cls, priority, summary in table
    ]


@hookimpl
def phalanx_launchers() -> list[LauncherSpec]:
    launch = f"{_PKG}.launchers"
    return [
        LauncherSpec(
            name="in_process",
            target=f"{launch}:InProcessLauncher",
            summary="runs fn in this process (alone, or in processes torchrun/srun/mpirun made)",
            interactive=True,
            creates_processes=False,
        ),
        LauncherSpec(
            name="subprocess",
            target=f"{launch}:SubprocessLauncher",
            summary="re-runs the script once per local rank under torch.distributed.elastic",
            needs=_NEEDS,
            install=_INSTALL,
        ),
        LauncherSpec(
            name="spawn",
            target=f"{launch}:MultiprocessingLauncher",
            summary="starts fresh interpreters (torch.multiprocessing, start method spawn)",
            options={"start_method": "spawn"},
            needs=_NEEDS,
            install=_INSTALL,
        ),
        LauncherSpec(
            name="fork",
            target=f"{launch}:MultiprocessingLauncher",
            summary="forks this process (works in notebooks; not once CUDA is initialised)",
            options={"start_method": "fork"},
            interactive=True,
            needs=_NEEDS,
            install=_INSTALL,
        ),
    ]


@hookimpl
def phalanx_collectives() -> list[CollectiveSpec]:
    return [
        CollectiveSpec(
            name="torch",
            target=f"{_PKG}.collectives:TorchCollective",
            summary="torch.distributed over any c10d backend (gloo, nccl, mpi, registered ones)",
            priority=10,
            needs=_NEEDS,
            install=_INSTALL,
            variants={backend: {"backend": backend} for backend in ("gloo", "nccl", "xccl", "ucc")},
            fault_tolerance=("liveness", "reconfigure"),
        ),
        CollectiveSpec(
            name="single_device",
            target=f"{_PKG}.collectives:SingleDeviceCollective",
            summary="a world of one process: every operation is local",
            needs=_NEEDS,
            install=_INSTALL,
        ),
    ]


@hookimpl
def phalanx_precisions() -> list[PrecisionSpec]:
    table = (
        ("64-true", "DoublePrecision", "float64 weights, inputs and compute", ("64",)),
        ("bf16-mixed", "MixedPrecision", "float32 weights, bfloat16 autocast", ("bf16",)),
        ("16-mixed", "MixedPrecision16", "float32 weights, float16 autocast and a grad scaler", ("16",)),
        ("bf16-true", "HalfPrecision", "bfloat16 weights, inputs and compute", ()),
        ("16-true", "HalfPrecision16", "float16 weights, inputs and compute", ()),
    )
    return [
        *(
            PrecisionSpec(
                name=name,
                target=f"{_PKG}.precisions:{cls}",
                summary=summary,
                aliases=aliases,
                needs=_NEEDS,
                install=_INSTALL,
            )
            for name, cls, summary, aliases in table
        ),
        PrecisionSpec(
            name="32-true",
            target=f"{_PKG}.precisions:FullPrecision",
            summary="float32 weights and compute",
            aliases=("32",),
            needs=_NEEDS,
            install=_INSTALL,
        ),
    ]


def _fabric_variants(name: str) -> dict[str, dict[str, object]]:
    """Fabric's names for this strategy with an option, and the option."""
    if name == "fsdp":
        return {"fsdp_cpu_offload": {"cpu_offload": True}}
    if name.startswith("ddp"):
        return {
            f"{name}_find_unused_parameters_{flag}": {"find_unused_parameters": flag == "true"}
            for flag in ("true", "false")
        }
    return {}


@hookimpl
def phalanx_strategies() -> list[StrategySpec]:
    strategies = f"{_PKG}.strategies"
    parallel = (
        (
            "ddp",
            "DDPStrategy",
            "subprocess",
            10,
            "DistributedDataParallel; the script is re-run once per device",
        ),
        ("ddp_spawn", "DDPStrategy", "spawn", 5, "DistributedDataParallel in processes started by spawn"),
        ("ddp_fork", "DDPStrategy", "fork", 0, "DistributedDataParallel in forked processes"),
        # Above ddp_fork: strategy='auto' in a notebook picks it, as Fabric does.
        ("ddp_notebook", "DDPStrategy", "fork", 1, "ddp_fork, under the name notebooks look for"),
        (
            "fsdp",
            "FSDPStrategy",
            "subprocess",
            -10,
            "fully sharded data parallel (torch's fully_shard); the script is re-run once per device",
        ),
        (
            "manual",
            "ManualStrategy",
            "subprocess",
            -20,
            "your own parallelism: phalanx gives ranks, processes and the group; you place and wrap",
        ),
    )
    own = "the torch collective's own c10d group (gloo, nccl), nothing in between"
    other = "the {collective!r} collective's operations, as a torch ProcessGroup (CollectiveProcessGroup)"
    traffic = {
        "DDPStrategy": "DDP's gradient buckets and broadcasts go through ",
        "FSDPStrategy": "fully_shard's all-gathers and reduce-scatters go through ",
        "ManualStrategy": "your DDP / FSDP / DTensor on strategy.process_group go through ",
    }
    return [
        StrategySpec(
            name="single_device",
            target=f"{strategies}:SingleDeviceStrategy",
            summary="one process on one device",
            launcher="in_process",
            collective="single_device",
            parallel=False,
            needs=_NEEDS,
            install=_INSTALL,
        ),
        *(
            StrategySpec(
                name=name,
                target=f"{_PKG}.fsdp:{cls}" if name == "fsdp" else f"{strategies}:{cls}",
                summary=summary,
                launcher=launcher,
                collective="torch",
                parallel=True,
                priority=priority,
                needs=_NEEDS,
                install=_INSTALL,
                traffic={"torch": traffic[cls] + own, "*": traffic[cls] + other},
                variants=_fabric_variants(name),
            )
            for name, cls, launcher, priority, summary in parallel
        ),
    ]
