"""Strategies over torch."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx_core import MisconfigurationError, Strategy

from .collectives import TorchCollective

__all__ = ["DDPStrategy", "ManualStrategy", "SingleDeviceStrategy", "TorchGroupStrategy"]


class SingleDeviceStrategy(Strategy):
    """One process on one device: the base composition, with a check that it
    was given exactly one device."""

    def __init__(self, **parts: Any) -> None:
        super().__init__(**parts)
        if len(self.parallel_devices) > 1:
            raise MisconfigurationError(
                f"strategy 'single_device' runs on one device, got {len(self.parallel_devices)}; "
                "use devices=1 or a parallel strategy"
            )


class TorchGroupStrategy(Strategy):
    """A strategy that needs torch's default process group whatever its
    collective is: DDP and FSDP reduce gradients over it, and user code
    under ``manual`` calls ``torch.distributed`` directly.

    When the collective did not make that group (it is not the torch one,
    ``resolve("ddp", collective="mpi")``) and nobody else did, the strategy
    makes it from the environment in :meth:`setup_environment`, and leaves it
    in :meth:`teardown`. A group the user made before is used as it is.
    """

    _torch_group: TorchCollective | None = None

    def setup_environment(self) -> None:
        super().setup_environment()
        if not dist.is_initialized():
            self._torch_group = TorchCollective(timeout=self.collective.timeout)
            self._torch_group.setup(self.environment, self.accelerator)

    def _require_group(self, name: str, call: str) -> None:
        if not dist.is_initialized():
            raise MisconfigurationError(
                f"strategy {name!r}: {call} runs inside strategy.launch(fn, ...), after the process "
                "group is made; call it from fn"
            )

    def unwrap_module(self, module: Any) -> Any:
        """The module inside a DistributedDataParallel wrapper (the one DDP
        made, or under ``manual`` the user's own), so checkpoint keys are the
        model's (no ``module.`` prefix) and load under every strategy."""
        return module.module if isinstance(module, DistributedDataParallel) else module

    def teardown(self) -> None:
        super().teardown()
        if self._torch_group is not None:
            self._torch_group.teardown()
            self._torch_group = None


class DDPStrategy(TorchGroupStrategy):
    """Data parallel: one process per device, the module wrapped in
    :class:`~torch.nn.parallel.DistributedDataParallel` on :meth:`setup`.

    The same class serves ``ddp`` (subprocess launcher), ``ddp_spawn``,
    ``ddp_fork`` and ``ddp_notebook``: only the launcher differs. Every
    collective call the strategy makes goes through its collective; DDP's
    own gradient reduction uses torch's default process group, which the
    strategy makes from the environment when the collective is not the torch
    one (``resolve("ddp", collective="mpi")``) and no group exists yet.

    Options (given to :func:`phalanx.resolve` as keywords) are
    DistributedDataParallel's: ``find_unused_parameters``, ``static_graph``,
    ``gradient_as_bucket_view``, ``broadcast_buffers``, ``bucket_cap_mb``.
    """

    def __init__(
        self,
        *,
        find_unused_parameters: bool = False,
        static_graph: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        bucket_cap_mb: float | None = None,
        **parts: Any,
    ) -> None:
        super().__init__(**parts)
        self._ddp_kwargs: dict[str, Any] = {
            "find_unused_parameters": find_unused_parameters,
            "static_graph": static_graph,
            "gradient_as_bucket_view": gradient_as_bucket_view,
        }
        if not broadcast_buffers:  # torch 2.13 warns when it is passed at all, even as the default
            self._ddp_kwargs["broadcast_buffers"] = False
        if bucket_cap_mb is not None:
            self._ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb

    def setup_module(self, module: Any) -> Any:
        self._require_group("ddp", "setup(module)")
        device = self.root_device
        device_ids = [device.index] if isinstance(device, torch.device) and device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)

    def no_backward_sync(self, module: Any, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        """``module.no_sync()`` for a DDP module: backward accumulates local
        gradients without reducing them (the next synchronised backward
        reduces everything)."""
        if not enabled:
            return contextlib.nullcontext()
        if not isinstance(module, DistributedDataParallel):
            raise MisconfigurationError(
                f"no_backward_sync() needs the module returned by strategy.setup(), a "
                f"DistributedDataParallel; got {type(module).__name__}"
            )
        return module.no_sync()


class ManualStrategy(TorchGroupStrategy):
    """Your own parallelism: phalanx gives the ranks (from the environment),
    the processes (the launcher), the collective and torch's default process
    group (unless you made one); your code places modules on devices and
    wraps them — DDP on one part, hand sharding or FSDP on another.

    - :meth:`setup` leaves modules and optimizers as they are: no precision
      conversion, no move, no wrapper (optimizer factories are still called
      with the module's parameters). The precision's forward context,
      backward and optimizer step still apply when you use them.
    - :attr:`root_device` is the device of this local rank: put your modules
      there yourself.
    - With ``checkpoint_per_rank=True`` (the default), every rank saves its
      own state: ``save_checkpoint("ckpt", state)`` writes the directory
      ``ckpt/`` with one file per rank, ``rank-00000.pt``, ... and
      :meth:`load_checkpoint` reads this rank's file back. With ``False``,
      rank 0 writes one file, as the other strategies do.
      A module you wrapped in DDP yourself is saved as the module inside
      it (no ``module.`` prefix), so a rank's file loads under every
      strategy.
    - :meth:`no_backward_sync` on a module you wrapped in DDP is its
      ``no_sync()``; on anything else there is nothing phalanx synchronises,
      and it does nothing.
    """

    def __init__(self, *, checkpoint_per_rank: bool = True, **parts: Any) -> None:
        super().__init__(**parts)
        if not isinstance(checkpoint_per_rank, bool):
            raise MisconfigurationError(
                f"strategy 'manual': checkpoint_per_rank={checkpoint_per_rank!r}; give True (one file "
                "per rank, the default) or False (one file from rank 0)"
            )
        self.checkpoint_per_rank = checkpoint_per_rank

    def setup(self, module: Any, *optimizers: Any) -> Any:
        made = self._make_optimizers(module, optimizers)
        return (module, *made) if made else module

    def no_backward_sync(self, module: Any, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
        if enabled and isinstance(module, DistributedDataParallel):
            return module.no_sync()
        return contextlib.nullcontext()

    def rank_checkpoint_path(self, path: str | os.PathLike[str], rank: int | None = None) -> Path:
        """The file of ``rank`` (this rank by default) in the checkpoint
        directory ``path``."""
        return Path(path) / f"rank-{self.global_rank if rank is None else rank:05d}.pt"

    def save_checkpoint(self, path: str | os.PathLike[str], state: Mapping[str, Any]) -> None:
        if not self.checkpoint_per_rank:
            super().save_checkpoint(path, state)
            return
        if Path(path).is_file():
            raise MisconfigurationError(
                f"save_checkpoint({os.fspath(path)!r}): strategy 'manual' saves one file per rank into a "
                "directory, and this is a file; choose another path, or pass checkpoint_per_rank=False"
            )
        self.checkpoint_io.save(self._to_state(state), self.rank_checkpoint_path(path))
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
        if not self.checkpoint_per_rank or Path(path).is_file():
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        mine = self.rank_checkpoint_path(path)
        if not mine.is_file():
            found = sorted(p.name for p in Path(path).glob("rank-*.pt")) if Path(path).is_dir() else []
            raise FileNotFoundError(
                f"load_checkpoint({os.fspath(path)!r}): no file for rank {self.global_rank} ({mine.name}); "
                + (
                    f"the directory has {', '.join(found)}: it was saved by {len(found)} rank(s), and "
                    f"this job has {self.world_size}"
                    if found
                    else "nothing was saved there by strategy 'manual'"
                )
            )
        return super().load_checkpoint(mine, state, strict=strict, weights_only=weights_only)
