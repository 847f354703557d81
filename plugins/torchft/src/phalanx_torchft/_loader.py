"""``ddp_ft``'s loader: each step's samples split over the groups in that
step's quorum, so that a dropped group's samples go to the others."""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterator, Mapping
from typing import Any

from phalanx_core import MisconfigurationError

__all__ = ["QuorumLoader"]


class QuorumLoader:
    """The loader ``ddp_ft``'s ``setup_dataloader`` returns.

    The job reads each epoch's order (the dataset shuffled with seed
    ``epoch``, as ``DistributedSampler`` shuffles it, or in order) from a
    position the groups share. A step takes the next ``P x R x B`` samples,
    where ``P`` is the number of groups taking part in the step (its
    quorum, known when the step starts), ``R`` the ranks of a group and
    ``B`` the loader's batch size, and deals them out as
    ``DistributedSampler`` deals an epoch: rank ``r`` of the ``p``-th group
    in the step gets every ``P x R``-th sample from ``p x R + r`` on.

    The position moves only when TorchFT commits the step. A step that is
    dropped (a group was lost in it) gives back its samples: the next step
    deals them out again, over the groups that are left. A group that heals
    takes its peers' position with their weights. So each sample of an
    epoch is in exactly one committed step, except at the epoch's end:
    where the last samples do not fill a step, every rank of it gets the
    same smaller batch and a few samples from the epoch's start fill the
    last batches (fewer than ``P x R``; ``drop_last`` drops the samples that
    do not fill a batch on every rank instead).

    A group that heals is given a batch it does not train on (TorchFT
    zeroes its gradients in that step) and takes its peers' position with
    their weights.

    Iterating gives the rest of the job's current epoch, then the loader
    moves to the next one: :attr:`epoch` is the job's epoch (a healed group
    takes it from its peers), so a loop over epochs is ``while loader.epoch
    < epochs: for batch in loader: ...``. The state (:meth:`state_dict`,
    for checkpoints) is that of phalanx's other loaders: a checkpoint of a
    ``ddp`` job goes on under ``ddp_ft`` and the other way round.

    With ``num_workers=0`` a step's batch is read in the training process
    when the step starts: its samples are not known before its quorum. With
    workers, the batches of the next steps are read ahead on the guess that
    they have the quorum of the step in hand and are committed (the common
    case: a step changes only when a group is lost or comes back); a step
    whose samples are not those guessed (a dropped step, a lost group, a
    healed position, a new epoch) has its workers' reads thrown away and
    read again from where the job is. The workers are the DataLoader's own
    (its ``num_workers``, ``prefetch_factor``, ``worker_init_fn``,
    ``multiprocessing_context``, ``pin_memory``, ``timeout``), kept for the
    whole job. :attr:`rereads` counts the steps read again.
    """

    def __init__(self, strategy: Any, loader: Any, *, move: bool = True) -> None:
        # strategy: the DDPFTStrategy (not imported: it imports this module)
        _check(loader)
        self.loader = loader
        self.dataset = loader.dataset
        self.batch_size = int(loader.batch_size)
        self.drop_last = bool(loader.drop_last)
        self.shuffle = type(loader.sampler).__name__ == "RandomSampler"
        self.seed = 0  # DistributedSampler's, so that a ddp job's order goes on here
        self._strategy = strategy
        self._move = move
        self._collate = loader.collate_fn
        self.epoch = 0
        #: Samples of the epoch's order taken by committed steps.
        self.position = 0
        self._pending: list[int] = []  # participants of each step handed out since the last verdict
        self._rolled = False  # the epoch ended in this iteration
        #: Steps whose batch the workers had read for other samples, read again.
        self.rereads = 0
        self._reader = _Reader(self, loader) if loader.num_workers > 0 else None

    # -- the training loop's side ---------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        self._rolled = False
        while True:
            batch = self._next()
            if batch is None:
                return
            yield batch

    def __len__(self) -> int:
        """Steps left in the epoch if every group takes part in each."""
        step = self._strategy.replica_groups * self._strategy.world_size * self.batch_size
        return -(-(len(self.dataset) - self.position) // step)

    def set_epoch(self, epoch: int) -> None:
        raise MisconfigurationError(
            f"loader.set_epoch({epoch}) under 'ddp_ft': the loader keeps the job's epoch itself "
            "(loader.epoch; a group that heals takes it from its peers, where a script's own count "
            "would start again at 0). Leave set_epoch out and loop with "
            "'while loader.epoch < epochs: for batch in loader: ...'"
        )

    def _next(self) -> Any | None:
        if self._rolled:
            self._rolled = False
            return None
        strategy = self._strategy
        ranks = strategy.world_size
        start = self._after_pending()
        if start >= len(self.dataset):
            self._end_epoch()  # what was handed out and never stepped on (an evaluation) is done
            return None
        strategy._open_step()
        manager = strategy.manager
        participants = max(strategy.participants, 1)  # waits for the quorum
        mine = manager.participating_rank() or 0
        share = self._share(start, participants, mine * ranks + strategy.global_rank)
        if not share:  # drop_last: fewer samples left than ranks in the step
            self._end_epoch()
            return None
        self._pending.append(participants)
        if self._reader is not None:
            batch = self._reader.batch((self.epoch, start, participants, mine * ranks + strategy.global_rank))
        else:
            batch = self._collate([self.dataset[i] for i in share])
        return strategy.batch_to_device(batch) if self._move else batch

    # -- the step's verdict (from the strategy) ---------------------------------

    def _settle(self, committed: bool) -> None:
        """The step's samples are taken (``committed``), or given back."""
        if committed:
            self.position = self._after_pending()
            if self.position >= len(self.dataset):
                self._end_epoch()
                self._rolled = True
        self._pending.clear()

    def _end_epoch(self) -> None:
        self.epoch += 1
        self.position = 0
        self._pending.clear()

    # -- the deal ------------------------------------------------------------------

    def _take(self, start: int, participants: int) -> int:
        """Where the next step starts after one from ``start``."""
        left = len(self.dataset) - start
        step = participants * self._strategy.world_size * self.batch_size
        return start + step if left > step else len(self.dataset)

    def _after_pending(self) -> int:
        position = self.position
        for participants in self._pending:
            position = self._take(position, participants)
        return position

    def _share(self, start: int, participants: int, index: int) -> list[int]:
        return self._share_of(self.epoch, start, participants, index)

    def _share_of(self, epoch: int, start: int, participants: int, index: int) -> list[int]:
        ranks = participants * self._strategy.world_size
        chunk = self._order(epoch)[start : start + ranks * self.batch_size]
        if len(chunk) < ranks * self.batch_size:  # the epoch's last step
            if self.drop_last:
                chunk = chunk[: len(chunk) // ranks * ranks]
            else:
                order = self._order(epoch)
                total = -(-len(chunk) // ranks) * ranks
                chunk = chunk + (order * (total // len(order) + 1))[: total - len(chunk)]
        return chunk[index::ranks]

    @functools.lru_cache(maxsize=2)  # noqa: B019 - one loader, two epochs at most
    def _order(self, epoch: int) -> list[int]:
        import torch

        count = len(self.dataset)
        if not self.shuffle:
            return list(range(count))
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return [int(i) for i in torch.randperm(count, generator=generator).tolist()]

    # -- state ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, int]:
        """The job's place: ``{"epoch", "position", "samples"}`` (as phalanx's
        other loaders save it)."""
        return {"epoch": self.epoch, "position": self.position, "samples": len(self.dataset)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved place (a checkpoint of this loader or of a
        ``ddp`` job's)."""
        if state.get("samples") != len(self.dataset):
            raise MisconfigurationError(
                f"the checkpoint's loader position is in a dataset of {state.get('samples')} samples, and "
                f"this loader's dataset has {len(self.dataset)}: load it into a loader of the same data, "
                "or leave the loader out of the state you load"
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._rolled = False

    def _heal(self, state: Mapping[str, Any]) -> None:
        """A peer's place, copied when this group heals (its own hand-outs
        of this step stay, to be settled from there)."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


#: A step's samples: (epoch, where in the epoch's order it starts, groups
#: in it, this rank's index among the step's ranks).
_Key = tuple[int, int, int, int]


class _Reader:
    """The DataLoader's workers, reading the batches of the steps to come
    as :class:`QuorumLoader` guesses them: a DataLoader of the same dataset
    and worker settings whose batch sampler yields the guessed steps'
    samples, kept for the job (``persistent_workers``); a step not guessed
    starts a new pass of it from that step (the workers drop what they
    read ahead)."""

    def __init__(self, owner: QuorumLoader, loader: Any) -> None:
        from torch.utils.data import DataLoader

        self._owner = owner
        self._guessed: collections.deque[_Key] = collections.deque()
        self._start: _Key | None = None
        self._pass: Iterator[Any] | None = None
        self._loader = DataLoader(
            loader.dataset,
            batch_sampler=self,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=True,
        )

    def batch(self, key: _Key) -> Any:
        """The batch of the step ``key``: read ahead where it was guessed,
        else read now (and the steps after it guessed from it)."""
        if self._pass is None or not self._guessed or self._guessed[0] != key:
            if self._pass is not None:
                self._owner.rereads += 1
            self._guessed.clear()
            self._start = key
            self._pass = iter(self._loader)
        self._guessed.popleft()
        return next(self._pass)

    def __iter__(self) -> Iterator[list[int]]:
        """The guessed steps' samples from the step asked for to the
        epoch's end: each step with the same groups, committed. Run by the
        DataLoader in this process, ahead of the steps."""
        assert self._start is not None
        epoch, start, participants, index = self._start
        owner = self._owner
        while start < len(owner.dataset):
            share = owner._share_of(epoch, start, participants, index)
            if not share:
                return
            self._guessed.append((epoch, start, participants, index))
            yield share
            start = owner._take(start, participants)

    def __len__(self) -> int:  # what DataLoader asks of a batch sampler; never used for a pass's length
        return len(self._owner.dataset)


def _check(loader: Any) -> None:
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader):
        raise MisconfigurationError(
            f"setup_dataloader() takes a torch.utils.data.DataLoader, got {type(loader).__name__}"
        )
    why = None
    if isinstance(loader.dataset, IterableDataset):
        why = "its dataset is an IterableDataset, which has no order to deal out"
    elif loader.batch_size is None or type(loader.batch_sampler).__name__ != "BatchSampler":
        why = f"it has a batch_sampler of its own ({type(loader.batch_sampler).__name__})"
    elif type(loader.sampler).__name__ not in ("RandomSampler", "SequentialSampler"):
        why = f"it has a sampler of its own ({type(loader.sampler).__name__})"
    if why is not None:
        raise MisconfigurationError(
            f"setup_dataloader() under 'ddp_ft' deals each step's samples out over the groups in the "
            f"step, and this DataLoader cannot be dealt out: {why}. Or split the data yourself and "
            "pass use_distributed_sampler=False (a lost group's samples are then not given to the others)"
        )
