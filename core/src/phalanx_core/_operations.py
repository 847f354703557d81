"""The names of the collective contract: its operations, its reduce ops,
its default timeout."""

from __future__ import annotations

from typing import Any

__all__ = ["DEFAULT_TIMEOUT", "EXTENDS", "OPERATIONS", "REDUCE_OPS", "Tensor"]

#: A tensor of the collective's backend (``torch.Tensor``). Core imports no
#: backend, so this is ``Any`` for the type checker.
Tensor = Any

#: The reduce op names every collective accepts.
REDUCE_OPS: tuple[str, ...] = ("sum", "mean", "min", "max", "product")

#: Seconds an operation may take before it raises CollectiveTimeoutError.
DEFAULT_TIMEOUT = 1800.0

#: Every operation of the contract, in the order the docs list them.
OPERATIONS: tuple[str, ...] = (
    "barrier",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_into",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_into",
    "all_to_all",
    "send",
    "recv",
    "broadcast_object",
    "all_gather_object",
    "gather_object",
    "scatter_object",
)

#: The operations that extend another, and the one each extends: a
#: collective that cannot do the one cannot do the other (unless it
#: implements it itself).
EXTENDS: dict[str, str] = {"all_gather_into": "all_gather", "reduce_scatter_into": "reduce_scatter"}
