"""CollectiveProcessGroup: torch's wrappers (DDP, FSDP2, DeviceMesh, DTensor)
over a phalanx collective, in two real ranks over gloo.

Every rank program is defined at the top level of this module (spawned
ranks import it by name). The collective under the group is the strategy's
TorchCollective, seen through :class:`Counting`, which records every
contract call it carries: the bytes that went through it are the proof
that the traffic took the collective's path, not torch's default group.
Each launch is bounded by the collective's timeout.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.distributed as dist
from reduce_ops import premul_sum
from torch import nn

import phalanx
from phalanx_core import MisconfigurationError, Work
from phalanx_torch._torch_versions import premul_sum_factor
from phalanx_torch.process_group import CollectiveProcessGroup

pytestmark = pytest.mark.subprocess

#: Seconds a collective may wait before its rank fails.
TIMEOUT = 60
STEPS = 3


class Counting:
    """Any collective, with a count of the calls and bytes each operation
    carried. It meets the contract by handing every call on."""

    OPS = ("barrier", "broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into", "gather",
           "scatter", "reduce_scatter", "reduce_scatter_into", "all_to_all", "send", "recv")  # fmt: skip

    def __init__(self, collective):
        self._inner = collective
        self.calls = collections.Counter()
        self.bytes = collections.Counter()

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in self.OPS:
            return attr

        @functools.wraps(attr)
        def counted(*args, **kwargs):
            self.calls[name] += 1
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a]
            self.bytes[name] += sum(t.numel() * t.element_size() for t in tensors)
            return attr(*args, **kwargs)

        return counted


def launch(fn):
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, timeout=TIMEOUT)
    return strategy.launch(fn)


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
    x = torch.randn(6, 8, generator=g)
    return x, x[:, :2].sum(dim=1, keepdim=True).expand(6, 2).contiguous()


def train(model, steps=STEPS, rank=0):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(rank, step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def flat_params(model):
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in params])


def grad_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- DDP -----------------------------------------------------------------------


def ddp_both_ways(strategy):
    rank = strategy.global_rank
    counting = Counting(strategy.collective)
    pg = CollectiveProcessGroup(counting).register()
    ours = nn.parallel.DistributedDataParallel(make_model(seed=rank), process_group=pg)
    built = dict(counting.calls)
    train(ours, rank=rank)
    theirs = nn.parallel.DistributedDataParallel(make_model(seed=0))  # torch's default group
    train(theirs, rank=rank)
    pg.unregister()
    return flat_params(ours.module), flat_params(theirs.module), built, dict(counting.bytes), grad_bytes(ours)


def test_ddp_over_the_collective_trains_as_ddp_over_torchs_group():
    results = launch(ddp_both_ways)
    for ours, theirs, built, carried, gradients in results:
        # different seeds per rank: DDP's first broadcast (over the collective) made them equal
        assert "broadcast" in built
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert carried["all_reduce"] >= STEPS * gradients  # every bucket went through the collective
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)


class _Quiet(Work):
    """A handle that can neither notify nor give c10d's work: as mpi's and
    horovod's, whose operations someone must wait for."""

    def __init__(self, inner):
        self._inner = inner

    def wait(self):
        return self._inner.wait()

    def is_completed(self):
        return self._inner.is_completed()


class Quiet(Counting):
    def __getattr__(self, name):
        attr = super().__getattr__(name)
        if name not in self.OPS:
            return attr

        def quiet(*args, **kwargs):
            result = attr(*args, **kwargs)
            return _Quiet(result) if isinstance(result, Work) else result

        return quiet


def ddp_over_quiet_handles(strategy, overlap):
    import threading

    rank = strategy.global_rank
    counting = Quiet(strategy.collective)
    pg = CollectiveProcessGroup(counting, overlap=overlap).register()
    ours = nn.parallel.DistributedDataParallel(make_model(seed=rank), process_group=pg)
    train(ours, rank=rank)
    threads = sorted(t.name for t in threading.enumerate() if t.name.startswith("phalanx-pg-"))
    theirs = nn.parallel.DistributedDataParallel(make_model(seed=0))
    train(theirs, rank=rank)
    pg.unregister()
    left = [t.name for t in threading.enumerate() if t.name.startswith("phalanx-pg-")]
    return (
        flat_params(ours.module),
        flat_params(theirs.module),
        dict(counting.bytes),
        grad_bytes(ours),
        threads,
        left,
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_ddp_over_handles_that_cannot_notify_completes_in_the_call_or_in_the_groups_thread(overlap):
    for ours, theirs, carried, gradients, threads, left in launch(
        functools.partial(ddp_over_quiet_handles, overlap=overlap)
    ):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert carried["all_reduce"] >= STEPS * gradients
        # overlap: one thread of the group's waits on the handles; else none
        assert len(threads) == (1 if overlap else 0), threads
        assert left == []  # unregister stopped it


def ddp_unused_and_no_sync(strategy):
    rank = strategy.global_rank
    counting = Counting(strategy.collective)
    pg = CollectiveProcessGroup(counting).register()

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(Branchy(), process_group=pg, find_unused_parameters=True)
    x = torch.full((2, 4), float(rank + 1))
    with model.no_sync():
        model(x).sum().backward()
    local = counting.calls["all_reduce"]
    model(x).sum().backward()
    synced = model.module.used.weight.grad.clone()
    pg.unregister()
    return local, counting.calls["all_reduce"], synced


def test_ddp_no_sync_and_find_unused_parameters_over_the_collective():
    (local0, after0, grad0), (local1, after1, grad1) = launch(ddp_unused_and_no_sync)
    assert local0 == local1 == 0  # nothing reduced inside no_sync
    assert after0 == after1 == 2  # the bucket, and the map of used parameters
    torch.testing.assert_close(grad0, grad1)
    # mean over ranks of two backwards (ranks' inputs 1 and 2): 2 * (1 + 2) / 2 = 3 per element, 2 rows
    torch.testing.assert_close(grad0, torch.full((4, 4), 6.0))


# -- FSDP2, DeviceMesh, DTensor ------------------------------------------------------


def fsdp_both_ways(strategy):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = strategy.global_rank
    counting = Counting(strategy.collective)
    pg = CollectiveProcessGroup(counting).register()

    def sharded(mesh):
        model = make_model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    ours = sharded(pg.device_mesh("cpu"))
    train(ours, rank=rank)
    after_ours = flat_params(ours)  # full_tensor(): an all-gather over the collective
    theirs = sharded(init_device_mesh("cpu", (2,)))
    train(theirs, rank=rank)
    pg.unregister()
    return (
        after_ours,
        flat_params(theirs),
        dict(counting.calls),
        dict(counting.bytes),
        grad_bytes(make_model()),
    )


def test_fsdp2_over_the_collective_trains_as_fsdp2_over_torchs_group():
    for ours, theirs, calls, carried, gradients in launch(fsdp_both_ways):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        # FSDP's flat buffers: the collective writes into them
        assert set(calls) >= {"all_gather_into", "reduce_scatter_into"}
        # each step reduce-scatters every gradient (the whole, in; a shard, out)
        assert carried["reduce_scatter_into"] >= STEPS * gradients
        # each step gathers every shard forward and again backward
        assert carried["all_gather_into"] >= 2 * STEPS * gradients // 2


def dtensor_redistribute(strategy):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    counting = Counting(strategy.collective)
    pg = CollectiveProcessGroup(counting).register()
    mesh = pg.device_mesh("cpu")
    # DeviceMesh equality ignores the group: unnamed, a mesh over this group
    # equals one over torch's (and DTensor's caches would mix them up)
    alike = DeviceMesh.from_group(pg, "cpu") == init_device_mesh("cpu", (2,))
    apart = mesh != init_device_mesh("cpu", (2,))
    seen = {}
    whole = torch.arange(8.0).reshape(4, 2)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    seen["distribute"] = dict(counting.calls)
    counting.calls.clear()
    replicated = sharded.redistribute(mesh, [Replicate()]).to_local()
    seen["shard->replicate"] = dict(counting.calls)
    counting.calls.clear()
    partial = DTensor.from_local(torch.ones(4, 2) * (strategy.global_rank + 1), mesh, [Partial()])
    scattered = partial.redistribute(mesh, [Shard(0)]).to_local()
    seen["partial->shard"] = dict(counting.calls)
    counting.calls.clear()
    summed = partial.redistribute(mesh, [Replicate()]).to_local()
    seen["partial->replicate"] = dict(counting.calls)
    pg.unregister()
    return replicated, scattered, summed, seen, (alike, apart)


def test_dtensor_redistributes_through_the_collective():
    for replicated, scattered, summed, seen, meshes in launch(dtensor_redistribute):
        assert meshes == (True, True)
        torch.testing.assert_close(replicated, torch.arange(8.0).reshape(4, 2))
        torch.testing.assert_close(scattered, torch.full((2, 2), 3.0))
        torch.testing.assert_close(summed, torch.full((4, 2), 3.0))
        assert seen == {
            "distribute": {"scatter": 1},
            "shard->replicate": {"all_gather_into": 1},
            "partial->shard": {"reduce_scatter_into": 1},
            "partial->replicate": {"all_reduce": 1},
        }


def as_world(strategy):
    """torch with no default group of its own (as under a collective that
    is not torch's): the collective's group takes the default group's place.
    Its unregister ends every group torch has (destroy_process_group()), so
    torch's own group trains first."""
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = strategy.global_rank
    theirs = make_model()
    mesh = init_device_mesh("cpu", (2,))
    for layer in [*theirs[::2], theirs]:
        fully_shard(layer, mesh=mesh)
    train(theirs, rank=rank)
    after_theirs = flat_params(theirs)
    counting = Counting(strategy.collective.new_group([0, 1]))  # over a gloo group of its own
    c10d._update_default_pg(None)
    pg = CollectiveProcessGroup(counting)
    try:
        pg.device_mesh("cpu")
        refused = None
    except ValueError as exc:  # DeviceMesh asks the default group for this rank
        refused = str(exc)
    pg.register(as_world=True)
    ours = make_model()
    mesh = pg.device_mesh("cpu")
    for layer in [*ours[::2], ours]:
        fully_shard(layer, mesh=mesh)
    train(ours, rank=rank)
    after_ours = flat_params(ours)
    t = torch.ones(2)
    dist.all_reduce(t)  # no group given: the default, now this one
    try:  # a group over this world, by torch's backend default: the world's backend makes none
        dist.new_group([0, 1])
        new_group = None
    except MisconfigurationError as exc:
        new_group = str(exc)
    pg.unregister()
    gone = dist.is_initialized()
    return after_ours, after_theirs, refused, t, dict(counting.calls), gone, new_group


def test_the_group_can_stand_in_for_torchs_default_group():
    for ours, theirs, refused, summed, calls, gone, new_group in launch(as_world):
        assert "Default process group has not been initialized" in refused
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        torch.testing.assert_close(summed, torch.full((2,), 2.0))
        assert calls["all_gather_into"] > 0 and calls["reduce_scatter_into"] > 0 and calls["all_reduce"] == 1
        assert not gone  # unregister gave the default group's place back
        assert "it makes none of its own. Give new_group a backend of torch's" in new_group


# -- torch's collectives, one by one ----------------------------------------------


class Failing:
    """A collective whose all_reduce fails when waited on."""

    def __init__(self, collective):
        self._inner = collective

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def all_reduce(self, tensor, op="sum", *, async_op=False):
        class Broken:
            def wait(self):
                raise RuntimeError("the transport broke")

        return Broken()


def torch_calls(strategy):
    rank, out = strategy.global_rank, {}
    pg = CollectiveProcessGroup(strategy.collective).register()
    for name, op in [("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG), ("min", dist.ReduceOp.MIN),
                     ("max", dist.ReduceOp.MAX), ("product", dist.ReduceOp.PRODUCT)]:  # fmt: skip
        t = torch.tensor([rank + 1.0, 3.0])
        dist.all_reduce(t, op=op, group=pg)
        out[name] = t.tolist()
    t = torch.tensor([rank + 1.0, 3.0])
    try:
        dist.all_reduce(t, op=premul_sum(0.5), group=pg)
        out["premul"] = t.tolist()
    except (MisconfigurationError, RuntimeError) as exc:  # torch 2.9: refused, the factor unreadable
        out["premul"] = f"{type(exc).__name__}: {exc}"
    t = torch.tensor([float(rank)] * 3)
    dist.broadcast(t, src=1, group=pg)
    out["broadcast"] = t.tolist()
    gathered = torch.empty(4)
    dist.all_gather_into_tensor(gathered, torch.tensor([rank, rank + 0.5]), group=pg)
    out["all_gather_into_tensor"] = gathered.tolist()
    parts = [torch.empty(2) for _ in range(2)]
    dist.all_gather(parts, torch.tensor([rank, -rank], dtype=torch.float), group=pg)
    out["all_gather"] = [p.tolist() for p in parts]
    mine = torch.empty(2)
    dist.reduce_scatter_tensor(mine, torch.arange(4.0) + rank, group=pg)
    out["reduce_scatter_tensor"] = mine.tolist()
    even = torch.empty(4)
    dist.all_to_all_single(even, torch.arange(4.0) + 10 * rank, group=pg)
    out["all_to_all_single"] = even.tolist()
    # uneven: rank r sends r + 1 rows to each rank
    uneven = torch.empty(3)
    dist.all_to_all_single(
        uneven, torch.full((2 * (rank + 1),), float(rank)), [1, 2], [rank + 1] * 2, group=pg
    )
    out["all_to_all_single uneven"] = uneven.tolist()
    received = [torch.empty(rank + 1), torch.empty(rank + 1)]  # rank r gets r + 1 from each
    dist.all_to_all(received, [torch.full((j + 1,), 10.0 * rank + j) for j in range(2)], group=pg)
    out["all_to_all"] = [r.tolist() for r in received]
    work = dist.barrier(group=pg, async_op=True)
    work.wait()
    if rank == 0:
        dist.send(torch.tensor([7.0]), dst=1, group=pg)
    else:
        box = torch.empty(1)
        dist.recv(box, src=0, group=pg)
        out["recv"] = box.tolist()
    work = dist.all_reduce(torch.ones(1), op=dist.ReduceOp.SUM, group=pg, async_op=True)
    out["future"] = [t.tolist() for t in work.get_future().wait()]
    try:
        dist.all_reduce(torch.ones(1, dtype=torch.int32), op=dist.ReduceOp.BXOR, group=pg)
    except MisconfigurationError as exc:
        out["bxor"] = str(exc)
    failing = CollectiveProcessGroup(Failing(strategy.collective))
    try:
        failing.allreduce([torch.ones(1)]).wait()
    except RuntimeError as exc:
        out["error"] = str(exc)
    model = nn.parallel.DistributedDataParallel(nn.Linear(2, 1), process_group=failing)
    try:
        model(torch.ones(1, 2)).sum().backward()  # the bucket's all_reduce fails in the reducer
    except RuntimeError as exc:
        out["ddp error"] = str(exc)
    failing.unregister()
    out["rank"] = (dist.get_rank(pg), dist.get_world_size(pg), dist.get_backend(pg))
    pg.unregister()
    return out


def test_torchs_collectives_over_the_collective():
    r0, r1 = launch(torch_calls)
    for rank, out in enumerate((r0, r1)):
        assert out["sum"] == [3.0, 6.0]
        assert out["avg"] == [1.5, 3.0]
        assert out["min"] == [1.0, 3.0]
        assert out["max"] == [2.0, 3.0]
        assert out["product"] == [2.0, 9.0]
        if premul_sum_factor(premul_sum(0.5)) is None:
            assert "PREMUL_SUM, whose factor this torch" in out["premul"], out["premul"]
        else:
            assert out["premul"] == [1.5, 3.0]
        assert out["broadcast"] == [1.0, 1.0, 1.0]
        assert out["all_gather_into_tensor"] == [0.0, 0.5, 1.0, 1.5]
        assert out["all_gather"] == [[0.0, 0.0], [1.0, -1.0]]
        assert out["reduce_scatter_tensor"] == [[1.0, 3.0], [5.0, 7.0]][rank]
        assert out["all_to_all_single"] == [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]][rank]
        assert out["all_to_all_single uneven"] == [0.0, 1.0, 1.0]
        assert out["all_to_all"] == [[[0.0], [10.0]], [[1.0, 1.0], [11.0, 11.0]]][rank]
        assert out["future"] == [[2.0]]
        assert "BXOR" in out["bxor"] and "no name for" in out["bxor"]
        assert out["error"] == "the transport broke"
        assert "the transport broke" in out["ddp error"]
        assert out["rank"] == (rank, 2, "phalanx-torch")
    assert r1["recv"] == [7.0]


def test_a_collective_not_set_up_is_refused():
    from phalanx_torch.collectives import TorchCollective

    with pytest.raises(MisconfigurationError, match="not set up"):
        CollectiveProcessGroup(TorchCollective())


def test_overlap_takes_a_bool():
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    strategy.launch()
    try:
        with pytest.raises(MisconfigurationError, match=r"overlap='yes'\): give True .* or False"):
            CollectiveProcessGroup(strategy.collective, overlap="yes")
    finally:
        strategy._teardown_at_exit()
