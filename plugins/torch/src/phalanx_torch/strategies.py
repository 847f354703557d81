"""Strategies over torch."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from phalanx_core import MisconfigurationError, Strategy

from .collectives import TorchCollective

__all__ = ["DDPStrategy", "SingleDeviceStrategy"]


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


class DDPStrategy(Strategy):
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
        self._ddp_group: TorchCollective | None = None

    def setup_environment(self) -> None:
        super().setup_environment()
        if not dist.is_initialized():
            # DDP reduces gradients over torch's default group; the collective
            # named for everything else is not a torch one, so make that group.
            self._ddp_group = TorchCollective(timeout=self.collective.timeout)
            self._ddp_group.setup(self.environment, self.accelerator)

    def setup_module(self, module: Any) -> Any:
        if not dist.is_initialized():
            raise MisconfigurationError(
                "strategy 'ddp': setup(module) runs inside strategy.launch(fn, ...), after the process "
                "group is made; call it from fn"
            )
        device = self.root_device
        device_ids = [device.index] if isinstance(device, torch.device) and device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)

    def unwrap_module(self, module: Any) -> Any:
        return module.module if isinstance(module, DistributedDataParallel) else module

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

    def teardown(self) -> None:
        super().teardown()
        if self._ddp_group is not None:
            self._ddp_group.teardown()
            self._ddp_group = None
