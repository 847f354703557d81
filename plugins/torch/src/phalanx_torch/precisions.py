"""Precisions over torch: full, double, mixed (autocast) and true half.

Each checks in its constructor that the accelerator supports it, and says
what to use instead; none switches silently to another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from typing import Any, ClassVar

import torch

from phalanx_core import MisconfigurationError, Precision

__all__ = ["DoublePrecision", "FullPrecision", "HalfPrecision", "MixedPrecision"]


def _device_type(precision: Precision) -> str:
    return getattr(precision.accelerator, "device_type", "cpu")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    if isinstance(data, torch.Tensor):
        return data.to(dtype) if data.is_floating_point() else data
    if isinstance(data, Mapping):
        return type(data)({k: _cast_floats(v, dtype) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, (list, tuple)) and not hasattr(data, "_fields"):
        return type(data)(_cast_floats(v, dtype) for v in data)
    return data


class FullPrecision(Precision):
    """``"32-true"``: float32 weights and compute. Every accelerator supports it."""

    name: ClassVar[str] = "32-true"

    def convert_module(self, module: Any) -> Any:
        return module.to(dtype=torch.float32)


class DoublePrecision(Precision):
    """``"64-true"``: float64 weights, inputs and compute (not on MPS)."""

    name: ClassVar[str] = "64-true"

    def validate(self) -> None:
        if _device_type(self) == "mps":
            raise MisconfigurationError(
                "precision '64-true' on accelerator 'mps': MPS has no float64; use '32-true'"
            )

    def convert_module(self, module: Any) -> Any:
        return module.to(dtype=torch.float64)

    def module_init_context(self) -> contextlib.AbstractContextManager[None]:
        return _default_dtype(torch.float64)

    def convert_input(self, data: Any) -> Any:
        return _cast_floats(data, torch.float64)


class HalfPrecision(Precision):
    """``"16-true"`` / ``"bf16-true"``: weights, inputs and compute in
    float16 / bfloat16 — half the memory, no float32 master copy."""

    name: ClassVar[str] = "bf16-true"
    dtype: ClassVar[torch.dtype] = torch.bfloat16

    def validate(self) -> None:
        _check_bf16(self)

    def convert_module(self, module: Any) -> Any:
        return module.to(dtype=self.dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager[None]:
        return _default_dtype(self.dtype)

    def convert_input(self, data: Any) -> Any:
        return _cast_floats(data, self.dtype)


class HalfPrecision16(HalfPrecision):
    """``"16-true"``."""

    name: ClassVar[str] = "16-true"
    dtype: ClassVar[torch.dtype] = torch.float16


class MixedPrecision(Precision):
    """``"bf16-mixed"`` / ``"16-mixed"``: float32 weights, the forward pass
    under ``torch.autocast``; ``"16-mixed"`` scales the loss with a
    ``torch.amp.GradScaler``, whose state goes into checkpoints.

    ``"16-mixed"`` needs a GPU: on a CPU it is refused with a pointer to
    ``"bf16-mixed"``.
    """

    name: ClassVar[str] = "bf16-mixed"
    dtype: ClassVar[torch.dtype] = torch.bfloat16

    def __init__(self, *, accelerator: Any = None) -> None:
        self._scaler: torch.amp.GradScaler | None = None
        super().__init__(accelerator=accelerator)

    def validate(self) -> None:
        if self.dtype is torch.float16 and _device_type(self) == "cpu":
            raise MisconfigurationError(
                "precision '16-mixed' on accelerator 'cpu': float16 autocast with a grad scaler "
                "needs a GPU; use precision='bf16-mixed' on the CPU"
            )
        _check_bf16(self)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The grad scaler of ``"16-mixed"`` (``None`` for ``"bf16-mixed"``),
        made at its first use: made here, in the process that launches, it
        would ask CUDA whether it is available, and a process that did
        cannot fork ranks that use CUDA."""
        if self.dtype is not torch.float16:
            return None
        if self._scaler is None:
            self._scaler = torch.amp.GradScaler(_device_type(self))
        return self._scaler

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with torch.autocast(_device_type(self), dtype=self.dtype):
            yield

    def backward(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        tensor.backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Any) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, closure)
        if closure is not None:
            raise MisconfigurationError(
                "precision '16-mixed' cannot step an optimizer with a closure (the grad scaler "
                "has to see the gradients first); call the closure yourself before optimizer_step"
            )
        result = self.scaler.step(optimizer)
        self.scaler.update()
        return result

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


class MixedPrecision16(MixedPrecision):
    """``"16-mixed"``."""

    name: ClassVar[str] = "16-mixed"
    dtype: ClassVar[torch.dtype] = torch.float16


def _check_bf16(precision: Any) -> None:
    on_cuda = precision.dtype is torch.bfloat16 and _device_type(precision) == "cuda"
    # is_bf16_supported() initialises CUDA, after which the process cannot
    # fork ranks that use it (ddp_fork): ask only where CUDA is already up.
    # (torch counts bfloat16 emulation as support, so on CUDA it says no
    # only for a GPU that cannot hold a bfloat16 tensor at all.)
    if on_cuda and torch.cuda.is_initialized() and not torch.cuda.is_bf16_supported():  # type: ignore[no-untyped-call]
        raise MisconfigurationError(
            f"precision {precision.name!r}: this GPU has no bfloat16 support; use '16-mixed'"
        )
