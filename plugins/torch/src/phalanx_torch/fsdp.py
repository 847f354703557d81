"""Fully sharded data parallel: torch's FSDP2 (``fully_shard``).

Every rank holds a shard of each parameter, gradient and optimizer state (a
:class:`~torch.distributed.tensor.DTensor` sharded on dim 0 over a 1-D
device mesh of the whole world); the forward and backward passes gather the
full parameters unit by unit and reduce-scatter the gradients.
:func:`~torch.distributed.fsdp.fully_shard` changes the module in place (its
class becomes ``FSDP<Name>``), so there is no wrapper to unwrap.

Checkpoints are either sharded (a :mod:`torch.distributed.checkpoint`
directory: each rank writes its own shards, and a job with another number of
ranks can read them) or full (one ordinary ``torch.save`` file written by
rank 0, readable by every other strategy).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import shutil
import warnings
from collections.abc import Callable, Generator, Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.utils import _sync_module_states

from phalanx_core import MisconfigurationError, check_module_keys
from phalanx_core.checkpoint import check_module_shapes, fsync_directory, torch_save_damage

from .strategies import TorchGroupStrategy

__all__ = ["FSDPStrategy"]

#: The values of ``state_dict_type``, with what each writes.
STATE_DICT_TYPES = {
    "sharded": "a torch.distributed.checkpoint directory, every rank writing its own shards",
    "full": "one torch.save file with the full state, written by rank 0",
}

#: The file every torch.distributed.checkpoint directory has.
_DCP_METADATA = ".metadata"
#: Bytes per broadcast of the initial weights (DDP's default bucket).
_BROADCAST_BUCKET = 250 * 1024 * 1024


class FSDPStrategy(TorchGroupStrategy):
    """Fully sharded data parallel with torch's ``fully_shard`` (FSDP2).

    :meth:`setup` shards the module over a 1-D device mesh of every rank
    (:meth:`device_mesh`: over the strategy's collective, so its
    all-gathers and reduce-scatters are the collective's operations):
    first each submodule chosen by ``shard_modules`` (innermost first), each
    its own unit that is gathered only while it runs, then the root, which
    takes every parameter left. Optimizers must be given as factories
    (``functools.partial(torch.optim.AdamW, lr=1e-3)``) so that they are made
    from the sharded parameters.

    Options (given to :func:`phalanx.resolve` as keywords):
        reshard_after_forward: free the gathered parameters of each unit after
            its forward and gather them again in backward (``True``, less
            memory), or keep them until backward (``False``, less
            communication). ``None`` (the default, torch's) is ``True`` for
            every unit but the root, whose parameters backward needs first:
            resharding the root too costs one more all-gather per step.
        shard_modules: what besides the root is sharded as its own unit:
            ``None`` (the root only), a class of module or a set/tuple/list
            of them (every submodule that is an instance), or a callable
            ``(module) -> bool``. Shard the repeated blocks of a model
            (``{TransformerBlock}``) so that only one is gathered at a time.
        cpu_offload: keep the sharded parameters, gradients and optimizer
            state in CPU memory (``CPUOffloadPolicy``); the optimizer step
            then runs on the CPU. Only useful on an accelerator.
        mp_policy: a :class:`torch.distributed.fsdp.MixedPrecisionPolicy`
            (dtypes of the gathered parameters and of the gradient
            reduction), passed to every ``fully_shard`` call. ``None`` (the
            default) passes none; the precision's autocast still applies.
        state_dict_type: how :meth:`save_checkpoint` writes: ``"sharded"`` (a
            :mod:`torch.distributed.checkpoint` directory at the path) or
            ``"full"`` (one file, as the other strategies write).
            :meth:`load_checkpoint` reads either, whatever this option is.
    """

    #: fully_shard gathers parameters (all_gather, into one flat buffer) and
    #: reduce-scatters gradients; a gradient norm over shards is an all_reduce.
    traffic: ClassVar[frozenset[str]] = frozenset({"all_gather", "reduce_scatter", "all_reduce"})

    def __init__(
        self,
        *,
        reshard_after_forward: bool | None = None,
        shard_modules: Any = None,
        cpu_offload: bool = False,
        mp_policy: MixedPrecisionPolicy | None = None,
        state_dict_type: str = "sharded",
        **parts: Any,
    ) -> None:
        super().__init__(**parts)
        if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
            raise MisconfigurationError(
                f"strategy 'fsdp': reshard_after_forward={reshard_after_forward!r}; give True (free the "
                "gathered parameters after each forward), False (keep them until backward) or None "
                "(the default: True for every unit but the root)"
            )
        if not isinstance(cpu_offload, bool):
            raise MisconfigurationError(
                f"strategy 'fsdp': cpu_offload={cpu_offload!r}; give True (sharded parameters, gradients "
                "and optimizer state in CPU memory) or False (on the device, the default)"
            )
        if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
            raise MisconfigurationError(
                f"strategy 'fsdp': mp_policy={mp_policy!r} ({type(mp_policy).__name__}); give a "
                "torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) or None"
            )
        if not isinstance(state_dict_type, str) or state_dict_type not in STATE_DICT_TYPES:
            raise MisconfigurationError(
                f"strategy 'fsdp': state_dict_type={state_dict_type!r}; give "
                + " or ".join(f"{name!r} ({what})" for name, what in STATE_DICT_TYPES.items())
            )
        self.reshard_after_forward = reshard_after_forward
        self.shard_modules = shard_modules
        self._shard_rule = _shard_rule(shard_modules)
        self.cpu_offload = cpu_offload
        self.mp_policy = mp_policy
        self.state_dict_type = state_dict_type
        # Set by module_init_context(empty_init=True): tensors that no
        # reset_parameters() initialises may stay uninitialised (a checkpoint
        # will overwrite them).
        self._uninitialised_allowed = False

    # -- setting up ------------------------------------------------------------

    def setup(self, module: Any, *optimizers: Any) -> Any:
        """Shard ``module`` and make its optimizers from the sharded
        parameters.

        Each optimizer must be a factory taking the parameters
        (``functools.partial(torch.optim.AdamW, lr=1e-3)``): an optimizer
        made before sharding holds the unsharded parameters, which sharding
        replaces. A module created under :meth:`module_init_context` (on the
        meta device) is materialised here, after sharding: each rank
        allocates its shards only and initialises them with the modules'
        ``reset_parameters()``.

        Returns the module, or ``(module, *optimizers)`` when optimizers are
        given.
        """
        for position, optimizer in enumerate(optimizers, start=1):
            if hasattr(optimizer, "step"):
                raise MisconfigurationError(
                    f"strategy 'fsdp': setup(module, ...) got an optimizer instance "
                    f"({type(optimizer).__name__}) as optimizer {position}. fsdp replaces the module's "
                    "parameters by sharded ones, and an optimizer made before holds the old ones. Pass a "
                    "factory instead, which is called with the sharded parameters: "
                    "functools.partial(torch.optim.AdamW, lr=1e-3)"
                )
        self._require_group("fsdp", "setup(module)")
        return super().setup(module, *optimizers)

    def module_to_device(self, module: Any) -> Any:
        """Move ``module`` to :attr:`root_device`; a module on the meta device
        stays there (it is materialised after sharding)."""
        on_meta, elsewhere = _split_by_meta(module)
        if not on_meta:
            return super().module_to_device(module)
        if elsewhere:
            raise MisconfigurationError(
                f"strategy 'fsdp': setup(module) got a module partly on the meta device "
                f"({_some(on_meta)}) and partly not ({_some(elsewhere)}). Create the whole model inside "
                "strategy.module_init_context(), or none of it"
            )
        return module

    def setup_module(self, module: Any) -> Any:
        """Shard ``module`` in place: the submodules chosen by
        ``shard_modules``, innermost first, then the root. A module on the
        meta device is then materialised on :attr:`root_device`."""
        self._require_group("fsdp", "setup(module)")
        if isinstance(module, FSDPModule):
            raise MisconfigurationError(
                f"strategy 'fsdp': setup(module) got a module that is already sharded "
                f"({type(module).__name__}); set up each module once, and keep the module setup() returned"
            )
        on_meta = bool(_split_by_meta(module)[0])
        if on_meta and not self._uninitialised_allowed:
            _refuse_uninitialisable(module)
        device = torch.device(self.root_device)
        mesh = self.device_mesh(device.type)
        offload: OffloadPolicy = (
            # Pinned memory needs an accelerator; on the CPU it is refused.
            CPUOffloadPolicy(pin_memory=device.type != "cpu") if self.cpu_offload else OffloadPolicy()
        )
        options: dict[str, Any] = {
            "mesh": mesh,
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": offload,
        }
        if self.mp_policy is not None:
            options["mp_policy"] = self.mp_policy
        if not on_meta:
            # Every rank starts from rank 0's weights, as under DDP (ranks
            # that seed differently would otherwise start from a mix of
            # shards of each rank's own): DDP's own broadcast, in buckets,
            # through the strategy's group. Meta-device models are made
            # alike on every rank by _materialise instead.
            _sync_module_states(module, self._process_group, _BROADCAST_BUCKET, 0, ())
        # Pre-order reversed: every submodule comes before its ancestors.
        for _, submodule in reversed(list(module.named_modules())):
            if submodule is not module and self._should_shard(submodule):
                fully_shard(submodule, **options)
        fully_shard(module, **options)
        if on_meta:
            _materialise(module, device, self.global_rank)
        return module

    def _should_shard(self, module: nn.Module) -> bool:
        rule = self._shard_rule
        return isinstance(module, rule) if isinstance(rule, tuple) else bool(rule(module))

    def unwrap_module(self, module: Any) -> Any:
        """``fully_shard`` changes the module in place (its class becomes
        ``FSDP<Name>``): there is no wrapper, and the module is returned as
        it is."""
        return module

    @contextlib.contextmanager
    def module_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """A context in which modules are created on the meta device (no
        memory), in the precision's dtype; :meth:`setup` shards them and then
        allocates and initialises only this rank's shards.

        Initialisation is each module's ``reset_parameters()`` (as
        ``torch.nn`` layers have), called on the sharded module. A parameter
        or buffer of a module without ``reset_parameters()`` could not be
        initialised, so :meth:`setup` refuses it, unless ``empty_init=True``
        (a checkpoint will overwrite everything; those tensors are left
        uninitialised until then). With ``empty_init=False`` modules are
        created on :attr:`root_device` as in the other strategies, whole on
        every rank.
        """
        if empty_init is False:
            with super().module_init_context(empty_init=False):
                yield
            return
        self._uninitialised_allowed = bool(empty_init)
        with torch.device("meta"), self.precision.module_init_context():
            yield

    # -- training steps ----------------------------------------------------------

    def no_backward_sync(self, module: Any, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """A context in which backward accumulates gradients on each rank
        without reducing them (gradient accumulation): the next backward
        outside it reduces everything accumulated. ``module`` is the one
        :meth:`setup` returned."""
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, FSDPModule):
            raise MisconfigurationError(
                f"strategy 'fsdp': no_backward_sync() needs the module returned by strategy.setup() (a "
                f"module sharded by fully_shard); got {type(module).__name__}"
            )
        return _without_gradient_sync(module)

    def clip_gradients(
        self,
        module: Any,
        optimizer: Any,
        *,
        max_norm: float | None = None,
        clip_val: float | None = None,
        norm_type: float = 2.0,
    ) -> Any:
        """Clip the sharded gradients by norm (``max_norm``) or by value
        (``clip_val``). The norm is that of the whole, unsharded gradient
        (reduced over the ranks), returned as a plain tensor, the same on
        every rank."""
        norm = super().clip_gradients(
            module, optimizer, max_norm=max_norm, clip_val=clip_val, norm_type=norm_type
        )
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    # -- checkpoints ------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
        """Save ``state`` to ``path``, as ``state_dict_type`` says.

        Modules and optimizers in ``state`` are saved through
        :mod:`torch.distributed.checkpoint.state_dict` (keys are parameter
        names); an optimizer's module must be in ``state`` too. Other objects
        with a ``state_dict()`` are saved as it, other values as they are
        (rank 0's), and the precision's state under ``"precision"``.
        ``weights_only`` loading needs them to be plain data and tensors.

        - ``"sharded"``: ``path`` becomes a :mod:`torch.distributed.checkpoint`
          directory; every rank writes its shards. The values that are not
          modules, optimizers or tensors are pickled whole into it (so that
          they come back exactly as they were).
        - ``"full"``: the full state is gathered to rank 0, which writes one
          file with :attr:`checkpoint_io`. Optimizer states are keyed by
          parameter index there, as ``optimizer.state_dict()`` is, so that
          any strategy can load the file.

        Every rank must call it; every rank returns once the checkpoint is
        complete.
        """
        modules, optimizers, others = self._split_state("save_checkpoint", path, state)
        if self.state_dict_type == "sharded":
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
            out.update({key: _whole(value) for key, value in self._plain_state(others).items()})
            # Every rank writes its shards into a staging directory beside
            # ``path``; rank 0 swaps it in once all are written and fsynced
            # (torch.distributed.checkpoint fsyncs each file). A save that
            # does not finish leaves the previous checkpoint at ``path``.
            staging, previous = _beside(path, ".partial"), _beside(path, ".previous")
            if self.is_global_zero:
                for leftover in (staging, previous):  # of a save that was killed
                    shutil.rmtree(leftover, ignore_errors=True)
            if self.world_size > 1:
                self.barrier()
            dcp_save(out, checkpoint_id=staging, process_group=self._process_group)
            if self.world_size > 1:
                self.barrier()
            if self.is_global_zero:
                _swap_in(staging, Path(path), previous)
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
            if self.is_global_zero:
                for key in optimizers:
                    out[key] = _optimizer_state_by_index(out[key])
                out.update(self._plain_state(others))
                self.checkpoint_io.save(out, path)
        if self.world_size > 1:
            self.barrier()

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        state: Mapping[str, Any] | None = None,
        *,
        strict: bool = True,
        weights_only: bool = True,
    ) -> dict[str, Any]:
        """Load the checkpoint at ``path``: a directory written with
        ``state_dict_type="sharded"``, or a file (written with ``"full"``,
        or by any other strategy).

        Modules and optimizers in ``state`` are restored in place (each
        optimizer's module must be in ``state`` too), other objects with a
        ``load_state_dict()`` get their entry; the remaining entries of the
        checkpoint are returned. With ``strict``, a key of ``state`` missing
        from the checkpoint is an error, and so are mismatched module keys.
        With ``weights_only`` nothing but tensors and plain data is
        unpickled. Every rank must call it.
        """
        target = Path(path)
        if target.is_dir():
            if not (target / _DCP_METADATA).is_file():
                raise FileNotFoundError(
                    f"load_checkpoint({os.fspath(path)!r}): this directory is not a sharded checkpoint "
                    f"(it has no {_DCP_METADATA} file, which a save writes last); give a directory that "
                    "save_checkpoint() finished with state_dict_type='sharded', or a checkpoint file"
                )
            return self._load_sharded(path, state or {}, strict=strict, weights_only=weights_only)
        if target.is_file():
            return self._load_full(path, state or {}, strict=strict, weights_only=weights_only)
        previous, staging = _beside(path, ".previous"), _beside(path, ".partial")
        if (previous / _DCP_METADATA).is_file() and (staging / _DCP_METADATA).is_file():
            raise FileNotFoundError(
                f"load_checkpoint({os.fspath(path)!r}): no checkpoint there: a sharded save was stopped "
                f"while it swapped its new checkpoint in. The previous one is whole at {str(previous)!r}, "
                f"the new one at {str(staging)!r}; rename the one you want to {os.fspath(path)!r}"
            )
        raise FileNotFoundError(
            f"load_checkpoint({os.fspath(path)!r}): no checkpoint there (neither a file nor a directory); "
            "give the path save_checkpoint() wrote"
        )

    def _load_sharded(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], *, strict: bool, weights_only: bool
    ) -> dict[str, Any]:
        metadata = _read_metadata(path)
        _check_shard_files(path, metadata, contents=False)
        saved = _saved_paths(metadata)
        present = {p[0] for p in saved}
        wanted = _present(path, "the checkpoint", state, present, strict)
        modules, optimizers, others = self._split_state("load_checkpoint", path, wanted)
        template: dict[str, Any] = {}
        for key, module in modules.items():
            template[key] = get_model_state_dict(module)
            if strict:
                check_module_keys(path, key, set(template[key]), {p[1] for p in saved if p[0] == key})
            check_module_shapes(path, key, template[key], _saved_shapes(metadata, key))
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
            where = _path_of(metadata, flat)
            if where[0] not in kept:
                _put(
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
                process_group=self._process_group,
                planner=_LoadPlanner(weights_only=weights_only, allow_partial_load=not strict),
            )
        except CheckpointException as exc:  # raised on every rank, with every rank's failure
            # Name the damaged file, if one is (each rank looks at every
            # file, so that every rank says the same).
            _check_shard_files(path, metadata, contents=True, cause=exc)
            failures = "; ".join(
                f"rank {rank}: {_first_line(error)}" for rank, (error, _) in exc.failures.items()
            )
            raise MisconfigurationError(
                f"load_checkpoint({os.fspath(path)!r}): torch.distributed.checkpoint could not read the "
                f"sharded checkpoint ({failures}). Its files are whole, so it was probably saved from other "
                "modules or optimizers: load it into ones like those it was saved from"
            ) from exc
        for key in set(template) - kept:
            if isinstance(metadata.state_dict_metadata.get(key), BytesStorageMetadata):
                template[key] = torch.load(
                    io.BytesIO(template[key]), map_location="cpu", weights_only=weights_only
                )
        for key, module in modules.items():
            if key in template:
                set_model_state_dict(module, template.pop(key), options=StateDictOptions(strict=strict))
        for key, (optimizer, module) in optimizers.items():
            if key in template:
                set_optimizer_state_dict(module, optimizer, template.pop(key))
        return self._restore_rest(template, others, wanted)

    def _load_full(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], *, strict: bool, weights_only: bool
    ) -> dict[str, Any]:
        # Rank 0 reads the file and broadcasts what it read, so that only one
        # rank holds the whole state at a time. A failure to read it is
        # every rank's error (no rank is left waiting on a broadcast).
        loaded: dict[str, Any] = {}
        failure: BaseException | None = None
        if self.is_global_zero:
            try:
                loaded = self.checkpoint_io.load(path, weights_only=weights_only)
            except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
                failure = exc
        sharded = {
            key for key, value in state.items() if isinstance(value, (nn.Module, torch.optim.Optimizer))
        }
        head = {key: value for key, value in loaded.items() if key not in sharded}
        # What every rank needs to check the modules and optimizers against
        # the file (only rank 0 sees it): the module keys, the optimizer
        # groups' sizes.
        layout: dict[str, Any] = {
            key: _module_shapes(loaded[key])
            if isinstance(state[key], nn.Module)
            else _group_sizes(loaded[key])
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
        if self.world_size > 1:
            header = self.broadcast_object(header if self.is_global_zero else None, src=0)
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
        modules, optimizers, others = self._split_state("load_checkpoint", path, wanted)
        broadcast = self.world_size > 1
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
                groups = [
                    {k: v for k, v in g.items() if k != "params"} for g in value.get("param_groups", [])
                ]
                for group, hyper in zip(optimizer.param_groups, self.broadcast_object(groups), strict=False):
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
        return self._restore_rest(head, others, wanted)

    def _restore_rest(
        self, loaded: dict[str, Any], others: Mapping[str, Any], wanted: Iterable[str]
    ) -> dict[str, Any]:
        """The precision's state and the non-sharded targets from
        ``loaded``; return what is left of it."""
        if "precision" in loaded:
            self.precision.load_state_dict(loaded.pop("precision"))
        for key in wanted:
            if key not in loaded:  # a module or optimizer, restored already
                continue
            value = loaded.pop(key)
            target: Any = others.get(key)
            if hasattr(target, "load_state_dict"):
                target.load_state_dict(value)
        return loaded

    def _split_state(
        self, call: str, path: str | os.PathLike[str], state: Mapping[str, Any]
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

    def _plain_state(self, others: Mapping[str, Any]) -> dict[str, Any]:
        out = {
            key: (value.state_dict() if hasattr(value, "state_dict") else value)
            for key, value in others.items()
        }
        precision_state = self.precision.state_dict()
        if precision_state:
            out["precision"] = precision_state
        return out


# -- helpers ---------------------------------------------------------------------------


def _beside(path: str | os.PathLike[str], suffix: str) -> Path:
    target = Path(path)
    return target.with_name(target.name + suffix)


def _swap_in(staging: Path, path: Path, previous: Path) -> None:
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


def _shard_rule(shard_modules: Any) -> tuple[type[nn.Module], ...] | Callable[[nn.Module], Any]:
    """``shard_modules`` as a tuple of module classes or a callable, or the
    error saying what it may be. (Kept as data, not as a closure: the
    strategy is pickled to spawned ranks.)"""
    if shard_modules is None:
        return ()
    if isinstance(shard_modules, type):
        shard_modules = (shard_modules,)
    if isinstance(shard_modules, (set, frozenset, tuple, list)):
        if all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in shard_modules):
            return tuple(shard_modules)
    elif callable(shard_modules):
        return shard_modules  # type: ignore[no-any-return]
    raise MisconfigurationError(
        f"strategy 'fsdp': shard_modules={shard_modules!r}; give None (shard the root module only), a module "
        "class or a set of them ({torch.nn.TransformerEncoderLayer}: every submodule of these classes is "
        "its own unit), or a callable that takes a submodule and returns True to shard it"
    )


def _split_by_meta(module: nn.Module) -> tuple[list[str], list[str]]:
    """The names of ``module``'s parameters and buffers on the meta device,
    and of the others."""
    on_meta: list[str] = []
    elsewhere: list[str] = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        (on_meta if tensor.is_meta else elsewhere).append(name)
    return on_meta, elsewhere


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _refuse_uninitialisable(module: nn.Module) -> None:
    """Refuse a module on the meta device with parameters or buffers that
    no ``reset_parameters()`` initialises."""
    missing = [
        f"{prefix + '.' if prefix else ''}{name} ({type(owner).__name__})"
        for prefix, owner in module.named_modules()
        if not callable(getattr(owner, "reset_parameters", None))
        for name, _ in [*owner.named_parameters(recurse=False), *owner.named_buffers(recurse=False)]
    ]
    if missing:
        raise MisconfigurationError(
            "strategy 'fsdp': the module was created on the meta device (module_init_context()), and "
            f"{_some(missing)} belong to modules without a reset_parameters() method, so nothing could "
            "initialise them after sharding. Give those modules a reset_parameters() that initialises their "
            "own parameters and buffers, create the model with module_init_context(empty_init=False), or "
            "with empty_init=True if a checkpoint will overwrite every tensor"
        )


def _materialise(module: nn.Module, device: torch.device, rank: int) -> None:
    """FSDP2's recipe for a sharded module on the meta device: allocate
    this rank's shards, then initialise them through every submodule's
    ``reset_parameters()`` (which works on the sharded DTensors)."""
    module.to_empty(device=device)
    with contextlib.ExitStack() as stack:
        if not _dtensor_rng_supported(device.type):
            # torch 2.13 limitation: DTensor's random operators draw each
            # shard from its rank's own generator except on devices whose
            # torch module has set_rng_state (cuda and the like; not the
            # CPU), and warn. Every rank's generator is in the same state
            # here (seeded alike, or forked), so every shard would get the
            # same values: rows 0..n/2 of each weight equal rows n/2..n.
            # Each rank draws from its own seed instead (taken from the
            # shared generator, so the init is still reproducible), in a
            # forked generator state that leaves the caller's stream as if
            # one number had been drawn.
            seed = int(torch.randint(0, 2**62, ()))
            stack.enter_context(torch.random.fork_rng(devices=[]))
            torch.manual_seed(seed + rank)
            stack.enter_context(warnings.catch_warnings())
            warnings.filterwarnings(
                "ignore", message="DTensor random operators may not have complete support"
            )
        stack.enter_context(torch.no_grad())
        for submodule in module.modules():
            reset = getattr(submodule, "reset_parameters", None)
            if callable(reset):
                reset()


def _dtensor_rng_supported(device_type: str) -> bool:
    """Whether DTensor's random operators give shards of one random tensor
    on this device type (torch's own test, ``is_rng_supported_mesh``)."""
    return hasattr(getattr(torch, device_type, None), "set_rng_state")


@contextlib.contextmanager
def _without_gradient_sync(module: FSDPModule) -> Generator[None, None, None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


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


def _keeps_tensors(optimizer: Any, module: Any) -> bool:
    """Whether the optimizer keeps any tensor state (torch's sharded
    optimizer state dict, which sets up the state it can, says)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

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


def _whole(value: Any) -> Any:
    """``value`` for a sharded checkpoint: a tensor as it is, anything else
    pickled by ``torch.save`` into bytes (read back by ``torch.load``)."""
    if isinstance(value, torch.Tensor):
        return value
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _path_of(metadata: Metadata, flat: str) -> tuple[Any, ...]:
    """Where a key of a checkpoint's flattened state was in the nested state
    that was saved (the default save planner records it)."""
    mapping = metadata.planner_data
    if isinstance(mapping, Mapping) and flat in mapping:
        return tuple(mapping[flat])
    return (flat,)


def _saved_paths(metadata: Metadata) -> list[tuple[Any, ...]]:
    return [_path_of(metadata, flat) for flat in metadata.state_dict_metadata]


def _saved_shapes(metadata: Metadata, key: str) -> dict[str, tuple[int, ...]]:
    """The shapes of the tensors saved under the module entry ``key``."""
    shapes = {}
    for flat, md in metadata.state_dict_metadata.items():
        where = _path_of(metadata, flat)
        if where[0] == key and len(where) == 2 and isinstance(md, TensorStorageMetadata):
            shapes[where[1]] = tuple(md.size)
    return shapes


def _first_line(exc: BaseException) -> str:
    """``exc`` as its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _damaged(path: str | os.PathLike[str], file: str, what: str) -> str:
    return (
        f"load_checkpoint({os.fspath(path)!r}): the sharded checkpoint is damaged: its file {file!r} {what}. "
        "Load an earlier checkpoint, or copy this directory again in full from where it came from"
    )


def _read_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The ``.metadata`` of the sharded checkpoint ``path``, or the error
    that names it and says what is wrong with it."""
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:
        what = (
            "is empty (0 bytes)"
            if (Path(path) / _DCP_METADATA).stat().st_size == 0
            else f"cannot be read ({_first_line(exc)}): it is truncated, damaged, or not a checkpoint's "
            "metadata"
        )
        raise MisconfigurationError(_damaged(path, _DCP_METADATA, what)) from exc
    if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "storage_data", None), Mapping):
        raise MisconfigurationError(
            _damaged(path, _DCP_METADATA, f"holds a {type(metadata).__name__}, not a checkpoint's Metadata")
        )
    return metadata


def _check_shard_files(
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
            what = f"is missing (its .metadata lists it; the directory has {_some(present)})"
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


def _put(root: dict[str, Any], where: tuple[Any, ...], value: Any) -> None:
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


class _LoadPlanner(DefaultLoadPlanner):
    """The default load planner, which unpickles every non-tensor value
    with ``weights_only=False``; with ``weights_only`` each value is first
    unpickled with ``weights_only=True``, which refuses anything but tensors
    and plain data."""

    def __init__(self, *, weights_only: bool, allow_partial_load: bool) -> None:
        super().__init__(allow_partial_load=allow_partial_load)
        self.weights_only = weights_only

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        if self.weights_only:
            torch.load(value, weights_only=True)
            value.seek(0)
        super().load_bytes(read_item, value)
