"""Strategies over torch."""

from __future__ import annotations

from typing import Any

from phalanx_core import MisconfigurationError, Strategy

__all__ = ["SingleDeviceStrategy"]


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
