"""The strategy's collectives: each call forwarded to its
:class:`~phalanx_core.Collective`, tensors and structures of tensors alike."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from .errors import MisconfigurationError

if TYPE_CHECKING:
    from .collective import Collective, Tensor

__all__ = ["CollectiveCalls"]


def _is_tensor(value: Any) -> bool:
    """A torch tensor (a Parameter, a DTensor), found without importing torch
    (no tensor exists before torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _each_tensor(data: Any, operation: str, call: Callable[[Any], Any]) -> Any:
    """``data`` with ``call`` applied to every tensor in it (through dicts,
    lists and tuples, in order, so that every rank calls the same operations
    in the same order); anything else in it is an error naming where."""

    def walk(value: Any, where: str) -> Any:
        if _is_tensor(value):
            return call(value)
        if isinstance(value, Mapping):
            out = {k: walk(v, f"{where}[{k!r}]") for k, v in value.items()}
            try:
                return type(value)(out)  # type: ignore[call-arg]  # an OrderedDict stays one
            except TypeError:
                return out
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
            if isinstance(value, tuple) and hasattr(value, "_fields"):
                return type(value)(*items)  # a named tuple
            return type(value)(items)
        raise MisconfigurationError(
            f"strategy.{operation}() takes a tensor, or a dict, list or tuple of tensors; {where} is a "
            f"{type(value).__name__}. Make it a tensor (torch.tensor(x)), or send any picklable object "
            f"with strategy.{'broadcast' if operation == 'broadcast' else 'all_gather_object'}(...)"
        )

    return walk(data, "data")


class CollectiveCalls:
    """The collective operations of :class:`~phalanx_core.Strategy`, each
    forwarded to ``self.collective``."""

    collective: Collective

    def _not_set_up(self, operation: str) -> None:
        """After an operation failed: if the collective is not set up, that
        is why; say so, instead of the backend's own words."""
        if not self.collective.is_initialized:
            raise MisconfigurationError(
                f"strategy.{operation}() before the strategy was set up: its collective "
                f"({type(self.collective).__name__}) has no group yet. Call strategy.launch() "
                "first (in a flat script: it sets this rank up, or starts the ranks), or call it "
                "inside strategy.launch(fn, ...), in fn (which gets the strategy)"
            ) from None

    def barrier(self) -> None:
        """Block until every rank arrives (:meth:`Collective.barrier`)."""
        self.collective.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank: a tensor in place
        (:meth:`Collective.broadcast`), anything else picklable (a dict, a
        number, a list of tensors) as :meth:`broadcast_object` sends it,
        which returns ``src``'s object."""
        if _is_tensor(obj):
            return self.collective.broadcast(obj, src)
        return self.collective.broadcast_object(obj, src)

    def all_reduce(self, data: Any, op: str = "sum", *, async_op: bool = False) -> Any:
        """:meth:`Collective.all_reduce`, in place: a tensor, or a dict, list
        or tuple of them (nested as you like; each tensor is reduced, the
        same structure is returned). ``async_op`` takes a tensor only."""
        if _is_tensor(data):
            return self.collective.all_reduce(data, op, async_op=async_op)
        if async_op:
            raise MisconfigurationError(
                f"all_reduce(async_op=True) takes one tensor, got a {type(data).__name__}; reduce "
                "each tensor with its own handle, or drop async_op"
            )
        return _each_tensor(data, "all_reduce", lambda t: self.collective.all_reduce(t, op))

    def reduce(self, tensor: Tensor, dst: int = 0, op: str = "sum") -> Tensor:
        """:meth:`Collective.reduce`."""
        return self.collective.reduce(tensor, dst, op)

    def all_gather(self, data: Any) -> Any:
        """:meth:`Collective.all_gather`: for a tensor, the list of every
        rank's, indexed by rank; for a dict, list or tuple of tensors
        (nested as you like), the same structure with such a list in the
        place of each tensor."""
        if _is_tensor(data):
            return self.collective.all_gather(data)
        return _each_tensor(data, "all_gather", self.collective.all_gather)

    def gather(self, tensor: Tensor, dst: int = 0) -> list[Tensor]:
        """:meth:`Collective.gather`."""
        return cast(list[Any], self.collective.gather(tensor, dst))

    def scatter(self, tensor: Tensor, scatter_list: Sequence[Tensor] | None = None, src: int = 0) -> Tensor:
        """:meth:`Collective.scatter`."""
        return self.collective.scatter(tensor, scatter_list, src)

    def reduce_scatter(self, tensor: Tensor, op: str = "sum") -> Tensor:
        """:meth:`Collective.reduce_scatter`."""
        return self.collective.reduce_scatter(tensor, op)

    def all_to_all(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        """:meth:`Collective.all_to_all`."""
        return cast(list[Any], self.collective.all_to_all(tensors))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """:meth:`Collective.broadcast_object`."""
        return self.collective.broadcast_object(obj, src)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """:meth:`Collective.all_gather_object`."""
        return self.collective.all_gather_object(obj)
