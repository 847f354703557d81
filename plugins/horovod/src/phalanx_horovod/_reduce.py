"""Horovod's ``DistributedOptimizer``, over any phalanx collective: what the
``horovod`` strategy wraps optimizers in when its collective is not
Horovod's own, so that the gradients go through the collective the user
named.

It keeps Horovod's semantics: every gradient is reduced as backward produces
it (here, in buckets), ``backward_passes_per_step=N`` reduces a parameter's
gradient on its N-th accumulation and keeps the others local, ``op`` is
``"mean"`` or ``"sum"``, ``compression="fp16"`` sends float32 gradients as
float16, ``gradient_predivide_factor`` splits the average around the sum,
``sparse_as_dense`` reduces sparse gradients as dense ones; ``step()``
waits for the reductions (``synchronize()``) unless inside
``skip_synchronize()``.

Order: every rank must start the same reductions in the same order, while
backward hooks fire in whatever order autograd runs them. Parameters are
kept in a fixed order (the reverse of the module's, roughly the order
backward reaches them) and grouped into buckets; a bucket is started when
all of its parameters are ready *and* every bucket before it has started,
as DDP's reducer does, and ``synchronize()`` starts the rest in order.
Imports torch when a wrapper is made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from phalanx_core import MisconfigurationError

__all__ = ["BUCKET_BYTES", "reducing_optimizer"]

#: Bytes of gradients per bucket (one all_reduce each): DDP's default size.
BUCKET_BYTES = 25 * 1024 * 1024


class _Bucket:
    __slots__ = ("flat", "params", "ready", "work")

    def __init__(self, params: list[Any]) -> None:
        self.params = params
        self.ready = 0
        self.work: Any = None
        self.flat: Any = None


class _Reducer:
    """The reductions of one optimizer's parameters through ``collective``."""

    def __init__(
        self,
        collective: Any,
        params: Sequence[Any],
        *,
        backward_passes_per_step: int,
        op: str,
        compression: str,
        gradient_predivide_factor: float,
        sparse_as_dense: bool,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        self.collective = collective
        self.passes = backward_passes_per_step
        self.average = op == "mean"
        self.fp16 = compression == "fp16"
        self.predivide = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.buckets: list[_Bucket] = []
        self.delay: dict[int, int] = {}
        self.bucket_of: dict[int, _Bucket] = {}
        self.started = 0  # buckets started this step, a prefix of self.buckets
        self.hooks: list[Any] = []
        current: list[Any] = []
        size = 0
        for p in reversed(list(params)):
            if not p.requires_grad:
                continue
            if current and (
                size + p.numel() * p.element_size() > bucket_bytes
                or (p.dtype, p.device) != (current[0].dtype, current[0].device)
            ):
                self.buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            self.buckets.append(_Bucket(current))
        for bucket in self.buckets:
            for p in bucket.params:
                self.bucket_of[id(p)] = bucket
                self.delay[id(p)] = self.passes
                self.hooks.append(p.register_post_accumulate_grad_hook(self._accumulated))

    # -- as backward runs -------------------------------------------------------

    def _accumulated(self, p: Any) -> None:
        if self.delay[id(p)] <= 0:
            raise MisconfigurationError(
                f"strategy 'horovod': a parameter's gradient was accumulated {self.passes + 1} times "
                f"before the optimizer stepped, with backward_passes_per_step={self.passes}; call "
                "optimizer.step() (or synchronize()) after every backward_passes_per_step backward passes"
            )
        self.delay[id(p)] -= 1
        if self.delay[id(p)] == 0:
            bucket = self.bucket_of[id(p)]
            bucket.ready += 1
            self._start_ready()

    def _start_ready(self) -> None:
        while self.started < len(self.buckets):
            bucket = self.buckets[self.started]
            if bucket.ready < len(bucket.params):
                return
            self._start(bucket)

    def _start(self, bucket: _Bucket) -> None:
        import torch

        grads = []
        for p in bucket.params:
            grad = p.grad
            if grad is None:
                grad = torch.zeros_like(p)  # unused here, maybe used elsewhere: reduce zeros
            elif grad.is_sparse:
                if not self.sparse_as_dense:
                    raise MisconfigurationError(
                        "strategy 'horovod': a sparse gradient (an embedding's with sparse=True?) cannot go "
                        f"through collective {getattr(self.collective, 'name', '?')!r}, which reduces dense "
                        "tensors; pass sparse_as_dense=True to resolve('horovod', ...)"
                    )
                grad = grad.to_dense()
            grads.append(grad.reshape(-1))
        flat = torch.cat(grads)
        if self.predivide != 1.0:
            flat.div_(self.predivide)
        if self.fp16 and flat.dtype is torch.float32:
            flat = flat.to(torch.float16)
        bucket.flat = flat
        bucket.work = self.collective.all_reduce(flat, op="sum", async_op=True)
        self.started += 1

    # -- in step() ---------------------------------------------------------------

    @property
    def pending(self) -> bool:
        return self.started > 0

    def synchronize(self) -> None:
        """Start what has not started (a parameter whose gradient did not
        arrive this step, or fewer passes than ``backward_passes_per_step``:
        Horovod reduces those too), wait for every bucket and write the
        reduced gradients back."""
        import torch

        while self.started < len(self.buckets):
            self._start(self.buckets[self.started])
        world = self.collective.world_size
        scale = self.predivide / world if self.average else self.predivide
        for bucket in self.buckets:
            bucket.work.wait()
            flat = bucket.flat
            offset = 0
            for p in bucket.params:
                n = p.numel()
                reduced = flat[offset : offset + n].view_as(p)
                offset += n
                if p.grad is None or p.grad.is_sparse:
                    p.grad = torch.empty_like(p)
                p.grad.copy_(reduced)
                if scale != 1.0:
                    p.grad.mul_(scale)
                self.delay[id(p)] = self.passes
            bucket.ready, bucket.work, bucket.flat = 0, None, None
        self.started = 0

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


class _ReducingOptimizer:
    """Mixed in before the optimizer's own class: the wrapper is still an
    instance of it (LR schedulers and grad scalers check), with the same
    parameter groups and state."""

    _phalanx_reducer: _Reducer
    _phalanx_skip: bool

    def synchronize(self) -> None:
        """Wait for every gradient's reduction (starting those not started)."""
        self._phalanx_reducer.synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside, ``step()`` does not synchronize (it already was)."""
        self._phalanx_skip = True
        try:
            yield
        finally:
            self._phalanx_skip = False

    def step(self, closure: Any = None) -> Any:
        if not self._phalanx_skip:
            self._phalanx_reducer.synchronize()
        return super().step(closure)  # type: ignore[misc]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._phalanx_reducer.pending:
            raise MisconfigurationError(
                "strategy 'horovod': optimizer.zero_grad() between backward() and step(): the gradients "
                "being reduced would be lost; call zero_grad() before backward(), or step() (or "
                "synchronize()) first"
            )
        super().zero_grad(set_to_none=set_to_none)  # type: ignore[misc]


def reducing_optimizer(optimizer: Any, collective: Any, **options: Any) -> Any:
    """``optimizer`` as Horovod's ``DistributedOptimizer`` would make it,
    reducing through ``collective``: an instance of a subclass of its class
    sharing its parameter groups and state (``options``: the strategy's)."""
    cls: Any = type(type(optimizer).__name__, (_ReducingOptimizer, type(optimizer)), {})
    wrapped = object.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    wrapped._phalanx_reducer = _Reducer(collective, params, **options)
    wrapped._phalanx_skip = False
    return wrapped


# torch's Optimizer wraps a class's step() once with its hook runner, and
# marks it so; the optimizer's own step (reached through super()) has it.
_ReducingOptimizer.step.hooked = True  # type: ignore[attr-defined]
