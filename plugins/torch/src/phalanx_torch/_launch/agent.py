"""What the ``subprocess`` launcher changes in torch elastic's agent, and
reads from it: the job-wide restart count and what each node says of a
restart (:func:`agent_class`; each round met goes to the launch's
ledger), the failures of
a ``ChildFailedError`` as core's records, the signal handlers kept, and the
errors that mean node 0's store is gone. Imports no torch at import time."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from phalanx_core.launching import RankFailure, root_cause, signal_name

from .._nodes.heartbeat import Heartbeat
from .._nodes.ledger import JobLedger
from .ranks import RESULTS_DIR_VAR

#: The private names of torch elastic's agent that the launcher overrides
#: or reads, all in this module; ``plugins/torch/tests/test_torch_private_
#: names.py`` checks each against the torch installed (a release that
#: renames one fails a test named after it, not a job).
PRIVATE_AGENT_NAMES: dict[str, str] = {
    "launcher.api.LocalElasticAgent": "the module global that elastic_launch's launch_agent makes its "
    "agent from, swapped for PhalanxAgent while a launch runs (elastic_launch takes no agent)",
    "_monitor_workers": "overridden: a failed round is counted for the job, a node's lost heartbeat "
    "fails the round, a node waiting to join is told from a failure",
    "_rendezvous": "overridden: each round's node rank and the job-wide restart count",
    "_restart_workers": "overridden: says the restart and its cause",
    "_exit_barrier": "overridden: the heartbeat told this node is done first (the others finishing "
    "do not take it for lost), and the barrier's requests to etcd brief",
    "_remaining_restarts": "written: the restarts left are the job's, not this node's",
    "_pcontext": "read: the ranks' processes, stopped when node 0 is lost without a word",
}


def stop_workers(agent: Any) -> None:
    """Stop the ranks that elastic's ``agent`` started (its private
    ``_pcontext``; see :data:`PRIVATE_AGENT_NAMES`), if any."""
    processes = getattr(agent, "_pcontext", None)
    if processes is not None:
        processes.close()


def say(who: str, line: str) -> None:
    sys.stderr.write(f"{who}: {line}\n")
    sys.stderr.flush()


def _say_restart(who: str, result: Any, restart: int, max_restarts: int, node_rank: int | None) -> None:
    """Say on stderr which rank failed (phalanx's root-cause rule over every
    failed rank of this node) and that every rank starts again."""
    failures = failures_of(result, node_rank)
    what = "a rank failed"
    if failures:
        first = root_cause(failures)
        killed = signal_name(first.exitcode)
        how = f"killed by {killed}" if killed else f"exit code {first.exitcode}"
        last = (first.traceback or "").strip().splitlines()[-1:]
        what = f"rank {first.rank} failed ({how}{': ' + last[0] if last else ''})"
        if first.raised and first.lost_a_peer:
            # The likeliest cause is the one this node's ranks cannot see.
            said = _GLOO_SOURCE.sub("", _GLOO_ADVICE.sub("", last[0])) if last else ""
            said = _GLOO_PEER_PORT.sub(r"\1", said)
            what = (
                f"rank {first.rank} lost a peer ({how}{': ' + said if said else ''}); no rank of "
                "this node failed of itself: the cause is on another node (its output names the rank), "
                "or that node was lost (the next round names it)"
            )
    sys.stderr.write(
        f"{who}: {what}; every rank is stopped and started again (restart {restart} of {max_restarts})\n"
    )
    sys.stderr.flush()


#: What a line of gloo's says besides what happened: where in gloo's
#: source it was raised, and its advice to read the other worker's logs.
_GLOO_SOURCE = re.compile(r"\[[^\]\s]*gloo/[^\]\s]*:\d+\] ")
_GLOO_ADVICE = re.compile(r"\. This is typically caused by a remote worker crashing\..*$")
#: The port gloo names a lost peer by: its bytes swapped (torch 2.13's
#: gloo printed 58084 for a peer whose socket ss showed on 58594).
_GLOO_PEER_PORT = re.compile(r"(by peer \[[^\]\s]+\]):\d+")


@contextlib.contextmanager
def agent_class(
    who: str,
    max_restarts: int,
    *,
    several_nodes: bool,
    elastic: bool,
    ledger: JobLedger,
    heartbeat: Heartbeat | None = None,
) -> Iterator[None]:
    """While elastic's launch runs, its agent (torch's LocalElasticAgent)
    is this subclass, which says each restart and the rank that caused it
    (:func:`_say_restart`; elastic's own log line names the rank its
    whole-second timestamps make first, often a rank it stopped itself),
    and, for a job in rounds (:mod:`.._nodes.rounds`), counts restarts for the
    job rather than for this node and gives the ranks their node's rank in
    the round (``NODE_RANK``); with ``heartbeat``, a node that stops
    beating (:mod:`.._nodes.heartbeat`) fails the round like a failed rank."""
    if not max_restarts and not elastic:
        yield
        return
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.launcher import api

    launcher_api: Any = api
    base = launcher_api.LocalElasticAgent
    lost_after = heartbeat.lost_after if heartbeat is not None else 0.0  # read only once it has one

    class PhalanxAgent(base):  # type: ignore[misc, valid-type]  # a class made at run time
        _last: Any = None
        _joining = False

        @staticmethod
        def _rounds() -> Any:
            """The rounds' handler (:mod:`.._nodes.rounds`), where the job meets in rounds."""
            return ledger.rounds

        #: The node that stopped beating, as the heartbeat said it: (node rank, host).
        _lost: tuple[int, str] | None = None

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            self._lost = None
            if heartbeat is not None and heartbeat.lost is not None and result.state == WorkerState.HEALTHY:
                # Our ranks wait in a collective for a host that will never
                # answer (gloo's timeout is 30 minutes): the round failed.
                self._lost = heartbeat.lost
                result = RunResult(state=WorkerState.FAILED)
            self._last = result
            self._joining = False
            rounds = self._rounds()
            if rounds is not None and result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                # Waiting first, then failed: a node whose ranks failed
                # counts the failure before it joins the next round, so a
                # node seen waiting has counted it by the time it is read
                # (read the other way round, the failure could be counted
                # between the two reads, and the restart taken for a join).
                if rounds.nodes_waiting_now() and not rounds.failed():
                    # A node waits to join and no node saw this round fail:
                    # another node has stopped its ranks for the new round,
                    # and ours lost their peers. A change of members, not a
                    # failure (not counted).
                    self._joining = True
                    self._remaining_restarts = max(1, max_restarts - rounds.restarts() + 1)
                else:
                    # The job's count, this round's failure included; elastic
                    # then restarts while its own count stays above 0.
                    self._remaining_restarts = max(0, max_restarts - rounds.count_failure() + 1)
            if self._lost is not None and self._remaining_restarts <= 0:
                from phalanx_core import NodeLostError

                node, host = self._lost
                words = f"{_lost_words(self._lost, lost_after)}, and the job has no restarts left"
                raise NodeLostError(words, node=node, address=host)
            return result

        def _rendezvous(self, worker_group: Any) -> None:
            super()._rendezvous(worker_group)
            rounds = self._rounds()
            if rounds is not None and heartbeat is not None:
                heartbeat.agent = self  # whose ranks to stop if the store goes silent
                heartbeat.start_round(rounds.round, worker_group.group_rank, worker_group.group_world_size)
            if rounds is not None:
                self._remaining_restarts = max(0, max_restarts - rounds.restarts())
                os.environ["NODE_RANK"] = str(worker_group.group_rank)  # the ranks' node, this round
                ledger.round_met(worker_group.group_rank, worker_group.group_world_size)
                results = os.environ.get(RESULTS_DIR_VAR)
                if results:  # what ranks of a round before left is not this round's
                    for stale in Path(results).glob("*.pkl"):
                        stale.unlink(missing_ok=True)

        def _failed_elsewhere(self) -> bool:
            """Whether, our ranks healthy when elastic read a node waiting
            to join, another node counted this round's failure (it counts
            before it joins, so this read, after elastic's, sees it). Its
            count is then the job's: this node's next round starts with it."""
            rounds = self._rounds()
            if rounds is None or self._last.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
                return False
            if not rounds.failed():
                return False
            # The count that node made (this node's add only reads it).
            self._remaining_restarts = max(0, max_restarts - rounds.count_failure())
            return True

        def _exit_barrier(self) -> None:
            # Through the job's store: in etcd, a cluster that cannot answer
            # costs the job's end 2 s, not a request's full patience (60 s;
            # elastic logs a barrier that fails, and the job ends as it would).
            from .._nodes import etcd3

            if heartbeat is not None:
                heartbeat.done()  # the others finishing do not take this node for lost
            with etcd3.briefly():
                super()._exit_barrier()

        def _restart_workers(self, worker_group: Any) -> None:
            last = self._last
            failed = last is not None and last.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            if self._lost is not None:
                restart = max_restarts - self._remaining_restarts
                say(who, f"{_lost_words(self._lost, lost_after)}; every rank is stopped and started again "
                    f"(restart {restart} of {max_restarts})")  # fmt: skip
            elif failed and not self._joining:
                restart = max_restarts - self._remaining_restarts
                node = worker_group.group_rank if several_nodes else None  # this round's
                _say_restart(who, last, restart, max_restarts, node)
            elif last is not None and self._failed_elsewhere():
                # Our ranks still ran when elastic saw the other node wait:
                # its rank failed, ours lost their peer and were slower to
                # end than its node was to count the failure and join.
                restart = max_restarts - self._remaining_restarts
                sys.stderr.write(
                    f"{who}: a rank on another node failed (that node's output says which); every rank "
                    f"is stopped and started again (restart {restart} of {max_restarts})\n"
                )
                sys.stderr.flush()
            elif last is not None:
                waiting = worker_group.spec.rdzv_handler.num_nodes_waiting()
                sys.stderr.write(
                    f"{who}: {waiting or 'a'} node{'s' if waiting > 1 else ''} asked to join; every rank "
                    "is stopped and the nodes meet in a new round (not counted as a restart)\n"
                )
                sys.stderr.flush()
            self._last = None
            super()._restart_workers(worker_group)

    launcher_api.LocalElasticAgent = PhalanxAgent  # what elastic_launch makes its agent of
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = base
        if heartbeat is not None:
            heartbeat.close()


def _lost_words(lost: tuple[int, str], seconds: float) -> str:
    node, host = lost
    return (
        f"node {node} (host {host}) is lost: its launching process stopped beating in the job's store "
        f"{seconds:g} s ago or more (a host lost without a word: its power, its network), and the ranks "
        "wait for it in vain"
    )


@contextlib.contextmanager
def signal_handlers_kept() -> Iterator[None]:
    """Elastic's agent replaces the handlers of SIGTERM, SIGINT, SIGHUP and
    SIGQUIT to stop the ranks; put this process's own back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signals = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT]
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def failures_of(exc: Any, node_rank: int | None) -> list[RankFailure]:
    """Every failed rank of elastic's ChildFailedError, each at the time its
    error file was written where there is one (elastic orders by whole
    seconds, which often names a rank that only lost its peer; the file's
    time is finer), and the ranks of this node that raised but that elastic
    stopped before it saw them fail (:func:`_raised_unseen`).
    ``node_rank``: this node's, in a job of several."""
    failures = []
    host = socket.gethostname() if node_rank is not None else None
    for rank, failure in exc.failures.items():
        when = float(failure.timestamp)
        with contextlib.suppress(OSError):
            when = os.stat(failure.error_file).st_mtime
        traceback_text = _traceback_of(failure.error_file_data)
        failures.append(
            RankFailure(int(rank), failure.exitcode, traceback_text, when, node=node_rank, host=host)
        )
    return failures + _raised_unseen(exc, node_rank)


def _raised_unseen(exc: Any, node_rank: int | None) -> list[RankFailure]:
    """This node's ranks that wrote an error file in the failed attempt (so
    raised: a rank stopped by a signal writes none) but are not among
    ``exc``'s failures. Elastic reports the ranks that had exited when it
    looked and stops the rest: a rank whose exception tore its group down
    may still be exiting when its peer, which only lost it, has exited."""
    known = {int(rank): failure for rank, failure in exc.failures.items()}
    if not known:
        return []
    rank, failure = next(iter(known.items()))
    first = rank - int(failure.local_rank)  # this node's first rank: local ranks are consecutive
    attempt = Path(failure.error_file).parent.parent
    if not attempt.name.startswith("attempt_"):  # not elastic's folder of the attempt's error files
        return []
    unseen = []
    for path in attempt.glob("*/error.json"):
        if path.parent.name.isdigit() and first + int(path.parent.name) not in known:
            unseen += _read_error_file(path, first + int(path.parent.name), node_rank)
    return unseen


def _read_error_file(path: Path, rank: int, node_rank: int | None) -> list[RankFailure]:
    """The failure that rank ``rank``'s error file records (none where it
    cannot be read)."""
    try:
        when = path.stat().st_mtime
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    host = socket.gethostname() if node_rank is not None else None
    return [RankFailure(rank, 1, _traceback_of(data), when, node=node_rank, host=host)]


def _traceback_of(error_file_data: dict[str, Any]) -> str | None:
    """The traceback in a rank's elastic error file (its JSON), if any."""
    message = error_file_data.get("message")
    if isinstance(message, dict):
        text = message.get("extraInfo", {}).get("py_callstack") or message.get("message")
        return str(text) if text else None
    if isinstance(message, str) and message != "<NONE>":
        return message
    return None


def raised_before(logs: Path, ranks: range, node_rank: int | None, before: float) -> list[RankFailure]:
    """This node's ranks that raised in the last attempt before ``before``
    (seconds since the epoch), from the error files they wrote under
    elastic's ``logs`` folder (``.../attempt_<n>/<local rank>/error.json``):
    what the node's own ranks did when the node watch stopped them for
    another node's post (elastic's SignalException then carries none)."""
    files = [path for path in logs.rglob("error.json") if path.parent.parent.name.startswith("attempt_")]
    if not files:
        return []
    last = max(int(path.parent.parent.name.removeprefix("attempt_")) for path in files)
    failures = []
    for path in files:
        if path.parent.parent.name != f"attempt_{last}" or not path.parent.name.isdigit():
            continue
        local = int(path.parent.name)
        if local >= len(ranks):
            continue  # not a rank of this round
        failures += [f for f in _read_error_file(path, ranks[local], node_rank) if f.when < before]
    return failures


def stopped_words(num_nodes: int) -> str:
    return "Every other rank was stopped" + (", on every node" if num_nodes > 1 else "")


def print_elsewhere(failure: RankFailure) -> None:
    """Another node's failure, in the lines its rank would have written
    here: its traceback, each line marked ``[rankN]:``."""
    _print_traceback(failure, f"(on node {failure.node}, host {failure.host})")


def print_if_shortened(failure: RankFailure) -> None:
    """This node's rank whose failure is the job's first, if it wrote its
    error's last line only (it lost a peer: see ``rank_program``): its
    whole traceback, from its error file, marked as its own lines are."""
    if failure.raised and failure.lost_a_peer:
        _print_traceback(failure, "(its traceback, which it left out above: no rank failed before it)")


def _print_traceback(failure: RankFailure, header: str) -> None:
    text = failure.traceback or f"(no traceback; exit code {failure.exitcode})"
    lines = [f"[rank{failure.rank}]: {header}"]
    lines += [f"[rank{failure.rank}]: {line}" for line in text.rstrip().splitlines()]
    sys.stderr.write("\n".join(lines) + "\n")
    sys.stderr.flush()


def store_lost_errors() -> tuple[type[BaseException], ...]:
    """What elastic's launch raises when the job's store stops answering."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    return (RendezvousConnectionError, dist.DistNetworkError)
