"""Precisions over torch."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from phalanx_core import Precision

__all__ = ["FullPrecision"]


class FullPrecision(Precision):
    """``"32-true"``: float32 weights and compute. Every accelerator supports it."""

    name: ClassVar[str] = "32-true"

    def convert_module(self, module: Any) -> Any:
        return module.to(dtype=torch.float32)
