"""Handles of the composed collectives' asynchronous operations, completed
from the callbacks of the handles they are made of, with no thread that
waits; and the reusable wire buffers of ``compressed``. Imports torch."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from phalanx_core import Work

__all__ = ["Buffers", "ChainedWork", "FutureWork", "NativeWork"]


class _Failed:
    """What a handle's inner future holds when its operation failed."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


def _unwrap(future: torch.futures.Future[Any]) -> Any:
    value = future.value()
    if isinstance(value, _Failed):
        raise value.error
    return value


class NativeWork(dist.Work):
    """A ``torch.distributed.Work`` over a c10d future: what phalanx's
    process group hands DDP's reducer and FSDP as it is
    (:meth:`phalanx_core.Work.backend_work`), so that they wait on the
    future itself, with no Python of the process group's in between."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()  # raises the operation's error
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:  # noqa: BLE001 - a failure is the answer
            return False
        return True


class FutureWork(Work):
    """A contract handle completed by :meth:`complete` or :meth:`fail`,
    from whichever thread finishes the operation.

    Two futures, as phalanx's process group keeps them: the inner one
    holds the result (or a failure), and the one torch's code gets is
    chained on it, so that a failure reaches torch as an error raised in a
    callback (a future failed from Python with ``set_exception`` crashes
    DDP's reducer when it reads the error). ``torch_value`` maps the
    contract's result to what torch's backends give for the operation
    (``[tensor]``); without it :meth:`backend_work` is ``None``.
    ``notifies``: something completes the handle without a waiter (the
    callbacks of the handles it is made of); where not, :meth:`wait` calls
    :meth:`drive` until it is done, and :meth:`on_done` says ``False``."""

    def __init__(self, *, notifies: bool, torch_value: Callable[[Any], Any] | None = None) -> None:
        self._notifies = notifies
        self._torch_value = torch_value
        self._inner: torch.futures.Future[Any] = torch.futures.Future()
        self._future = self._inner.then(_unwrap)
        self._result: Any = None
        self._error: BaseException | None = None

    def complete(self, result: Any) -> None:
        self._result = result
        try:
            value = self._torch_value(result) if self._torch_value is not None else None
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self.fail(exc)
            return
        self._inner.set_result(value)

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._inner.set_result(_Failed(error))

    def drive(self) -> None:
        """Make progress where nothing notifies: wait on what this handle
        waits for. The default has nothing to drive."""

    def wait(self) -> Any:
        while not self._notifies and not self._inner.done():
            self.drive()
        self._inner.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return self._inner.done()

    def on_done(self, callback: Callable[[], object]) -> bool:
        if not self._notifies:
            return False
        self._inner.then(lambda _: callback())
        return True

    def backend_work(self) -> Any:
        if not self._notifies or self._torch_value is None:
            return None
        return NativeWork(self._future)


class ChainedWork(FutureWork):
    """``work`` (a contract handle of the inner collective) followed by
    ``finish(its result)``. Where ``work`` notifies (``Work.on_done``: the
    torch collective's, through c10d's future), ``finish`` runs in the
    thread that completes it (gloo's worker) and the handle is done then:
    nobody has to wait for the copy back to happen. Elsewhere ``finish``
    runs in :meth:`wait`."""

    def __init__(
        self, work: Work, finish: Callable[[Any], Any], torch_value: Callable[[Any], Any] | None = None
    ) -> None:
        super().__init__(notifies=False, torch_value=torch_value)
        self._work = work
        self._finish: Callable[[Any], Any] | None = finish
        self._lock = threading.Lock()
        self._notifies = work.on_done(self._run)

    def _run(self) -> None:
        with self._lock:
            finish, self._finish = self._finish, None
        if finish is None:
            return
        try:
            result = finish(self._work.wait())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            self.fail(exc)
            return
        self.complete(result)

    def drive(self) -> None:
        self._run()

    def is_completed(self) -> bool:
        return self._inner.done() or (not self._notifies and self._work.is_completed())


class Buffers:
    """Wire buffers kept for reuse, by (elements, dtype, device): a fresh
    buffer of 8 MB costs its page faults on every call (about ten times
    the conversion into a buffer already touched, measured on this
    machine), and DDP and FSDP send the same sizes every step. A buffer is
    taken for one operation and given back when it is done; at most
    ``keep`` sizes are kept, the least recently used dropped first."""

    def __init__(self, keep: int = 16) -> None:
        self._keep = keep
        self._free: OrderedDict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (numel, dtype, device)
        with self._lock:
            free = self._free.get(key)
            if free:
                self._free.move_to_end(key)
                return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, *buffers: torch.Tensor) -> None:
        with self._lock:
            for buffer in buffers:
                key = (buffer.numel(), buffer.dtype, buffer.device)
                self._free.setdefault(key, []).append(buffer)
                self._free.move_to_end(key)
            while len(self._free) > self._keep:
                self._free.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
