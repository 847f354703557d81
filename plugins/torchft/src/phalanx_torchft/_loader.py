"""``ddp_ft``'s loader: each step's samples split over the groups in that
step's quorum, so that a dropped group's samples go to the others."""

from __future__ import annotations

import collections
import functools
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from phalanx_core import MisconfigurationError

from ._seams import StepDealer

__all__ = ["QuorumLoader"]


class QuorumLoader:
    """The loader ``ddp_ft``'s ``setup_dataloader`` returns.

    The job reads each epoch's order (the dataset shuffled with seed
    ``epoch``, as ``DistributedSampler`` shuffles it, or in order) from a
    place the groups share: the samples given back (below), then the
    order from :attr:`position` on. A step takes the next ``M x R x B``
    samples of it, where ``M`` is the number of groups in the last quorum
    this rank saw (the members of the previous step's quorum, healing ones
    included: a step's groups as far as anyone can know when it starts),
    ``R`` the ranks of a group and ``B`` the loader's batch size, and deals
    them out as ``DistributedSampler`` deals an epoch: rank ``r`` of the
    ``m``-th member (TorchFT's order of the quorum's replicas) gets every
    ``M x R``-th sample from ``m x R + r`` on. So a step's batch is known
    before the step's quorum: the group computes while the quorum forms,
    as TorchFT's own loop does.

    When the step's verdict comes, the groups learn together (one small
    all-reduce across the groups, in ``optimizer_step``) which members'
    shares were trained: those of the groups that took part in the step. A
    committed step takes its samples; the shares of members that were not
    in it (a group lost, or one that fell behind and heals) are given back,
    and the next steps deal them out first. A step that is dropped gives
    back all its samples. Where the groups of a step dealt from different
    quorums (a group that restarted from a checkpoint at the job's step, so
    with no last quorum, beside ones that had one) the step's samples
    cannot be told apart: the step is dropped on every group and dealt
    again. A group that heals takes its peers' place with their weights
    (the batch it was given in that step is not trained on: TorchFT zeroes
    its gradients). So each sample of an epoch is in exactly one committed
    step, except at the epoch's end: where the last samples do not fill a
    step, every rank of it gets the same smaller batch and a few samples
    from the epoch's start fill the last batches (fewer than ``M x R``; a
    second such step where a share of the first was given back;
    ``drop_last`` drops the samples that do not fill a batch on every rank
    instead). Where the step's own quorum is in hand when its batch is
    dealt (the first step; every step under ``hsdp_ft``, which waits for
    it), the batch is dealt to the quorum's participants instead.

    Iterating gives the rest of the job's current epoch, then the loader
    moves to the next one: :attr:`epoch` is the job's epoch (a healed group
    takes it from its peers), so a loop over epochs is ``while loader.epoch
    < epochs: for batch in loader: ...``. The state (:meth:`state_dict`,
    for checkpoints) is that of phalanx's other loaders plus the samples
    given back and not yet trained (``"given_back"``): a checkpoint of a
    ``ddp`` job goes on under ``ddp_ft``, and the other way round (where a
    ``ddp`` loader, which knows no samples given back, leaves those out of
    the epoch: fewer than a step's worth for each group lost in the last
    steps before the checkpoint).

    With ``num_workers=0`` a step's batch is read in the training process
    when it is asked for. With workers, the batches of the next steps are
    read ahead on the guess that each is committed with the same groups
    (the common case: the groups change only when one is lost or comes
    back); a step whose samples are not those guessed (a dropped step, a
    lost group, a healed place, a new epoch) has its workers' reads thrown
    away and read again from where the job is. The workers are the
    DataLoader's own (its ``num_workers``, ``prefetch_factor``,
    ``worker_init_fn``, ``multiprocessing_context``, ``pin_memory``,
    ``timeout``), kept for the whole job. :attr:`rereads` counts the steps
    read again.
    """

    def __init__(self, strategy: StepDealer, loader: Any, *, move: bool = True) -> None:
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
        #: Samples of this epoch dealt to groups that were not in their
        #: step: dealt again first.
        self.given_back: list[int] = []
        self._pending: list[int] = []  # members dealt to, for each batch handed out in the step
        self._rolled = False  # the epoch ended in this iteration
        #: Steps whose batch the workers had read for other samples, read again.
        self.rereads = 0
        self._asked: int | None = None  # the script's epoch (set_epoch), until it ends or is found behind
        self._behind_said = False
        self._reader = _Reader(self, loader) if loader.num_workers > 0 else None
        # local_sgd_ft, diloco_ft: a window of steps is settled at its sync,
        # and may run past the epoch's end (see _replay).
        self._windows = bool(getattr(strategy, "settles_windows", False))
        #: The epoch of the last batch handed out: under ``local_sgd_ft`` and
        #: ``diloco_ft`` the next epoch's, where a window runs past the
        #: epoch's end before its sync (else :attr:`epoch`).
        self.batch_epoch = 0

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
        return -(-(len(self.dataset) - self.position + len(self.given_back)) // step)

    def set_epoch(self, epoch: int) -> None:
        """What ``DistributedSampler.set_epoch`` is in a DDP script's epoch
        loop (``for epoch in range(start, epochs): loader.set_epoch(epoch);
        for batch in loader: ...``), kept to the job's epoch, which the
        loader holds (:attr:`epoch`; a group that heals takes it from its
        peers):

        * ``epoch`` is the job's: nothing changes.
        * ``epoch`` is behind the job's (a group that was started again
          runs its script from the top, and heals into a later epoch): the
          next iteration gives no batch, so the loop comes to the job's
          epoch at once and trains the rest of it with the others.
        * ``epoch`` is ahead, before any sample of the job's epoch was
          dealt (the script numbers its epochs from 1, or resumed at an
          epoch of its own): the job's epoch becomes ``epoch`` (its order is
          shuffled with seed ``epoch``, as ``DistributedSampler`` would).
          Ahead in the middle of an epoch is refused: the groups could not
          agree where the epoch ended.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise MisconfigurationError(f"loader.set_epoch({epoch!r}): expected an int of at least 0")
        if epoch > self.epoch:
            if self.position or self.given_back or self._pending:
                raise MisconfigurationError(
                    f"loader.set_epoch({epoch}) under {self._strategy.name!r} while the job's epoch "
                    f"{self.epoch} is under way ({self.position} of its {len(self.dataset)} samples "
                    "trained): the groups deal each epoch to its end, and a loop that leaves an epoch "
                    "early would leave it at a different step in each group. Iterate the loader to "
                    "the epoch's end, or give set_epoch the epoch the loader is in (loader.epoch)"
                )
            self.epoch = epoch
        self._asked = epoch

    def _next(self) -> Any | None:
        if self._rolled:
            self._rolled = False
            return None
        if self._asked is not None and self._asked < self.epoch:  # healed into a later epoch
            asked, self._asked = self._asked, None
            self._say_behind(asked)
            return None
        strategy = self._strategy
        if self._windows:
            members, member = strategy.deal_basis()
            epoch, back, start = self._replay([*self._pending, members])[-1][:3]
        else:
            epoch = self.epoch
            back, start = self._after_pending()
            if start >= len(self.dataset) and not back:
                self._end_epoch()  # what was handed out and never stepped on (an evaluation) is done
                return None
            strategy.open_step()
            members, member = strategy.deal_basis()  # the last quorum seen; the first one waited for
        index = member * strategy.world_size + strategy.global_rank
        chunk, _, _, _ = self._chunk(epoch, back, start, members)
        share = chunk[index :: members * strategy.world_size]
        if not share:  # drop_last: fewer samples left than ranks in the step
            if not self._windows:
                self._end_epoch()
            return None
        self._pending.append(members)
        self.batch_epoch = epoch
        if self._reader is not None:
            batch = self._reader.batch((epoch, tuple(back), start, members, index))
        else:
            batch = self._collate([self.dataset[i] for i in share])
        return strategy.batch_to_device(batch) if self._move else batch

    def _say_behind(self, asked: int) -> None:
        """Once per process: the script's epoch loop is behind the job's,
        and its iterations give nothing until they meet."""
        if self._behind_said:
            return
        self._behind_said = True
        strategy = self._strategy
        if strategy.global_rank == 0:
            sys.stderr.write(
                f"phalanx: replica group {strategy.replica_group} joined the job in epoch {self.epoch} "
                f"(healed from its peers) while its script is at set_epoch({asked}): the loader gives no "
                f"batch until the script's loop reaches epoch {self.epoch}\n"
            )
            sys.stderr.flush()

    # -- the step's verdict (from the strategy) ---------------------------------

    def settle(self, committed: bool, members: int = 0, trained: frozenset[int] = frozenset()) -> None:
        """The step's batches were dealt to ``members`` members, of which
        those in ``trained`` took part: their samples are taken where the
        step is ``committed``, the others' given back."""
        if self._windows:
            self._settle_window(committed, members, trained)
            return
        if committed and members:
            back, position = self.given_back, self.position
            returned: list[int] = []
            ranks = members * self._strategy.world_size
            for _ in self._pending:
                chunk, real, back, position = self._chunk(self.epoch, back, position, members)
                returned += [
                    sample
                    for i, sample in enumerate(chunk[:real])
                    if (i % ranks) // self._strategy.world_size not in trained
                ]
            self.given_back, self.position = returned + back, position
            if self.position >= len(self.dataset) and not self.given_back:
                self._end_epoch()
                self._rolled = True
        self._pending.clear()

    def _replay(self, dealt: Sequence[int]) -> list[tuple[int, list[int], int, list[int], int]]:
        """Under ``local_sgd_ft`` and ``diloco_ft``: where each of the
        window's steps, dealt to ``dealt`` members in turn, takes its
        samples from, replayed from the job's place (so that every group,
        a healed one too, finds the same): for each, ``(epoch, the samples
        given back before it, where in the epoch's order it starts, its
        chunk, how many of the chunk are its own)``. A step that finds the
        epoch dealt to its end takes the next epoch's first samples: a
        window may run past the epoch's end before its sync settles it."""
        epoch, back, position = self.epoch, list(self.given_back), self.position
        steps = []
        for members in dealt:
            chunk, real, rest, after = self._chunk(epoch, back, position, members)
            if (position >= len(self.dataset) and not back) or not chunk:  # not chunk: drop_last's rest
                epoch, back, position = epoch + 1, [], 0
                chunk, real, rest, after = self._chunk(epoch, back, position, members)
            steps.append((epoch, back, position, chunk, real))
            back, position = rest, after
        return steps

    def _settle_window(self, committed: bool, members: int, trained: frozenset[int]) -> None:
        """A window's verdict (see :meth:`settle`), its steps replayed
        (:meth:`_replay`): the samples of the groups that were not in it are
        given back, and those of an epoch the window ran past are dealt at
        the next epoch's start (a lost group's share of an epoch's last
        window is trained in the next one)."""
        if not (committed and members):
            self._pending.clear()  # nothing taken: the window is dealt again from the job's place
            return
        ranks = members * self._strategy.world_size
        steps = self._replay([members] * len(self._pending))
        returned: list[int] = []
        carried: list[int] = []
        epoch = self.epoch
        for step_epoch, _, _, chunk, real in steps:
            if step_epoch != epoch:
                carried, returned, epoch = carried + returned, [], step_epoch
            returned += [
                sample
                for i, sample in enumerate(chunk[:real])
                if (i % ranks) // self._strategy.world_size not in trained
            ]
        if steps:
            last_epoch, back, position, _, _ = steps[-1]
            _, _, rest, after = self._chunk(last_epoch, back, position, members)
            if last_epoch != self.epoch:
                self._rolled = True  # the script's pass over the epoch ends at its next batch
            self.epoch, self.position = last_epoch, after
            self.given_back = returned + carried + rest
            if self.position >= len(self.dataset) and not self.given_back:
                self._end_epoch()
                self._rolled = True
        self._pending.clear()

    def _end_epoch(self) -> None:
        self.epoch += 1
        self._asked = None  # the script's epoch was dealt to its end; its next set_epoch tells the next
        self.position = 0
        self.given_back = []
        self._pending.clear()

    # -- the deal ------------------------------------------------------------------

    def _chunk(
        self, epoch: int, back: Sequence[int], start: int, members: int
    ) -> tuple[list[int], int, list[int], int]:
        """A step's samples dealt to ``members`` members, from the samples
        given back ``back`` and the epoch's order from ``start`` on: the
        step's chunk (rank ``i`` of the step's ranks gets ``chunk[i::ranks]``),
        how many of it are the step's own (the rest fill the epoch's last
        step from its start), and what is given back and where the order
        is after it."""
        ranks = members * self._strategy.world_size
        wanted = ranks * self.batch_size
        order = self._order(epoch)
        taken = list(back[:wanted])
        taken += order[start : start + wanted - len(taken)]
        after = start + max(len(taken) - len(back), 0)
        chunk = taken
        if len(taken) < wanted:  # the epoch's last step
            if self.drop_last:
                chunk = taken[: len(taken) // ranks * ranks]
            else:
                total = -(-len(taken) // ranks) * ranks
                chunk = taken + (order * (total // len(order) + 1))[: total - len(taken)]
        return chunk, min(len(taken), len(chunk)), list(back[wanted:]), after

    def _after_pending(self) -> tuple[list[int], int]:
        """Where the step's next batch starts: the given back samples and
        the order's position after the batches handed out in the step."""
        back, position = self.given_back, self.position
        for members in self._pending:
            _, _, back, position = self._chunk(self.epoch, back, position, members)
        return list(back), position

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

    def state_dict(self) -> dict[str, Any]:
        """The job's place: ``{"epoch", "position", "samples"}`` (as phalanx's
        other loaders save it) and ``"given_back"``, the samples of the
        epoch given back by steps that a group was not in, not yet trained."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "samples": len(self.dataset),
            "given_back": list(self.given_back),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved place (a checkpoint of this loader or of a
        ``ddp`` job's)."""
        if state.get("samples") != len(self.dataset):
            raise MisconfigurationError(
                f"the checkpoint's loader position is in a dataset of {state.get('samples')} samples, and "
                f"this loader's dataset has {len(self.dataset)}: load it into a loader of the same data, "
                "or leave the loader out of the state you load"
            )
        outside = [i for i in state.get("given_back", ()) if not 0 <= int(i) < len(self.dataset)]
        if outside:
            raise MisconfigurationError(
                f"the checkpoint's loader state gives back samples {outside[:5]} that this loader's dataset "
                f"of {len(self.dataset)} samples does not have: load it into a loader of the same data, "
                "or leave the loader out of the state you load"
            )
        self.heal(state)
        self._rolled = False

    def heal(self, state: Mapping[str, Any]) -> None:
        """A peer's place, copied when this group heals (its own hand-outs
        of this step stay, to be settled from there)."""
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.given_back = [int(i) for i in state.get("given_back", ())]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


#: A step's samples: (epoch, the samples given back before it, where in the
#: epoch's order it starts, the members it is dealt to, this rank's index
#: among the step's ranks).
_Key = tuple[int, tuple[int, ...], int, int, int]


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
        epoch, back, start, members, index = self._start
        owner = self._owner
        ranks = members * owner._strategy.world_size
        while start < len(owner.dataset) or back:
            chunk, _, rest, after = owner._chunk(epoch, back, start, members)
            share = chunk[index::ranks]
            if not share:
                return
            self._guessed.append((epoch, tuple(back), start, members, index))
            yield share
            back, start = tuple(rest), after

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
        sampler = loader.sampler
        why = f"it has a sampler of its own ({type(sampler).__module__}.{type(sampler).__name__})"
        if hasattr(sampler, "num_replicas") or "Distributed" in type(sampler).__name__:
            # torch's DistributedSampler, TorchFT's (torchft.data), or one like them.
            shuffle = bool(getattr(sampler, "shuffle", True))
            raise MisconfigurationError(
                f"setup_dataloader() under 'ddp_ft': this DataLoader has {why}, which splits the "
                "data over a fixed set of ranks; ddp_ft deals each step's samples over the groups "
                "in that step instead (a lost group's samples go to the others). Drop sampler= "
                f"from the DataLoader and pass shuffle={shuffle} (the epoch's order is then "
                "DistributedSampler's with seed 0, set_epoch as in a DDP script)"
            )
    if why is not None:
        raise MisconfigurationError(
            f"setup_dataloader() under 'ddp_ft' deals each step's samples out over the groups in the "
            f"step, and this DataLoader cannot be dealt out: {why}. Or split the data yourself and "
            "pass use_distributed_sampler=False (a lost group's samples are then not given to the others)"
        )
