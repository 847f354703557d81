"""The way to ``ddp_ft``'s lighthouse on several hosts, measured in one run
(three hosts of network namespaces, root; CPU, gloo):

    python bench/ddp_ft_lighthouse.py [--baseline-tree DIR] [--trials 3] [--steps 200] [--json]

* **No failure** (with ``--baseline-tree``): the median step of ``ddp_ft``
  with 3 groups of 1 rank, one a host, and a small model (a step is mostly
  TorchFT's quorum and commit, what the forwarder and the guard sit in),
  this tree (each host's managers reach the lighthouse through a forwarder
  on 127.0.0.1 and node 0's guard) against the checkout ``--baseline-tree``
  (9d9f4ea: they called node 0's lighthouse directly), alternating,
  ``--trials`` runs each.
* **The lighthouse's host lost** under ``--rendezvous etcd://`` (an etcd
  member on each host): the elected host killed whole at group 0's step
  20; the time from the kill to the other groups' next committed step, and
  whether any of them was started again, ``--trials`` times (a fresh bed
  each).

This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ddp_ft import Run, baseline_env

LEADER = re.compile(r"this host runs the job's lighthouse now \(term \d+\), at ([\d.]+):")


def median_steps(args: argparse.Namespace) -> dict[str, list[float]]:
    """The median step of each run, by tree."""
    from phalanx_core.testing.hosts import TestBed

    trees: dict[str, dict[str, str] | None] = {
        "baseline tree": baseline_env(args.baseline_tree),
        "this tree": None,
    }
    found: dict[str, list[float]] = {tree: [] for tree in trees}
    flags = ["--strategy", "ddp_ft", "--replica-groups", "3", "--devices", "1", "--num-nodes", "3"]
    options = argparse.Namespace(steps=args.steps, pad=0.0, every=10**9, width=16)
    with TestBed(3, subnet="192.168.84") as bed:
        for _ in range(args.trials):
            for tree, env in trees.items():
                run = Run(flags, options, bed, env=env)
                run.wait()
                found[tree].append(run.median_step(0))
    return found


def lighthouse_losses(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each trial: the elected lighthouse's host killed whole."""
    from phalanx_core.testing.hosts import TestBed

    found = []
    options = argparse.Namespace(steps=60, pad=0.05, every=10**9)
    for trial in range(args.trials):
        with TestBed(3, subnet="192.168.85") as bed, tempfile.TemporaryDirectory() as folder:
            endpoints = bed.start_etcd(Path(folder))
            flags = ["--strategy", "ddp_ft", "--replica-groups", "3", "--devices", "1", "--num-nodes", "3"]
            flags += ["--rendezvous", f"etcd://{endpoints}/bench-{trial}"]
            run = Run(flags, options, bed)
            while not any(s[0] == 0 and s[2] >= 20 for s in run.steps):
                if run.process.poll() is not None:
                    raise RuntimeError(f"the job ended before the kill ({run.folder})")
                time.sleep(0.01)
            [address] = LEADER.findall("".join(run.lines))[-1:]
            leader = next(i for i, host in enumerate(bed.hosts) if host.address == address)
            bed.kill_all(bed.hosts[leader])
            killed = time.monotonic()
            run.wait(lost=leader)
            after = [s[4] for s in run.steps if s[0] != leader and s[3] and s[4] > killed]
            pids = {
                group: {s[1] for s in run.steps if s[0] == group} for group in range(3) if group != leader
            }
            found.append(
                {
                    "next_committed_step_s": round(min(after) - killed, 3),
                    "restarted": sorted(group for group, seen in pids.items() if len(seen) > 1),
                }
            )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", type=Path, help="a phalanx checkout from before (9d9f4ea)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result: dict[str, Any] = {}
    if args.baseline_tree:
        steps = median_steps(args)
        result["median_step_s"] = {tree: [round(t, 5) for t in times] for tree, times in steps.items()}
        result["throughput_this_over_baseline"] = round(
            statistics.median(steps["baseline tree"]) / statistics.median(steps["this tree"]), 3
        )
    result["lighthouse_host_lost"] = lighthouse_losses(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    if "median_step_s" in result:
        for tree, times in result["median_step_s"].items():
            print(f"no failure, {tree}: median step {', '.join(f'{t * 1000:.2f}' for t in times)} ms")
        print(f"throughput this tree / baseline: {result['throughput_this_over_baseline']}")
    for loss in result["lighthouse_host_lost"]:
        print(
            "lighthouse's host killed (etcd): the others' next committed step "
            f"{loss['next_committed_step_s']} s after; groups started again: {loss['restarted'] or 'none'}"
        )


if __name__ == "__main__":
    main()
