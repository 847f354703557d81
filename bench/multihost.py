"""Two hosts made of network namespaces (phalanx_core.testing.hosts): what a
job across them costs and how fast it ends. Needs root and iproute2.

    python bench/multihost.py [--repeat 5] [--blocks 7] [--iters 20]

1. all_reduce of 16 MB over the hosts' link, one rank per host: the torch
   collective, which chooses the interface by itself, against plain
   torch.distributed with ``GLOO_SOCKET_IFNAME`` set by hand, in the same
   two processes, in alternating blocks (each block makes its group anew);
   the ratio is phalanx / plain. Goal: at most 1.05.
2. A rank's failure on host B to the end of ``phalanx run`` on host A (the
   failing rank prints the time it raises; the clocks are one machine's).
   Goal: under 5 s.
3. Plan mismatch to error: node 0 runs ddp, node 1 fsdp; time from the
   moment the later node has resolved its plan to the end of both nodes'
   ``phalanx run``. Goal: under 5 s.

This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "multihost" / "job.py"
SIZE = 4 * 1024 * 1024  # float32: 16 MB
MAIN = "192.168.77.1"  # node 0's address on the test bed


def _rank(args: argparse.Namespace) -> None:
    """One rank of part 1 (started on each host by the parent)."""
    import torch
    import torch.distributed as dist

    import phalanx

    rank = int(os.environ["RANK"])
    tensor = torch.ones(SIZE)
    port = int(os.environ["MASTER_PORT"])
    times: dict[str, list[float]] = {"plain": [], "phalanx": []}

    def timed(op) -> float:
        op()  # warm up
        start = time.perf_counter()
        for _ in range(args.iters):
            op()
        return (time.perf_counter() - start) / args.iters

    for block in range(args.blocks):
        for kind in ("plain", "phalanx") if block % 2 == 0 else ("phalanx", "plain"):
            os.environ["MASTER_PORT"] = str(port + 1 + len(times["plain"]) + len(times["phalanx"]))
            if kind == "plain":
                os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # by hand
                dist.init_process_group("gloo", rank=rank, world_size=2)
                times[kind].append(timed(lambda: dist.all_reduce(tensor)))
                dist.destroy_process_group()
                del os.environ["GLOO_SOCKET_IFNAME"]
            else:
                strategy = phalanx.resolve("ddp", accelerator="cpu", num_nodes=2, environment="variables")
                strategy.setup_environment()
                times[kind].append(timed(lambda s=strategy: s.all_reduce(tensor)))
                strategy.teardown()
                os.environ.pop("GLOO_SOCKET_IFNAME", None)  # the collective set it for its group
    if rank == 0:
        print("RESULT " + json.dumps(times), flush=True)


def _env(**extra: str) -> dict[str, str]:
    from phalanx_core.testing.processes import scheduler_free_environment

    return scheduler_free_environment(**extra)


def _all_reduce(bed, args: argparse.Namespace) -> None:
    processes = [
        host.popen(
            [sys.executable, __file__, "--rank", "--blocks", str(args.blocks), "--iters", str(args.iters)],
            env=_env(
                RANK=str(i),
                LOCAL_RANK="0",
                NODE_RANK=str(i),
                WORLD_SIZE="2",
                MASTER_ADDR=MAIN,
                MASTER_PORT="29700",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, host in enumerate(bed.hosts)
    ]
    outputs = [p.communicate(timeout=600) for p in processes]
    line = next((x for x in outputs[0][0].splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        print("all_reduce run failed:\n" + "\n".join(o[1][-3000:] for o in outputs))
        return
    times = json.loads(line[len("RESULT ") :])
    plain, mine = statistics.median(times["plain"]), statistics.median(times["phalanx"])
    ratios = sorted(m / p for m, p in zip(times["phalanx"], times["plain"], strict=True))
    print(
        f"all_reduce 16 MB over the link: plain (GLOO_SOCKET_IFNAME by hand) {plain * 1e3:.2f} ms, "
        f"phalanx (chosen) {mine * 1e3:.2f} ms; ratio of medians {mine / plain:.3f} "
        f"(per block {', '.join(f'{r:.3f}' for r in ratios)})"
    )


def _nodes(bed, flags: list[list[str]], script: list[str]) -> list[tuple[float, str]]:
    """Run ``phalanx run`` on both hosts; (time it ended, output) per node."""
    processes = []
    for node, host in enumerate(bed.hosts):
        command = [
            sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", "--devices", "1",
            "--num-nodes", "2", "--node-rank", str(node), "--main-address", "node0", "--main-port", "29611",
            *flags[node], str(JOB), *script,
        ]  # fmt: skip
        processes.append(
            host.popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    ended = []
    for process in processes:
        out, _ = process.communicate(timeout=300)
        ended.append((time.time(), out))
    return ended


def _stamp(text: str, marker: str) -> float | None:
    for line in text.splitlines():
        if marker in line:
            return float(line.split(marker, 1)[1].split()[0])
    return None


def _failure(bed, args: argparse.Namespace) -> None:
    delays = []
    for _ in range(args.repeat):
        ended = _nodes(bed, [["--strategy", "ddp"]] * 2, ["fail", "1"])
        failed_at = _stamp(ended[1][1], "PHALANX-FAILED-AT ")
        if failed_at is None:
            print("failure run did not fail as planned:\n" + ended[1][1][-3000:])
            return
        delays.append(ended[0][0] - failed_at)
    print(
        "rank 1 raises on host B -> phalanx run on host A has ended: median "
        f"{statistics.median(delays):.2f} s "
        f"(runs: {', '.join(f'{d:.2f}' for d in sorted(delays))})"
    )


def _mismatch(bed, args: argparse.Namespace) -> None:
    delays = []
    for _ in range(args.repeat):
        ended = _nodes(bed, [["--strategy", "ddp"], ["--strategy", "fsdp"]], ["train"])
        resolved = [_stamp(out, "PHALANX-RESOLVED-AT ") for _, out in ended]
        if None in resolved or "PlanMismatchError" not in ended[0][1]:
            print("mismatch run did not stop as planned:\n" + ended[0][1][-3000:])
            return
        delays.append(max(t for t, _ in ended) - max(r for r in resolved if r is not None))
    print(
        f"plans differ (ddp on node 0, fsdp on node 1) -> both nodes have ended: median "
        f"{statistics.median(delays):.2f} s (runs: {', '.join(f'{d:.2f}' for d in sorted(delays))})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs of parts 2 and 3")
    parser.add_argument("--blocks", type=int, default=7, help="blocks of part 1, per side")
    parser.add_argument("--iters", type=int, default=20, help="all_reduce calls per block")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args)
        return
    from phalanx_core.testing.hosts import TestBed, missing

    if missing() is not None:
        sys.exit(f"bench/multihost.py: {missing()}")
    with TestBed(2) as bed:
        _all_reduce(bed, args)
        _failure(bed, args)
        _mismatch(bed, args)


if __name__ == "__main__":
    main()
