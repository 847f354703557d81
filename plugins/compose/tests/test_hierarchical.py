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


def test_two_nodes_of_two_ranks_take_both_levels_and_keep_the_contract():
    results = run_two_nodes("--strategy", "ddp", "--collective", "hierarchical", mode="contract")
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["hierarchical"] is True
        assert r["layout"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        assert r["all_reduce"] == [6.0] * 5  # 0 + 1 + 2 + 3
        assert r["broadcast"] == [0.0, 1.0, 2.0]
        assert r["all_gather"] == [0, 1, 2, 3]
        # Within the node: the reduce-scatter and all-gather of the
        # all_reduce, the broadcast's second hop, the all_gather's first.
        assert r["local"]["reduce_scatter"] == 1 and r["local"]["all_gather_into"] == 1, r["local"]
        assert r["local"]["broadcast"] == 1 and r["local"]["all_gather"] == 1, r["local"]
        # Across: the all_reduce of one slice, and the nodes' blocks.
        assert r["cross"]["all_reduce"] == 1 and r["cross"]["all_gather"] == 1, r["cross"]
        assert r["ran"], r


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_training_reaches_the_weights_of_the_plain_collective(strategy):
    plain = run_two_nodes("--strategy", strategy, mode="train")
    layered = run_two_nodes("--strategy", strategy, "--collective", "hierarchical", mode="train")
    for a, b in zip(plain, layered, strict=True):
        # The same sums, added in another order: equal to rounding.
        torch.testing.assert_close(torch.tensor(b["weights"]), torch.tensor(a["weights"]), rtol=0, atol=1e-6)
