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
rank 0, readable by every other strategy): written by ``_checkpoint.fsdp_save``, read
by ``_checkpoint.fsdp_load``, the sharded directory's files checked by ``_checkpoint.shard_files``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Generator, Mapping
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from phalanx_core import MisconfigurationError, SaveHandle

from ._checkpoint import fsdp_load, fsdp_save
from ._checkpoint.shard_files import some
from .strategies import TorchGroupStrategy

__all__ = ["FSDPStrategy"]

#: The values of ``state_dict_type``, with what each writes.
STATE_DICT_TYPES = {
    "sharded": "a torch.distributed.checkpoint directory, every rank writing its own shards",
    "full": "one torch.save file with the full state, written by rank 0",
}

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
    #: The name in messages (a subclass registered under another name has its own).
    name: ClassVar[str] = "fsdp"
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
                f"strategy {self.name!r}: reshard_after_forward={reshard_after_forward!r}; give True "
                "(free the gathered parameters after each forward), False (keep them until backward) or None "
                "(the default: True for every unit but the root)"
            )
        if not isinstance(cpu_offload, bool):
            raise MisconfigurationError(
                f"strategy {self.name!r}: cpu_offload={cpu_offload!r}; give True (sharded parameters, "
                "gradients and optimizer state in CPU memory) or False (on the device, the default)"
            )
        if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
            raise MisconfigurationError(
                f"strategy {self.name!r}: mp_policy={mp_policy!r} ({type(mp_policy).__name__}); give a "
                "torch.distributed.fsdp.MixedPrecisionPolicy(param_dtype=..., reduce_dtype=...) or None"
            )
        if not isinstance(state_dict_type, str) or state_dict_type not in STATE_DICT_TYPES:
            raise MisconfigurationError(
                f"strategy {self.name!r}: state_dict_type={state_dict_type!r}; give "
                + " or ".join(f"{name!r} ({what})" for name, what in STATE_DICT_TYPES.items())
            )
        self.reshard_after_forward = reshard_after_forward
        self.shard_modules = shard_modules
        self._shard_rule = _shard_rule(shard_modules, self.name)
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
            if hasattr(optimizer, "step") and not isinstance(optimizer, type):  # a class is a factory
                raise MisconfigurationError(
                    f"strategy {self.name!r}: setup(module, ...) got an optimizer instance "
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
                f"strategy {self.name!r}: setup(module) got a module partly on the meta device "
                f"({some(on_meta)}) and partly not ({some(elsewhere)}). Create the whole model inside "
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
                f"strategy {self.name!r}: setup(module) got a module that is already sharded "
                f"({type(module).__name__}); set up each module once, and keep the module setup() returned"
            )
        on_meta = bool(_split_by_meta(module)[0])
        if on_meta and not self._uninitialised_allowed:
            _refuse_uninitialisable(module, self.name)
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
            # shards of each rank's own): a broadcast in buckets, as DDP's,
            # through the strategy's group. Meta-device models are made
            # alike on every rank by _materialise instead.
            _broadcast_states(module, self._process_group, _BROADCAST_BUCKET)
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
                f"strategy {self.name!r}: no_backward_sync() needs the module returned by strategy.setup() "
                f"(a module sharded by fully_shard); got {type(module).__name__}"
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

    def save_checkpoint(
        self, path: str | os.PathLike[str], state: Mapping[str, Any], *, blocking: bool = True
    ) -> SaveHandle:
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

        Every rank must call it. With ``blocking`` (the default) every rank
        returns once the checkpoint is complete; with ``blocking=False``
        each rank copies what it writes (its shards; for ``"full"``, rank 0
        the gathered state) into host memory and writes it in the
        background, returning a handle (the rules are
        :mod:`phalanx_core.saving`'s; the background writers talk through a
        gloo group of their own, made by the first such save).
        """
        return fsdp_save.save(self, path, state, blocking=blocking)

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
        return fsdp_load.load(self, path, state, strict=strict, weights_only=weights_only)


# -- helpers ---------------------------------------------------------------------------


def _shard_rule(
    shard_modules: Any, strategy: str
) -> tuple[type[nn.Module], ...] | Callable[[nn.Module], Any]:
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
        f"strategy {strategy!r}: shard_modules={shard_modules!r}; give None (shard the root module only), "
        "a module class or a set of them ({torch.nn.TransformerEncoderLayer}: every submodule of these "
        "classes is its own unit), or a callable that takes a submodule and returns True to shard it"
    )


def _split_by_meta(module: nn.Module) -> tuple[list[str], list[str]]:
    """The names of ``module``'s parameters and buffers on the meta device,
    and of the others."""
    on_meta: list[str] = []
    elsewhere: list[str] = []
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        (on_meta if tensor.is_meta else elsewhere).append(name)
    return on_meta, elsewhere


def _broadcast_states(module: nn.Module, group: Any, bucket_bytes: int) -> None:
    """Give every rank of ``group`` the parameters and buffers of its rank
    0: one broadcast a bucket of at most ``bucket_bytes`` (more for a
    single larger tensor) of tensors of one dtype and device, flattened."""
    tensors = [t.detach() for t in (*module.parameters(), *module.buffers())]
    buckets: dict[tuple[torch.dtype, torch.device], list[list[torch.Tensor]]] = {}
    for tensor in tensors:
        kind = buckets.setdefault((tensor.dtype, tensor.device), [[]])
        last = kind[-1]
        if last and sum(t.numel() for t in last) * tensor.element_size() + tensor.nbytes > bucket_bytes:
            kind.append(last := [])
        last.append(tensor)
    for kind in buckets.values():
        for bucket in kind:
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, group=group, group_src=0)
            for tensor, part in zip(bucket, torch.split(flat, [t.numel() for t in bucket]), strict=True):
                tensor.copy_(part.view_as(tensor))


def _refuse_uninitialisable(module: nn.Module, strategy: str) -> None:
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
            f"strategy {strategy!r}: the module was created on the meta device (module_init_context()), and "
            f"{some(missing)} belong to modules without a reset_parameters() method, so nothing could "
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
