"""The Precision interface: the numerics of training."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import MisconfigurationError

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
        if accelerator is not None:
            self.validate()

    def validate(self) -> None:
        """Check that ``self.accelerator`` supports this precision; raise
        :class:`~phalanx_core.MisconfigurationError` saying what to use
        instead. Called by the constructor when it is given an accelerator,
        and by ``check_accelerator`` when a ready instance made without
        one is bound to its strategy's. The base accepts every accelerator."""

    def check_accelerator(self, accelerator: Accelerator) -> None:
        """Called by the strategy's constructor with its accelerator: a
        precision made for another accelerator is refused (a CPU autocast on
        a CUDA strategy would leave the GPU's forward in float32); one made
        without (``resolve(plugins=[MixedPrecision()])``) is bound to it and
        checked (``validate``), as the registry's would have been."""
        mine = self.accelerator
        if mine is None:
            self.accelerator = accelerator
            self.validate()
            return
        if mine is not accelerator and getattr(mine, "name", None) != getattr(accelerator, "name", None):
            raise MisconfigurationError(
                f"precision {self.name!r} was made for accelerator {getattr(mine, 'name', mine)!r}, and "
                f"the strategy runs on {getattr(accelerator, 'name', accelerator)!r}; make it without "
                "accelerator= (the strategy then gives it its own), or give the precision by name"
            )

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
