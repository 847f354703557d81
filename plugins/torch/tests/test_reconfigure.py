"""The torch collective's ``reconfigure`` and ``abort`` beyond the
conformance suite's cases (test_conformance.py): what it refuses, and what
it says where the members do not meet. Real gloo groups, formed on a real
TCPStore of this process."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx_core import (
    CollectiveConnectionError,
    CollectiveTimeoutError,
    Membership,
    MisconfigurationError,
    UnavailableError,
)
from phalanx_torch.collectives import TorchCollective


@pytest.fixture
def store():
    served = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30)
    )
    yield served
    del served


def alone(store, prefix: str, **extra) -> Membership:
    return Membership(rank=0, world_size=1, host="127.0.0.1", port=store.port, prefix=prefix, **extra)


def test_a_group_of_one_reconfigured_works_and_after_abort_says_to_reconfigure(store):
    collective = TorchCollective(timeout=30)
    for prefix in ("t/1", "t/2"):
        collective.reconfigure(alone(store, prefix, label="alone"))
        assert (collective.rank, collective.world_size, collective.is_initialized) == (0, 1, True)
        assert collective.all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]
        assert collective.all_gather_object("x") == ["x"]
    with pytest.raises(UnavailableError, match=r"a group formed by reconfigure\(\) makes no subgroups"):
        collective.new_group([0])
    collective.abort()
    collective.abort()  # again: nothing more to end
    with pytest.raises(CollectiveConnectionError, match=r"its group was aborted .* reconfigure\(\) it"):
        collective.all_reduce(torch.ones(1))
    collective.reconfigure(alone(store, "t/3"))
    assert collective.all_reduce(torch.ones(1)).item() == 1.0
    collective.teardown()


def test_members_that_do_not_arrive_are_named_within_the_timeout(store):
    collective = TorchCollective()
    start = time.monotonic()
    missing = Membership(rank=0, world_size=3, host="127.0.0.1", port=store.port, prefix="m/1", timeout=2)
    with pytest.raises(
        CollectiveTimeoutError, match=r"reconfigure\(\) on the 'torch' collective .*rank 0 of 3"
    ):
        collective.reconfigure(missing)
    assert time.monotonic() - start < 30  # bounded: the group's 2 s, not the collective's 1800
    assert collective.timeout == 2  # the configuration's


def test_a_store_that_does_not_answer_is_named():
    collective = TorchCollective()
    nowhere = Membership(rank=0, world_size=2, host="127.0.0.1", port=1, prefix="n/1", timeout=1)
    with pytest.raises(CollectiveConnectionError, match=r"the members' store at 127.0.0.1:1 did not answer"):
        collective.reconfigure(nowhere)


def test_reconfigure_takes_a_membership():
    with pytest.raises(MisconfigurationError, match=r"give a phalanx_core.Membership"):
        TorchCollective().reconfigure("127.0.0.1:29500/x")  # type: ignore[arg-type]


def reconfigure_the_jobs_group(strategy):
    try:
        strategy.collective.reconfigure(
            Membership(rank=0, world_size=1, host="127.0.0.1", port=29500, prefix="never")
        )
    except MisconfigurationError as exc:
        return str(exc)
    return "reconfigured"


def test_the_collective_of_the_jobs_default_group_is_not_reconfigured():
    results = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="spawn").launch(
        reconfigure_the_jobs_group
    )
    for said in results:
        assert "set up the job's default group: its members are the job's" in said, results
