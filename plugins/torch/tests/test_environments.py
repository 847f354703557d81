"""Cluster environments, as tables of environment variables: what each
environment reads, what its validation refuses, and which one the registry
detects. The variables are the ones the real schedulers set (seen under
torchrun, srun/sbatch/salloc of Slurm 22.05 and mpirun of OpenMPI 4.1); the
real runs are in tests/real/."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import zlib

import pytest

import phalanx
from phalanx_core import MisconfigurationError
from phalanx_torch.environments import (
    KubeflowEnvironment,
    LocalEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
    VariablesEnvironment,
    expand_hostlist,
)

HOST = socket.gethostname()
ENVIRONMENTS = {
    "torchelastic": TorchElasticEnvironment,
    "slurm": SLURMEnvironment,
    "lsf": LSFEnvironment,
    "kubeflow": KubeflowEnvironment,
    "mpi": MPIEnvironment,
    "variables": VariablesEnvironment,
    "local": LocalEnvironment,
}
PRIORITY = {
    "torchelastic": 100,
    "slurm": 80,
    "lsf": 70,
    "kubeflow": 60,
    "mpi": 50,
    "variables": 10,
    "local": 0,
}
_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "LSB_", "JSM_", "KUBERNETES_")
_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")
_NAMES += ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def scheduler_variables(environ=os.environ) -> list[str]:
    return [k for k in environ if k.startswith(_PREFIXES) or k in _NAMES]


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No scheduler variable of the machine running the tests leaks in (CI
    may itself run under Slurm)."""
    for name in scheduler_variables():
        monkeypatch.delenv(name)


def setenv(monkeypatch, variables: dict[str, str]) -> None:
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def values(env) -> dict:
    return {
        "main_address": env.main_address,
        "main_port": env.main_port,
        "world_size": env.world_size,
        "global_rank": env.global_rank,
        "local_rank": env.local_rank,
        "node_rank": env.node_rank,
    }


# -- what the schedulers set ---------------------------------------------------------

TORCHRUN = {  # torchrun --standalone --nproc-per-node 2, rank 1
    "TORCHELASTIC_RUN_ID": "c4483f80",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1",
    "MASTER_ADDR": "localhost",
    "MASTER_PORT": "38397",
}
SRUN = {  # srun -N1 -n2, task 1
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "1",
    "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "phx-a1",
    "SLURM_STEP_NODELIST": "phx-a1",
    "SLURM_NNODES": "1",
    "SLURM_STEP_NUM_NODES": "1",
    "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2",
}
SRUN_2_NODES = {  # srun -N2 --ntasks-per-node=2, task 3
    **SRUN,
    "SLURM_JOB_ID": "123456",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_NODEID": "1",
    "SLURM_NODELIST": "phx-n[07-08]",
    "SLURM_STEP_NODELIST": "phx-n[07-08]",
    "SLURM_NNODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}
SBATCH = {  # the batch script of sbatch -n 4: no step
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_NODELIST": "phx-a1",
    "SLURM_NNODES": "1",
    "SLURM_TASKS_PER_NODE": "4",
}
SALLOC = {  # the shell of salloc -n 2
    "SLURM_JOB_ID": "78",
    "SLURM_NTASKS": "2",
    "SLURM_NODELIST": "phx-a1",
    "SLURM_NNODES": "1",
    "SLURM_JOB_NAME": "interactive",
}
SRUN_PTY = {**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "1", "SLURM_PTY_PORT": "38075"}
SRUN_PTY.update(SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1", SLURM_JOB_NAME="bash")
MPIRUN = {  # OpenMPI 4.1 mpirun -np 2, rank 1
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "OMPI_COMM_WORLD_NODE_RANK": "1",  # the rank on the node, not the node
    "OMPI_MCA_ess_base_jobid": "1416888321",
    "OMPI_MCA_orte_num_nodes": "1",
    "PMIX_NAMESPACE": "1416888321",
    "PMIX_RANK": "1",
}
MPIRUN_2_NODES = {
    **MPIRUN,
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
    "PMIX_RANK": "3",
    "MASTER_ADDR": "phx-m0",
}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}  # MPICH
JSRUN = {  # jsrun on an LSF job of two compute hosts, rank 3 (jsrun also sets OMPI_* for Spectrum MPI)
    "LSB_JOBID": "98765",
    "LSB_HOSTS": f"phx-batch {HOST} {HOST} phx-c2 phx-c2",
    "JSM_NAMESPACE_RANK": "3",
    "JSM_NAMESPACE_SIZE": "4",
    "JSM_NAMESPACE_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "4",
}
KUBEFLOW = {  # PyTorchJob, worker pod 2 of 3
    "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "3",
    "RANK": "2",
}


# -- host lists ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
        ("host-0[01-03]", ["host-001", "host-002", "host-003"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("a,b[1-2],c", ["a", "b1", "b2", "c"]),
        ("r[1-2]n[08-09]", ["r1n08", "r1n09", "r2n08", "r2n09"]),
        ("n[009-010] m1", ["n009", "n010", "m1"]),
        ("", []),
    ],
)
def test_expand_hostlist(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize(
    ("text", "error"), [("n[1-2", "'\\[' without '\\]'"), ("n1-2]", "without"), ("n[a-b]", "not a number")]
)
def test_expand_hostlist_refuses_what_it_cannot_read(text, error):
    with pytest.raises(ValueError, match=error):
        expand_hostlist(text)


# -- each environment's values ------------------------------------------------------


def _values_table():
    def row(id_, cls, variables, **expected):
        return pytest.param(cls, variables, expected, id=id_)

    return [
        row("torchrun", TorchElasticEnvironment, TORCHRUN, main_address="127.0.0.1", main_port=38397,
            world_size=2, global_rank=1, local_rank=1, node_rank=0),
        row("torchrun-2-nodes", TorchElasticEnvironment,
            {**TORCHRUN, "RANK": "3", "WORLD_SIZE": "4", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
             "MASTER_ADDR": "phx-head"},
            main_address="phx-head", main_port=38397, world_size=4, global_rank=3, local_rank=1,
            node_rank=1),
        row("srun", SLURMEnvironment, SRUN, main_address="127.0.0.1", main_port=14242, world_size=2,
            global_rank=1, local_rank=1, node_rank=0),
        row("srun-2-nodes", SLURMEnvironment, SRUN_2_NODES, main_address="phx-n07", main_port=13456,
            world_size=4, global_rank=3, local_rank=1, node_rank=1),
        row("srun-node-0-is-this-host", SLURMEnvironment,
            {**SRUN_2_NODES, "SLURM_STEP_NODELIST": f"{HOST},phx-n9", "SLURM_NODEID": "0"},
            main_address="127.0.0.1", main_port=13456, world_size=4, global_rank=3, local_rank=1,
            node_rank=0),
        row("srun-master-vars-win", SLURMEnvironment,
            {**SRUN_2_NODES, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29511"},
            main_address="10.0.0.5", main_port=29511, world_size=4, global_rank=3, local_rank=1,
            node_rank=1),
        row("sbatch-script", SLURMEnvironment, SBATCH, main_address="127.0.0.1", main_port=10077,
            world_size=1, global_rank=0, local_rank=0, node_rank=0),
        row("salloc-shell", SLURMEnvironment, SALLOC, main_address="127.0.0.1", main_port=10078,
            world_size=1, global_rank=0, local_rank=0, node_rank=0),
        row("jsrun", LSFEnvironment, JSRUN, main_address="127.0.0.1", main_port=18765, world_size=4,
            global_rank=3, local_rank=1, node_rank=0),
        row("jsrun-second-host", LSFEnvironment,
            {**JSRUN, "LSB_HOSTS": f"phx-batch phx-c1 phx-c1 {HOST} {HOST}"},
            main_address="phx-c1", main_port=18765, world_size=4, global_rank=3, local_rank=1,
            node_rank=1),
        row("kubeflow", KubeflowEnvironment, KUBEFLOW, main_address="job-master-0", main_port=23456,
            world_size=3, global_rank=2, local_rank=0, node_rank=2),
        row("mpich-hydra", MPIEnvironment, HYDRA, main_address="127.0.0.1", main_port=29500,
            world_size=2, global_rank=1, local_rank=1, node_rank=0),
        row("mpirun-2-nodes", MPIEnvironment, MPIRUN_2_NODES, main_address="phx-m0",
            main_port=20000 + zlib.crc32(b"1416888321") % 10000, world_size=4, global_rank=3,
            local_rank=1, node_rank=1),
        row("local-alone", LocalEnvironment, {}, main_address="127.0.0.1", main_port=29500,
            world_size=1, global_rank=0, local_rank=0, node_rank=0),
    ]  # fmt: skip


@pytest.mark.parametrize(("cls", "variables", "expected"), _values_table())
def test_values(monkeypatch, cls, variables, expected):
    setenv(monkeypatch, variables)
    assert values(cls()) == expected


def test_mpirun_port_is_agreed_from_the_job_id_alone(monkeypatch):
    setenv(monkeypatch, MPIRUN)
    port = MPIEnvironment().main_port
    assert 20000 <= port < 30000
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")  # another rank of the same job
    assert MPIEnvironment().main_port == port
    monkeypatch.setenv("PMIX_NAMESPACE", "1416888999")  # another job
    assert MPIEnvironment().main_port != port
    monkeypatch.setenv("MASTER_PORT", "29123")
    assert MPIEnvironment().main_port == 29123
    assert values(MPIEnvironment()) | {"main_port": 0} == {
        "main_address": "127.0.0.1",
        "main_port": 0,
        "world_size": 2,
        "global_rank": 0,
        "local_rank": 1,
        "node_rank": 0,
    }


def test_lsf_reads_the_rankfile_before_lsb_hosts(monkeypatch, tmp_path):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("phx-launch\nphx-c1\nphx-c1\n" + f"{HOST}\n{HOST}\n")
    setenv(monkeypatch, {**JSRUN, "LSB_DJOB_RANKFILE": str(rankfile), "LSB_HOSTS": "x y z"})
    env = LSFEnvironment()
    assert (env.main_address, env.node_rank) == ("phx-c1", 1)
    env.validate(num_devices=2, num_nodes=2)


@pytest.mark.parametrize(
    ("mine", "host", "same"),
    [
        ("10.10.10.2", "10.10.10.2", True),
        ("10.10.10.2", "10.10.10.0", False),  # not by the first label of an address
        ("node1", "node1.cluster", True),  # one name short: the short names
        ("node1.cluster", "node1", True),
        ("node1.a.example", "node1.b.example", False),  # two qualified names: whole
        ("node1", "node2", False),
        ("anything", "localhost", True),
    ],
)
def test_a_host_is_this_one_only_when_its_name_is(monkeypatch, mine, host, same):
    from phalanx_torch._launch import scheduler_vars as _scheduler_vars

    monkeypatch.setattr(_scheduler_vars.socket, "gethostname", lambda: mine)
    assert _scheduler_vars._is_this_host(host) is same


def test_lsf_with_addresses_for_host_names_finds_its_node(monkeypatch, tmp_path):
    from phalanx_torch._launch import scheduler_vars as _scheduler_vars

    monkeypatch.setattr(_scheduler_vars.socket, "gethostname", lambda: "10.10.10.2")
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("launch\n" + "".join(f"10.10.10.{i}\n" for i in range(4)))
    setenv(monkeypatch, {**JSRUN, "LSB_DJOB_RANKFILE": str(rankfile)})
    env = LSFEnvironment()
    assert (env.main_address, env.node_rank) == ("10.10.10.0", 2)


def test_lsf_refuses_several_nodes_with_an_empty_rank_file(monkeypatch, tmp_path):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("")
    setenv(monkeypatch, {**JSRUN, "LSB_DJOB_RANKFILE": str(rankfile)})
    with pytest.raises(MisconfigurationError, match=r"num_nodes=2, but the job lists no compute hosts"):
        LSFEnvironment().validate(num_devices=2, num_nodes=2)


def test_scheduler_environments_say_they_started_the_processes():
    started = {name for name, cls in ENVIRONMENTS.items() if cls.creates_processes_externally}
    assert started == set(ENVIRONMENTS) - {"local"}


# -- validation ---------------------------------------------------------------------


def _validate_table():
    def row(id_, cls, variables, devices, nodes, error):
        return pytest.param(cls, variables, devices, nodes, error, id=id_)

    slurm_4 = {**SRUN, "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "4"}
    return [
        row("slurm-tasks", SLURMEnvironment, slurm_4, 2, 1,
            r"SLURM_NTASKS=4 process\(es\), but devices=2 x num_nodes=1 = 2 .*--ntasks-per-node=2 "
            r"--nodes=1\), or set devices=4"),
        row("slurm-nodes", SLURMEnvironment, SRUN_2_NODES, 2, 1,
            r"runs on SLURM_NNODES=2 node\(s\), but num_nodes=1 .* pass num_nodes=2"),
        row("slurm-uneven", SLURMEnvironment, {**SRUN_2_NODES, "SLURM_STEP_TASKS_PER_NODE": "3,1"}, 2, 2,
            r"SLURM_TASKS_PER_NODE=3,1 process\(es\) per node, but devices=2 needs 2 on every node"),
        row("sbatch-without-srun", SLURMEnvironment, SBATCH, 4, 1,
            r"inside a Slurm allocation \(job 77\) but was not started with srun .* run `srun --nodes=1 "
            r"--ntasks-per-node=4 python script.py` .* environment='local'"),
        row("salloc-without-srun", SLURMEnvironment, SALLOC, 2, 1, r"was not started with srun"),
        row("srun-pty-shell", SLURMEnvironment, SRUN_PTY, 2, 1,
            r"not started with srun for this script: .* interactive step \(srun --pty"),
        row("slurm-bad-nodelist", SLURMEnvironment, {**SRUN_2_NODES, "SLURM_STEP_NODELIST": "n[1-"}, 2, 2,
            r"cannot read the Slurm node list"),
        row("torchrun-missing", TorchElasticEnvironment, {"TORCHELASTIC_RUN_ID": "x"}, 1, 1,
            r"RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are not set; start the script "
            r"with `torchrun"),
        row("torchrun-processes", TorchElasticEnvironment, TORCHRUN, 4, 1,
            r"torchrun started WORLD_SIZE=2 process\(es\), but devices=4 x num_nodes=1 = 4 .*"
            r"torchrun --nproc-per-node=4 --nnodes=1"),
        row("torchrun-nodes", TorchElasticEnvironment, TORCHRUN, 1, 2,
            r"GROUP_WORLD_SIZE=1 node\(s\), but num_nodes=2"),
        row("jsrun-missing", LSFEnvironment, {"LSB_JOBID": "5", "LSB_HOSTS": "b c"}, 2, 1,
            r"inside an LSF job \(5\) but was not started with jsrun .*`jsrun --nrs 2 --rs_per_host 2"),
        row("jsrun-processes", LSFEnvironment, JSRUN, 1, 2, r"JSM_NAMESPACE_SIZE=4 process\(es\), but"),
        row("jsrun-foreign-host", LSFEnvironment, {**JSRUN, "LSB_HOSTS": "b phx-c1 phx-c2"}, 2, 2,
            r"this host \(.*\) is not among the LSF job's compute hosts \(phx-c1, phx-c2\)"),
        row("kubeflow-devices", KubeflowEnvironment, KUBEFLOW, 2, 3,
            r"one process per pod, and this job has WORLD_SIZE=3 pod\(s\), but devices=2 x num_nodes=3"
            r".* pass devices=1, num_nodes=3"),
        row("mpi-processes", MPIEnvironment, MPIRUN, 4, 1,
            r"mpirun started OMPI_COMM_WORLD_SIZE=2 process\(es\), but devices=4 .*\(mpirun -np 4 "
            r"--npernode 4"),
        row("mpi-map-by-node", MPIEnvironment, {**MPIRUN_2_NODES, "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, 2, 2,
            r"did not fill each node in turn .*\(--map-by slot\), or set NODE_RANK"),
        row("variables-nodes", VariablesEnvironment,
            {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
            1, 2, r"needs NODE_RANK set on each node"),
    ]  # fmt: skip


@pytest.mark.parametrize(("cls", "variables", "devices", "nodes", "error"), _validate_table())
def test_validate_says_what_to_change(monkeypatch, cls, variables, devices, nodes, error):
    setenv(monkeypatch, variables)
    with pytest.raises(MisconfigurationError, match=error):
        cls().validate(num_devices=devices, num_nodes=nodes)


@pytest.mark.parametrize(
    ("cls", "variables", "devices", "nodes"),
    [
        (TorchElasticEnvironment, TORCHRUN, 2, 1),
        (SLURMEnvironment, SRUN, 2, 1),
        (SLURMEnvironment, SRUN_2_NODES, 2, 2),
        (SLURMEnvironment, SBATCH, 1, 1),  # one process in a batch script is a world of one
        (SLURMEnvironment, SRUN_PTY, 1, 1),
        (LSFEnvironment, JSRUN, 2, 2),
        (KubeflowEnvironment, KUBEFLOW, 1, 3),
        (MPIEnvironment, MPIRUN, 2, 1),
        (MPIEnvironment, MPIRUN_2_NODES, 2, 2),
        (MPIEnvironment, {**MPIRUN_2_NODES, "OMPI_COMM_WORLD_LOCAL_RANK": "0", "NODE_RANK": "1"}, 2, 2),
        (MPIEnvironment, HYDRA, 2, 1),
    ],
)
def test_validate_accepts_a_matching_job(monkeypatch, cls, variables, devices, nodes):
    setenv(monkeypatch, variables)
    cls().validate(num_devices=devices, num_nodes=nodes)


# -- detection ------------------------------------------------------------------------

HAND = {  # two processes a user started, this one rank 1 (torch's env:// variables)
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29511",
}

DETECTION = [
    pytest.param({}, {"local"}, id="nothing"),
    pytest.param(TORCHRUN, {"torchelastic", "variables", "local"}, id="torchrun"),
    pytest.param(
        {**TORCHRUN, **KUBEFLOW, **TORCHRUN}, {"torchelastic", "variables", "local"}, id="torchrun-in-a-pod"
    ),
    pytest.param({**SRUN, **TORCHRUN}, {"torchelastic", "slurm", "variables", "local"}, id="srun-torchrun"),
    pytest.param(HAND, {"variables", "local"}, id="started-by-hand"),
    pytest.param(SRUN, {"slurm", "local"}, id="srun"),
    pytest.param(SBATCH, {"slurm", "local"}, id="sbatch-script"),
    pytest.param(SALLOC, {"slurm", "local"}, id="salloc-shell"),
    pytest.param({**SRUN, "PMI_RANK": "1", "PMI_SIZE": "2"}, {"slurm", "mpi", "local"}, id="srun-mpi-pmi2"),
    pytest.param(MPIRUN, {"mpi", "local"}, id="mpirun"),
    pytest.param({**SBATCH, **MPIRUN}, {"mpi", "local"}, id="mpirun-in-sbatch"),
    pytest.param(
        {**SRUN, "SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", **HYDRA},
        {"mpi", "local"},
        id="hydra-mpirun-in-slurm",
    ),
    pytest.param(HYDRA, {"mpi", "local"}, id="mpich-hydra"),
    pytest.param({"PMIX_RANK": "0"}, {"local"}, id="pmix-rank-without-a-size"),
    pytest.param(JSRUN, {"lsf", "mpi", "local"}, id="jsrun"),
    pytest.param({"LSB_JOBID": "5"}, {"lsf", "local"}, id="lsf-batch-script"),
    pytest.param({"LSB_JOBID": "5", **MPIRUN}, {"mpi", "local"}, id="mpirun-in-lsf"),
    pytest.param(KUBEFLOW, {"kubeflow", "local"}, id="kubeflow"),
    pytest.param({k: v for k, v in KUBEFLOW.items() if k != "RANK"}, {"local"}, id="pod-without-rank"),
    pytest.param(
        {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "x", "PMI_SIZE": "y", "PMI_RANK": "z"},
        {"slurm", "mpi", "local"},
        id="garbage-does-not-raise",
    ),
]


@pytest.mark.parametrize(("variables", "detected"), DETECTION)
def test_detect(monkeypatch, variables, detected):
    setenv(monkeypatch, variables)
    assert {name for name, cls in ENVIRONMENTS.items() if cls.detect()} == detected


@pytest.fixture(scope="module")
def registry():
    return phalanx.Registry()


@pytest.mark.parametrize(("variables", "detected"), DETECTION)
def test_the_registry_picks_the_highest_priority(monkeypatch, registry, variables, detected):
    setenv(monkeypatch, variables)
    plan = registry.plan("single_device", accelerator="cpu")
    want = max(detected, key=PRIORITY.__getitem__)
    assert plan.environment is not None and plan.launcher is not None
    assert (plan.environment.name, plan.environment.reason) == (want, f"detected (priority {PRIORITY[want]})")
    assert plan.launcher.name == "in_process"


def test_the_spec_priorities_are_the_documented_order(registry):
    entries = registry.entries("environment")
    assert {e.name: e.spec.priority for e in entries if e.name in PRIORITY} == PRIORITY


@pytest.mark.parametrize(
    ("variables", "devices", "error"),
    [
        (SBATCH, 2, r"was not started with srun"),
        ({**SRUN, "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4"}, 2, r"SLURM_NTASKS=4 .* set devices=4"),
        (MPIRUN, 3, r"OMPI_COMM_WORLD_SIZE=2 process\(es\), but devices=3"),
    ],
    ids=["sbatch", "srun", "mpirun"],
)
def test_resolve_stops_at_validation(monkeypatch, registry, variables, devices, error):
    setenv(monkeypatch, variables)
    with pytest.raises(MisconfigurationError, match=error):
        registry.resolve("ddp", accelerator="cpu", devices=devices)


@pytest.mark.parametrize(
    ("variables", "launcher", "reason"),
    [
        (SRUN, "in_process", "environment 'slurm' already started one process per rank"),
        (MPIRUN, "in_process", "environment 'mpi' already started one process per rank"),
        (TORCHRUN, "in_process", "environment 'torchelastic' already started one process per rank"),
        ({}, "subprocess", "the strategy's default"),
    ],
    ids=["srun", "mpirun", "torchrun", "nothing"],
)
def test_a_scheduler_makes_ddp_run_in_its_processes(monkeypatch, registry, variables, launcher, reason):
    setenv(monkeypatch, variables)
    plan = registry.plan("ddp", accelerator="cpu", devices=2)
    assert plan.launcher is not None
    assert (plan.launcher.name, plan.launcher.reason) == (launcher, reason)


@pytest.mark.subprocess
@pytest.mark.parametrize(
    "variables",
    [SRUN, MPIRUN, TORCHRUN, JSRUN, KUBEFLOW],
    ids=["srun", "mpirun", "torchrun", "jsrun", "kubeflow"],
)
def test_detection_imports_no_torch(variables):
    env = {k: v for k, v in os.environ.items() if k not in scheduler_variables()}
    code = (
        "import json, sys, phalanx\n"
        "plan = phalanx.plan('single_device', accelerator='cpu')\n"
        "print(json.dumps([plan.environment.name, 'torch' in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, **variables}, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    name, imported = json.loads(out.stdout.splitlines()[-1])
    assert name != "local" and not imported


def test_processes_started_by_hand_run_in_place(monkeypatch):
    setenv(monkeypatch, HAND)
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2)
    assert type(strategy.environment) is VariablesEnvironment
    assert type(strategy.launcher).__name__ == "InProcessLauncher"  # not two more processes
    assert (strategy.global_rank, strategy.world_size) == (1, 2)
    auto = phalanx.resolve(accelerator="cpu")  # devices 'auto': the processes that exist
    assert (type(auto).__name__, len(auto.parallel_devices)) == ("DDPStrategy", 2)
    with pytest.raises(MisconfigurationError, match=r"started WORLD_SIZE=2 process\(es\), but devices=3"):
        phalanx.resolve("ddp", accelerator="cpu", devices=3)


def test_a_local_rank_beyond_the_devices_is_refused_not_an_index_error(monkeypatch):
    setenv(monkeypatch, {**HAND, "LOCAL_RANK": "2", "RANK": "0", "WORLD_SIZE": "1"})
    with pytest.raises(MisconfigurationError, match=r"LOCAL_RANK=2(, but| is set, but) devices=1"):
        phalanx.resolve(accelerator="cpu", devices=1)


def test_an_outside_environment_with_the_wrong_world_is_refused_for_any_environment():
    class OneProcess(LocalEnvironment):
        creates_processes_externally = True  # a third party's, whose validate checks nothing

    with pytest.raises(MisconfigurationError, match=r"OneProcess started 1 process\(es\).*devices=2"):
        phalanx.resolve("ddp", accelerator="cpu", devices=2, environment=OneProcess())


def test_mpi_on_several_nodes_needs_master_addr_only_where_it_is_read(monkeypatch):
    """A collective that meets at an address reads ``main_address`` and is
    told to set MASTER_ADDR; validating the layout (what the mpi
    collective, which needs no address, goes through) does not ask for it."""
    setenv(monkeypatch, {**MPIRUN_2_NODES, "MASTER_ADDR": ""})
    environment = MPIEnvironment()
    environment.validate(num_devices=2, num_nodes=2)
    with pytest.raises(MisconfigurationError, match=r"cannot agree on rank 0's host, where this collective"):
        environment.main_address
    assert environment.main_port > 0
