"""``ddp_ft`` on three hosts made of network namespaces (one replica group
of one rank each, the torchft tests' training script, a step of about
0.11 s): the survivors' longest gap between two committed steps after
node1 is killed whole (``kill``: every process of its namespace, SIGKILL)
or cut off the network (``cut``; ``replica_timeout=3``, the default is 10).
Needs root and iproute2, as the ``torchft`` nox session's host tests.

    python bench/ddp_ft_hosts.py kill cut
"""

from __future__ import annotations

import itertools
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "torchft" / "tests"))
from ft_job import Job

from phalanx_core.testing.hosts import TestBed


def longest_gap(job: Job, after: float) -> float:
    """The survivors' (groups 0 and 2) longest gap between two committed
    steps, from the last one before ``after``."""
    worst = 0.0
    for group in (0, 2):
        times = sorted(s[6] for s in job.steps if s[0] == group and s[4])
        before = [t for t in times if t <= after]
        later = [t for t in times if t > after]
        if before and later:
            worst = max(worst, *(b - a for a, b in itertools.pairwise([before[-1], *later])))
    return worst


def measure(kind: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f"ddp-ft-{kind}-"))
    try:
        with TestBed(3, subnet="192.168.81") as bed:
            extra = ("-o", "replica_timeout=3") if kind == "cut" else ()
            job = Job(tmp, "--devices", "1", "--replica-groups", "3", *extra, hosts=bed.hosts)
            job.wait_for(lambda: any(s[0] == 1 and s[3] >= 15 for s in job.steps), "step 15")
            event = time.monotonic()
            if kind == "kill":
                bed.kill_all(bed.hosts[1])
            else:
                bed.cut(bed.hosts[1])

            def ten_more() -> bool:
                return sum(1 for s in job.steps if s[0] == 0 and s[6] > event + 0.5 and s[4]) >= 10

            job.wait_for(ten_more, "10 steps after")
            times = sorted(s[6] for s in job.steps if s[0] == 0 and s[4])
            step = (times[10] - times[5]) / 5
            gap = longest_gap(job, event)
            print(
                f"{kind}: survivors' longest gap between committed steps {gap:.3f} s (a step: {step:.3f} s)"
            )
            job.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    for kind in sys.argv[1:] or ["kill", "cut"]:
        measure(kind)
