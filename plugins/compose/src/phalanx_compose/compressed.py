"""The ``compressed`` collective: another collective, with float32 carried
in half the bytes.

``resolve("ddp", collective="compressed", inner="mpi", dtype="bf16")``: the
reductions and gathers (``all_reduce``, ``reduce``, ``reduce_scatter``,
``all_gather``, ``gather`` and their ``_into`` forms) send a float32 tensor
as bf16 (or fp16) through the inner collective and give it back in float32;
every other dtype, every other operation (``broadcast``, ``scatter``,
``all_to_all``, ``send``/``recv``: they copy values, which must arrive
exact) and the object operations go to the inner collective as they are.
Through phalanx's process group for torch, DDP's gradient buckets and
FSDP's all-gathers and reduce-scatters take this path too.

With ``dtype="int8"`` an ``all_reduce`` of a sum or mean carries a
quarter of float32's bytes: each rank's tensor is quantized to int8 with
a float32 scale for every :data:`INT8_BLOCK` values (the block's largest
magnitude over 127), its ``world_size`` parts go to their ranks
(``all_to_all``), each rank sums its part in float32, quantizes the sum
and the parts are gathered (``all_gather``): two roundings, each within
half a step of its block's scale, and every rank ends with the same
values. It runs to its end before the call returns (``async_op`` gives a
finished handle). The other reductions and gathers carry bf16, and
``all_reduce`` of ``max``, ``min`` or ``product`` too.

**Error feedback** (``error_feedback=True``): for ``all_reduce`` with
``sum`` or ``mean``, what rounding to the wire's dtype lost is kept per
tensor (by its storage, as DDP reuses its bucket tensors each step) and
added to that tensor the next time, so the rounding errors do not
accumulate over the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from phalanx_core import (
    DEFAULT_TIMEOUT,
    Collective,
    Membership,
    MisconfigurationError,
    NonMember,
    Work,
    check_into,
    check_rank,
    check_reduce_op,
)

from ._parts import make_collective

if TYPE_CHECKING:
    import torch

    from phalanx_core import Accelerator, ClusterEnvironment, Launcher
    from phalanx_core.hangs import Board

__all__ = ["CompressedCollective"]

#: The wire dtypes, by the names ``dtype=`` takes.
_WIRE = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "16": "float16",
    "int8": "int8",
}
#: Values that share one float32 scale under ``dtype="int8"``.
INT8_BLOCK = 256


class CompressedCollective(Collective):
    """``inner`` with float32 carried as ``dtype`` in its reductions and
    gathers (see the module's docstring).

    Options:
        inner: the collective that carries the bytes, by name (``"torch"``:
            gloo or nccl by the accelerator, ``"mpi"``, a third party's),
            or a ready instance.
        inner_options: keyword arguments for the inner collective
            (``{"backend": "gloo"}``); its timeout is this one's.
        dtype: ``"bf16"`` (the default: float32's range, 8 bits of
            mantissa), ``"fp16"`` (more mantissa, a range that gradients
            can overflow) or ``"int8"`` (an all_reduce of a sum or mean in
            int8 with a scale per block; the rest in bf16).
        error_feedback: keep what rounding lost in an ``all_reduce`` of a
            sum or mean, per tensor, and add it next time.
    """

    name = "compressed"

    def __init__(
        self,
        *,
        inner: str | Collective = "torch",
        inner_options: Mapping[str, Any] | None = None,
        dtype: str = "bf16",
        error_feedback: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(timeout=timeout)
        if dtype not in _WIRE:
            raise MisconfigurationError(
                f"collective 'compressed': dtype={dtype!r}; give 'bf16' (float32's range, less "
                "precision), 'fp16' (more precision, a range gradients can overflow) or 'int8' (a "
                "quarter of the bytes in an all_reduce of a sum or mean, a scale per block of values)"
            )
        if not isinstance(error_feedback, bool):
            raise MisconfigurationError(
                f"collective 'compressed': error_feedback={error_feedback!r}; expected True or False"
            )
        if inner_options is not None and not isinstance(inner_options, Mapping):
            raise MisconfigurationError(
                f"collective 'compressed': inner_options={inner_options!r}; expected a dict of the "
                "inner collective's options"
            )
        if inner == "compressed":
            raise MisconfigurationError(
                "collective 'compressed': inner='compressed' would compress twice; name the collective "
                "that carries the bytes (e.g. 'torch', 'mpi')"
            )
        self.inner = make_collective(
            "inner", inner, {"timeout": timeout, **(inner_options or {})}, owner="compressed"
        )
        self.dtype = dtype
        self.error_feedback = error_feedback
        # What the inner collective can do, this one can.
        self.unsupported = self.inner.unsupported  # type: ignore[misc]
        self.reduce_ops = self.inner.reduce_ops  # type: ignore[misc]
        self.subgroups = self.inner.subgroups  # type: ignore[misc]
        self.fault_tolerance = self.inner.fault_tolerance  # type: ignore[misc]
        self._residuals: dict[tuple[int, int, str], torch.Tensor] = {}
        self._buffers_: Any = None

    # -- life cycle ----------------------------------------------------------

    def check_accelerator(self, accelerator: Accelerator) -> None:
        self.inner.check_accelerator(accelerator)

    def check_launcher(self, launcher: Launcher, environment: ClusterEnvironment) -> None:
        self.inner.check_launcher(launcher, environment)

    def setup(self, environment: ClusterEnvironment, accelerator: Accelerator | None = None) -> None:
        self.inner.plan_facts = self.plan_facts
        self.inner.arrival_report = self.arrival_report
        self.inner.setup(environment, accelerator)
        self.plan_checked = self.inner.plan_checked

    def reconfigure(self, membership: Membership) -> None:
        """The inner collective's (its residuals are this rank's own, and
        stay with it: what rounding lost is added to the next all_reduce
        whatever its members)."""
        self.inner.reconfigure(membership)

    def abort(self) -> None:
        self.inner.abort()

    def shrink(self, ranks: Sequence[int]) -> None:
        self.inner.shrink(ranks)

    def teardown(self) -> None:
        self._residuals.clear()
        if self._buffers_ is not None:
            self._buffers_.clear()
        self.inner.teardown()

    @property
    def is_initialized(self) -> bool:
        return self.inner.is_initialized

    @property
    def rank(self) -> int:
        return self.inner.rank

    @property
    def world_size(self) -> int:
        return self.inner.world_size

    @property
    def global_ranks(self) -> tuple[int, ...]:
        return self.inner.global_ranks

    @property
    def is_member(self) -> bool:
        return self.inner.is_member

    def board(self) -> Board | None:
        return self.inner.board()

    def new_group(self, ranks: Sequence[int]) -> Collective:
        group = self.inner.new_group(ranks)
        if isinstance(group, NonMember):
            return group
        return CompressedCollective(
            inner=group, dtype=self.dtype, error_feedback=self.error_feedback, timeout=self.timeout
        )

    @property
    def _buffers(self) -> Any:
        """The reused wire buffers (made on first use: it imports torch)."""
        if self._buffers_ is None:
            from ._works import Buffers

            self._buffers_ = Buffers()
        return self._buffers_

    # -- the wire ------------------------------------------------------------

    def _compresses(self, tensor: Any) -> bool:
        import torch

        return isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32

    def _wire_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "int8":  # what is not an all_reduce of a sum or mean
            return torch.bfloat16
        return getattr(torch, _WIRE[self.dtype])  # type: ignore[no-any-return]

    def _buffer(self, like: torch.Tensor, numel: int | None = None) -> torch.Tensor:
        """A wire buffer of ``numel`` elements (``like``'s by default),
        shaped as ``like`` where it has its size, from the reused ones."""
        n = like.numel() if numel is None else numel
        buffer: torch.Tensor = self._buffers.take(n, self._wire_dtype(), like.device)
        return buffer.view(like.shape) if n == like.numel() else buffer

    def _to_wire(self, tensor: torch.Tensor, *, feedback: bool = False) -> torch.Tensor:
        """``tensor`` converted into a reused wire buffer; with
        ``feedback``, plus what rounding it lost last time (added to
        ``tensor`` itself, which the all_reduce overwrites), and what it
        loses now kept."""
        import torch

        wire = self._buffer(tensor)
        if not feedback:
            return wire.copy_(tensor)
        key = (tensor.untyped_storage().data_ptr(), tensor.numel(), str(tensor.device))
        residual = self._residuals.get(key)
        if residual is None:
            residual = self._residuals[key] = torch.zeros_like(tensor)
        else:
            tensor.add_(residual)
        wire.copy_(tensor)
        torch.sub(tensor, wire, out=residual)  # one pass: fp32 minus the rounded value
        return wire

    def _finish(
        self,
        work: Any,
        async_op: bool,
        finish: Callable[[Any], Any],
        buffers: Sequence[torch.Tensor],
        torch_value: Callable[[Any], Any] | None = None,
    ) -> Any:
        """``finish`` after the inner operation, then ``buffers`` given
        back: now, or, for ``async_op``, in the thread that completes the
        inner handle (gloo's worker, through its c10d future) where it
        notifies, else when the handle is waited on. ``torch_value``: the
        result as torch's backends give it (``[tensor]``), which lets
        phalanx's process group hand DDP and FSDP this handle's own c10d
        future (``backend_work``)."""

        def done(result: Any) -> Any:
            try:
                return finish(result)
            finally:
                self._buffers.give(*buffers)

        if async_op:
            from ._works import ChainedWork

            assert isinstance(work, Work)
            return ChainedWork(work, done, torch_value)
        return done(work)

    # -- reductions ------------------------------------------------------------

    def all_reduce(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        if not self._compresses(tensor):
            return self.inner.all_reduce(tensor, op, async_op=async_op)
        op = check_reduce_op(op, self.reduce_ops, collective=self.name, is_bool=False)
        if self.dtype == "int8" and op in ("sum", "mean"):
            self._int8_all_reduce(tensor, op)
            if not async_op:
                return tensor
            from ._works import FutureWork

            done = FutureWork(notifies=True, torch_value=_listed)
            done.complete(tensor)
            return done
        wire = self._to_wire(tensor, feedback=self.error_feedback and op in ("sum", "mean"))
        work = self.inner.all_reduce(wire, op, async_op=async_op)
        return self._finish(work, async_op, lambda _: tensor.copy_(wire), [wire], _listed)

    def _int8_all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        """``tensor`` summed (or averaged) over the ranks in int8: its parts
        quantized and sent to their ranks, each part summed in float32 by
        its rank and quantized again, and the sums gathered (the module's
        docstring). With ``error_feedback``, what the first rounding lost
        is kept for this tensor's next all_reduce."""
        import torch

        n = self.world_size
        flat = tensor.detach().reshape(-1).clone()
        if self.error_feedback:
            key = (tensor.untyped_storage().data_ptr(), tensor.numel(), str(tensor.device))
            residual = self._residuals.get(key)
            if residual is not None:
                flat.add_(residual)
        part = -(-flat.numel() // n)  # the values of each rank's part (the last one padded)
        padded = torch.zeros(part * n, dtype=torch.float32, device=flat.device)
        padded[: flat.numel()] = flat
        parts = padded.view(n, part)
        sent = [_quantize(parts[rank]) for rank in range(n)]
        if self.error_feedback:
            rounded = torch.cat([_dequantize(payload, part) for payload in sent])[: flat.numel()]
            self._residuals[key] = flat - rounded
        received: list[torch.Tensor] = self.inner.all_to_all(sent)  # type: ignore[assignment]
        total = torch.zeros(part, dtype=torch.float32, device=flat.device)
        for payload in received:
            total.add_(_dequantize(payload, part))
        if op == "mean":
            total.div_(n)
        gathered: list[torch.Tensor] = self.inner.all_gather(_quantize(total))  # type: ignore[assignment]
        whole = torch.cat([_dequantize(payload, part) for payload in gathered])[: flat.numel()]
        with torch.no_grad():
            tensor.copy_(whole.view(tensor.shape))

    def reduce(self, tensor: Any, dst: int = 0, op: str = "sum", *, async_op: bool = False) -> Any:
        if not self._compresses(tensor):
            return self.inner.reduce(tensor, dst, op, async_op=async_op)
        check_reduce_op(op, self.reduce_ops, collective=self.name, is_bool=False)
        check_rank(dst, self.world_size, operation="reduce", argument="dst")
        wire = self._to_wire(tensor)
        work = self.inner.reduce(wire, dst, op, async_op=async_op)
        # Only dst's tensor holds the result; elsewhere it is scratch.
        mine = self.rank == dst
        return self._finish(work, async_op, lambda _: tensor.copy_(wire) if mine else tensor, [wire], _listed)

    def reduce_scatter(self, tensor: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        if not self._compresses(tensor):
            return self.inner.reduce_scatter(tensor, op, async_op=async_op)
        wire = self._to_wire(tensor)
        work = self.inner.reduce_scatter(wire, op, async_op=async_op)
        return self._finish(work, async_op, lambda part: part.to(tensor.dtype), [wire])

    def reduce_scatter_into(
        self, output: Any, tensor: Any, op: str = "sum", *, async_op: bool = False
    ) -> Any:
        if not (self._compresses(tensor) and self._compresses(output)):
            return self.inner.reduce_scatter_into(output, tensor, op, async_op=async_op)
        check_into(output, tensor, self.world_size, operation="reduce_scatter_into")
        wire_out = self._buffer(output)  # written, never read: no conversion in
        wire = self._to_wire(tensor)
        work = self.inner.reduce_scatter_into(wire_out, wire, op, async_op=async_op)
        return self._finish(work, async_op, lambda _: output.copy_(wire_out), [wire_out, wire], _listed)

    # -- gathers ---------------------------------------------------------------

    def all_gather(self, tensor: Any, *, async_op: bool = False) -> Any:
        if not self._compresses(tensor):
            return self.inner.all_gather(tensor, async_op=async_op)
        wire = self._to_wire(tensor)
        work = self.inner.all_gather(wire, async_op=async_op)
        return self._finish(work, async_op, lambda parts: [p.to(tensor.dtype) for p in parts], [wire])

    def all_gather_into(self, output: Any, tensor: Any, *, async_op: bool = False) -> Any:
        if not (self._compresses(tensor) and self._compresses(output)):
            return self.inner.all_gather_into(output, tensor, async_op=async_op)
        check_into(output, tensor, self.world_size, operation="all_gather_into")
        wire_out = self._buffer(output)  # written, never read: no conversion in
        wire = self._to_wire(tensor)
        work = self.inner.all_gather_into(wire_out, wire, async_op=async_op)
        return self._finish(work, async_op, lambda _: output.copy_(wire_out), [wire_out, wire], _listed)

    def gather(self, tensor: Any, dst: int = 0, *, async_op: bool = False) -> Any:
        if not self._compresses(tensor):
            return self.inner.gather(tensor, dst, async_op=async_op)
        wire = self._to_wire(tensor)
        work = self.inner.gather(wire, dst, async_op=async_op)
        return self._finish(work, async_op, lambda parts: [p.to(tensor.dtype) for p in parts], [wire])

    # -- the rest, as the inner collective does it -----------------------------------

    def barrier(self, *, async_op: bool = False) -> Work | None:
        return self.inner.barrier(async_op=async_op)

    def broadcast(self, tensor: Any, src: int = 0, *, async_op: bool = False) -> Any:
        return self.inner.broadcast(tensor, src, async_op=async_op)

    def scatter(
        self, tensor: Any, scatter_list: Sequence[Any] | None = None, src: int = 0, *, async_op: bool = False
    ) -> Any:
        return self.inner.scatter(tensor, scatter_list, src, async_op=async_op)

    def all_to_all(self, tensors: Sequence[Any], *, async_op: bool = False) -> Any:
        return self.inner.all_to_all(tensors, async_op=async_op)

    def send(self, tensor: Any, dst: int, *, tag: int = 0) -> None:
        self.inner.send(tensor, dst, tag=tag)

    def recv(self, tensor: Any, src: int, *, tag: int = 0) -> Any:
        return self.inner.recv(tensor, src, tag=tag)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.inner.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.inner.all_gather_object(obj)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any]:
        return self.inner.gather_object(obj, dst)

    def scatter_object(self, objs: Sequence[Any] | None, src: int = 0) -> Any:
        return self.inner.scatter_object(objs, src)


def _quantize(values: torch.Tensor) -> torch.Tensor:
    """``values`` (float32, one dimension) as bytes: int8 values, each
    block of :data:`INT8_BLOCK` scaled by its largest magnitude over 127,
    then the blocks' float32 scales."""
    import torch

    blocks = -(-values.numel() // INT8_BLOCK)
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32, device=values.device)
    padded[: values.numel()] = values
    grid = padded.view(blocks, INT8_BLOCK)
    scales = grid.abs().amax(dim=1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    quantized = torch.round(grid / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return torch.cat([quantized.view(-1)[: values.numel()].view(torch.uint8), scales.view(torch.uint8)])


def _dequantize(payload: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` float32 values of a :func:`_quantize` payload."""
    import torch

    blocks = -(-count // INT8_BLOCK)
    quantized = payload[:count].view(torch.int8).to(torch.float32)
    scales = payload[count : count + 4 * blocks].clone().view(torch.float32)
    padded = torch.zeros(blocks * INT8_BLOCK, dtype=torch.float32, device=payload.device)
    padded[:count] = quantized
    return (padded.view(blocks, INT8_BLOCK) * scales[:, None]).view(-1)[:count]


def _listed(result: Any) -> list[Any]:
    """An in-place operation's result as torch's backends give it."""
    return [result]
