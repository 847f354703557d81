"""How ``hierarchical`` runs its operations without blocking the caller.

An operation is a :class:`Chain` of up to three steps, one per level:
within the node, across the nodes, within the node again (``all_reduce``:
reduce-scatter, all-reduce, all-gather). The caller's call starts the
first step and returns; each later step is started by the callback of the
step before it (``Work.on_done``: from gloo's worker thread, through
c10d's future), so DDP's backward pass goes on while its buckets travel.

The ranks must start the operations of each group in the same order, and
callbacks come in any order. So each level has a group of its own (this
node's ranks twice: one group for the first level, another for the last),
and a chain starts its step of a level only after every chain started
before it has started its step of that level (or has none). Each group
then sees its operations in the order the caller started them, on every
rank, whichever thread starts them.

Where a level's handles cannot notify (``inter="mpi"``: checked once, at
setup), the steps go on when someone waits: :meth:`Chain.wait` waits on the
oldest step in flight and starts what follows, and the chain's ``on_done``
says ``False`` (phalanx's process group then waits in a thread, or in the
call). Imports torch.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from phalanx_core import Collective, Work

from ._works import FutureWork

__all__ = ["Chain", "Pipeline"]

LEVELS = 3


class Chain(FutureWork):
    """One composed operation: ``steps[i]`` (``None``: nothing at level
    ``i``) takes the result of the step before and returns the handle of
    the operation it started; ``finish`` takes the last result and gives
    the operation's."""

    def __init__(
        self,
        pipeline: Pipeline,
        steps: Sequence[Callable[[Any], Work] | None],
        finish: Callable[[Any], Any],
        torch_value: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(notifies=pipeline.notifies, torch_value=torch_value)
        self._pipeline = pipeline
        self.steps = list(steps)
        self.finish = finish
        self.started = 0  # levels started (or skipped)
        self.current: Work | None = None  # the step in flight
        self.current_done = False
        self.value: Any = None

    def drive(self) -> None:
        self._pipeline.drive()

    def complete(self, result: Any) -> None:
        self._release()
        super().complete(result)

    def fail(self, error: BaseException) -> None:
        self._release()
        super().fail(error)

    def _release(self) -> None:
        # Before anyone waiting on this chain wakes: drop the steps and
        # finish (closures over the levels' collectives, whose gloo groups
        # they own) and the step in flight. Otherwise the gloo worker that
        # completes the chain may drop the last reference to its own group
        # after the caller has torn down, and ~ProcessGroupGloo joins
        # itself: "Resource deadlock avoided", SIGABRT.
        self.steps = [None] * LEVELS
        self.finish = _released
        self.current = None


class Pipeline:
    """The chains in flight of one ``hierarchical`` collective, in the
    order they were started, and who moves them on."""

    def __init__(self, levels: Sequence[Collective]) -> None:
        self._chains: deque[Chain] = deque()
        self._lock = threading.Lock()
        self._running = False
        self._again = False
        self._drive_lock = threading.Lock()
        self.notifies = all(_notifies(level) for level in levels)

    def submit(self, chain: Chain) -> None:
        """Start ``chain``'s first step (now, or, if another thread is
        moving the chains on, from that thread, right after)."""
        with self._lock:
            self._chains.append(chain)
        self.kick()

    def kick(self) -> None:
        """Move every chain on as far as it goes. One thread at a time: a
        thread that finds another at it leaves it a note and returns (a
        callback of gloo's never waits here)."""
        with self._lock:
            if self._running:
                self._again = True
                return
            self._running = True
        while True:
            try:
                self._advance()
            except BaseException:
                with self._lock:
                    self._running = False
                raise
            with self._lock:
                if not self._again:
                    self._running = False
                    return
                self._again = False

    def _advance(self) -> None:
        with self._lock:
            chains = list(self._chains)
        free = [True] * LEVELS  # whether a later chain may start its step of each level
        for chain in chains:
            self._move(chain, free)
            if chain.is_completed():
                with self._lock:
                    self._chains.remove(chain)
            else:
                for level in range(chain.started, LEVELS):
                    free[level] = False

    def _move(self, chain: Chain, free: list[bool]) -> None:
        while True:
            if chain.current is not None:
                if not chain.current_done:
                    return
                work, chain.current = chain.current, None
                try:
                    chain.value = work.wait()  # done: returns at once
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                    del work
                    chain.fail(exc)
                    return
                del work  # it holds its level's collective
            if chain.started == LEVELS:
                try:
                    result = chain.finish(chain.value)
                except BaseException as exc:  # noqa: BLE001
                    chain.fail(exc)
                    return
                chain.complete(result)
                return
            level = chain.started
            if not free[level]:
                return
            step = chain.steps[level]
            chain.started += 1
            if step is None:
                continue
            try:
                work = step(chain.value)
            except BaseException as exc:  # noqa: BLE001
                del step
                chain.started = LEVELS  # the later steps will not be started
                chain.fail(exc)
                return
            del step  # a closure over its level's collective
            chain.current, chain.current_done = work, False
            # The callback names the step by its level, not by its handle:
            # gloo's worker keeps the callback until after it returned,
            # and the handle holds the level's collective (see Chain._release).
            if self.notifies and not work.on_done(functools.partial(self._done, chain, chain.started)):
                # One handle that could not notify after all: a thread waits for it.
                args = (chain, work, chain.started)
                threading.Thread(target=self._wait_for, args=args, daemon=True).start()
                del args
            del work

    def _done(self, chain: Chain, started: int) -> None:
        if chain.current is not None and chain.started == started:
            chain.current_done = True
        self.kick()

    def _wait_for(self, chain: Chain, work: Work, started: int) -> None:
        with contextlib.suppress(BaseException):  # raised again when the chain takes the result
            work.wait()
        del work
        self._done(chain, started)

    def drive(self) -> None:
        """Where nothing notifies: wait on the oldest step in flight, then
        move the chains on."""
        with self._drive_lock:
            self.kick()
            with self._lock:
                waiting = next(
                    (c for c in self._chains if c.current is not None and not c.current_done), None
                )
            if waiting is not None and waiting.current is not None:
                with contextlib.suppress(BaseException):  # raised again when the chain takes the result
                    waiting.current.wait()
                waiting.current_done = True
            self.kick()


def _released(_: Any) -> Any:
    raise RuntimeError("hierarchical: a finished chain was moved on again")


def _notifies(collective: Collective) -> bool:
    """Whether ``collective``'s handles notify (``Work.on_done``), tried on
    an asynchronous barrier: every rank of the group calls this."""
    work = collective.barrier(async_op=True)
    if work is None:
        return False
    notifies = work.on_done(lambda: None)
    work.wait()
    return notifies
