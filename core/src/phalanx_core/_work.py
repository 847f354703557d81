"""Handles of asynchronous operations (``async_op=True``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

__all__ = ["CompletedWork", "Work"]


class Work(ABC):
    """The handle an operation called with ``async_op=True`` returns."""

    @abstractmethod
    def wait(self) -> Any:
        """Block until the operation is done; return what the synchronous
        call would have returned. Raises what the synchronous call would
        have raised (a timeout included)."""

    @abstractmethod
    def is_completed(self) -> bool:
        """Return whether the operation is done, without blocking."""

    def on_done(self, callback: Callable[[], object]) -> bool:
        """Optional: arrange for ``callback()`` to be called once the
        operation is done (or failed), from whichever thread finishes it,
        and return ``True``. From then on :meth:`wait` must not block
        (``callback`` may call it, to get the result or the error).
        ``False`` (the default): this handle cannot notify; a caller that
        needs to know waits on it instead (phalanx's process group for torch
        then waits in a thread of its own, which costs a thread hand-off per
        operation). The torch collective's handles notify through c10d's
        futures."""
        return False

    def backend_work(self) -> Any:
        """Optional: the backend's own handle for this operation, where
        waiting on it alone completes the operation (the results already
        where :meth:`wait` would return them, nothing left to do after it);
        ``None`` (the default) otherwise. phalanx's process group for torch
        hands a ``torch.distributed.Work`` found here to torch as it is, so
        that DDP's reducer and FSDP wait on c10d's own future with no Python
        in between: a collective built on torch.distributed (one that counts
        its calls, or adds a step before each) gets that from the torch
        collective's handles by returning them."""
        return None

    def then(self, finish: Callable[[Any], Any]) -> Work:
        """A handle for this operation followed by ``finish(its result)``:
        its :meth:`wait` returns what ``finish`` returns (called once, in
        the waiting thread). For a collective that wraps another one's
        operation and has something to do after it (copy a result back,
        convert it)."""
        return _Then(self, finish)


class CompletedWork(Work):
    """A handle for an operation that already ran (or is lazy, as on XLA):
    ``wait()`` returns ``result`` at once, or calls ``finish`` once first
    to produce it."""

    def __init__(self, result: Any = None, finish: Callable[[], Any] | None = None) -> None:
        self._result = result
        self._finish = finish

    def wait(self) -> Any:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish()
        return self._result

    def is_completed(self) -> bool:
        return self._finish is None

    def on_done(self, callback: Callable[[], object]) -> bool:
        if self._finish is not None:
            return False
        callback()
        return True


class _Then(Work):
    """``work`` followed by ``finish`` of its result: what the default
    into-forms return for ``async_op=True``."""

    def __init__(self, work: Work, finish: Callable[[Any], Any]) -> None:
        self._work = work
        self._finish: Callable[[Any], Any] | None = finish
        self._result: Any = None

    def wait(self) -> Any:
        result = self._work.wait()
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._result = finish(result)
        return self._result

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def on_done(self, callback: Callable[[], object]) -> bool:
        return self._work.on_done(callback)
