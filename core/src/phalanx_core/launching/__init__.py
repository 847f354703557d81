"""The launcher toolkit: what every launcher that makes processes needs,
public, so that a third party's launcher reports failures and runs ranks
exactly as phalanx's own do. Imports no backend (:func:`hosted_store`
imports torch when called).

In the launching process:

- :class:`RankFailure`, one record per failed rank (rank, node, host, exit
  code or signal, traceback, time), and :func:`root_cause`, the one rule
  for which rank failed first (:meth:`RankFailure.order`); the marks of a
  lost peer's error (:data:`PEER_LOST_MARKS`, plus a backend's own);
- :func:`worker_failed`, the :class:`~phalanx_core.WorkerFailedError` that
  names the root cause and keeps every failure;
- :func:`stop_processes` (SIGTERM, then SIGKILL after :data:`STOP_GRACE`
  seconds), :data:`CAUSE_GRACE` (how long to wait for the cause while only
  lost peers were seen), :func:`signal_name`;
- :class:`RankLines`: whole lines marked ``[rankN]: `` out of a tool that
  tags each write of a rank (mpirun, horovodrun), and
  :func:`relay_output`, which passes a tool's output on that way, and
  :func:`last_tracebacks`: each rank's traceback read from its output,
  where a tool ran the ranks and reports none itself;
- :func:`hosted_store`: the rendezvous store, listening where it is told
  (:data:`LOOPBACK` for one node), and :func:`listen_variables`, which
  tell the ranks' gloo to listen there too.

In a rank:

- :mod:`phalanx_core.launching.rank_program`, what a rank runs to run a
  script (``python -m phalanx_core.launching.rank_program SCRIPT``), and
  :func:`~phalanx_core.launching.rank_program.run_as_rank`;
- :func:`rank_variables` (as torchrun sets them), :func:`carried_variables`
  (the user's ``PHALANX_*`` settings, not one launch's own), :func:`die_with_parent`,
  :func:`run_program` (a script or ``-m module`` as ``__main__``),
  :func:`write_whole`, :func:`dumps_result`, :func:`failure_text`, and
  :func:`exit_process`, the way out that avoids the interpreter's
  finalization (where gloo's threads abort a finished rank), and
  :func:`before_threads_join`, for a part whose threads end only when told.

See the launcher author's guide in the documentation.
"""

from ._failures import (
    EXCERPT_LINES,
    PEER_LOST_MARKS,
    RankFailure,
    root_cause,
    signal_name,
    warn_died_after_delivery,
    worker_failed,
)
from ._output import RANK_LINE, RankLines, last_tracebacks, relay_output
from ._processes import CAUSE_GRACE, STOP_GRACE, check_count, signal_group, stop_processes
from ._ranks import (
    LAUNCH_PRIVATE_PREFIX,
    LINES_PREFIXED_VAR,
    PARENT_PID_VAR,
    RANK_MACHINERY,
    RESTART_COUNT_VAR,
    RUN_FLAGS_VAR,
    before_threads_join,
    carried_variables,
    die_with_parent,
    dumps_result,
    exit_code_of,
    exit_process,
    failure_text,
    is_rank_machinery,
    rank_variables,
    run_flags_changed,
    run_program,
    write_whole,
)
from ._stores import (
    GLOO_INTERFACE_VAR,
    LOOPBACK,
    hosted_store,
    listen_variables,
    listening_socket,
    script_store,
)

__all__ = [
    "CAUSE_GRACE",
    "LAUNCH_PRIVATE_PREFIX",
    "LINES_PREFIXED_VAR",
    "PARENT_PID_VAR",
    "RANK_LINE",
    "RankLines",
    "EXCERPT_LINES",
    "GLOO_INTERFACE_VAR",
    "LOOPBACK",
    "PEER_LOST_MARKS",
    "RESTART_COUNT_VAR",
    "RUN_FLAGS_VAR",
    "RANK_MACHINERY",
    "STOP_GRACE",
    "RankFailure",
    "check_count",
    "before_threads_join",
    "die_with_parent",
    "dumps_result",
    "exit_code_of",
    "exit_process",
    "failure_text",
    "hosted_store",
    "is_rank_machinery",
    "last_tracebacks",
    "relay_output",
    "listen_variables",
    "listening_socket",
    "carried_variables",
    "rank_variables",
    "root_cause",
    "script_store",
    "run_flags_changed",
    "run_program",
    "signal_group",
    "signal_name",
    "stop_processes",
    "warn_died_after_delivery",
    "worker_failed",
    "write_whole",
]
