"""Launcher ``ray_replica_groups``: a ``replica_groups`` job whose hosts Ray
chooses. Imports ray and torchft only when it launches.

``phalanx run --strategy ddp_ft --launcher ray_replica_groups
--replica-groups 4 --num-nodes 2 --devices 1 train.py`` asks Ray for
``num_nodes`` nodes with ``num_processes`` CPUs each (a placement group,
one bundle a node, on distinct nodes: ``STRICT_SPREAD``), and starts on
each an actor that runs that node's part of the job as ``phalanx run``
runs it on each of several hosts (:mod:`phalanx_torchft._node`): node 0's
the lighthouse (at its node's address, on a port its actor found free)
and its groups, every other node's its groups, each group restarted by its
own node. Ray starts nothing again: a node whose actor is lost (its
machine) is lost to the job with its groups, and the other nodes' groups
train on. What each node prints comes to this process.

The Ray instance is ``phalanx_ray``'s: the cluster at ``address`` (or
``RAY_ADDRESS``), else a local one started for the job on 127.0.0.1 (one
node). On a cluster joined, the working directory goes to the actors as
Ray's ``working_dir``, as under launcher ``ray``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

from phalanx_core import MisconfigurationError, UnavailableError
from phalanx_core.launching import carried_variables

from .launcher import ReplicaGroupsLauncher, _say, _write

__all__ = ["RayReplicaGroupsLauncher"]

_TAG = "launcher 'ray_replica_groups'"


class RayReplicaGroupsLauncher(ReplicaGroupsLauncher):
    """``replica_groups`` on the nodes Ray gives (see the module's
    docstring).

    Options: those of ``replica_groups``, and
        address: the Ray cluster to join (``"auto"``, ``"host:6379"``);
            default ``RAY_ADDRESS``, else a local Ray instance for the job.
        placement_timeout: seconds to wait for ``num_nodes`` nodes with
            ``num_processes`` free CPUs each (default 60).
    """

    is_interactive_compatible: ClassVar[bool] = False

    def __init__(
        self,
        *,
        environment: Any = None,
        num_processes: int = 1,
        num_nodes: int = 1,
        node_rank: int | None = None,
        accelerator: Any = None,
        replica_groups: int = 2,
        max_restarts: int = 3,
        min_replicas: int = 1,
        heartbeat_timeout: float = 1.0,
        join_timeout: float = 1.0,
        quorum_tick: float = 0.05,
        lighthouse: str | None = None,
        address: str | None = None,
        placement_timeout: float = 60.0,
        monitor_interval: float = 0.1,
        rendezvous_timeout: float = 900.0,
    ) -> None:
        super().__init__(
            environment=environment,
            num_processes=num_processes,
            num_nodes=num_nodes,
            node_rank=0,  # this process places the nodes; each one's rank is its bundle's
            replica_groups=replica_groups,
            max_restarts=max_restarts,
            min_replicas=min_replicas,
            heartbeat_timeout=heartbeat_timeout,
            join_timeout=join_timeout,
            quorum_tick=quorum_tick,
            lighthouse=lighthouse,
            monitor_interval=monitor_interval,
            rendezvous_timeout=rendezvous_timeout,
        )
        if self.hosts_per_group > 1:
            raise MisconfigurationError(
                f"{_TAG} runs whole groups on each Ray node, and replica_groups={replica_groups} on "
                f"num_nodes={num_nodes} nodes would spread each group over {self.hosts_per_group} "
                "nodes; give replica_groups a multiple of num_nodes, or run the groups that span hosts "
                "with launcher replica_groups (phalanx run on every host, or srun / mpirun)"
            )
        device = getattr(accelerator, "name", "cpu")
        if device != "cpu":
            raise MisconfigurationError(
                f"{_TAG} asks Ray for CPUs for each node's groups, and accelerator {device!r} is not "
                "cpu: run GPU groups with launcher replica_groups on each host (phalanx run on every "
                "host, or srun / mpirun)"
            )
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise MisconfigurationError(
                f"{_TAG}: address={address!r}; give a Ray address ('auto', 'host:6379'), or none "
                "for a local Ray instance"
            )
        if isinstance(placement_timeout, bool) or not isinstance(placement_timeout, (int, float)):
            placement_timeout = -1
        if placement_timeout <= 0:
            raise MisconfigurationError(
                f"{_TAG}: placement_timeout={placement_timeout!r}; expected seconds, more than 0"
            )
        self.address = address
        self.placement_timeout = float(placement_timeout)

    @classmethod
    def runs_per_node(cls, environment: type[Any]) -> bool:
        return False  # it places the nodes itself

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        return (
            "as launcher replica_groups does on each of the nodes Ray gives, node 0's address being its "
            "Ray node's; and Ray's own servers (127.0.0.1 for a local Ray instance started for the job)"
        )

    def explain(self) -> dict[str, str]:
        said = super().explain()
        per_node = self.replica_groups // self.num_nodes
        said["groups"] = (
            f"{self.replica_groups} replica groups of {self.num_processes} rank(s) each, {per_node} on each "
            f"of {self.num_nodes} Ray node(s), each a job of its own (store, ranks); a group that fails is "
            f"started again alone by its node, up to {self.max_restarts} time(s) each, while the others "
            "train on"
        )
        if self.lighthouse is None:
            said["lighthouse"] = (
                "TorchFT's, in node 0's process (on the Ray node of the placement group's first bundle), at "
                "that node's address and a port free there (the next one: where the nodes say the job has "
                "ended); if that node is lost, every other group stops with NoQuorumError within the "
                "strategy's quorum_timeout"
            )
        said["hosts"] = (
            f"{self.num_nodes} Ray node(s) with {self.num_processes} free CPU(s) each (a placement group, "
            f"distinct nodes), at {self._where()}; an actor on each runs its node's groups and dies with "
            "them; a node lost is lost to the job with its groups, the others train on"
        )
        return said

    def _where(self) -> str:
        address = self.address or os.environ.get("RAY_ADDRESS")
        return f"address={address}" if address else "a local Ray instance started for the job"

    def run_script(self, command: Sequence[str]) -> None:
        """Run ``python *command`` in every rank of every group, on
        ``num_nodes`` Ray nodes; return when every node has ended. Raise
        ``SystemExit``: a node's failed status, 1 where every node was
        lost, ``128 + signal`` when this process was stopped."""
        import ray
        from phalanx_ray.launcher import RayCluster
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        joins = not ray.is_initialized() and bool(self.address or os.environ.get("RAY_ADDRESS"))
        cluster = RayCluster(
            self.address, self.num_processes * self.num_nodes, {"working_dir": os.getcwd()} if joins else None
        )
        stopped: list[int] = []
        previous = {
            number: signal.signal(number, lambda n, _f: stopped.append(n))
            for number in (signal.SIGTERM, signal.SIGHUP)
        }
        group: Any = None
        actors: list[Any] = []
        try:
            group = placement_group(
                [{"CPU": float(self.num_processes)}] * self.num_nodes,
                strategy="STRICT_SPREAD" if self.num_nodes > 1 else "PACK",
            )
            if not ray.wait([group.ready()], timeout=self.placement_timeout)[0]:
                nodes = [n for n in ray.nodes() if n.get("Alive")]
                raise UnavailableError(
                    f"{_TAG}: Ray gave no {self.num_nodes} distinct node(s) with {self.num_processes} free "
                    f"CPU(s) each in {self.placement_timeout:g} s (placement_timeout); the cluster has "
                    f"{len(nodes)} node(s): "
                    + "; ".join(
                        f"{n['NodeManagerAddress']} {n['Resources'].get('CPU', 0):g} CPU" for n in nodes
                    )
                )
            node_run = ray.remote(NodeRun)
            actors = [
                node_run.options(
                    num_cpus=self.num_processes,
                    max_concurrency=2,  # run() holds one thread, take() the other
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=node
                    ),
                ).remote()
                for node in range(self.num_nodes)
            ]
            main, port = ray.get(actors[0].where.remote())
            env = {**carried_variables(), "MASTER_ADDR": main, "MASTER_PORT": str(port)}
            cwd = None if joins else os.getcwd()
            refs = {
                actor.run.remote(self._settings(node), env, list(command), cwd): node
                for node, actor in enumerate(actors)
            }
            codes: dict[int, int | None] = {}
            while refs and not stopped:
                done, _ = ray.wait(list(refs), timeout=0.2)
                self._relay(ray, actors)
                for ref in done:
                    node = refs.pop(ref)
                    try:
                        codes[node] = ray.get(ref)
                        if codes[node]:
                            _say(f"phalanx run: node {node}'s groups ended with exit status {codes[node]}")
                    except ray.exceptions.RayActorError as exc:
                        codes[node] = None
                        _say(
                            f"phalanx run: node {node}'s actor was lost ({type(exc).__name__}): its groups "
                            "are lost to the job; the other nodes' groups train on"
                        )
            self._relay(ray, actors)
        except KeyboardInterrupt:
            stopped.append(signal.SIGINT)
        finally:
            for actor in actors:
                ray.kill(actor)  # its node's process dies with it, and that node's groups with it
            if group is not None:
                remove_placement_group(group)
            cluster.close()
            for number, handler in previous.items():
                signal.signal(number, handler)
        if stopped:
            raise SystemExit(128 + stopped[0])
        failed = [code for code in codes.values() if code]
        if failed:
            raise SystemExit(failed[0])
        if all(code is None for code in codes.values()):
            raise SystemExit(1)

    def _settings(self, node: int) -> dict[str, Any]:
        """The options of node ``node``'s ``replica_groups`` launcher."""
        return {
            "num_processes": self.num_processes,
            "num_nodes": self.num_nodes,
            "node_rank": node,
            "replica_groups": self.replica_groups,
            "max_restarts": self.max_restarts,
            "min_replicas": self.min_replicas,
            "heartbeat_timeout": self.heartbeat_timeout,
            "join_timeout": self.join_timeout,
            "quorum_tick": self.quorum_tick,
            "lighthouse": self.lighthouse,
            "monitor_interval": self.monitor_interval,
            "rendezvous_timeout": self.rendezvous_timeout,
        }

    @staticmethod
    def _relay(ray: Any, actors: list[Any]) -> None:
        """Print what the nodes printed since the last look (a lost node's
        actor has nothing more to say)."""
        for actor in actors:
            try:
                lines = ray.get(actor.take.remote())
            except ray.exceptions.RayActorError:
                continue
            if lines:
                _write(sys.stdout, "".join(lines).encode())


class NodeRun:
    """A Ray actor on one node of the job: runs that node's part of it in a
    process of its own (:mod:`phalanx_torchft._node`), which dies with the
    actor, and keeps its output for the launching process."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._lock = threading.Lock()

    def where(self) -> tuple[str, int]:
        """This node's address, and a port that is free here with the one
        after it (the lighthouse's, and the store of the job's end)."""
        import ray

        address = ray.util.get_node_ip_address()
        for _ in range(100):
            with socket.socket() as probe:
                probe.bind((address, 0))
                port = probe.getsockname()[1]
            if port < 65535 and _free(address, port) and _free(address, port + 1):
                return address, port
        raise UnavailableError(f"{_TAG}: no two free ports in a row on {address}")

    def run(self, settings: dict[str, Any], env: dict[str, str], command: list[str], cwd: str | None) -> int:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "phalanx_torchft._node",
                json.dumps(settings),
                str(os.getpid()),
                "--",
                *command,
            ],
            env={**os.environ, **env},
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert process.stdout is not None
        for line in iter(process.stdout.readline, b""):
            with self._lock:
                self._lines.append(line.decode(errors="replace"))
        return process.wait()

    def take(self) -> list[str]:
        with self._lock:
            lines, self._lines = self._lines, []
        return lines


def _free(address: str, port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((address, port))
        except OSError:
            return False
    return True
