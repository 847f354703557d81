"""setup_dataloader: each rank reads its own share, batches land on the device."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import phalanx
from phalanx_core import MisconfigurationError

DATA = TensorDataset(torch.arange(12.0).unsqueeze(1), torch.arange(12))


def read_all(strategy, shuffle):
    loader = strategy.setup_dataloader(DataLoader(DATA, batch_size=2, shuffle=shuffle))
    loader.set_epoch(0)
    seen = [int(i) for _, labels in loader for i in labels]
    devices = {x.device.type for x, _ in loader}
    return seen, len(loader), devices


@pytest.mark.subprocess
@pytest.mark.parametrize("shuffle", [False, True])
def test_each_rank_reads_its_own_share(shuffle):
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2)
    (first, n0, dev0), (second, n1, _) = strategy.launch(read_all, shuffle)
    assert sorted(first + second) == list(range(12))  # disjoint, and together everything
    assert n0 == n1 == 3
    assert dev0 == {"cpu"}
    if not shuffle:
        assert first == [0, 2, 4, 6, 8, 10]


def test_one_rank_keeps_the_loader_order():
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    [(seen, batches, _)] = strategy.launch(read_all, False)
    assert seen == list(range(12))
    assert batches == 6


def refuse_custom_batch_sampler(strategy):
    batches = BatchSampler(SequentialSampler(DATA), batch_size=3, drop_last=False)

    class MyBatches(BatchSampler):
        pass

    loader = DataLoader(DATA, batch_sampler=MyBatches(SequentialSampler(DATA), 3, False))
    try:
        strategy.setup_dataloader(loader)
    except MisconfigurationError as exc:
        message = str(exc)
    else:
        message = ""
    kept = strategy.setup_dataloader(loader, use_distributed_sampler=False)
    return message, len(kept), len(list(batches))


@pytest.mark.subprocess
def test_a_custom_batch_sampler_is_refused_with_what_to_do():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2)
    for message, batches, expected in strategy.launch(refuse_custom_batch_sampler):
        assert "has its own sampler or batch_sampler (MyBatches)" in message
        assert "use_distributed_sampler=False" in message
        assert batches == expected


def test_not_a_dataloader():
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    with pytest.raises(MisconfigurationError, match=r"takes a torch\.utils\.data\.DataLoader, got list"):
        strategy.setup_dataloader([1, 2])
