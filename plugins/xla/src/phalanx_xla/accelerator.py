"""The ``xla`` accelerator: XLA devices through torch_xla's PJRT runtime."""

from __future__ import annotations

from typing import Any, ClassVar

from phalanx_core import Accelerator, Availability, MisconfigurationError, parse_device_indices
from phalanx_core.accelerator import DevicesFlag

from . import _runtime

__all__ = ["XLAAccelerator"]


class XLAAccelerator(Accelerator):
    """XLA devices (TPU cores, or the devices ``PJRT_DEVICE=CPU`` / ``CUDA``
    gives), one replica per device.

    Available where torch_xla is installed with the torch release it was
    built for, and ``PJRT_DEVICE`` names a device (or a TPU is attached);
    otherwise :meth:`availability` says which of these is missing and what
    to do (see :mod:`phalanx_xla._runtime`). The constructor refuses where
    it is not available.

    ``devices``: torch_xla runs one replica on *every* device of the host
    (``CPU_NUM_DEVICES=N`` / ``TPU_NUM_DEVICES`` change how many there
    are), or a single one; so ``devices`` is ``1``, the count of all of
    them, ``-1`` or ``"auto"`` (all). Device indices are the replicas'
    ``xla:0``, ``xla:1``, ...; counting them never starts the XLA runtime,
    which must not start in the process that launches the replicas.
    """

    name: ClassVar[str] = "xla"
    collective_backend: ClassVar[str | None] = "xla"

    def __init__(self) -> None:
        self.check_available()

    @classmethod
    def availability(cls) -> Availability:
        return _runtime.availability()

    @classmethod
    def device_count(cls) -> int:
        return _runtime.device_count() if cls.availability() else 0

    def parallel_devices(self, devices: DevicesFlag) -> list[Any]:
        count = self.device_count()
        indices = parse_device_indices(devices, count, accelerator=self.name)
        if indices != [0] and indices != list(range(count)):
            raise MisconfigurationError(
                f"accelerator 'xla' with devices={devices!r}: torch_xla runs one replica on every "
                f"device of this host ({count} here, PJRT_DEVICE={_runtime.device_type()}) or on one, "
                f"so ask for devices=1 or devices={count} (or 'auto'); to use {len(indices)}, change "
                f"the number of devices torch_xla sees (CPU_NUM_DEVICES={len(indices)} on the CPU runtime)"
            )
        return [self.get_device(i) for i in indices]

    def get_device(self, index: int) -> Any:
        import torch

        return torch.device("xla", index)

    def setup_device(self, device: Any) -> None:
        """Check that the replica runs on ``device`` (torch_xla gives each
        replica its device when it starts it)."""
        if _runtime.in_replica():
            mine = _runtime.xla_device()
            if mine.index != getattr(device, "index", mine.index):
                raise MisconfigurationError(
                    f"the replica on {mine} was given device {device}; the strategy's devices and "
                    "torch_xla's replicas disagree, which is a bug in phalanx-xla: please report it"
                )
