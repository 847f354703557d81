"""The ``ray`` environment, and how the registry chooses it: in the process
that launches (the ``ray`` launcher's spec names it), and in a rank (its
variables are set, over a Slurm allocation's). Needs no ray."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
from phalanx_ray.environment import JOB_VAR, NODES_VAR, RayEnvironment

import phalanx
from phalanx.testing.suites import EnvironmentSuite
from phalanx_core import MisconfigurationError

#: What the ray launcher sets in rank 1 of 2 nodes x 2 ranks (as the
#: ``rank_1_of_4`` fixture does).
RANK_1_OF_4 = {
    JOB_VAR: "job-1",
    NODES_VAR: "2",
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "NODE_RANK": "0",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "40123",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
}


class TestRayEnvironment(EnvironmentSuite):
    environment = "ray"
    variables = RANK_1_OF_4
    expected: ClassVar[dict[str, Any]] = {
        "world_size": 4,
        "global_rank": 1,
        "local_rank": 1,
        "node_rank": 0,
        "main_address": "10.0.0.1",
        "main_port": 40123,
    }


def test_the_launching_process_runs_in_the_ray_environment_the_launcher_names(clean):
    plan = phalanx.Registry().plan("ddp", accelerator="cpu", devices=2, num_nodes=2, launcher="ray")
    assert (plan.environment.name, plan.launcher.name) == ("ray", "ray")
    assert "where launcher 'ray' runs its ranks" in plan.explain()
    # There it is no rank: nothing exists yet, and the layout is the launcher's to make.
    assert RayEnvironment.creates_processes_externally is False
    RayEnvironment().validate(num_devices=2, num_nodes=2)


def test_without_the_ray_launcher_the_environment_is_detected_as_before(clean):
    plan = phalanx.Registry().plan("ddp", accelerator="cpu", devices=2, launcher="spawn")
    assert plan.environment.name == "local"


def test_a_ray_cluster_inside_a_slurm_allocation_is_seen_as_ray(rank_1_of_4, clean):
    for name, value in {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}.items():
        clean.setenv(name, value)
    plan = phalanx.Registry().plan("ddp", accelerator="cpu", devices=2, num_nodes=2)
    assert plan.environment.name == "ray"


def test_a_rank_that_resolves_another_layout_than_the_launch_is_refused(rank_1_of_4):
    with pytest.raises(
        MisconfigurationError, match=r"started 2 rank\(s\) per node on 2 node\(s\).*devices=4, num_nodes=1"
    ):
        RayEnvironment().validate(num_devices=4, num_nodes=1)
