"""Jobs of two nodes on two hosts: ``phalanx run`` and ``torchrun`` across
network namespaces, what happens when a rank on one host fails, when the
nodes resolve different plans, when a rank cannot reach another, and
checkpoints that cross between the two-host job and one host.

The hosts' own names map to loopback (Debian's ``/etc/hosts``), the trap
that makes gloo listen where no other host reaches it: phalanx must choose
the interface that joins the hosts by itself.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

JOB = str(Path(__file__).resolve().parent / "job.py")
PORT = "29611"
MAIN = "192.168.77.1"  # node0 on the test bed


def phalanx_run(
    node: int, *flags: str, main: str = "node0", script: tuple[str, ...] = ("train",)
) -> list[str]:
    return [
        sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", "--num-nodes", "2",
        "--node-rank", str(node), "--main-address", main, "--main-port", PORT, *flags, JOB, *script,
    ]  # fmt: skip


def results(runs) -> list[dict]:
    found = [r for run in runs for r in run.results]
    return sorted(found, key=lambda r: r["rank"])


@pytest.mark.parametrize(
    ("strategy", "devices", "main"),
    [
        ("ddp", 1, "node0"),  # node 0's own name leads to loopback there
        ("ddp", 2, MAIN),
        ("fsdp", 2, "node0"),
        ("manual", 1, MAIN),
    ],
)
def test_phalanx_run_trains_across_two_hosts(bed, run_nodes, strategy, devices, main):
    runs = run_nodes(
        bed.hosts,
        [phalanx_run(n, "--strategy", strategy, "--devices", str(devices), main=main) for n in (0, 1)],
    )
    for run in runs:
        assert run.returncode == 0, run.describe()
        # c10d's reverse lookups find their names (the test bed lists the
        # IPv4-mapped addresses; see nodes.md): no EAI_AGAIN warning.
        assert "The hostname of the client socket cannot be retrieved" not in run.stderr, run.describe()
        # Node 0's store outlives every node's last request: no c10d warning
        # ("recvValue failed ... Connection was likely closed", a C++ stack).
        assert "TCPStore.cpp" not in run.stderr, run.describe()
    found = results(runs)
    world = 2 * devices
    assert [r["rank"] for r in found] == list(range(world)), found
    for r in found:
        assert r["world_size"] == world
        assert r["node"] == r["rank"] // devices
        assert r["host"] == f"node{r['node']}"
        assert r["all_reduce"] == sum(range(world))
    if strategy != "manual":  # gradients averaged: one model everywhere
        assert len({r["weights"] for r in found}) == 1, found
    else:  # manual: each rank trains its own copy on its own data
        assert len({r["weights"] for r in found}) == world, found


def test_torchrun_across_two_hosts_with_c10d_rendezvous(bed, run_nodes):
    # `-m phalanx run` in front of the script, as nodes.md says: a plain
    # `torchrun job.py` ends through Python's finalization, where the gloo
    # group that torch's DDP keeps alive past destroy_process_group can
    # abort a finished rank (1 run of 5 of this test, under load).
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node0:{PORT}", "--rdzv-id", "multihost",
        "-m", "phalanx", "run", "--strategy", "ddp", "--accelerator", "cpu", "--num-nodes", "2", JOB, "train",
    ]  # fmt: skip
    runs = run_nodes(bed.hosts, [command, command])
    for run in runs:
        assert run.returncode == 0, run.describe()
    found = results(runs)
    assert [(r["rank"], r["host"]) for r in found] == [(0, "node0"), (1, "node1")], found
    assert len({r["weights"] for r in found}) == 1
    assert all(r["all_reduce"] == 1 for r in found)


@pytest.mark.parametrize("failing", [1, 0])
def test_a_failure_on_one_host_ends_the_job_on_both_with_its_cause(bed, run_nodes, failing):
    runs = run_nodes(
        bed.hosts,
        [
            phalanx_run(n, "--strategy", "ddp", "--devices", "1", script=("fail", str(failing)))
            for n in (0, 1)
        ],
    )
    for run in runs:
        assert run.returncode == 1, run.describe()
        # Every node names the rank that failed, its node and host, and shows its traceback.
        assert (
            f"phalanx run: rank {failing} (node {failing}, host node{failing}) raised first" in run.stderr
        ), run.describe()
        assert f"[rank{failing}]: ValueError: rank {failing} on node{failing} broke on purpose" in (
            run.stdout + run.stderr
        ), run.describe()
        assert "CollectiveTimeoutError" not in run.stderr.splitlines()[-1]


def test_a_node_that_fails_before_its_group_exists_ends_the_other(bed, run_nodes):
    runs = run_nodes(
        bed.hosts,
        [phalanx_run(n, "--strategy", "ddp", "--devices", "1", script=("fail-early", "1")) for n in (0, 1)],
    )
    for run in runs:
        assert run.returncode == 1, run.describe()
        assert "rank 1 (node 1, host node1) raised first" in run.stderr, run.describe()
        assert "[rank1]: RuntimeError: node 1 could not read its data" in run.stdout + run.stderr


@pytest.mark.parametrize(
    ("node1_flags", "field", "values"),
    [
        (("--strategy", "fsdp", "--devices", "1"), "strategy", ("ddp (phalanx-torch", "fsdp (phalanx-torch")),
        (("--strategy", "ddp", "--devices", "2"), "devices per node", ("1", "2")),
    ],
)
def test_nodes_that_resolved_different_plans_stop_with_the_difference(
    bed, run_nodes, node1_flags, field, values
):
    runs = run_nodes(
        bed.hosts,
        [phalanx_run(0, "--strategy", "ddp", "--devices", "1"), phalanx_run(1, *node1_flags)],
    )
    for run in runs:
        assert run.returncode == 1, run.describe()
        text = run.stdout + run.stderr
        assert "PlanMismatchError" in text, run.describe()
        assert "the nodes of this job resolved different plans" in text
        row = next(line for line in text.splitlines() if re.search(rf"\]:\s+{field}\s", line))
        cells = row.split(field, 1)[1]
        assert cells.index(values[0]) < cells.index(values[1]), row  # node 0's value in node 0's column
        assert re.search(r"node 0\s+node 1", text)


def test_a_rank_that_cannot_reach_another_says_so(bed, run_nodes):
    """gloo told to listen on loopback on both hosts: the rank that dials
    the other (gloo's choice) is refused, and says where it tried, why that
    address cannot work and what to do; both nodes stop with that cause."""
    runs = run_nodes(
        bed.hosts,
        [phalanx_run(n, "--strategy", "ddp", "--devices", "1", main=MAIN) for n in (0, 1)],
        env={"GLOO_SOCKET_IFNAME": "lo"},
    )
    causes = set()
    for run in runs:
        assert run.returncode == 1, run.describe()
        closing = re.search(r"phalanx run: rank (\d) \(node \1, host node\1\) raised first", run.stderr)
        assert closing, run.describe()
        rank = int(closing.group(1))
        causes.add(rank)
        text = run.stdout + run.stderr
        assert (
            f"[rank{rank}]: phalanx_core.errors.CollectiveConnectionError: setup() on the 'torch' "
            f"collective (gloo, rank {rank} of 2 on node{rank}) could not connect to another rank at "
            "[127.0.0.1]:"
        ) in text, run.describe()
        assert "Connection refused. 127.0.0.1 is a loopback address" in text
        assert "did not complete within" not in text
    assert len(causes) == 1  # the same cause on both nodes


def test_explain_shows_the_interface_each_host_chooses(bed):
    for node, host in enumerate(bed.hosts):
        done = host.run([
            sys.executable, "-m", "phalanx", "explain", "--strategy", "ddp", "--accelerator", "cpu",
            "--devices", "1", "--num-nodes", "2", "--node-rank", str(node), "--main-address", MAIN,
        ])  # fmt: skip
        assert done.returncode == 0, done.stderr
        line = next(x for x in done.stdout.splitlines() if x.startswith("network"))
        assert line.split(None, 1)[1] == (
            f"gloo on eth0: eth0 ({host.address}) is where the route to the main address {MAIN} leaves from"
        )
    done = bed.hosts[1].run([
        sys.executable, "-m", "phalanx", "explain", "--strategy", "ddp", "--accelerator", "cpu",
        "--num-nodes", "2", "--node-rank", "1", "--main-address", "10.99.0.1",
    ])  # fmt: skip
    assert "no route from this host (node1) to the main address 10.99.0.1" in done.stdout


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_crosses_between_two_hosts_and_one(bed, run_nodes, tmp_path, strategy):
    """One file (fsdp: ``state_dict_type='full'``) that a job on two hosts
    writes and one process on one host reads, and the reverse."""
    flags = ("--strategy", strategy, "--devices", "1")
    if strategy == "fsdp":
        flags += ("-o", "state_dict_type=full")
    two_hosts = tmp_path / "two.ckpt"
    runs = run_nodes(
        bed.hosts,
        [phalanx_run(n, *flags, script=("save", str(two_hosts))) for n in (0, 1)],
    )
    assert all(run.returncode == 0 for run in runs), "\n".join(run.describe() for run in runs)
    [weights] = {r["weights"] for r in results(runs)}

    # Loaded on one host, by one process.
    done = bed.hosts[1].run([
        sys.executable, "-m", "phalanx", "run", "--strategy", "single_device", "--accelerator", "cpu", JOB,
        "load", str(two_hosts),
    ])  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    [loaded] = [line for line in done.stdout.splitlines() if "PHALANX-RESULT" in line]
    assert f'"weights": "{weights}"' in loaded and '"step": 3' in loaded

    # The reverse: written on one host, loaded by the job on two.
    one_host = tmp_path / "one.ckpt"
    done = bed.hosts[0].run([
        sys.executable, "-m", "phalanx", "run", "--strategy", "single_device", "--accelerator", "cpu", JOB,
        "save", str(one_host),
    ])  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    [saved] = [line for line in done.stdout.splitlines() if "PHALANX-RESULT" in line]
    runs = run_nodes(
        bed.hosts,
        [phalanx_run(n, *flags, script=("load", str(one_host))) for n in (0, 1)],
    )
    assert all(run.returncode == 0 for run in runs), "\n".join(run.describe() for run in runs)
    for r in results(runs):
        assert f'"weights": "{r["weights"]}"' in saved and r["step"] == 3, (r, saved)
