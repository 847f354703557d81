"""A training job that survives lost nodes: run on every host with
``phalanx run --num-nodes MIN:MAX --max-restarts N`` (or under ``torchrun``
directly, for ``bench/restarts_multihost.py``'s comparison).

    elastic_job.py OUT [SAMPLES [PAUSE]]

Trains 2 epochs over SAMPLES samples (default 96; batch 2 per rank),
waiting PAUSE seconds (default 0.1) after each step so that a test can
kill a host mid-training, and saves a checkpoint every 2 steps (in the
background). It resumes with ``strategy.resume`` from OUT/ckpt, which every
host shares. Every rank appends a line per step to OUT/seen-<host>-<rank>.txt:
``<restarts> <resumed step> <world size> <epoch> <step> <sample>...``
(a round is told apart by its restart count and the step it resumed from;
see :mod:`phalanx_core.testing.samples`). Rank 0 writes OUT/done.json at
the end (restarts, world, steps, host) and the final weights to
OUT/final.pt.

The ``<restarts>`` of every rank is rank 0's: under torchrun each node's
agent counts its own restarts, and the nodes of one round may disagree
(under ``phalanx run`` the count is the job's, the same everywhere). Every
rank also appends to OUT/times-<host>-<rank>.txt, once ``strategy.launch()``
has returned, a ``start`` line with the time its interpreter began this
file (before ``import torch``; a rank that fails in ``launch`` writes
none), then one ``step`` line per finished step::

    start <monotonic>
    step <restarts> <resumed step> <world size> <epoch> <step> <monotonic>

``time.monotonic()`` is one clock for every process of the machine, the
test bed's network namespaces included. Under ``phalanx run`` the strategy
comes from its flags; started by ``torchrun`` directly (no ``phalanx run``
in between) it is ``ddp`` on the CPU over this round's nodes
(``GROUP_WORLD_SIZE``).
"""

from __future__ import annotations

import time

STARTED = time.monotonic()

import json  # noqa: E402 - after the start time
import os  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import phalanx  # noqa: E402
from phalanx_core import CheckpointDirectory  # noqa: E402


def strategy_here():
    if os.environ.get("PHALANX_RUN_FLAGS") or "TORCHELASTIC_RUN_ID" not in os.environ:
        return phalanx.resolve()  # phalanx run: its flags
    return phalanx.resolve("ddp", accelerator="cpu", num_nodes=int(os.environ["GROUP_WORLD_SIZE"]))


def main() -> None:
    out = Path(sys.argv[1])
    samples = int(sys.argv[2]) if len(sys.argv) > 2 else 96
    pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1
    host = socket.gethostname()
    strategy = strategy_here()
    strategy.launch()
    times = open(out / f"times-{host}-{strategy.global_rank}.txt", "a")  # noqa: SIM115 - open until the end
    times.write(f"start {STARTED:.6f}\n")
    times.flush()
    torch.manual_seed(0)
    model, optimizer = strategy.setup(nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    x = torch.arange(samples * 3, dtype=torch.float32).reshape(samples, 3) / (samples * 3)
    data = TensorDataset(torch.arange(samples), x, x.sum(dim=1, keepdim=True))
    loader = strategy.setup_dataloader(DataLoader(data, batch_size=2, shuffle=True))
    checkpoints = CheckpointDirectory(out / "ckpt", keep=2)
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    step = resumed = strategy.resume(checkpoints, state)
    # Each torchrun agent counts its own restarts (a node whose ranks failed
    # counts one, a node that only saw the new round does not): rank 0's
    # count names the round on every rank.
    restarts = strategy.broadcast_object(strategy.restart_count, src=0)
    head = f"{restarts} {resumed} {strategy.world_size}"
    seen = open(out / f"seen-{host}-{strategy.global_rank}.txt", "a")  # noqa: SIM115 - open until the end
    for epoch in range(loader.epoch, 2):
        loader.set_epoch(epoch)
        for index, inputs, target in loader:
            step += 1
            optimizer.zero_grad()
            strategy.backward(nn.functional.mse_loss(model(inputs), target))
            strategy.optimizer_step(optimizer)
            seen.write(f"{head} {epoch} {step} {' '.join(map(str, index.tolist()))}\n")
            seen.flush()
            times.write(f"step {head} {epoch} {step} {time.monotonic():.6f}\n")
            times.flush()
            if step % 2 == 0:
                checkpoints.save(strategy, step, state, blocking=False)
            time.sleep(pause)
            while (out / "hold").exists():  # the test holds the job open (a host on its way in)
                time.sleep(0.05)
    strategy.save_checkpoint(out / "final.pt", {"model": model})
    if strategy.is_global_zero:
        done = {"restarts": strategy.restart_count, "world": strategy.world_size, "steps": step, "host": host}
        (out / "done.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main()
