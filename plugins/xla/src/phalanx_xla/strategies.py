"""The ``xla`` and ``xla_single`` strategies: data parallel across XLA
devices, and one XLA device.

Both use the ``xla`` launcher (replicas that torch_xla starts), the ``xla``
environment (ranks from ``torch_xla.runtime``) and the ``xla`` collective,
and accept the precisions ``"32-true"`` and ``"bf16-true"`` (float32, or
bfloat16 weights and inputs); any other is refused with what to use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from typing import Any

from phalanx_core import MisconfigurationError, Strategy

from . import _runtime

__all__ = ["XLASingleStrategy", "XLAStrategy"]

#: The precisions the xla strategies run.
PRECISIONS = ("32-true", "bf16-true")


class XLAStrategy(Strategy):
    """Data parallel across XLA devices, one replica per device.

    - :meth:`setup` moves the module to the replica's device and makes its
      parameters rank 0's (one broadcast of all of them), so that every
      replica starts from the same weights.
    - :meth:`backward` runs the precision's backward, then averages the
      gradients of the modules :meth:`setup` returned across the replicas
      (one ``xm.all_reduce`` of every gradient, as ``xm.reduce_gradients``
      does, then a division by the number of replicas) — as DDP does in its
      backward, so that clipping sees the averaged gradients. Inside
      :meth:`no_backward_sync` the gradients stay local and accumulate; the
      next backward outside it averages them all.
    - :meth:`optimizer_step` steps through the precision, then launches the
      step's graph (``torch_xla.sync()``): XLA runs lazily, and this is the
      step's end.
    - Checkpoints are written by rank 0, with every tensor moved to the CPU
      first.
    """

    def __init__(self, **parts: Any) -> None:
        collective = parts.get("collective")
        if getattr(collective, "name", None) != "xla":
            # Its gradients go through torch_xla's own all_reduce, never
            # through another collective: refused, not a silent detour.
            raise MisconfigurationError(
                f"strategy 'xla' with collective {getattr(collective, 'name', type(collective).__name__)!r}: "
                "the xla strategy averages gradients with torch_xla's xm.all_reduce, which runs on the "
                "'xla' collective's replicas only; drop collective= (or give collective='xla')"
            )
        super().__init__(**parts)
        name = getattr(self.precision, "name", type(self.precision).__name__)
        if name not in PRECISIONS:
            raise MisconfigurationError(
                f"precision {name!r} with an xla strategy: XLA runs {' and '.join(map(repr, PRECISIONS))} "
                "here (bfloat16 is XLA's half type; there is no grad scaler or autocast on this path); "
                "use precision='bf16-true' or '32-true'"
            )
        self._synced_modules: list[Any] = []
        self._sync_gradients = True

    def setup_module(self, module: Any) -> Any:
        if self.world_size > 1:
            self._broadcast_parameters(module)
        self._synced_modules.append(module)
        return module

    def _broadcast_parameters(self, module: Any) -> None:
        import torch
        from torch.nn.utils import parameters_to_vector, vector_to_parameters

        params = [p for p in module.parameters()]
        if not params:
            return
        with torch.no_grad():
            flat = parameters_to_vector(params)
            self.collective.broadcast(flat, 0)
            vector_to_parameters(flat, params)

    def backward(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        super().backward(tensor, *args, **kwargs)
        if self._sync_gradients and self.world_size > 1:
            self._average_gradients()

    def _average_gradients(self) -> None:
        import torch_xla.core.xla_model as xm

        grads = [p.grad for module in self._synced_modules for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        if _runtime.replicas_are_threads():
            # The gradients' graph may differ between replicas (a constant
            # that depends on the rank): launched first, the all_reduce's
            # graph is the same on every replica (see phalanx_xla._runtime).
            _runtime.sync()
        xm.all_reduce(xm.REDUCE_SUM, grads, pin_layout=_runtime.pin_layout())
        _runtime.collective_issued()
        for grad in grads:  # lazy tensors: one graph either way
            grad.div_(self.world_size)

    @contextlib.contextmanager
    def no_backward_sync(self, module: Any, enabled: bool = True) -> Generator[None, None, None]:
        """Backward keeps the gradients local (gradient accumulation); the
        next backward outside this context averages what accumulated."""
        previous = self._sync_gradients
        self._sync_gradients = not enabled and previous
        try:
            yield
        finally:
            self._sync_gradients = previous

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
        result = super().optimizer_step(optimizer, closure)
        _runtime.sync()
        return result

    def _to_state(self, state: Mapping[str, Any]) -> dict[str, Any]:
        # What save_checkpoint writes (blocking or in the background): on the CPU.
        return _to_cpu(super()._to_state(state))  # type: ignore[no-any-return]

    def teardown(self) -> None:
        self._synced_modules.clear()
        super().teardown()


class XLASingleStrategy(XLAStrategy):
    """One XLA device, one replica: the same steps as ``xla`` with nothing
    to average."""

    def __init__(self, **parts: Any) -> None:
        super().__init__(**parts)
        if len(self.parallel_devices) > 1:
            raise MisconfigurationError(
                f"strategy 'xla_single' runs on one XLA device, got {len(self.parallel_devices)}; use "
                "devices=1, or strategy='xla' for one replica per device"
            )


def _to_cpu(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return type(value)({k: _to_cpu(v) for k, v in value.items()})  # type: ignore[call-arg]
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    return value
