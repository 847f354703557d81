"""A node's ranks started, watched, restarted and stopped by a loop of
phalanx's own on the public face of ``torch.distributed.elastic``: its
process layer (``start_processes`` and the ``PContext`` it returns, its
log specs and error files) and a ``RendezvousHandler``. Elastic's agent
(``LocalElasticAgent``) decides restarts per node and hides the round it
met, the ranks it started and its restart count in private attributes;
this loop holds them itself: the job's restart count where the nodes meet
in rounds (:mod:`.._nodes.rounds`), the heartbeat's verdict, a node
joining told from a failure. Imports no torch at import time.

Each rank gets the variables elastic's agent gives (:func:`rank_env`), so
a script, torch's environment readers and phalanx's ``TorchElasticEnvironment``
see a rank of ``torchrun``; its error file and its output go where elastic's
``DefaultLogsSpecs`` puts them (``<logs>/<run>/attempt_<restart>/<local rank>/``).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from phalanx_core.launching import STOP_GRACE

from .._nodes import job_keys
from .._nodes.heartbeat import Heartbeat
from .._nodes.job_store import read_when_set
from .._nodes.ledger import JobLedger, StopRequested
from .failures import lost_words, say, say_restart

__all__ = ["SIGNALS", "RankLoop", "end_what_they_left", "rank_env", "signals_variable"]

logger = logging.getLogger(__name__)

#: The signals that stop the ranks and end the launching process (elastic's
#: process layer installs a handler for each as it starts the ranks, which
#: raises its ``SignalException``).
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def signals_variable() -> dict[str, str]:
    """``TORCHELASTIC_SIGNALS_TO_HANDLE`` where this torch's torchrun sets it.

    A newer torchrun names the signals its process layer handles in that
    variable (``LaunchConfig.signals_to_handle``; 2.13 does), which the ranks
    inherit; an older one (2.9) handles the same four without it. The ranks see what
    a torchrun rank of the same torch sees."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    if "signals_to_handle" in {field.name for field in dataclasses.fields(LaunchConfig)}:
        return {"TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS}
    return {}


class Verdict(enum.Enum):
    """How a round of this node's ranks ended (:meth:`RankLoop._watch`)."""

    #: Every rank ended well: the node passes the exit barrier, the loop ends.
    ENDED = "ended"
    #: A failure, said and counted: every rank starts again in a new round.
    RESTART = "restart"
    #: Nodes ask to join: the ranks stop for a new round (not counted).
    JOINED = "joined"


def _look_every(nodes: int) -> float:
    """Seconds between two looks for a key of the round's: 0.05 s for a
    few nodes, growing with the nodes so that all of them together ask the
    job's store at most about 2,000 times a second."""
    return min(1.0, max(0.05, nodes / 2000))


#: The name the ranks' role goes by (``ROLE_NAME``), as elastic's agent names it.
ROLE = "phalanx"

#: How long a node that ended well waits at most for the others to end.
EXIT_BARRIER = 300.0


def rank_env(
    *,
    local_rank: int,
    num_processes: int,
    group_rank: int,
    group_world_size: int,
    first_rank: int,
    world_size: int,
    master: tuple[str, int],
    restart_count: int,
    max_restarts: int,
    run_id: str,
    use_agent_store: bool,
) -> dict[str, str]:
    """The variables of local rank ``local_rank`` of node ``group_rank``,
    whose ranks are numbered from ``first_rank`` in a world of
    ``world_size``: those elastic's agent gives each rank (``torchrun``'s)."""
    rank = first_rank + local_rank
    world = world_size
    env = {
        "LOCAL_RANK": str(local_rank),
        "RANK": str(rank),
        "GROUP_RANK": str(group_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": ROLE,
        "LOCAL_WORLD_SIZE": str(num_processes),
        "WORLD_SIZE": str(world),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_WORLD_SIZE": str(world),
        "MASTER_ADDR": master[0],
        "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_RESTART_COUNT": str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
        if name in os.environ:
            env[name] = os.environ[name]
    return env


def end_what_they_left(failures: dict[int, Any]) -> dict[int, int]:
    """SIGKILL what each failed rank left running in its process group
    (elastic starts each rank as a group's leader): its DataLoader's
    workers, anything it forked. They hold copies of the rank's sockets,
    so its peers in a collective would hear of its end only when the last
    of them exits (a loader worker checks that its parent lives every 5 s):
    ended here, at once, a peer's error comes as the rank dies. How many
    were ended, by the failed ranks' local ranks (those that left any).

    Elastic's own stop signals only the groups of ranks still running. A
    process the rank started in a session of its own is not reached."""
    ended = {}
    for local, failure in failures.items():
        pid = getattr(failure, "pid", None)
        if not isinstance(pid, int) or pid <= 0:
            continue
        left = _group_members(pid)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        if left:
            ended[int(local)] = left
    return ended


def _group_members(group: int) -> int:
    """How many running processes are in process group ``group``."""
    count = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(group) and fields[0] != "Z":
            count += 1
    return count


class RankLoop:
    """One node's part of a launch: meet the other nodes (``make_handler()``,
    a ``RendezvousHandler``), start ``num_processes`` ranks of ``python
    *command``, watch them, and after a failure stop them, meet again and
    start them again while the restarts allow.

    :meth:`run` returns once every rank has ended well (after the nodes'
    exit barrier); it raises elastic's ``ChildFailedError`` (the failed
    ranks, by global rank) when the restarts are spent, ``NodeLostError``
    for a node the heartbeat found lost with none left, and elastic's
    ``SignalException`` for a signal (the ranks stopped with it, the
    rendezvous left open, as elastic's launch leaves it for the next
    scaling), and ``StopRequested`` when the node watch asks the ranks to
    stop (the ledger's ``stop_requested``, waited on between the looks at
    the ranks). The ranks never outlive it."""

    def __init__(
        self,
        make_handler: Callable[[], Any],
        command: Sequence[str],
        *,
        num_processes: int,
        max_restarts: int,
        monitor_interval: float,
        logs_specs: Any,
        prefix_lines: bool,
        who: str,
        ledger: JobLedger,
        several_nodes: bool,
        heartbeat: Heartbeat | None = None,
        variables: Mapping[str, str] | None = None,
        results: Path | None = None,
        restarts_before: int = 0,
    ) -> None:
        self.make_handler = make_handler
        #: What every rank's environment has besides its own rank's
        #: variables (over this process's, which the ranks inherit).
        self.variables = dict(variables or {})
        #: Where the ranks of a launch leave their results (None: a script's run).
        self.results = results
        #: The restarts of the job before this loop's first round (a
        #: replica group restarted by its launcher runs a loop of its own
        #: each start): added to the ranks' ``TORCHELASTIC_RESTART_COUNT``.
        self.restarts_before = restarts_before
        self.command = tuple(command)
        self.num_processes = num_processes
        self.max_restarts = max_restarts
        self.monitor_interval = monitor_interval
        self.logs_specs = logs_specs
        self.prefix_lines = prefix_lines
        self.who = who
        self.ledger = ledger
        self.several_nodes = several_nodes
        self.heartbeat = heartbeat
        self.handler: Any = None
        #: The ranks' processes (elastic's ``PContext``) while they run.
        self.processes: Any = None
        #: This node's rank and the number of nodes, in the round met last.
        self.group_rank = 0
        self.group_world_size = 1
        #: The restart the running ranks are (``TORCHELASTIC_RESTART_COUNT``).
        self.restart_count = 0
        #: The global rank of this node's local rank 0, this round.
        self.first_rank = 0
        self._lock = threading.Lock()

    # -- the loop -----------------------------------------------------------------

    def run(self) -> None:
        from torch.distributed.elastic.multiprocessing import SignalException

        shut_down = True
        try:
            self.handler = self.make_handler()
            info = self._meet()
            while True:
                if self.ledger.stop_requested.is_set():
                    raise StopRequested
                self._start(info)
                verdict = self._watch()
                logger.debug("the ranks of node %d, round's end: %s", self.group_rank, verdict.value)
                if verdict is Verdict.ENDED:
                    self._exit_barrier(info)
                    return
                self._close(signal.SIGTERM)
                info = self._meet()
        except SignalException as exc:
            # Ctrl-C, a scheduler's SIGTERM: the ranks stop with that
            # signal; the rendezvous stays open (closing it would end the
            # job for the other nodes' next round).
            shut_down = False
            self._close(exc.sigval)
            raise
        except StopRequested:
            # The node watch read another node's failure: that node ends the
            # job and closes the rendezvous; this one only stops.
            shut_down = False
            raise
        finally:
            self._close(signal.SIGTERM)
            if self.heartbeat is not None:
                self.heartbeat.close()
            if shut_down and self.handler is not None:
                with contextlib.suppress(Exception):
                    self.handler.shutdown()

    def _meet(self) -> Any:
        """The next round: its rendezvous, and what a round of the job's
        rounds sets (the job's restart count, the heartbeat's round, the
        ledger's record)."""
        info = self.handler.next_rendezvous()
        self.group_rank, self.group_world_size = int(info.rank), int(info.world_size)
        rounds = self.ledger.rounds
        if rounds is not None:
            self.restart_count = min(int(rounds.restarts()), self.max_restarts)
            if self.heartbeat is not None:
                self.heartbeat.loop = self  # whose ranks to stop if the store goes silent
                self.heartbeat.start_round(rounds.round, self.group_rank, self.group_world_size)
            self.ledger.round_met(self.group_rank, self.group_world_size)
            if self.results is not None:  # what ranks of a round before left is not this round's
                for stale in self.results.glob("*.pkl"):
                    stale.unlink(missing_ok=True)
        return info

    def _start(self, info: Any) -> None:
        from torch.distributed.elastic.multiprocessing import start_processes

        store_info = info.bootstrap_store_info
        self.first_rank, world_size = self._number_ranks(info)
        envs = {}
        prefixes: dict[int, str] | None = {} if self.prefix_lines else None
        for local in range(self.num_processes):
            env = self.variables | rank_env(
                local_rank=local,
                num_processes=self.num_processes,
                group_rank=self.group_rank,
                group_world_size=self.group_world_size,
                first_rank=self.first_rank,
                world_size=world_size,
                master=(store_info.master_addr, int(store_info.master_port)),
                restart_count=self.restarts_before + self.restart_count,
                max_restarts=self.max_restarts,
                run_id=self.handler.get_run_id(),
                use_agent_store=bool(self.handler.use_agent_store),
            )
            if self.ledger.rounds is not None:
                env["NODE_RANK"] = str(self.group_rank)  # the ranks' node, this round
            envs[local] = env
            if prefixes is not None:
                prefixes[local] = f"[rank{self.first_rank + local}]: "
        processes = start_processes(
            name=ROLE,
            entrypoint=sys.executable,
            args={local: self.command for local in range(self.num_processes)},
            envs=envs,
            logs_specs=self.logs_specs,
            log_line_prefixes=prefixes,
            start_method="spawn",
        )
        with self._lock:
            self.processes = processes

    def _watch(self) -> Verdict:
        """Watch the ranks until the round ends: how (every rank ended
        well; else the next round is to be met: a restart, said and
        counted, or nodes joining); raises when the restarts are spent."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        while True:
            if self.ledger.stop_requested.wait(self.monitor_interval):
                self._close(signal.SIGTERM)
                raise StopRequested
            processes = self.processes
            if processes is None:  # stopped from another thread (kill_ranks), which ends the process
                continue
            result = processes.wait(0)
            lost = self.heartbeat.lost if self.heartbeat is not None and result is None else None
            if result is not None and not result.is_failed():
                return Verdict.ENDED
            if result is not None:
                for local, count in end_what_they_left(result.failures).items():
                    say(
                        self.who,
                        f"rank {self.first_rank + local} failed and left {count} process(es) of its own "
                        "running (its DataLoader workers, or what it started); ended with it, as they "
                        "held its connections open",
                    )
            if result is not None or lost is not None:
                # Elastic's error holds one failed rank at least: none where only the heartbeat saw a loss.
                failed = ChildFailedError(ROLE, self._global(result.failures)) if result is not None else None
                return self._after_failure(failed, lost)
            if self.handler.num_nodes_waiting() > 0:
                return self._joined_or_failed_elsewhere()

    def _global(self, failures: dict[int, Any]) -> dict[int, Any]:
        return {self.first_rank + int(local): failure for local, failure in failures.items()}

    def _number_ranks(self, info: Any) -> tuple[int, int]:
        """This node's first global rank and the world's size: the ranks of
        each node numbered after those of the nodes before it, through the
        round's store (each node says how many ranks it runs; node 0 adds
        them up and tells each its first). Nodes may run different numbers
        of ranks: a job whose nodes were given different ``--devices``
        still forms one world, whose ranks then name the difference of
        their plans."""
        if self.group_world_size == 1:
            return 0, self.num_processes
        store = info.store
        store.set(job_keys.local_ranks(self.group_rank), str(self.num_processes))
        # Looked for, not waited for: a wait holds the job's store's
        # connection, which the heartbeat beats on (_nodes.job_store).
        look = functools.partial(
            read_when_set,
            interval=_look_every(self.group_world_size),
            stop=self.ledger.stop_requested,
            stopped=StopRequested,
        )
        if self.group_rank == 0:
            nodes = range(self.group_world_size)
            sizes = [int(size) for size in look(store, [job_keys.local_ranks(node) for node in nodes])]
            firsts = itertools.accumulate([0, *sizes[:-1]])
            store.multi_set(
                [job_keys.first_rank(node) for node in nodes], [f"{first} {sum(sizes)}" for first in firsts]
            )
        (mine,) = look(store, [job_keys.first_rank(self.group_rank)])
        first, world = bytes(mine).decode().split()
        return int(first), int(world)

    def _after_failure(self, failed: Any, lost: tuple[int, str] | None) -> Verdict:
        """This node's ranks failed (``failed``: elastic's error, every
        failed rank of it), or the heartbeat found node ``lost`` silent
        while they ran (they wait for it in a collective; ``failed`` is
        ``None``): count the failure and restart, or raise."""
        rounds = self.ledger.rounds
        if rounds is None:  # this node's own count
            restart = self.restart_count + 1
        elif lost is None and rounds.nodes_waiting_now() and not rounds.failed():
            # Waiting first, then failed: a node whose ranks failed counts
            # the failure before it joins the next round, so a node seen
            # waiting has counted it by the time it is read. A node waits
            # and no node saw this round fail: another node has stopped its
            # ranks for a new round, and ours lost their peers. A change
            # of members, not a failure (not counted).
            self._say_join()
            return Verdict.JOINED
        else:
            restart = int(rounds.count_failure())  # the job's count, this round's failure included
        if restart > self.max_restarts:
            self._close(signal.SIGTERM)
            if lost is not None:
                from phalanx_core import NodeLostError

                lost_after = self.heartbeat.lost_after if self.heartbeat is not None else 0.0
                words = f"{lost_words(lost, lost_after)}, and the job has no restarts left"
                raise NodeLostError(words, node=lost[0], address=lost[1])
            raise failed
        if rounds is None:
            self.restart_count = restart
        if lost is not None:
            lost_after = self.heartbeat.lost_after if self.heartbeat is not None else 0.0
            say(self.who, f"{lost_words(lost, lost_after)}; every rank is stopped and started again "
                f"(restart {restart} of {self.max_restarts})")  # fmt: skip
        else:
            node = self.group_rank if self.several_nodes else None
            say_restart(self.who, failed, restart, self.max_restarts, node)
        return Verdict.RESTART

    def _joined_or_failed_elsewhere(self) -> Verdict:
        """Our ranks run, and a node waits to join: another node whose
        ranks failed counted the failure before it joined (then ours lost
        their peer and were slower to end than that node was to count and
        join), or nodes ask to join the running job (not counted)."""
        rounds = self.ledger.rounds
        if rounds is not None and rounds.failed():
            restart = min(int(rounds.count_failure()), self.max_restarts)  # the count that node made
            say(
                self.who,
                "a rank on another node failed (that node's output says which); every rank is "
                f"stopped and started again (restart {restart} of {self.max_restarts})",
            )
            return Verdict.RESTART
        self._say_join()
        return Verdict.JOINED

    def _say_join(self) -> None:
        waiting = int(self.handler.num_nodes_waiting())
        say(
            self.who,
            f"{waiting or 'a'} node{'s' if waiting > 1 else ''} asked to join; every rank is stopped and "
            "the nodes meet in a new round (not counted as a restart)",
        )

    def _exit_barrier(self, info: Any) -> None:
        """Every rank of this node ended well: tell the heartbeat (the
        others finishing do not take this node for lost), then wait for
        every node of the round to end (at most :data:`EXIT_BARRIER`
        seconds), so that the job's store outlives none of them. In etcd,
        a cluster that cannot answer costs the job's end 2 s, not a
        request's full patience; a barrier that fails ends the node as it
        would have (each node's ranks ended well)."""
        from torch.distributed.elastic.multiprocessing import SignalException

        from .._nodes import etcd3

        if self.heartbeat is not None:
            self.heartbeat.done()
        if self.group_world_size < 2:
            return
        store = info.store
        try:
            with etcd3.briefly():
                if int(store.add(job_keys.ENDED_COUNT, 1)) >= self.group_world_size:
                    store.set(job_keys.ENDED_ALL, "1")
                deadline = time.monotonic() + EXIT_BARRIER
                pause = _look_every(self.group_world_size)
                while not store.check([job_keys.ENDED_ALL]) and time.monotonic() < deadline:
                    time.sleep(pause)  # looked for: a wait would hold the job's store's connection
        except SignalException:
            raise
        except Exception:  # noqa: BLE001 - the node's own ranks ended well: so does the node
            pass

    # -- stopping -----------------------------------------------------------------

    def _close(self, sig: int) -> None:
        with self._lock:
            processes, self.processes = self.processes, None
        if processes is not None:
            processes.close(death_sig=sig, timeout=STOP_GRACE)

    def kill_ranks(self) -> None:
        """Stop the ranks now, from any thread (the heartbeat's, when node
        0's store went silent and this process is about to end)."""
        self._close(signal.SIGTERM)
