"""Saving a checkpoint in the background.

``strategy.save_checkpoint(path, state, blocking=False)`` blocks training
only while the state is copied into host memory (``HostStager``); a
thread of the strategy's own then writes and fsyncs it, with the same
guarantees as a blocking save (atomic, durable, the previous checkpoint
whole until the new one is). It returns a :class:`SaveHandle`.

The rules:

- At most one save is in flight per strategy: a second ``save_checkpoint``
  (blocking or not) first waits for the one before, and so does
  ``load_checkpoint``.
- ``handle.wait()`` is a collective call, like ``save_checkpoint`` itself:
  every rank calls it, and it returns on every rank once the checkpoint is
  whole at its path. A failed background write raises
  :class:`~phalanx_core.errors.CheckpointSaveError` on every rank, there or
  at the next ``save_checkpoint`` / ``load_checkpoint``, whichever comes
  first; one never waited for raises in ``teardown()``. A failure is never
  dropped.
- Memory: the host keeps one copy of what this rank writes (rank 0's whole
  state where rank 0 writes one file, each rank's shards where every rank
  writes its own), from the first background save to ``teardown()``. Its
  buffers are reused by the next save of the same shapes (pinned where the
  state is on a GPU, so that the copy is fast and overlaps nothing else).
"""

from __future__ import annotations

import contextlib
import copy
import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from .checkpoint import _first_line as first_line
from .errors import CheckpointSaveError

__all__ = ["BackgroundSaves", "HostStager", "SaveHandle"]

#: Agrees across ranks on how a save went: takes this rank's failure (or
#: None) and returns the failure every rank raises (or None).
Agreement = Callable[[BaseException | None], BaseException | None]


class SaveHandle:
    """A checkpoint save in flight (or done); ``save_checkpoint`` returns it.

    :meth:`wait` is collective (every rank calls it); :meth:`done` and
    :meth:`add_done_callback` are this rank's own.
    """

    #: Where the checkpoint goes.
    path: str

    def __init__(self, path: str | os.PathLike[str], future: Future[None], agree: Agreement | None) -> None:
        self.path = os.fspath(path)
        self._future = future
        self._agree = agree
        self._outcome: tuple[BaseException | None] | None = None
        self._lock = threading.Lock()
        #: Callbacks still to run when this rank's part ends (None once it has).
        self._callbacks: list[Callable[[SaveHandle], Any]] | None = []
        self._callbacks_lock = threading.Lock()

    @classmethod
    def finished(cls, path: str | os.PathLike[str]) -> SaveHandle:
        """The handle of a save that is already complete everywhere."""
        future: Future[None] = Future()
        future.set_result(None)
        handle = cls(path, future, None)
        handle._outcome = (None,)
        handle._callbacks = None
        return handle

    def done(self) -> bool:
        """Whether this rank's part of the save has ended (written, or
        failed). That the checkpoint is whole at :attr:`path` is known only
        once :meth:`wait` returns."""
        return self._future.done()

    def add_done_callback(self, fn: Callable[[SaveHandle], Any]) -> None:
        """Call ``fn(handle)`` once this rank's part has ended: in the
        writing thread, before the part counts as done (so before
        :meth:`wait` returns, and before the next save starts), or at once
        where it has already ended. An error it raises is the save's."""
        with self._callbacks_lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        fn(self)

    def _end(self, failure: BaseException | None) -> None:
        """End this rank's part: run the callbacks, then mark it done."""
        with self._callbacks_lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for fn in callbacks:
            try:
                fn(self)
            except BaseException as exc:  # noqa: BLE001 - the save's failure
                failure = failure or exc
        if failure is None:
            self._future.set_result(None)
        else:
            self._future.set_exception(failure)

    def wait(self) -> None:
        """Block until the checkpoint is whole at :attr:`path` on every rank
        (a collective call: every rank must make it); raise
        :class:`~phalanx_core.errors.CheckpointSaveError` on every rank if
        any rank's part failed. Once it has returned or raised, it does the
        same again at once, with no collective."""
        with self._lock:
            if self._outcome is None:
                try:
                    self._future.result()
                    mine: BaseException | None = None
                except BaseException as exc:  # noqa: BLE001 - agreed on, then raised
                    mine = exc
                everyone = self._agree(mine) if self._agree is not None else mine
                self._outcome = (everyone,)
            failure = self._outcome[0]
        if failure is not None:
            raise failure

    def __repr__(self) -> str:
        state = "done" if self._outcome is not None or self._future.done() else "in flight"
        return f"SaveHandle({self.path!r}, {state})"


class BackgroundSaves:
    """A strategy's background writer: one thread, one save in flight at a
    time, and the host copy of the state that the next save reuses."""

    def __init__(self) -> None:
        self.stager = HostStager()
        self.in_flight: SaveHandle | None = None

    def finish(self) -> None:
        """Wait for the save in flight, if any (collective: every rank calls
        it where every rank started the save); raise its failure."""
        handle, self.in_flight = self.in_flight, None
        if handle is not None:
            handle.wait()

    def start(
        self,
        path: str | os.PathLike[str],
        write: Callable[[], None] | None,
        agree: Agreement | None,
    ) -> SaveHandle:
        """Run ``write`` (this rank's part; None where it has none) in a
        thread of its own; return the save's handle."""
        handle = SaveHandle(path, Future(), agree)
        if write is None:
            handle._end(None)
        else:

            def run() -> None:
                try:
                    write()
                except BaseException as exc:  # noqa: BLE001 - handed to the waiting rank
                    handle._end(exc)
                else:
                    handle._end(None)

            threading.Thread(target=run, name="phalanx-checkpoint", daemon=False).start()
        self.in_flight = handle
        return handle

    def close(self) -> BaseException | None:
        """Teardown: wait for this rank's part of the save in flight (no
        collective: another rank may be gone) and release the host copy;
        return the error to raise for this rank's failure of a save never
        waited for."""
        handle, self.in_flight = self.in_flight, None
        self.stager.release()
        if handle is None or handle._outcome is not None:  # none, or waited for (raised there)
            return None
        with contextlib.suppress(BaseException):  # returned below
            handle._future.result()
        mine = handle._future.exception()
        if mine is None:
            return None
        return agreed_failure([(-1, first_line(mine))], mine, handle.path, -1)


class HostStager:
    """Copies a state (nested dicts and lists of tensors and plain values)
    into host memory it keeps, so that training can change the original at
    once. The next copy of a state with the same tensors (names, shapes,
    dtypes) reuses the same buffers; another state makes new ones.

    Tensors on a GPU are copied into pinned host memory, without
    synchronising tensor by tensor: one synchronisation at the end. Sharded
    tensors (``DTensor``) are copied shard by shard and stay sharded.
    Values that are not tensors are copied too (``copy.deepcopy``).
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Any] | None = None
        self._layout: tuple[Any, ...] | None = None

    def stage(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` in host memory (see the class)."""
        import torch

        layout = _layout(state)
        if self._buffers is None or layout != self._layout:
            on_gpu = any(device not in ("cpu", "meta") for *_, device in layout)
            pin = on_gpu and torch.cuda.is_available()
            self._buffers = {
                where: torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pin)
                for where, shape, dtype, _ in layout
            }
            self._layout = layout
        staged = _copied(state, self._buffers, "")
        if any(device == "cuda" for *_, device in layout):
            torch.cuda.synchronize()
        return dict(staged)

    def release(self) -> None:
        """Drop the buffers (the next :meth:`stage` makes new ones)."""
        self._buffers = None
        self._layout = None


def _copied(value: Any, buffers: Mapping[str, Any], where: str) -> Any:
    """``value`` with each tensor copied into its buffer (by its place, as
    :func:`_layout` names it; without waiting for a GPU), a ``DTensor``
    made again over its copied shard, and every other value copied."""
    import torch

    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        buffer = buffers[where]
        buffer.copy_(local, non_blocking=True)
        if local is value:
            return buffer
        return type(value).from_local(  # type: ignore[attr-defined]
            buffer,
            value.device_mesh,  # type: ignore[attr-defined]
            value.placements,  # type: ignore[attr-defined]
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, Mapping):
        return {key: _copied(item, buffers, f"{where}/{key}") for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_copied(item, buffers, f"{where}/{i}") for i, item in enumerate(value)]
        if isinstance(value, list) or type(value) is tuple:
            return items if isinstance(value, list) else tuple(items)
        return type(value)(*items)  # a named tuple
    return copy.deepcopy(value)


def _layout(state: Any, prefix: str = "") -> tuple[Any, ...]:
    """What decides whether staging buffers fit ``state``: every tensor's
    place, shape, dtype and device type, in order."""
    import torch

    found: list[Any] = []

    def walk(value: Any, where: str) -> None:
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            found.append((where, tuple(local.shape), local.dtype, local.device.type))
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{where}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}/{i}")

    walk(state, prefix)
    return tuple(found)


def agreed_failure(
    failures: list[tuple[int, str] | None], mine: BaseException | None, path: str, rank: int
) -> BaseException | None:
    """The error every rank raises, given every rank's failure as (rank,
    first line) or None: None if none failed."""
    failed = [f for f in failures if f is not None]
    if not failed:
        return None
    where = "; ".join(f"rank {r}: {line}" if r >= 0 else line for r, line in failed)
    error = CheckpointSaveError(
        f"the background save of the checkpoint {path!r} failed ({where}). The checkpoint there is "
        "the previous one, whole (or none, if there was none); fix the cause and save again"
    )
    if mine is not None:
        error.__cause__ = mine
    return error
