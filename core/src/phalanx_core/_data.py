"""Data loaders for several ranks: a distributed sampler and device moves.

torch is imported when a loader is set up, never when core is imported.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

from .errors import MisconfigurationError

__all__ = ["DeviceLoader", "distribute_loader"]

#: DataLoader arguments carried over when the loader is rebuilt.
_KEPT = (
    "batch_size",
    "num_workers",
    "collate_fn",
    "pin_memory",
    "drop_last",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "generator",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


class Ranks(Protocol):
    """What a loader needs of a strategy (:class:`~phalanx_core.Strategy` is
    one): who this rank is, and how a batch reaches its device."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def batch_to_device(self, batch: Any) -> Any: ...


class DeviceLoader:
    """A loader for one rank: its batches moved to the strategy's device
    (where asked), its position in the epoch kept (:meth:`state_dict`);
    otherwise the loader it wraps (``len``, ``sampler``, ``dataset``).

    The position is the number of the epoch's samples that every rank
    together has been given (batches handed to the training loop, not
    those a worker prefetched). Saved in a checkpoint (a loader in the state
    given to ``save_checkpoint``) and loaded back, on any number of ranks,
    the loader gives the rest of that epoch's order, split anew over the
    ranks there are now: with the same batch size on every rank (as
    ``setup_dataloader`` makes it), no sample of the epoch is given twice or
    skipped, except that, as ``DistributedSampler`` does, the last batches
    repeat a few samples where the rest does not split evenly (none with
    ``drop_last``, which drops them instead).
    """

    def __init__(self, loader: Any, strategy: Ranks, *, move: bool = True) -> None:
        self.loader = loader
        self._strategy = strategy
        self._move = move
        self._given = 0  # batches handed out in this epoch

    def __iter__(self) -> Iterator[Any]:
        sampler = self._sampler()
        self._given = 0
        for batch in self.loader:
            self._given += 1
            yield self._strategy.batch_to_device(batch) if self._move else batch
        if sampler is not None:
            sampler.start = 0  # the epoch is over: the next one starts at its beginning

    def __len__(self) -> int:
        return len(self.loader)

    @property
    def epoch(self) -> int:
        """The epoch the sampler is in (0 before any ``set_epoch``; a
        loaded position's epoch after :meth:`load_state_dict`)."""
        return int(getattr(getattr(self.loader, "sampler", None), "epoch", 0))

    def set_epoch(self, epoch: int) -> None:
        """Give the distributed sampler the epoch, for a new shuffle order. A
        loaded position is kept when ``epoch`` is its epoch."""
        sampler: Any = getattr(self.loader, "sampler", None)
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            if getattr(sampler, "epoch", None) != epoch and hasattr(sampler, "start"):
                sampler.start = 0
                self._given = 0
            set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        """The position in the epoch, for a checkpoint: ``{"epoch", "position",
        "samples"}`` (samples the epoch has in all)."""
        sampler = self._sampler()
        if sampler is None:
            raise MisconfigurationError(
                "the loader's position cannot be saved: it was set up without phalanx's distributed "
                "sampler (use_distributed_sampler=False, or a sampler of its own); keep your own sampler's "
                "position, or leave the loader out of the checkpoint"
            )
        batch = self.loader.batch_size or 1
        position = min(sampler.start + self._given * batch * sampler.num_replicas, len(sampler.dataset))
        return {"epoch": int(sampler.epoch), "position": int(position), "samples": len(sampler.dataset)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Go on from a saved position (see the class): the next iteration
        of that epoch gives the rest of its order."""
        sampler = self._sampler()
        if sampler is None:
            raise MisconfigurationError(
                "cannot load a loader position into a loader set up without phalanx's distributed sampler"
            )
        if state.get("samples") != len(sampler.dataset):
            raise MisconfigurationError(
                f"the checkpoint's loader position is in a dataset of {state.get('samples')} samples, and "
                f"this loader's dataset has {len(sampler.dataset)}: load it into a loader of the same data, "
                "or leave the loader out of the state you load"
            )
        sampler.set_epoch(int(state["epoch"]))
        sampler.start = int(state["position"])
        self._given = 0

    def _sampler(self) -> Any:
        sampler = getattr(self.loader, "sampler", None)
        return sampler if hasattr(sampler, "start") else None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def distribute_loader(
    strategy: Ranks, loader: Any, *, use_distributed_sampler: bool, move_to_device: bool
) -> Any:
    """What :meth:`Strategy.setup_dataloader` does."""
    from torch.utils.data import (
        DataLoader,
        DistributedSampler,
        RandomSampler,
        SequentialSampler,
    )

    if not isinstance(loader, DataLoader):
        raise MisconfigurationError(
            f"setup_dataloader() takes a torch.utils.data.DataLoader, got {type(loader).__name__}"
        )
    if use_distributed_sampler and not isinstance(loader.sampler, DistributedSampler):
        custom_batches = (
            loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler"
        )
        if custom_batches or not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
            raise MisconfigurationError(
                "setup_dataloader(): this DataLoader has its own sampler or batch_sampler "
                f"({type(loader.batch_sampler if custom_batches else loader.sampler).__name__}), so phalanx "
                "cannot give each rank its share; make it distributed yourself and pass "
                "use_distributed_sampler=False"
            )
        sampler: DistributedSampler[Any] = _resumable_sampler_class()(
            loader.dataset,
            num_replicas=strategy.world_size,
            rank=strategy.global_rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
            drop_last=loader.drop_last,
        )
        kept = {name: getattr(loader, name) for name in _KEPT if hasattr(loader, name)}
        if loader.num_workers > 0:
            kept["prefetch_factor"] = loader.prefetch_factor
        else:
            kept.pop("persistent_workers", None)
            kept.pop("multiprocessing_context", None)
        loader = DataLoader(loader.dataset, sampler=sampler, **kept)
    if move_to_device or isinstance(getattr(loader, "sampler", None), _resumable_sampler_class()):
        return DeviceLoader(loader, strategy, move=move_to_device)
    return loader


@functools.cache
def _resumable_sampler_class() -> type:
    from torch.utils.data import DistributedSampler

    class ResumableDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
        """``DistributedSampler`` that can start an epoch part way through:
        the epoch's order without its first ``start`` samples, split over
        the ranks as ``DistributedSampler`` splits a whole epoch (every
        rank's k-th sample is consecutive in the order, so what every rank
        was given after k batches is a prefix of it)."""

        start = 0

        def __iter__(self) -> Iterator[Any]:
            import torch

            count = len(self.dataset)  # type: ignore[arg-type]
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + self.epoch)
                order = torch.randperm(count, generator=generator).tolist()
            else:
                order = list(range(count))
            order = order[self.start :]
            total = self._per_rank(len(order)) * self.num_replicas
            if len(order) < total and order:  # pad, as DistributedSampler does
                order += (order * (total // len(order) + 1))[: total - len(order)]
            return iter(order[self.rank : total : self.num_replicas])

        def __len__(self) -> int:
            return self._per_rank(len(self.dataset) - self.start)  # type: ignore[arg-type]

        def _per_rank(self, left: int) -> int:
            if self.drop_last:
                return left // self.num_replicas
            return -(-left // self.num_replicas)

    return ResumableDistributedSampler
