"""A lost replica under ``ddp_ft`` against a restart under ``ddp
--max-restarts``, in one run, on this host (CPU, gloo).

    python bench/ddp_ft.py [--groups 3] [--steps 60] [--pad 0.25] [--kill-at 25] [--every 10]
                           [--heartbeat-timeout 1.0] [--json]

Workload: ``bench/ddp_ft_train.py`` (a small MLP, ``--pad`` seconds of
sleep in each step, one line per step). Four jobs, one after the other:

* ``ddp_ft``: ``phalanx run --strategy ddp_ft --replica-groups G --devices 1
  --max-restarts 1``; once group 1 has done ``--kill-at`` steps its rank is
  killed with SIGKILL. Measured on the survivors: the longest gap between two
  of their committed steps from the kill to the end, and how many of their
  steps were not committed after the kill.
* ``ddp``: ``phalanx run --strategy ddp --devices G --max-restarts 1``, a
  checkpoint every ``--every`` steps; rank 1 killed at the same step.
  Measured: the kill to the first step after it (every rank restarted,
  resumed from the newest checkpoint), and the steps done again (the kill's
  step minus the checkpoint's).
* both again without a kill: the median time of a step, ``ddp_ft`` against
  ``ddp`` (G ranks either way), as throughput.

This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

WORKLOAD = Path(__file__).resolve().parent / "ddp_ft_train.py"
LINE = re.compile(r"STEP group=(\d+) pid=(\d+) step=(\d+) committed=(\w+) t=([\d.]+)")


class Run:
    """One ``phalanx run`` of the workload, its step lines as they come."""

    def __init__(self, flags: list[str], args: argparse.Namespace) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="phalanx-ddp-ft-"))
        self.steps: list[tuple[int, int, int, bool, float]] = []
        command = [sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", *flags, str(WORKLOAD)]
        command += [str(self.folder), str(args.steps), str(args.pad), str(args.every)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=self.folder
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            found = LINE.search(line)
            if found:
                group, pid, step, committed, t = found.groups()
                self.steps.append((int(group), int(pid), int(step), committed == "True", float(t)))

    def kill_at(self, group: int, step: int) -> tuple[float, int]:
        """SIGKILL ``group``'s process once it has done ``step`` steps; the
        time and the step it was at."""
        while not any(s[0] == group and s[2] >= step for s in self.steps):
            if self.process.poll() is not None:
                raise RuntimeError("the job ended before the kill")
            time.sleep(0.01)
        pid, at = next((s[1], s[2]) for s in reversed(self.steps) if s[0] == group)
        os.kill(pid, signal.SIGKILL)
        return time.monotonic(), at

    def wait(self) -> None:
        if self.process.wait(600) != 0:
            raise RuntimeError(f"the job failed with {self.process.returncode}")

    def median_step(self, group: int) -> float:
        times = [s[4] for s in self.steps if s[0] == group and s[3]][5:]  # after the first steps
        return statistics.median(b - a for a, b in itertools.pairwise(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pad", type=float, default=0.25)
    parser.add_argument("--kill-at", type=int, default=25)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument(
        "--heartbeat-timeout", type=float, default=1.0, help="the replica_groups launcher's (seconds)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    g = str(args.groups)

    ft_flags = ["--strategy", "ddp_ft", "--replica-groups", g, "--devices", "1"]
    ft_flags += ["-o", f"heartbeat_timeout={args.heartbeat_timeout}"]
    ft = Run([*ft_flags, "--max-restarts", "1"], args)
    killed, _ = ft.kill_at(1, args.kill_at)
    ft.wait()
    survivors = [s for s in ft.steps if s[0] != 1]
    gaps = []
    for group in {s[0] for s in survivors}:
        times = [s[4] for s in survivors if s[0] == group and s[3]]
        before = [t for t in times if t < killed][-1:]
        after = before + [t for t in times if t >= killed]
        gaps.append(max(b - a for a, b in itertools.pairwise(after)))
    not_committed = sum(1 for s in survivors if s[4] >= killed and not s[3])

    ddp = Run(["--strategy", "ddp", "--devices", g, "--max-restarts", "1"], args)
    killed_ddp, at = ddp.kill_at(1, args.kill_at)
    ddp.wait()
    before = {s[1] for s in ddp.steps if s[4] < killed_ddp}
    next_step = min(s[4] for s in ddp.steps if s[1] not in before)  # a restarted rank's first step
    redone = at - (at // args.every) * args.every

    quiet_ft = Run(ft_flags, args)
    quiet_ft.wait()
    quiet_ddp = Run(["--strategy", "ddp", "--devices", g], args)
    quiet_ddp.wait()
    step_ft, step_ddp = quiet_ft.median_step(0), quiet_ddp.median_step(0)

    result = {
        "groups": args.groups,
        "pad_s": args.pad,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "ddp_ft_survivor_longest_gap_s": round(max(gaps), 3),
        "ddp_ft_survivor_steps_not_committed": not_committed,
        "ddp_max_restarts_kill_to_next_step_s": round(next_step - killed_ddp, 3),
        "ddp_max_restarts_steps_done_again": redone,
        "gap_ratio_ddp_ft_to_ddp": round(max(gaps) / (next_step - killed_ddp), 3),
        "step_s_ddp_ft": round(step_ft, 4),
        "step_s_ddp": round(step_ddp, 4),
        "throughput_ratio_ddp_ft_to_ddp": round(step_ddp / step_ft, 3),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"{g} groups of 1 rank (ddp_ft, heartbeat_timeout {args.heartbeat_timeout} s) / {g} ranks (ddp), "
        f"step padded {args.pad} s, CPU"
    )
    print(
        f"ddp_ft, group 1 killed at step {args.kill_at}: survivors' longest gap "
        f"{result['ddp_ft_survivor_longest_gap_s']} s, their steps not committed {not_committed}"
    )
    print(
        f"ddp --max-restarts 1, rank 1 killed at step {at}: kill to next step "
        f"{result['ddp_max_restarts_kill_to_next_step_s']} s, steps done again {redone} "
        f"(checkpoint every {args.every})"
    )
    print(f"gap ratio ddp_ft / ddp: {result['gap_ratio_ddp_ft_to_ddp']}")
    print(
        f"no failure: step {result['step_s_ddp_ft']} s (ddp_ft) vs {result['step_s_ddp']} s (ddp): "
        f"throughput ratio {result['throughput_ratio_ddp_ft_to_ddp']}"
    )


if __name__ == "__main__":
    main()
