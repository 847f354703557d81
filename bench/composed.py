"""Composed collectives (phalanx-compose) against the collective they wrap,
measured in the same ranks, in interleaved blocks.

    python bench/composed.py [--blocks 7] [--iters 10] [--rate 1gbit] [--no-hosts]

1. ``compressed`` (bf16 on the wire) against its inner ``torch`` collective
   (gloo), all_reduce of 16 MB of float32, 2 ranks on this machine
   (loopback: memory copies, where bytes cost little).
2. Needs root and iproute2: two hosts made of network namespaces
   (phalanx_core.testing.hosts), their link limited to ``--rate`` with
   ``tc tbf`` (a network where bytes dominate), 2 ranks on each host:
   a. ``compressed`` against its inner ``torch`` collective, across the hosts;
   b. ``hierarchical`` (intra and inter ``torch``: gloo within the host and
      across) against a flat all_reduce over all 4 ranks (its intra
      collective's group of every rank, the plain torch collective).

The ratio is composed / plain (below 1: faster). Goals (issue "Collectives
composed by name"): compressed at least 1.5x faster where bytes dominate;
hierarchical reported as measured.
   c. ``hierarchical`` with ``inter="mpi"`` (ranks started by mpirun across
      the hosts, through tests/multihost/netns_rsh.py) against the same flat
      all_reduce over gloo.
This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE = 4 * 1024 * 1024  # float32: 16 MB


def _blocks(strategy, plain, composed, blocks: int, iters: int) -> dict[str, list[float]]:
    """Seconds per all_reduce of 16 MB, per block, through each path."""
    import time

    import torch

    tensor = torch.ones(SIZE)
    times: dict[str, list[float]] = {"plain": [], "composed": []}
    for block in range(blocks):
        order = [("plain", plain), ("composed", composed)]
        for name, collective in order if block % 2 == 0 else order[::-1]:
            strategy.barrier()
            collective.all_reduce(tensor)  # warm up
            start = time.perf_counter()
            for _ in range(iters):
                collective.all_reduce(tensor)
            times[name].append((time.perf_counter() - start) / iters)
    return times


def compressed_fn(strategy, blocks: int, iters: int) -> dict[str, list[float]]:
    return _blocks(strategy, strategy.collective.inner, strategy.collective, blocks, iters)


def hierarchical_fn(strategy, blocks: int, iters: int) -> dict[str, list[float]]:
    if not strategy.collective.hierarchical:
        raise RuntimeError("hierarchical: one level only (the job is not on two nodes)")
    return _blocks(strategy, strategy.collective.intra, strategy.collective, blocks, iters)


def _report(what: str, times: dict[str, list[float]]) -> dict[str, float]:
    plain, composed = statistics.median(times["plain"]), statistics.median(times["composed"])
    ratios = sorted(c / p for c, p in zip(times["composed"], times["plain"], strict=True))
    print(
        f"{what}: plain {plain * 1e3:.2f} ms, composed {composed * 1e3:.2f} ms; ratio of medians "
        f"{composed / plain:.3f} ({plain / composed:.2f}x) "
        f"(per block {', '.join(f'{r:.3f}' for r in ratios)})",
        flush=True,
    )
    return {"plain_ms": plain * 1e3, "composed_ms": composed * 1e3, "ratio": composed / plain}


def on_loopback(args: argparse.Namespace) -> dict[str, float]:
    import phalanx

    strategy = phalanx.resolve(
        "ddp", accelerator="cpu", devices=2, launcher="spawn", collective="compressed", inner="torch"
    )
    times = strategy.launch(compressed_fn, args.blocks, args.iters)[0]
    return _report("compressed vs torch (gloo), 2 ranks on loopback", times)


def _rank(args: argparse.Namespace) -> None:
    """A rank under ``phalanx run`` on a test-bed host (part 2)."""
    import phalanx

    if phalanx.run_flags():
        strategy = phalanx.resolve()
    else:  # under mpirun: hierarchical with MPI across the hosts
        strategy = phalanx.resolve(
            "ddp", accelerator="cpu", devices=2, num_nodes=2, collective="hierarchical", inter="mpi"
        )
    fn = compressed_fn if args.rank == "compressed" else hierarchical_fn
    times = strategy.launch(fn, args.blocks, args.iters)
    if times[strategy.global_rank] is not None and strategy.global_rank == 0:
        print("RESULT " + json.dumps(times[0]), flush=True)


def across_hosts(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    from phalanx_core.testing.hosts import TestBed, missing
    from phalanx_core.testing.processes import scheduler_free_environment

    if missing() is not None:
        print(f"part 2 skipped: {missing()}")
        return {}
    found: dict[str, dict[str, float]] = {}
    with TestBed(2) as bed:
        for host in bed.hosts:
            host.run(["tc", "qdisc", "add", "dev", host.interface, "root", "tbf", "rate", args.rate,
                      "burst", "1mb", "latency", "100ms"], check=True)  # fmt: skip
        for part in ("compressed", "hierarchical", "hierarchical-mpi"):
            if part == "hierarchical-mpi":
                if shutil.which("mpirun") is None:
                    print("hierarchical (inter mpi) skipped: no mpirun")
                    continue
                agent = ROOT / "tests" / "multihost" / "netns_rsh.py"
                command = [
                    "mpirun", "--allow-run-as-root", "--bind-to", "none", "--host", "node0:2,node1:2",
                    "-np", "4", "--mca", "plm_rsh_agent", f"{sys.executable} {agent}",
                    "-x", "MASTER_ADDR=node0", sys.executable, __file__, "--rank", part,
                    "--blocks", str(args.blocks), "--iters", str(args.iters),
                ]  # fmt: skip
                hosts = ",".join(f"{host.name}={host.namespace}" for host in bed.hosts)
                environment = scheduler_free_environment(
                    PHALANX_NETNS_HOSTS=hosts, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"
                )
                done = bed.hosts[0].run(command, env=environment, cwd=ROOT, timeout=900)
                outputs = [(done.stdout, done.stderr)]
                _found(found, part, outputs, args)
                continue
            commands = [
                [sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", "--devices", "2",
                 "--num-nodes", "2", "--node-rank", str(node), "--main-address", "node0",
                 "--main-port", "29621", "--strategy", "ddp", "--collective", part, __file__,
                 "--rank", part, "--blocks", str(args.blocks), "--iters", str(args.iters)]
                for node in (0, 1)
            ]  # fmt: skip
            environment = scheduler_free_environment()
            processes = [
                host.popen(
                    command,
                    env=environment,
                    cwd=ROOT,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for host, command in zip(bed.hosts, commands, strict=True)
            ]
            outputs = [p.communicate(timeout=900) for p in processes]
            _found(found, part, outputs, args)
    return found


_WHAT = {
    "compressed": "compressed vs torch (gloo)",
    "hierarchical": "hierarchical (torch within, torch across) vs flat torch",
    "hierarchical-mpi": "hierarchical (torch within, mpi across; mpirun) vs flat torch",
}


def _found(found: dict[str, dict[str, float]], part: str, outputs: list[tuple[str, str]], args) -> None:
    line = next((x for x in outputs[0][0].splitlines() if "RESULT " in x), None)
    if line is None:
        print(f"{part} run failed:\n" + "\n".join(o[1][-3000:] for o in outputs))
        return
    times = json.loads(line.split("RESULT ", 1)[1])
    found[part] = _report(f"{_WHAT[part]}, 2 hosts x 2 ranks, link {args.rate}", times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=7, help="blocks per path")
    parser.add_argument("--iters", type=int, default=10, help="all_reduce calls per block")
    parser.add_argument("--rate", default="1gbit", help="the hosts' link rate (tc tbf)")
    parser.add_argument("--no-hosts", action="store_true", help="skip part 2")
    parser.add_argument("--rank", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    on_loopback(args)
    if not args.no_hosts:
        across_hosts(args)


if __name__ == "__main__":
    main()
