"""Every error phalanx raises on purpose.

All are subclasses of :class:`PhalanxError`, so ``except PhalanxError`` catches
them all; each is also a subclass of the built-in exception that fits it, so
code that does not know phalanx still catches them (``ValueError``,
``LookupError``, ``TimeoutError``, ``RuntimeError``).

A message has four parts, in this order: what was asked for; who is
responsible (``'horovod' (phalanx-horovod 0.1.0)``); what exists; what to do.
Errors that wrap another one are raised ``from`` it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "CheckpointSaveError",
    "CollectiveConnectionError",
    "CollectiveTimeoutError",
    "MisconfigurationError",
    "NotInGroupError",
    "PhalanxError",
    "PlanMismatchError",
    "PluginError",
    "UnavailableError",
    "UnknownNameError",
    "WorkerFailedError",
]


class PhalanxError(Exception):
    """Base class of every error phalanx raises on purpose."""


class MisconfigurationError(PhalanxError, ValueError):
    """Flags, options or arguments that cannot work together.

    Raised before anything is built when the flags given to
    ``phalanx.resolve`` are of the wrong type, conflict, or ask for something
    impossible; raised by a part's constructor when it cannot work with the
    parts it was given.
    """


class UnknownNameError(PhalanxError, LookupError):
    """A name that no installed plugin gives, or that several plugins give.

    The message lists the names that exist and every plugin that failed to
    load, because the name asked for may live in one of those.
    """

    def __str__(self) -> str:  # LookupError would not quote, but be explicit.
        return str(self.args[0]) if self.args else ""


class PluginError(PhalanxError):
    """A plugin that is broken: it failed to import, its hook raised or
    returned the wrong thing, a hook name is misspelt, or a spec's target does
    not exist. The message names the entry point and its distribution."""


class UnavailableError(PhalanxError, RuntimeError):
    """A part whose backend or hardware is missing here.

    The message says what is missing and what to install (``pip install
    phalanx-horovod[horovod]``) or where to run.
    """


class NotInGroupError(PhalanxError, RuntimeError):
    """A collective operation called on a rank that is not a member of the
    group (see :meth:`phalanx_core.Collective.new_group`)."""


class CollectiveTimeoutError(PhalanxError, TimeoutError):
    """A collective operation that did not complete within its timeout.

    ``operation`` is the name of the operation (``"all_reduce"``);
    ``missing_ranks`` the ranks that did not arrive, where the backend can
    tell, else ``None``.
    """

    def __init__(
        self,
        message: str,
        *,
        operation: str,
        timeout: float | None = None,
        missing_ranks: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__(message)
        self.operation = operation
        self.timeout = timeout
        self.missing_ranks = missing_ranks


class PlanMismatchError(MisconfigurationError):
    """The nodes of one job resolved different plans (another strategy,
    other devices per node, other versions). ``differences`` maps each
    differing field to the value every node holds (node rank -> value)."""

    def __init__(self, message: str, *, differences: dict[str, dict[int, str]]) -> None:
        super().__init__(message)
        self.differences = differences


class CollectiveConnectionError(PhalanxError, ConnectionError):
    """A rank could not reach another: the connection was refused, or no
    route leads to the address it was given, or the connection closed
    under an operation (the other rank's process ended). The message names
    the address, what the network said, and where the address came from.
    ``operation`` is the operation that tried (``"setup"``)."""

    def __init__(self, message: str, *, operation: str) -> None:
        super().__init__(message)
        self.operation = operation


class CheckpointSaveError(PhalanxError, RuntimeError):
    """A checkpoint save in the background failed (``save_checkpoint(...,
    blocking=False)``). Raised on every rank, by the save's ``wait()`` or the
    next ``save_checkpoint``/``load_checkpoint``; the message names each
    rank that failed and why, and on those ranks the cause is chained. The
    path still holds the previous checkpoint, whole."""


class WorkerFailedError(PhalanxError, RuntimeError):
    """A rank of a launched job failed.

    Raised by :meth:`phalanx_core.Launcher.launch` in the calling process after
    every other rank was stopped. ``rank`` is the global rank that failed
    first; ``exitcode`` its exit code (negative: killed by signal
    ``-exitcode``), ``signal`` the signal's name when there was one, and
    ``traceback`` the text of the exception raised on that rank, when the rank
    lived long enough to write it. In a job of several nodes, ``node`` and
    ``host`` say where that rank ran, where they are known. ``failures``
    keeps every failed rank's record that the launcher saw
    (:class:`phalanx_core.launching.RankFailure`), the first one first.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exitcode: int | None = None,
        signal: str | None = None,
        traceback: str | None = None,
        node: int | None = None,
        host: str | None = None,
        failures: Sequence[Any] = (),
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures: tuple[Any, ...] = tuple(failures)
        self.exitcode = exitcode
        self.signal = signal
        self.traceback = traceback
        self.node = node
        self.host = host

    def first_failure(self) -> str:
        """Which rank failed first and where its story is, for output whose
        every line a rank wrote is marked ``[rankN]:`` (``phalanx run``, a
        script that ``launch()`` re-ran)."""
        where = f"the lines above marked [rank{self.rank}]"
        who = f"rank {self.rank}"
        if self.node is not None:
            who += f" (node {self.node}" + (f", host {self.host})" if self.host else ")")
        if self.traceback:
            return f"{who} raised first; its traceback is in {where}"
        if self.signal:
            return f"{who} was killed by {self.signal} first; its output is in {where}"
        if self.exitcode is None:
            return f"{who} died first, how could not be seen; its output is in {where}"
        return f"{who} exited with code {self.exitcode} first; its output is in {where}"

    @property
    def exit_status(self) -> int:
        """The status to exit with: the rank's exit code, or 1."""
        return self.exitcode if isinstance(self.exitcode, int) and self.exitcode > 0 else 1


class NodeLostError(WorkerFailedError):
    """A node of a launched job was lost (its launching process, or its
    host) in a way the job cannot survive: the node that held the job's
    rendezvous store, where the store was on a node, or any node of a job
    of fixed nodes without restarts. ``node`` is that node, ``address``
    where its store was, or its host. ``rank`` is -1: no rank of this
    node failed."""

    def __init__(self, message: str, *, node: int, address: str) -> None:
        super().__init__(message, rank=-1, node=node)
        self.address = address

    def first_failure(self) -> str:
        return str(self).rstrip(".")
