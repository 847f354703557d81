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
            # What it can do when peers come and go, as its class does (the
            # torch collective's): fault-tolerant strategies (ddp_ft) take it.
            fault_tolerance=("liveness", "reconfigure"),
        )
    ]
