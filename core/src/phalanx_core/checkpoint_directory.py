"""A directory of numbered checkpoints: save by step, find the newest
complete one, keep the last K, and clear what killed saves left.

::

    checkpoints = CheckpointDirectory("ckpt", keep=3)
    path = checkpoints.latest()            # None on a first run
    if path is not None:
        strategy.load_checkpoint(path, state)
    ...
    checkpoints.save(strategy, step, state, blocking=False)

A checkpoint is ``<root>/step-<step>`` (eight digits at least): a file, or
a directory for strategies that write one (``fsdp``'s sharded checkpoints).
It is complete once it is there under that name: every strategy writes to
a temporary name and renames it when the checkpoint is whole, so what
:meth:`CheckpointDirectory.latest` finds always loads.

One job writes to a directory at a time (several may read it).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .checkpoint import HOST, _running, fsync_directory
from .errors import MisconfigurationError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from .saving import SaveHandle

__all__ = ["COMPLETE_MARK", "CheckpointDirectory"]

#: What marks a checkpoint directory complete: the file every
#: ``torch.distributed.checkpoint`` directory has, written last, or the
#: mark a strategy that writes one file per rank leaves once every rank's
#: file is there (:data:`COMPLETE_MARK`).
_SHARDED_MARK = ".metadata"
#: The file a strategy writes into a checkpoint directory of its own layout
#: once the checkpoint is whole (``manual``'s one file per rank).
COMPLETE_MARK = ".complete"
#: What phalanx leaves beside a checkpoint while it writes one: a partial
#: file (``.<host>-<pid>-<random>.partial``), a sharded save's staging
#: directory (``.partial``), or the previous sharded checkpoint while the
#: new one is swapped in (``.previous``).
_LEFTOVER = re.compile(
    r"^(?P<name>.+?)\.(?:(?P<host>[A-Za-z0-9_-]+?)-(?P<pid>\d+)-[0-9a-f]{8}\.)?(?P<kind>partial|previous)$"
)


class CheckpointDirectory:
    """Numbered checkpoints in ``root`` (see the module's docstring).

    Args:
        root: the directory; created by the first save.
        keep: how many complete checkpoints to keep (the newest ones); older
            ones are removed once a newer save is complete. ``None`` keeps
            every one.
        prefix: the name of a checkpoint before its step.
    """

    #: The directory.
    root: Path
    #: How many complete checkpoints are kept (``None``: all).
    keep: int | None
    #: The name of a checkpoint before its step.
    prefix: str

    def __init__(
        self, root: str | os.PathLike[str], *, keep: int | None = None, prefix: str = "step-"
    ) -> None:
        if not isinstance(root, (str, os.PathLike)):
            raise MisconfigurationError(
                f"CheckpointDirectory({root!r}): give the directory's path (a str or a pathlib.Path)"
            )
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool) or keep < 1):
            raise MisconfigurationError(
                f"CheckpointDirectory(keep={keep!r}): give how many complete checkpoints to keep (1 or "
                "more), or None to keep every one"
            )
        if not isinstance(prefix, str) or not prefix or "/" in prefix or prefix.startswith("."):
            raise MisconfigurationError(
                f"CheckpointDirectory(prefix={prefix!r}): give a file-name prefix such as 'step-' (no '/', "
                "not starting with '.')"
            )
        self.root = Path(root)
        self.keep = keep
        self.prefix = prefix
        self._name = re.compile(re.escape(prefix) + r"(\d+)$")

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` goes."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise MisconfigurationError(f"CheckpointDirectory.path({step!r}): a step is an int, 0 or more")
        return self.root / f"{self.prefix}{step:08d}"

    def checkpoints(self) -> list[tuple[int, Path]]:
        """Every complete checkpoint, as (step, path), the oldest first."""
        found = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        for name in names:
            matched = self._name.match(name)
            if matched is not None and _complete(self.root / name):
                found.append((int(matched.group(1)), self.root / name))
        return sorted(found)

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or None where there is none."""
        complete = self.checkpoints()
        return complete[-1][1] if complete else None

    def latest_step(self) -> int | None:
        """The step of :meth:`latest`, or None."""
        complete = self.checkpoints()
        return complete[-1][0] if complete else None

    def save(
        self, strategy: Any, step: int, state: Mapping[str, Any], *, blocking: bool = True
    ) -> SaveHandle:
        """``strategy.save_checkpoint(self.path(step), state, blocking=...)``
        (``strategy``: a :class:`~phalanx_core.Strategy`);
        once it is complete, rank 0 removes the checkpoints beyond
        :attr:`keep` (:meth:`prune`) and what killed saves left
        (:meth:`clear_partials`). Every rank must call it."""
        handle: SaveHandle = strategy.save_checkpoint(self.path(step), state, blocking=blocking)
        if strategy.is_global_zero:
            handle.add_done_callback(lambda _: self._tidy())
        return handle

    def _tidy(self) -> None:
        self.prune()
        self.clear_partials()

    def prune(self) -> list[Path]:
        """Remove the complete checkpoints older than the newest
        :attr:`keep`; return them."""
        if self.keep is None:
            return []
        removed = [path for _, path in self.checkpoints()[: -self.keep]]
        for path in removed:
            _remove(path)
        if removed:
            fsync_directory(self.root)
        return removed

    def clear_partials(self) -> list[Path]:
        """Remove what saves that are no longer running left in the
        directory (partial files and staging directories of checkpoints of
        this directory; a previous sharded checkpoint kept while a new one
        was swapped in, once the new one is there); return them.

        A partial file of a process that still runs on this host is left
        alone; everything else is a killed save's, since one job writes
        here at a time: call it where no save of this job is in flight
        (:meth:`save` does, once its save is complete)."""
        removed = []
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        for name in names:
            matched = _LEFTOVER.match(name)
            if matched is None or self._name.match(matched.group("name")) is None:
                continue
            path = self.root / name
            if matched.group("kind") == "previous" and not _complete(self.root / matched.group("name")):
                continue  # the new one is not there: this is the checkpoint to keep
            pid = int(matched.group("pid") or 0)
            if pid and matched.group("host") == HOST and pid != os.getpid() and _running(pid):
                continue  # a save of another job on this host, still running
            _remove(path)
            removed.append(path)
        return removed

    def __repr__(self) -> str:
        return f"CheckpointDirectory({os.fspath(self.root)!r}, keep={self.keep!r})"


def _complete(path: Path) -> bool:
    """Whether ``path`` is a whole checkpoint: a file (renamed into place
    when whole), or a directory that a sharded save finished."""
    if path.is_file():
        return True
    return path.is_dir() and ((path / _SHARDED_MARK).is_file() or (path / COMPLETE_MARK).is_file())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
