"""The checkpoint files of the torch strategies: every checkpoint any of
them writes, read by any of them, on any number of ranks.

:class:`TorchDistributedCheckpointIO` is the ``checkpoint_io`` of
``single_device``, the DDP family and ``manual``: it writes one file, as
``torch.save`` does (atomically), and reads a file or a sharded
``torch.distributed.checkpoint`` directory (``fsdp``'s
``state_dict_type="sharded"``, written on any number of ranks) as one
whole state: every tensor whole, optimizer states keyed by parameter
index as ``optimizer.state_dict()`` is. (``fsdp`` reads both itself, each
rank only its shards.)
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx_core import MisconfigurationError, TorchCheckpointIO

__all__ = ["TorchDistributedCheckpointIO", "per_rank_directory_error"]

#: The name of one rank's file in ``manual``'s checkpoint directories.
RANK_FILE = "rank-{:05d}.pt"


class TorchDistributedCheckpointIO(TorchCheckpointIO):
    """Writes files (:class:`~phalanx_core.TorchCheckpointIO`); reads files
    and sharded directories (see the module's docstring)."""

    def load(self, path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
        from ._checkpoint.shard_files import METADATA, finish_interrupted_swap

        target = Path(path)
        finish_interrupted_swap(path)  # a sharded save killed while it swapped its checkpoint in
        if not target.is_dir():
            return super().load(path, weights_only=weights_only)

        if (target / METADATA).is_file():
            return read_whole(path, weights_only=weights_only)
        raise per_rank_directory_error(path) or FileNotFoundError(
            f"no checkpoint at {os.fspath(path)!r}: it is a directory, and neither a sharded checkpoint "
            f"(it has no {METADATA}, which a sharded save writes last) nor one of strategy 'manual'; "
            "give the path save_checkpoint() wrote"
        )


def per_rank_directory_error(path: str | os.PathLike[str]) -> MisconfigurationError | None:
    """The error for loading the directory ``path`` as one checkpoint where
    ``manual`` saved one file per rank there; None if it did not."""
    found = sorted(p.name for p in Path(path).glob("rank-*.pt")) if Path(path).is_dir() else []
    if not found:
        return None
    one = os.fspath(Path(path) / found[0])
    return MisconfigurationError(
        f"cannot load {os.fspath(path)!r} as one checkpoint: it holds one file per rank ({len(found)}: "
        f"{', '.join(found[:3])}{', ...' if len(found) > 3 else ''}), which strategy 'manual' writes with "
        "checkpoint_per_rank=True. Each file is the state of one rank's own parallelism, which only your "
        "code knows how to put together, so only 'manual' on as many ranks loads it (each rank its own "
        f"file). Where the ranks held replicas (DDP), load one file, e.g. {one!r}; "
        "to move between strategies, save with checkpoint_per_rank=False (one file)"
    )


def read_whole(path: str | os.PathLike[str], *, weights_only: bool) -> dict[str, Any]:
    """The sharded checkpoint directory ``path`` as one state, read whole
    by this process alone (no collective): tensors whole, optimizer states
    keyed by parameter index, the values saved whole unpickled."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from ._checkpoint.shard_files import (
        LoadPlanner,
        check_shard_files,
        first_line,
        load_value,
        path_of,
        put,
        read_metadata,
    )

    metadata = read_metadata(path)
    check_shard_files(path, metadata, contents=False)
    state: dict[str, Any] = {}
    for flat, md in metadata.state_dict_metadata.items():
        empty = (
            torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        )
        put(state, path_of(metadata, flat), empty)
    try:
        with warnings.catch_warnings():
            # torch warns on every no_dist load that it assumes one process:
            # here that is what was asked for.
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp_load(
                state,
                checkpoint_id=path,
                planner=LoadPlanner(
                    weights_only=weights_only, allow_partial_load=False, path=os.fspath(path)
                ),
                no_dist=True,
            )
    except CheckpointException as exc:
        check_shard_files(path, metadata, contents=True, cause=exc)
        failures = "; ".join(first_line(error) for error, _ in exc.failures.values())
        raise MisconfigurationError(
            f"cannot load the sharded checkpoint {os.fspath(path)!r}: torch.distributed.checkpoint could not "
            f"read it ({failures})"
        ) from exc
    for key, value in state.items():
        if isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata) and isinstance(
            value, bytes
        ):
            state[key] = load_value(
                io.BytesIO(value), weights_only=weights_only, entry=key, path=os.fspath(path)
            )
        elif _optimizer_state_by_name(value):
            state[key] = optimizer_state_by_index(value)
    return state


def _optimizer_state_by_name(value: Any) -> bool:
    """Whether ``value`` is an optimizer state keyed by parameter name (as
    torch's ``get_optimizer_state_dict`` gives it)."""
    if not isinstance(value, Mapping) or not isinstance(value.get("param_groups"), list):
        return False
    groups = value["param_groups"]
    return all(
        isinstance(g, Mapping) and all(isinstance(p, str) for p in g.get("params", ())) for g in groups
    )


def optimizer_state_by_index(state: Mapping[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name (as
    ``get_optimizer_state_dict`` gives it) keyed by parameter index instead,
    as ``optimizer.state_dict()`` is: the index counts the parameters of
    every group, in order."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state.get("state", {}).items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }
