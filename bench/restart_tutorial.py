"""PyTorch's fault-tolerance tutorial, adapted to measure recovery after a killed rank.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        bench/restart_tutorial.py --snapshot DIR/snapshot.pt --log-dir DIR
    python -m phalanx run --strategy ddp --accelerator cpu --devices 2 --max-restarts 1 \\
        bench/restart_tutorial.py --snapshot DIR/snapshot.pt --log-dir DIR

Source: pytorch/examples, ``distributed/ddp-tutorial-series/multigpu_torchrun.py``
and its ``datautils.py`` (BSD-3-Clause; the "Fault-tolerant Distributed
Training with torchrun" tutorial). Its structure is kept: ``ddp_setup()``
calls ``init_process_group`` from the environment the launcher sets, a
``Trainer`` wraps the model in DDP, rank 0 saves a snapshot
(``MODEL_STATE``, ``EPOCHS_RUN``) at the end of an epoch, and a restarted
rank loads it and goes on from ``EPOCHS_RUN``. As in the tutorial,
``EPOCHS_RUN`` is the epoch just finished, so a resumed job trains that
epoch again. Changed for the benchmark (``bench/restarts.py``) only:

* the CPU and the ``gloo`` backend (``LOCAL_RANK`` picks no device; DDP gets
  no ``device_ids``; no pinned memory);
* the data set is drawn from a ``torch.Generator`` with a fixed seed, and
  the model is seeded, so every run is the same;
* an MSE loss (the tutorial's regression target, ``torch.rand(1)``);
* each batch sleeps 50 ms (``--sleep``), so a run lasts ~10-20 s;
* the snapshot goes to ``--snapshot`` (the tutorial writes ``snapshot.pt``
  in the working directory whatever path it was given);
* ``--epochs`` (4) epochs of ``--batches`` (10) batches per rank, a
  snapshot after every epoch;
* rank 1 kills itself with ``SIGKILL`` at batch ``--kill-batch`` of epoch
  ``--kill-epoch`` on the first attempt only
  (``TORCHELASTIC_RESTART_COUNT == "0"``), after writing the time to
  ``LOG_DIR/kill``;
* each rank appends one line per event to ``LOG_DIR/rank<RANK>.log``:
  ``start``, every finished ``step`` and every finished ``epoch``, with the
  attempt (``TORCHELASTIC_RESTART_COUNT``), ``time.monotonic()`` and
  ``time.time()``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

ATTEMPT = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


class Events:
    """Appends ``<kind> <attempt> <epoch> <batch> <monotonic> <time>`` lines to a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, kind: str, epoch: int = -1, batch: int = -1) -> None:
        line = f"{kind} {ATTEMPT} {epoch} {batch} {time.monotonic():.6f} {time.time():.6f}\n"
        with open(self.path, "a") as f:
            f.write(line)


class MyTrainDataset(Dataset):
    """``datautils.MyTrainDataset``: ``size`` pairs (20 inputs, 1 target),
    drawn from a generator with a fixed seed."""

    def __init__(self, size: int, seed: int = 0) -> None:
        self.size = size
        generator = torch.Generator().manual_seed(seed)
        self.data = [
            (torch.rand(20, generator=generator), torch.rand(1, generator=generator)) for _ in range(size)
        ]

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int):
        return self.data[index]


def ddp_setup() -> None:
    init_process_group(backend="gloo")


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
        events: Events,
        args: argparse.Namespace,
    ) -> None:
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.events = events
        self.args = args
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = torch.nn.functional.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()
        time.sleep(self.args.sleep)

    def _maybe_die(self, epoch: int, batch: int) -> None:
        if (self.global_rank, epoch, batch, ATTEMPT) == (1, self.args.kill_epoch, self.args.kill_batch, "0"):
            with open(os.path.join(self.args.log_dir, "kill"), "w") as f:
                f.write(f"{time.monotonic():.6f} {time.time():.6f}\n")
            os.kill(os.getpid(), signal.SIGKILL)

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[RANK{self.global_rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for batch, (source, targets) in enumerate(self.train_data):
            self._maybe_die(epoch, batch)
            self._run_batch(source, targets)
            self.events.write("step", epoch, batch)
        self.events.write("epoch", epoch)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.global_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs(args: argparse.Namespace, world_size: int):
    train_set = MyTrainDataset(args.batches * args.batch_size * world_size)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))


def main(args: argparse.Namespace) -> None:
    events = Events(os.path.join(args.log_dir, f"rank{os.environ['RANK']}.log"))
    events.write("start")
    ddp_setup()
    dataset, model, optimizer = load_train_objs(args, int(os.environ["WORLD_SIZE"]))
    train_data = prepare_dataloader(dataset, args.batch_size)
    trainer = Trainer(model, train_data, optimizer, args.save_every, args.snapshot, events, args)
    trainer.train(args.epochs)
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the torchrun tutorial's job, with a rank killed once")
    parser.add_argument("--epochs", type=int, default=4, help="total epochs (default 4)")
    parser.add_argument("--save-every", type=int, default=1, help="snapshot every N epochs (default 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank (default 32)")
    parser.add_argument("--batches", type=int, default=10, help="batches per epoch and rank (default 10)")
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds each batch sleeps (default 0.05)")
    parser.add_argument("--kill-epoch", type=int, default=2, help="epoch in which rank 1 dies (default 2)")
    parser.add_argument("--kill-batch", type=int, default=5, help="batch at which rank 1 dies (default 5)")
    parser.add_argument("--snapshot", required=True, help="the snapshot file")
    parser.add_argument("--log-dir", required=True, help="folder of the rank logs and the kill time")
    main(parser.parse_args())
