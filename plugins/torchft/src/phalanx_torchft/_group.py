"""One replica group of a ``replica_groups`` job: its ranks, run as the
``subprocess`` launcher runs a one-node job (its agent loop and a
store of the group's own, on ADDRESS: 127.0.0.1 on one host, the address
other hosts reach on several), with no restart of its own: the launching
process restarts the whole group.

Where the group spans NUM_NODES hosts, this is its part on one of them
(NODE_RANK among them), run as the ``subprocess`` launcher runs a job of
NUM_NODES nodes without restarts: they meet in the group's store at
``MASTER_ADDR:MASTER_PORT``, which part 0 hosts, and a failure in one part
stops the others (the node watch), so that every host's launcher starts its
part again. A part whose host is cut off the network is taken for lost
after :data:`HOST_LOST_AFTER` seconds without a beat, not the 15 s of a
job's nodes: until then the other groups wait for this one's quorum.

    python -m phalanx_torchft._group NUM_PROCESSES MONITOR_INTERVAL RENDEZVOUS_TIMEOUT PARENT_PID \\
        ADDRESS NUM_NODES NODE_RANK -- COMMAND...

Exits 0 when every rank did, else with the first failed rank's status,
after saying which rank it was.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from phalanx_core import WorkerFailedError
from phalanx_core.launching import RESTART_COUNT_VAR, die_with_parent, exit_process

from ._variables import GROUP_FAILURE_FILE_VAR

#: Seconds without a beat of a part's launching process after which the
#: group's other parts take its host for lost and stop (5 beats of 1 s):
#: while a part waits for it, every group waits in its quorum.
HOST_LOST_AFTER = 5.0


def main(argv: list[str]) -> int:
    settings, command = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    processes, monitor_interval, rendezvous_timeout, parent, address, nodes, node = settings
    die_with_parent(int(parent))
    from phalanx_torch.launchers import SubprocessLauncher

    launcher = SubprocessLauncher(
        num_processes=int(processes),
        num_nodes=int(nodes),
        node_rank=int(node),  # not NODE_RANK's: on one node it is this host's among the job's hosts
        max_restarts=0,
        monitor_interval=float(monitor_interval),
        rendezvous_timeout=float(rendezvous_timeout),
        **({"listen_on": address} if int(nodes) == 1 else {"host_lost_after": HOST_LOST_AFTER}),
    )
    try:
        # The group's restarts, which its launcher counts (each start runs this process again).
        launcher.run_script(command, restarts_before=int(os.environ.get(RESTART_COUNT_VAR, "0")))
    except WorkerFailedError as exc:
        sys.stderr.write(f"phalanx run: {exc.first_failure()}. The group's other ranks were stopped.\n")
        failure = os.environ.get(GROUP_FAILURE_FILE_VAR)
        if failure and exc.traceback:  # for the launcher, which compares the groups' failures
            Path(failure).write_text(exc.traceback)
        # A rank killed by a signal: 128 + its number, as a shell says it.
        return 128 - exc.exitcode if isinstance(exc.exitcode, int) and exc.exitcode < 0 else exc.exit_status
    except SystemExit as exc:  # stopped by a signal: 128 + its number
        return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
