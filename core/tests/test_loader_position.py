"""The position of a loader from ``setup_dataloader`` in its epoch: saved
part way through on one number of ranks and loaded on another, the rest of
the epoch is split over the new ranks, and every sample of the epoch is
given exactly once. The ranks here are the rank numbers a strategy would
give (``Ranks``: global rank, world size); what the loader does with them
is the real sampler's."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from phalanx_core import MisconfigurationError
from phalanx_core._data import distribute_loader


@dataclass
class Rank:
    global_rank: int
    world_size: int

    def batch_to_device(self, batch):
        return batch


def loaders(world: int, samples: int = 48, batch: int = 4, drop_last: bool = False):
    data = TensorDataset(torch.arange(samples))
    return [
        distribute_loader(
            Rank(r, world),
            DataLoader(data, batch_size=batch, shuffle=True, drop_last=drop_last),
            use_distributed_sampler=True,
            move_to_device=True,
        )
        for r in range(world)
    ]


def take(ranks, batches: int, epoch: int) -> tuple[list[int], list]:
    """``batches`` batches from every rank (in step), then each rank's saved
    position."""
    seen = []
    for loader in ranks:
        loader.set_epoch(epoch)
        iterator = iter(loader)
        for _ in range(batches):
            seen += next(iterator)[0].tolist()
    return seen, [loader.state_dict() for loader in ranks]


@pytest.mark.parametrize(
    ("before", "after", "batches"), [(3, 2, 3), (2, 3, 3), (2, 2, 4), (1, 3, 3), (3, 1, 1)]
)
def test_the_rest_of_the_epoch_goes_to_the_new_ranks_each_sample_once(before, after, batches):
    seen, states = take(loaders(before), batches, epoch=5)
    assert len({tuple(sorted(s.items())) for s in states}) == 1  # every rank saved the same position
    assert states[0] == {"epoch": 5, "position": batches * 4 * before, "samples": 48}
    resumed = loaders(after)
    for loader in resumed:
        loader.load_state_dict(states[0])
        assert loader.epoch == 5
        loader.set_epoch(5)  # the loop's own call: the position stays
        seen += [i for (batch,) in loader for i in batch.tolist()]
    assert sorted(Counter(seen)) == list(range(48)) and set(Counter(seen).values()) == {1}


def test_a_position_at_the_end_of_the_epoch_gives_nothing_more_and_the_next_epoch_whole():
    ranks = loaders(2)
    for loader in ranks:
        list(loader)
    state = ranks[0].state_dict()
    assert state == {"epoch": 0, "position": 48, "samples": 48}
    resumed = loaders(2)
    for loader in resumed:
        loader.load_state_dict(state)
        assert list(loader) == []
        loader.set_epoch(1)
        assert len(list(loader)) == 6


def test_an_uneven_rest_is_padded_as_distributed_sampler_pads_or_dropped():
    _, states = take(loaders(2), 1, epoch=0)  # 8 of 48 given; 40 left for 3 ranks
    padded, dropped = loaders(3), loaders(3, drop_last=True)
    for loader in padded + dropped:
        loader.load_state_dict(states[0])
    got = [i for loader in padded for (b,) in loader for i in b.tolist()]
    assert len(got) == 42 and len(set(got)) == 40
    got = [i for loader in dropped for (b,) in loader for i in b.tolist()]
    assert len(got) == len(set(got)) == 36  # 13 per rank, whole batches only: 3 batches of 4


def test_a_position_from_another_dataset_is_refused():
    [loader] = loaders(1)
    with pytest.raises(
        MisconfigurationError, match="dataset of 10 samples, and this loader's dataset has 48"
    ):
        loader.load_state_dict({"epoch": 0, "position": 4, "samples": 10})


def test_a_loader_without_phalanxs_sampler_says_it_cannot_keep_its_position():
    loader = distribute_loader(
        Rank(0, 1),
        DataLoader(TensorDataset(torch.arange(4))),
        use_distributed_sampler=False,
        move_to_device=True,
    )
    with pytest.raises(MisconfigurationError, match="without phalanx's distributed sampler"):
        loader.state_dict()
