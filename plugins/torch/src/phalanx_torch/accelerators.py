"""Accelerators over torch devices."""

from __future__ import annotations

from typing import ClassVar

import torch

from phalanx_core import Accelerator, Availability, MisconfigurationError
from phalanx_core.accelerator import DevicesFlag

__all__ = ["CPUAccelerator"]


class CPUAccelerator(Accelerator):
    """The CPU. ``devices=N`` means N processes, all on the CPU (one device
    each in the strategy's terms); ``"auto"`` and ``-1`` mean one."""

    name: ClassVar[str] = "cpu"
    collective_backend: ClassVar[str | None] = "gloo"

    @classmethod
    def availability(cls) -> Availability:
        return Availability(True)

    @classmethod
    def device_count(cls) -> int:
        return 1

    def get_device(self, index: int) -> torch.device:
        return torch.device("cpu")

    def parallel_devices(self, devices: DevicesFlag) -> list[torch.device]:
        if devices in ("auto", -1, "-1"):
            return [torch.device("cpu")]
        if isinstance(devices, str) and devices.strip().isdigit():
            devices = int(devices)
        if isinstance(devices, int) and not isinstance(devices, bool) and devices >= 1:
            return [torch.device("cpu")] * devices
        raise MisconfigurationError(
            f"accelerator='cpu' with devices={devices!r}: on the CPU, devices is the number of "
            "processes (an int of at least 1, or 'auto'); device indices mean nothing there"
        )
