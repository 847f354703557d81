"""Data loaders for several ranks: a distributed sampler and device moves.

torch is imported when a loader is set up, never when core is imported.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    """A loader whose batches are moved to the strategy's device; otherwise
    the loader it wraps (``len``, ``sampler``, ``dataset``, ``set_epoch``)."""

    def __init__(self, loader: Any, strategy: Ranks) -> None:
        self.loader = loader
        self._strategy = strategy

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield self._strategy.batch_to_device(batch)

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int) -> None:
        """Give the distributed sampler the epoch, for a new shuffle order."""
        set_epoch = getattr(getattr(self.loader, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

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
    if (
        use_distributed_sampler
        and strategy.world_size > 1
        and not isinstance(loader.sampler, DistributedSampler)
    ):
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
        sampler: DistributedSampler[Any] = DistributedSampler(
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
    return DeviceLoader(loader, strategy) if move_to_device else loader
