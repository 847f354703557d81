"""Writing an FSDP checkpoint: a sharded directory, every rank writing its
own shards, or one full file, gathered to rank 0 and written there.

The state is split the same way for writing and for reading
(:func:`split_state`): modules, the optimizers (each with the module it
optimizes: torch's checkpoint functions go through it) and the rest.
"""

from __future__ import annotations

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

from phalanx_core import MisconfigurationError

from ._shard_files import beside, swap_in, whole


def save(strategy: Any, path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
    """Save ``state`` to ``path``: :meth:`FSDPStrategy.save_checkpoint
    <phalanx_torch.fsdp.FSDPStrategy.save_checkpoint>`, for ``strategy``."""
    modules, optimizers, others = split_state("save_checkpoint", path, state)
    if strategy.state_dict_type == "sharded":
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
        # (torch.distributed.checkpoint fsyncs each file). A save that
        # does not finish leaves the previous checkpoint at ``path``.
        staging, previous = beside(path, ".partial"), beside(path, ".previous")
        if strategy.is_global_zero:
            for leftover in (staging, previous):  # of a save that was killed
                shutil.rmtree(leftover, ignore_errors=True)
        if strategy.world_size > 1:
            strategy.barrier()
        dcp_save(out, checkpoint_id=staging, process_group=strategy._process_group)
        if strategy.world_size > 1:
            strategy.barrier()
        if strategy.is_global_zero:
            swap_in(staging, Path(path), previous)
    else:
        if Path(path).is_dir():
            raise MisconfigurationError(
                f"save_checkpoint({os.fspath(path)!r}): strategy 'fsdp' with state_dict_type='full' "
                "writes one file there, and it is a directory; choose another path, or pass "
                "state_dict_type='sharded'"
            )
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # Every rank takes part in the gathering; rank 0 gets everything.
        out = {key: get_model_state_dict(module, options=options) for key, module in modules.items()}
        for key, (optimizer, module) in optimizers.items():
            out[key] = get_optimizer_state_dict(module, optimizer, options=options)
        if strategy.is_global_zero:
            for key in optimizers:
                out[key] = _optimizer_state_by_index(out[key])
            out.update(plain_state(strategy, others))
            strategy.checkpoint_io.save(out, path)
    if strategy.world_size > 1:
        strategy.barrier()


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


def _optimizer_state_by_index(state: dict[str, Any]) -> dict[str, Any]:
    """A full optimizer state keyed by parameter name (as
    ``get_optimizer_state_dict`` gives it) keyed by parameter index instead,
    as ``optimizer.state_dict()`` is: the index counts the parameters of
    every group, in order."""
    names = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]} for group in state["param_groups"]
        ],
    }
