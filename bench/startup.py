"""Start-up time of ``phalanx run`` against ``torchrun``, measured in one run.

    python bench/startup.py [--runs 5] [--warmup 1] [--json] [--env-bytecode]

Two scripts, each started on 2 CPU ranks by both launchers:

* **barrier**: make the process group and pass one barrier. For phalanx,
  ``phalanx.resolve("ddp", accelerator="cpu", devices=2).launch(fn)`` with
  ``fn`` calling ``strategy.barrier()``; for torch,
  ``init_process_group("gloo")``, ``barrier()``, ``destroy_process_group()``.
* **trivial**: a script that does nothing (``x = 1``), the same file for both.

The commands are ``phalanx run --strategy ddp --accelerator cpu --devices 2
SCRIPT`` and ``torchrun --standalone --nproc-per-node 2 SCRIPT`` (the console
scripts next to this interpreter, else ``python -m phalanx`` and ``python -m
torch.distributed.run``). Each round runs all four commands, the two
launchers in an order that alternates from round to round, so that drift on
a busy machine hits both sides; the time is the wall time from start to exit
of the command, and the CPU seconds of its whole process tree (the ranks
included) are given beside it. Medians over ``--runs`` rounds, after
``--warmup`` untimed ones; the ratio is phalanx / torchrun (lower is
better; the goal is at most 1.0).

The children run in an empty folder, without the variables that would change
what is measured (``PHALANX_*``, a rank's or a scheduler's ``RANK``,
``MASTER_ADDR``, ... ); ``PYTHONPATH`` is kept, so that a working copy can be
measured. By default they cache bytecode in a temporary
``PYTHONPYCACHEPREFIX``, as an installed package has it: with
``PYTHONDONTWRITEBYTECODE=1`` and an editable install, every process (the
agent and each rank) would compile the phalanx sources again, which torch,
installed with its bytecode, never does. ``--env-bytecode`` leaves those two
variables as they are.

On a busy machine (2 cores shared with other work) the medians of 5 runs
move by 10-20 % from one run of this script to the next: read the CPU
seconds too, which move much less, and use ``--runs 11`` before comparing
two revisions.

This prints; it asserts nothing. Everything it and the commands write (the
scripts, the bytecode, the launchers' temporary files: the children's
``TMPDIR``) is in one temporary folder, removed at the end.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BARRIER_PHALANX = """\
import phalanx


def fn(strategy):
    strategy.barrier()


if __name__ == "__main__":
    phalanx.resolve("ddp", accelerator="cpu", devices=2).launch(fn)
"""

BARRIER_TORCH = """\
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    dist.barrier()
    dist.destroy_process_group()
"""

TRIVIAL = "x = 1\n"

#: Variables removed from every child: they would change what is measured.
SCRUB_PREFIXES = ("PHALANX_", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMI_", "LSB_")
SCRUB = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "NODE_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "PYTHONPROFILEIMPORTTIME",
    "PYTHONDEVMODE",
    "PYTHONTRACEMALLOC",
)


def _console_script(name: str, module: str) -> list[str]:
    """The console script ``name`` next to this interpreter, else ``python -m module``."""
    path = Path(sys.executable).parent / name
    if path.is_file() and os.access(path, os.X_OK):
        return [str(path)]
    return [sys.executable, "-m", module]


def child_env(tmp: Path, pycache: Path | None) -> dict[str, str]:
    """This environment without :data:`SCRUB`, with ``TMPDIR`` in ``tmp``
    (what the launchers leave there, torchrun's ``torchelastic_*`` log
    folders, goes when ``tmp`` does) and bytecode cached in ``pycache``."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUB and not k.startswith(SCRUB_PREFIXES)}
    env["TMPDIR"] = str(tmp)
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


def run_once(argv: Sequence[str], env: dict[str, str], cwd: Path) -> tuple[float, float]:
    """Run ``argv``; return its wall seconds and the CPU seconds of its
    process tree (every descendant it waited for). Raises on failure."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(
            f"command failed with exit code {proc.returncode}: {' '.join(argv)}\n"
            f"{proc.stderr.decode(errors='replace')}"
        )
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, cpu


def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-startup-") as tmp:
        root = Path(tmp)
        cwd = root / "cwd"  # empty: nothing of the caller's folder on sys.path
        cwd.mkdir()
        scripts = {}
        for name, text in (
            ("barrier_phalanx.py", BARRIER_PHALANX),
            ("barrier_torch.py", BARRIER_TORCH),
            ("trivial.py", TRIVIAL),
        ):
            scripts[name] = root / name
            scripts[name].write_text(text)
        (root / "tmp").mkdir()
        env = child_env(root / "tmp", None if args.env_bytecode else root / "pycache")
        phalanx_run = [
            *_console_script("phalanx", "phalanx"),
            "run",
            "--strategy",
            "ddp",
            "--accelerator",
            "cpu",
            "--devices",
            "2",
        ]
        torchrun = [
            *_console_script("torchrun", "torch.distributed.run"),
            "--standalone",
            "--nproc-per-node",
            "2",
        ]
        cases = {
            "barrier": {
                "phalanx": [*phalanx_run, str(scripts["barrier_phalanx.py"])],
                "torchrun": [*torchrun, str(scripts["barrier_torch.py"])],
            },
            "trivial": {
                "phalanx": [*phalanx_run, str(scripts["trivial.py"])],
                "torchrun": [*torchrun, str(scripts["trivial.py"])],
            },
        }
        samples: dict[str, dict[str, dict[str, list[float]]]] = {
            case: {side: {"wall": [], "cpu": []} for side in sides} for case, sides in cases.items()
        }
        rounds = args.warmup + args.runs
        progress = not args.json and sys.stderr.isatty()
        for round_ in range(rounds):
            if progress:
                print(f"\rround {round_ + 1}/{rounds}", end="", file=sys.stderr, flush=True)
            for case, sides in cases.items():
                order = list(sides) if round_ % 2 == 0 else list(reversed(list(sides)))
                for side in order:
                    wall, cpu = run_once(sides[side], env, cwd)
                    if round_ >= args.warmup:
                        samples[case][side]["wall"].append(wall)
                        samples[case][side]["cpu"].append(cpu)
        if progress:
            print("\r" + " " * 30 + "\r", end="", file=sys.stderr, flush=True)
    result: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": importlib.metadata.version("torch"),
        "cpus": os.cpu_count(),
        "runs": args.runs,
        "bytecode": "as the environment has it" if args.env_bytecode else "cached (PYTHONPYCACHEPREFIX)",
        "commands": {
            case: {side: " ".join(argv) for side, argv in sides.items()} for case, sides in cases.items()
        },
        "cases": {},
    }
    for case, sides in samples.items():
        row: dict[str, Any] = {}
        for side, values in sides.items():
            row[side] = {
                "wall_median": statistics.median(values["wall"]),
                "wall_min": min(values["wall"]),
                "cpu_median": statistics.median(values["cpu"]),
            }
            if args.samples:
                row[side]["wall"] = values["wall"]
                row[side]["cpu"] = values["cpu"]
        row["ratio"] = row["phalanx"]["wall_median"] / row["torchrun"]["wall_median"]
        row["ratio_min"] = row["phalanx"]["wall_min"] / row["torchrun"]["wall_min"]
        result["cases"][case] = row
    return result


def report(result: dict[str, Any]) -> None:
    print(
        f"torch {result['torch']}, python {result['python']}, {result['cpus']} cpus, 2 CPU ranks, "
        f"medians of {result['runs']} runs; bytecode {result['bytecode']}"
    )
    for case, sides in result["commands"].items():
        for side, command in sides.items():
            print(f"  {case:<8} {side:<9} {command}")
    print()
    header = (
        f"{'script':<8} {'phalanx s':>10} {'torchrun s':>11} {'ratio':>6} {'min ratio':>10} "
        f"{'phalanx cpu s':>14} {'torchrun cpu s':>15}"
    )
    print(header)
    print("-" * len(header))
    for case, row in result["cases"].items():
        p, t = row["phalanx"], row["torchrun"]
        print(
            f"{case:<8} {p['wall_median']:>10.3f} {t['wall_median']:>11.3f} {row['ratio']:>6.2f} "
            f"{row['ratio_min']:>10.2f} {p['cpu_median']:>14.2f} {t['cpu_median']:>15.2f}"
        )
    print("\n(ratio: phalanx / torchrun of the median wall times; min ratio: of the fastest runs;")
    print(" cpu s: CPU seconds of the whole process tree, the ranks included)")
    print("\nverdict:")
    for case, row in result["cases"].items():
        mark = "PASS" if row["ratio"] <= 1.0 else "FAIL"
        print(f"  [{mark}] {case}: phalanx run / torchrun {row['ratio']:.2f} (goal <= 1.0)")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--samples", action="store_true", help="include every sample in --json output")
    parser.add_argument(
        "--env-bytecode",
        action="store_true",
        help="leave PYTHONDONTWRITEBYTECODE / PYTHONPYCACHEPREFIX as they are (by default the children "
        "cache bytecode in a temporary folder, as an installed package has it)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        parser.error("--runs must be at least 1 and --warmup at least 0")
    result = bench(args)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
