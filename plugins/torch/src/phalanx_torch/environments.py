"""Cluster environments that read this machine's variables. Imports no torch.

Detection order (the spec priorities in :mod:`phalanx_torch.plugin`), first
match wins: ``torchelastic`` (100), ``slurm`` (80), ``lsf`` (70),
``kubeflow`` (60), ``mpi`` (50), ``local`` (0, always). Every ``detect()``
reads variables only and never raises; every problem with what it read is
reported by ``validate()``, which the registry calls before building the
rest of the strategy. None of these environments changes the process's
variables, so none needs a ``teardown()``.

Rendezvous address and port, everywhere: ``MASTER_ADDR`` / ``MASTER_PORT``
when set (the user asked for them), else ``127.0.0.1`` on one node and the
first host of the job otherwise, and a port every rank derives from the job
id alone, without talking to the others.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import ClassVar

from phalanx_core import ClusterEnvironment, MisconfigurationError

from ._launch.ranks import MIN_NODES_VAR
from ._launch.scheduler_vars import (
    _LOOPBACK,
    _address,
    _check_layout,
    _first_int,
    _int_var,
    _is_this_host,
    _mpi_launcher_started_this,
    _need_int,
    _peek_int,
    _port_from_job_id,
    _port_from_key,
    _tasks_per_node,
    _var,
    expand_hostlist,
)

__all__ = [
    "KubeflowEnvironment",
    "LSFEnvironment",
    "LocalEnvironment",
    "MPIEnvironment",
    "SLURMEnvironment",
    "TorchElasticEnvironment",
    "expand_hostlist",
]


def node_rank_needed(num_nodes: int) -> str:
    """The error of several nodes on the local environment without
    ``NODE_RANK`` where something needs it."""
    return (
        f"num_nodes={num_nodes} on the local environment needs NODE_RANK set on each node "
        "(and MASTER_ADDR pointing at node 0); set them (phalanx run --node-rank N --main-address "
        "ADDRESS), let the nodes meet in rounds that number them (--max-restarts N, --num-nodes "
        "MIN:MAX or --rendezvous etcd://...), or use a scheduler's environment (slurm, torchelastic)"
    )


class LocalEnvironment(ClusterEnvironment):
    """This machine, with ranks given by a launcher (or one process alone).

    Reads ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` where a launcher set them; without
    them it is rank 0 of a world of one on ``127.0.0.1``. Always detected:
    it is the default, with the lowest priority.
    """

    creates_processes_externally: ClassVar[bool] = False

    def __init__(self, *, main_address: str = "127.0.0.1", main_port: int = 29500) -> None:
        self._main_address = main_address
        self._main_port = main_port
        self._num_nodes = 1  # as validate() was told

    @classmethod
    def detect(cls) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", self._main_address)

    @property
    def main_port(self) -> int:
        return _int_var("MASTER_PORT", self._main_port)

    @property
    def world_size(self) -> int:
        return _int_var("WORLD_SIZE", 1)

    @property
    def global_rank(self) -> int:
        return _int_var("RANK", 0)

    @property
    def local_rank(self) -> int:
        return _int_var("LOCAL_RANK", 0)

    @property
    def node_rank(self) -> int:
        if self._num_nodes > 1 and not self.node_rank_given:
            # Read where no NODE_RANK was given for several nodes: node 0 is
            # not assumed (the subprocess launcher asks node_rank_given first).
            raise MisconfigurationError(node_rank_needed(self._num_nodes))
        return _int_var("NODE_RANK", 0)

    @property
    def node_rank_given(self) -> bool:
        """Whether this node was given its rank (``NODE_RANK``). Several
        nodes that meet in rounds need none: the rendezvous numbers them
        (the ``subprocess`` launcher says which need it)."""
        return "NODE_RANK" in os.environ

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        self._num_nodes = num_nodes
        if "LOCAL_RANK" in os.environ and not 0 <= self.local_rank < num_devices:
            raise MisconfigurationError(
                f"LOCAL_RANK={self.local_rank} is set, but devices={num_devices}: this process would "
                f"be local rank {self.local_rank} of {num_devices}; unset LOCAL_RANK, or start every "
                "process with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT (environment "
                "'variables') and devices= the processes on each node"
            )


class VariablesEnvironment(LocalEnvironment):
    """Processes you started yourself, one per rank, with torch's ``env://``
    variables set: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
    and ``MASTER_PORT`` (``NODE_RANK`` on several nodes). Detected when all
    five are set (and no scheduler is); phalanx then runs ``fn`` in these
    processes (launcher ``in_process``) instead of starting more, as Fabric
    does. Below every scheduler's environment, above ``local``."""

    creates_processes_externally: ClassVar[bool] = True
    VARIABLES: ClassVar[tuple[str, ...]] = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def detect(cls) -> bool:
        return all(name in os.environ for name in cls.VARIABLES)

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        missing = [name for name in self.VARIABLES if name not in os.environ]
        if missing:
            raise MisconfigurationError(
                f"environment 'variables' reads {', '.join(self.VARIABLES)}, and {', '.join(missing)} "
                "is not set; set every one in each process you start, or use environment='local' and "
                "let a launcher start them"
            )
        if num_nodes != 1 and not self.node_rank_given:
            raise MisconfigurationError(node_rank_needed(num_nodes))
        super().validate(num_devices=num_devices, num_nodes=num_nodes)
        _check_layout(
            who="the processes you started",
            world=("WORLD_SIZE", self.world_size),
            nodes=None,
            per_node=None,
            num_devices=num_devices,
            num_nodes=num_nodes,
            fix="start devices x num_nodes = {total} processes",
        )
        if not 0 <= self.local_rank < num_devices:
            raise MisconfigurationError(
                f"LOCAL_RANK={self.local_rank}, but devices={num_devices}: each node's processes have "
                f"LOCAL_RANK 0..{num_devices - 1}; set LOCAL_RANK in that range, or devices= to the "
                "processes started on each node"
            )


class TorchElasticEnvironment(ClusterEnvironment):
    """Processes started by ``torchrun`` (torch.distributed.elastic).

    Detected by ``TORCHELASTIC_RUN_ID``; ranks from ``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``GROUP_RANK`` (the node), ``LOCAL_WORLD_SIZE`` and
    ``GROUP_WORLD_SIZE``; the rendezvous is torchrun's own ``MASTER_ADDR`` /
    ``MASTER_PORT`` (its store listens there, on every interface), with
    ``127.0.0.1`` for this host's own name on one node (``--standalone``
    sets ``localhost``).
    """

    creates_processes_externally: ClassVar[bool] = True
    _NEEDED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def detect(cls) -> bool:
        return _var("TORCHELASTIC_RUN_ID") is not None

    @property
    def main_address(self) -> str:
        address = _var("MASTER_ADDR") or _LOOPBACK
        one_node = _int_var("GROUP_WORLD_SIZE", 1) == 1
        return _LOOPBACK if one_node and _is_this_host(address) else address

    @property
    def main_port(self) -> int:
        return _need_int(("MASTER_PORT",), "torchelastic")

    @property
    def local_world_size(self) -> int | None:
        """The processes torchrun started on this node (``LOCAL_WORLD_SIZE``)."""
        return _first_int(("LOCAL_WORLD_SIZE",))

    @property
    def world_size(self) -> int:
        return _need_int(("WORLD_SIZE",), "torchelastic")

    @property
    def global_rank(self) -> int:
        return _need_int(("RANK",), "torchelastic")

    @property
    def local_rank(self) -> int:
        return _need_int(("LOCAL_RANK",), "torchelastic")

    @property
    def node_rank(self) -> int:
        return _int_var("GROUP_RANK", 0)

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        missing = [name for name in self._NEEDED if not os.environ.get(name)]
        if missing:
            raise MisconfigurationError(
                f"TORCHELASTIC_RUN_ID is set, so this process looks started by torchrun, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; start the "
                "script with `torchrun ... script.py` (not by hand with only some variables), or "
                "unset TORCHELASTIC_RUN_ID"
            )
        local = _first_int(("LOCAL_WORLD_SIZE",))
        groups = _first_int(("GROUP_WORLD_SIZE",))
        fewest = _first_int((MIN_NODES_VAR,))
        if groups is not None and fewest is not None and fewest <= groups <= num_nodes:
            # A job of MIN:MAX nodes (phalanx run --num-nodes), num_nodes
            # its most: this round has the nodes it has.
            num_nodes = groups
        _check_layout(
            who="torchrun",
            world=("WORLD_SIZE", self.world_size),
            nodes=("GROUP_WORLD_SIZE", groups) if groups is not None else None,
            per_node=("LOCAL_WORLD_SIZE", [local]) if local is not None else None,
            num_devices=num_devices,
            num_nodes=num_nodes,
            fix="torchrun --nproc-per-node={devices} --nnodes={num_nodes}",
            others_unseen=True,
        )


class SLURMEnvironment(ClusterEnvironment):
    """A Slurm job step: one process per task, started by ``srun``.

    Ranks from ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and
    ``SLURM_NODEID``; the rendezvous is the step's first node (from the
    compressed ``SLURM_STEP_NODELIST`` / ``SLURM_NODELIST``: its IP address,
    the same on every node; ``127.0.0.1`` on one node) and port ``10000 +``
    the last four digits of ``SLURM_JOB_ID``
    (``MASTER_ADDR`` / ``MASTER_PORT`` win when set). Two steps of one job
    running at once on one node need different ``MASTER_PORT`` values.

    Detected in any Slurm job, also where the script was *not* started by
    ``srun`` (a batch script or a ``salloc`` shell: ``SLURM_JOB_ID`` without
    ``SLURM_STEP_ID``). That is deliberate: a job of several tasks whose
    script runs as one plain process would otherwise fall through to the
    ``local`` environment and silently train as a world of one, so
    :meth:`validate` stops it with what to run instead. Such a process is
    rank 0 of a world of one, which is right for ``devices=1, num_nodes=1``.
    Not detected when an ``mpirun`` inside the job made this process (the
    ranks are then the MPI launcher's: ``mpi``).
    """

    creates_processes_externally: ClassVar[bool] = True

    @classmethod
    def detect(cls) -> bool:
        if _var("SLURM_JOB_ID", "SLURM_JOBID") is None:
            return False
        tasks = _peek_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if cls._in_step() else 1
        return not _mpi_launcher_started_this(tasks, _peek_int("SLURM_PROCID"))

    @staticmethod
    def _in_step() -> bool:
        """Whether srun started this process (a job step), not the batch script or salloc."""
        return _var("SLURM_STEP_ID", "SLURM_STEPID") is not None

    @property
    def job_id(self) -> str:
        return _var("SLURM_JOB_ID", "SLURM_JOBID") or "0"

    def _hosts(self) -> list[str]:
        nodelist = "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"
        text = _var(*nodelist) or ""
        try:
            return expand_hostlist(text)
        except ValueError as exc:
            raise MisconfigurationError(
                f"cannot read the Slurm node list: {exc}; is {nodelist[0]} intact?"
            ) from exc

    @property
    def main_address(self) -> str:
        return _address(self._hosts() if self._in_step() else [])

    @property
    def main_port(self) -> int:
        return _int_var("MASTER_PORT", _port_from_job_id(self.job_id))

    @property
    def world_size(self) -> int:
        return _need_int(("SLURM_NTASKS", "SLURM_STEP_NUM_TASKS"), "slurm") if self._in_step() else 1

    @property
    def global_rank(self) -> int:
        return _need_int(("SLURM_PROCID",), "slurm") if self._in_step() else 0

    @property
    def local_rank(self) -> int:
        return _need_int(("SLURM_LOCALID",), "slurm") if self._in_step() else 0

    @property
    def node_rank(self) -> int:
        return _need_int(("SLURM_NODEID",), "slurm") if self._in_step() else 0

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        wanted = num_devices * num_nodes
        run = f"srun --nodes={num_nodes} --ntasks-per-node={num_devices} python script.py"
        instead = (
            f"or pass environment='local' to have phalanx start the {num_devices} process(es) on this "
            "node itself"
        )
        if _var("SLURM_JOB_ID", "SLURM_JOBID") is None:
            raise MisconfigurationError(
                "environment 'slurm' was asked for, but this process is not in a Slurm job (SLURM_JOB_ID "
                f"is not set); start it with `{run}` inside an allocation (sbatch, salloc), or drop "
                "environment= to run here"
            )
        if not self._in_step():
            if wanted > 1:
                raise MisconfigurationError(
                    f"this runs inside a Slurm allocation (job {self.job_id}) but was not started with "
                    f"srun (SLURM_STEP_ID is not set: a batch script or a salloc shell), so it is one "
                    f"process where devices={num_devices} x num_nodes={num_nodes} = {wanted} are "
                    f"needed; run `{run}` from the batch script or the allocation, {instead}"
                )
            return
        if self.world_size == 1 < wanted and _var("SLURM_PTY_PORT") is not None:
            raise MisconfigurationError(
                f"this runs inside a Slurm allocation (job {self.job_id}) but was not started with "
                f"srun for this script: it is the one task of an interactive step (srun --pty, "
                f"SLURM_PTY_PORT is set), where devices={num_devices} x num_nodes={num_nodes} = "
                f"{wanted} processes are needed; run `{run}` from that shell, {instead}"
            )
        self._hosts()  # raises when the node list cannot be read
        nodes = _first_int(("SLURM_STEP_NUM_NODES", "SLURM_NNODES"))
        per_node = _var("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
        _check_layout(
            who=f"Slurm job {self.job_id}",
            world=("SLURM_NTASKS", self.world_size),
            nodes=("SLURM_NNODES", nodes) if nodes is not None else None,
            per_node=("SLURM_TASKS_PER_NODE", _tasks_per_node(per_node)) if per_node else None,
            num_devices=num_devices,
            num_nodes=num_nodes,
            fix="set --ntasks-per-node={devices} --nodes={num_nodes}",
        )


class LSFEnvironment(ClusterEnvironment):
    """An IBM Spectrum LSF job whose processes ``jsrun`` started.

    Ranks from ``JSM_NAMESPACE_RANK``, ``JSM_NAMESPACE_SIZE`` and
    ``JSM_NAMESPACE_LOCAL_RANK``; hosts from the file named by
    ``LSB_DJOB_RANKFILE`` (one line per slot), else ``LSB_HOSTS``. The first
    host of either list is the job's launch node, which runs no rank, and is
    dropped. The node rank is this host's place among the others; the port
    ``10000 +`` the last four digits of ``LSB_JOBID``.

    Like ``slurm``, detected in any LSF job (``LSB_JOBID``), also where
    ``jsrun`` did not start the script, so that :meth:`validate` says so
    instead of a silent world of one; not detected when an ``mpirun`` made
    the process without ``jsrun`` (``mpi`` reads those ranks).
    """

    creates_processes_externally: ClassVar[bool] = True

    @classmethod
    def detect(cls) -> bool:
        if _var("LSB_JOBID") is None:
            return False
        return cls._in_jsrun() or not _mpi_launcher_started_this(None, None)

    @staticmethod
    def _in_jsrun() -> bool:
        return _var("JSM_NAMESPACE_RANK") is not None and _var("JSM_NAMESPACE_SIZE") is not None

    def _hosts(self) -> list[str]:
        """The compute hosts, each once, in order (the launch node dropped)."""
        rankfile = _var("LSB_DJOB_RANKFILE")
        if rankfile is not None:
            try:
                lines = Path(rankfile).read_text().split()
            except OSError as exc:
                raise MisconfigurationError(
                    f"LSB_DJOB_RANKFILE={rankfile!r} cannot be read ({exc}); run inside the LSF job "
                    "that wrote it, or unset it to use LSB_HOSTS"
                ) from exc
        else:
            lines = (_var("LSB_HOSTS") or "").split()
        return list(dict.fromkeys(lines[1:]))

    @property
    def main_address(self) -> str:
        return _address(self._hosts())

    @property
    def main_port(self) -> int:
        return _int_var("MASTER_PORT", _port_from_job_id(_var("LSB_JOBID") or "0"))

    @property
    def world_size(self) -> int:
        return _need_int(("JSM_NAMESPACE_SIZE",), "lsf") if self._in_jsrun() else 1

    @property
    def global_rank(self) -> int:
        return _need_int(("JSM_NAMESPACE_RANK",), "lsf") if self._in_jsrun() else 0

    @property
    def local_rank(self) -> int:
        return _need_int(("JSM_NAMESPACE_LOCAL_RANK",), "lsf") if self._in_jsrun() else 0

    @property
    def node_rank(self) -> int:
        return self._node_index(self._hosts())

    @staticmethod
    def _node_index(hosts: list[str]) -> int:
        if len(hosts) <= 1:
            return 0
        mine = [i for i, host in enumerate(hosts) if _is_this_host(host)]
        if not mine:
            raise MisconfigurationError(
                f"this host ({socket.gethostname()}) is not among the LSF job's compute hosts "
                f"({', '.join(hosts)}); run inside the job, or set LSB_DJOB_RANKFILE to the job's file"
            )
        return mine[0]

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        wanted = num_devices * num_nodes
        job = _var("LSB_JOBID")
        if not self._in_jsrun():
            if wanted > 1:
                raise MisconfigurationError(
                    f"this runs inside an LSF job ({job}) but was not started with jsrun "
                    f"(JSM_NAMESPACE_RANK is not set), so it is one process where devices="
                    f"{num_devices} x num_nodes={num_nodes} = {wanted} are needed; run `jsrun --nrs "
                    f"{wanted} --rs_per_host {num_devices} --tasks_per_rs 1 python script.py`, or pass "
                    "environment='local' to have phalanx start the processes on this node itself"
                )
            return
        hosts = self._hosts()
        if not hosts and num_nodes > 1:
            where = _var("LSB_DJOB_RANKFILE")
            raise MisconfigurationError(
                f"LSF job {job}: num_nodes={num_nodes}, but the job lists no compute hosts ("
                + (f"LSB_DJOB_RANKFILE={where!r} names none" if where else "LSB_HOSTS names none")
                + "), so no node can tell its rank or find node 0; run inside the job LSF started, whose "
                "rank file lists its hosts"
            )
        self._node_index(hosts)  # raises when this host is not one of the job's
        _check_layout(
            who=f"LSF job {job}",
            world=("JSM_NAMESPACE_SIZE", self.world_size),
            nodes=("compute hosts", len(hosts)) if hosts else None,
            per_node=None,
            num_devices=num_devices,
            num_nodes=num_nodes,
            fix="jsrun --nrs {total} --rs_per_host {devices} --tasks_per_rs 1",
        )


class KubeflowEnvironment(ClusterEnvironment):
    """A Kubeflow PyTorchJob: one process per pod.

    Detected in a Kubernetes pod (``KUBERNETES_PORT``) with ``MASTER_ADDR``,
    ``MASTER_PORT``, ``WORLD_SIZE`` and ``RANK`` set by the operator, and not
    under torchrun. ``WORLD_SIZE`` counts pods; each pod is a node of one
    process, so ``local_rank`` is 0 and ``node_rank`` is ``RANK``.
    """

    creates_processes_externally: ClassVar[bool] = True

    @classmethod
    def detect(cls) -> bool:
        needed = ("KUBERNETES_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")
        return all(_var(name) is not None for name in needed) and _var("TORCHELASTIC_RUN_ID") is None

    @property
    def main_address(self) -> str:
        return _var("MASTER_ADDR") or _LOOPBACK

    @property
    def main_port(self) -> int:
        return _need_int(("MASTER_PORT",), "kubeflow")

    @property
    def world_size(self) -> int:
        return _need_int(("WORLD_SIZE",), "kubeflow")

    @property
    def global_rank(self) -> int:
        return _need_int(("RANK",), "kubeflow")

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return self.global_rank

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        pods = self.world_size
        if num_devices != 1 or num_nodes != pods:
            raise MisconfigurationError(
                f"a Kubeflow PyTorchJob runs one process per pod, and this job has WORLD_SIZE={pods} "
                f"pod(s), but devices={num_devices} x num_nodes={num_nodes} were asked for; pass "
                f"devices=1, num_nodes={pods}, or set the job's replicas to {num_nodes} (to run "
                f"{num_devices} processes in each pod, start the script with torchrun in the pod)"
            )


class MPIEnvironment(ClusterEnvironment):
    """Processes started by ``mpirun``/``mpiexec``, read from the variables
    the MPI launcher sets; mpi4py is not imported (no MPI call is needed).

    Ranks from OpenMPI's ``OMPI_COMM_WORLD_RANK``/``_SIZE``/``_LOCAL_RANK``/
    ``_LOCAL_SIZE``, else the PMI ones (MPICH, Intel MPI: ``PMI_RANK``,
    ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``; ``PMIX_RANK``).
    No launcher sets the node's index (``OMPI_COMM_WORLD_NODE_RANK`` is the
    rank on the node), so on several nodes ``node_rank`` is ``NODE_RANK``
    when set, else ``rank // local_size``, which holds for mpirun's default
    placement (each node filled in turn); :meth:`validate` refuses other
    placements.

    Rendezvous: ``MASTER_ADDR`` (needed on several nodes, since the ranks
    cannot agree on rank 0's host without talking; ``127.0.0.1`` on one),
    ``MASTER_PORT`` or a port in 20000-29999 hashed from the job's id
    (``PMIX_NAMESPACE``, ``OMPI_MCA_ess_base_jobid``, ``PMI_JOBID``), or
    29500 when the launcher sets none of those.
    """

    creates_processes_externally: ClassVar[bool] = True
    _RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
    _SIZE = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    _LOCAL_RANK = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
    _LOCAL_SIZE = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
    _JOB = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID")

    @classmethod
    def detect(cls) -> bool:
        return _var(*cls._RANK) is not None and _var(*cls._SIZE) is not None

    @property
    def _local_size(self) -> int:
        """Ranks on this node; the whole world when the launcher does not say."""
        return _first_int(self._LOCAL_SIZE, self.world_size) or 1

    @property
    def _one_node(self) -> bool:
        return self._local_size == self.world_size

    @property
    def main_address(self) -> str:
        """``MASTER_ADDR``; ``127.0.0.1`` on one node. On several nodes
        without it, reading this raises: a collective that meets at an
        address (the ``torch`` one) needs it, one that talks through MPI
        (``collective="mpi"``) reads none."""
        address = _var("MASTER_ADDR")
        if address:
            return address
        try:
            one_node = self._one_node
        except MisconfigurationError:  # no mpirun variables: nothing to say about nodes here
            one_node = True
        if one_node:
            return _LOOPBACK
        raise MisconfigurationError(
            f"mpirun started ranks on {self.world_size // self._local_size} nodes, and without talking "
            "to each other they cannot agree on rank 0's host, where this collective meets; set "
            "MASTER_ADDR to rank 0's host name and pass it to every rank (OpenMPI: mpirun -x "
            "MASTER_ADDR=host0 -x MASTER_PORT=29500 ...), or use collective='mpi', which needs no address"
        )

    @property
    def main_port(self) -> int:
        job = _var(*self._JOB)
        return _int_var("MASTER_PORT", _port_from_key(job) if job else 29500)

    @property
    def world_size(self) -> int:
        return _need_int(self._SIZE, "mpi")

    @property
    def global_rank(self) -> int:
        return _need_int(self._RANK, "mpi")

    @property
    def local_rank(self) -> int:
        return _first_int(self._LOCAL_RANK, self.global_rank if self._one_node else None) or 0

    @property
    def node_rank(self) -> int:
        if _var("NODE_RANK") is not None:
            return _int_var("NODE_RANK", 0)
        return 0 if self._one_node else self.global_rank // self._local_size

    def validate(self, *, num_devices: int, num_nodes: int) -> None:
        world, local = self.world_size, self._local_size
        _check_layout(
            who="mpirun",
            world=(self._found(self._SIZE), world),
            nodes=("ranks / local ranks", world // local) if world % local == 0 else None,
            per_node=(self._found(self._LOCAL_SIZE), [local]) if _var(*self._LOCAL_SIZE) else None,
            num_devices=num_devices,
            num_nodes=num_nodes,
            fix="mpirun -np {total} --npernode {devices} (OpenMPI) or -ppn {devices} (MPICH)",
        )
        if self._one_node:
            return
        if _var(*self._LOCAL_RANK) is None:
            raise MisconfigurationError(
                f"mpirun started ranks on {num_nodes} nodes but set no local rank "
                f"({' or '.join(self._LOCAL_RANK)}); use an MPI launcher that sets one, or torchrun"
            )
        if _var("NODE_RANK") is None and self.local_rank != self.global_rank % local:
            raise MisconfigurationError(
                f"rank {self.global_rank} is local rank {self.local_rank} of {local}, so mpirun did "
                "not fill each node in turn and the node's index cannot be worked out; use mpirun's "
                "default placement (--map-by slot), or set NODE_RANK on every rank"
            )

    @staticmethod
    def _found(names: tuple[str, ...]) -> str:
        return next((name for name in names if os.environ.get(name)), names[0])
