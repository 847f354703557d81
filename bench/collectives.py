"""Collectives through phalanx vs plain torch.distributed, measured in one run.

    python bench/collectives.py [--iters 200] [--repeat 7] [--json]

1. Per call, in the same two gloo processes: all_reduce of 1 float and of
   16 MB, broadcast and all_gather of 1 float — ``dist.<op>`` against the
   ``torch`` collective's, in interleaved blocks; the ratio is phalanx / plain.
2. Launch to the first completed all_reduce, 2 ranks: ``phalanx.resolve(
   "ddp_spawn", devices=2).launch(fn)`` against ``torch.multiprocessing.spawn``
   + ``init_process_group``.
3. A rank's crash to the caller's error: time from the moment a rank raises
   to ``WorkerFailedError`` in the caller, for the spawn and subprocess
   launchers.

Goals: every per-call ratio at most 1.05; launch at most 1.05x plain; crash
to error under 5 s. This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = {"1 float": 1, "16 MB": 4 * 1024 * 1024}


def _port() -> int:
    # A benchmark's own rendezvous: a free port chosen once, before any rank starts.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _per_call_rank(rank: int, port: int, iters: int, repeat: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    from phalanx_torch.collectives import TorchCollective
    from phalanx_torch.environments import LocalEnvironment

    dist.init_process_group("gloo", rank=rank, world_size=2)
    coll = TorchCollective()
    coll.setup(LocalEnvironment())  # adopts the group: both paths use the same one

    def plain_all_gather(t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(2)]  # new tensors, as the contract returns
        dist.all_gather(out, t)
        return out

    cases = [
        (f"all_reduce {label}", numel, lambda t: dist.all_reduce(t), lambda t: coll.all_reduce(t))
        for label, numel in SIZES.items()
    ]
    cases.append(("broadcast 1 float", 1, lambda t: dist.broadcast(t, 0), lambda t: coll.broadcast(t, 0)))
    cases.append(("all_gather 1 float", 1, plain_all_gather, lambda t: coll.all_gather(t)))
    results = {}
    for name, numel, plain, ours in cases:
        t = torch.ones(numel)
        n = iters if numel == 1 else max(5, iters // 20)
        for fn in (plain, ours):  # warm up both
            for _ in range(3):
                fn(t)
        times: dict[str, list[float]] = {"plain": [], "phalanx": []}
        for block in range(repeat):
            pairs = (("plain", plain), ("phalanx", ours))
            for key, fn in pairs if block % 2 == 0 else pairs[::-1]:  # ABBA: no order bias
                dist.barrier()
                start = time.perf_counter()
                for _ in range(n):
                    fn(t)
                times[key].append((time.perf_counter() - start) / n)
        results[name] = {
            **{k: statistics.median(v) for k, v in times.items()},
            **{f"{k}_min": min(v) for k, v in times.items()},
        }
    if rank == 0:
        queue.put(results)
    coll.teardown()
    dist.destroy_process_group()


def added_python_work(number: int = 200_000) -> float:
    """Microseconds of Python the torch collective adds to an all_reduce call
    (op lookup, dtype checks, result handling), without the torch call:
    machine noise does not reach this figure."""
    import timeit

    from phalanx_torch.collectives import TorchCollective

    coll = TorchCollective()
    coll._world_size, coll._rank, coll._global_ranks = 2, 0, (0, 1)
    t = torch.ones(1)
    base = timeit.timeit(lambda: None, number=number)
    work = timeit.timeit(
        lambda: coll._done(None, *coll._reduce(t, "sum")[1:2], False, "all_reduce"), number=number
    )
    return (work - base) / number * 1e6


def per_call(iters: int, repeat: int) -> dict[str, dict[str, float]]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_per_call_rank, args=(_port(), iters, repeat, queue), nprocs=2, start_method="spawn")
    return queue.get()


def _plain_launch_rank(rank: int, port: int, t0: float, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1))
    if rank == 0:
        queue.put(time.time() - t0)
    dist.destroy_process_group()


def _phalanx_launch_fn(strategy, t0: float) -> float:
    strategy.all_reduce(torch.ones(1))
    return time.time() - t0


def launch_times(repeat: int) -> dict[str, float]:
    import phalanx

    plain, ours = [], []
    ctx = mp.get_context("spawn")
    for _ in range(repeat):
        queue = ctx.SimpleQueue()
        t0 = time.time()
        mp.start_processes(_plain_launch_rank, args=(_port(), t0, queue), nprocs=2, start_method="spawn")
        plain.append(queue.get())
        strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2)
        t0 = time.time()
        ours.append(strategy.launch(_phalanx_launch_fn, t0)[0])
    return {"plain": statistics.median(plain), "phalanx": statistics.median(ours)}


CRASH_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import phalanx

    def fn(strategy, stamp):
        strategy.barrier()
        if strategy.global_rank == 1:
            with open(stamp, "w") as f:
                f.write(repr(time.time()))
            raise RuntimeError("crash on purpose")
        strategy.barrier()  # rank 0 waits for a rank that is gone

    if __name__ == "__main__":
        launcher, stamp = sys.argv[1], sys.argv[2]
        strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher=launcher, timeout=60)
        try:
            strategy.launch(fn, stamp)
        except phalanx.WorkerFailedError as exc:
            if not os.environ.get("TORCHELASTIC_RUN_ID"):  # the caller, not a re-run rank
                print("ERROR_AT", repr(time.time()), "RANK", exc.rank, flush=True)
            sys.exit(0)
    """
)


def crash_times(repeat: int) -> dict[str, float]:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "crash.py")
        with open(script, "w") as f:
            f.write(CRASH_SCRIPT)
        for launcher in ("spawn", "subprocess"):
            samples = []
            for i in range(repeat):
                stamp = os.path.join(tmp, f"{launcher}{i}.stamp")
                out = subprocess.run(
                    [sys.executable, script, launcher, stamp], capture_output=True, text=True, timeout=120
                )
                line = next((x for x in out.stdout.splitlines() if x.startswith("ERROR_AT")), None)
                if line is None or not os.path.exists(stamp):
                    raise RuntimeError(
                        f"crash run with {launcher} gave no error:\n{out.stdout}\n{out.stderr}"
                    )
                with open(stamp) as f:
                    crashed = float(f.read())
                samples.append(float(line.split()[1]) - crashed)
            results[launcher] = statistics.median(samples)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--launch-repeat", type=int, default=5)
    parser.add_argument("--crash-repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    calls = per_call(args.iters, args.repeat)
    launches = launch_times(args.launch_repeat)
    crashes = crash_times(args.crash_repeat)
    added = added_python_work()
    report = {"per_call": calls, "added_python_us": added, "launch": launches, "crash_to_error_s": crashes}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"torch {torch.__version__}, gloo, 2 ranks, {os.cpu_count()} cpus")
    print("blocks interleaved ABBA; ratios of the medians of the blocks (best: of the fastest blocks)")
    print(f"{'per call':<22} {'plain us':>10} {'phalanx us':>11} {'median ratio':>13} {'best ratio':>11}")
    worst = 0.0
    for name, t in calls.items():
        ratio = t["phalanx"] / t["plain"]
        best = t["phalanx_min"] / t["plain_min"]
        worst = max(worst, ratio)
        print(
            f"{name:<22} {t['plain'] * 1e6:>10.1f} {t['phalanx'] * 1e6:>11.1f} {ratio:>13.3f} {best:>11.3f}"
        )
    print(f"Python work phalanx adds to a call, measured alone: {added:.2f} us")
    launch_ratio = launches["phalanx"] / launches["plain"]
    print(
        f"\nlaunch to first all_reduce: plain {launches['plain']:.3f} s, "
        f"phalanx {launches['phalanx']:.3f} s, ratio {launch_ratio:.3f}"
    )
    for launcher, seconds in crashes.items():
        print(f"crash to error ({launcher}): {seconds:.2f} s")
    print("\nverdict:")
    print(f"  [{'PASS' if worst <= 1.05 else 'FAIL'}] worst per-call median ratio {worst:.3f} (goal <= 1.05)")
    print(f"  [{'PASS' if launch_ratio <= 1.05 else 'FAIL'}] launch ratio {launch_ratio:.3f} (goal <= 1.05)")
    slowest = max(crashes.values())
    print(f"  [{'PASS' if slowest < 5 else 'FAIL'}] slowest crash to error {slowest:.2f} s (goal < 5 s)")


if __name__ == "__main__":
    main()
