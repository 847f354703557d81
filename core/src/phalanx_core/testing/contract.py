"""The Collective contract as executable checks, for any implementation.

Run :func:`check_collective` in every rank of a job with a set-up
collective; it raises ``AssertionError`` naming the operation and what
differed, or returns the names of the checks that ran. Operations the
collective lists in ``unsupported`` are checked to refuse clearly
(:class:`~phalanx_core.UnavailableError`), never skipped::

    def fn(strategy):
        return check_collective(strategy.collective)

    phalanx.resolve("ddp_spawn", accelerator="cpu", devices=3).launch(fn)

Imports torch when called, not when imported.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from ..collective import REDUCE_OPS, Collective, Work
from ..errors import MisconfigurationError, NotInGroupError, UnavailableError

__all__ = ["AFTER_RECONFIGURE", "CHECKS", "check_collective", "check_reconfigure"]


def _eq(operation: str, got: Any, expected: Any) -> None:
    assert got == expected, f"{operation}: expected {expected!r}, got {got!r}"


def _values(t: Any) -> list[Any]:
    return list(t.tolist()) if t.dim() else [t.item()]


def check_ranks(c: Any) -> None:
    assert c.is_initialized, "is_initialized is false after setup"
    assert 0 <= c.rank < c.world_size, f"rank {c.rank} outside 0..{c.world_size - 1}"
    assert len(c.global_ranks) == c.world_size, f"global_ranks {c.global_ranks} has the wrong length"
    assert c.is_member


def check_barrier(c: Any) -> None:
    assert c.barrier() is None, "barrier() returns None"
    work = c.barrier(async_op=True)
    assert isinstance(work, Work), "barrier(async_op=True) returns a Work"
    work.wait()


def check_broadcast(c: Any) -> None:
    import torch

    for src in range(c.world_size):
        t = torch.full((3,), float(c.rank))
        out = c.broadcast(t, src)
        assert out is t, "broadcast returns the tensor it was given (in place)"
        _eq(f"broadcast(src={src})", t.tolist(), [float(src)] * 3)


def _expected(op: str, n: int, integer: bool) -> float:
    values = list(range(1, n + 1))  # rank r contributes r + 1
    if op == "sum":
        return sum(values)
    if op == "mean":
        return sum(values) // n if integer else sum(values) / n
    if op == "min":
        return 1
    if op == "max":
        return n
    return math.prod(values)


def check_all_reduce(c: Any) -> None:
    import torch

    n = c.world_size
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        integer = not dtype.is_floating_point
        for op in REDUCE_OPS:
            if op not in c.reduce_ops:
                continue
            t = torch.full((2,), c.rank + 1, dtype=dtype)
            out = c.all_reduce(t, op)
            assert out is t, f"all_reduce({op}) returns the tensor it was given (in place)"
            assert t.dtype is dtype, f"all_reduce({op}) changed the dtype to {t.dtype}"
            expected = _expected(op, n, integer)
            got = _values(t)
            assert all(math.isclose(g, expected, rel_tol=1e-6) for g in got), (
                f"all_reduce(op={op!r}, {dtype}) over {n} ranks: expected {expected}, got {got}"
            )
    # integer mean is floor division: ranks give 0, 1 (, 2, ...) -> sum // n
    t = torch.tensor([c.rank], dtype=torch.int64)
    c.all_reduce(t, "mean")
    _eq("all_reduce(mean) of integers", t.item(), sum(range(n)) // n)
    t = torch.tensor([-c.rank - 1], dtype=torch.int64)  # negative: floor, not truncation
    c.all_reduce(t, "mean")
    _eq("all_reduce(mean) of negative integers", t.item(), -sum(range(1, n + 1)) // n)


def check_bool_reductions(c: Any) -> None:
    import torch

    t = torch.tensor([c.rank == 0, True, False])
    c.all_reduce(t, "min")
    _eq("all_reduce(min) of bools", t.tolist(), [c.world_size == 1, True, False])
    t = torch.tensor([c.rank == 0, True, False])
    c.all_reduce(t, "max")
    _eq("all_reduce(max) of bools", t.tolist(), [True, True, False])
    try:
        c.all_reduce(torch.tensor([True]), "sum")
    except MisconfigurationError:
        pass
    else:
        raise AssertionError("all_reduce(sum) of a bool tensor must raise MisconfigurationError")


def check_reduce(c: Any) -> None:
    import torch

    dst = c.world_size - 1
    t = torch.full((2,), float(c.rank + 1))
    out = c.reduce(t, dst, "sum")
    assert out is t, "reduce returns the tensor it was given"
    if c.rank == dst:
        _eq("reduce(sum) on dst", t.tolist(), [float(_expected("sum", c.world_size, False))] * 2)


def check_all_gather(c: Any) -> None:
    import torch

    t = torch.tensor([float(c.rank), 7.0])
    out = c.all_gather(t)
    _eq("all_gather length", len(out), c.world_size)
    _eq("all_gather values", [x.tolist() for x in out], [[float(r), 7.0] for r in range(c.world_size)])
    assert all(x is not t for x in out), "all_gather returns new tensors"
    _eq("all_gather leaves its input", t.tolist(), [float(c.rank), 7.0])


def check_gather(c: Any) -> None:
    import torch

    t = torch.tensor([float(c.rank)])
    out = c.gather(t, 0)
    if c.rank == 0:
        _eq("gather on dst", [x.item() for x in out], [float(r) for r in range(c.world_size)])
    else:
        _eq("gather on a non-dst rank", out, [])


def check_scatter(c: Any) -> None:
    import torch

    src = c.world_size - 1
    t = torch.zeros(2)
    chunks = [torch.full((2,), 10.0 * r) for r in range(c.world_size)] if c.rank == src else None
    out = c.scatter(t, chunks, src)
    assert out is t, "scatter returns the tensor it was given (in place)"
    _eq("scatter", t.tolist(), [10.0 * c.rank] * 2)


def check_reduce_scatter(c: Any) -> None:
    import torch

    n = c.world_size
    t = torch.arange(2 * n, dtype=torch.float32) + c.rank
    before = t.clone()
    out = c.reduce_scatter(t, "sum")
    offset = sum(range(n))
    expected = [n * v + offset for v in (2.0 * c.rank, 2.0 * c.rank + 1)]
    _eq("reduce_scatter(sum)", out.tolist(), expected)
    assert torch.equal(t, before), "reduce_scatter leaves its input unchanged"
    try:
        c.reduce_scatter(torch.zeros(2 * n + 1), "sum")
    except MisconfigurationError:
        if n == 1:
            raise AssertionError("reduce_scatter of 3 rows over 1 rank is valid") from None
    else:
        if n > 1:
            raise AssertionError("reduce_scatter with dim 0 not divisible by the size must raise")


def check_all_gather_into(c: Any) -> None:
    import torch

    n = c.world_size
    t = torch.tensor([[float(c.rank), 7.0]])
    output = torch.full((n, 2), -1.0)
    got = c.all_gather_into(output, t)
    assert got is output, "all_gather_into returns the output it was given"
    _eq("all_gather_into", output.tolist(), [[float(r), 7.0] for r in range(n)])
    _eq("all_gather_into leaves its input", t.tolist(), [[float(c.rank), 7.0]])
    flat = torch.zeros(2 * n)  # any shape with the elements: rank i's in the i-th chunk
    c.all_gather_into(flat, t)
    _eq("all_gather_into a flat output", flat.tolist(), [v for r in range(n) for v in (float(r), 7.0)])
    work = c.all_gather_into(output, torch.tensor([[float(c.rank) + 0.5, 1.0]]), async_op=True)
    assert isinstance(work, Work), "all_gather_into(async_op=True) returns a Work"
    assert work.wait() is output, "Work.wait() of all_gather_into returns the output"
    _eq("async all_gather_into", output.tolist(), [[r + 0.5, 1.0] for r in range(n)])
    for label, out, inp in (
        ("an output of the wrong size", torch.zeros(2 * n + 1), t),
        ("an output of another dtype", torch.zeros(2 * n, dtype=torch.float64), t),
        ("a non-contiguous output", torch.zeros(2, 2 * n).t(), torch.zeros(2)),
    ):
        try:
            c.all_gather_into(out, inp)
        except MisconfigurationError:
            continue
        raise AssertionError(f"all_gather_into with {label} must raise MisconfigurationError")


def check_reduce_scatter_into(c: Any) -> None:
    import torch

    n = c.world_size
    t = torch.arange(2 * n, dtype=torch.float32) + c.rank
    before = t.clone()
    output = torch.full((2,), -1.0)
    got = c.reduce_scatter_into(output, t, "sum")
    assert got is output, "reduce_scatter_into returns the output it was given"
    offset = sum(range(n))
    _eq(
        "reduce_scatter_into(sum)",
        output.tolist(),
        [n * v + offset for v in (2.0 * c.rank, 2.0 * c.rank + 1)],
    )
    assert torch.equal(t, before), "reduce_scatter_into leaves its input unchanged"
    ints = torch.full((n,), c.rank + 1, dtype=torch.int64)
    out = torch.zeros(1, dtype=torch.int64)
    c.reduce_scatter_into(out, ints, "mean")
    _eq("reduce_scatter_into(mean) of integers", out.tolist(), [sum(range(1, n + 1)) // n])
    work = c.reduce_scatter_into(output, torch.ones(2 * n), "max", async_op=True)
    assert isinstance(work, Work), "reduce_scatter_into(async_op=True) returns a Work"
    assert work.wait() is output, "Work.wait() of reduce_scatter_into returns the output"
    _eq("async reduce_scatter_into(max)", output.tolist(), [1.0, 1.0])
    try:
        c.reduce_scatter_into(torch.zeros(3), torch.zeros(3 * n + 1), "sum")
    except MisconfigurationError:
        pass
    else:
        raise AssertionError("reduce_scatter_into with an input of the wrong size must raise")


def check_all_to_all(c: Any) -> None:
    import torch

    tensors = [torch.full((2,), 100.0 * c.rank + i) for i in range(c.world_size)]
    out = c.all_to_all(tensors)
    _eq("all_to_all", [x.tolist() for x in out], [[100.0 * j + c.rank] * 2 for j in range(c.world_size)])


def check_send_recv(c: Any) -> None:
    import torch

    n = c.world_size
    if n > 1:
        if c.rank % 2 == 0 and c.rank + 1 < n:
            c.send(torch.tensor([float(c.rank) + 0.5]), c.rank + 1)
        elif c.rank % 2 == 1:
            t = torch.zeros(1)
            out = c.recv(t, c.rank - 1)
            assert out is t, "recv returns the tensor it was given (in place)"
            _eq("recv", t.item(), c.rank - 1 + 0.5)
    try:
        c.send(torch.zeros(1), c.rank)
    except MisconfigurationError:
        pass
    else:
        raise AssertionError("send to oneself must raise MisconfigurationError")


def check_objects(c: Any) -> None:
    n = c.world_size
    src = n - 1
    _eq(
        "broadcast_object", c.broadcast_object({"from": c.rank, "x": [1, 2]}, src), {"from": src, "x": [1, 2]}
    )
    _eq("all_gather_object", c.all_gather_object(("r", c.rank)), [("r", r) for r in range(n)])
    got = c.gather_object(c.rank * 2, 0)
    _eq("gather_object", got, [r * 2 for r in range(n)] if c.rank == 0 else [])
    objs = [f"for {r}" for r in range(n)] if c.rank == 0 else None
    _eq("scatter_object", c.scatter_object(objs, 0), f"for {c.rank}")


def check_async(c: Any) -> None:
    import torch

    t = torch.ones(2)
    work = c.all_reduce(t, "sum", async_op=True)
    assert isinstance(work, Work), "all_reduce(async_op=True) returns a Work"
    out = work.wait()
    assert out is t, "Work.wait() returns what the synchronous call returns"
    assert work.is_completed(), "is_completed() after wait()"
    _eq("async all_reduce", t.tolist(), [float(c.world_size)] * 2)
    t = torch.full((1,), c.rank + 1, dtype=torch.int64)
    _eq(
        "async integer mean",
        c.all_reduce(t, "mean", async_op=True).wait().item(),
        sum(range(1, c.world_size + 1)) // c.world_size,
    )
    gathered = c.all_gather(torch.tensor([float(c.rank)]), async_op=True).wait()
    _eq("async all_gather", [x.item() for x in gathered], [float(r) for r in range(c.world_size)])


def check_async_inputs(c: Any) -> None:
    """Asynchronous operations on temporary inputs: the caller keeps no
    reference to what it passed, and other tensors of the same sizes fill
    the freed memory before ``wait()``. A collective must keep every buffer
    its backend still reads alive until the operation is done (a process
    group built on it gets exactly such inputs from FSDP)."""
    import torch

    n, r = c.world_size, c.rank
    base = torch.arange(4 * n, dtype=torch.float32).reshape(2 * n, 2)
    scattered = c.reduce_scatter(base * (r + 1), "sum", async_op=True)
    gathered = c.all_gather(torch.full((3, 2), float(r)).t(), async_op=True)  # not contiguous
    swapped = c.all_to_all([torch.full((2,), float(10 * r + j)) for j in range(n)], async_op=True)
    junk = [torch.full(shape, -7.0) for shape in ((2 * n, 2), (2, 3), (n, 2), (2,)) for _ in range(32)]
    total = n * (n + 1) // 2
    _eq(
        "async reduce_scatter of a temporary",
        scattered.wait().tolist(),
        (base[2 * r : 2 * r + 2] * total).tolist(),
    )
    _eq(
        "async all_gather of a temporary",
        [g.tolist() for g in gathered.wait()],
        [[[float(k)] * 3] * 2 for k in range(n)],
    )
    _eq(
        "async all_to_all of temporaries",
        [t.tolist() for t in swapped.wait()],
        [[float(10 * k + r)] * 2 for k in range(n)],
    )
    del junk


def check_groups(c: Any) -> None:
    import torch

    n = c.world_size
    if n > 1 and not getattr(c, "subgroups", True):
        # Only the whole world: a smaller group is refused, clearly, on every
        # rank; the whole world, asked in any order, works.
        refusal = ""
        try:
            c.new_group([n - 1])
        except UnavailableError as exc:
            refusal = str(exc)
        else:
            raise AssertionError("subgroups = False, yet new_group of fewer than every rank did not raise")
        if "new_group" not in refusal:
            raise AssertionError(f"the refusal of a smaller group must name new_group: {refusal}")
        given = list(range(n))[::-1]
    else:
        given = [0] if n == 1 else [n - 1, 0]
    group = c.new_group(given)
    members = sorted(given)  # group ranks follow the parent's rank order, not the order given
    if c.rank in members:
        assert group.is_member, "a member's group has is_member true"
        _eq("group world_size", group.world_size, len(members))
        _eq("group rank", group.rank, members.index(c.rank))
        t = torch.tensor([float(c.rank)])
        group.all_reduce(t, "sum")
        _eq("group all_reduce", t.item(), float(sum(members)))
        b = torch.tensor([float(c.rank)])
        group.broadcast(b, src=group.world_size - 1)  # a group rank, not a world rank
        _eq("group broadcast from group rank", b.item(), float(members[-1]))
        _eq("group all_gather_object", group.all_gather_object(c.rank), members)
    else:
        assert not group.is_member, "a non-member's group has is_member false"
        _eq("non-member rank", group.rank, -1)
        try:
            group.all_reduce(torch.zeros(1))
        except NotInGroupError:
            pass
        else:
            raise AssertionError("an operation on a non-member's group must raise NotInGroupError")
    c.barrier()


def check_bad_arguments(c: Any) -> None:
    import torch

    bad: list[tuple[str, Callable[[], Any]]] = [
        ("all_reduce(op='avg')", lambda: c.all_reduce(torch.zeros(1), "avg")),
        ("broadcast(src=world_size)", lambda: c.broadcast(torch.zeros(1), c.world_size)),
        ("reduce(dst=-1)", lambda: c.reduce(torch.zeros(1), -1)),
        ("new_group([])", lambda: c.new_group([])),
    ]
    for label, call in bad:
        try:
            call()
        except MisconfigurationError:
            continue
        raise AssertionError(f"{label} must raise MisconfigurationError before sending anything")


#: Every check, in the order they run; a check whose operation the collective
#: declares unsupported is replaced by a check that the operation refuses.
CHECKS: dict[str, tuple[Callable[[Any], None], tuple[str, ...]]] = {
    "ranks": (check_ranks, ()),
    "barrier": (check_barrier, ("barrier",)),
    "broadcast": (check_broadcast, ("broadcast",)),
    "all_reduce": (check_all_reduce, ("all_reduce",)),
    "bool_reductions": (check_bool_reductions, ("all_reduce",)),
    "reduce": (check_reduce, ("reduce",)),
    "all_gather": (check_all_gather, ("all_gather",)),
    "gather": (check_gather, ("gather",)),
    "scatter": (check_scatter, ("scatter",)),
    "reduce_scatter": (check_reduce_scatter, ("reduce_scatter",)),
    "all_gather_into": (check_all_gather_into, ("all_gather_into",)),
    "reduce_scatter_into": (check_reduce_scatter_into, ("reduce_scatter_into",)),
    "all_to_all": (check_all_to_all, ("all_to_all",)),
    "send_recv": (check_send_recv, ("send", "recv")),
    "objects": (check_objects, ("broadcast_object", "all_gather_object", "gather_object", "scatter_object")),
    "async": (check_async, ("all_reduce", "all_gather")),
    "async_inputs": (check_async_inputs, ("reduce_scatter", "all_gather", "all_to_all")),
    "groups": (check_groups, ("all_reduce", "broadcast", "all_gather_object", "barrier")),
    "bad_arguments": (check_bad_arguments, ("all_reduce", "broadcast", "reduce")),
}


def _check_refuses(c: Collective, operation: str) -> None:
    try:
        getattr(c, operation)(None)
    except UnavailableError as exc:
        if operation not in str(exc):
            raise AssertionError(f"the refusal of {operation}() must name the operation: {exc}") from exc
    else:
        raise AssertionError(f"{operation}() is declared unsupported but did not raise UnavailableError")


def check_collective(collective: Collective, only: tuple[str, ...] = (), *, device: Any = None) -> list[str]:
    """Run every check of the contract (or those named in ``only``) on a
    set-up collective, in every rank; return the names of what ran, with
    ``"refuses:<op>"`` for each declared-unsupported operation.

    The checks make their tensors on ``device`` (``strategy.root_device``
    for nccl, which moves CUDA tensors only); ``None`` is torch's default
    device, the CPU."""
    if device is None:
        return _check_all(collective, only)
    import torch

    with torch.device(device):
        return _check_all(collective, only)


def _check_all(collective: Collective, only: tuple[str, ...]) -> list[str]:
    ran = []
    unsupported = set(collective.unsupported)
    for name, (check, operations) in CHECKS.items():
        if only and name not in only:
            continue
        if unsupported & set(operations):
            for op in sorted(unsupported & set(operations)):
                if f"refuses:{op}" not in ran:
                    _check_refuses(collective, op)
                    ran.append(f"refuses:{op}")
            continue
        check(collective)
        ran.append(name)
    return ran


# -- when peers come and go ------------------------------------------------------

#: The checks that run after each reconfiguration: the whole contract but
#: subgroups (a reconfigured group makes none: see the contract).
AFTER_RECONFIGURE: tuple[str, ...] = tuple(name for name in CHECKS if name != "groups")


def check_reconfigure(
    collective: Collective, *, host: str, port: int, rank: int, world_size: int, prefix: str
) -> list[str]:
    """The ``reconfigure`` capability, in every rank of a job of
    ``world_size`` (3 or more) ranks, on a collective that was never set
    up (the same kind on every rank), meeting at the TCPStore at
    ``host:port``: two configurations in a row before any operation; the
    contract over every rank; over all but the last rank (which sits that
    one out); over every rank again; and again over the same members.
    After each, every check of the contract but subgroups (with the
    configuration's ranks). Returns what ran, one label a configuration."""
    from ..collective import Membership

    last = world_size - 1
    plan: list[tuple[str, list[int]]] = [
        ("every rank, first", list(range(world_size))),
        ("every rank, at once again", list(range(world_size))),
        ("all but the last", list(range(last))),
        ("every rank, back", list(range(world_size))),
        ("the same members again", list(range(world_size))),
    ]
    ran: list[str] = []
    for index, (label, members) in enumerate(plan):
        if rank not in members:
            ran.append(f"{label}: sat out")
            continue
        membership = Membership(
            rank=members.index(rank),
            world_size=len(members),
            host=host,
            port=port,
            prefix=f"{prefix}/{index}",
            label=label,
        )
        collective.reconfigure(membership)
        _eq(f"rank after reconfiguring ({label})", collective.rank, membership.rank)
        _eq(f"world_size after reconfiguring ({label})", collective.world_size, len(members))
        if index == 0:
            continue  # the next one comes before any operation
        checks = _check_all(collective, AFTER_RECONFIGURE)
        ran.append(f"{label}: {len(checks)} checks")
    return ran
