"""The files of a sharded checkpoint: a :mod:`torch.distributed.checkpoint`
directory, its ``.metadata`` and the shard files that it places records in.

Writing: every rank writes its shards into a staging directory beside the
path, which rank 0 then swaps in (:func:`beside`, :func:`swap_in`); values
other than tensors go in pickled whole (:func:`whole`). Reading: where each
saved value was in the nested state (:func:`path_of`), and, before and after
torch reads the files, whether they are whole (:func:`read_metadata`,
:func:`check_shard_files`): an error then names the damaged file and what is
wrong with it.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from phalanx_core import MisconfigurationError
from phalanx_core.checkpoint import fsync_directory, torch_save_damage, weights_only_refusal

#: The file every torch.distributed.checkpoint directory has.
METADATA = ".metadata"


# -- writing ----------------------------------------------------------------------------


def beside(path: str | os.PathLike[str], suffix: str) -> Path:
    """The path next to ``path`` with ``suffix`` added to its name."""
    target = Path(path)
    return target.with_name(target.name + suffix)


def swap_in(staging: Path, path: Path, previous: Path) -> None:
    """Put the finished directory ``staging`` at ``path``: the old one moves
    aside to ``previous`` first (a directory cannot be renamed over a
    non-empty one), then is removed. Between the two renames ``path`` is
    missing and both checkpoints are whole; load says so."""
    fsync_directory(staging)
    if path.exists():
        path.rename(previous)
    staging.rename(path)
    fsync_directory(path.parent)
    shutil.rmtree(previous, ignore_errors=True)


def finish_interrupted_swap(path: str | os.PathLike[str]) -> bool:
    """Where a save was killed between the two renames of :func:`swap_in`
    (nothing at ``path``, the previous checkpoint whole beside it), finish
    what it began: put the new checkpoint at ``path`` if it is whole (its
    ``.metadata`` is written last), else the previous one back. Return
    whether a checkpoint is at ``path`` now. Safe to call from every rank
    at once: one rename wins, the others find it done."""
    target = Path(path)
    if target.exists():
        return True
    staging, previous = beside(path, ".partial"), beside(path, ".previous")
    if not (previous / METADATA).is_file():
        return False
    source = staging if (staging / METADATA).is_file() else previous
    with contextlib.suppress(FileNotFoundError, FileExistsError, OSError):
        source.rename(target)
    with contextlib.suppress(OSError):
        fsync_directory(target.parent)
    return target.exists()


def whole(value: Any) -> Any:
    """``value`` for a sharded checkpoint: a tensor as it is, anything else
    pickled by ``torch.save`` into bytes (read back by ``torch.load``)."""
    if isinstance(value, torch.Tensor):
        return value
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


# -- reading: where each value was -------------------------------------------------------


def path_of(metadata: Metadata, flat: str) -> tuple[Any, ...]:
    """Where a key of a checkpoint's flattened state was in the nested state
    that was saved (the default save planner records it)."""
    mapping = metadata.planner_data
    if isinstance(mapping, Mapping) and flat in mapping:
        return tuple(mapping[flat])
    return (flat,)


def saved_paths(metadata: Metadata) -> list[tuple[Any, ...]]:
    """Where every saved value was in the nested state (:func:`path_of`)."""
    return [path_of(metadata, flat) for flat in metadata.state_dict_metadata]


def saved_shapes(metadata: Metadata, key: str) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors saved under the module entry ``key``."""
    shapes = {}
    for flat, md in metadata.state_dict_metadata.items():
        where = path_of(metadata, flat)
        if where[0] == key and len(where) == 2 and isinstance(md, TensorStorageMetadata):
            shapes[where[1]] = tuple(md.size)
    return shapes


def put(root: dict[str, Any], where: tuple[Any, ...], value: Any) -> None:
    """Set ``value`` at ``where`` (dict keys and list indices) in ``root``,
    making the dicts and lists on the way."""
    node: Any = root
    for part, after in itertools.pairwise(where):
        if isinstance(node, list):
            node.extend([None] * (part + 1 - len(node)))
            if node[part] is None:
                node[part] = [] if isinstance(after, int) else {}
        elif part not in node:
            node[part] = [] if isinstance(after, int) else {}
        node = node[part]
    if isinstance(node, list):
        node.extend([None] * (where[-1] + 1 - len(node)))
    node[where[-1]] = value


# -- checking the files -----------------------------------------------------------------


def first_line(exc: BaseException) -> str:
    """``exc`` as its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _damaged(path: str | os.PathLike[str], file: str, what: str) -> str:
    return (
        f"load_checkpoint({os.fspath(path)!r}): the sharded checkpoint is damaged: its file {file!r} {what}. "
        "Load an earlier checkpoint, or copy this directory again in full from where it came from"
    )


def read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The ``.metadata`` of the sharded checkpoint ``path``, or the error
    that names it and says what is wrong with it."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:
        what = (
            "is empty (0 bytes)"
            if (Path(path) / METADATA).stat().st_size == 0
            else f"cannot be read ({first_line(exc)}): it is truncated, damaged, or not a checkpoint's "
            "metadata"
        )
        raise MisconfigurationError(_damaged(path, METADATA, what)) from exc
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), Mapping):
        raise MisconfigurationError(
            _damaged(path, METADATA, f"holds a {type(metadata).__name__}, not a checkpoint's Metadata")
        )
    return metadata


def check_shard_files(
    path: str | os.PathLike[str], metadata: Metadata, *, contents: bool, cause: BaseException | None = None
) -> None:
    """Refuse a sharded checkpoint whose ``.metadata`` names a file that
    is missing or shorter than the records it places in it; with
    ``contents``, also one whose records are not what ``torch.save`` wrote
    (reading them all: done once a load has failed, to say why)."""
    records: dict[str, list[tuple[int, int, str, bool]]] = {}
    for index, info in metadata.storage_data.items():
        records.setdefault(info.relative_path, []).append(
            (info.offset, info.length, getattr(index, "fqn", str(index)), not info.transform_descriptors)
        )
    for name, placed in sorted(records.items()):
        file = Path(path) / name
        if not file.is_file():
            present = sorted(p.name for p in Path(path).iterdir())
            what = f"is missing (its .metadata lists it; the directory has {some(present)})"
            raise MisconfigurationError(_damaged(path, name, what)) from cause
        size = file.stat().st_size
        end = max(offset + length for offset, length, _, _ in placed)
        if size < end:
            what = f"is truncated: it has {size:,} bytes, and the .metadata places records up to byte {end:,}"
            raise MisconfigurationError(_damaged(path, name, what)) from cause
        if not contents:
            continue
        with file.open("rb") as stream:
            for offset, length, entry, plain in sorted(placed):
                if not plain:  # written through a transform (compressed): not checked
                    continue
                stream.seek(offset)
                damage = torch_save_damage(io.BytesIO(stream.read(length)))
                if damage is not None:
                    where = f"bytes {offset:,} to {offset + length:,}"
                    what = f"has a damaged record of {entry!r} ({where}): it {damage}"
                    raise MisconfigurationError(_damaged(path, name, what)) from cause


class LoadPlanner(DefaultLoadPlanner):
    """The default load planner, which unpickles every non-tensor value
    with ``weights_only=False``; with ``weights_only`` each value is first
    unpickled with ``weights_only=True``, which refuses anything but tensors
    and plain data."""

    def __init__(self, *, weights_only: bool, allow_partial_load: bool, path: str = "") -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.weights_only = weights_only
        self.path = path

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self.weights_only:
            entry = getattr(getattr(read_item, "dest_index", None), "fqn", "?")
            load_value(value, weights_only=True, entry=entry, path=self.path)
            value.seek(0)
        super().load_bytes(read_item, value)


def load_value(value: io.BytesIO, *, weights_only: bool, entry: str, path: str) -> Any:
    """``torch.load`` of one pickled value of a sharded checkpoint; with
    ``weights_only``, a value that names code to run is refused as core's
    checkpoint error naming ``entry`` and ``path`` (nothing runs)."""
    try:
        return torch.load(value, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as exc:
        refused = weights_only_refusal(exc, f"the entry {entry!r} of the checkpoint {path!r}")
        if refused is None:
            raise
        raise refused from exc


def some(names: list[str]) -> str:
    """The first three of ``names``, and how many more there are."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
