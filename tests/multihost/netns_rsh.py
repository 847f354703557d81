"""An rsh agent for OpenMPI's ``mpirun`` on a test bed: ``ssh`` to a host
that is a network namespace (:mod:`phalanx_core.testing.hosts`).

``mpirun --mca plm_rsh_agent "python netns_rsh.py" --host node0,node1 ...``
calls ``python netns_rsh.py HOST WORD...`` to start its daemon (``orted``)
on each other host, as it calls ``ssh HOST WORD...``. Like ssh, this runs
the words joined by spaces through the host's shell, on the host (its
namespace, its own host name, its ``/etc/hosts``), with a login's
environment, not the caller's: ``PATH``, ``HOME`` and the test's tag
(``PHALANX_TEST_TAG``, so that a process left behind on the host is found).
What a rank needs besides must come through ``mpirun -x NAME``, as on a
cluster.

The hosts are ``PHALANX_NETNS_HOSTS``: ``name=namespace`` pairs, separated
by commas (``node0=phxab12n0,node1=phxab12n1``).
"""

from __future__ import annotations

import os
import sys

from phalanx_core.testing.hosts import Host
from phalanx_core.testing.processes import TAG_VAR

HOSTS_VAR = "PHALANX_NETNS_HOSTS"
LOGIN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KEPT = ("HOME", TAG_VAR)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        sys.stderr.write("usage: netns_rsh.py HOST COMMAND...\n")
        return 2
    host, words = argv[0], argv[1:]
    hosts = dict(pair.split("=", 1) for pair in os.environ.get(HOSTS_VAR, "").split(",") if pair)
    if host not in hosts:
        sys.stderr.write(f"netns_rsh.py: no host {host!r} in {HOSTS_VAR}={os.environ.get(HOSTS_VAR)!r}\n")
        return 255  # ssh's code for a host it cannot reach
    login = {"PATH": LOGIN_PATH, **{name: os.environ[name] for name in KEPT if name in os.environ}}
    command = Host(name=host, address="", namespace=hosts[host]).command(["sh", "-c", " ".join(words)])
    os.execvpe(command[0], command, login)
    return 255  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
