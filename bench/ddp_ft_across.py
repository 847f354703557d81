"""The collective between ``ddp_ft``'s replica groups, measured side by side
in one run (CPU, gloo):

    python bench/ddp_ft_across.py [--baseline-tree DIR] [--trials 3] [--rate 100mbit]
                                  [--width 60000] [--steps 12] [--json]

* **A lost group, one host**: the survivors' longest gap between two
  committed steps after group 1 of 3 is killed (``bench/ddp_ft.py``'s
  measure), with the traffic between the groups through the named ``torch``
  collective (this tree), against the same job of ``--baseline-tree``, a
  checkout of phalanx from before the named collective carried it
  (80a33cf: TorchFT's own gloo group did). The two alternate, ``--trials``
  times each. Without ``--baseline-tree`` this part is skipped.
* **No failure, one host** (with ``--baseline-tree``): the median step of
  the same job without a kill, 300 steps of a small model (mostly TorchFT's
  own costs a step), this tree against the baseline, ``2 x --trials``
  alternating runs each.
* **Throughput, three hosts** (network namespaces, root): the median step
  of ``ddp_ft`` with 3 groups of 1 rank, one a host, and a model of
  ``--width`` (its gradients about 66 x width float32: 16 MB at 60000),
  with ``--collective torch`` and ``--collective compressed`` (bf16 on the
  wire), on the bed's link as it is and limited to ``--rate`` each way at
  every host (tc), and the bytes the hosts sent on their links in each job
  (their interfaces' counters: every byte of every process). Ratios:
  compressed's throughput over torch's; with
  ``--baseline-tree``, also the named torch collective's over TorchFT's
  own gloo group (the tree before).

This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_ft import Run, baseline_env, survivors_gap


def kill_gaps(args: argparse.Namespace) -> dict[str, list[float]]:
    """Part A: alternating trials of this tree and the baseline."""
    trees: dict[str, Any] = {"named torch collective": os.environ}
    if args.baseline_tree:
        trees["TorchFT's own gloo group (baseline tree)"] = baseline_env(args.baseline_tree)
    kill = argparse.Namespace(steps=40, pad=0.25, every=10, width=None)
    flags = ["--strategy", "ddp_ft", "--replica-groups", "3", "--devices", "1", "--max-restarts", "1"]
    flags += ["-o", "heartbeat_timeout=1.0"]
    gaps: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.trials):
        for name, env in trees.items():
            run = Run(flags, kill, env=dict(env))
            killed, _ = run.kill_at(1, 15)
            run.wait()
            gaps[name].append(round(survivors_gap(run, killed), 3))
    return gaps


def small_steps(args: argparse.Namespace) -> dict[str, list[float]]:
    """Part C: no failure, one host, the small model (a step of TorchFT's
    own costs, mostly): the median step of this tree and the baseline,
    alternating trials, in milliseconds."""
    work = argparse.Namespace(steps=300, pad=0.0, every=100000, width=None)
    flags = ["--strategy", "ddp_ft", "--replica-groups", "3", "--devices", "1"]
    trees: dict[str, Any] = {"named torch collective": None}
    trees["TorchFT's own gloo group (baseline tree)"] = baseline_env(args.baseline_tree)
    found: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(2 * args.trials):
        for name, env in trees.items():
            run = Run(flags, work, env=env)
            run.wait()
            times = [s[4] for s in run.steps if s[0] == 0 and s[3]][10:]
            found[name].append(
                round(statistics.median(b - a for a, b in itertools.pairwise(times)) * 1000, 2)
            )
    return found


def throughput(args: argparse.Namespace) -> tuple[dict[str, float], dict[str, int]]:
    """Part B: median steps on three hosts, per collective, link as it is
    and limited; and the bytes the hosts sent on their links in each job
    (every process's: the ranks', the stores', the heartbeats')."""
    from phalanx_core.testing.hosts import TestBed

    work = argparse.Namespace(steps=args.steps, pad=0.0, every=1000, width=args.width)
    flags = ["--strategy", "ddp_ft", "--replica-groups", "3", "--devices", "1", "--num-nodes", "3"]
    flags += ["-o", "replica_timeout=120"]  # a step of 16 MB on a slow link takes seconds
    steps: dict[str, float] = {}
    sent: dict[str, int] = {}
    jobs: list[tuple[str, str, Any]] = [("torch", "torch", None), ("compressed", "compressed", None)]
    if args.baseline_tree:  # TorchFT's own gloo group between the groups
        jobs.insert(1, ("torch (baseline tree)", "torch", baseline_env(args.baseline_tree)))
    with TestBed(3, subnet="192.168.83") as bed:
        for rate in (None, args.rate):
            for host in bed.hosts:
                bed.limit(host, rate)
            for name, collective, env in jobs:
                before = sum(bed.bytes_sent(host) for host in bed.hosts)
                run = Run([*flags, "--collective", collective], work, bed, env=env)
                run.wait()
                sent[f"{name} {rate or 'unlimited'}"] = (
                    sum(bed.bytes_sent(host) for host in bed.hosts) - before
                )
                times = [s[4] for s in run.steps if s[0] == 0 and s[3]][3:]  # after the first steps
                steps[f"{name} {rate or 'unlimited'}"] = statistics.median(
                    b - a for a, b in itertools.pairwise(times)
                )
    return steps, sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", type=Path, help="a phalanx checkout from before (80a33cf)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--rate", default="100mbit", help="tc's rate for the limited link, each way")
    parser.add_argument("--width", type=int, default=60000)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip-kill", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if not args.skip_kill:
        result["survivors_longest_gap_s"] = kill_gaps(args)
    if args.baseline_tree and not args.skip_kill:
        result["small_step_ms"] = small_steps(args)
    if not args.skip_throughput:
        steps, sent = throughput(args)
        result["median_step_s"] = {k: round(v, 4) for k, v in steps.items()}
        result["bytes_sent_per_job"] = sent
        result["throughput_compressed_over_torch"] = {
            link: round(steps[f"torch {link}"] / steps[f"compressed {link}"], 3)
            for link in ("unlimited", args.rate)
        }
        if args.baseline_tree:
            result["throughput_torch_over_baseline"] = {
                link: round(steps[f"torch (baseline tree) {link}"] / steps[f"torch {link}"], 3)
                for link in ("unlimited", args.rate)
            }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    for name, gaps in result.get("survivors_longest_gap_s", {}).items():
        print(f"group 1 of 3 killed, one host, {name}: survivors' longest gap {gaps} s "
              f"(median {statistics.median(gaps)})")  # fmt: skip
    for name, steps in result.get("small_step_ms", {}).items():
        print(f"no failure, one host, 3 groups, small model, {name}: median step {steps} ms "
              f"(median {round(statistics.median(steps), 2)})")  # fmt: skip
    for name, step in result.get("median_step_s", {}).items():
        print(f"3 hosts, ddp_ft, width {args.width}, --collective {name}: median step {step} s")
    for name, count in result.get("bytes_sent_per_job", {}).items():
        print(
            f"3 hosts, --collective {name}: {count / 1e6:.1f} MB sent on the hosts' links "
            f"({args.steps} steps)"
        )
    for link, ratio in result.get("throughput_compressed_over_torch", {}).items():
        print(f"throughput, compressed / torch, link {link}: {ratio}")
    for link, ratio in result.get("throughput_torch_over_baseline", {}).items():
        print(f"throughput, torch (named) / TorchFT's own gloo group (baseline tree), link {link}: {ratio}")


if __name__ == "__main__":
    main()
