"""The ``lsf`` and ``kubeflow`` environments on jobs across hosts: on each
host, the processes that scheduler starts, with the variables it sets
there, each running ddp_job.py. phalanx must detect the environment, run
in place (launcher ``in_process``), find each process's node and the main
address, and the job must complete: an all_reduce, every rank's host, a
DDP step over gloo.

- LSF, ``bsub -nnodes 2`` then ``jsrun --nrs 4 --rs_per_host 2
  --tasks_per_rs 1``: node0 is the job's launch node, which runs the batch
  script and no rank; node1 and node2 each run 2 tasks. Every task has
  ``LSB_JOBID``, ``LSB_DJOB_RANKFILE`` (one line per slot: the launch node
  once, then each compute host once per slot), ``LSB_MCPU_HOSTS``,
  ``LSB_HOSTS``, and jsrun's ``JSM_NAMESPACE_*`` with the
  ``OMPI_COMM_WORLD_*`` / ``PMIX_RANK`` of the Spectrum MPI underneath it.
- Kubeflow's PyTorchJob (training-operator v1), one Master and one Worker
  replica: one process per pod, with ``MASTER_ADDR`` the master pod's name
  (its headless service), ``MASTER_PORT`` 23456 (the operator's default),
  ``WORLD_SIZE`` the pods, ``RANK`` the pod's index (the master 0),
  ``PYTHONUNBUFFERED=0``, and the ``KUBERNETES_*`` variables of every pod.

Each runs where a host's own name maps to 127.0.1.1 (Debian's hosts file)
and where it maps to the host's address (a cluster's DNS; Kubernetes
writes a pod's name with the pod's address).
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

import pytest

JOB = str(Path(__file__).resolve().parent / "ddp_job.py")
NAMES = pytest.mark.parametrize(
    "names_on_loopback", [True, False], ids=["name-on-loopback", "name-on-bridge"]
)


def job(devices: int, nodes: int) -> list[str]:
    return [sys.executable, JOB, "--devices", str(devices), "--nodes", str(nodes), "--timeout", "30"]


def check_job(runs, hosts: list, environment: str, main_address: str, main_port: int) -> None:
    """Every process ended well, and rank r's result says it ran on
    ``hosts[r]``, with the node, main address and port expected."""
    for run in runs:
        assert run.returncode == 0, run.describe()
    results = sorted((r for run in runs for r in run.results), key=lambda r: r["rank"])
    world = len(hosts)
    assert [r["rank"] for r in results] == list(range(world)), [run.describe() for run in runs]
    nodes = list(dict.fromkeys(host.name for host in hosts))
    per_node = world // len(nodes)
    for rank, result in enumerate(results):
        assert result["environment"] == environment, result
        assert result["launcher"] == "in_process", result
        assert result["world_size"] == world, result
        assert result["host"] == hosts[rank].name, result
        assert result["node_rank"] == nodes.index(hosts[rank].name), result
        assert result["local_rank"] == rank % per_node, result
        assert (result["main_address"], result["main_port"]) == (main_address, main_port), result
        assert result["all_reduce"] == world * (world + 1) / 2, result
        assert result["hosts"] == [host.name for host in hosts], result
        assert result["ddp_gradient"] == [float(world + 1)] * 4, result
        # gloo on the host's address on the bridge; rank 0's store on every interface
        assert [a for a in result["listening"] if a not in ("0.0.0.0", "::")] == [hosts[rank].address], result
        assert not any(ipaddress.ip_address(a).is_loopback for a in result["listening"]), result


@NAMES
def test_lsf_jsrun_tasks_on_two_compute_hosts(make_bed, run_nodes, tmp_path, names_on_loopback):
    bed = make_bed(3, names_on_loopback=names_on_loopback)
    launch, *compute = bed.hosts
    devices, slots = 2, 4  # jsrun runs 2 tasks on each host of 4 slots
    slot_hosts = [launch.name] + [host.name for host in compute for _ in range(slots)]
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("\n".join(slot_hosts) + "\n")
    job_vars = {
        "LSB_JOBID": "424242",
        "LSB_JOBNAME": "phalanx-multihost",
        "LSB_DJOB_RANKFILE": str(rankfile),
        "LSB_DJOB_HOSTFILE": str(rankfile),
        "LSB_MCPU_HOSTS": " ".join([f"{launch.name} 1"] + [f"{host.name} {slots}" for host in compute]),
        "LSB_HOSTS": " ".join(slot_hosts),
    }
    tasks = [host for host in compute for _ in range(devices)]  # jsrun packs ranks host by host
    world = len(tasks)
    task_vars = [
        {
            "JSM_NAMESPACE_RANK": str(rank),
            "JSM_NAMESPACE_SIZE": str(world),
            "JSM_NAMESPACE_LOCAL_RANK": str(rank % devices),
            "JSM_NAMESPACE_LOCAL_SIZE": str(devices),
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": str(world),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % devices),
            "OMPI_COMM_WORLD_LOCAL_SIZE": str(devices),
            "PMIX_RANK": str(rank),
        }
        for rank in range(world)
    ]
    runs = run_nodes(
        tasks, [job(devices, len(compute))] * world, env=job_vars, node_env=task_vars, timeout=120
    )
    # The first compute host, by its address on the bridge, on every node;
    # the port is 10000 + the job id's last four digits.
    check_job(runs, tasks, "lsf", main_address=compute[0].address, main_port=14242)


@NAMES
def test_kubeflow_pytorchjob_one_process_per_pod(make_bed, run_nodes, names_on_loopback):
    bed = make_bed(2, names_on_loopback=names_on_loopback)
    master = bed.hosts[0]
    pod_vars = {
        "MASTER_ADDR": master.name,
        "MASTER_PORT": "23456",
        "WORLD_SIZE": str(len(bed.hosts)),
        "PYTHONUNBUFFERED": "0",
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    }
    runs = run_nodes(
        bed.hosts,
        [job(1, len(bed.hosts))] * len(bed.hosts),
        env=pod_vars,
        node_env=[{"RANK": str(index)} for index in range(len(bed.hosts))],
        timeout=120,
    )
    check_job(runs, bed.hosts, "kubeflow", main_address=master.name, main_port=23456)
