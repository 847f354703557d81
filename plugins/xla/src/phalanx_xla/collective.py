"""The ``xla`` collective: the Collective contract over ``torch_xla.core.xla_model``.

What maps to what:

=====================  =====================================================
contract               torch_xla
=====================  =====================================================
all_reduce, reduce     ``xm.all_reduce`` (``"mean"``: sum, then divided;
                       integers by floor division; bools as int32 min/max)
broadcast              the XLA pattern of ``xm.collective_broadcast``: every
                       rank but ``src`` gives zeros, then an all_reduce sum
scatter                the same pattern on ``src``'s stacked list; each rank
                       keeps its row
all_gather, gather     ``xm.all_gather`` along a new first dimension
reduce_scatter         ``xm.reduce_scatter`` along dimension 0
all_to_all             ``xm.all_to_all`` of the stacked list
barrier                ``xm.rendezvous``
object operations      rendezvous payloads: pickled bytes exchanged as
                       ``xm.rendezvous`` exchanges its payload
send, recv             refused: XLA has no point-to-point transfer between
                       replicas (every replica runs the same program)
=====================  =====================================================

**In place.** XLA returns new tensors; where the contract says "in place"
(``all_reduce``, ``broadcast``, ``reduce``, ``scatter``) the result is
copied into the tensor given (``tensor.copy_(result)``), which is returned.
CPU tensors are accepted too: they are moved to the replica's device, and
the result copied back.

**Completion.** XLA runs lazily; each operation here launches its graph
(``torch_xla.sync()``) and waits for its result, so that a timeout can be
told. With ``async_op=True`` the graph is launched and the handle's
``wait()`` waits. The wait is bounded by the collective's ``timeout``
(:class:`~phalanx_core.CollectiveTimeoutError` naming the operation); on
the CPU runtime XLA itself aborts the process when a collective waits 15 s
for a replica that never comes, so timeouts longer than that end as a
failed job instead.

**Groups.** Every XLA collective runs on every replica: a replica group
whose non-members do not take part never completes (XLA waits for all of
them). So :meth:`XLACollective.new_group` accepts the group of every rank
(in any order) and refuses any smaller group, with
:class:`~phalanx_core.UnavailableError`.

**Replicas as threads.** See :mod:`phalanx_xla._runtime`: where the
replicas are threads of one process (the CPU runtime), inputs are synced
before each operation, the operation is launched alone, under a lock, and
what the contract adds (the mean's division, dtype casts) runs after it.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from phalanx_core import (
    DEFAULT_TIMEOUT,
    Collective,
    CompletedWork,
    MisconfigurationError,
    UnavailableError,
    Work,
    check_one_per_rank,
    check_rank,
    check_reduce_op,
    check_scatter_list,
    timed_out,
)

from . import _runtime

if TYPE_CHECKING:
    from phalanx_core import Accelerator, ClusterEnvironment, Launcher

__all__ = ["XLACollective"]

_XM_OP = {"sum": "sum", "mean": "sum", "min": "min", "max": "max", "product": "mul"}


class XLACollective(Collective):
    """The contract between XLA replicas (see the module's docstring).
    Used inside replicas the ``xla`` launcher started; on the CPU runtime
    one object serves every replica of the process, each thread its own
    rank."""

    name: ClassVar[str] = "xla"
    #: None: XLA runs each collective on every replica of the program,
    #: fixed when its runtime starts.
    fault_tolerance: ClassVar[frozenset[str]] = frozenset()
    unsupported: ClassVar[frozenset[str]] = frozenset({"send", "recv"})
    subgroups: ClassVar[bool] = False  # new_group: every rank only (see new_group)

    def __init__(self, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        super().__init__(timeout=timeout)
        self._state: threading.local | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_state"] = None  # per thread; not picklable
        return state

    @property
    def _local(self) -> threading.local:
        if self._state is None:
            self._state = threading.local()
        return self._state

    # -- life cycle -----------------------------------------------------------

    def check_accelerator(self, accelerator: Accelerator) -> None:
        if accelerator.name != "xla":
            raise MisconfigurationError(
                f"collective 'xla' with accelerator {accelerator.name!r}: it talks between XLA replicas "
                "only; use strategy='xla' with accelerator='xla', or a collective for "
                f"{accelerator.name!r} (collective='torch')"
            )

    def check_launcher(self, launcher: Launcher, environment: ClusterEnvironment) -> None:
        """Replicas torch_xla started: the ``xla`` launcher's."""
        from .launcher import XLALauncher

        if not isinstance(launcher, XLALauncher):
            raise MisconfigurationError(
                f"collective 'xla' with launcher {type(launcher).__name__}: XLA replicas exist only where "
                "torch_xla starts them; use launcher='xla' (the default of strategies 'xla' and "
                "'xla_single')"
            )

    def setup(self, environment: ClusterEnvironment, accelerator: Accelerator | None = None) -> None:
        _runtime.require_replica("the 'xla' collective's setup")
        self._local.initialized = True

    def teardown(self) -> None:
        if self._state is not None:
            self._local.initialized = False

    @property
    def is_initialized(self) -> bool:
        return self._state is not None and bool(getattr(self._local, "initialized", False))

    @property
    def rank(self) -> int:
        _runtime.require_replica("the 'xla' collective's rank")
        import torch_xla.runtime as xr

        return int(xr.global_ordinal())

    @property
    def world_size(self) -> int:
        _runtime.require_replica("the 'xla' collective's world_size")
        import torch_xla.runtime as xr

        return int(xr.world_size())

    # -- the machinery ----------------------------------------------------------

    def _on_device(self, tensor: Any) -> Any:
        """``tensor`` on this replica's device, its pending graph launched,
        so that the operation's graph is the same on every replica."""
        device = _runtime.xla_device()
        moved = tensor if tensor.device == device else tensor.to(device)
        _runtime.sync()
        return moved

    def _launch(self, operation: str, result: Any, finish: Callable[[Any], Any], async_op: bool) -> Any:
        """Launch the graph that computes ``result``; return ``finish`` of
        the completed result (or a handle that gives it). Where replicas are
        threads the collective was launched already, alone, and what follows
        it runs when the result is read (syncing here would first wait,
        unbounded, for the collective)."""
        if not _runtime.replicas_are_threads():
            _runtime.sync()

        def complete() -> Any:
            self._wait(operation)
            out = finish(result)
            if _runtime.replicas_are_threads():
                # What follows the collective (a copy, a division, rows),
                # launched under the lock: replicas never compile at once
                # (torch_xla crashed, SIGSEGV, when two threads compiled to
                # read results), and the caller gets computed tensors.
                _runtime.sync()
            return out

        if async_op:
            return CompletedWork(finish=complete)
        return complete()

    def _wait(self, operation: str) -> None:
        """Block until this replica's device has run what was launched, at
        most ``timeout`` seconds. A helper thread waits on the device
        (``xm.wait_device_ops``: no compilation, no transfer), so that this
        one can give up."""
        import torch_xla.core.xla_model as xm

        devices = xm.xla_real_devices([_runtime.xla_device()])
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                xm.wait_device_ops(devices)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        waiter = threading.Thread(target=wait, name=f"phalanx-xla-{operation}", daemon=True)
        waiter.start()
        waiter.join(self.timeout)
        if waiter.is_alive():
            raise timed_out(
                "xla",
                operation,
                self.timeout,
                where=f"replica {self.rank} of {self.world_size}",
                then="raise the timeout with resolve(..., timeout=SECONDS) if the work is just slow",
            )
        if errors:
            raise errors[0]

    @staticmethod
    def _copy_into(tensor: Any) -> Callable[[Any], Any]:
        def finish(result: Any) -> Any:
            tensor.copy_(result.to(tensor.device) if result.device != tensor.device else result)
            return tensor

        return finish

    def _reduced(self, value: Any, op: str) -> Any:
        """The all_reduce of ``value`` with ``op``, with the contract's mean
        and bool semantics, in ``value``'s dtype, on the device (launched
        where replicas are threads; see :func:`_runtime.collective_issued`)."""
        import torch
        import torch_xla.core.xla_model as xm

        is_bool = value.dtype is torch.bool
        x = self._on_device(value.to(torch.int32) if is_bool else value)
        if self.world_size == 1:
            out = x.clone()
        else:
            out = xm.all_reduce(_XM_OP[op], x, pin_layout=_runtime.pin_layout())
            _runtime.collective_issued()
        if is_bool:
            return out.to(torch.bool)
        if op == "mean" and self.world_size > 1:
            n = self.world_size
            out = out / n if x.dtype.is_floating_point else torch.div(out, n, rounding_mode="floor")
        return out.to(value.dtype)

    def _check_op(self, tensor: Any, op: str) -> str:
        import torch

        return check_reduce_op(op, self.reduce_ops, collective=self.name, is_bool=tensor.dtype is torch.bool)

    # -- tensor operations --------------------------------------------------------

    def barrier(self, *, async_op: bool = False) -> Work | None:
        self._rendezvous(b"", "barrier")
        return CompletedWork() if async_op else None

    def all_reduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        name = self._check_op(tensor, op)
        return self._launch("all_reduce", self._reduced(tensor, name), self._copy_into(tensor), async_op)

    def reduce(self, tensor: Any, dst: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        check_rank(dst, self.world_size, operation="reduce", argument="dst")
        name = self._check_op(tensor, op)
        return self._launch("reduce", self._reduced(tensor, name), self._copy_into(tensor), async_op)

    def broadcast(self, tensor: Any, src: int = 0, *, async_op: bool = False) -> Any:
        check_rank(src, self.world_size, operation="broadcast", argument="src")
        return self._launch("broadcast", self._from(src, tensor), self._copy_into(tensor), async_op)

    def _from(self, src: int, value: Any) -> Any:
        """``src``'s ``value`` on every rank: the others give zeros (made
        before the inputs are synced, so that the sum's graph is the same on
        every replica), then a sum."""
        import torch

        return self._reduced(value if self.rank == src else torch.zeros_like(value), "sum")

    def all_gather(self, tensor: Any, *, async_op: bool = False) -> Any:
        return self._launch("all_gather", self._gathered(tensor), self._rows(tensor.device), async_op)

    def _gathered(self, tensor: Any) -> Any:
        import torch_xla.core.xla_model as xm

        x = self._on_device(tensor.unsqueeze(0))
        if self.world_size == 1:
            return x.clone()
        out = xm.all_gather(x, dim=0, pin_layout=_runtime.pin_layout())
        _runtime.collective_issued()
        return out

    @staticmethod
    def _rows(device: Any) -> Callable[[Any], list[Any]]:
        def finish(result: Any) -> list[Any]:
            result = result.to(device) if result.device != device else result
            return [row.clone() for row in result.unbind(0)]

        return finish

    def gather(self, tensor: Any, dst: int = 0, *, async_op: bool = False) -> Any:
        check_rank(dst, self.world_size, operation="gather", argument="dst")
        rows = self._rows(tensor.device)
        mine = self.rank == dst
        return self._launch("gather", self._gathered(tensor), lambda r: rows(r) if mine else [], async_op)

    def scatter(
        self,
        tensor: Any,
        scatter_list: Sequence[Any] | None = None,
        src: int = 0,
        *,
        async_op: bool = False,
    ) -> Any:
        import torch

        n = self.world_size
        check_rank(src, n, operation="scatter", argument="src")
        if self.rank == src:
            chunks = check_scatter_list(scatter_list, tensor, n, src=src)
            stacked = torch.stack([t.to(tensor.device) for t in chunks])
        else:
            stacked = torch.zeros((n, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        into = self._copy_into(tensor)
        rank = self.rank  # selected after the collective: no rank in its graph
        return self._launch("scatter", self._from(src, stacked), lambda rows: into(rows[rank]), async_op)

    def reduce_scatter(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        import torch
        import torch_xla.core.xla_model as xm

        name = self._check_op(tensor, op)
        n = self.world_size
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise MisconfigurationError(
                f"reduce_scatter(): dimension 0 of the tensor ({tuple(tensor.shape)}) must be divisible "
                f"by the group's size ({n}); pad it to a multiple of {n}"
            )
        x = self._on_device(tensor)
        if n == 1:
            out = x.clone()
        elif x.dtype is torch.bool:
            raise MisconfigurationError(
                "reduce_scatter() of a bool tensor: convert it to an integer dtype first"
            )
        else:
            out = xm.reduce_scatter(
                _XM_OP[name], x, scale=1.0, scatter_dim=0, shard_count=n, pin_layout=_runtime.pin_layout()
            )
            _runtime.collective_issued()
            if name == "mean":
                out = out / n if x.dtype.is_floating_point else torch.div(out, n, rounding_mode="floor")
            out = out.to(x.dtype)
        device = tensor.device
        return self._launch(
            "reduce_scatter", out, lambda r: r.to(device) if r.device != device else r, async_op
        )

    def all_to_all(self, tensors: Sequence[Any], *, async_op: bool = False) -> Any:
        import torch
        import torch_xla.core.xla_model as xm

        n = self.world_size
        check_one_per_rank(tensors, n, operation="all_to_all")
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise MisconfigurationError(
                f"all_to_all() on the 'xla' collective needs tensors of one shape (XLA splits one "
                f"tensor), got shapes {sorted(shapes)}; pad them to one shape"
            )
        device = tensors[0].device
        stacked = self._on_device(torch.stack(list(tensors)))
        if n == 1:
            out = stacked.clone()
        else:
            out = xm.all_to_all(
                stacked,
                split_dimension=0,
                concat_dimension=0,
                split_count=n,
                pin_layout=_runtime.pin_layout(),
            )
            _runtime.collective_issued()
        return self._launch("all_to_all", out, self._rows(device), async_op)

    # send and recv: unsupported (see the module's docstring). Spelled out,
    # as core's NonMember does, so that type checkers see them implemented;
    # they refuse whatever they are given, as the base's refusals do.

    def send(self, *args: Any, **kwargs: Any) -> None:
        """Not available: XLA has no point-to-point transfer between replicas
        (raises :class:`~phalanx_core.UnavailableError`)."""
        raise self._refusal("send")

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        """Not available: XLA has no point-to-point transfer between replicas
        (raises :class:`~phalanx_core.UnavailableError`)."""
        raise self._refusal("recv")

    # -- object operations -----------------------------------------------------------

    def _rendezvous(self, payload: bytes, operation: str) -> list[bytes]:
        """Every replica's ``payload``, by rank. Where the replicas are
        separate processes, ``xm.rendezvous``; where they are threads of
        this process, the same exchange (sizes all-gathered, payloads padded
        and all-gathered), through this collective's guarded operations:
        ``xm.rendezvous`` syncs without the lock (see :mod:`._runtime`)."""
        import torch

        if self.world_size == 1:
            return [payload]
        if not _runtime.replicas_are_threads():
            import torch_xla.core.xla_model as xm

            return list(xm.rendezvous(f"phalanx-{operation}", payload))
        # On the CPU (whatever device a `with torch.device(...)` block
        # names): the rows come back there, read without compiling a graph.
        size = torch.tensor([len(payload)], dtype=torch.int64, device="cpu")
        sizes = [int(s.item()) for s in self.all_gather(size)]
        longest = max(sizes)
        if longest == 0:
            return [b"" for _ in sizes]
        data = torch.zeros(longest, dtype=torch.uint8, device="cpu")
        if payload:
            data[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        rows = self.all_gather(data)
        return [bytes(row[:s].tolist()) for row, s in zip(rows, sizes, strict=True)]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        check_rank(src, self.world_size, operation="broadcast_object", argument="src")
        mine = pickle.dumps(obj) if self.rank == src else b""
        return pickle.loads(self._rendezvous(mine, "broadcast_object")[src])

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [pickle.loads(p) for p in self._rendezvous(pickle.dumps(obj), "all_gather_object")]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        check_rank(dst, self.world_size, operation="gather_object", argument="dst")
        payloads = self._rendezvous(pickle.dumps(obj), "gather_object")
        return [pickle.loads(p) for p in payloads] if self.rank == dst else []

    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        n = self.world_size
        check_rank(src, n, operation="scatter_object", argument="src")
        mine = b""
        if self.rank == src:
            if objs is None or len(objs) != n:
                raise MisconfigurationError(
                    f"scatter_object(src={src}): the source rank gives one object per rank ({n} here), "
                    f"got {None if objs is None else len(objs)}"
                )
            mine = pickle.dumps(list(objs))
        return pickle.loads(self._rendezvous(mine, "scatter_object")[src])[self.rank]

    # -- groups ----------------------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> Collective:
        n = self.world_size
        given = list(ranks)
        if not given:
            raise MisconfigurationError("new_group([]): a group needs at least one rank")
        for r in given:
            check_rank(r, n, operation="new_group", argument="ranks")
        if len(set(given)) != len(given):
            raise MisconfigurationError(f"new_group({given!r}) names a rank more than once")
        if sorted(given) != list(range(n)):
            raise UnavailableError(
                f"new_group({given!r}) on the 'xla' collective: every XLA collective runs on all "
                f"{n} replicas (a replica group whose other replicas do not take part never completes), "
                f"so the only group is every rank, {list(range(n))}. Call the operation on the whole "
                "world, and ignore the result on the ranks outside your group"
            )
        group = XLACollective(timeout=self.timeout)
        group._local.initialized = True
        return group
