"""phalanx-torch's parts through the conformance suites of
phalanx.testing.suites, as any plugin author runs them."""

from __future__ import annotations

from typing import ClassVar

import pytest

from phalanx.testing.suites import AcceleratorSuite, CollectiveSuite, EnvironmentSuite, LauncherSuite

pytestmark = pytest.mark.subprocess


class TestTorchCollective(CollectiveSuite):
    collective = "torch"


class TestSingleDeviceCollective(CollectiveSuite):
    collective = "single_device"
    strategy = "single_device"
    launcher = "in_process"
    world_sizes = (1,)
    timeout = None  # a world of one waits for nobody


class TestSpawnLauncher(LauncherSuite):
    launcher = "spawn"


class TestForkLauncher(LauncherSuite):
    launcher = "fork"
    num_processes = 3


class TestSubprocessLauncher(LauncherSuite):
    """The launcher of ``phalanx run`` and of a script that calls
    ``strategy.launch()``: it re-runs the script (or the function's module)
    in each rank under torch.distributed.elastic."""

    launcher = "subprocess"
    launches_functions_here = False  # tests/test_restarts.py and run_scripts/ launch functions


class TestTorchElasticEnvironment(EnvironmentSuite):
    environment = "torchelastic"
    variables: ClassVar[dict[str, str]] = {
        "TORCHELASTIC_RUN_ID": "c4483f80",
        "RANK": "1",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "38397",
    }
    expected: ClassVar[dict[str, int]] = {
        "world_size": 2,
        "global_rank": 1,
        "local_rank": 1,
        "node_rank": 0,
        "main_port": 38397,
    }


class TestSlurmEnvironment(EnvironmentSuite):
    environment = "slurm"
    variables: ClassVar[dict[str, str]] = {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "phx-a1",
        "SLURM_STEP_NODELIST": "phx-a1",
        "SLURM_NNODES": "1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_TASKS_PER_NODE": "2",
    }
    expected: ClassVar[dict[str, int]] = {
        "world_size": 2,
        "global_rank": 1,
        "local_rank": 1,
        "node_rank": 0,
        "main_port": 14242,
    }


class TestMPIEnvironment(EnvironmentSuite):
    environment = "mpi"
    variables: ClassVar[dict[str, str]] = {
        "PMI_RANK": "1",
        "PMI_SIZE": "2",
        "MPI_LOCALRANKID": "1",
        "MPI_LOCALNRANKS": "2",
    }
    expected: ClassVar[dict[str, int]] = {"world_size": 2, "global_rank": 1, "local_rank": 1, "node_rank": 0}


class TestCPUAccelerator(AcceleratorSuite):
    accelerator = "cpu"


class TestCUDAAccelerator(AcceleratorSuite):
    accelerator = "cuda"  # here without a GPU: the refusal, with its reason


class TestMPSAccelerator(AcceleratorSuite):
    accelerator = "mps"
