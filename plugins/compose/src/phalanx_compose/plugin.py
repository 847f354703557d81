"""phalanx-compose's entry module: specs only; imports no torch."""

from __future__ import annotations

from phalanx_core import CollectiveSpec, hookimpl


@hookimpl
def phalanx_collectives() -> list[CollectiveSpec]:
    return [
        CollectiveSpec(
            name="compressed",
            target="phalanx_compose.compressed:CompressedCollective",
            parts={"inner": "torch"},
            summary="another collective (inner=), carrying float32 as bf16 or fp16 (dtype=) in its "
            "reductions and gathers; error_feedback=True keeps what rounding lost for the next all-reduce",
            needs=("torch>=2.9",),
            install="pip install 'torch>=2.9'",
            fault_tolerance=("liveness", "reconfigure"),
        ),
        CollectiveSpec(
            name="hierarchical",
            target="phalanx_compose.hierarchical:HierarchicalCollective",
            parts={"intra": "torch", "inter": "torch"},
            summary="one collective within each node (intra=), another across the nodes (inter=): "
            "all_reduce as reduce-scatter, cross-node all-reduce, all-gather",
            needs=("torch>=2.9",),
            install="pip install 'torch>=2.9'",
            fault_tolerance=("liveness", "reconfigure"),
        ),
    ]
