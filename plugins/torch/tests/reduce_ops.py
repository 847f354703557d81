"""torch's ReduceOps the tests make (not a test module)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def premul_sum(factor: float) -> Any:
    """torch's ReduceOp that multiplies each input by ``factor``, then sums:
    ``ReduceOp.PREMUL_SUM(factor)`` where it is callable (torch 2.13 on),
    else torch's own private maker of it (torch 2.9)."""
    make = dist.ReduceOp.PREMUL_SUM
    return make(factor) if callable(make) else dist._make_nccl_premul_sum(factor)  # type: ignore[attr-defined]
