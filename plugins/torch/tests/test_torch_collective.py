"""The torch collective over a third-party c10d backend, on a device, with a
group the user made, and its options (the contract over gloo in worlds of 1
to 3: test_conformance.py)."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

import phalanx
from phalanx_core import MisconfigurationError, UnavailableError
from phalanx_core.testing.contract import CHECKS, check_collective
from phalanx_torch._collective.c10d_backends import check_backend
from phalanx_torch.collectives import TorchCollective

pytestmark = pytest.mark.subprocess

THIRD_PARTY = "phalanxtestbackend"


def _make_third_party_group(store, rank, size, timeout):
    # A third party's backend: here gloo's process group under another name.
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def register_third_party() -> None:
    if THIRD_PARTY not in dist.Backend.backend_list:
        dist.Backend.register_backend(THIRD_PARTY, _make_third_party_group, devices=["cpu"])


# Spawned ranks import this module afresh: register there too.
register_third_party()


def run_contract(strategy):
    collective = strategy.collective
    assert isinstance(collective, TorchCollective)
    return strategy.global_rank, collective.backend, check_collective(collective)


# The contract over gloo in worlds of 1 to 3: test_conformance.py (the kit's CollectiveSuite).


def run_contract_on_device(strategy):
    collective = strategy.collective
    return collective.backend, check_collective(collective, device=strategy.root_device)


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")
def test_contract_over_nccl_on_one_gpu():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cuda", devices=1, timeout=60)
    [(backend, ran)] = strategy.launch(run_contract_on_device)
    assert backend == "nccl"
    assert ran == list(CHECKS)


def test_the_contract_takes_a_device():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, timeout=60)
    assert strategy.launch(run_contract_on_device) == [("gloo", list(CHECKS))] * 2


def test_a_third_party_backend_by_name():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, backend=THIRD_PARTY, timeout=60)
    results = strategy.launch(run_contract)
    assert [backend for _, backend, _ in results] == [THIRD_PARTY, THIRD_PARTY]
    assert all(ran == list(CHECKS) for _, _, ran in results)


def adopt_existing_group(strategy):
    # A group exists (the strategy's collective made it, as a user's own
    # init_process_group would): a new torch collective adopts it, and its
    # teardown leaves the group to whoever made it.
    adopted = TorchCollective(timeout=30)
    adopted.setup(strategy.environment, strategy.accelerator)
    t = torch.ones(1)
    adopted.all_reduce(t)
    adopted.teardown()
    return t.item(), dist.is_initialized()


def test_adopts_a_group_the_user_made():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, timeout=60)
    assert strategy.launch(adopt_existing_group) == [(2.0, True), (2.0, True)]


def test_unknown_and_unavailable_backends_are_refused_by_name():
    with pytest.raises(MisconfigurationError, match=r"knows no such backend; it has .*gloo"):
        check_backend("glooo")
    if not dist.is_mpi_available():
        with pytest.raises(UnavailableError, match=r"no mpi backend .* use collective='mpi'"):
            check_backend("mpi")
    if not dist.is_nccl_available():
        with pytest.raises(UnavailableError, match=r"no nccl backend"):
            check_backend("nccl")


def slow_rank_times_out(strategy):
    from phalanx_core import CollectiveTimeoutError

    if strategy.global_rank == 1:
        import time

        time.sleep(6)  # simulates a rank that never arrives within rank 0's 2 s barrier
        return "late"
    try:
        strategy.collective.barrier()
    except CollectiveTimeoutError as exc:
        return exc.operation, exc.missing_ranks, exc.timeout
    return "no timeout"


def test_a_rank_that_does_not_arrive_is_named_by_the_timeout():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, timeout=2)
    assert strategy.launch(slow_rank_times_out) == [("barrier", (1,), 2.0), "late"]


def rank_one_leaves(strategy):
    import time

    from phalanx_core import CollectiveConnectionError

    collective = strategy.collective
    collective.all_reduce(torch.ones(1))  # every connection is made
    if strategy.global_rank == 1:
        dist.destroy_process_group()  # closes its connections, as a process that ends does
        return "left"
    time.sleep(1.5)  # the connections are closed before rank 0 calls
    caught = []
    for call in (collective.barrier, lambda: collective.all_reduce(torch.ones(1))):
        try:
            call()
        except CollectiveConnectionError as exc:
            caught.append((exc.operation, str(exc)))
    return caught


def test_a_rank_whose_peer_left_is_told_so_by_name():
    # gloo says "Connection closed by peer [address]" where the other rank's
    # process ended before this one called: it is said as the contract's
    # error, not gloo's RuntimeError.
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, timeout=30)
    caught, left = strategy.launch(rank_one_leaves)
    assert left == "left"
    assert [operation for operation, _ in caught] == ["barrier", "all_reduce"]
    for operation, message in caught:
        assert message.startswith(
            f"{operation}() on the 'torch' collective (gloo, rank 0 of 2) lost its connection to the rank at "
        )
        assert "Connection closed by peer. That rank's process ended" in message
        assert "lost its connection to the rank at 127.0.0.1: " in message  # the host: gloo's port is swapped
    assert "Every rank calls barrier()" in caught[0][1]
    assert "Every rank calls barrier()" not in caught[1][1]


def rank_one_slow_to_connect(strategy):
    import time

    collective = strategy.collective
    collective.teardown()
    made = []
    if strategy.global_rank == 1:
        real = dist.init_process_group

        def slow(*args, **kwargs):
            real(*args, **kwargs)
            time.sleep(1.0)  # as a loaded machine's connecting thread may be
            made.append(time.time())

        dist.init_process_group = slow
    try:
        collective.setup(strategy.environment, strategy.accelerator)
    finally:
        if strategy.global_rank == 1:
            dist.init_process_group = real
    returned = time.time()
    collective.all_reduce(torch.ones(1))
    return made[0] if made else returned


def test_set_up_returns_on_no_rank_before_every_ranks_group_is_made():
    # gloo's connecting rank is done before its peer has read the
    # connection: a rank that went on and ended (a script that calls no
    # collective) closed it under the peer, whose set-up then failed with
    # "Connection closed by peer". Set-up returns once every rank's is made.
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, timeout=30)
    returned, made = strategy.launch(rank_one_slow_to_connect)
    assert returned >= made


def test_timeout_is_a_positive_number():
    with pytest.raises(MisconfigurationError, match="positive number of seconds"):
        TorchCollective(timeout=datetime.timedelta(seconds=3))  # type: ignore[arg-type]


def all_to_all_in_one_buffer(strategy):
    # The path gloo takes before torch 2.13 (it has no list all_to_all there),
    # taken here on purpose.
    collective = strategy.collective
    collective._all_to_all_in_one = True
    rank, world = collective.rank, collective.world_size
    # what rank r sends rank i has the shape of what i sends r: (2, r + i + 1)
    out = collective.all_to_all([torch.full((2, rank + i + 1), 10.0 * rank + i) for i in range(world)])
    flags = collective.all_to_all(
        [torch.tensor([rank == i, True]) for i in range(world)], async_op=True
    ).wait()
    return [t.tolist() for t in out], [t.tolist() for t in flags]


def test_all_to_all_through_one_buffer():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, timeout=60)
    results = strategy.launch(all_to_all_in_one_buffer)
    for rank, (out, flags) in enumerate(results):
        assert out == [[[10.0 * j + rank] * (rank + j + 1)] * 2 for j in range(2)]
        assert flags == [[j == rank, True] for j in range(2)]
