"""Modules, optimizers and batches: the small helpers a strategy's set-up
uses. Imports torch only inside :func:`skip_init`."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Mapping
from typing import Any

from .errors import MisconfigurationError

__all__ = ["is_module", "make_optimizer", "skip_init", "to_device"]


def make_optimizer(factory: Any, module: Any) -> Any:
    if not callable(factory):
        raise MisconfigurationError(
            f"setup(module, {factory!r}): an optimizer must be an optimizer (with .step) or a "
            "callable that makes one from the module's parameters"
        )
    return factory(module.parameters())


def is_module(obj: Any) -> bool:
    return hasattr(obj, "parameters") and hasattr(obj, "named_modules")


def to_device(batch: Any, device: Any) -> Any:
    if hasattr(batch, "to") and callable(batch.to) and not isinstance(batch, type):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return type(batch)({k: to_device(v, device) for k, v in batch.items()})  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


@contextlib.contextmanager
def skip_init() -> Generator[None, None, None]:
    """Make every ``torch.nn.init`` function return its tensor untouched."""
    from torch.overrides import TorchFunctionMode

    class SkipInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if getattr(func, "__module__", None) == "torch.nn.init":
                return args[0] if args else kwargs["tensor"]
            return func(*args, **(kwargs or {}))

    with SkipInit():
        yield
