"""Launcher ``replica_groups``: TorchFT's lighthouse and N replica groups,
each restarted on its own. Imports torchft only when it launches.

Layout of a job on one host (``phalanx run --strategy ddp_ft
--replica-groups 3 --devices 2 train.py``):

* this process hosts TorchFT's lighthouse (``torchft.coordination.
  LighthouseServer``) on ``127.0.0.1`` and a port the kernel gives;
* each group is a child process (:mod:`phalanx_torchft._group`) that runs
  the group's ranks as the ``subprocess`` launcher runs a one-node job
  (its agent loop, a store of the group's own), with the group's
  number, the number of groups and the lighthouse's URL in the ranks'
  variables;
* a group that fails (any of its ranks) is started again, up to
  ``max_restarts`` times for that group; the others are not touched, and go
  on training without it until it is back. The job ends when every group
  has ended; it fails when a group failed more often than it may restart.

On several hosts (``--num-nodes N --node-rank R --main-address A
--main-port P`` on every host), each host runs ``replica_groups / N``
whole groups, numbered ``R * (replica_groups / N) + i``, or, with fewer
groups than hosts, a part of group ``R // k`` of ``k = N /
replica_groups`` hosts (see :mod:`._group`; the group's hosts learn where
its store is through node 0's, :mod:`._end`); node 0's
launching process hosts the lighthouse at ``A:P`` (or none does: every
host is given ``lighthouse=URL`` of one that runs elsewhere). A group's
store and its ranks' gloo then listen on the address this host reaches the
lighthouse from, not on ``127.0.0.1``: TorchFT's groups meet in one
group's store, and heal over gloo, across hosts.

Under a scheduler that started one process per node (``srun
--ntasks-per-node=1 phalanx run --strategy ddp_ft --num-nodes N ...``,
``mpirun --map-by ppr:1:node``), ``phalanx run`` runs as this launcher in
each of them (:meth:`runs_per_node`): the scheduler's environment gives
the node rank and node 0's address and port, and each node starts its
groups as above. The scheduler starts nothing again: a failed group is
this launcher's to restart.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, ClassVar
from urllib.parse import urlsplit

from phalanx_core import MisconfigurationError
from phalanx_core.launching import (
    LOOPBACK,
    RESTART_COUNT_VAR,
    STOP_GRACE,
    run_flags_changed,
    stop_processes,
)
from phalanx_core.network import is_loopback, route_source
from phalanx_torch.launchers import SubprocessLauncher

from ._end import JobEnd
from ._lighthouse import LEASE, TERM_FILE_VAR
from ._variables import (
    COMMITTED_FILE_VAR,
    FINISHED_FILE_VAR,
    GROUP_ADDRESS_VAR,
    GROUP_FAILURE_FILE_VAR,
    LIGHTHOUSE_VAR,
    MIN_REPLICAS_VAR,
    REPLICA_GROUP_VAR,
    REPLICA_GROUPS_VAR,
)

__all__ = ["ReplicaGroupsLauncher"]

logger = logging.getLogger(__name__)


class ReplicaGroupsLauncher(SubprocessLauncher):
    """Starts TorchFT's lighthouse and ``replica_groups`` groups of
    ``num_processes`` ranks each, and restarts a group that fails without
    stopping the others (see the module's docstring).

    Options:
        replica_groups: how many replica groups the job has, on all its
            hosts (default 2; ``phalanx run --replica-groups N``); on
            ``num_nodes`` hosts, a multiple of ``num_nodes``.
        max_restarts: how many times *each group* may be started again
            after it failed (default 3; ``--max-restarts``).
        min_replicas: the fewest groups a step may have: the lighthouse
            forms no quorum of fewer, and the survivors wait. Default 1;
            with ``rendezvous`` in etcd (the lighthouse elected) a majority
            of the groups, ``replica_groups // 2 + 1``: a part of the job cut
            off from the rest never commits a step on its own (no split
            brain, whatever the timing; see :mod:`._lighthouse`).
        heartbeat_timeout: seconds without a heartbeat after which the
            lighthouse drops a group from the quorum (default 1.0). A
            survivor's stall after a group dies is about this long.
        join_timeout: seconds the lighthouse waits for the groups it knows
            of to join a quorum before forming it without them (default 1.0).
        quorum_tick: seconds between the lighthouse's quorum checks
            (default 0.05).
        lighthouse: the URL of a lighthouse that runs elsewhere
            (``http://HOST:PORT``; ``phalanx run --lighthouse URL``), which
            the groups use instead of one this launcher starts; the
            lighthouse's own settings (the four above but
            ``max_restarts``) are then its own. Default: this launcher
            starts one, on 127.0.0.1 on one host, on node 0 at the main
            address and port on several.
    """

    is_interactive_compatible: ClassVar[bool] = False
    #: Each host runs the groups of its node rank: it needs one.
    node_ranks_from_rounds: ClassVar[bool] = False

    def __init__(
        self,
        *,
        environment: Any = None,
        num_processes: int = 1,
        num_nodes: int = 1,
        node_rank: int | None = None,
        replica_groups: int = 2,
        max_restarts: int = 3,
        min_replicas: int | None = None,
        heartbeat_timeout: float = 1.0,
        join_timeout: float = 1.0,
        quorum_tick: float = 0.05,
        lighthouse: str | None = None,
        rendezvous: str | None = None,
        monitor_interval: float = 0.1,
        rendezvous_timeout: float = 900.0,
    ) -> None:
        super().__init__(
            environment=environment,
            num_processes=num_processes,
            num_nodes=num_nodes,
            node_rank=node_rank,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            rendezvous_timeout=rendezvous_timeout,
            rendezvous=rendezvous,
        )
        if lighthouse is not None and self._elected:
            raise MisconfigurationError(
                f"launcher 'replica_groups': lighthouse={lighthouse!r} and rendezvous={rendezvous!r}: with "
                "the rendezvous in etcd the hosts elect the lighthouse among themselves (one runs it, "
                "another takes over if its host is lost); give one or the other"
            )
        if min_replicas is None:
            elected = rendezvous is not None and self._place().kind == "etcd"
            min_replicas = replica_groups // 2 + 1 if elected and isinstance(replica_groups, int) else 1
        for name, value in (("replica_groups", replica_groups), ("min_replicas", min_replicas)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MisconfigurationError(
                    f"launcher 'replica_groups': {name}={value!r}; expected an int of at least 1"
                )
        if replica_groups % num_nodes and num_nodes % replica_groups:
            spans = "".join(
                f", {d} ({num_nodes // d} hosts a group)"
                for d in range(num_nodes - 1, 1, -1)
                if num_nodes % d == 0
            )
            raise MisconfigurationError(
                f"launcher 'replica_groups': replica_groups={replica_groups} on num_nodes={num_nodes} "
                "hosts: each host runs the same number of whole groups (a multiple of "
                f"{num_nodes}), or each group spans the same number of hosts (a divisor of {num_nodes}); "
                f"give --replica-groups {num_nodes * max(1, replica_groups // num_nodes)}{spans}"
            )
        if min_replicas > replica_groups:
            raise MisconfigurationError(
                f"launcher 'replica_groups': min_replicas={min_replicas} is more than "
                f"replica_groups={replica_groups}: no quorum could ever form; lower min_replicas"
            )
        for name, seconds in (
            ("heartbeat_timeout", heartbeat_timeout),
            ("join_timeout", join_timeout),
            ("quorum_tick", quorum_tick),
        ):
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or seconds <= 0:
                raise MisconfigurationError(
                    f"launcher 'replica_groups': {name}={seconds!r}; expected a number of seconds above 0"
                )
        if lighthouse is not None:
            _check_url(lighthouse)
        self.replica_groups = replica_groups
        self.min_replicas = min_replicas
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.join_timeout = float(join_timeout)
        self.quorum_tick = float(quorum_tick)
        self.lighthouse = lighthouse
        #: The lighthouse's URL while a job runs.
        self.lighthouse_url: str | None = None
        #: The address this host's groups listen on while a job runs.
        self.group_address = LOOPBACK
        #: The file that exists once this host knows the job has finished.
        self.finished_marker: Path | None = None
        #: The file with the term of the lighthouse this host follows
        #: (several hosts), while a job runs.
        self.term_file: Path | None = None
        #: The traceback every group failed with before the job committed a
        #: step, where they all failed alike (the job then ended).
        self.failed_alike: str | None = None
        #: Why the job's lighthouse did not let this host in, where it did not.
        self.refused: str | None = None
        self._forwarder: Any = None
        #: The tracebacks the groups' ranks printed, each with the first
        #: rank that did (``"group0 rank1"``): printed again, one line.
        self.tracebacks: dict[bytes, str] = {}

    @property
    def _elected(self) -> bool:
        """Whether the hosts elect the lighthouse (the rendezvous in etcd)."""
        return self.rendezvous is not None and self._place().kind == "etcd"

    @property
    def hosts_per_group(self) -> int:
        """How many hosts each group spans: 1 where each host runs whole
        groups, else ``num_nodes / replica_groups``."""
        return max(1, self.num_nodes // self.replica_groups)

    @property
    def groups_here(self) -> range:
        """The numbers of the groups this host runs (a part of, where a
        group spans several hosts)."""
        span = self.hosts_per_group
        if span > 1:
            return range(self.node_rank // span, self.node_rank // span + 1)
        count = self.replica_groups // self.num_nodes
        return range(self.node_rank * count, (self.node_rank + 1) * count)

    @property
    def part(self) -> int:
        """This host's place among its group's hosts (0: the group's store
        is here), where a group spans several hosts; else 0."""
        return self.node_rank % self.hosts_per_group

    @classmethod
    def listens(cls, num_nodes: int) -> str | None:
        if num_nodes == 1:
            return (
                "127.0.0.1: the lighthouse, each group's store and its ranks' gloo (healing transfers "
                "included); every interface ([::]): TorchFT's manager server (each group's rank 0), "
                "which TorchFT 0.2 binds so with no option to narrow it"
            )
        return (
            "node 0: the lighthouse's guard at the main address and port (the lighthouse itself on "
            "127.0.0.1 behind it; with an etcd rendezvous, the elected host's guard at its own address "
            "and the main port), and a store at the main port + 1 (not with etcd) where the hosts say "
            "that the job has ended and where a group's store is (no guard, lighthouse or store where "
            "lighthouse=URL is given; the store then only where groups span hosts); every node: a "
            "forwarder to the lighthouse on 127.0.0.1, each group's store (a group's first host, where "
            "it spans hosts) and its ranks' gloo (healing transfers included) on the address that "
            "reaches the lighthouse, on ports the kernel gives; every interface ([::]): TorchFT's "
            "manager server (each group's rank 0), which TorchFT 0.2 binds so with no option to narrow it"
        )

    def listening(self) -> str | None:
        if self.num_nodes > 1 and self._elected:
            return (
                "the lighthouse's guard on the elected host, at its address and the main port (the "
                "lighthouse itself on 127.0.0.1 behind it; the job's end store is in etcd); every node: "
                "a forwarder to the lighthouse on 127.0.0.1, each group's store and its ranks' gloo "
                "(healing transfers included) on the address that reaches the first etcd member, on "
                "ports the kernel gives; every interface ([::]): TorchFT's manager server (each "
                "group's rank 0), which TorchFT 0.2 binds so with no option to narrow it"
            )
        return type(self).listens(self.num_nodes)

    def explain(self) -> dict[str, str]:
        here, span = self.groups_here, self.hosts_per_group
        if span > 1:
            ranks = self.num_processes * span
            groups = (
                f"{self.replica_groups} replica groups of {ranks} rank(s) each, each on {span} hosts "
                f"({self.num_processes} a host); this host runs part {self.part} of group {here.start}"
                + (
                    " and hosts the group's store"
                    if self.part == 0
                    else f", whose store node {self.node_rank - self.part} hosts"
                )
                + ". A failure in a part stops the group's ranks on all its hosts, and each host starts "
                f"its part again, up to {self.max_restarts} time(s), while the other groups train on"
            )
        else:
            where = (
                "on this host"
                if self.num_nodes == 1
                else f"on {self.num_nodes} hosts, groups {here.start} to {here.stop - 1} on this one"
            )
            groups = (
                f"{self.replica_groups} replica groups of {self.num_processes} rank(s) each {where}, "
                "each a job of its own (store, ranks); a group that fails is started again alone, "
                f"up to {self.max_restarts} time(s) each, while the others train on"
            )
        if self.lighthouse is not None:
            lighthouse = f"{self.lighthouse} (lighthouse=), run by someone else; its settings are its own"
        elif self.num_nodes == 1:
            lighthouse = (
                "TorchFT's, in phalanx run's own process (127.0.0.1, a port from the kernel); "
                "if that process is lost, so are the groups"
            )
        elif self._elected:
            place, port = self._place(), self._main()[1]
            lighthouse = (
                f"TorchFT's, elected among the hosts in {place.describe()}: the host that holds "
                f"/phalanx/{place.name}/lighthouse (a lease of {LEASE} s) runs it on 127.0.0.1 behind a "
                f"guard at its own address and port {port} that lets in only hosts that prove "
                "PHALANX_JOB_SECRET; each host's groups reach it through a forwarder on 127.0.0.1 that "
                "follows the key. If its host is lost, another host runs one once the lease has ended, "
                "and no group is started again"
            )
        else:
            main, port = self._main()
            lighthouse = (
                f"TorchFT's, in node 0's phalanx run process at {main}:{port} (the main address and "
                "port; on 127.0.0.1 behind a guard there that lets in only hosts that prove "
                "PHALANX_JOB_SECRET, through each host's forwarder on 127.0.0.1), kept until every "
                f"host's groups have ended (node 0 hears of their end at port {port + 1}); if node 0's "
                "host is lost, every other group stops with NoQuorumError within the strategy's "
                "quorum_timeout (with --rendezvous etcd://... the hosts elect another)"
            )
        return {
            "groups": groups,
            "lighthouse": lighthouse,
            "quorum": (
                "a quorum (each step's under ddp_ft and hsdp_ft, each sync's under local_sgd_ft and "
                "the diloco strategies) is the groups that ask for it with a heartbeat younger than "
                f"{self.heartbeat_timeout:g} s (heartbeat_timeout): at once when every group of the last "
                "quorum has asked; else once every heartbeating group has, or "
                f"{self.join_timeout:g} s after the first did (join_timeout), if they are at least "
                f"{self.min_replicas} (min_replicas) and more than half of the heartbeating groups; "
                f"else it waits. Checked every {self.quorum_tick:g} s (quorum_tick)"
            ),
        }

    @classmethod
    def runs_per_node(cls, environment: type[Any]) -> bool:
        """Yes outside the groups' ranks (which the groups' agent loops
        started): a scheduler's process on each node runs this launcher,
        which starts that node's groups."""
        return not os.environ.get("TORCHELASTIC_RUN_ID")

    def launch(self, fn: Any, *args: Any, **kwargs: Any) -> list[Any]:
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            return super().launch(fn, *args, **kwargs)
        raise MisconfigurationError(
            "launcher 'replica_groups' runs a script: start it with phalanx run --strategy ddp_ft "
            "--replica-groups N script.py (launch(fn) from a script is not supported by this launcher)"
        )

    def run_script(self, command: Sequence[str]) -> None:
        """Run ``python *command`` in every rank of every replica group;
        return when every group has ended. Raise ``SystemExit`` with a
        failed group's exit status when a group failed more often than
        ``max_restarts``, or ``128 + signal`` when this process was
        stopped by a signal (every group is stopped first)."""
        os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at info
        self.failed_alike, self.tracebacks, self.refused = None, {}, None
        folder = Path(tempfile.mkdtemp(prefix="phalanx-replica-groups-"))
        marker = folder / "finished"
        closers: list[Any] = []
        try:
            closers = self._start_lighthouse(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        main, port = self._main()
        # Node 0 hosts the lighthouse, or the groups that span hosts meet through its store;
        # with the rendezvous in etcd, the hosts meet there.
        elected = self._elected
        shared = self.num_nodes > 1 and (elected or self.lighthouse is None or self.hosts_per_group > 1)
        end = JobEnd(
            self.node_rank,
            self.num_nodes,
            main if shared else None,
            port + 1,
            self.group_address,
            marker,
            store=self._etcd_store if elected else None,
        )
        self.finished_marker = marker
        stopped: list[int] = []
        groups = [_Group(index, self, list(command), end, stopped) for index in self.groups_here]
        previous = {
            number: signal.signal(number, lambda n, _f: stopped.append(n))
            for number in (signal.SIGTERM, signal.SIGHUP)
        }
        try:
            end.start()
            failed = self._watch(groups, stopped, end)
            end.host_ended()
            if not stopped and not elected:  # elected: another host takes the lighthouse over
                end.wait_for_other_hosts(_say, stopped)
        except KeyboardInterrupt:
            stopped.append(signal.SIGINT)
            failed = None
        finally:
            stop_processes([g.process for g in groups if g.process is not None], grace=STOP_GRACE)
            for group in groups:
                group.join_output()
            end.close()
            for close in reversed(closers):
                close()
            shutil.rmtree(folder, ignore_errors=True)
            self.lighthouse_url = self.term_file = self._forwarder = None
            for number, handler in previous.items():
                signal.signal(number, handler)
        if stopped:
            raise SystemExit(128 + stopped[0])
        if self.failed_alike is not None or self.refused is not None:
            raise SystemExit(failed.exit_status if failed is not None else 1)
        if failed is not None:
            _say(
                f"phalanx run: replica group {failed.index} failed {failed.restarts + 1} time(s), "
                f"more than max_restarts={self.max_restarts}; its last exit status was "
                f"{failed.status} (its output is in the lines above marked [group{failed.index} ...]). "
                "The other groups ended on their own."
            )
            raise SystemExit(failed.exit_status)

    def _start_lighthouse(self, folder: Path) -> list[Any]:
        """Set ``lighthouse_url`` (what the groups' managers call) and
        ``group_address``; start what this host runs of the way to the
        lighthouse (see :mod:`._lighthouse`) and return what stops it. One
        host: TorchFT's lighthouse on 127.0.0.1. Several: a forwarder on
        127.0.0.1 that the managers call, following node 0's guard (node 0
        runs the lighthouse behind it at the main address and port), or,
        with the rendezvous in etcd, the elected host's (every host stands).
        ``lighthouse=URL``: that one, called directly."""
        main, port = self._main()
        if self.lighthouse is not None:
            self.lighthouse_url = self.lighthouse
            self.group_address = self._group_address()
            return []
        if self.num_nodes == 1:
            local, stop = self._local_lighthouse()
            self.lighthouse_url = f"http://{LOOPBACK}:{local}"
            self.group_address = LOOPBACK
            return [stop]
        from ._lighthouse import Election, Forwarder, Guard, step_down_after

        if self._elected:
            toward, _ = self._place().endpoints[0]
            self.lighthouse_url = f"http://{_url_host(toward)}:{port}"  # for the route to the hosts
        else:
            self.lighthouse_url = f"http://{_url_host(main)}:{port}"
        self.group_address = self._group_address()
        self.term_file = folder / "lighthouse-term"
        forwarder = Forwarder(term_file=self.term_file)
        self._forwarder = forwarder
        closers: list[Any] = [forwarder.close]
        try:
            if self._elected:
                from phalanx_torch.nodes import etcd_client

                place = self._place()
                election = Election(
                    etcd_client(place, patience=2.0),
                    place.name,
                    self.group_address,
                    port,
                    self._local_lighthouse,
                    forwarder,
                    step_down_after=step_down_after(
                        self.min_replicas, self.replica_groups, self.heartbeat_timeout
                    ),
                )
                election.start()
                closers.append(election.close)
            elif self.node_rank == 0:
                local, stop = self._local_lighthouse()
                closers.append(stop)
                try:
                    guard = Guard(self.group_address, port, local)
                except OSError as exc:
                    raise MisconfigurationError(
                        f"launcher 'replica_groups': the lighthouse cannot listen on {self.group_address}:"
                        f"{port} ({exc.strerror or exc}); give a free --main-port"
                    ) from None
                closers.append(guard.close)
                forwarder.follow(self.group_address, port)
            else:
                forwarder.follow(main, port)
        except BaseException:
            for close in reversed(closers):
                close()
            raise
        self.lighthouse_url = forwarder.url
        return closers

    def _local_lighthouse(self) -> tuple[int, Any]:
        """Start TorchFT's lighthouse on 127.0.0.1 and a port the kernel
        gives: its port, and what stops it."""
        from torchft.coordination import LighthouseServer

        try:
            server = LighthouseServer(
                bind=f"{LOOPBACK}:0",
                min_replicas=self.min_replicas,
                join_timeout_ms=round(self.join_timeout * 1000),
                quorum_tick_ms=max(1, round(self.quorum_tick * 1000)),
                heartbeat_timeout_ms=round(self.heartbeat_timeout * 1000),
            )
        except Exception as exc:  # noqa: BLE001 - the Rust server's bind error (its type is not public)
            raise MisconfigurationError(
                f"launcher 'replica_groups': the lighthouse cannot listen on {LOOPBACK} "
                f"({str(exc).strip() or type(exc).__name__})"
            ) from None
        return int(server.address().rsplit(":", 1)[1]), server.shutdown

    def _etcd_store(self) -> Any:
        """The job's end store in etcd (the rendezvous' cluster)."""
        from phalanx_torch.nodes import job_store

        place = self._place()
        return job_store(place.endpoints, f"/phalanx/{place.name}/end/", timeout=PATIENCE_OF_END)

    def _group_address(self) -> str:
        """The address this host's groups listen on: ``127.0.0.1`` where
        every group and the lighthouse are here; else the address this host
        reaches the lighthouse from, which other hosts reach it at."""
        if self.lighthouse_url is None:  # one host, the lighthouse not started yet
            return LOOPBACK
        host = urlsplit(self.lighthouse_url).hostname or LOOPBACK
        try:
            source = route_source(host)
        except OSError as exc:
            raise MisconfigurationError(
                f"launcher 'replica_groups': this host finds no route to the lighthouse at "
                f"{self.lighthouse_url} ({exc.strerror or exc}); give node 0's address as this host "
                "reaches it (an IP address works everywhere)"
            ) from None
        if is_loopback(source):
            if self.num_nodes == 1:
                return LOOPBACK  # one host and a lighthouse on it: no other host takes part
            raise MisconfigurationError(
                f"launcher 'replica_groups': the lighthouse's host {host!r} leads to this host's "
                "loopback, but the other hosts' groups must reach this host's groups (TorchFT's "
                "groups meet in one group's store): give the main address (or the lighthouse's URL) "
                "as the address the hosts share, an IP address of this host's network interface"
            )
        return source

    def _watch(self, groups: list[_Group], stopped: list[int], end: JobEnd) -> _Group | None:
        """Restart failed groups until every group has ended; the group
        that failed past its restarts, if one did. Once the job has
        finished (a group ended with status 0, here or on another host), a
        group that fails is not started again (see :mod:`._end`). Before
        the job's first committed step a group that raised is held, not
        started again, until a group commits a step (then it starts again)
        or every group has failed: alike, the job ends (a restart cannot
        fix it, :attr:`failed_alike`); else the held groups start again."""
        given_up: _Group | None = None
        running = {group.index: group for group in groups}
        held: dict[int, _Group] = {}
        for group in groups:
            if not group.start():
                del running[group.index]
                given_up = given_up if group.why_not_started == _FINISHED else given_up or group
        while (running or held) and not stopped:
            time.sleep(self.monitor_interval)
            if end.failed_alike is not None:
                return self._end_alike(end, running, held, given_up)
            forwarder = self._forwarder
            if forwarder is not None and forwarder.refused is not None:
                stop_processes(
                    [g.process for g in running.values() if g.process is not None], grace=STOP_GRACE
                )
                self.refused = forwarder.refused
                _say(
                    f"phalanx run: this host cannot take part in the job: {forwarder.refused}. Its groups "
                    "are stopped and not started again; give every host of the job the same "
                    "PHALANX_JOB_SECRET"
                )
                return given_up
            for index, group in sorted(running.items()):
                status = group.poll()
                if status is None:
                    if (newer := group.superseded()) is not None:
                        stop_processes([group.process], grace=STOP_GRACE)
                        group.join_output()
                        _say(f"phalanx run: replica group {index}: {newer}; this host's part is stopped")
                        if not group.start():
                            del running[index]
                            given_up = given_up if group.why_not_started == _FINISHED else given_up or group
                        continue
                    if group.waits_for_a_lost_part():
                        del running[index]
                        stop_processes([group.process], grace=STOP_GRACE)
                        _say(
                            f"phalanx run: replica group {index} waited for a host of its own after group "
                            f"{end.finished_by} had ended the job; stopped, not started again"
                        )
                        end.group_gone(index, _FINISHED)
                    continue
                if status == 0:
                    del running[index]
                    end.group_ended(index)
                elif (finisher := end.finished()) is not None:
                    del running[index]
                    _say(
                        f"phalanx run: replica group {index} failed ({group.say_status()}) after group "
                        f"{finisher} had ended the job; not started again: it would find no peer to heal "
                        "from, and the job's result is in the groups that ended"
                    )
                    end.group_gone(index, _FINISHED)
                elif not end.has_committed() and (failure := group.failure()) is not None:
                    del running[index]
                    held[index] = group
                    group.held_at = time.monotonic()
                    end.failed_early(index, failure)
                    if group.restarts >= self.max_restarts:
                        given_up = given_up or group
                    _say(
                        f"phalanx run: replica group {index} failed ({group.say_status()}) before the job "
                        "committed a step; "
                        + (
                            "held too"
                            if len(held) > 1
                            else "held until a group commits one (then it starts again) or every group "
                            "has failed (alike, the job ends: a restart cannot fix that)"
                        )
                    )
                elif group.restarts < self.max_restarts:
                    self._restart(group)
                    if not group.start():
                        del running[index]
                        given_up = given_up if group.why_not_started == _FINISHED else given_up or group
                else:
                    del running[index]
                    given_up = given_up or group
                    others = "the other groups go on without it" if running else "no group here is left"
                    _say(
                        f"phalanx run: replica group {index} failed ({group.say_status()}) and may not "
                        f"start again (max_restarts={self.max_restarts}); {others}"
                    )
                    end.group_gone(index, f"it failed more often than max_restarts={self.max_restarts}")
            if held:
                given_up = self._settle_held(end, running, held, given_up)
        return given_up

    def _settle_held(
        self, end: JobEnd, running: dict[int, _Group], held: dict[int, _Group], given_up: _Group | None
    ) -> _Group | None:
        """The groups held since they failed before the job's first
        committed step: once a group committed one, or every group failed
        and not alike, each starts again (or, past its restarts, is given
        up); every group failed alike: :attr:`failed_alike` is set (the
        watch ends the job at its next look)."""
        held_since = min(group.held_at for group in held.values())
        if end.lost or time.monotonic() - held_since > HOLD_LIMIT:
            # The other hosts cannot be asked (node 0's store lost), or no
            # verdict came in time (a group slow to fail or to commit):
            # started again as any failed group is.
            why = "node 0's store, where the hosts meet, is lost" if end.lost else f"{HOLD_LIMIT:g} s passed"
            _say(f"phalanx run: held replica group(s) {', '.join(map(str, sorted(held)))} start again: {why}")
        elif not end.has_committed():
            failures = end.early_failures(self.replica_groups)
            if len(failures) < self.replica_groups:
                return given_up
            if len(set(failures.values())) == 1:
                end.fail_alike(next(iter(failures.values())))
                return given_up
        for index, group in sorted(held.items()):
            del held[index]
            end.forget_early(index)
            if group.restarts >= self.max_restarts:
                _say(
                    f"phalanx run: replica group {index} may not start again (max_restarts="
                    f"{self.max_restarts}); the other groups go on without it"
                )
                end.group_gone(index, f"it failed more often than max_restarts={self.max_restarts}")
                continue
            self._restart(group)
            running[index] = group
            if not group.start():
                del running[index]
                given_up = given_up if group.why_not_started == _FINISHED else given_up or group
        return given_up

    def _restart(self, group: _Group) -> None:
        group.restarts += 1
        _say(
            f"phalanx run: replica group {group.index} failed ({group.say_status()}); starting it again "
            f"({group.restarts} of {self.max_restarts}); the other groups go on"
        )

    def _end_alike(
        self, end: JobEnd, running: dict[int, _Group], held: dict[int, _Group], given_up: _Group | None
    ) -> _Group | None:
        """Every group failed alike before the job committed a step (found
        here or by another host): stop this host's groups, say it once, and
        return the group whose failure ends the job."""
        stop_processes([g.process for g in running.values() if g.process is not None], grace=STOP_GRACE)
        failure = end.failed_alike or ""
        last = failure.strip().splitlines()[-1] if failure.strip() else "an error"
        self.failed_alike = failure
        _say(
            f"phalanx run: every replica group ({self.replica_groups}) failed alike before the job "
            f"committed a step: {last} (its traceback is above, once; the other groups' are one line "
            "each). A restart cannot fix that: no group is started again, and the job ends"
        )
        first = held[min(held)] if held else given_up or next(iter(running.values()), None)
        return first


class _Group:
    """One replica group's process, its restarts, and the copying of its
    output with each line marked by the group."""

    def __init__(
        self, index: int, launcher: ReplicaGroupsLauncher, command: list[str], end: JobEnd, stopped: list[int]
    ) -> None:
        self.index = index
        self.launcher = launcher
        self.command = command
        self.end = end
        self.stopped = stopped
        self.restarts = 0
        self.status: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._copiers: list[threading.Thread] = []
        #: Where the group spans hosts: the number of its start that this
        #: part runs in (-1 before the first).
        self.start_number = -1
        #: Why :meth:`start` started nothing.
        self.why_not_started = ""
        #: When :meth:`superseded` next reads node 0's store.
        self._next_look = 0.0
        #: When the group was held (failed before the job's first commit).
        self.held_at = 0.0
        #: Where the group's launching process writes its first failed
        #: rank's traceback.
        self.failure_file = end.marker.with_name(f"group{index}-failure")

    def failure(self) -> str | None:
        """The traceback of the rank that failed first in the group's last
        start, where it raised (``None`` for a rank killed by a signal, or
        lost)."""
        try:
            return self.failure_file.read_text() or None
        except OSError:
            return None

    def start(self) -> bool:
        """Start the group's ranks (this host's part of them, where the
        group spans hosts); ``False`` where it cannot start again (see
        ``why_not_started``, said on stderr)."""
        self.join_output()
        self.status = None
        self.failure_file.unlink(missing_ok=True)
        launcher = self.launcher
        span = launcher.hosts_per_group
        # strategy.restart_count in the group's ranks: this group's restarts.
        restarts = self.restarts
        address = launcher.group_address
        # The group's ranks are a one-node job, whatever --num-nodes says, or a job on its own hosts.
        job: dict[str, str] = run_flags_changed(num_nodes=span)
        if span > 1:
            found = self._meet()
            if isinstance(found, str):
                self.why_not_started = found
                _say(f"phalanx run: replica group {self.index} is not started again here: {found}")
                return False
            self.start_number, main, port = found
            restarts = self.start_number - 1  # the group's starts, counted by part 0 from 1
            job.update(MASTER_ADDR=main, MASTER_PORT=str(port), NODE_RANK=str(launcher.part))
        env = {
            **os.environ,
            REPLICA_GROUP_VAR: str(self.index),
            REPLICA_GROUPS_VAR: str(launcher.replica_groups),
            LIGHTHOUSE_VAR: str(launcher.lighthouse_url),
            MIN_REPLICAS_VAR: str(launcher.min_replicas),
            FINISHED_FILE_VAR: str(launcher.finished_marker),
            COMMITTED_FILE_VAR: str(self.end.committed_file),
            GROUP_ADDRESS_VAR: launcher.group_address,
            # Through a forwarder, a quorum asked as the lighthouse's host is lost
            # fails: TorchFT asks again (the forwarder holds it until one answers).
            **({QUORUM_RETRIES_VAR: os.environ.get(QUORUM_RETRIES_VAR, "3")} if launcher.term_file else {}),
            **({TERM_FILE_VAR: str(launcher.term_file)} if launcher.term_file is not None else {}),
            GROUP_FAILURE_FILE_VAR: str(self.failure_file),
            RESTART_COUNT_VAR: str(restarts),
            **job,
        }
        settings = [
            str(launcher.num_processes),
            str(launcher.monitor_interval),
            str(launcher.rendezvous_timeout),
            str(os.getpid()),
            address,
            str(span),
            str(launcher.part),
        ]
        logger.debug(
            "replica group %d: start %d, main %s", self.index, restarts + 1, job.get("MASTER_ADDR", "-")
        )
        self.process = subprocess.Popen(
            [sys.executable, "-m", "phalanx_torchft._group", *settings, "--", *self.command],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # stop_processes stops the group's whole process group
        )
        assert self.process.stdout is not None
        assert self.process.stderr is not None
        self._copiers = [
            threading.Thread(target=self._copy, args=(self.process.stdout, sys.stdout), daemon=True),
            threading.Thread(target=self._copy, args=(self.process.stderr, sys.stderr), daemon=True),
        ]
        for copier in self._copiers:
            copier.start()
        return True

    def _meet(self) -> tuple[int, str, int] | str:
        """Where this start of a group that spans hosts meets (its number,
        the group's store's address and port): offered by part 0, which
        hosts the store; taken by the others. Else why it cannot start."""
        launcher, end = self.launcher, self.end
        if end.finished() is not None:
            return _FINISHED
        if launcher.part == 0:
            port = _free_port(launcher.group_address)
            number = end.offer_group_store(self.index, launcher.group_address, port)
            if number is None:
                return f"node 0's store at {end.address}:{end.port}, where the group's hosts meet, is lost"
            return number, launcher.group_address, port
        found = end.take_group_store(self.index, launcher.part, launcher.rendezvous_timeout, self.stopped)
        if isinstance(found, str) and end.finished_by is not None:
            return _FINISHED
        return found

    def superseded(self) -> str | None:
        """A part other than 0 of a group that spans hosts: why the start it
        runs in is over, where part 0 no longer runs it (it offered a newer
        start, or the group is gone), else ``None``. Read once a second."""
        launcher = self.launcher
        if launcher.hosts_per_group == 1 or launcher.part == 0 or time.monotonic() < self._next_look:
            return None
        self._next_look = time.monotonic() + 1.0
        newest = self.end.newest_offer(self.index)
        if isinstance(newest, str):
            return f"it is not started again ({newest})"
        if newest is not None and newest > self.start_number:
            return (
                f"its first host offered start {newest} while this host's part waits in start "
                f"{self.start_number}, which that host no longer runs (it was started again, or "
                "replaced); the part takes the new start"
            )
        return None

    def waits_for_a_lost_part(self) -> bool:
        """Part 0 of a group that spans hosts, once the job has finished: a
        start that another part never took waits for a host that is gone."""
        launcher, end = self.launcher, self.end
        if launcher.hosts_per_group == 1 or launcher.part != 0 or end.finished_by is None:
            return False
        return not end.joined(self.index, self.start_number, launcher.hosts_per_group)

    def _copy(self, source: IO[bytes], sink: Any) -> None:
        """Copy the group's output, each line marked by the group: ``[rank0]:
        ...`` as ``[group1 rank0]: ...``, the group's own lines as ``[group1]:
        ...``. A rank's traceback that a rank of this job printed before
        (another group failing alike, this group again after a restart) is
        one line: its exception's, and whose it was first."""
        mark = f"[group{self.index}".encode()
        pending: dict[bytes, list[bytes]] = {}  # a rank's traceback so far, by the rank's mark
        for line in iter(source.readline, b""):
            if not line.startswith(b"[rank"):
                _write(sink, mark + b"]: " + line)
                continue
            rank, _, body = line.partition(b"]: ")
            block = pending.get(rank)
            if block is None:
                if body.rstrip() == b"Traceback (most recent call last):":
                    pending[rank] = [line]
                else:
                    _write(sink, mark + b" " + line[1:])
                continue
            block.append(line)
            if body[:1] in (b" ", b"\t") and len(block) < _LONGEST_TRACEBACK:
                continue  # a frame: the block goes on
            del pending[rank]  # the exception's line: the block is whole
            who = f"group{self.index} {rank[1:].decode(errors='replace')}"
            text = b"".join(part.partition(b"]: ")[2] for part in block)
            first = self.launcher.tracebacks.setdefault(text, who)
            if first == who or body[:1] in (b" ", b"\t"):
                _write(sink, b"".join(mark + b" " + part[1:] for part in block))
            else:
                said = f" (the same traceback as {first}'s, above)\n".encode()
                _write(sink, mark + b" " + line[1:].rstrip(b"\r\n") + said)
        for block in pending.values():  # the output ended in a traceback
            _write(sink, b"".join(mark + b" " + part[1:] for part in block))
        source.close()

    def join_output(self) -> None:
        for copier in self._copiers:
            copier.join(timeout=STOP_GRACE)
        self._copiers = []

    def poll(self) -> int | None:
        if self.process is None:
            return None
        self.status = self.process.poll()
        return self.status

    def say_status(self) -> str:
        status = self.status
        if status is not None and status < 0:
            return f"its launching process was killed by {_signal_name(-status)}"
        if status is not None and status > 128:
            return f"a rank was killed by {_signal_name(status - 128)}"
        return f"exit status {status}"

    @property
    def exit_status(self) -> int:
        status = self.status or 1
        return 128 - status if status < 0 else status


#: TorchFT's variable: how many times a group's manager asks again for a
#: quorum whose request failed.
QUORUM_RETRIES_VAR = "TORCHFT_QUORUM_RETRIES"
#: Seconds a group that failed before the job's first committed step is
#: held at most, waiting for the verdict (a commit, or every group failed).
HOLD_LIMIT = 60.0
#: Seconds one request to the end store in etcd may take.
PATIENCE_OF_END = 2.0

#: The most lines of a traceback held back to compare it with those before.
_LONGEST_TRACEBACK = 2000

#: Why a group is not started again once the job has finished.
_FINISHED = "the job has finished"


def _free_port(address: str) -> int:
    """A port the kernel gives on ``address``, free as this returns."""
    import socket

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def _url_host(address: str) -> str:
    """``address`` as the host part of a URL (IPv6 in brackets)."""
    return f"[{address}]" if ":" in address else address


def _check_url(url: Any) -> None:
    parts = urlsplit(url) if isinstance(url, str) else None
    try:
        port = parts.port if parts is not None else None
    except ValueError:
        port = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise MisconfigurationError(
            f"launcher 'replica_groups': lighthouse={url!r}; give a running TorchFT lighthouse's "
            "URL, http://HOST:PORT"
        )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _say(line: str) -> None:
    _write(sys.stderr, f"{line}\n".encode())


_WRITE = threading.Lock()


def _write(sink: Any, data: bytes) -> None:
    with _WRITE:
        buffer = getattr(sink, "buffer", None)
        if buffer is not None:
            sink.flush()
            buffer.write(data)
            buffer.flush()
        else:
            sink.write(data.decode(errors="replace"))
            sink.flush()
