"""``ddp_ft``'s loader with DataLoader workers against ``ddp``'s (a
``DistributedSampler`` under the same DataLoader), on this host (CPU, gloo).

    python bench/ddp_ft_loader.py [--groups 2] [--steps 40] [--read 0.004] [--batch 16] [--workers 2]

Workload: a dataset whose every sample takes ``--read`` seconds to read
(sleep: a decode, a disk), ``--batch`` samples a batch, a small MLP; the
ranks' median time from one step's end to the next one's. Jobs, one
after the other: ``ddp_ft`` (``--groups`` groups of one rank) with
``num_workers=0`` and with ``--workers``, ``ddp`` (``--groups`` ranks)
with ``--workers``, and ``ddp_ft`` with ``--workers`` and reads that take
no time (the floor: its step without the reads). A step with no failure is read ahead by the workers
under ``ddp_ft`` as under ``ddp``; the ratio says what is left of the
difference. This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset
    import phalanx

    steps, read, batch, workers = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])

    class Slow(Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            time.sleep(read)
            return torch.randn(32, generator=torch.Generator().manual_seed(i))

    strategy = phalanx.resolve()
    strategy.launch()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    data = DataLoader(Slow(), batch_size=batch, shuffle=True, num_workers=workers)
    loader = strategy.setup_dataloader(data)
    last = None
    for step, x in enumerate(loader):
        if step == steps:
            break
        optimizer.zero_grad()
        strategy.backward(model(x).square().mean())
        strategy.optimizer_step(optimizer)
        now = time.perf_counter()
        if last is not None and step >= 5:
            print(f"GAP {now - last:.6f}", flush=True)
        last = now
    """
)


def run(
    folder: Path, flags: list[str], args: argparse.Namespace, workers: int, read: float | None = None
) -> float:
    command = [
        sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", *flags, str(folder / "train.py"),
        str(args.steps), str(args.read if read is None else read), str(args.batch), str(workers),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    gaps = [float(g) for g in re.findall(r"GAP ([\d.]+)", done.stdout)]
    if done.returncode != 0 or not gaps:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return statistics.median(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--read", type=float, default=0.004)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "train.py").write_text(SCRIPT)
        ft = ["--strategy", "ddp_ft", "--replica-groups", str(args.groups), "--devices", "1"]
        ft_none = run(folder, ft, args, 0)
        ft_workers = run(folder, ft, args, args.workers)
        ddp_workers = run(folder, ["--strategy", "ddp", "--devices", str(args.groups)], args, args.workers)
        ft_instant = run(folder, ft, args, args.workers, read=0.0)
    print(f"one batch read in the training process: about {args.read * args.batch:.3f} s")
    print(f"ddp_ft, num_workers=0: {ft_none:.4f} s a step (median)")
    print(f"ddp_ft, num_workers={args.workers}: {ft_workers:.4f} s a step")
    print(f"ddp,    num_workers={args.workers}: {ddp_workers:.4f} s a step")
    print(f"ddp_ft, num_workers={args.workers}, reads taking no time: {ft_instant:.4f} s a step (its floor)")
    print(f"ddp_ft workers / no workers: {ft_workers / ft_none:.3f}")
    print(f"ddp_ft workers / its floor: {ft_workers / ft_instant:.3f}")
    print(f"ddp_ft / ddp (both with workers): {ft_workers / ddp_workers:.3f}")


if __name__ == "__main__":
    main()
