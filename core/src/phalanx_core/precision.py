"""The Precision interface: the numerics of training."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from .accelerator import Accelerator

__all__ = ["Precision"]


class Precision:
    """Module conversion, the forward context, backward and the optimizer
    step for one numeric recipe (``"32-true"``, ``"bf16-mixed"``, ...).

    Constructed by the registry as ``Precision(accelerator=...,
    **spec_options)``; a subclass checks in its constructor that the
    accelerator supports it and raises
    :class:`~phalanx_core.MisconfigurationError` saying what to use instead
    (16-mixed on a CPU suggests bf16-mixed) — never a silent switch.

    The base class is full precision with no conversion: every method does
    the plain thing, so a subclass overrides only what it changes.

    Attributes:
        name: the precision's name (``"32-true"``).
    """

    name: ClassVar[str] = "32-true"

    def __init__(self, *, accelerator: Accelerator | None = None) -> None:
        self.accelerator = accelerator

    def convert_module(self, module: Any) -> Any:
        """Return ``module`` converted for this precision (``module.half()``
        for ``"16-true"``); the base returns it unchanged."""
        return module

    def convert_input(self, data: Any) -> Any:
        """Return a batch converted for this precision; the base returns it
        unchanged."""
        return data

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """A context around the forward pass (autocast for mixed precision);
        the base does nothing."""
        yield

    def module_init_context(self) -> contextlib.AbstractContextManager[None]:
        """A context in which new modules get this precision's parameter
        dtype (the default dtype of ``"bf16-true"`` is bfloat16); the base
        changes nothing."""
        return contextlib.nullcontext()

    def backward(self, tensor: Any, *args: Any, **kwargs: Any) -> None:
        """Run backward from ``tensor`` (scaling it first where a grad scaler
        is needed)."""
        tensor.backward(*args, **kwargs)

    def unscale_gradients(self, optimizer: Any) -> None:
        """Unscale ``optimizer``'s gradients before clipping; the base has no
        scaler."""

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any] | None = None) -> Any:
        """Step ``optimizer`` (through the grad scaler where there is one);
        return what the optimizer's ``step`` returned."""
        return optimizer.step(closure) if closure is not None else optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        """Return this precision's state for a checkpoint (a grad scaler's);
        the base has none."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state :meth:`state_dict` returned."""

    def teardown(self) -> None:
        """Undo what the precision changed in this process (a default dtype)."""
