"""Writing an FSDP checkpoint: a sharded directory, every rank writing its
own shards, or one full file, gathered to rank 0 and written there.

The state is split the same way for writing and for reading
(:func:`split_state`): modules, the optimizers (each with the module it
optimizes: torch's checkpoint functions go through it) and the rest.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import FSDPModule

from phalanx_core import MisconfigurationError, SaveHandle

from ..checkpoint_io import optimizer_state_by_index
from .shard_files import beside, swap_in, whole


def save(
    strategy: Any, path: str | os.PathLike[str], state: Mapping[str, Any], *, blocking: bool = True
) -> SaveHandle:
    """Save ``state`` to ``path``: :meth:`FSDPStrategy.save_checkpoint
    <phalanx_torch.fsdp.FSDPStrategy.save_checkpoint>`, for ``strategy``."""
    strategy._check_blocking(blocking)
    strategy._saves.finish()
    modules, optimizers, others = split_state("save_checkpoint", path, state)
    if strategy.state_dict_type == "sharded":
        return _save_sharded(strategy, path, modules, optimizers, others, blocking)
    if Path(path).is_dir():
        raise MisconfigurationError(
            f"save_checkpoint({os.fspath(path)!r}): strategy 'fsdp' with state_dict_type='full' "
            "writes one file there, and it is a directory; choose another path, or pass "
            "state_dict_type='sharded'"
        )
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # Every rank takes part in the gathering; rank 0 gets everything.
    out: dict[str, Any] = {
        key: get_model_state_dict(module, options=options) for key, module in modules.items()
    }
    for key, (optimizer, module) in optimizers.items():
        out[key] = get_optimizer_state_dict(module, optimizer, options=options)
    write = None
    if strategy.is_global_zero:
        for key in optimizers:
            out[key] = optimizer_state_by_index(out[key])
        out.update(plain_state(strategy, others))
        if not blocking:
            out = strategy._saves.stager.stage(out)
        write = functools.partial(strategy.checkpoint_io.save, out, path)
    return _run(strategy, path, write, blocking)


def _save_sharded(
    strategy: Any,
    path: str | os.PathLike[str],
    modules: dict[str, nn.Module],
    optimizers: dict[str, tuple[torch.optim.Optimizer, nn.Module]],
    others: dict[str, Any],
    blocking: bool,
) -> SaveHandle:
    if Path(path).is_file():
        raise MisconfigurationError(
            f"save_checkpoint({os.fspath(path)!r}): strategy 'fsdp' with state_dict_type='sharded' "
            "writes a directory there, and it is a file; choose another path, or pass "
            "state_dict_type='full'"
        )
    out: dict[str, Any] = {key: get_model_state_dict(module) for key, module in modules.items()}
    for key, (optimizer, module) in optimizers.items():
        out[key] = get_optimizer_state_dict(module, optimizer)
    # Other values are pickled whole, so that they come back exactly:
    # torch.distributed.checkpoint would flatten them, losing empty
    # dicts and lists and turning int keys into strings. Tensors go
    # in as tensors.
    out.update({key: whole(value) for key, value in plain_state(strategy, others).items()})
    # Every rank writes its shards into a staging directory beside
    # ``path``; rank 0 swaps it in once all are written and fsynced
    # (torch.distributed.checkpoint fsyncs each file, and its coordinator,
    # rank 0, writes the .metadata last, once every rank has written). A
    # save that does not finish leaves the previous checkpoint at ``path``.
    staging, previous = beside(path, ".partial"), beside(path, ".previous")
    if strategy.is_global_zero:
        for leftover in (staging, previous):  # of a save that was killed
            shutil.rmtree(leftover, ignore_errors=True)
    if strategy.world_size > 1:
        strategy.barrier()
    group = strategy._process_group
    if not blocking:
        # The background writer's collectives go through a group of their
        # own, so that they never interleave with training's.
        out = strategy._saves.stager.stage(out)
        group = _checkpoint_group(strategy)

    def write() -> None:
        dcp_save(out, checkpoint_id=staging, process_group=group)
        if strategy.is_global_zero:
            swap_in(staging, Path(path), previous)

    return _run(strategy, path, write, blocking)


def _run(strategy: Any, path: str | os.PathLike[str], write: Any, blocking: bool) -> SaveHandle:
    """Run ``write`` (this rank's part, or None) now, and return once every
    rank's is done; or in the background, returning its handle."""
    if not blocking:
        handle: SaveHandle = strategy._saves.start(path, write, strategy._agreement(path))
        return handle
    if write is not None:
        write()
    if strategy.world_size > 1:
        strategy.barrier()
    return SaveHandle.finished(path)


def _checkpoint_group(strategy: Any) -> Any:
    """The gloo group of every rank that background saves talk through
    (made once per strategy, by every rank: the first background save is a
    collective call)."""
    group = getattr(strategy, "_checkpoint_pg", None)
    if group is None:
        import torch.distributed as dist

        from .._torch_versions import gloo_connection_lines_hidden

        with gloo_connection_lines_hidden():
            group = dist.new_group(backend="gloo")
        strategy._checkpoint_pg = group
    return group


def split_state(
    call: str, path: str | os.PathLike[str], state: Mapping[str, Any]
) -> tuple[dict[str, nn.Module], dict[str, tuple[torch.optim.Optimizer, nn.Module]], dict[str, Any]]:
    """``state`` as its modules, its optimizers (each with the module of
    ``state`` whose parameters it optimizes) and the rest."""
    modules = {key: value for key, value in state.items() if isinstance(value, nn.Module)}
    for module in modules.values():
        # A forward pass without backward (evaluation) leaves the root,
        # which does not reshard after forward, holding its whole
        # parameters in place of the shards the optimizer steps: shard
        # them again first, as the next backward would.
        for unit in module.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()
    optimizers: dict[str, tuple[torch.optim.Optimizer, nn.Module]] = {}
    others: dict[str, Any] = {}
    for key, value in state.items():
        if key in modules:
            continue
        if not isinstance(value, torch.optim.Optimizer):
            others[key] = value
            continue
        mine = {id(p) for group in value.param_groups for p in group["params"]}
        owner = next(
            (m for m in modules.values() if mine <= {id(p) for p in m.parameters()}),
            None,
        )
        if owner is None:
            raise MisconfigurationError(
                f"{call}({os.fspath(path)!r}): strategy 'fsdp' saves and loads an optimizer's state "
                f"through the module it optimizes, and the optimizer under {key!r} optimizes parameters "
                f"of none of the modules in the state ({sorted(modules) or 'there are none'}). Put its "
                "module in the state too (state={'model': model, 'optimizer': optimizer})"
            )
        optimizers[key] = (value, owner)
    return modules, optimizers, others


def plain_state(strategy: Any, others: Mapping[str, Any]) -> dict[str, Any]:
    """The values of ``others`` as they are saved (an object's
    ``state_dict()``), with the precision's state under ``"precision"``."""
    out = {
        key: (value.state_dict() if hasattr(value, "state_dict") else value) for key, value in others.items()
    }
    precision_state = strategy.precision.state_dict()
    if precision_state:
        out["precision"] = precision_state
    return out
