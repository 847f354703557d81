"""How a strategy writes and reads checkpoint files.

Writes are atomic and durable: :class:`TorchCheckpointIO` writes to a
temporary file of its own in the same directory, fsyncs it, renames it over
the path and fsyncs the directory, so the path holds either the previous
checkpoint or the new one, whole, even after a crash or a power loss.

Reads say what is wrong: a file that is empty, truncated, damaged or not a
checkpoint at all is a :class:`~phalanx_core.MisconfigurationError` that
names the file (:func:`torch_save_damage` tells which).
"""

from __future__ import annotations

import contextlib
import errno
import os
import pickle
import re
import secrets
import socket
import zipfile
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

from .errors import MisconfigurationError

__all__ = [
    "CheckpointIO",
    "TorchCheckpointIO",
    "check_module_keys",
    "check_module_shapes",
    "clear_stale_partials",
    "fsync_directory",
    "partial_path",
    "torch_save_damage",
    "weights_only_refusal",
]

#: What to do about a checkpoint file that is damaged, and about a file
#: that is not a checkpoint.
_ADVICE_DAMAGED = (
    "Load an earlier checkpoint, or copy this one again in full from where it came from (a save that "
    "did not finish leaves the previous file at the path, never part of a new one)"
)
_ADVICE_FOREIGN = "Give the path of a file that save_checkpoint() wrote"


class CheckpointIO(ABC):
    """Writes and reads one checkpoint file. A strategy holds one."""

    @abstractmethod
    def save(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """Write ``state`` (plain data and tensors) to ``path``, creating
        its parent directories."""

    @abstractmethod
    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
        """Read what :meth:`save` wrote. With ``weights_only`` (the
        default) nothing but tensors and plain data is unpickled."""


class TorchCheckpointIO(CheckpointIO):
    """``torch.save`` / ``torch.load``.

    ``save()`` drops the checkpoint it replaces from the page cache
    (``drop_cached``), writes to a temporary file next to ``path``
    (``<name>.<host>-<pid>-<random>.partial``: processes or ranks saving to
    one path at once never share it), fsyncs it, renames it to ``path`` and
    fsyncs the directory. A save that fails removes its temporary file; one
    that is killed leaves it, and the previous checkpoint, untouched, and
    the next save to the same path removes it
    (``clear_stale_partials``).

    ``load()`` raises :class:`~phalanx_core.MisconfigurationError`, naming
    the file, for a file that is empty, truncated, damaged, not written by
    ``torch.save``, or not a dict of named entries.
    """

    def save(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        import torch

        target = Path(path)
        _make_directories(target.parent)
        clear_stale_partials(target)
        drop_cached(target)
        temporary = partial_path(target)
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        try:
            with open(fd, "wb") as file:
                torch.save(state, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        fsync_directory(target.parent)

    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
        import torch

        if Path(path).is_dir():
            raise FileNotFoundError(
                f"no checkpoint file at {os.fspath(path)!r}: it is a directory (a sharded checkpoint "
                "of strategy 'fsdp', or per-rank files of 'manual'?), and this checkpoint_io "
                f"({type(self).__name__}) reads files only. The strategies of phalanx-torch read sharded "
                "directories too (their checkpoint_io, TorchDistributedCheckpointIO)"
            )
        if not Path(path).is_file():
            raise FileNotFoundError(f"no checkpoint file at {os.fspath(path)!r}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=weights_only)
        except OSError:
            raise  # cannot open it: the error names the file
        except Exception as exc:
            with open(path, "rb") as file:
                found = _damage(file)
            refused = weights_only_refusal(exc, f"the checkpoint file {os.fspath(path)!r}")
            if found is None and refused is not None:
                raise refused from exc
            if found is None:
                if not isinstance(exc, (EOFError, pickle.UnpicklingError)):
                    raise  # a whole file: torch's own error says what to do
                found = f"cannot be unpickled ({_first_line(exc)}): it is truncated or damaged", False
            damage, foreign = found
            advice = _ADVICE_FOREIGN if foreign else _ADVICE_DAMAGED
            raise MisconfigurationError(
                f"cannot load the checkpoint file {os.fspath(path)!r}: it {damage}. {advice}"
            ) from exc
        if not isinstance(state, dict) or not all(isinstance(key, str) for key in state):
            what = (
                "a dict whose keys are not all strings"
                if isinstance(state, dict)
                else f"a {_type_name(state)}"
            )
            raise MisconfigurationError(
                f"cannot load the checkpoint file {os.fspath(path)!r}: torch.load reads {what} from it, "
                "and a checkpoint is a dict of named entries ({'model': ..., 'optimizer': ..., ...}). "
                f"{_ADVICE_FOREIGN}, or read this file with torch.load yourself"
            )
        return state


def torch_save_damage(file: IO[bytes]) -> str | None:
    """What is wrong with the bytes of ``file`` (from its start to its end)
    as something ``torch.save`` wrote, as the rest of a sentence whose
    subject is the file ("... is empty (0 bytes)"); ``None`` where nothing
    is: a whole zip archive with a ``data.pkl`` and correct checksums, or a
    file in torch's legacy format (which cannot be checked without
    unpickling it).

    It reads the whole file: call it once loading has failed, to say why.
    """
    found = _damage(file)
    return found[0] if found else None


def _damage(file: IO[bytes]) -> tuple[str, bool] | None:
    """:func:`torch_save_damage`, and whether the file is not torch.save's
    at all (rather than one cut short or damaged)."""
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(0)
    head = file.read(256)
    file.seek(0)
    if size == 0:
        return "is empty (0 bytes)", False
    if head.startswith(b"PK\x03\x04"):
        try:
            with zipfile.ZipFile(file) as archive:
                names = archive.namelist()
                if not any(name == "data.pkl" or name.endswith("/data.pkl") for name in names):
                    listed = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
                    return f"is a zip archive that torch.save did not write (no data.pkl in {listed})", True
                bad = archive.testzip()
        except (zipfile.BadZipFile, EOFError, ValueError, OSError):
            return (
                f"is truncated: it begins as a torch.save archive (zip), but its {size:,} bytes end "
                "before the archive's index, which a complete one ends with"
            ), False
        finally:
            file.seek(0)
        return (f"is damaged: its entry {bad!r} fails its CRC check", False) if bad else None
    if head.startswith(_LEGACY_HEAD):
        return None
    if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return (
            f"is not a torch.save file but a plain pickle ({size:,} bytes, as pickle.dump writes; "
            "torch.save writes a zip archive)"
        ), True
    text = _as_text(head)
    if text is not None:
        return f"is not a torch.save file but text ({size:,} bytes), beginning {text[:60]!r}", True
    return (
        f"is not a torch.save file: its {size:,} bytes begin with {head[:8].hex(' ')}, and torch.save "
        "writes a zip archive, which begins with 50 4b 03 04"
    ), True


def check_module_keys(
    path: str | os.PathLike[str], key: str, expected: Iterable[str], saved: Iterable[str]
) -> None:
    """Refuse a strict load whose saved module keys differ from the
    module's: name the entry, what is missing and what is extra (before
    anything is loaded, where torch's own error comes from deep inside
    ``load_state_dict``, or on one rank only)."""
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        raise MisconfigurationError(
            f"load_checkpoint({os.fspath(path)!r}): the module under {key!r} does not match the checkpoint: "
            f"missing from the checkpoint: {missing or 'none'}; in the checkpoint, not in the module: "
            f"{unexpected or 'none'}. Pass strict=False to load the keys both have"
        )


def check_module_shapes(
    path: str | os.PathLike[str], key: str, expected: Mapping[str, Any], saved: Mapping[str, Any]
) -> None:
    """Refuse a load whose saved tensors have other shapes than the
    module's, before anything is loaded: name the entry and the first
    tensors that differ. ``expected`` is the module's state dict,
    ``saved`` the checkpoint's, with tensors or their shapes (tuples of
    ints); names only one of them has, and values that are neither, are
    not compared."""
    differ = [
        f"{name} is {theirs} in the checkpoint and {mine} in the module"
        for name, value in sorted(expected.items())
        if (mine := _shape(value)) is not None
        and (theirs := _shape(saved.get(name))) is not None
        and theirs != mine
    ]
    if differ:
        raise MisconfigurationError(
            f"load_checkpoint({os.fspath(path)!r}): the module under {key!r} does not match the checkpoint: "
            f"{len(differ)} tensor(s) have another shape: {'; '.join(differ[:3])}"
            f"{'; ...' if len(differ) > 3 else ''}. Load it into a module like the one it was saved from"
        )


def drop_cached(path: str | os.PathLike[str]) -> None:
    """Drop the pages of the file at ``path`` (a checkpoint written and
    fsynced before) from the page cache, before a save that replaces it
    writes as much again: the old file stays whole on disk, and the new
    one is written into the pages it gave back, rather than waiting for the
    kernel to write the old ones back (``bench/checkpoint.py``; its figures
    in bench/README.md); ``torch.save`` into the same file reuses its
    pages through the truncation. Nothing where there is no such file, or
    no ``posix_fadvise`` (Windows, macOS)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_directory(directory: str | os.PathLike[str]) -> None:
    """Make what was renamed, created or removed in ``directory`` durable
    (after ``os.replace``, the new name survives a power loss once this
    returns). Nothing on systems that cannot open a directory (Windows),
    nor on file systems that cannot fsync one."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


# -- the partial files of saves that did not finish ---------------------------------

#: This host's name as partial files carry it (its first label, in the
#: characters a file name keeps).
HOST = re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname().split(".")[0]) or "host"

#: ``<name>.<host>-<pid>-<random>.partial`` (and the ``<name>.<pid>-<random>
#: .partial`` of earlier versions, which named no host).
_PARTIAL = re.compile(r"^(?P<name>.+)\.(?:(?P<host>[A-Za-z0-9_-]+?)-)?(?P<pid>\d+)-[0-9a-f]{8}\.partial$")


def partial_path(target: str | os.PathLike[str]) -> Path:
    """A new temporary path beside ``target`` for a save of this process
    to write before renaming it to ``target``."""
    target = Path(target)
    return target.with_name(f"{target.name}.{HOST}-{os.getpid()}-{secrets.token_hex(4)}.partial")


def clear_stale_partials(target: str | os.PathLike[str]) -> list[Path]:
    """Remove the partial files (:func:`partial_path`) that saves to
    ``target`` left behind when they were killed; return them.

    A partial file is stale when the process that wrote it is gone (it was
    written on this host and its process no longer runs, or it is this
    process's own: its saves finish before the next one starts), or, when
    it came from another host, when ``target`` was written after it (a
    later save to the same path finished). Call it where no other save to
    ``target`` runs on this host's behalf."""
    target = Path(target)
    removed = []
    for candidate in _partials_of(target):
        if is_stale_partial(candidate, target):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(candidate)
            removed.append(candidate)
    return removed


def is_stale_partial(candidate: Path, target: Path | None = None) -> bool:
    """Whether the partial file ``candidate`` belongs to no save that runs
    (see :func:`clear_stale_partials`); False for a name that is not a
    partial file's."""
    found = _PARTIAL.match(candidate.name)
    if found is None:
        return False
    host, pid = found.group("host"), int(found.group("pid"))
    if host is None or host == HOST:
        return pid == os.getpid() or not _running(pid)
    try:
        return target is not None and target.stat().st_mtime > candidate.stat().st_mtime
    except FileNotFoundError:
        return False


def _partials_of(target: Path) -> list[Path]:
    try:
        names = os.listdir(target.parent)
    except FileNotFoundError:
        return []
    return [
        target.parent / name
        for name in names
        if name.startswith(target.name + ".")
        and (found := _PARTIAL.match(name)) is not None
        and found.group("name") == target.name
    ]


def _running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this host (one of another user's
    counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -- helpers ------------------------------------------------------------------------

#: How a file in torch's legacy (before 1.6, not zip) format begins: a
#: pickle (protocol 2) of its magic number.
_LEGACY_HEAD = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


def _shape(value: Any) -> tuple[int, ...] | None:
    """The shape of a tensor, or a shape given as a tuple of ints."""
    if hasattr(value, "shape"):
        return tuple(value.shape)
    if isinstance(value, tuple) and all(isinstance(n, int) for n in value):
        return tuple(value)
    return None


def weights_only_refusal(exc: BaseException, what: str) -> MisconfigurationError | None:
    """The error for ``what`` (a checkpoint file, an entry of a folder)
    when ``exc`` is torch's refusal to unpickle it with ``weights_only``
    (it names code to run); ``None`` for any other error."""
    if not _refused_by_weights_only(exc):
        return None
    return MisconfigurationError(
        f"cannot load {what} with weights_only=True: it holds objects that only full unpickling "
        f"rebuilds, and full unpickling can run any code the file names ({_unsupported(exc)}); "
        "nothing in it was run. If you trust the file (you wrote it), load it with "
        "weights_only=False (strategy.load_checkpoint(path, state, weights_only=False)); otherwise "
        "keep only tensors, numbers, strings and containers of them in a checkpoint"
    )


def _unsupported(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused, in its own words (the
    line that names the global), or its first line."""
    import re

    named = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
    return f"it names {named.group(1)}" if named else _first_line(exc)


def _refused_by_weights_only(exc: BaseException) -> bool:
    return isinstance(exc, pickle.UnpicklingError) and str(exc).startswith("Weights only load failed")


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _first_line(exc: BaseException) -> str:
    """``exc`` as its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _as_text(head: bytes) -> str | None:
    """``head`` as text, if it is printable UTF-8 (the last character may
    be cut)."""
    for cut in range(4):
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        return text if all(c.isprintable() or c in "\t\r\n" for c in text) else None
    return None


def _make_directories(directory: Path) -> None:
    """Create ``directory`` and its missing parents, durably (each new
    directory's entry is fsynced in its parent)."""
    created = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for new in reversed(created):
        fsync_directory(new.parent)
