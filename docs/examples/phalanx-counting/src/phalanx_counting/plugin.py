"""The entry module: declarations only. It must stay cheap to import:
``phalanx list`` imports it, and it imports no torch."""

from phalanx_core import CollectiveSpec, hookimpl


@hookimpl
def phalanx_collectives():
    return [
        CollectiveSpec(
            name="counting",
            target="phalanx_counting.collective:CountingCollective",  # imported when used
            summary="torch.distributed, counting every operation and the bytes it moves",
            needs=("torch",),  # checked without importing; missing: listed as unavailable
            install="pip install torch",
        )
    ]
