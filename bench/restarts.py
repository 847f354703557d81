"""Recovery after a killed rank: ``phalanx run`` against ``torchrun``, on one node.

    python bench/restarts.py [--runs 20] [--timeout 120] [--warmup 1] [--json] [--keep DIR]

The workload is ``bench/restart_tutorial.py``: PyTorch's fault-tolerance
tutorial (pytorch/examples ``distributed/ddp-tutorial-series/multigpu_torchrun.py``)
on 2 CPU ranks with gloo, 4 epochs of 10 batches of 50 ms, a snapshot at
every epoch end; rank 1 kills itself with ``SIGKILL`` in epoch 2 on the
first attempt. It is run ``--runs`` times under each of

* ``python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 SCRIPT ...``
* ``python -m phalanx run --strategy ddp --accelerator cpu --devices 2 --max-restarts 1 SCRIPT ...``

interleaved (torchrun, phalanx, torchrun, ...), after ``--warmup`` untimed
pairs (they fill the bytecode cache). Each run has a fresh temporary folder
(its working directory, ``TMPDIR``, the snapshot, the rank logs) and
``--timeout`` seconds; a run still going then is a hang: every process it
started is killed (found by a variable set only in that run's environment,
since torch elastic starts each rank in a session of its own).

A run **recovered** when the launcher exited 0 and both ranks finished the
last epoch. For the others the kind of failure is given: a hang, gloo's
``connectFullMesh`` / ``Connection refused`` in the output (the restarted
ranks failed to connect), or another exit code. Times, from the rank logs
(``time.monotonic()``, one clock for every process of the machine):

* kill to restart: from the kill to the later of the two restarted ranks'
  first line (its interpreter up, before ``import torch``);
* kill to next step: from the kill to the later of the two ranks' first
  finished step on the second attempt, in every run that got one;
* wall: the launcher's whole run, start to exit.

After every run it looks for processes of that run still alive (and kills
them); the count is printed. The children's environment is
``bench/startup.py``'s ``child_env`` (no rank or scheduler variables, a
bytecode cache in the benchmark's temporary folder).

This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from startup import child_env

SCRIPT = Path(__file__).resolve().parent / "restart_tutorial.py"
EPOCHS = 4

#: The variable that marks every process of one run.
MARK = "PHALANX_BENCH_RESTARTS_RUN"

LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
    "phalanx run": [
        sys.executable,
        "-m",
        "phalanx",
        "run",
        "--strategy",
        "ddp",
        "--accelerator",
        "cpu",
        "--devices",
        "2",
    ],
}

GLOO_CONNECT = ("connectFullMesh", "Connection refused")


def marked(value: str) -> list[int]:
    """The processes whose environment has ``MARK=value`` (or starts with it)."""
    needle = f"{MARK}={value}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if any(item.startswith(needle) for item in environ.split(b"\0")):
            pids.append(int(entry))
    return pids


def kill_marked(value: str) -> int:
    """SIGKILL every process of ``value``; the number found."""
    pids = marked(value)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def read_events(logs: Path) -> dict[int, list[tuple[str, int, int, int, float]]]:
    """Each rank's lines: (kind, attempt, epoch, batch, monotonic)."""
    events: dict[int, list[tuple[str, int, int, int, float]]] = {}
    for path in sorted(logs.glob("rank*.log")):
        rank = int(path.stem.removeprefix("rank"))
        rows = []
        for line in path.read_text().splitlines():
            kind, attempt, epoch, batch, mono, _ = line.split()
            rows.append((kind, int(attempt), int(epoch), int(batch), float(mono)))
        events[rank] = rows
    return events


def first_after(events: dict[int, list[tuple[str, int, int, int, float]]], kind: str) -> float | None:
    """The later over both ranks of each one's first ``kind`` line on an attempt after the first."""
    times = []
    for rank in (0, 1):
        found = [mono for k, attempt, _, _, mono in events.get(rank, []) if k == kind and attempt >= 1]
        if not found:
            return None
        times.append(found[0])
    return max(times)


def run_once(
    name: str, root: Path, pycache: Path, timeout: float, index: int, keep: Path | None
) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"run{index}-", dir=root))
    logs = folder / "logs"
    tmp = folder / "tmp"
    logs.mkdir()
    tmp.mkdir()
    mark = f"{os.getpid()}-{index}"
    env = child_env(tmp, pycache)
    env[MARK] = mark
    argv = [
        *LAUNCHERS[name],
        "--max-restarts",
        "1",
        str(SCRIPT),
        "--epochs",
        str(EPOCHS),
        "--snapshot",
        str(folder / "snapshot.pt"),
        "--log-dir",
        str(logs),
    ]
    with open(folder / "output", "wb") as out:
        start = time.monotonic()
        proc = subprocess.Popen(
            argv, env=env, cwd=folder, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            kill_marked(mark)
            proc.wait()
        wall = time.monotonic() - start
    time.sleep(0.5)  # let a process that was on its way out go
    left = kill_marked(mark)
    output = (folder / "output").read_text(errors="replace")
    events = read_events(logs)
    kill_file = logs / "kill"
    killed = float(kill_file.read_text().split()[0]) if kill_file.exists() else None
    finished = all(
        any(k == "epoch" and epoch == EPOCHS - 1 for k, _, epoch, _, _ in events.get(rank, []))
        for rank in (0, 1)
    )
    restart = first_after(events, "start")
    step = first_after(events, "step")
    if code is None:
        failure = f"hang (killed after {timeout:g} s)"
    elif code != 0 and any(s in output for s in GLOO_CONNECT):
        failure = "gloo connectFullMesh / Connection refused"
    elif code != 0:
        failure = f"exit {code}"
    elif not finished:
        failure = "exit 0, last epoch not finished"
    elif killed is None:
        failure = "rank 1 was never killed"
    else:
        failure = None
    result = {
        "launcher": name,
        "index": index,
        "code": code,
        "recovered": failure is None,
        "failure": failure,
        "kill_to_restart": None if killed is None or restart is None else restart - killed,
        "kill_to_step": None if killed is None or step is None else step - killed,
        "wall": wall,
        "left_behind": left,
    }
    if keep is not None:
        shutil.copytree(folder, keep / f"{index:02d}-{name.replace(' ', '-')}", dirs_exist_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    return result


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    def spread(key: str) -> dict[str, Any]:
        values = [r[key] for r in results if r[key] is not None]
        if not values:
            return {"n": 0, "median": None, "max": None}
        return {"n": len(values), "median": statistics.median(values), "max": max(values)}

    return {
        "runs": len(results),
        "recovered": sum(r["recovered"] for r in results),
        "failures": dict(Counter(r["failure"] for r in results if r["failure"])),
        "kill_to_restart": spread("kill_to_restart"),
        "kill_to_step": spread("kill_to_step"),
        "wall": spread("wall"),
        "left_behind": sum(r["left_behind"] for r in results),
    }


def table(summaries: dict[str, dict[str, Any]]) -> str:
    names = list(summaries)
    rows: list[tuple[str, ...]] = [("", *names)]
    rows.append(("recovered", *(f"{s['recovered']}/{s['runs']}" for s in summaries.values())))
    kinds = sorted({kind for s in summaries.values() for kind in s["failures"]})
    for kind in kinds:
        rows.append((f"failed: {kind}", *(str(s["failures"].get(kind, 0)) for s in summaries.values())))

    def cell(spread: dict[str, Any]) -> str:
        if not spread["n"]:
            return "-"
        return f"{spread['median']:.2f} / {spread['max']:.2f} (n={spread['n']})"

    rows.append(
        ("kill to restart, s (median / max)", *(cell(s["kill_to_restart"]) for s in summaries.values()))
    )
    rows.append(
        ("kill to next step, s (median / max)", *(cell(s["kill_to_step"]) for s in summaries.values()))
    )
    rows.append(("wall per run, s (median / max)", *(cell(s["wall"]) for s in summaries.values())))
    rows.append(("processes left behind", *(str(s["left_behind"]) for s in summaries.values())))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def leftovers() -> list[str]:
    """``ps`` lines of any process still running the workload or carrying a run's mark."""
    ps = subprocess.run(["ps", "-eo", "pid,ppid,pgid,etimes,args"], capture_output=True, text=True).stdout
    pids = set(marked(f"{os.getpid()}-"))
    return [line for line in ps.splitlines()[1:] if SCRIPT.name in line or int(line.split()[0]) in pids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs per launcher (default 20)")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds before a run is a hang (default 120)"
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed pairs of runs first (default 1)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON, every run included")
    parser.add_argument("--keep", type=Path, help="copy every run's folder (output, logs) here")
    args = parser.parse_args()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in LAUNCHERS}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-restarts-") as tmp:
        root = Path(tmp)
        pycache = root / "pycache"
        index = 0
        for round_ in range(-args.warmup, args.runs):
            for name in LAUNCHERS:
                r = run_once(name, root, pycache, args.timeout, index, args.keep)
                index += 1
                step = "-" if r["kill_to_step"] is None else f"{r['kill_to_step']:.2f} s"
                print(
                    f"{'warm-up' if round_ < 0 else f'run {round_ + 1}/{args.runs}'} {name}: "
                    f"{'recovered' if r['recovered'] else r['failure']}, kill to step {step}, "
                    f"wall {r['wall']:.1f} s, left behind {r['left_behind']}",
                    file=sys.stderr,
                    flush=True,
                )
                if round_ >= 0:
                    results[name].append(r)
    summaries = {name: summary(rs) for name, rs in results.items()}
    remaining = leftovers()
    if args.json:
        print(json.dumps({"summaries": summaries, "runs": results, "leftovers": remaining}, indent=2))
        return
    print(
        f"Recovery after rank 1 is SIGKILLed in epoch 2 of {EPOCHS} ({SCRIPT.name}, 2 CPU ranks, gloo), "
        f"--max-restarts 1, {args.runs} runs each, interleaved, timeout {args.timeout:g} s "
        f"(total {time.monotonic() - began:.0f} s):\n"
    )
    print(table(summaries))
    print(f"\nprocesses of the workload left after the benchmark (ps): {len(remaining)}")
    for line in remaining:
        print("  " + line)


if __name__ == "__main__":
    main()
