"""OpenMPI's ``mpirun`` across two hosts: a job started on node0 with
``--host node0:N,node1:N``, whose ranks on node1 ``mpirun`` starts through
its rsh agent, as it would through ssh (netns_rsh.py: node1's namespace, its
host name, a login's environment; a rank there gets what ``mpirun -x``
passes, and nothing else of node0's environment).

Each rank runs ddp_job.py: phalanx detects the ``mpi`` environment from
OpenMPI's variables and runs in place; an all_reduce, every rank's host,
and a DDP step must come out right on every rank, over MPI
(``collective="mpi"``) and over gloo (the ``torch`` collective).

OpenMPI needs no settings on these hosts: its TCP transport leaves out
loopback by itself and each host has one other interface. A host with a
second interface whose address every host has too (Docker's bridge,
172.17.0.1) hangs it, until ``btl_tcp_if_include`` names the network the
hosts share.

The hosts' own names map to 127.0.1.1, and their addresses sort above it,
so that a rank listening on loopback is one the others dial, and the job
fails (:class:`~phalanx_core.testing.hosts.TestBed`).
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx_core.testing.hosts import TestBed

HERE = Path(__file__).resolve().parent
JOB = HERE / "ddp_job.py"
AGENT = HERE / "netns_rsh.py"


def mpirun(bed: TestBed, per_host: int, *options: str, job: tuple[str, ...] = ()) -> tuple[list[str], dict]:
    """The ``mpirun`` command that node0 runs for ``per_host`` ranks on each
    host, and the environment it needs (its rsh agent's hosts)."""
    command = [
        "mpirun", "--allow-run-as-root", "--bind-to", "none",
        "--host", ",".join(f"{host.name}:{per_host}" for host in bed.hosts),
        "-np", str(per_host * len(bed.hosts)),
        "--mca", "plm_rsh_agent", f"{sys.executable} {AGENT}",
        *options,
        sys.executable, str(JOB), "--devices", str(per_host), "--nodes", str(len(bed.hosts)), *job,
    ]  # fmt: skip
    hosts = ",".join(f"{host.name}={host.namespace}" for host in bed.hosts)
    return command, {"PHALANX_NETNS_HOSTS": hosts}


def check_job(run, bed: TestBed, per_host: int, collective: str) -> list[dict]:
    """Every rank's result, by rank, checked against where mpirun put it
    (node0 filled first, then node1)."""
    assert run.returncode == 0, run.describe()
    results = sorted(run.results, key=lambda r: r["rank"])
    world = per_host * len(bed.hosts)
    assert [r["rank"] for r in results] == list(range(world)), run.describe()
    hosts = [bed.hosts[rank // per_host].name for rank in range(world)]
    for rank, result in enumerate(results):
        assert result["environment"] == "mpi", result
        assert result["launcher"] == "in_process", result
        assert result["collective"] == collective, result
        assert result["world_size"] == world, result
        assert result["host"] == hosts[rank], result
        assert result["node_rank"] == rank // per_host, result
        assert result["local_rank"] == rank % per_host, result
        assert result["all_reduce"] == world * (world + 1) / 2, result
        assert result["hosts"] == hosts, result
        assert result["ddp_gradient"] == [float(world + 1)] * 4, result
    return results


@pytest.mark.parametrize("per_host", [1, 2])
def test_ddp_over_mpi_across_two_hosts(bed, run_nodes, per_host):
    # MASTER_ADDR as a user of the torch collective would have set it.
    command, env = mpirun(bed, per_host, "-x", "MASTER_ADDR=node0", job=("--collective", "mpi"))
    [run] = run_nodes(bed.hosts[:1], [command], env=env, timeout=120)
    results = check_job(run, bed, per_host, "mpi")
    assert {r["main_address"] for r in results} == {"node0"}
    [port] = {r["main_port"] for r in results}  # from the job's id, the same on every rank
    assert 20000 <= port < 30000


def test_ddp_over_mpi_across_two_hosts_needs_no_master_addr(bed, run_nodes):
    command, env = mpirun(bed, 1, job=("--collective", "mpi"))
    [run] = run_nodes(bed.hosts[:1], [command], env=env, timeout=120)
    results = check_job(run, bed, 1, "mpi")
    assert {r["main_address"] for r in results} == {None}


def test_ddp_over_gloo_across_two_hosts_without_master_addr_says_to_set_it(bed, run_nodes):
    command, env = mpirun(bed, 1)
    [run] = run_nodes(bed.hosts[:1], [command], env=env, timeout=120)
    assert run.returncode != 0, run.describe()
    assert "set MASTER_ADDR to rank 0's host name" in run.stdout + run.stderr, run.describe()


@pytest.mark.parametrize("main", ["name", "address"])
def test_ddp_over_gloo_across_two_hosts(bed, run_nodes, main):
    """MASTER_ADDR is node0's name (as the mpi environment's message asks),
    which maps to 127.0.1.1 on node0 itself, or its address. Either way
    gloo on each rank listens on its host's address on the bridge, where
    the other host reaches it, and never on loopback."""
    address = bed.hosts[0].address if main == "address" else bed.hosts[0].name
    command, env = mpirun(bed, 2, "-x", f"MASTER_ADDR={address}", job=("--timeout", "30"))
    [run] = run_nodes(bed.hosts[:1], [command], env=env, timeout=120)
    results = check_job(run, bed, 2, "torch")
    for result in results:
        assert result["main_address"] == address, result
        host = next(h for h in bed.hosts if h.name == result["host"])
        # rank 0 also hosts the store: torch binds it to every interface
        gloo = [a for a in result["listening"] if a not in ("0.0.0.0", "::")]
        assert gloo == [host.address], run.describe()
        assert not any(ipaddress.ip_address(a).is_loopback for a in result["listening"]), result


@pytest.mark.parametrize("how", ["named", "chosen-by-name", "chosen-by-address"])
def test_openmpi_beside_a_docker_bridge_stays_on_the_hosts_network(bed, run_nodes, how):
    """Each host also has ``docker0`` at 172.17.0.1, as every host with
    Docker does: OpenMPI's TCP transport then takes a peer's 172.17.0.1 for
    a way to it and reaches its own host instead (it hangs, 'received
    unexpected process identifier'). ``btl_tcp_if_include`` with the
    hosts' network keeps it on the bridge: named by the user, or chosen by
    the ``mpi`` collective from the route to ``MASTER_ADDR`` (node0's name,
    which leads to loopback on node0 itself, or its address)."""
    for host in bed.hosts:
        for step in (
            ["link", "add", "docker0", "type", "veth", "peer", "name", "vethd"],
            ["addr", "add", "172.17.0.1/16", "dev", "docker0"],
            ["link", "set", "docker0", "up"],
            ["link", "set", "vethd", "up"],
        ):
            subprocess.run(["ip", "-n", host.namespace, *step], check=True, capture_output=True, timeout=30)
    network = str(ipaddress.ip_network(f"{bed.hosts[0].address}/24", strict=False))
    main = bed.hosts[0].address if how == "chosen-by-address" else "node0"
    named = ("--mca", "btl_tcp_if_include", network) if how == "named" else ()
    command, env = mpirun(bed, 2, *named, "-x", f"MASTER_ADDR={main}", job=("--collective", "mpi"))
    [run] = run_nodes(bed.hosts[:1], [command], env=env, timeout=120)
    check_job(run, bed, 2, "mpi")


def test_ddp_ft_under_mpirun_on_two_hosts_restarts_a_killed_group_on_its_host(bed, tmp_path):
    # mpirun starts one phalanx run per host (node1's through its rsh
    # agent); MASTER_ADDR names node 0, whose phalanx run hosts the
    # lighthouse. Group 1's rank (node 1) killed: node 1's phalanx run
    # starts it again, and it heals from group 0 across the hosts.
    from ft_job import Job, kill_one_of_two_groups_and_check_it_heals

    launch = [
        "mpirun", "--allow-run-as-root", "--bind-to", "none",
        "--host", ",".join(f"{host.name}:1" for host in bed.hosts), "-np", str(len(bed.hosts)),
        "--mca", "plm_rsh_agent", f"{sys.executable} {AGENT}",
        "-x", f"MASTER_ADDR={bed.hosts[0].address}", "-x", "MASTER_PORT=29650",
    ]  # fmt: skip
    hosts = ",".join(f"{host.name}={host.namespace}" for host in bed.hosts)
    job = Job(
        tmp_path, "--devices", "1", "--replica-groups", "2", "--num-nodes", "2", "--max-restarts", "1",
        park_at=6, launch=launch, env={**os.environ, "PHALANX_NETNS_HOSTS": hosts}, where=bed.hosts[0],
    )  # fmt: skip
    kill_one_of_two_groups_and_check_it_heals(job, park_at=6)
    assert "[group0" in job.output and "[group1" in job.output, job.output
