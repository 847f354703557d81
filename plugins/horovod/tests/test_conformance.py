"""phalanx-horovod's parts through the conformance suites of
phalanx.testing.suites, with real horovod: ranks started by the
``horovod`` launcher (horovod.runner.run over gloo) from this plain Python
process."""

from __future__ import annotations

import pytest

from phalanx.testing.suites import CollectiveSuite, LauncherSuite, TrafficSuite

pytestmark = pytest.mark.subprocess


class TestHorovodCollective(CollectiveSuite):
    """The whole contract (send and recv checked to refuse), in worlds of
    1, 2 and 3 ranks, and a timeout that names the operation."""

    collective = "horovod"
    strategy = "horovod"
    launcher = "horovod"


class TestHorovodCollectiveUnderDDP(CollectiveSuite):
    """The composition: torch's DDP strategy carrying the horovod collective."""

    collective = "horovod"
    strategy = "ddp"
    launcher = "horovod"
    world_sizes = (2,)


class TestHorovodTraffic(TrafficSuite):
    """DDP's gradient buckets, FSDP's all-gathers and reduce-scatters and a
    user's DDP under ``manual`` go through Horovod (hvd.allreduce_async_,
    ...), not a torch group."""

    collective = "horovod"
    launcher = "horovod"


class TestHorovodLauncher(LauncherSuite):
    launcher = "horovod"
    strategy = "horovod"


class TestHorovodLauncherUnderDDP(LauncherSuite):
    """torch's own collective and DDP in the ranks horovod starts (the rank
    protocol: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""

    launcher = "horovod"
    strategy = "ddp"
    num_processes = 3


class TestHorovodStrategyTrafficOverTorch(TrafficSuite):
    """The horovod strategy with torch's collective: phalanx's version of
    DistributedOptimizer sends every gradient through the collective's
    ``all_reduce`` (counted on the collective object), to the weights of one
    process."""

    collective = "torch"
    strategies = ("horovod",)
    launcher = "horovod"
