"""The ``phalanx`` command line: ``list``, ``explain`` and ``run``.

``list`` imports no torch: it reads specs only (``--probe`` imports the
accelerators to ask the hardware). ``explain`` builds the plan's parts, as
``resolve`` does, so that it refuses what ``resolve`` refuses (which imports
their backends; ``--plan-only`` imports what choosing needs, and checks
less). ``run`` builds the strategy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from phalanx_core.errors import PhalanxError, WorkerFailedError
from phalanx_core.specs import CollectiveSpec, Kind, StrategySpec

from ._entry import Entry, backends, one_look
from ._registry import Registry

__all__ = ["main"]


def _availability(entry: Entry, probe: bool) -> tuple[bool, str]:
    missing = entry.missing()
    if missing:
        return False, f"needs {', '.join(missing)}: {entry.todo()}"
    if probe and entry.kind is Kind.ACCELERATOR:
        try:
            availability = entry.load().availability()
        except PhalanxError as exc:
            return False, str(exc)
        return availability.available, availability.reason
    return True, ""


def _capabilities(entry: Any) -> dict[str, list[str]]:
    """A collective's fault-tolerance capabilities, a strategy's needs of
    its collective (``phalanx list``); none for other parts."""
    spec = entry.spec
    if isinstance(spec, CollectiveSpec) and spec.fault_tolerance:
        return {"fault_tolerance": list(spec.fault_tolerance)}
    if isinstance(spec, StrategySpec) and spec.collective_needs:
        return {"collective_needs": list(spec.collective_needs)}
    return {}


def _table(rows: Sequence[tuple[str, ...]], out: TextIO) -> None:
    """Aligned columns; on a terminal, the last column is cut to its width."""
    if not rows:
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    room = _columns() if out.isatty() else 0
    for row in rows:
        cells = [f"{cell:<{widths[i]}}" for i, cell in enumerate(row[:-1])]
        line = "  ".join([*cells, row[-1]]).rstrip()
        if room and len(line) > room:
            line = line[: max(room - 1, sum(widths))] + "…"
        print(line, file=out)


def _columns() -> int:
    """The terminal's width, as ``shutil`` reads it (imported on a terminal only)."""
    import shutil

    return shutil.get_terminal_size((0, 0)).columns


def _available_cell(entry: Entry, ok: bool, why: str, probe: bool) -> str:
    """The AVAILABLE column, short: what is missing goes below the table."""
    if not ok:
        unmet = entry.unmet()  # the versions installed are said below the table
        return f"no: needs {', '.join(str(need) for need, _ in unmet)}" if unmet else "no (see below)"
    if entry.kind is Kind.ACCELERATOR and not probe:
        return "installed"  # its packages are here; --probe asks the hardware
    return "yes"


#: Seconds of an entry module's import that ``phalanx list`` points out.
SLOW_IMPORT = 0.5


def _list(args: argparse.Namespace, out: TextIO) -> int:
    with one_look():
        return _list_looked(args, out)


def _list_looked(args: argparse.Namespace, out: TextIO) -> int:
    registry = Registry()
    kinds = [Kind(args.kind)] if args.kind else list(Kind)
    parts = []
    for kind in kinds:
        for entry in sorted(registry.entries(kind), key=lambda e: e.name):
            ok, why = _availability(entry, args.probe)
            parts.append((entry, ok, why))
    if args.json:
        data = {
            "parts": [
                {
                    "kind": str(e.kind),
                    "name": e.name,
                    "qualified_name": e.qualified_name,
                    "plugin": e.provider.plugin,
                    "distribution": e.provider.distribution,
                    "version": e.provider.version,
                    "target": e.spec.target,
                    "summary": e.spec.summary,
                    "available": ok,
                    "reason": why,
                    "aliases": list(e.spec.aliases),
                    "priority": e.spec.priority,
                    **_capabilities(e),
                }
                for e, ok, why in parts
            ],
            "plugins": [p.to_dict() for p in registry.plugins],
            "backends": [b.to_dict() for b in backends([e for e, _, _ in parts])],
        }
        json.dump(data, out, indent=2)
        print(file=out)
        return 0
    rows: list[tuple[str, ...]] = [("KIND", "NAME", "FROM", "AVAILABLE", "SUMMARY")]
    for e, ok, why in parts:
        source = f"{e.provider.distribution} {e.provider.version}" if e.provider.distribution else "run time"
        summary = e.spec.summary + "".join(
            f" [{key.replace('_', ' ')}: {', '.join(names)}]" for key, names in _capabilities(e).items()
        )
        rows.append((str(e.kind), e.name, source, _available_cell(e, ok, why, args.probe), summary))
    _table(rows, out)
    found = backends([e for e, _, _ in parts])
    if found:
        print(file=out)
        for backend in found:
            print(backend.say(), file=out)
    unavailable: dict[tuple[str, str], set[str]] = {}
    for e, ok, why in parts:
        if not ok:
            unavailable.setdefault((e.provider.distribution or "run time", why), set()).add(e.name)
    if unavailable:
        print("\nnot available here:", file=out)
        for (source, why), names in sorted(unavailable.items()):
            print(f"  {', '.join(sorted(names))} ({source}): {why}", file=out)
    if not args.probe and any(e.kind is Kind.ACCELERATOR and ok for e, ok, _ in parts):
        print(
            "\naccelerators marked 'installed': their packages are here; `phalanx list --probe` asks "
            "the hardware whether they can be used",
            file=out,
        )
    for problem in registry.filter_problems:
        print(f"\n{problem}", file=out)
    print(file=out)
    rows = [("PLUGIN", "DISTRIBUTION", "STATUS", "HOOKS")]
    for p in registry.plugins:
        dist = f"{p.provider.distribution} {p.provider.version}" if p.provider.distribution else "-"
        hooks = ", ".join(h.removeprefix("phalanx_") for h in p.hooks) or "-"
        rows.append((p.provider.plugin, dist, p.status, hooks))
    _table(rows, out)
    for p in registry.plugins:
        if (p.import_seconds or 0.0) >= SLOW_IMPORT:
            print(
                f"\nslow: {p.provider}: its entry module {p.value!r} took {p.import_seconds:.1f} s to "
                "import, and every `phalanx list` and `resolve()` imports it. An entry module should "
                "import phalanx_core and give specs only, its backend imported by the parts' targets "
                f"when used (see 'Publish a plugin'); PHALANX_DISABLE_PLUGINS={p.provider.plugin} skips it",
                file=out,
            )
    problems = [p for p in registry.plugins if p.status != "loaded"]
    # Plugins disabled for one reason (not in PHALANX_PLUGINS) share a line.
    disabled: dict[str, list[str]] = {}
    for p in problems:
        if p.status == "disabled":
            disabled.setdefault(str(p.error), []).append(str(p.provider))
            continue
        print(f"\n{p.status}: {p.provider}: {p.error}", file=out)
        if args.verbose and p.traceback:
            print(p.traceback.rstrip(), file=out)
    for why, providers in disabled.items():
        print(f"\ndisabled ({why}): {', '.join(providers)}", file=out)
    if any(p.status == "failed" for p in problems) and not args.verbose:
        print("\n(run `phalanx list --verbose` for the tracebacks)", file=out)
    return 0


def _devices(value: str) -> Any:
    value = value.strip()
    if value.lstrip("-").isdigit():
        return int(value)
    return value


def _option(text: str) -> tuple[str, Any]:
    """``--option NAME=VALUE``: the value as a Python literal (``True``,
    ``3``, ``0.5``, ``'full'``, ``[1, 2]``; ``true`` / ``false`` / ``none``
    as JSON writes them), else the text itself."""
    import ast

    name, sep, raw = text.partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{text!r}: write an option as NAME=VALUE, e.g. --option find_unused_parameters=True"
        )
    lowered = raw.strip().lower()
    if lowered in {"true", "false", "none", "null"}:
        return name, {"true": True, "false": False}.get(lowered)
    try:
        return name, ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        return name, raw


def _options(pairs: Sequence[tuple[str, Any]] | None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for name, value in pairs or ():
        if name in options and options[name] != value:
            from phalanx_core.errors import MisconfigurationError

            raise MisconfigurationError(
                f"--option {name} is given twice, as {options[name]!r} and {value!r}; give it once"
            )
        options[name] = value
    return options


def _node_variables(args: argparse.Namespace) -> None:
    """``--node-rank``, ``--main-address``, ``--main-port``: the variables
    every environment reads them from."""
    for var, value in (
        ("NODE_RANK", args.node_rank),
        ("MASTER_ADDR", args.main_address),
        ("MASTER_PORT", args.main_port),
    ):
        if value is not None:
            os.environ[var] = str(value)


def _explain(args: argparse.Namespace, out: TextIO) -> int:
    _node_variables(args)
    registry = Registry()
    options = _options(args.option)
    num_nodes = _launch_options(args, options)
    plan = registry.plan(
        args.strategy,
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=1 if num_nodes is None else num_nodes,
        precision=args.precision,
        collective=args.collective,
        launcher=args.launcher,
        environment=args.environment,
        **options,
    )
    network = devices_here = None
    said: dict[str, str] = {}
    if not args.plan_only:
        # Every check resolve() runs: the parts' constructors (the backend
        # there, the accelerator's devices, the precision and the collective
        # against the accelerator, the collective against the launcher).
        strategy = registry.build(plan)
        devices_here = strategy.launcher.num_processes
        said = strategy.launcher.explain()
        describe = getattr(strategy.collective, "network", None)
        if callable(describe):
            world = strategy.launcher.num_processes * strategy.launcher.num_nodes
            environment = strategy.environment
            network = describe(environment.main_address, environment.main_port, world, strategy.accelerator)
    listens = _listens(registry, plan) if args.plan_only else strategy.launcher.listening()
    needed = backends(
        [Entry(c.spec, c.provider) for c in (*plan.parts(), *plan.composition) if c.spec and c.provider]
    )
    if args.json:
        document = {
            **plan.to_dict(),
            "backends": [b.to_dict() for b in needed],
            "devices_here": devices_here,
            "listens": listens,
            "network": network,
            "launcher_says": said,
            "built": not args.plan_only,
        }
        json.dump(document, out, indent=2)
        print(file=out)
    else:
        print(plan.explain(devices_here), file=out)
        for backend in needed:
            print(f"backend      {backend.say()}", file=out)
        if listens:
            print(f"listens on   {listens}", file=out)
        for label, line in said.items():
            print(f"{label:<12} {line}", file=out)
        if network:
            print(f"network      {network}", file=out)
        print(
            "checked      "
            + (
                "the choice of parts only (--plan-only): the parts were not built, so what their "
                "constructors refuse is not known yet"
                if args.plan_only
                else "everything resolve() checks; not the rendezvous, which needs the processes "
                "launch starts"
            ),
            file=out,
        )
    return 0


def _listens(registry: Registry, plan: Any) -> str | None:
    """What the plan's launcher says about where the job will listen
    (imports the launcher's module, which imports no backend)."""
    choice = plan.launcher
    if choice.instance is not None:
        cls = type(choice.instance)
    else:
        name = f"{choice.provider.distribution}:{choice.name}" if choice.provider else choice.name
        try:
            cls = registry.get(Kind.LAUNCHER, name).load()
        except PhalanxError:
            return None
    listens = getattr(cls, "listens", None)
    return listens(plan.num_nodes) if callable(listens) else None


#: ``phalanx run``'s flags that become the defaults of ``resolve()`` in the script.
_RUN_FLAGS = ("strategy", "accelerator", "devices", "num_nodes", "precision", "collective")


def _node_count(text: str) -> int | tuple[int, int]:
    """``--num-nodes``: N, or MIN:MAX."""
    low, colon, high = text.partition(":")
    try:
        counts = (int(low), int(high)) if colon else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of nodes, or MIN:MAX (2:4)") from None
    if not 1 <= counts[0] <= counts[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: give 1 <= MIN <= MAX, as in 2:4")
    return counts if colon else counts[0]


def _launch_options(args: argparse.Namespace, options: dict[str, Any]) -> int | None:
    """The launcher's options that ``run``'s and ``explain``'s flags set,
    added to ``options`` (refused where ``--option`` gave another value);
    the number of nodes (``MAX`` of ``--num-nodes MIN:MAX``), or ``None``
    where ``--num-nodes`` was not given."""
    given = args.num_nodes
    if isinstance(given, tuple):  # MIN:MAX
        low, high = given
        _give_option(options, "min_nodes", low, f"--num-nodes {low}:{high}")
    for flag in ("rendezvous", "max_restarts", "replica_groups", "lighthouse"):
        value = getattr(args, flag)
        if value is not None:
            _give_option(options, flag, value, f"--{flag.replace('_', '-')} {value}")
    if given is None:
        return None
    return int(given[1] if isinstance(given, tuple) else given)


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    """The flags of the job's shape and its launcher, as ``run`` and
    ``explain`` take them."""
    p.add_argument(
        "--num-nodes",
        type=_node_count,
        metavar="N|MIN:MAX",
        help="the number of nodes (default 1), or MIN:MAX: a job that goes on with at least MIN "
        "nodes after a restart and takes in nodes that join, up to MAX (with --max-restarts)",
    )
    p.add_argument(
        "--rendezvous",
        metavar="URL",
        help="where several nodes meet: c10d (default; node 0 hosts the store at --main-address) or "
        "etcd://HOST:PORT,HOST:PORT/NAME (an etcd cluster: losing any node, node 0's too, leaves "
        "the job running; etcd+https://...?cacert=PATH&cert=PATH&key=PATH&user=NAME over TLS, the "
        "password in PHALANX_ETCD_PASSWORD; the launcher's rendezvous option)",
    )
    p.add_argument("--node-rank", type=int, help="this node's rank (sets NODE_RANK)")
    p.add_argument("--main-address", help="node 0's address (sets MASTER_ADDR)")
    p.add_argument("--main-port", type=int, help="node 0's port (sets MASTER_PORT)")
    p.add_argument(
        "--max-restarts",
        type=int,
        metavar="N",
        help="restart every rank of the job, on every node, up to N times after a rank fails or "
        "a node is lost (the launcher's max_restarts option; default 0)",
    )
    p.add_argument(
        "--replica-groups",
        type=int,
        metavar="N",
        help="N replica groups of --devices ranks each, which a fault-tolerant strategy (ddp_ft, "
        "from phalanx-torchft) trains across: a group that fails is restarted alone while the "
        "others go on (the launcher's replica_groups option; --max-restarts is then per group)",
    )
    p.add_argument(
        "--lighthouse",
        metavar="URL",
        help="a running TorchFT lighthouse (http://HOST:PORT) for the replica groups of every host "
        "to use (the launcher's lighthouse option; default: phalanx run starts one, on node 0 "
        "on several hosts)",
    )


def _give_option(options: dict[str, Any], name: str, value: Any, flag: str) -> None:
    """A flag that sets the launcher's option ``name``; refused where
    ``--option`` gave another value."""
    if options.get(name, value) != value:
        from phalanx_core.errors import MisconfigurationError

        raise MisconfigurationError(f"{flag} and --option {name}={options[name]!r} disagree; give it once")
    options[name] = value


def _check_module(module: str) -> None:
    """Refuse ``-m MODULE`` whose top-level package no rank would find (on
    ``sys.path``, with the working directory first, as ``python -m`` puts
    it), before any rank starts. Nothing is imported: a package's
    submodules are the ranks' to find."""
    from importlib.machinery import PathFinder

    top = module.partition(".")[0]
    if not top.isidentifier() or (
        top not in sys.builtin_module_names and PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None
    ):
        from phalanx_core.errors import MisconfigurationError

        raise MisconfigurationError(
            f"-m {module}: no module {top!r} on the path the ranks search (the working directory "
            f"{os.getcwd()}, then PYTHONPATH and this Python's site-packages); check the name, run from "
            "the directory that holds it, or install its package"
        )


def _run(args: argparse.Namespace, out: TextIO) -> int:
    if not args.module and not os.path.isfile(args.script):
        from phalanx_core.errors import MisconfigurationError

        raise MisconfigurationError(
            f"no script at {args.script!r} (from {os.getcwd()}); give the path of a Python file, "
            "or -m MODULE for a module"
        )
    if args.module:
        _check_module(args.script)
    given: dict[str, Any] = {
        name: getattr(args, name) for name in _RUN_FLAGS if getattr(args, name) is not None
    }
    options = _options(args.option)
    num_nodes = _launch_options(args, options)
    if num_nodes is not None:
        given["num_nodes"] = num_nodes
    if options:
        given["options"] = options
    from phalanx_core.hangs import HANG_REPORT_VAR  # `phalanx run` only: `phalanx list` stays light

    from ._flags import RUN_FLAGS_VAR

    _node_variables(args)
    if args.hang_report is not None:
        os.environ[HANG_REPORT_VAR] = str(args.hang_report)
    # Set before resolving, so that the script's ranks inherit it and
    # ``phalanx.resolve()`` there gives this strategy.
    os.environ[RUN_FLAGS_VAR] = json.dumps(given)
    strategy = Registry().resolve(launcher=args.launcher)
    command = ["-m", args.script, *args.args] if args.module else [args.script, *args.args]
    launcher = strategy.launcher
    if not launcher.creates_processes:
        try:
            launcher.run_script(command)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except KeyboardInterrupt:
            return 130
        except Exception:  # noqa: BLE001 - the script's own error: its traceback, as python shows it
            import traceback

            traceback.print_exc()
            return 1
        return 0
    try:
        launcher.run_script(command)
    except WorkerFailedError as exc:
        print(f"phalanx run: {exc.first_failure()}. The other ranks were stopped.", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:
        print("phalanx run: interrupted (SIGINT); every rank was stopped.", file=sys.stderr)
        return 130
    except SystemExit as exc:  # the launcher stopped the ranks on a signal: 128 + its number
        code = exc.code if isinstance(exc.code, int) else 1
        if code > 128:
            print(
                f"phalanx run: stopped by {_signal_name(code - 128)}; every rank was stopped.",
                file=sys.stderr,
            )
        return code
    return 0


def _signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _version() -> str:
    from . import __version__

    return __version__


_OPTION_HELP = (
    "an option of a part, as resolve() takes it (repeatable): --option find_unused_parameters=True "
    "--option timeout=600; the value is a Python literal, else text"
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="phalanx", description="Names to composed distributed-training strategies."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("list", help="every part of every installed plugin, and the plugins")
    p.add_argument("--kind", choices=[str(k) for k in Kind], help="only parts of this kind")
    p.add_argument("--json", action="store_true", help="JSON for scripts")
    p.add_argument(
        "--probe",
        action="store_true",
        help="import the accelerators and ask the hardware (imports their backends)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="tracebacks of failed plugins")
    p.set_defaults(run=_list)
    p = sub.add_parser("explain", help="the plan for a set of flags, with the reason for each part")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--devices", type=_devices, default="auto", help="N, -1, 'auto' or '0,2'")
    _add_launch_flags(p)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--collective")
    p.add_argument("--launcher")
    p.add_argument("--environment")
    p.add_argument("-o", "--option", type=_option, action="append", metavar="NAME=VALUE", help=_OPTION_HELP)
    p.add_argument("--json", action="store_true", help="JSON for scripts")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="choose the parts without building them (imports no backend; checks less than resolve)",
    )
    p.set_defaults(run=_explain)
    p = sub.add_parser(
        "run",
        help="run a script on every rank of a strategy, like torchrun for every strategy",
        description="Start the ranks the strategy needs and run SCRIPT in each; inside it, "
        "phalanx.resolve() with no arguments gives this strategy. Each output line of a rank "
        "starts with [rankN]:. A flag given here and a different value given to resolve() in "
        "the script is an error.",
    )
    p.add_argument("--strategy", help="a strategy name (default: 'auto')")
    p.add_argument("--accelerator", help="an accelerator name (default: 'auto')")
    p.add_argument("--devices", type=_devices, help="devices per node: N, -1, 'auto' or '0,2'")
    _add_launch_flags(p)
    p.add_argument("--precision", help="a precision name (default: '32-true')")
    p.add_argument("--collective", help="a collective name (default: the strategy's)")
    p.add_argument("--launcher", help="a launcher name (default: the strategy's)")
    p.add_argument("-o", "--option", type=_option, action="append", metavar="NAME=VALUE", help=_OPTION_HELP)
    p.add_argument(
        "--hang-report",
        type=float,
        metavar="SECONDS",
        help="seconds an operation may wait before every rank reports where it is (default 300; 0: never)",
    )
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module, as python -m runs it")
    p.add_argument("script", metavar="SCRIPT")
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")
    p.set_defaults(run=_run)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line; return the exit code (1 for a phalanx error,
    with its message on stderr). As the program itself (``argv`` not
    given), ``run`` ends the process with that code instead of returning."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.run(args, out or sys.stdout)
    except PhalanxError as exc:
        print(f"phalanx {args.command}: error: {exc}", file=sys.stderr)
        code = 1
    except BrokenPipeError:  # `phalanx list | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141  # 128 + SIGPIPE, as a shell reports it
    if argv is None and args.command == "run":
        # The program itself (the console script, python -m phalanx), not a
        # caller: end without the interpreter's finalization, in which
        # tearing torch's modules down takes 0.3-0.8 s (see exit_process).
        from phalanx_core.launching import exit_process

        exit_process(code)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
