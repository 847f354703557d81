"""Composed collectives across two hosts: ``hierarchical`` with 2 ranks on
each of two hosts (within a host over gloo, across over gloo on the veth
link), and ``compressed`` across them. The job is phalanx-compose's own
two-node script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

JOB = str(Path(__file__).resolve().parents[2] / "plugins" / "compose" / "tests" / "jobs" / "two_level.py")
AGENT = Path(__file__).resolve().parent / "netns_rsh.py"  # mpirun's way into node1 (test_mpirun.py)
PORT = "29613"


def phalanx_run(node: int, *flags: str, mode: str) -> list[str]:
    return [
        sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", "--devices", "2", "--num-nodes", "2",
        "--node-rank", str(node), "--main-address", "node0", "--main-port", PORT, *flags, JOB, mode,
    ]  # fmt: skip


def results(runs) -> list[dict]:
    for run in runs:
        assert run.returncode == 0, run.describe()
    return sorted((r for run in runs for r in run.results), key=lambda r: r["rank"])


def test_hierarchical_across_two_hosts_takes_both_levels_and_keeps_the_contract(bed, run_nodes):
    runs = run_nodes(
        bed.hosts, [phalanx_run(n, "--collective", "hierarchical", mode="contract") for n in (0, 1)]
    )
    found = results(runs)
    assert [r["rank"] for r in found] == [0, 1, 2, 3]
    for r in found:
        assert r["hierarchical"] is True and r["layout"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        assert r["all_reduce"] == [6.0] * 5 and r["all_gather"] == [0, 1, 2, 3]
        assert r["cross"]["all_reduce"] == 1, r["cross"]
        assert r["ran"], r


@pytest.mark.parametrize("collective", ["hierarchical", "compressed"])
def test_ddp_across_two_hosts_through_a_composed_collective(bed, run_nodes, collective):
    plain = results(run_nodes(bed.hosts, [phalanx_run(n, "--strategy", "ddp", mode="train") for n in (0, 1)]))
    composed = results(
        run_nodes(
            bed.hosts,
            [phalanx_run(n, "--strategy", "ddp", "--collective", collective, mode="train") for n in (0, 1)],
        )
    )
    # hierarchical: the same sums in another order; compressed: bf16 gradients.
    tolerance = 1e-6 if collective == "hierarchical" else 2e-2
    for a, b in zip(plain, composed, strict=True):
        assert max(abs(x - y) for x, y in zip(a["weights"], b["weights"], strict=True)) <= tolerance


def test_hierarchical_with_mpi_across_the_hosts_and_gloo_within(bed, run_nodes):
    """intra='torch' (gloo), inter='mpi': ranks started by mpirun on both
    hosts (its rsh agent enters node1), MASTER_ADDR passed for the torch
    group within the hosts."""
    command = [
        "mpirun", "--allow-run-as-root", "--bind-to", "none", "--host", "node0:2,node1:2", "-np", "4",
        "--mca", "plm_rsh_agent", f"{sys.executable} {AGENT}", "-x", "MASTER_ADDR=node0",
        sys.executable, JOB, "contract", "mpi",
    ]  # fmt: skip
    env = {"PHALANX_NETNS_HOSTS": ",".join(f"{host.name}={host.namespace}" for host in bed.hosts)}
    [run] = run_nodes(bed.hosts[:1], [command], env=env, timeout=180)
    found = results([run])
    assert [r["rank"] for r in found] == [0, 1, 2, 3], run.describe()
    for r in found:
        assert r["hierarchical"] is True and r["layout"] == [[0, 0], [0, 1], [1, 0], [1, 1]]
        assert r["all_reduce"] == [6.0] * 5 and r["broadcast"] == [0.0, 1.0, 2.0]
        assert r["all_gather"] == [0, 1, 2, 3]
        assert r["cross"]["all_reduce"] == 1, r["cross"]
        assert r["ran"], r
