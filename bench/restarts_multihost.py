"""A lost host and a row of killed ranks on three hosts made of network
namespaces (``phalanx_core.testing.hosts``): ``phalanx run`` against
``torchrun``. Needs root and iproute2.

    python bench/restarts_multihost.py [--runs 5] [--soak-kills 10] [--json] [--keep DIR]
    python bench/restarts_multihost.py --runs 0            # the soak only
    python bench/restarts_multihost.py --soak-kills 0      # the lost host only

The workload is the multihost tests' ``tests/multihost/elastic_job.py``
(2 epochs, batch 2 per rank, a pause after each step, a background
checkpoint every 2 steps, ``strategy.resume``), which writes a
``time.monotonic()`` on every step and at each rank's start. Every run makes a test bed of 3
hosts (node0..node2, 192.168.77.1-3) and removes it at its end.

1. **A lost host**, ``--runs`` times per launcher, interleaved (phalanx
   run, torchrun, torchrun with a store per round, phalanx run, ...), one
   rank per host, on each host I:

   * ``python -m phalanx run --strategy ddp --accelerator cpu --devices 1
     --num-nodes 2:3 --max-restarts 3 --node-rank I --main-address
     192.168.77.1 --main-port P JOB OUT SAMPLES PAUSE``
   * ``python -m torch.distributed.run --nnodes 2:3 --nproc-per-node 1
     --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint node0:P
     --rdzv-id ID JOB OUT SAMPLES PAUSE``: torchrun as it comes (the c10d
     rendezvous' ``last_call_timeout`` of 30 s; its TCPStore shared by every
     round and by the ranks). The job resolves ``ddp`` on the CPU for this
     round's ``GROUP_WORLD_SIZE`` nodes itself: ``-m phalanx run
     --num-nodes 3`` in front of it refuses a round of 2 nodes, and
     ``--num-nodes 2:3`` refuses ``min_nodes`` under torchrun (try them
     with ``--torchrun-inner``). The endpoint is ``node0``, not
     192.168.77.1: torchrun hosts the store only where the endpoint is the
     host's name or an address that name resolves to, and node0's name
     resolves to 127.0.1.1 there (Debian's ``/etc/hosts``), so with the
     address no host serves it;
   * the same with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: each round's
     ranks get a store of their own (hosted by rank 0), none of an earlier
     round's keys.

   Once the job has trained ``--kill-after`` steps on 3 hosts, every
   process of node2 is killed with SIGKILL (the host is lost; it is not
   started again). Measured: kill to restart (the later of the two
   remaining ranks' start, the time its interpreter began, in the round
   that trained: an attempt that failed in ``strategy.launch()`` is not
   counted), kill to next step (the later of the two remaining ranks' first
   finished step in the new round), the steps lost (the last step the
   killed round reached minus the step the new round resumed from: trained
   after the newest checkpoint, done again), whether both remaining nodes
   exited 0, whether every sample of each epoch was trained (the counting
   of ``tests/multihost/test_elastic.py``: ``DistributedSampler``'s padding
   repeats allowed where the world size changed), and the processes left
   in the hosts' namespaces or carrying the run's tag afterwards (killed).
   Each run names what its output says among ``PlanMismatchError``,
   ``connectFullMesh``, ``Connection refused`` and
   ``RendezvousConnectionError``.

2. **A soak**: one ``phalanx run`` job on 3 hosts (``--num-nodes
   --soak-nodes``, ``--max-restarts --soak-kills``, ``--soak-samples``
   samples) in which ``--soak-kills`` kills happen in a row: each time one
   rank process chosen at random (``phalanx_torch._launch.rank_program``, found in
   the hosts' namespaces; ``--seed``) is sent SIGKILL, and the next kill
   waits until the new round has trained ``--soak-steps`` steps past the
   one it resumed from. Measured: the job's exit code on every host,
   ``restarts`` in done.json, every sample of each epoch trained, processes
   left, total time, and per kill the time to the next step and the steps
   lost.

Every run has ``--timeout`` seconds; a run still going then is a hang (its
processes are killed). The load average of the machine is printed with
every run (``--max-load`` waits, at most ``--load-wait`` seconds, for the
1-minute load to fall below it before each run). ``--save FILE`` keeps the
figures as JSON; ``--replay FILE`` prints their tables again.

This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from startup import child_env

from phalanx_core.testing.hosts import TestBed, missing
from phalanx_core.testing.processes import TAG_VAR, new_tag, reap
from phalanx_core.testing.samples import sample_finding

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).resolve().parent.parent / "tests" / "multihost" / "elastic_job.py"
MAIN = "192.168.77.1"  # node0 on the test bed
PORT = 29631
EPOCHS = 2
RANK_PROGRAM = "phalanx_torch._launch.rank_program"

#: The lost host is run under each of these, with these variables.
LAUNCHERS: dict[str, dict[str, str]] = {
    "phalanx run": {},
    "torchrun": {},
    "torchrun, a store per round": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
}

#: What a failed run's output is searched for.
MARKERS = ("PlanMismatchError", "connectFullMesh", "Connection refused", "RendezvousConnectionError")

Round = tuple[int, int]  # (restart count, resumed step): one round of the job


def phalanx_command(node: int, out: Path, job: list[str], nodes: str, restarts: int) -> list[str]:
    return [
        sys.executable, "-m", "phalanx", "run", "--strategy", "ddp", "--accelerator", "cpu",
        "--devices", "1", "--num-nodes", nodes, "--max-restarts", str(restarts), "--node-rank", str(node),
        "--main-address", MAIN, "--main-port", str(PORT), str(JOB), str(out), *job,
    ]  # fmt: skip


def torchrun_command(node: int, out: Path, args: argparse.Namespace, run_id: str) -> list[str]:
    inner = [
        "-m",
        "phalanx",
        "run",
        "--strategy",
        "ddp",
        "--accelerator",
        "cpu",
        "--num-nodes",
        args.torchrun_inner or "",
    ]
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
        "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"node0:{PORT}",
        "--rdzv-id", run_id, *(inner if args.torchrun_inner else []), str(JOB), str(out),
        str(args.samples), str(args.pause),
    ]  # fmt: skip


class Job:
    """One launcher per host of ``bed``, started and watched."""

    def __init__(self, bed: TestBed, folder: Path, env: dict[str, str]) -> None:
        self.bed, self.folder = bed, folder
        self.out = folder / "out"
        self.out.mkdir()
        self.tag = new_tag()
        self.env = {**env, TAG_VAR: self.tag, "PYTHONUNBUFFERED": "1"}
        self.processes: dict[str, subprocess.Popen] = {}
        self.began = time.monotonic()

    def start(self, index: int, argv: list[str], env: dict[str, str] | None = None) -> None:
        host = self.bed.hosts[index]
        with open(self.folder / f"{host.name}.log", "w") as log:
            log.write("$ " + " ".join([*(f"{k}={v}" for k, v in (env or {}).items()), *argv]) + "\n")
            log.flush()
            self.processes[host.name] = host.popen(
                argv, env={**self.env, **(env or {})}, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT
            )

    def kill_host(self, index: int) -> int:
        """SIGKILL every process of the host; how many there were."""
        return self.bed.kill_all(self.bed.hosts[index])

    def ranks(self) -> list[tuple[str, int]]:
        """(host, pid) of every rank process of ``phalanx run`` running now."""
        found = []
        for host in self.bed.hosts:
            for pid in self.bed.pids(host):
                with contextlib.suppress(OSError):
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    if RANK_PROGRAM.encode() in argv:
                        found.append((host.name, pid))
        return found

    def wait_for(self, what, deadline: float) -> bool:
        """Poll ``what()`` until it is true (True) or ``deadline`` (False),
        or every launcher has ended (then one last look)."""
        while True:
            if what():
                return True
            if time.monotonic() > deadline or all(p.poll() is not None for p in self.processes.values()):
                return bool(what())
            time.sleep(0.1)

    def finish(self, names: list[str], deadline: float) -> tuple[dict[str, int | None], int, list[str]]:
        """Wait for the launchers of ``names`` until ``deadline``; their exit
        codes (``None``: still running, then killed), the seconds from the
        start to the last end, and the processes left (killed)."""
        codes: dict[str, int | None] = {}
        for name in names:
            try:
                codes[name] = self.processes[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        ended = time.monotonic() - self.began
        left = [f"{pid} {cmd}" for pid, cmd in reap(self.tag, grace=5.0).items()]
        for host in self.bed.hosts:  # untagged too: whatever still runs in a namespace
            for pid in self.bed.pids(host):
                try:
                    cmd = (
                        Path(f"/proc/{pid}/cmdline")
                        .read_bytes()
                        .replace(b"\0", b" ")
                        .decode(errors="replace")
                    )
                    os.kill(pid, signal.SIGKILL)
                except OSError:  # gone meanwhile
                    continue
                if not any(line.startswith(f"{pid} ") for line in left):
                    left.append(f"{pid} {cmd.strip()} (in {host.name}'s namespace)")
        return codes, ended, left


# -- the logs ------------------------------------------------------------------


def read_times(out: Path) -> tuple[list[tuple[str, float]], list[tuple[str, Round, int, int, float]]]:
    """Every rank's ``start`` lines (file, monotonic) and ``step`` lines
    (file, round, world, step, monotonic)."""
    starts, steps = [], []
    for path in sorted(out.glob("times-*.txt")):
        for line in path.read_text().splitlines():
            fields = line.split()
            if fields[:1] == ["start"] and len(fields) == 2:
                starts.append((path.stem, float(fields[1])))
            elif fields[:1] == ["step"] and len(fields) == 7:
                restarts, resumed, world, _epoch, step = map(int, fields[1:6])
                steps.append((path.stem, (restarts, resumed), world, step, float(fields[6])))
    return starts, steps


def host_of(stem: str) -> str:
    return stem.split("-")[1]  # times-<host>-<rank>


def last_step(out: Path, world: int | None = None) -> int:
    _, steps = read_times(out)
    return max((s for _, _, w, s, _ in steps if world is None or w == world), default=0)


def after_kill(out: Path, killed: float, before: set[Round]) -> dict[str, Any]:
    """Times from ``killed`` to the restart and to the first step of the
    first round that began after it, the later over the hosts of that round."""
    starts, steps = read_times(out)
    new = [
        (stem, key, step, mono) for stem, key, _, step, mono in steps if key not in before and mono > killed
    ]
    if not new:
        return {"round": None, "kill_to_restart": None, "kill_to_step": None}
    key = min(k for _, k, _, _ in new)
    firsts: dict[str, float] = {}
    for stem, k, _, mono in new:
        if k == key:
            firsts[stem] = min(firsts.get(stem, mono), mono)
    restarted: dict[str, float] = {}
    for stem, mono in starts:
        if stem in firsts and mono > killed:
            restarted[stem] = min(restarted.get(stem, mono), mono)
    return {
        "round": key,
        "hosts": sorted(host_of(s) for s in firsts),
        "kill_to_restart": max(restarted.values()) - killed if len(restarted) == len(firsts) else None,
        "kill_to_step": max(firsts.values()) - killed,
    }


def rounds_of(out: Path) -> dict[Round, dict[str, int]]:
    """Every round: its world size and the last step it reached."""
    found: dict[Round, dict[str, int]] = {}
    for log in out.glob("seen-*.txt"):
        for line in log.read_text().splitlines():
            restarts, resumed, world, _epoch, step = map(int, line.split()[:5])
            entry = found.setdefault((restarts, resumed), {"world": world, "last": step})
            entry["last"] = max(entry["last"], step)
    return dict(sorted(found.items()))


def steps_lost(out: Path) -> list[int]:
    """For each round after the first: the steps the round before it
    reached past the step it resumed from (trained again)."""
    rounds = rounds_of(out)
    return [max(0, rounds[a]["last"] - b[1]) for a, b in itertools.pairwise(rounds)]


def every_sample(out: Path, samples: int) -> str | None:
    """``None`` when every sample of each epoch was trained on exactly once
    (but for the padding repeats of rounds that took an epoch over on
    another world size), else what is wrong: the test's own check
    (:func:`phalanx_core.testing.samples.sample_finding`)."""
    return sample_finding(out, samples, EPOCHS)


def done_json(out: Path) -> dict[str, Any] | None:
    path = out / "done.json"
    return json.loads(path.read_text()) if path.exists() else None


# -- the runs ------------------------------------------------------------------


def wait_for_quiet(args: argparse.Namespace) -> float:
    if args.max_load is not None:
        deadline = time.monotonic() + args.load_wait
        while os.getloadavg()[0] >= args.max_load and time.monotonic() < deadline:
            time.sleep(5)
    return os.getloadavg()[0]


def lost_host(
    name: str, index: int, root: Path, env: dict[str, str], args: argparse.Namespace
) -> dict[str, Any]:
    folder = root / f"{index:02d}-{name.replace(' ', '-')}"
    folder.mkdir()
    load = wait_for_quiet(args)
    result: dict[str, Any] = {"launcher": name, "index": index, "load_at_start": load}
    with TestBed(3) as bed:
        job = Job(bed, folder, env)
        deadline = job.began + args.timeout
        for node in range(3):
            if name == "phalanx run":
                argv = phalanx_command(node, job.out, [str(args.samples), str(args.pause)], "2:3", 3)
            else:
                argv = torchrun_command(node, job.out, args, f"bench{index}")
            job.start(node, argv, LAUNCHERS[name])
        on_three = job.wait_for(lambda: last_step(job.out, world=3) >= args.kill_after, deadline)
        failure = None
        if not on_three:
            failure = f"never {args.kill_after} steps on 3 hosts"
            codes, wall, left = job.finish(["node0", "node1", "node2"], time.monotonic())
        else:
            before = set(rounds_of(job.out))
            result["killed_at_step"] = last_step(job.out)
            killed = time.monotonic()
            result["killed_processes"] = job.kill_host(2)
            result["load_at_kill"] = os.getloadavg()[0]
            job.wait_for(lambda: after_kill(job.out, killed, before)["round"] is not None, deadline)
            codes, wall, left = job.finish(["node0", "node1"], deadline)
            result.update(after_kill(job.out, killed, before))
        result.update(codes=codes, wall=wall, left_behind=left, done=done_json(job.out))
        lost = steps_lost(job.out)
        result["steps_lost"] = lost[0] if lost else None
        result["rounds"] = [[*key, r["world"], r["last"]] for key, r in rounds_of(job.out).items()]
        result["samples"] = every_sample(job.out, args.samples)
    if failure is None:
        if None in codes.values():
            failure = f"hang (killed after {args.timeout:g} s)"
        elif any(codes.values()):
            failure = "exit " + ", ".join(f"{k} {v}" for k, v in codes.items())
        elif result.get("kill_to_step") is None:
            failure = "exit 0, no step after the kill"
        elif result["samples"] is not None:
            failure = "samples: " + result["samples"]
    said = "".join((folder / f"node{n}.log").read_text(errors="replace") for n in range(3))
    result["output_says"] = [marker for marker in MARKERS if marker in said]
    if failure is not None and result["output_says"]:
        failure += " (output: " + ", ".join(result["output_says"]) + ")"
    result["failure"] = failure
    result["recovered"] = failure is None
    keep(folder, args)
    return result


def soak(root: Path, env: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    folder = root / "soak"
    folder.mkdir()
    chooser = random.Random(args.seed)
    load = wait_for_quiet(args)
    result: dict[str, Any] = {"load_at_start": load, "kills": []}
    with TestBed(3) as bed:
        job = Job(bed, folder, env)
        deadline = job.began + args.soak_timeout
        for node in range(3):
            work = [str(args.soak_samples), str(args.pause)]
            job.start(node, phalanx_command(node, job.out, work, args.soak_nodes, args.soak_kills))
        going = job.wait_for(lambda: last_step(job.out) >= args.kill_after, deadline)
        failure = None if going else f"never {args.kill_after} steps"
        for number in range(args.soak_kills if going else 0):
            ranks = job.ranks()
            if not ranks:
                failure = f"kill {number + 1}: no rank process found"
                break
            host, pid = chooser.choice(ranks)
            before = set(rounds_of(job.out))
            at_step = last_step(job.out)
            killed = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            kill: dict[str, Any] = {
                "host": host,
                "pid": pid,
                "at_step": at_step,
                "load": os.getloadavg()[0],
                "killed_round": max(before),
            }

            def went_on(killed=killed, before=before) -> bool:
                found = after_kill(job.out, killed, before)
                if found["round"] is None:
                    return False
                return rounds_of(job.out)[found["round"]]["last"] >= found["round"][1] + args.soak_steps

            if not job.wait_for(went_on, deadline):
                kill.update(after_kill(job.out, killed, before))
                result["kills"].append(kill)
                failure = f"kill {number + 1}: training did not go on"
                break
            kill.update(after_kill(job.out, killed, before))
            result["kills"].append(kill)
            print(
                f"  soak kill {number + 1}/{args.soak_kills}: rank on {host} at step {at_step}, "
                f"next step after {kill['kill_to_step']:.2f} s",
                file=sys.stderr,
                flush=True,
            )
        codes, wall, left = job.finish(["node0", "node1", "node2"], deadline)
        rounds = rounds_of(job.out)
        for kill in result["kills"]:
            if kill.get("round") is not None:
                kill["steps_lost"] = max(0, rounds[kill["killed_round"]]["last"] - kill["round"][1])
        result.update(
            codes=codes,
            wall=wall,
            left_behind=left,
            done=done_json(job.out),
            samples=every_sample(job.out, args.soak_samples),
            rounds=[[*key, r["world"], r["last"]] for key, r in rounds_of(job.out).items()],
            load_at_end=os.getloadavg()[0],
        )
    done = result["done"] or {}
    if failure is None:
        if None in codes.values():
            failure = f"hang (killed after {args.soak_timeout:g} s)"
        elif any(codes.values()):
            failure = "exit " + ", ".join(f"{k} {v}" for k, v in codes.items())
        elif done.get("restarts") != args.soak_kills:
            failure = f"done.json says restarts {done.get('restarts')}, not {args.soak_kills}"
        elif result["samples"] is not None:
            failure = "samples: " + result["samples"]
        elif left:
            failure = f"{len(left)} processes left"
    result["failure"] = failure
    keep(folder, args)
    return result


def keep(folder: Path, args: argparse.Namespace) -> None:
    if args.keep is not None:
        shutil.copytree(folder, args.keep / folder.name, dirs_exist_ok=True)


# -- the report ----------------------------------------------------------------


def spread(values: list[float | None]) -> str:
    found = [v for v in values if v is not None]
    if not found:
        return "-"
    return f"{statistics.median(found):.2f} / {max(found):.2f} (n={len(found)})"


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def summary_table(results: dict[str, list[dict[str, Any]]]) -> str:
    names = list(results)
    rows: list[tuple[str, ...]] = [("", *names)]
    rows.append(
        (
            "recovered and finished",
            *(f"{sum(r['recovered'] for r in rs)}/{len(rs)}" for rs in results.values()),
        )
    )
    kinds = sorted({r["failure"] for rs in results.values() for r in rs if r["failure"]})
    for kind in kinds:
        rows.append(
            (f"failed: {kind}", *(str(sum(r["failure"] == kind for r in rs)) for rs in results.values()))
        )
    for label, key in (
        ("kill to restart, s (median / max)", "kill_to_restart"),
        ("kill to next step, s (median / max)", "kill_to_step"),
        ("steps lost (median / max)", "steps_lost"),
        ("wall per run, s (median / max)", "wall"),
    ):
        rows.append((label, *(spread([r.get(key) for r in rs]) for rs in results.values())))
    rows.append(
        ("processes left behind", *(str(sum(len(r["left_behind"]) for r in rs)) for rs in results.values()))
    )
    for marker in MARKERS:
        counts = [sum(marker in r.get("output_says", ()) for r in rs) for rs in results.values()]
        if any(counts):
            rows.append((f"runs whose output says {marker}", *map(str, counts)))
    return table(rows)


def runs_table(results: dict[str, list[dict[str, Any]]]) -> str:
    rows: list[tuple[str, ...]] = [
        ("run", "launcher", "load", "killed at step", "restart s", "next step s", "lost",
         "exit (node0, node1)", "done.json", "every sample", "left", "wall s", "output says"),
    ]  # fmt: skip
    for r in sorted((r for rs in results.values() for r in rs), key=lambda r: r["index"]):
        done = r["done"]
        rows.append((
            str(r["index"]), r["launcher"], f"{r.get('load_at_kill', r['load_at_start']):.1f}",
            str(r.get("killed_at_step", "-")), number(r.get("kill_to_restart")),
            number(r.get("kill_to_step")),
            str(r["steps_lost"] if r["steps_lost"] is not None else "-"),
            ", ".join(str(r["codes"].get(n)) for n in ("node0", "node1")),
            f"restarts {done['restarts']}, world {done['world']}" if done else "-",
            "yes" if r["samples"] is None else "no", str(len(r["left_behind"])), f"{r['wall']:.1f}",
            ", ".join(r.get("output_says", ())) or "-",
        ))  # fmt: skip
    return table(rows)


def number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def soak_report(result: dict[str, Any], args: argparse.Namespace) -> str:
    done = result["done"]
    kills = result["kills"]
    lines = [
        f"Soak: phalanx run --num-nodes {args.soak_nodes} --max-restarts {args.soak_kills}, 3 hosts, "
        f"{args.soak_samples} samples x {EPOCHS} epochs, pause {args.pause:g} s, {len(kills)} of "
        f"{args.soak_kills} kills of a random rank (SIGKILL), the next one once the new round has trained "
        f"{args.soak_steps} steps (seed {args.seed}):",
        "",
        f"- result: {'ok' if result['failure'] is None else 'FAILED: ' + result['failure']}",
        f"- exit codes: {result['codes']}",
        f"- done.json: {done}",
        f"- every sample of each epoch trained: {'yes' if result['samples'] is None else result['samples']}",
        f"- processes left: {len(result['left_behind'])}"
        + "".join(f"\n    {p}" for p in result["left_behind"]),
        f"- total time: {result['wall']:.1f} s (load average {result['load_at_start']:.1f} at the start, "
        f"{result['load_at_end']:.1f} at the end)",
        f"- kill to next step, s (median / max): {spread([k.get('kill_to_step') for k in kills])}",
        f"- kill to restart, s (median / max): {spread([k.get('kill_to_restart') for k in kills])}",
        f"- steps lost per kill: {[k.get('steps_lost') for k in kills]}",
        "",
    ]
    rows: list[tuple[str, ...]] = [("kill", "rank on", "at step", "load", "restart s", "next step s", "lost")]
    for i, k in enumerate(kills, 1):
        rows.append((
            str(i), k["host"], str(k["at_step"]), f"{k['load']:.1f}", number(k.get("kill_to_restart")),
            number(k.get("kill_to_step")), str(k.get("steps_lost", "-")),
        ))  # fmt: skip
    lines.append(table(rows))
    lines.append(f"\nrounds (restarts, resumed step, world, last step): {result['rounds']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="lost-host runs per launcher (default 5)")
    parser.add_argument(
        "--soak-kills", type=int, default=10, help="rank kills in the soak (default 10; 0: none)"
    )
    parser.add_argument("--samples", type=int, default=120, help="samples per epoch, lost host (default 120)")
    parser.add_argument("--soak-samples", type=int, default=600, help="samples per epoch, soak (default 600)")
    parser.add_argument("--pause", type=float, default=0.25, help="seconds after each step (default 0.25)")
    parser.add_argument(
        "--kill-after", type=int, default=7, help="steps on 3 hosts before a kill (default 7)"
    )
    parser.add_argument("--soak-steps", type=int, default=3, help="steps of a new round before the next kill")
    parser.add_argument("--soak-nodes", default="3", help="--num-nodes of the soak (default 3; or 2:3)")
    parser.add_argument("--seed", type=int, default=0, help="the soak's choice of ranks (default 0)")
    parser.add_argument(
        "--timeout", type=float, default=240.0, help="seconds per lost-host run (default 240)"
    )
    parser.add_argument(
        "--soak-timeout", type=float, default=900.0, help="seconds for the soak (default 900)"
    )
    parser.add_argument(
        "--torchrun-inner",
        metavar="NODES",
        help="torchrun starts `-m phalanx run --num-nodes NODES JOB` instead of JOB (3 refuses a round of 2)",
    )
    parser.add_argument(
        "--launchers",
        nargs="+",
        choices=list(LAUNCHERS),
        default=list(LAUNCHERS),
        help="the lost host under these (default all three)",
    )
    parser.add_argument(
        "--max-load", type=float, help="before each run, wait for the 1-minute load below this"
    )
    parser.add_argument("--load-wait", type=float, default=600.0, help="at most this long (default 600 s)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON, every run included")
    parser.add_argument("--save", type=Path, help="also write the JSON figures to this file")
    parser.add_argument("--replay", type=Path, help="print the tables of a --save file; run nothing")
    parser.add_argument("--keep", type=Path, help="copy every run's folder (launcher output, logs) here")
    args = parser.parse_args()
    if args.replay is not None:
        saved = json.loads(args.replay.read_text())
        for key, value in saved.get("settings", {}).items():
            setattr(args, key, value)
        report(saved["lost_host"], saved["soak"], args, saved.get("seconds"))
        return
    if missing() is not None:
        raise SystemExit(f"a test bed cannot be made here: {missing()}")
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)

    began = time.monotonic()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in args.launchers}
    soaked = None
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-restarts-multihost-") as tmp:
        root = Path(tmp)
        (root / "tmp").mkdir()
        env = child_env(root / "tmp", root / "pycache")
        index = 0
        for number_ in range(args.runs):
            for name in results:
                r = lost_host(name, index, root, env, args)
                index += 1
                results[name].append(r)
                outcome = "recovered" if r["recovered"] else r["failure"]
                print(
                    f"run {number_ + 1}/{args.runs} {name}: {outcome}, "
                    f"kill to next step {number(r.get('kill_to_step'))} s, lost {r['steps_lost']}, "
                    f"wall {r['wall']:.1f} s, left {len(r['left_behind'])}, "
                    f"load {r.get('load_at_kill', r['load_at_start']):.1f}",
                    file=sys.stderr,
                    flush=True,
                )
        if args.soak_kills:
            soaked = soak(root, env, args)
    seconds = time.monotonic() - began
    settings = {k: v for k, v in vars(args).items() if k not in ("keep", "save", "replay", "json")}
    figures = json.dumps(
        {"lost_host": results, "soak": soaked, "seconds": seconds, "settings": settings},
        indent=2,
        default=str,
    )
    if args.save is not None:
        args.save.write_text(figures)
    if args.json:
        print(figures)
        return
    report(results, soaked, args, seconds)


def report(
    results: dict[str, list[dict[str, Any]]],
    soaked: dict[str, Any] | None,
    args: argparse.Namespace,
    seconds: float | None,
) -> None:
    runs = max((len(rs) for rs in results.values()), default=0)
    if runs:
        print(
            f"A lost host: 3 hosts, one rank each, SIGKILL to every process of node2 after {args.kill_after} "
            f"steps on 3 hosts; --num-nodes / --nnodes 2:3, --max-restarts 3; {args.samples} samples x "
            f"{EPOCHS} epochs, pause {args.pause:g} s; {runs} runs each, interleaved; timeout "
            f"{args.timeout:g} s (total {'?' if seconds is None else f'{seconds:.0f}'} s):\n"
        )
        print(summary_table(results))
        print()
        print(runs_table(results))
    if soaked is not None:
        print()
        print(soak_report(soaked, args))


if __name__ == "__main__":
    main()
