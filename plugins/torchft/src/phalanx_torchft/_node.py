"""One host's part of a ``replica_groups`` job that a launcher of hosts
started there (``ray_replica_groups``: a Ray actor on each node): that
host's groups, run as ``phalanx run`` runs them on each of several hosts.

    python -m phalanx_torchft._node SETTINGS PARENT_PID -- COMMAND...

SETTINGS: the ``ReplicaGroupsLauncher`` options (JSON), ``num_nodes`` and
``node_rank`` among them; node 0's address and port in ``MASTER_ADDR`` and
``MASTER_PORT``. Exits with the launcher's status.
"""

from __future__ import annotations

import json
import sys

from phalanx_core.launching import die_with_parent, exit_process


def main(argv: list[str]) -> int:
    settings, parent = argv[: argv.index("--")]
    command = argv[argv.index("--") + 1 :]
    die_with_parent(int(parent))  # a lost actor takes this host's groups with it
    from .launcher import ReplicaGroupsLauncher

    launcher = ReplicaGroupsLauncher(**json.loads(settings))
    try:
        launcher.run_script(command)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
