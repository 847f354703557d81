"""Start-up and discovery benchmark for phalanx.

Measures, in fresh interpreters started with :mod:`subprocess`:

* ``python -c "import phalanx"``
* ``python -c "import phalanx; phalanx.Registry()"`` (the plugins installed in
  this environment, i.e. the in-repo ones)
* ``python -m phalanx list`` and the ``phalanx`` console script (when one sits
  next to the interpreter)
* ``python -c "import phalanx; phalanx.Registry()"`` with N throw-away plugin
  distributions (default 50 and 200) on ``PYTHONPATH``

each as absolute milliseconds, as milliseconds above a bare interpreter start
(``python -c pass``) and as a ratio to it. The bare start is measured in the
same run, interleaved with the measured commands (one bare start right before
each measured start) so that machine noise hits both; every row is compared
with the bare starts taken next to it. Medians are reported, and minimums.

It also times ``import phalanx`` and ``phalanx.Registry()`` *inside* the
process (``time.perf_counter``), which is the pure discovery time, checks
that every generated plugin really loaded, and checks that ``import phalanx``,
``Registry()`` and ``phalanx list`` import no ``torch``.

Usage::

    python bench/discovery.py                 # table and verdict
    python bench/discovery.py --repeat 50     # more samples
    python bench/discovery.py --json          # machine-readable
    python bench/discovery.py --plugins 50,200,1000 --keep

Only the standard library and phalanx are used. This prints; it asserts
nothing (the exit code is 0 unless a measured command itself fails).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Goals this benchmark reports against (seconds).
LIST_GOAL_S = 0.05  # `phalanx list` within this of a bare interpreter start (issue 31; was 0.15)
IMPORT_GOAL_S = 0.03  # `import phalanx` within this of a bare interpreter start (issue 31)
DISCOVERY_GOAL_S = 0.3  # Registry() with 200 plugins under this
DISCOVERY_GOAL_PLUGINS = 200

#: Environment variables that would change what is measured; removed from every child.
SCRUB = (
    "PYTHONPATH",
    "PYTHONPROFILEIMPORTTIME",
    "PYTHONDEVMODE",
    "PYTHONTRACEMALLOC",
    "PYTHONINSPECT",
    "PYTHONASYNCIODEBUG",
    "PHALANX_PLUGINS",
    "PHALANX_DISABLE_PLUGINS",
    "PHALANX_DEBUG",
)

PLUGIN_SOURCE = """\
from phalanx_core import CollectiveSpec, hookimpl


@hookimpl
def phalanx_collectives():
    return [CollectiveSpec(name="c{i}", target="x_{i}.impl:C", summary="benchmark collective {i}")]
"""

IMPL_SOURCE = """\
class C:
    pass
"""

#: Run inside a child: times import and Registry() and reports what loaded.
PROBE = """\
import time
t0 = time.perf_counter()
import phalanx
t1 = time.perf_counter()
r = phalanx.Registry()
t2 = time.perf_counter()
import sys
loaded = sum(p.status == "loaded" for p in r.plugins)
failed = [str(p.provider) + ": " + str(p.error) for p in r.plugins if p.status == "failed"]
print(repr(((t1 - t0) * 1e3, (t2 - t1) * 1e3, len(r.plugins), loaded, failed,
            sum(1 for _ in r.entries()), "torch" in sys.modules)))
"""

TORCH_IMPORT = "import phalanx, sys; print('torch' in sys.modules)"
TORCH_REGISTRY = "import phalanx, sys; phalanx.Registry(); print('torch' in sys.modules)"
TORCH_LIST = (
    "import contextlib, io, sys\n"
    "from phalanx.cli import main\n"
    "with contextlib.redirect_stdout(io.StringIO()):\n"
    "    code = main(['list'])\n"
    "print('torch' in sys.modules if code == 0 else 'exit %d' % code)\n"
)


# -- helpers -----------------------------------------------------------------------


def _load_write_distribution() -> Callable[..., Path]:
    """``phalanx_core.testing._distributions.write_distribution``, loaded from its
    file so that the ``phalanx_core.testing`` package (which imports pytest) is
    not imported; falls back to the ordinary import."""
    spec = importlib.util.find_spec("phalanx_core")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "testing" / "_distributions.py"
        if path.is_file():
            file_spec = importlib.util.spec_from_file_location("_phalanx_bench_distributions", path)
            if file_spec is not None and file_spec.loader is not None:
                module = importlib.util.module_from_spec(file_spec)
                file_spec.loader.exec_module(module)
                return module.write_distribution  # type: ignore[no-any-return]
    from phalanx_core.testing._distributions import write_distribution

    return write_distribution


def make_plugins(root: Path, count: int) -> Path:
    """Write ``count`` plugin distributions into ``root`` and return it. Each is a
    package ``x_<i>`` whose ``x_<i>.plugin`` module (the entry point) gives one
    collective ``c<i>``."""
    write_distribution = _load_write_distribution()
    for i in range(count):
        write_distribution(
            root,
            f"phalanx-bench-plugin-{i}",
            version="1.0.0",
            entry_points={f"bench{i}": f"x_{i}.plugin"},
            modules={
                f"x_{i}": "",
                f"x_{i}.plugin": PLUGIN_SOURCE.format(i=i),
                f"x_{i}.impl": IMPL_SOURCE,
            },
        )
    return root


def child_env(pythonpath: Path | None = None, pycache: Path | None = None) -> dict[str, str]:
    """The environment of a child: this one without :data:`SCRUB`; with
    ``pycache``, bytecode is written to and read from that folder (and
    ``PYTHONDONTWRITEBYTECODE`` is dropped), so that nothing is compiled
    from source after the warm-up and nothing is written next to the sources."""
    env = {k: v for k, v in os.environ.items() if k not in SCRUB}
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    return env


@dataclass
class Command:
    key: str
    label: str
    argv: list[str]
    env: dict[str, str]
    samples: list[float] = field(default_factory=list)  # ms
    base: list[float] = field(default_factory=list)  # ms, the bare start right before each sample


@dataclass
class Probe:
    key: str
    label: str
    env: dict[str, str]
    expect_plugins: int | None = None
    import_ms: list[float] = field(default_factory=list)
    registry_ms: list[float] = field(default_factory=list)
    info: tuple[Any, ...] | None = None


def run_timed(argv: Sequence[str], env: dict[str, str], cwd: str) -> float:
    """Run ``argv`` once; return its wall time in ms. Raises on failure."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    elapsed = (time.perf_counter() - t0) * 1e3
    if proc.returncode != 0:
        raise SystemExit(
            f"command failed with exit code {proc.returncode}: {' '.join(argv)}\n"
            f"{proc.stderr.decode(errors='replace')}"
        )
    return elapsed


def run_output(argv: Sequence[str], env: dict[str, str], cwd: str) -> str:
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"command failed with exit code {proc.returncode}: {' '.join(argv)}\n{proc.stderr}")
    return proc.stdout.strip()


def stats(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def find_console_script(python: str) -> str | None:
    folder = Path(python).parent
    for name in ("phalanx", "phalanx.exe"):
        path = folder / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


# -- the benchmark -------------------------------------------------------------------


def bench(args: argparse.Namespace) -> dict[str, Any]:
    python = args.python
    counts = [int(c) for c in args.plugins.split(",") if c.strip()]
    tmp = Path(tempfile.mkdtemp(prefix="phalanx-bench-"))
    cwd = tmp / "cwd"  # an empty working directory: `-c` and `-m` put it on sys.path
    cwd.mkdir()
    progress = not args.json and sys.stderr.isatty()
    try:
        pycache = None if args.env_bytecode else tmp / "pycache"
        plain = child_env(pycache=pycache)
        plugin_dirs = {n: make_plugins(tmp / f"plugins-{n}", n) for n in counts}

        baseline = [python, "-c", "pass"]
        commands = [
            Command("import", "python -c 'import phalanx'", [python, "-c", "import phalanx"], plain),
            Command(
                "registry",
                "python -c 'import phalanx; phalanx.Registry()'",
                [python, "-c", "import phalanx; phalanx.Registry()"],
                plain,
            ),
            Command("list_m", "python -m phalanx list", [python, "-m", "phalanx", "list"], plain),
        ]
        script = find_console_script(python)
        if script is not None:
            commands.append(Command("list_script", "phalanx list (console script)", [script, "list"], plain))
        for n, folder in plugin_dirs.items():
            commands.append(
                Command(
                    f"registry_{n}",
                    f"Registry() + {n} plugins",
                    [python, "-c", "import phalanx; phalanx.Registry()"],
                    child_env(folder, pycache),
                )
            )
        probes = [Probe("registry", "in-repo plugins", plain)]
        for n, folder in plugin_dirs.items():
            probes.append(
                Probe(f"registry_{n}", f"+ {n} plugins", child_env(folder, pycache), expect_plugins=n)
            )

        # Warm up: the page cache, and the bytecode cache (at least one round when it starts empty).
        for _ in range(max(args.warmup, 0 if pycache is None else 1)):
            run_timed(baseline, plain, str(cwd))
            for cmd in commands:
                run_timed(cmd.argv, cmd.env, str(cwd))
            for probe in probes:
                run_output([python, "-c", PROBE], probe.env, str(cwd))

        for round_ in range(args.repeat):
            if progress:
                print(f"\rround {round_ + 1}/{args.repeat}", end="", file=sys.stderr, flush=True)
            for cmd in commands:
                cmd.base.append(run_timed(baseline, cmd.env if args.baseline_env else plain, str(cwd)))
                cmd.samples.append(run_timed(cmd.argv, cmd.env, str(cwd)))
            for probe in probes:
                out = run_output([python, "-c", PROBE], probe.env, str(cwd))
                imp, reg, *info = ast.literal_eval(out)  # the tuple PROBE prints
                probe.import_ms.append(imp)
                probe.registry_ms.append(reg)
                probe.info = tuple(info)
        if progress:
            print("\r" + " " * 30 + "\r", end="", file=sys.stderr, flush=True)

        torch = {
            "import phalanx": run_output([python, "-c", TORCH_IMPORT], plain, str(cwd)),
            "Registry()": run_output([python, "-c", TORCH_REGISTRY], plain, str(cwd)),
            "phalanx list": run_output([python, "-c", TORCH_LIST], plain, str(cwd)),
        }
    finally:
        if args.keep:
            print(f"kept the generated plugins in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    all_base = [b for cmd in commands for b in cmd.base]
    rows: list[dict[str, Any]] = []
    for cmd in commands:
        s, b = stats(cmd.samples), stats(cmd.base)
        paired = [x - y for x, y in zip(cmd.samples, cmd.base, strict=True)]
        rows.append(
            {
                "key": cmd.key,
                "command": cmd.label,
                "argv": cmd.argv[1:] if cmd.argv[0] == python else cmd.argv,
                "ms": s,
                "bare_ms": b,
                "above_bare_ms": s["median"] - b["median"],
                "above_bare_paired_median_ms": statistics.median(paired),
                "above_bare_min_ms": s["min"] - b["min"],
                "ratio": s["median"] / b["median"],
                "ratio_min": s["min"] / b["min"],
                **({"samples_ms": cmd.samples, "bare_samples_ms": cmd.base} if args.samples else {}),
            }
        )
    in_process: list[dict[str, Any]] = []
    for probe in probes:
        n_plugins, loaded, failed, n_entries, torch_loaded = probe.info or (0, 0, [], 0, None)
        in_process.append(
            {
                "key": probe.key,
                "label": probe.label,
                "import_phalanx_ms": stats(probe.import_ms),
                "registry_ms": stats(probe.registry_ms),
                "plugins": n_plugins,
                "loaded": loaded,
                "failed": failed,
                "entries": n_entries,
                "extra_plugins_expected": probe.expect_plugins,
                "torch_imported": torch_loaded,
            }
        )

    by_key = {r["key"]: r for r in rows}
    by_probe = {p["key"]: p for p in in_process}
    verdicts = []
    if "import" in by_key:
        above = by_key["import"]["above_bare_ms"]
        verdicts.append(
            {
                "goal": f"{by_key['import']['command']} within {IMPORT_GOAL_S * 1e3:.0f} ms of a bare start",
                "measured_ms": above,
                "limit_ms": IMPORT_GOAL_S * 1e3,
                "pass": above <= IMPORT_GOAL_S * 1e3,
            }
        )
    for key in ("list_m", "list_script"):
        if key in by_key:
            above = by_key[key]["above_bare_ms"]
            verdicts.append(
                {
                    "goal": f"{by_key[key]['command']} within {LIST_GOAL_S * 1e3:.0f} ms of a bare start",
                    "measured_ms": above,
                    "limit_ms": LIST_GOAL_S * 1e3,
                    "pass": above <= LIST_GOAL_S * 1e3,
                }
            )
    n = DISCOVERY_GOAL_PLUGINS
    if f"registry_{n}" in by_probe:
        reg = by_probe[f"registry_{n}"]["registry_ms"]["median"]
        verdicts.append(
            {
                "goal": f"{n} plugins discovered (Registry() in-process) "
                f"under {DISCOVERY_GOAL_S * 1e3:.0f} ms",
                "measured_ms": reg,
                "limit_ms": DISCOVERY_GOAL_S * 1e3,
                "pass": reg < DISCOVERY_GOAL_S * 1e3,
            }
        )
        above = by_key[f"registry_{n}"]["above_bare_ms"]
        verdicts.append(
            {
                "goal": f"{n} plugins: whole `import phalanx; Registry()` process, above a bare start, "
                f"under {DISCOVERY_GOAL_S * 1e3:.0f} ms (stricter reading)",
                "measured_ms": above,
                "limit_ms": DISCOVERY_GOAL_S * 1e3,
                "pass": above < DISCOVERY_GOAL_S * 1e3,
            }
        )
    broken = [
        p
        for p in in_process
        if p["failed"]
        or (p["extra_plugins_expected"] is not None and p["loaded"] < p["extra_plugins_expected"])
    ]
    return {
        "python": python,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "repeat": args.repeat,
        "warmup": args.warmup,
        "bytecode": (
            "as the environment says: PYTHONDONTWRITEBYTECODE="
            + os.environ.get("PYTHONDONTWRITEBYTECODE", "")
            + ", PYTHONPYCACHEPREFIX="
            + os.environ.get("PYTHONPYCACHEPREFIX", "")
            if args.env_bytecode
            else "cached (PYTHONPYCACHEPREFIX in the temporary folder, written during the warm-up)"
        ),
        "bare_start_ms": stats(all_base),
        "commands": rows,
        "in_process": in_process,
        "torch_imported": torch,
        "verdicts": verdicts,
        "all_plugins_loaded": not broken,
    }


# -- output ----------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            f"{c:>{widths[i]}}" if i in right else f"{c:<{widths[i]}}" for i, c in enumerate(cells)
        ).rstrip()

    print(line(header))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))


def report(result: dict[str, Any]) -> None:
    base = result["bare_start_ms"]
    print(
        f"phalanx discovery benchmark: {result['python']} (Python {result['python_version']}, "
        f"{result['platform']}, {result['cpus']} CPUs)"
    )
    print(
        f"{result['repeat']} runs each (+{result['warmup']} warm-up), interleaved with a bare start; "
        f"bare start `python -c pass`: median {base['median']:.1f} ms, min {base['min']:.1f} ms"
    )
    print(f"bytecode: {result['bytecode']}")
    print()
    table: list[list[str]] = []
    for r in result["commands"]:
        table.append(
            [
                r["command"],
                f"{r['ms']['median']:.1f}",
                f"{r['ms']['min']:.1f}",
                f"{r['bare_ms']['median']:.1f}",
                f"{r['above_bare_ms']:+.1f}",
                f"{r['above_bare_min_ms']:+.1f}",
                f"{r['ratio']:.2f}x",
            ]
        )
    _table(
        ["command (fresh process)", "median ms", "min ms", "bare ms", "above bare", "above (min)", "x bare"],
        table,
        right={1, 2, 3, 4, 5, 6},
    )
    print()
    table = []
    for p in result["in_process"]:
        status = f"{p['loaded']}/{p['plugins']} loaded"
        if p["failed"]:
            status += f", {len(p['failed'])} FAILED"
        table.append(
            [
                p["label"],
                f"{p['import_phalanx_ms']['median']:.1f}",
                f"{p['registry_ms']['median']:.1f}",
                f"{p['registry_ms']['min']:.1f}",
                status,
                str(p["entries"]),
            ]
        )
    _table(
        ["in-process (perf_counter)", "import ms", "Registry() ms", "min ms", "plugins", "parts"],
        table,
        right={1, 2, 3, 5},
    )
    for p in result["in_process"]:
        for failure in p["failed"][:3]:
            print(f"  failed: {failure}")
    print()
    print(
        "torch imported by: "
        + ", ".join(
            f"{k}: {'YES' if v == 'True' else 'no' if v == 'False' else v}"
            for k, v in result["torch_imported"].items()
        )
    )
    print()
    print("verdict:")
    for v in result["verdicts"]:
        mark = "PASS" if v["pass"] else "FAIL"
        print(f"  [{mark}] {v['goal']}: {v['measured_ms']:.1f} ms (goal {v['limit_ms']:.0f} ms)")
    if not result["all_plugins_loaded"]:
        print("  [WARN] not every generated plugin loaded; the discovery figures are not meaningful")
    if any(v == "True" for v in result["torch_imported"].values()):
        print("  [FAIL] torch is imported by import/Registry()/list")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per command (default 20)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed rounds first (default 1; at least 1 unless --env-bytecode)",
    )
    parser.add_argument(
        "--plugins", default="50,200", help="comma-separated counts of generated plugins (default 50,200)"
    )
    parser.add_argument("--python", default=sys.executable, help="interpreter to measure (default: this one)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--samples", action="store_true", help="include every sample in --json output")
    parser.add_argument(
        "--baseline-env",
        action="store_true",
        help="take each row's bare start with that row's environment (PYTHONPATH) rather than a clean one",
    )
    parser.add_argument(
        "--env-bytecode",
        action="store_true",
        help="leave PYTHONDONTWRITEBYTECODE / PYTHONPYCACHEPREFIX as they are (by default the "
        "children cache bytecode in a temporary PYTHONPYCACHEPREFIX, as an installed package has it)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the generated plugin folders (printed)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    result = bench(args)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
