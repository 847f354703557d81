"""The ``torch`` collective's calls over a group it formed itself, for one
configuration of members (``Collective.reconfigure``).

torch makes the groups its ``torch.distributed`` functions take from the
job's default group only (``init_process_group``, ``new_group``); a group of
other members, formed again at every quorum, has no place there. So a
configuration is one c10d backend made from its store, rank and size
(``torch.distributed.ProcessGroupGloo``, ``ProcessGroupNCCL``: public
classes), and :class:`BackendCalls` gives the torch collective the
functions it calls on ``torch.distributed`` (same names, same arguments),
each one call of the backend's own public methods. The collective's
operations, their checks, their "mean" of integers and their errors stay
the ones it runs over the default group.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from phalanx_core import CollectiveConnectionError, Membership, MisconfigurationError

__all__ = ["ABORTED", "FORMED", "BackendCalls", "form"]

#: The c10d backends a configuration's group is formed of (their public
#: classes take a store, a rank and a size).
FORMED = ("gloo", "nccl")


def form(backend: str, membership: Membership, timeout: float) -> Any:
    """A c10d backend of ``backend`` (``"gloo"``, ``"nccl"``) for the
    members ``membership`` names: its store client, under the
    configuration's prefix, and the backend's connections to every member
    (made here: this returns once every member arrived, or raises c10d's
    RuntimeError after ``timeout``)."""
    wait = datetime.timedelta(seconds=timeout)
    try:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            membership.host, membership.port, is_master=False, timeout=wait, wait_for_workers=False
        )
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CollectiveConnectionError(
            f"reconfigure() on the 'torch' collective ({membership.describe()}): the members' store at "
            f"{membership.host}:{membership.port} did not answer (timeout {timeout:g} s: {first}). Check "
            "that whatever serves it (TorchFT's manager of the quorum's leader) runs and is reachable",
            operation="reconfigure",
        ) from None
    prefixed = dist.PrefixStore(membership.prefix, store)  # type: ignore[attr-defined]
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, membership.rank, membership.world_size, wait)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = wait
        return dist.ProcessGroupNCCL(prefixed, membership.rank, membership.world_size, options)
    raise MisconfigurationError(
        f"reconfigure() on the 'torch' collective: backend {backend!r} cannot form a group of other "
        "members in place (torch makes its groups from the job's default group only, and gloo and nccl "
        "are the backends phalanx forms one of by hand); give backend='gloo' or 'nccl'"
    )


def _run(work: Any, async_op: bool) -> Any:
    if async_op:
        return work
    work.wait()
    return None


class BackendCalls:
    """``torch.distributed``'s functions as the torch collective calls them
    (``group=`` is ignored: the group is this configuration's), over one
    c10d backend. Ranks are the configuration's."""

    def __init__(self, backend: Any, rank: int, size: int) -> None:
        self.backend = backend
        self.rank = rank
        self.size = size

    def barrier(self, group: Any = None, async_op: bool = False) -> Any:
        return _run(self.backend.barrier(dist.BarrierOptions()), async_op)

    def monitored_barrier(
        self, group: Any = None, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        self.backend.monitored_barrier(timeout, wait_all_ranks)

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        options = dist.BroadcastOptions()
        options.rootRank = src
        return _run(self.backend.broadcast([tensor], options), async_op)

    def all_reduce(self, tensor: torch.Tensor, op: Any, group: Any = None, async_op: bool = False) -> Any:
        options = dist.AllreduceOptions()
        options.reduceOp = op
        return _run(self.backend.allreduce([tensor], options), async_op)

    def reduce(
        self, tensor: torch.Tensor, dst: int, op: Any, group: Any = None, async_op: bool = False
    ) -> Any:
        options = dist.ReduceOptions()
        options.rootRank = dst
        options.reduceOp = op
        return _run(self.backend.reduce([tensor], options), async_op)

    def all_gather(
        self, out: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        return _run(self.backend.allgather([out], [tensor]), async_op)

    def all_gather_into(
        self, stacked: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False
    ) -> Any:
        # Each rank's part lands in its chunk of the output itself (views).
        parts = [chunk.view(tensor.shape) for chunk in stacked.chunk(self.size)]
        return _run(self.backend.allgather([parts], [tensor.contiguous()]), async_op)

    def gather(
        self,
        tensor: torch.Tensor,
        out: list[torch.Tensor] | None,
        dst: int,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        options = dist.GatherOptions()
        options.rootRank = dst
        return _run(self.backend.gather([out] if out is not None else [], [tensor], options), async_op)

    def scatter(
        self,
        tensor: torch.Tensor,
        chunks: Sequence[torch.Tensor] | None,
        src: int,
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        options = dist.ScatterOptions()
        options.rootRank = src
        given = [[c.contiguous() for c in chunks]] if chunks is not None else []
        return _run(self.backend.scatter([tensor], given, options), async_op)

    def reduce_scatter(
        self, out: torch.Tensor, source: torch.Tensor, op: Any, group: Any = None, async_op: bool = False
    ) -> Any:
        options = dist.ReduceScatterOptions()
        options.reduceOp = op
        parts = [chunk.view(out.shape) for chunk in source.chunk(self.size)]
        return _run(self.backend.reduce_scatter([out], [parts], options), async_op)

    def all_to_all(
        self, out: list[torch.Tensor], tensors: list[torch.Tensor], group: Any = None, async_op: bool = False
    ) -> Any:
        return _run(self.backend.alltoall(out, tensors, dist.AllToAllOptions()), async_op)

    def all_to_all_single(
        self,
        received: torch.Tensor,
        flat: torch.Tensor,
        out_sizes: list[int],
        in_sizes: list[int],
        group: Any = None,
        async_op: bool = False,
    ) -> Any:
        work = self.backend.alltoall_base(received, flat, out_sizes, in_sizes, dist.AllToAllOptions())
        return _run(work, async_op)

    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0) -> None:
        self.backend.send([tensor], dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, group: Any = None, tag: int = 0) -> None:
        self.backend.recv([tensor], src, tag).wait()

    # -- objects: pickled, sizes first (as torch's own object functions) --------

    def broadcast_object_list(self, box: list[Any], src: int, group: Any = None) -> None:
        size = torch.zeros(1, dtype=torch.int64)
        data = _pickled(box[0]) if self.rank == src else None
        if data is not None:
            size[0] = data.numel()
        self.broadcast(size, src)
        if data is None:
            data = torch.empty(int(size[0]), dtype=torch.uint8)
        self.broadcast(data, src)
        box[0] = _unpickled(data)

    def all_gather_object(self, out: list[Any], obj: Any, group: Any = None) -> None:
        data = _pickled(obj)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.all_gather(sizes, torch.tensor([data.numel()]))
        longest = max(int(s[0]) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        self.all_gather(parts, padded)
        out[:] = [_unpickled(part[: int(s[0])]) for part, s in zip(parts, sizes, strict=True)]

    def gather_object(self, obj: Any, out: list[Any] | None, dst: int, group: Any = None) -> None:
        every: list[Any] = [None] * self.size
        self.all_gather_object(every, obj)
        if out is not None:
            out[:] = every

    def scatter_object_list(
        self, out: list[Any], objs: list[Any] | None, src: int, group: Any = None
    ) -> None:
        box: list[Any] = [objs]
        self.broadcast_object_list(box, src)
        out[0] = box[0][self.rank]


def _pickled(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())


class _Aborted:
    """The calls of a collective whose group was aborted: each raises,
    saying to reconfigure it."""

    def __getattr__(self, name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise CollectiveConnectionError(
                f"{name}() on the 'torch' collective: its group was aborted (abort(), or a new "
                "configuration that failed to form); reconfigure() it with the next members first",
                operation=name,
            )

        return refuse


#: The calls of an aborted collective.
ABORTED = _Aborted()
