"""Training under ``ddp``, ``fsdp`` and ``manual`` with the ranks as Ray
actors: the weights equal, bit for bit, those of the same steps under
``ddp_spawn``'s launcher (``spawn``), and those computed in one process.
Inside an actor, ``phalanx.resolve`` gives the same strategy, in place."""

from __future__ import annotations

import pytest
import torch

import phalanx
from phalanx_core.testing.traffic import run_traffic


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "manual"])
def test_the_same_weights_as_under_spawn(kind):
    on_ray = phalanx.resolve(kind, accelerator="cpu", devices=2, launcher="ray").launch(run_traffic, kind)
    spawned = phalanx.resolve(kind, accelerator="cpu", devices=2, launcher="spawn").launch(run_traffic, kind)
    assert [r["rank"] for r in on_ray] == [0, 1]
    for ray_rank, spawn_rank in zip(on_ray, spawned, strict=True):
        # The same computation in the same order: the same bits.
        assert ray_rank["weights"] == spawn_rank["weights"], kind
        torch.testing.assert_close(
            torch.tensor(ray_rank["weights"]), torch.tensor(ray_rank["reference"]), rtol=0, atol=1e-6
        )


def test_a_rank_resolves_the_same_strategy_inside_its_actor():
    def where(strategy):
        inside = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray")
        return (
            inside.plan.environment.name,
            inside.plan.launcher.name,
            type(inside.launcher).__name__,
            inside.launcher.runs_in_place(),
            (inside.global_rank, inside.local_rank, inside.node_rank, inside.world_size),
            (strategy.global_rank, strategy.world_size),
        )

    results = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray").launch(where)
    for rank, got in enumerate(results):
        assert got == ("ray", "ray", "RayLauncher", True, (rank, rank, 0, 2), (rank, 2))


def test_the_mpi_collective_is_refused_when_resolving():
    with pytest.raises(phalanx.MisconfigurationError, match=r"collective 'mpi'.*mpirun"):
        phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray", collective="mpi")
