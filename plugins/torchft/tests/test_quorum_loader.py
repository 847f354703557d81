"""The quorum loader's deal, step by step, in one process: each rank of
three groups of two draws its batch before its step's quorum is known
(dealt to the members of the last quorum), and the step's verdict gives
back the shares of members that were not in it. The strategy here is the
loader's side of ``ddp_ft``'s (what the loader asks of it); the real
groups, quorums and kills are in test_ddp_ft.py."""

from __future__ import annotations

import collections

import pytest

pytest.importorskip("torchft", reason="phalanx-torchft's tests need torchft: pip install 'torchft>=0.2,<0.3'")

import torch
from phalanx_torchft import QuorumLoader
from torch.utils.data import DataLoader, Dataset

GROUPS, RANKS, BATCH, SAMPLES = 3, 2, 2, 100


class Samples(Dataset):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> int:
        return i


class Rank:
    """What the loader asks of the strategy: the rank, and the members the
    step is dealt to (the last quorum this rank saw)."""

    def __init__(self, group: int, rank: int) -> None:
        self.replica_group, self.global_rank = group, rank
        self.world_size, self.replica_groups = RANKS, GROUPS
        self.basis = (0, 0)
        self.name = "ddp_ft"

    def open_step(self) -> None:
        pass

    def deal_basis(self) -> tuple[int, int]:
        return self.basis

    def batch_to_device(self, batch):  # type: ignore[no-untyped-def]
        return batch


def ranks_of(workers: int) -> dict[tuple[int, int], tuple[Rank, QuorumLoader]]:
    made = {}
    for group in range(GROUPS):
        for rank in range(RANKS):
            strategy = Rank(group, rank)
            data = DataLoader(Samples(), batch_size=BATCH, shuffle=True, num_workers=workers)
            made[group, rank] = strategy, QuorumLoader(strategy, data, move=False)
    return made


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "workers"])
def test_a_lost_members_share_is_given_back_and_every_sample_trained_once(workers):
    ranks = ranks_of(workers)
    iterators = {key: iter(loader) for key, (_, loader) in ranks.items()}
    trained: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    # Each step: the members its batches are dealt to (the last quorum's,
    # with each group's index in it), the groups that take part (the
    # step's own quorum), and whether it is committed.
    everyone = {0: 0, 1: 1, 2: 2}
    without_1 = {0: 0, 2: 1}
    steps = [
        *[(everyone, {0, 1, 2}, True)] * 3,
        (everyone, {0, 1, 2}, False),  # group 1 killed in it: the all-reduce fails
        (everyone, {0, 2}, True),  # dealt to three, trained by two: member 1's share given back
        *[(without_1, {0, 2}, True)] * 5,
        (without_1, {0, 2}, True),  # group 1 back: it heals in this step (not dealt to)
        *[(everyone, {0, 1, 2}, True)] * 12,
    ]
    given_back_seen = False
    for number, (dealt, taking_part, committed) in enumerate(steps):
        healing = number == 10
        batches = {}
        for (group, rank), (strategy, _) in ranks.items():
            if group not in dealt and not healing:
                continue  # lost
            # The healing group deals by the quorum it waited for: three
            # members, itself the second.
            strategy.basis = (len(dealt), dealt[group]) if group in dealt else (3, 1)
            try:
                batch = next(iterators[group, rank])
            except StopIteration:  # the epoch's end: the next one
                iterators[group, rank] = iter(loader_of(ranks, group, rank))
                batch = next(iterators[group, rank])
            batches[group, rank] = (loader_of(ranks, group, rank).epoch, [int(i) for i in batch])
        if healing:  # copies a peer's place, then settles its step as the peers do
            loader_of(ranks, 1, 0).heal(loader_of(ranks, 0, 0).state_dict())
            loader_of(ranks, 1, 1).heal(loader_of(ranks, 0, 1).state_dict())
        trained_members = frozenset(dealt[g] for g in taking_part if g in dealt)
        if committed:
            for (group, _), (epoch, ids) in batches.items():
                if group in taking_part and group in dealt:
                    trained[epoch].update(ids)
        for (group, _), (_, loader) in ranks.items():
            if group in dealt or healing:
                loader.settle(committed, len(dealt), trained_members)
        given_back_seen |= bool(loader_of(ranks, 0, 0).given_back)
        states = {repr(loader.state_dict()) for g, (_, loader) in ranks.items() if g[0] != 1}
        assert len(states) == 1, (number, states)  # every survivor at the same place
        if number >= 10:  # and the healed group with them
            assert loader_of(ranks, 1, 0).state_dict() == loader_of(ranks, 0, 0).state_dict()

    assert given_back_seen
    assert loader_of(ranks, 0, 0).epoch >= 1
    first = trained[0]
    assert sorted(first) == list(range(SAMPLES))  # the whole first epoch
    repeated = sum(n - 1 for n in first.values())
    assert repeated < GROUPS * RANKS  # at most the filling of the epoch's last step
    if workers:
        assert loader_of(ranks, 0, 0).rereads >= 1  # the lost member's step read again


def loader_of(ranks, group, rank):  # type: ignore[no-untyped-def]
    return ranks[group, rank][1]


def test_a_checkpoint_holds_the_samples_given_back():
    strategy = Rank(0, 0)
    loader = QuorumLoader(strategy, DataLoader(Samples(), batch_size=BATCH), move=False)
    strategy.basis = (3, 0)
    next(iter(loader))
    loader.settle(True, 3, frozenset({0, 2}))  # member 1's share given back
    state = loader.state_dict()
    assert state["position"] == GROUPS * RANKS * BATCH
    assert state["given_back"] == [2, 3, 8, 9]  # member 1's ranks' samples of the step, in order
    again = QuorumLoader(strategy, DataLoader(Samples(), batch_size=BATCH), move=False)
    again.load_state_dict(state)
    strategy.basis = (2, 0)
    assert [int(i) for i in next(iter(again))] == [2, 12]  # dealt first, over the two members left
    assert torch.equal(torch.tensor(again.state_dict()["given_back"]), torch.tensor([2, 3, 8, 9]))


def test_a_checkpoint_giving_back_samples_the_dataset_has_not_is_refused_with_what_to_do():
    from phalanx_core import MisconfigurationError

    loader = QuorumLoader(Rank(0, 0), DataLoader(Samples(), batch_size=BATCH), move=False)
    state = {"epoch": 0, "position": 12, "samples": SAMPLES, "given_back": [3, SAMPLES + 7]}
    with pytest.raises(MisconfigurationError, match=r"gives back samples \[107\].*same data"):
        loader.load_state_dict(state)


def one_group_loader() -> tuple[Rank, QuorumLoader]:
    strategy = Rank(0, 0)
    strategy.world_size, strategy.basis = 1, (1, 0)
    return strategy, QuorumLoader(strategy, DataLoader(Samples(), batch_size=10, shuffle=True), move=False)


def an_epoch(loader: QuorumLoader) -> list[int]:
    """Iterate the loader once as a DDP loop does, each step committed."""
    seen = []
    for batch in loader:
        seen += [int(i) for i in batch]
        loader.settle(True, 1, frozenset({0}))
    return seen


def test_set_epoch_in_a_ddp_loop_keeps_the_jobs_epoch():
    # The usual loop: each epoch every sample once, in DistributedSampler's
    # order for that epoch (seed 0 + epoch).
    _, loader = one_group_loader()
    orders = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        seen = an_epoch(loader)
        assert sorted(seen) == list(range(SAMPLES)), epoch
        orders.append(seen)
        assert loader.epoch == epoch + 1
    expected = [
        torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(e)).tolist() for e in range(3)
    ]
    assert orders == expected


def test_a_group_that_heals_into_a_later_epoch_skips_the_epochs_its_script_is_behind(capsys):
    # A group started again runs its script from the top (set_epoch(0)),
    # and its first step heals it into the job's place: epoch 2, 40 samples in.
    _, peer = one_group_loader()
    peer.set_epoch(2)
    batches = iter(peer)
    for _ in range(4):
        next(batches)
        peer.settle(True, 1, frozenset({0}))
    _, healed = one_group_loader()
    trained: dict[int, list[int]] = {}
    for epoch in range(4):
        healed.set_epoch(epoch)
        for batch in healed:
            if not trained and healed.epoch == 0:  # its first step: healed, its batch not trained
                healed.heal(peer.state_dict())
                healed.settle(True, 1, frozenset({0}))
                continue
            trained.setdefault(epoch, []).extend(int(i) for i in batch)
            healed.settle(True, 1, frozenset({0}))
    # Epochs 0 and 1 of the script gave no batch; epoch 2 the job's rest of
    # it (after the step it healed in, which its peers committed), epoch 3 all of it.
    assert sorted(trained) == [2, 3]
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(2)).tolist()
    assert trained[2] == order[50:]
    assert sorted(trained[3]) == list(range(SAMPLES))
    assert "joined the job in epoch 2" in capsys.readouterr().err


def test_a_group_that_heals_in_an_epochs_last_step_is_told_at_its_next_set_epoch(capsys):
    # Its first step is the last of the job's epoch 1: committed, it ends
    # the script's epoch 0 loop, and the loader, in epoch 2 by then, says
    # so at the script's set_epoch(1), whose pass gives nothing.
    _, peer = one_group_loader()
    peer.set_epoch(1)
    batches = iter(peer)
    for _ in range(SAMPLES // 10 - 1):
        next(batches)
        peer.settle(True, 1, frozenset({0}))
    _, healed = one_group_loader()
    passes: dict[int, int] = {}
    for epoch in range(3):
        healed.set_epoch(epoch)
        for _batch in healed:
            if healed.epoch == 0:  # its first step: healed, its batch not trained
                healed.heal(peer.state_dict())
            passes[epoch] = passes.get(epoch, 0) + 1
            healed.settle(True, 1, frozenset({0}))
    assert passes == {0: 1, 2: SAMPLES // 10}
    assert "joined the job in epoch 2 (healed from its peers) while its script is at set_epoch(1)" in (
        capsys.readouterr().err
    )


def test_set_epoch_ahead_starts_that_epoch_but_not_in_the_middle_of_one():
    from phalanx_core import MisconfigurationError

    _, loader = one_group_loader()
    loader.set_epoch(1)  # a loop numbering its epochs from 1
    assert loader.epoch == 1
    next(iter(loader))
    loader.settle(True, 1, frozenset({0}))
    with pytest.raises(
        MisconfigurationError, match=r"set_epoch\(2\).*epoch 1 is under way.*to the epoch's end"
    ):
        loader.set_epoch(2)
    with pytest.raises(MisconfigurationError, match="expected an int"):
        loader.set_epoch(-1)


def test_a_distributed_sampler_is_refused_saying_to_drop_it_and_shuffle():
    from torch.utils.data.distributed import DistributedSampler
    from torchft.data import DistributedSampler as TorchFTSampler

    from phalanx_core import MisconfigurationError

    samplers = {
        "torch": DistributedSampler(Samples(), num_replicas=2, rank=0, shuffle=False),
        "torchft": TorchFTSampler(
            Samples(), replica_rank=0, num_replica_groups=2, group_rank=0, num_replicas=1
        ),
    }
    for which, sampler in samplers.items():
        shuffle = "False" if which == "torch" else "True"
        with pytest.raises(MisconfigurationError, match=rf"Drop sampler= .* pass shuffle={shuffle}"):
            QuorumLoader(Rank(0, 0), DataLoader(Samples(), batch_size=BATCH, sampler=sampler))


def test_a_loader_split_by_the_user_is_kept_as_given():
    # use_distributed_sampler=False: no quorum deal, the base strategy's
    # loader (the batches moved to the device where asked).
    import phalanx

    strategy = phalanx.resolve("ddp_ft", accelerator="cpu", devices=1)
    loader = DataLoader(Samples(), batch_size=BATCH)
    assert strategy.setup_dataloader(loader, use_distributed_sampler=False, move_to_device=False) is loader
    moved = strategy.setup_dataloader(loader, use_distributed_sampler=False)
    assert not isinstance(moved, QuorumLoader)
    assert moved.loader is loader
