"""The launcher conformance suite on the ``ray`` launcher, each launch on a
local Ray instance it starts and stops; and the registry's choices where
the launcher's class must be loaded (in a rank, under a scheduler)."""

from __future__ import annotations

import pytest
from phalanx_ray.environment import RayEnvironment

import phalanx
from phalanx.testing.suites import LauncherSuite
from phalanx_core import MisconfigurationError


class TestRayLauncher(LauncherSuite):
    launcher = "ray"
    # A Ray actor's process is its raylet's child: how it ended cannot be
    # seen from the launching process.
    sees_exit_codes = False
    hang_guard = 120.0


def test_in_a_rank_the_environment_is_ray_and_the_launcher_runs_in_place(rank_1_of_4):
    plan = phalanx.Registry().plan("ddp", accelerator="cpu", devices=2, num_nodes=2, launcher="ray")
    assert (plan.environment.name, plan.launcher.name) == ("ray", "ray")
    assert RayEnvironment.creates_processes_externally is True
    # A script that names no launcher in a rank runs in place too.
    plan = phalanx.Registry().plan("ddp", accelerator="cpu", devices=2, num_nodes=2)
    assert (plan.environment.name, plan.launcher.name) == ("ray", "in_process")


def test_under_a_scheduler_that_started_the_ranks_the_ray_launcher_is_refused(clean):
    torchrun = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # fmt: skip
    for name, value in torchrun.items():
        clean.setenv(name, value)
    with pytest.raises(MisconfigurationError, match="launcher='ray' creates processes, but environment"):
        phalanx.Registry().plan("ddp", accelerator="cpu", devices=2, launcher="ray")
