"""Collectives through phalanx vs plain torch.distributed, measured in one run.

    python bench/collectives.py [--iters 200] [--repeat 7] [--json]

1. Per call, in the same two gloo processes: all_reduce of 1 float and of
   16 MB, broadcast and all_gather of 1 float — ``dist.<op>`` against the
   ``torch`` collective's, in interleaved blocks; the ratio is phalanx / plain.
2. Launch to the first completed all_reduce, 2 ranks: ``phalanx.resolve(
   "ddp_spawn", devices=2).launch(fn)`` against ``torch.multiprocessing.spawn``
   + ``init_process_group``.
   With mpi4py and mpirun: all_reduce of 1 float and of 16 MB in two ranks
   started by the ``mpirun`` launcher, plain mpi4py (``Allreduce`` in place
   on the tensor's buffer, and ``Iallreduce`` tested to a deadline: what
   plain code writes for a timeout) against the ``mpi`` collective, with
   torch's gloo group in the same ranks beside them; the ratio is
   phalanx / mpi4py.
3. A rank's crash to the caller's error: time from the moment a rank raises
   to ``WorkerFailedError`` in the caller, for the spawn and subprocess
   launchers.

Goals: every per-call ratio at most 1.05 (mpi: against mpi4py); launch at most 1.05x plain; crash
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
        (f"all_reduce {label}", numel, {"plain": lambda t: dist.all_reduce(t), "phalanx": coll.all_reduce})
        for label, numel in SIZES.items()
    ]
    cases.append(
        (
            "broadcast 1 float",
            1,
            {"plain": lambda t: dist.broadcast(t, 0), "phalanx": lambda t: coll.broadcast(t, 0)},
        )
    )
    cases.append(("all_gather 1 float", 1, {"plain": plain_all_gather, "phalanx": coll.all_gather}))
    results = _blocks(cases, iters, repeat, dist.barrier)
    if rank == 0:
        queue.put(results)
    coll.teardown()
    dist.destroy_process_group()


def _blocks(cases, iters: int, repeat: int, barrier) -> dict[str, dict[str, float]]:
    """Time each case's functions (``{label: fn}``) in blocks interleaved
    ABBA (rotated for three), per-call medians and minimums."""
    results = {}
    for name, numel, fns in cases:
        t = torch.ones(numel)
        n = iters if numel == 1 else max(5, iters // 20)
        for fn in fns.values():  # warm up each
            for _ in range(3):
                fn(t)
        times: dict[str, list[float]] = {key: [] for key in fns}
        order = list(fns.items())
        for block in range(repeat):
            for key, fn in order[block % len(order) :] + order[: block % len(order)]:
                barrier()
                start = time.perf_counter()
                for _ in range(n):
                    fn(t)
                times[key].append((time.perf_counter() - start) / n)
        results[name] = {
            **{k: statistics.median(v) for k, v in times.items()},
            **{f"{k}_min": min(v) for k, v in times.items()},
        }
    return results


def _mpi_per_call_fn(strategy, iters: int, repeat: int) -> dict[str, dict[str, float]]:
    """In each mpirun rank: plain mpi4py (blocking ``Allreduce`` in place on
    the tensor's buffer), the ``mpi`` collective, and torch's gloo group
    (which the ddp strategy made beside it)."""
    from mpi4py import MPI

    comm, coll = MPI.COMM_WORLD, strategy.collective

    def mpi4py_with_timeout(t: torch.Tensor, timeout: float = 1800.0) -> None:
        # What plain mpi4py code must write for an operation that can time
        # out (MPI has no timeout): the non-blocking call, tested to a deadline.
        request = comm.Iallreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM)
        if request.Test():
            return
        deadline = time.monotonic() + timeout
        while not request.Test():
            if time.monotonic() > deadline:
                raise TimeoutError("all_reduce")

    cases = [
        (
            f"all_reduce {label}",
            numel,
            {
                "mpi4py": lambda t: comm.Allreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM),
                "mpi4py_timeout": mpi4py_with_timeout,
                "phalanx": lambda t: coll.all_reduce(t),
                "gloo": lambda t: dist.all_reduce(t),
            },
        )
        for label, numel in SIZES.items()
    ]
    return _blocks(cases, iters, repeat, comm.Barrier)


def mpi_per_call(iters: int, repeat: int) -> dict[str, dict[str, float]] | None:
    """The mpi collective against plain mpi4py, in 2 ranks started by the
    mpirun launcher; None where mpi4py or mpirun is missing."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("mpi4py") is None or shutil.which("mpirun") is None:
        return None
    import phalanx

    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, collective="mpi", launcher="mpirun")
    return strategy.launch(_mpi_per_call_fn, iters, repeat)[0]


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
    parser.add_argument("--no-mpi", action="store_true", help="skip the mpi collective's table")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    calls = per_call(args.iters, args.repeat)
    mpi = None if args.no_mpi else mpi_per_call(args.iters, args.repeat)
    launches = launch_times(args.launch_repeat)
    crashes = crash_times(args.crash_repeat)
    added = added_python_work()
    report = {
        "per_call": calls,
        "mpi_per_call": mpi,
        "added_python_us": added,
        "launch": launches,
        "crash_to_error_s": crashes,
    }
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
    worst_mpi = None
    if mpi is None:
        print(
            "\nmpi: not measured (needs mpi4py and mpirun: pip install mpi4py; apt-get install openmpi-bin)"
        )
    else:
        print("\nmpi, 2 ranks under the mpirun launcher; blocks rotated")
        print(
            f"{'per call':<22} {'mpi4py us':>10} {'+timeout us':>12} {'phalanx us':>11} {'gloo us':>9} "
            f"{'median ratio':>13} {'best ratio':>11} {'vs +timeout':>12}"
        )
        worst_mpi = 0.0
        for name, t in mpi.items():
            ratio = t["phalanx"] / t["mpi4py"]
            best = t["phalanx_min"] / t["mpi4py_min"]
            worst_mpi = max(worst_mpi, ratio)
            print(
                f"{name:<22} {t['mpi4py'] * 1e6:>10.1f} {t['mpi4py_timeout'] * 1e6:>12.1f} "
                f"{t['phalanx'] * 1e6:>11.1f} {t['gloo'] * 1e6:>9.1f} {ratio:>13.3f} {best:>11.3f} "
                f"{t['phalanx'] / t['mpi4py_timeout']:>12.3f}"
            )
        print(
            "(mpi4py: blocking Allreduce, which cannot time out; +timeout: plain mpi4py's Iallreduce "
            "tested to a deadline, as the collective's contract asks)"
        )
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
    if worst_mpi is not None:
        verdict = "PASS" if worst_mpi <= 1.05 else "FAIL"
        print(
            f"  [{verdict}] mpi collective / plain mpi4py, worst median ratio {worst_mpi:.3f} (goal <= 1.05)"
        )
    slowest = max(crashes.values())
    print(f"  [{'PASS' if slowest < 5 else 'FAIL'}] slowest crash to error {slowest:.2f} s (goal < 5 s)")


if __name__ == "__main__":
    main()
