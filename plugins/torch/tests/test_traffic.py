"""Which process group carries a torch strategy's traffic.

The torch collective's own c10d group, with nothing in between; for any
other collective (here, a TorchCollective subclass whose operations are its
own), a CollectiveProcessGroup over it; and a collective that cannot do an
operation a strategy's traffic needs is refused when resolving, naming it.
(That the bytes then go through the collective, and the weights come out
right, is phalanx_core.testing's TrafficSuite: run on the mpi, horovod and
counting collectives in their own tests.)
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import phalanx
from phalanx_core import MisconfigurationError
from phalanx_torch.collectives import TorchCollective
from phalanx_torch.process_group import CollectiveProcessGroup

pytestmark = pytest.mark.subprocess


class NoReduceScatter(TorchCollective):
    """The torch collective without reduce_scatter."""

    name = "no_reduce_scatter"
    unsupported = frozenset({"reduce_scatter"})


class OwnAllReduce(TorchCollective):
    """The torch collective with an all_reduce of its own (counted)."""

    name = "own_all_reduce"

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        self.reduced = getattr(self, "reduced", 0) + 1
        return super().all_reduce(tensor, op, async_op=async_op)


def test_fsdp_refuses_a_collective_without_reduce_scatter_when_resolving():
    with pytest.raises(MisconfigurationError) as info:
        phalanx.resolve("fsdp", accelerator="cpu", devices=2, collective=NoReduceScatter())
    message = str(info.value)
    assert "cannot do reduce_scatter" in message and "FSDPStrategy" in message
    assert "collective='torch'" in message
    # DDP needs no reduce_scatter: the same collective is fine there.
    phalanx.resolve("ddp_fork", accelerator="cpu", devices=2, collective=NoReduceScatter())


def which_group(strategy):
    group = strategy.process_group
    mesh = strategy.device_mesh()
    return (
        type(group).__name__,
        group is dist.group.WORLD,
        isinstance(group, CollectiveProcessGroup),
        mesh.get_group() is group,
        dist.get_world_size(group),
    )


def test_the_torch_collective_gives_its_own_group_to_ddp():
    results = phalanx.resolve("ddp_fork", accelerator="cpu", devices=2, collective="torch").launch(
        which_group
    )
    for name, is_world, adapted, mesh_group, size in results:
        assert (is_world, adapted, size) == (True, False, 2), name
        assert mesh_group


def test_a_collective_with_operations_of_its_own_gets_the_adapter():
    strategy = phalanx.resolve(
        "manual", accelerator="cpu", devices=2, collective=OwnAllReduce(), launcher="fork"
    )
    for name, is_world, adapted, mesh_group, size in strategy.launch(which_group):
        assert (name, adapted, size, mesh_group) == ("CollectiveProcessGroup", True, 2, True)
        # The collective made torch's default group itself: the adapter is
        # registered beside it, not in its place.
        assert not is_world


def test_process_group_outside_launch_says_where_it_is():
    strategy = phalanx.resolve("ddp_fork", accelerator="cpu", devices=2)
    with pytest.raises(
        MisconfigurationError, match=r"needs the process group, which strategy\.launch\(\) makes"
    ):
        strategy.process_group
