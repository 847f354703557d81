"""``hierarchical`` on 2 nodes x 2 ranks: two ``phalanx run`` processes on
this machine, one per node (``--node-rank``), meeting on loopback. The
all_reduce takes both levels (a reduce-scatter and an all-gather within the
node, an all-reduce across), the whole contract holds on 4 ranks, and DDP
and FSDP train to the weights of the plain torch collective."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from phalanx_core.testing.processes import TAG_VAR, new_tag, reap, scheduler_free_environment

JOB = Path(__file__).parent / "jobs" / "two_level.py"


def run_two_nodes(*flags: str, mode: str) -> list[dict]:
    """Both nodes' ``phalanx run``, to the end; every rank's result."""
    import subprocess

    with socket.socket() as probe:  # a free port for node 0's store (loopback only)
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    tag = new_tag()
    env = scheduler_free_environment(**{TAG_VAR: tag})
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "phalanx",
                "run",
                "--accelerator",
                "cpu",
                "--devices",
                "2",
                "--num-nodes",
                "2",
                "--node-rank",
                str(node),
                "--main-address",
                "127.0.0.1",
                "--main-port",
                port,
                *flags,
                str(JOB),
                mode,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for node in (0, 1)
    ]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        left = reap(tag, grace=5)
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, f"exit {node.returncode}\n{out}\n{err}"
    assert not left, left
    results = [
        json.loads(line.split("PHALANX-RESULT ", 1)[1])
        for out, _ in outputs
        for line in out.splitlines()
        if "PHALANX-RESULT " in line
    ]
    return sorted(results, key=lambda r: r["rank"])


@pytest.fixture(scope="module")
def contract_run() -> list[dict]:
    """The contract job on 2 nodes x 2 ranks, run once for the tests below."""
    return run_two_nodes("--strategy", "ddp", "--collective", "hierarchical", mode="contract")


def test_two_nodes_of_two_ranks_take_both_levels_and_keep_the_contract(contract_run):
    results = contract_run
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["hierarchical"] is True
        assert r["layout"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        assert r["all_reduce"] == [6.0] * 5  # 0 + 1 + 2 + 3
        assert r["broadcast"] == [0.0, 1.0, 2.0]
        assert r["all_gather"] == [0, 1, 2, 3]
        # Two levels, exactly the flat result: rank r's row, summed.
        assert r["reduce_scatter"] == r["reduce_scatter_flat"] == [[400 * r["rank"] + 6] * 3]
        # Within the node, first level: the all_reduce's reduce-scatter, the
        # all_gather's first hop, the reduce_scatter's first level.
        assert r["local"] == {"reduce_scatter_into": 2, "all_gather": 1}, r["local"]
        # Within the node, last level: the all_reduce's all-gather and the
        # broadcast's second hop.
        assert r["last"] == {"all_gather_into": 1, "broadcast": 1}, r["last"]
        # Across: the all_reduce of one slice, the broadcast's first hop
        # (in the cross group of the source's local index: ranks 1 and 3),
        # the nodes' blocks, the reduce_scatter's slice.
        across = {"all_reduce": 1, "all_gather": 1, "reduce_scatter_into": 1}
        assert r["cross"] == ({**across, "broadcast": 1} if r["rank"] in (1, 3) else across), r["cross"]
        assert r["ran"], r


def test_async_operations_return_before_they_are_done_and_then_hold_the_flat_result(contract_run):
    """8 all_reduces of 4 MB each and 8 reduce_scatter_intos, started one
    after another on 4 ranks, the last rank a second late: on the other
    ranks every handle is still pending when the calls return (the call no
    longer runs the three steps itself, which would have waited for the
    late rank), and once waited on every result equals the flat
    collective's exactly."""
    for r in contract_run:
        assert r["async_all_reduce_right"] and r["async_reduce_scatter_right"], r
        if r["rank"] != len(contract_run) - 1:
            assert r["pending_all_reduce"] == 8 and r["pending_reduce_scatter"] == 8, r
        # DDP's bucket (999 elements: padded for the node's reduce-scatter)
        # waits on the chain's own c10d future, not on a Python handle.
        assert r["handed"] == "NativeWork" and r["bucket_summed"], r


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_training_reaches_the_weights_of_the_plain_collective(strategy):
    plain = run_two_nodes("--strategy", strategy, mode="train")
    layered = run_two_nodes("--strategy", strategy, "--collective", "hierarchical", mode="train")
    for a, b in zip(plain, layered, strict=True):
        # The same sums, added in another order: equal to rounding.
        torch.testing.assert_close(torch.tensor(b["weights"]), torch.tensor(a["weights"]), rtol=0, atol=1e-6)
