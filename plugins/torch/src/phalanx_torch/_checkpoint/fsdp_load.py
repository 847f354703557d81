"""Reading an FSDP checkpoint: a sharded directory (each rank reads the
shards it holds, whatever the number of ranks that wrote them) or one full
file (rank 0 reads it and broadcasts it), checked against the modules and
optimizers it is loaded into before anything is loaded.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from phalanx_core import MisconfigurationError, check_module_keys
from phalanx_core.checkpoint import check_module_shapes

from ..checkpoint_io import per_rank_directory_error
from .fsdp_save import split_state
from .shard_files import (
    METADATA,
    LoadPlanner,
    check_shard_files,
    finish_interrupted_swap,
    first_line,
    load_value,
    path_of,
    put,
    read_metadata,
    saved_paths,
    saved_shapes,
)


def load(
    strategy: Any,
    path: str | os.PathLike[str],
    state: Mapping[str, Any] | None,
    *,
    strict: bool,
    weights_only: bool,
) -> dict[str, Any]:
    """Load the checkpoint at ``path``: :meth:`FSDPStrategy.load_checkpoint
    <phalanx_torch.fsdp.FSDPStrategy.load_checkpoint>`, for ``strategy``."""
    strategy._saves.finish()  # a save in flight first
    finish_interrupted_swap(path)
    target = Path(path)
    if target.is_dir():
        if not (target / METADATA).is_file():
            per_rank = per_rank_directory_error(path)
            if per_rank is not None:
                raise per_rank
            raise FileNotFoundError(
                f"load_checkpoint({os.fspath(path)!r}): this directory is not a sharded checkpoint "
                f"(it has no {METADATA} file, which a save writes last); give a directory that "
                "save_checkpoint() finished with state_dict_type='sharded', or a checkpoint file"
            )
        return _load_sharded(strategy, path, state or {}, strict=strict, weights_only=weights_only)
    if target.is_file():
        return _load_full(strategy, path, state or {}, strict=strict, weights_only=weights_only)
    raise FileNotFoundError(
        f"load_checkpoint({os.fspath(path)!r}): no checkpoint there (neither a file nor a directory); "
        "give the path save_checkpoint() wrote"
    )


def _load_sharded(
    strategy: Any,
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    strict: bool,
    weights_only: bool,
) -> dict[str, Any]:
    metadata = read_metadata(path)
    check_shard_files(path, metadata, contents=False)
    saved = saved_paths(metadata)
    present = {p[0] for p in saved}
    wanted = _present(path, "the checkpoint", state, present, strict)
    modules, optimizers, others = split_state("load_checkpoint", path, wanted)
    template: dict[str, Any] = {}
    for key, module in modules.items():
        template[key] = get_model_state_dict(module)
        if strict:
            check_module_keys(path, key, set(template[key]), {p[1] for p in saved if p[0] == key})
        check_module_shapes(path, key, template[key], saved_shapes(metadata, key))
        if not strict:
            names = {p[1] for p in saved if p[0] == key and len(p) == 2}
            template[key] = {name: value for name, value in template[key].items() if name in names}
    for key, (optimizer, module) in optimizers.items():
        template[key] = get_optimizer_state_dict(module, optimizer)
    # Everything else the directory holds is read whole, from what its
    # metadata says (tensors as empty tensors to read into, other values
    # as placeholders the unpickled value replaces).
    kept = set(template)
    for flat, md in metadata.state_dict_metadata.items():
        where = path_of(metadata, flat)
        if where[0] not in kept:
            put(
                template,
                where,
                torch.empty(md.size, dtype=md.properties.dtype)
                if isinstance(md, TensorStorageMetadata)
                else None,
            )
    try:
        dcp_load(
            template,
            checkpoint_id=path,
            process_group=strategy._process_group,
            planner=LoadPlanner(
                weights_only=weights_only, allow_partial_load=not strict, path=os.fspath(path)
            ),
        )
    except CheckpointException as exc:  # raised on every rank, with every rank's failure
        # Name the damaged file, if one is (each rank looks at every
        # file, so that every rank says the same).
        check_shard_files(path, metadata, contents=True, cause=exc)
        failures = "; ".join(f"rank {rank}: {first_line(error)}" for rank, (error, _) in exc.failures.items())
        raise MisconfigurationError(
            f"load_checkpoint({os.fspath(path)!r}): torch.distributed.checkpoint could not read the "
            f"sharded checkpoint ({failures}). Its files are whole, so it was probably saved from other "
            "modules or optimizers: load it into ones like those it was saved from"
        ) from exc
    for key in set(template) - kept:
        if isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
            template[key] = load_value(
                io.BytesIO(template[key]), weights_only=weights_only, entry=key, path=os.fspath(path)
            )
    for key, module in modules.items():
        if key in template:
            set_model_state_dict(module, template.pop(key), options=StateDictOptions(strict=strict))
    for key, (optimizer, module) in optimizers.items():
        if key in template:
            set_optimizer_state_dict(module, optimizer, template.pop(key))
    return _restore_rest(strategy, template, others, wanted)


def _load_full(
    strategy: Any,
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    strict: bool,
    weights_only: bool,
) -> dict[str, Any]:
    # Rank 0 reads the file and broadcasts what it read, so that only one
    # rank holds the whole state at a time. A failure to read it is
    # every rank's error (no rank is left waiting on a broadcast). Rank 0
    # of the strategy's ranks, which is not always the job's one process
    # that writes (is_global_zero): under hsdp_ft each replica group reads
    # its own copy.
    reader = strategy.global_rank == 0
    loaded: dict[str, Any] = {}
    failure: BaseException | None = None
    if reader:
        try:
            loaded = strategy.checkpoint_io.load(path, weights_only=weights_only)
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            failure = exc
    sharded = {key for key, value in state.items() if isinstance(value, (nn.Module, torch.optim.Optimizer))}
    head = {key: value for key, value in loaded.items() if key not in sharded}
    # What every rank needs to check the modules and optimizers against
    # the file (only rank 0 sees it): the module keys, the optimizer
    # groups' sizes.
    layout: dict[str, Any] = {
        key: _module_shapes(loaded[key]) if isinstance(state[key], nn.Module) else _group_sizes(loaded[key])
        for key in sharded
        if key in loaded
    }
    # A file that is not a whole checkpoint is the same error on every
    # rank; anything else rank 0 met, a RuntimeError that quotes it.
    problem: tuple[bool, str] | None = None
    if failure is not None:
        ours = isinstance(failure, MisconfigurationError)
        problem = (ours, str(failure) if ours else repr(failure))
    header = (problem, sorted(loaded), head, layout)
    if strategy.world_size > 1:
        header = strategy.broadcast_object(header if reader else None, src=0)
    problem, present_keys, head, layout = header
    if failure is not None:
        raise failure
    if problem is not None:
        ours, message = problem
        if ours:
            raise MisconfigurationError(message)
        raise RuntimeError(
            f"load_checkpoint({os.fspath(path)!r}): rank 0 could not read the checkpoint file: {message}"
        )
    present = set(present_keys)
    wanted = _present(path, "the file", state, present, strict)
    modules, optimizers, others = split_state("load_checkpoint", path, wanted)
    broadcast = strategy.world_size > 1
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=strict)
    # Every check on every rank (none is left waiting), before anything
    # is loaded.
    for key, module in modules.items():
        if layout[key] is None:
            raise MisconfigurationError(
                f"load_checkpoint({os.fspath(path)!r}): the entry {key!r} is not a module's state dict; "
                "give the key under which the module was saved"
            )
        mine = get_model_state_dict(module)
        if strict:
            check_module_keys(path, key, set(mine), set(layout[key]))
        check_module_shapes(path, key, mine, layout[key])
    for key, (optimizer, _) in optimizers.items():
        _check_group_sizes(path, key, layout[key], optimizer)
    # Rank 0 gives the full state dicts, the other ranks empty ones.
    for key, module in modules.items():
        set_model_state_dict(module, loaded.get(key, {}), options=options)
    for key, (optimizer, module) in optimizers.items():
        value = loaded.get(key, {})
        if not _keeps_tensors(optimizer, module):
            # Plain SGD keeps no state, only hyperparameters; torch's
            # loader takes its device from the state and fails without.
            groups = [{k: v for k, v in g.items() if k != "params"} for g in value.get("param_groups", [])]
            for group, hyper in zip(optimizer.param_groups, strategy.broadcast_object(groups), strict=False):
                group.update(hyper)
            continue
        if value:
            value = _optimizer_state_by_name(value, optimizer, module)
        set_optimizer_state_dict(
            module,
            optimizer,
            value,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast),
        )
        _retype_groups(optimizer)
    return _restore_rest(strategy, head, others, wanted)


def _restore_rest(
    strategy: Any, loaded: dict[str, Any], others: Mapping[str, Any], wanted: Iterable[str]
) -> dict[str, Any]:
    """The precision's state and the non-sharded targets from
    ``loaded``; return what is left of it."""
    if "precision" in loaded:
        strategy.precision.load_state_dict(loaded.pop("precision"))
    for key in wanted:
        if key not in loaded:  # a module or optimizer, restored already
            continue
        value = loaded.pop(key)
        target: Any = others.get(key)
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(value)
    return loaded


def _present(
    path: str | os.PathLike[str], where: str, state: Mapping[str, Any], present: set[str], strict: bool
) -> dict[str, Any]:
    """The entries of ``state`` the checkpoint has; with ``strict``, one it
    has not is an error (the precision's state is not the user's key)."""
    for key in state:
        if key not in present and strict:
            raise MisconfigurationError(
                f"load_checkpoint({os.fspath(path)!r}): {where} has no {key!r}; it has "
                f"{sorted(present - {'precision'})}. Pass strict=False to load what is there"
            )
    return {key: value for key, value in state.items() if key in present}


def _module_shapes(state: Any) -> dict[str, tuple[int, ...] | None] | None:
    """The keys of a saved module state, each with its tensor's shape (None
    for a value that is not a tensor); None for something that is not a
    module state."""
    if not isinstance(state, Mapping) or not all(isinstance(key, str) for key in state):
        return None
    return {
        key: tuple(value.shape) if isinstance(value, torch.Tensor) else None for key, value in state.items()
    }


def _group_sizes(state: Any) -> list[int] | None:
    """How many parameters each group of a saved optimizer state has (None
    for something that is not an optimizer state)."""
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list):
        return None
    return [len(group.get("params", ())) for group in state["param_groups"]]


def _check_group_sizes(
    path: str | os.PathLike[str], key: str, sizes: list[int] | None, optimizer: Any
) -> None:
    mine = [len(group["params"]) for group in optimizer.param_groups]
    if sizes is None:
        raise MisconfigurationError(
            f"load_checkpoint({os.fspath(path)!r}): the entry {key!r} is not an optimizer state (it has no "
            "param_groups); give the key under which the optimizer was saved"
        )
    if sizes != mine:
        raise MisconfigurationError(
            f"load_checkpoint({os.fspath(path)!r}): the optimizer state under {key!r} has parameter "
            f"groups of {sizes} parameters, and the optimizer has {mine}; load it into an optimizer like "
            "the one it was saved from"
        )


def _retype_groups(optimizer: Any) -> None:
    """Give back the tuples that torch's broadcast of a full optimizer state
    turns into lists (Adam's ``betas``), where the optimizer's defaults
    have a tuple: the groups are then as they were saved."""
    for group in optimizer.param_groups:
        for key, default in optimizer.defaults.items():
            if isinstance(default, tuple) and isinstance(group.get(key), list):
                group[key] = tuple(group[key])


def _keeps_tensors(optimizer: Any, module: Any) -> bool:
    """Whether the optimizer keeps any tensor state (torch's sharded
    optimizer state dict, which sets up the state it can, says)."""
    state: Any = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=False))
    return any(
        getattr(value, "dim", lambda: 0)() > 0
        for entry in state.get("state", {}).values()
        for value in entry.values()
    )


def _optimizer_state_by_name(state: dict[str, Any], optimizer: Any, module: nn.Module) -> dict[str, Any]:
    """An optimizer state keyed by parameter index (``optimizer.state_dict()``)
    keyed by the parameter names of ``module`` instead, matching the saved
    groups with ``optimizer``'s groups in order, as
    ``optimizer.load_state_dict`` does (:func:`_check_group_sizes` checked
    that they match). A state keyed by name is returned as it is."""
    groups = state["param_groups"]
    if all(isinstance(i, str) for group in groups for i in group["params"]):
        return state
    # A tied parameter (a GPT's embedding and output layer) is named by its
    # first name, as named_parameters() and torch's checkpoint functions name it.
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    by_index = {
        i: names[id(p)]
        for saved, group in zip(groups, optimizer.param_groups, strict=True)
        for i, p in zip(saved["params"], group["params"], strict=True)
    }
    return {
        "state": {by_index[i]: value for i, value in state.get("state", {}).items()},
        "param_groups": [{**group, "params": [by_index[i] for i in group["params"]]} for group in groups],
    }
