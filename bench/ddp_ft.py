"""A lost replica under ``ddp_ft`` against a restart under ``ddp
--max-restarts``, in one run, on this host or on ``--hosts N`` hosts made
of network namespaces (CPU, gloo).

    python bench/ddp_ft.py [--groups 3] [--steps 60] [--pad 0.25] [--kill-at 25] [--every 10]
                           [--heartbeat-timeout 1.0] [--replica-timeout 10] [--hosts N [--cut]]
                           [--own-loader] [--json]
    python bench/ddp_ft.py --loader-workers 0,2,4 [--repeat 3] [--baseline-tree DIR] [--json]

With ``--hosts N`` (root and iproute2; ``--groups`` is then N: one group,
or one ``ddp`` rank, a host), the kill is of every process of host 1 (as a
lost machine), and ``ddp`` runs as ``--num-nodes N-1:N --max-restarts 1``
(node 0 holds its store), so that the job goes on with the hosts left;
``--cut`` cuts host 1 off the network instead (a lost group is then seen
only when an all-reduce with it times out: ``--replica-timeout``).

Workload: ``bench/ddp_ft_train.py`` (a small MLP, ``--pad`` seconds of
sleep in each step, one line per step; its batches from ``setup_dataloader``,
or with ``--own-loader`` from its own ``DataLoader``, for the ``ddp_ft``
jobs; either way a step computes while its quorum forms and waits for it
in its all-reduce). Four jobs, one after the other:

* ``ddp_ft``: ``phalanx run --strategy ddp_ft --replica-groups G --devices 1
  --max-restarts 1``; once group 0 has done ``--kill-at`` steps group 1's
  rank is killed with SIGKILL. Measured on the survivors: the longest gap between two
  of their committed steps from the kill to the end, and how many steps
  each one did not commit after the kill.
* ``ddp``: ``phalanx run --strategy ddp --devices G --max-restarts 1``, a
  checkpoint every ``--every`` steps; rank 1 killed at the same step.
  Measured: the kill to the first step after it (every rank restarted,
  resumed from the newest checkpoint), and the steps done again (the kill's
  step minus the checkpoint's).
* both again without a kill: the median time of a step, ``ddp_ft`` against
  ``ddp`` (G ranks either way), as throughput.
* with ``--hosts N`` and a kill (not ``--cut``): TorchFT wired by hand on
  the same hosts (``bench/torchft_by_hand.py``: a process a group, the
  lighthouse on host 0 with the same heartbeat timeout), host 1 killed once
  group 0 has committed ``--kill-at`` steps: the survivors' longest gap and
  steps not committed, beside ``ddp_ft``'s.

With ``--loader-workers 0,2,4`` only the ``ddp_ft`` kill runs, ``--repeat``
times for each ``num_workers`` of the workload's ``DataLoader``: the
survivors' longest gap, and how long the killed rank's loader workers
(its child processes, read from ``/proc`` before the kill) outlived it.

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
from typing import Any

WORKLOAD = Path(__file__).resolve().parent / "ddp_ft_train.py"
LINE = re.compile(r"STEP group=(\d+) pid=(\d+) step=(\d+) committed=(\w+) t=([\d.]+)")


class Run:
    """One ``phalanx run`` of the workload, its step lines as they come."""

    def __init__(
        self, flags: list[str], args: argparse.Namespace, bed: Any = None, env: dict[str, str] | None = None
    ) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="phalanx-ddp-ft-"))
        self.steps: list[tuple[int, int, int, bool, float]] = []
        self.lines: list[str] = []
        self.bed = bed
        command = [sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", *flags]
        workload = [str(WORKLOAD), str(self.folder), str(args.steps), str(args.pad), str(args.every)]
        if getattr(args, "own_loader", False) and "ddp_ft" in flags:
            workload.append("own")
        if getattr(args, "width", None):
            workload.append(f"width={args.width}")
        if getattr(args, "workers", None):
            workload.append(f"workers={args.workers}")
        env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"}
        options: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
        options.update(env=env, cwd=self.folder)
        if bed is None:
            self.processes = [subprocess.Popen([*command, *workload], **options)]
        else:
            hosts = bed.hosts
            self.processes = [
                host.popen([*command, "--node-rank", str(node), "--main-address", hosts[0].address,
                            "--main-port", "29650", *workload], **options)
                for node, host in enumerate(hosts)
            ]  # fmt: skip
        self.process = self.processes[0]
        for process in self.processes:
            threading.Thread(target=self._read, args=(process,), daemon=True).start()

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            self.lines.append(line)
            found = LINE.search(line)
            if found:
                group, pid, step, committed, t = found.groups()
                self.steps.append((int(group), int(pid), int(step), committed == "True", float(t)))

    def kill_at(self, group: int, step: int, cut: bool = False) -> tuple[float, int]:
        """SIGKILL ``group``'s process once group 0 has done ``step`` steps
        (as ``torchft_by_hand.py`` times its kill; or cut its host off the
        network, ``cut``); the time and the step it was at."""
        while not any(s[0] == 0 and s[2] >= step for s in self.steps):
            if self.process.poll() is not None:
                raise RuntimeError("the job ended before the kill")
            time.sleep(0.01)
        pid, at = next((s[1], s[2]) for s in reversed(self.steps) if s[0] == group)
        if self.bed is None:
            os.kill(pid, signal.SIGKILL)
        elif cut:
            self.bed.cut(self.bed.hosts[group])
        else:  # the whole host of the group (one a host)
            self.bed.kill_all(self.bed.hosts[group])
        return time.monotonic(), at

    def wait(self, lost: int | None = None) -> None:
        """Wait for every process but that of host ``lost``; then end what
        runs there (a host cut off: as one that never comes back)."""
        for node, process in enumerate(self.processes):
            if node != lost and process.wait(600) != 0:
                raise RuntimeError(f"the job failed with {process.returncode} (node {node})")
        if lost is not None:
            self.bed.kill_all(self.bed.hosts[lost])
            self.processes[lost].wait(60)
            self.bed.reconnect(self.bed.hosts[lost])  # for the next run (a no-op after a kill)

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
    parser.add_argument("--hosts", type=int, help="N hosts of network namespaces, one group a host (root)")
    parser.add_argument("--cut", action="store_true", help="with --hosts: cut host 1 off the network instead")
    parser.add_argument("--replica-timeout", type=float, default=10.0, help="ddp_ft's (seconds)")
    parser.add_argument("--own-loader", action="store_true", help="ddp_ft's jobs without setup_dataloader")
    parser.add_argument("--loader-workers", help="only the ddp_ft kill, with these num_workers: 0,2,4")
    parser.add_argument("--repeat", type=int, default=3, help="with --loader-workers: runs of each")
    parser.add_argument("--baseline-tree", type=Path, help="with --loader-workers: a checkout to compare")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.loader_workers is not None:
        loader_stalls(args)
        return
    if args.hosts is None:
        if args.cut:
            parser.error("--cut needs --hosts")
        measure(args, None)
        return
    from phalanx_core.testing.hosts import TestBed

    args.groups = args.hosts
    with TestBed(args.hosts, subnet="192.168.82") as bed:
        measure(args, bed)


def tree_path(tree: Path) -> str:
    """PYTHONPATH for the source folders of the phalanx checkout ``tree``
    (they then come before the installed ones)."""
    folders = [tree / "core" / "src", tree / "registry" / "src"]
    folders += sorted(p for p in (tree / "plugins").glob("*/src") if p.is_dir())
    return os.pathsep.join(str(folder) for folder in folders)


def survivors_gap(run: Run, killed: float) -> float:
    """The longest gap between two committed steps of a group that was not
    killed, from its last one before the kill to its end."""
    gaps = []
    survivors = [s for s in run.steps if s[0] != 1]
    for group in {s[0] for s in survivors}:
        times = [s[4] for s in survivors if s[0] == group and s[3]]
        before = [t for t in times if t < killed][-1:]
        after = before + [t for t in times if t >= killed]
        gaps.append(max(b - a for a, b in itertools.pairwise(after)))
    return max(gaps)


def baseline_env(tree: Path) -> dict[str, str]:
    """This process's environment with the checkout ``tree`` first on the path."""
    path = os.pathsep.join(filter(None, [tree_path(tree), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def loader_stalls(args: argparse.Namespace) -> None:
    """``--loader-workers``: the ``ddp_ft`` kill alone, for each count of
    loader workers, ``--repeat`` times (alternating with the checkout of
    ``--baseline-tree``, where given)."""
    from phalanx_core.testing.processes import descendants, is_alive

    counts = [int(n) for n in args.loader_workers.split(",")]
    flags = ["--strategy", "ddp_ft", "--replica-groups", str(args.groups), "--devices", "1"]
    flags += ["-o", f"heartbeat_timeout={args.heartbeat_timeout}", "--max-restarts", "1"]
    trees: dict[str, dict[str, str] | None] = {"this tree": None}
    if args.baseline_tree:
        trees = {"baseline tree": baseline_env(args.baseline_tree), **trees}
    results: dict[str, dict[int, list[dict[str, float]]]] = {tree: {} for tree in trees}
    for workers in counts:
        for _ in range(args.repeat):
            for tree, env in trees.items():
                args.workers = workers
                run = Run(flags, args, env=env)
                while not any(s[0] == 0 and s[2] >= args.kill_at for s in run.steps):
                    if run.process.poll() is not None:
                        raise RuntimeError(f"the job ended before the kill ({tree}, {run.folder})")
                    time.sleep(0.01)
                victim = next(s[1] for s in reversed(run.steps) if s[0] == 1)
                left = descendants(victim)
                os.kill(victim, signal.SIGKILL)
                killed = time.monotonic()
                outlived = 0.0
                while left:
                    left = {pid for pid in left if is_alive(pid)}
                    outlived = time.monotonic() - killed
                    time.sleep(0.005)
                run.wait()
                results[tree].setdefault(workers, []).append(
                    {"longest_gap_s": round(survivors_gap(run, killed), 3), "outlived_s": round(outlived, 3)}
                )
    if args.json:
        print(json.dumps({"heartbeat_timeout_s": args.heartbeat_timeout, "runs": results}, indent=2))
        return
    print(
        f"ddp_ft, {args.groups} groups of 1 rank, heartbeat_timeout {args.heartbeat_timeout} s, step padded "
        f"{args.pad} s, group 1's rank killed after group 0's step {args.kill_at} (CPU, one host)"
    )
    for tree, by_count in results.items():
        for workers, runs in by_count.items():
            gaps = ", ".join(f"{r['longest_gap_s']:.2f}" for r in runs)
            outlived = ", ".join(f"{r['outlived_s']:.2f}" for r in runs)
            print(
                f"{tree}, num_workers={workers}: survivors' longest gap {gaps} s; "
                f"the killed rank's children outlived it by {outlived} s"
            )


def measure(args: argparse.Namespace, bed: Any) -> None:
    g = str(args.groups)
    nodes: list[str] = []  # phalanx run's flags for a job across the hosts
    if bed is not None:
        nodes = ["--num-nodes", g]
    lost = None if bed is None else 1

    ft_flags = ["--strategy", "ddp_ft", "--replica-groups", g, "--devices", "1", *nodes]
    ft_flags += ["-o", f"heartbeat_timeout={args.heartbeat_timeout}"]
    ft_flags += ["-o", f"replica_timeout={args.replica_timeout}"]
    ft = Run([*ft_flags, "--max-restarts", "1"], args, bed)
    killed, _ = ft.kill_at(1, args.kill_at, args.cut)
    ft.wait(lost)
    survivors = [s for s in ft.steps if s[0] != 1]
    gap = survivors_gap(ft, killed)
    # Each survivor's steps not committed after the kill (one a survivor, not their sum).
    not_committed = [
        sum(1 for s in survivors if s[0] == group and s[4] >= killed and not s[3])
        for group in sorted({s[0] for s in survivors})
    ]

    if bed is None:
        ddp_flags = ["--strategy", "ddp", "--devices", g]
    else:
        ddp_flags = ["--strategy", "ddp", "--devices", "1", "--num-nodes", f"{args.groups - 1}:{g}"]
    ddp = Run([*ddp_flags, "--max-restarts", "1"], args, bed)
    killed_ddp, at = ddp.kill_at(1, args.kill_at, args.cut)
    ddp.wait(lost)
    before = {s[1] for s in ddp.steps if s[4] < killed_ddp}
    next_step = min(s[4] for s in ddp.steps if s[1] not in before)  # a restarted rank's first step
    redone = at - (at // args.every) * args.every

    quiet_ft = Run(ft_flags, args, bed)
    quiet_ft.wait()
    quiet_ddp = Run([*ddp_flags[:-2], *nodes] if bed is not None else ddp_flags, args, bed)
    quiet_ddp.wait()
    step_ft, step_ddp = quiet_ft.median_step(0), quiet_ddp.median_step(0)

    by_hand = None
    if bed is not None and not args.cut:
        by_hand = torchft_by_hand(args, bed)

    result = {
        "hosts": args.hosts or 1,
        "groups": args.groups,
        "pad_s": args.pad,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "ddp_ft_survivor_longest_gap_s": round(gap, 3),
        "ddp_ft_survivor_steps_not_committed": not_committed,
        "ddp_max_restarts_kill_to_next_step_s": round(next_step - killed_ddp, 3),
        "ddp_max_restarts_steps_done_again": redone,
        "gap_ratio_ddp_ft_to_ddp": round(gap / (next_step - killed_ddp), 3),
        "step_s_ddp_ft": round(step_ft, 4),
        "step_s_ddp": round(step_ddp, 4),
        "throughput_ratio_ddp_ft_to_ddp": round(step_ddp / step_ft, 3),
    }
    if by_hand is not None:
        result["by_hand_survivor_longest_gap_s"] = max(by_hand["survivor_longest_gap_s"])
        result["by_hand_survivor_steps_not_committed"] = by_hand["survivor_steps_not_committed"]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    event = "cut off the network" if args.cut else "killed whole"
    lost = "cut off" if args.cut else "killed"
    where = "one host" if bed is None else f"{g} hosts (network namespaces), host 1 {event}"
    print(
        f"{g} groups of 1 rank (ddp_ft, heartbeat_timeout {args.heartbeat_timeout} s, replica_timeout "
        f"{args.replica_timeout:g} s) / {g} ranks (ddp), "
        f"step padded {args.pad} s, CPU, {where}"
    )
    print(
        f"ddp_ft, group 1 {lost} at step {args.kill_at}: survivors' longest gap "
        f"{result['ddp_ft_survivor_longest_gap_s']} s, each one's steps not committed {not_committed}"
    )
    print(
        f"ddp --max-restarts 1, rank 1 {lost} at step {at}: {lost} to next step "
        f"{result['ddp_max_restarts_kill_to_next_step_s']} s, steps done again {redone} "
        f"(checkpoint every {args.every})"
    )
    if by_hand is not None:
        print(
            f"torchft by hand, host 1 killed at step {args.kill_at}: survivors' longest gap "
            f"{result['by_hand_survivor_longest_gap_s']} s, each one's steps not committed "
            f"{result['by_hand_survivor_steps_not_committed']}"
        )
    print(f"gap ratio ddp_ft / ddp: {result['gap_ratio_ddp_ft_to_ddp']}")
    print(
        f"no failure: step {result['step_s_ddp_ft']} s (ddp_ft) vs {result['step_s_ddp']} s (ddp): "
        f"throughput ratio {result['throughput_ratio_ddp_ft_to_ddp']}"
    )


def torchft_by_hand(args: argparse.Namespace, bed: Any) -> dict[str, Any]:
    """One kill of host 1 under TorchFT wired by hand, on ``bed``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torchft_by_hand as by_hand

    options = argparse.Namespace(
        groups=args.groups, steps=args.steps, step_time=args.pad, kills=1, down=2.0,
        heartbeat_ms=round(args.heartbeat_timeout * 1000),
    )  # fmt: skip
    kills: list[dict[str, Any]] = by_hand.driver(options, bed, first_kill_after=args.kill_at)["kills"]
    return kills[0]


if __name__ == "__main__":
    main()
