"""The ``horovod`` strategy: data parallel with ``hvd.DistributedOptimizer``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ClassVar

from phalanx_core import MisconfigurationError, Strategy, UnavailableError

from ._hvd import hvd
from ._reduce import reducing_optimizer
from .collective import HorovodCollective

__all__ = ["HorovodStrategy"]

_OPS = ("mean", "sum", "adasum")
_COMPRESSIONS = ("none", "fp16")


class _WireFloat32:
    """A Horovod compressor for the gradients Horovod cannot reduce on the
    CPU: bfloat16 ones travel as float32 and come back as bfloat16 (float16
    and float32 ones travel as they are, or as float16 with
    ``compression='fp16'``)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        import torch

        if tensor.dtype is torch.bfloat16:
            return tensor.to(torch.float32), torch.bfloat16
        compressed: tuple[Any, Any] = self._inner.compress(tensor)
        return compressed

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        import torch

        if ctx is torch.bfloat16:
            return tensor.to(torch.bfloat16)
        return self._inner.decompress(tensor, ctx)


class HorovodStrategy(Strategy):
    """Data parallel over Horovod: one process per device, every rank holding
    the whole module.

    - :meth:`setup` broadcasts the module's parameters and buffers from rank
      0 (through the collective), and each optimizer's state from rank 0;
      each optimizer is wrapped in ``hvd.DistributedOptimizer``, which
      all-reduces each gradient as backward produces it and waits for them
      all in ``step()``.
    - Gradient accumulation: with ``backward_passes_per_step=N`` Horovod
      keeps the gradients of N - 1 backward passes local and reduces them
      with the N-th. :meth:`no_backward_sync` marks those passes; Horovod
      cannot skip the reduction of a single backward pass on demand, so
      with ``N = 1`` it refuses to pretend.
    - :meth:`clip_gradients` waits for the reduced gradients first
      (``optimizer.synchronize()``), and the step then does not reduce again.
    - Checkpoints: rank 0 writes, every rank reads (the module is not
      wrapped, so its keys are the plain module's).
    - Precision: any precision plugin; bfloat16 gradients (``bf16-true``)
      are reduced as float32, which is what Horovod can add on the CPU.

    Options (keywords of :func:`phalanx.resolve`):
        backward_passes_per_step: backward passes per reduction (1).
        op: how gradients combine: ``"mean"`` (Horovod's Average, the
            default), ``"sum"``, or ``"adasum"``.
        compression: ``"none"`` or ``"fp16"`` (float32 gradients travel as
            float16: Horovod's ``Compression.fp16``).
        gradient_predivide_factor: divide gradients by this before the sum
            and by ``size / factor`` after (``op="mean"`` only).
        sparse_as_dense: reduce sparse gradients as dense tensors.

    The collective carries the gradients. With ``horovod`` (the default)
    the optimizers are wrapped in ``hvd.DistributedOptimizer``, which talks
    to Horovod itself (tensor fusion, Adasum). With any other collective
    (``collective="torch"``, ``"mpi"``, a third party's) they are wrapped in
    phalanx's own version of it, with the same options and behaviour
    (except ``op="adasum"``, Horovod's alone): gradients are reduced in
    buckets of 25 MiB through that collective's ``all_reduce`` as backward
    produces them, in the same order on every rank.
    """

    name: ClassVar[str] = "horovod"
    traffic: ClassVar[frozenset[str]] = frozenset({"broadcast", "all_reduce"})

    def __init__(
        self,
        *,
        backward_passes_per_step: int = 1,
        op: str = "mean",
        compression: str = "none",
        gradient_predivide_factor: float = 1.0,
        sparse_as_dense: bool = False,
        **parts: Any,
    ) -> None:
        super().__init__(**parts)
        self._native = isinstance(self.collective, HorovodCollective)
        if (
            isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step < 1
        ):
            raise MisconfigurationError(
                f"strategy 'horovod': backward_passes_per_step={backward_passes_per_step!r}; give the "
                "number of backward passes per gradient reduction, an int of at least 1"
            )
        if op not in _OPS:
            raise MisconfigurationError(
                f"strategy 'horovod': op={op!r} is not a gradient reduction; use one of "
                f"{', '.join(map(repr, _OPS))}"
            )
        if compression not in _COMPRESSIONS:
            raise MisconfigurationError(
                f"strategy 'horovod': compression={compression!r}; use one of "
                f"{', '.join(map(repr, _COMPRESSIONS))}"
            )
        if not isinstance(gradient_predivide_factor, (int, float)) or gradient_predivide_factor <= 0:
            raise MisconfigurationError(
                f"strategy 'horovod': gradient_predivide_factor={gradient_predivide_factor!r}; give a "
                "positive number"
            )
        if op == "adasum" and not self._native:
            raise MisconfigurationError(
                f"strategy 'horovod' with op='adasum' and collective "
                f"{getattr(self.collective, 'name', '?')!r}: Adasum is Horovod's own reduction, which "
                "only the 'horovod' collective runs; use collective='horovod', or op='mean' or 'sum'"
            )
        if op == "adasum" and not hvd().mpi_built():
            raise UnavailableError(
                "strategy 'horovod' with op='adasum': Horovod runs Adasum over MPI only, and this horovod "
                "was built without MPI; build it with HOROVOD_WITH_MPI=1 (and start the job with "
                "horovodrun --mpi), or use op='mean'"
            )
        if gradient_predivide_factor != 1.0 and op != "mean":
            raise MisconfigurationError(
                f"strategy 'horovod': gradient_predivide_factor={gradient_predivide_factor!r} with "
                f"op={op!r}; Horovod splits only an average this way: use op='mean'"
            )
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.compression = compression
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = bool(sparse_as_dense)
        self._named_parameters: list[tuple[str, Any]] = []
        self._synchronized: set[int] = set()

    # -- setup ---------------------------------------------------------------

    def setup_module(self, module: Any) -> Any:
        """Broadcast the parameters and buffers from rank 0, in place."""
        self._named_parameters = list(module.named_parameters())
        if self.world_size > 1:
            works = [
                self.collective.broadcast(t.data, 0, async_op=True) for t in module.state_dict().values()
            ]
            for work in works:
                work.wait()
        return module

    def setup_optimizer(self, optimizer: Any) -> Any:
        """Wrap ``optimizer`` in ``hvd.DistributedOptimizer`` (or, with
        another collective, phalanx's version of it) with its state from
        rank 0."""
        state = optimizer.state_dict()
        if self.world_size > 1:
            state = self.collective.broadcast_object(state if self.is_global_zero else None, 0)
        ours = {id(p) for _, p in self._named_parameters}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        named = [(n, p) for n, p in self._named_parameters if id(p) in {id(q) for q in params}]
        if not set(map(id, params)) <= ours:
            raise MisconfigurationError(
                "strategy 'horovod': an optimizer holds parameters that are not the module's; pass "
                "optimizers of the module given to setup() (or factories: functools.partial(SGD, lr=...))"
            )
        if not self._native:
            optimizer.load_state_dict(state)
            return reducing_optimizer(
                optimizer,
                self.collective,
                backward_passes_per_step=self.backward_passes_per_step,
                op=self.op,
                compression=self.compression,
                gradient_predivide_factor=self.gradient_predivide_factor,
                sparse_as_dense=self.sparse_as_dense,
            )
        h = hvd()
        inner = h.Compression.fp16 if self.compression == "fp16" else h.Compression.none
        op = {"mean": h.Average, "sum": h.Sum, "adasum": h.Adasum}[self.op]
        wrapped = h.DistributedOptimizer(
            optimizer,
            named_parameters=named,
            compression=_WireFloat32(inner),
            backward_passes_per_step=self.backward_passes_per_step,
            op=op,
            gradient_predivide_factor=self.gradient_predivide_factor,
            sparse_as_dense=self.sparse_as_dense,
        )
        # DistributedOptimizer makes a new optimizer over the same parameter
        # groups: give it the state (rank 0's) the one given had.
        wrapped.load_state_dict(state)
        return wrapped

    # -- training ------------------------------------------------------------

    def no_backward_sync(self, module: Any, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """Backward passes whose gradients stay local. Horovod decides by
        count: with ``backward_passes_per_step=N`` it reduces on every N-th
        pass, so inside this context run the N - 1 passes before a
        synchronised one. With ``N = 1`` every pass is reduced, and this
        refuses rather than reduce silently."""
        if enabled and self.world_size > 1 and self.backward_passes_per_step == 1:
            raise MisconfigurationError(
                "no_backward_sync() on strategy 'horovod' with backward_passes_per_step=1: Horovod reduces "
                "the gradients of every backward pass and cannot skip one on demand; pass "
                "backward_passes_per_step=N to resolve('horovod', ...) to accumulate N passes (N - 1 of "
                "them inside no_backward_sync), or use strategy 'ddp'"
            )
        return contextlib.nullcontext()

    def clip_gradients(
        self,
        module: Any,
        optimizer: Any,
        *,
        max_norm: float | None = None,
        clip_val: float | None = None,
        norm_type: float = 2.0,
    ) -> Any:
        """Clip the reduced gradients: wait for Horovod's reduction first."""
        if hasattr(optimizer, "synchronize") and id(optimizer) not in self._synchronized:
            optimizer.synchronize()
            self._synchronized.add(id(optimizer))
        return super().clip_gradients(
            module, optimizer, max_norm=max_norm, clip_val=clip_val, norm_type=norm_type
        )

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for the reduced gradients, then step through the precision
        (a grad scaler unscales reduced gradients)."""
        if not hasattr(optimizer, "skip_synchronize"):
            raise MisconfigurationError(
                f"strategy 'horovod': optimizer_step() got a {type(optimizer).__name__}, not the optimizer "
                "setup() returned; step the optimizers strategy.setup(module, optimizer) gives back"
            )
        if id(optimizer) not in self._synchronized:
            optimizer.synchronize()
        self._synchronized.discard(id(optimizer))
        with optimizer.skip_synchronize():
            return self.precision.optimizer_step(optimizer, closure)
