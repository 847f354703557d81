"""The horovod strategy with real horovod, in ranks the ``horovod``
launcher starts: rank 0's parameters and optimizer state everywhere after
setup, gradients averaged by hvd.DistributedOptimizer (one step equals the
full-batch step of one process), accumulation with
backward_passes_per_step, clipping of the reduced gradients, checkpoints
written by rank 0, the precisions, and torch's DDP over the horovod
collective. The same tests run with the torch collective, whose strategy
wraps optimizers in phalanx's version of DistributedOptimizer (gradients
through the collective), and reach Horovod's own weights. Option errors are
refused when resolving."""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import cloudpickle
import pytest
import torch

import phalanx
from phalanx_core import MisconfigurationError, UnavailableError
from phalanx_core.testing.processes import TAG_VAR, new_tag, reap

pytestmark = pytest.mark.subprocess

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(autouse=True)
def no_leftovers(monkeypatch: pytest.MonkeyPatch):
    tag = new_tag()
    monkeypatch.setenv(TAG_VAR, tag)
    yield
    left = reap(tag, grace=10)
    assert not left, f"processes left behind (killed now): {left}"


def resolve(strategy: str = "horovod", **flags):
    return phalanx.resolve(strategy, accelerator="cpu", devices=2, **flags)


#: Horovod's own DistributedOptimizer, and phalanx's over torch's collective
#: (a gloo group in the ranks the horovod launcher starts).
collectives = pytest.mark.parametrize("collective", ["horovod", "torch"])


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def data(rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)


def flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()])


def same_everywhere(strategy, t: torch.Tensor) -> bool:
    got = strategy.all_gather(t.detach().float())
    return all(torch.equal(got[0], g) for g in got)


def setup_step_clip_checkpoint(strategy, folder: str):
    r = strategy.global_rank
    out = {}
    torch.manual_seed(r)  # every rank starts from other weights...
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = data(r)
    torch.nn.functional.mse_loss(net(x), y).backward()
    optimizer.step()  # ...and another momentum
    optimizer.zero_grad()
    net, optimizer = strategy.setup(net, optimizer)
    out["params_from_rank_0"] = same_everywhere(strategy, flat(net))
    momentum = torch.cat([s["momentum_buffer"].reshape(-1) for s in optimizer.state.values()])
    out["momentum_from_rank_0"] = same_everywhere(strategy, momentum)
    out["wrapped"] = (type(optimizer).__name__, isinstance(optimizer, torch.optim.SGD))
    # one step of both ranks == one step of one process on both batches
    reference = copy.deepcopy(net)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # load_state_dict shares tensors
    optimizer.zero_grad()
    strategy.backward(torch.nn.functional.mse_loss(net(x), y))
    strategy.optimizer_step(optimizer)
    both = [data(k) for k in range(strategy.world_size)]
    xs, ys = torch.cat([b[0] for b in both]), torch.cat([b[1] for b in both])
    ref_opt.zero_grad()
    torch.nn.functional.mse_loss(reference(xs), ys).backward()
    ref_opt.step()
    out["step_is_the_full_batch_step"] = torch.allclose(flat(net), flat(reference), atol=1e-6)
    # clipping sees the reduced gradients: the same norm on every rank
    optimizer.zero_grad()
    strategy.backward(torch.nn.functional.mse_loss(net(x), y))
    norm = strategy.clip_gradients(net, optimizer, max_norm=1e-3)
    out["clip_norm_everywhere"] = same_everywhere(strategy, norm.reshape(1))
    strategy.optimizer_step(optimizer)
    out["after_clip"] = same_everywhere(strategy, flat(net))
    # checkpoints: rank 0 writes, every rank reads
    path = Path(folder, "ckpt.pt")
    strategy.save_checkpoint(path, {"model": net, "optimizer": optimizer, "step": 2})
    fresh = model()
    left = strategy.load_checkpoint(path, {"model": fresh})
    out["checkpoint"] = (path.exists(), left.get("step"), torch.equal(flat(fresh), flat(net)))
    return r, out


@collectives
def test_setup_step_clipping_and_checkpoints(tmp_path, collective):
    results = dict(resolve(collective=collective).launch(setup_step_clip_checkpoint, str(tmp_path)))
    for r, out in results.items():
        assert out == {
            "params_from_rank_0": True,
            "momentum_from_rank_0": True,
            "wrapped": ("SGD", True),
            "step_is_the_full_batch_step": True,
            "clip_norm_everywhere": True,
            "after_clip": True,
            "checkpoint": (True, 2, True),
        }, (r, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def accumulate(strategy, passes: int):
    r = strategy.global_rank
    torch.manual_seed(0)
    net, optimizer = strategy.setup(model(), functools.partial(torch.optim.SGD, lr=0.0))
    # This rank's own sum of the passes, from a copy that no strategy touches:
    # reading net's gradients after the last pass would race with Horovod,
    # which reduces them in place on its own thread (it failed once so).
    alone = copy.deepcopy(net)
    local = [torch.zeros_like(p) for p in net.parameters()]
    for k in range(passes):
        x, y = data(10 * r + k)
        torch.nn.functional.mse_loss(alone(x), y).backward()
        with strategy.no_backward_sync(net, enabled=k < passes - 1):
            strategy.backward(torch.nn.functional.mse_loss(net(x), y))
        if k < passes - 1:  # still local: the sum of this rank's passes
            local = [p.grad.clone() for p in net.parameters()]
    own = [p.grad for p in alone.parameters()]
    strategy.optimizer_step(optimizer)
    reduced = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    expected = strategy.all_reduce(torch.cat([g.reshape(-1) for g in own]), "mean")
    kept_local = not same_everywhere(strategy, torch.cat([g.reshape(-1) for g in local]))
    return torch.allclose(reduced, expected, atol=1e-6), kept_local


@collectives
def test_accumulation_keeps_passes_local_until_the_nth(collective):
    results = resolve(backward_passes_per_step=3, collective=collective).launch(accumulate, 3)
    assert results == [(True, True), (True, True)]


def no_sync_with_one_pass(strategy):
    net = strategy.setup(model())
    try:
        strategy.no_backward_sync(net)
    except MisconfigurationError as exc:
        return str(exc)
    return "accepted"


@collectives
def test_no_backward_sync_without_accumulation_is_refused(collective):
    for message in resolve(collective=collective).launch(no_sync_with_one_pass):
        assert "backward_passes_per_step=N" in message, message


def train(strategy, steps: int = 20, passes: int = 1):
    torch.manual_seed(0)
    net, optimizer = strategy.setup(model(), functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    x, y = strategy.batch_to_device(data(strategy.global_rank, 32))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        for k in range(passes):
            with strategy.no_backward_sync(net, enabled=k < passes - 1), strategy.forward_context():
                loss = torch.nn.functional.mse_loss(net(x[k::passes]).float(), y[k::passes].float())
            strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        losses.append(loss.item())
    params = flat(net)
    dtype = str(next(net.parameters()).dtype)
    return losses[0], losses[-1], same_everywhere(strategy, params), dtype, params.tolist()


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        ({"precision": "bf16-true"}, "torch.bfloat16"),
        ({"precision": "bf16-mixed"}, "torch.float32"),
        ({"precision": "16-true"}, "torch.float16"),
        ({"compression": "fp16"}, "torch.float32"),
        ({"op": "sum"}, "torch.float32"),
    ],
)
@collectives
def test_training_in_each_precision_and_option(flags, dtype, collective):
    for first, last, same, got, _ in resolve(collective=collective, **flags).launch(train):
        assert last < first, (flags, first, last)
        assert same, f"{flags}: the ranks' parameters differ after training"
        assert got == dtype


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"op": "sum"},
        {"gradient_predivide_factor": 2.0},
        {"compression": "fp16"},
        {"backward_passes_per_step": 2},
    ],
    ids=["mean", "sum", "predivide", "fp16", "accumulate-2"],
)
def test_over_another_collective_the_weights_are_horovods(flags):
    """phalanx's DistributedOptimizer over torch's collective trains to the
    weights Horovod's own reaches, option by option; the gradients went
    through the collective (its all_reduce carried them)."""
    results = {
        collective: resolve(collective=collective, **flags).launch(
            train, 6, flags.get("backward_passes_per_step", 1)
        )
        for collective in ("horovod", "torch")
    }
    for native, ours in zip(results["horovod"], results["torch"], strict=True):
        torch.testing.assert_close(torch.tensor(ours[4]), torch.tensor(native[4]), rtol=0, atol=1e-6)


def test_ddp_over_the_horovod_collective_trains():
    """The composition promise: torch's DDP (its gradients over a torch
    group in Horovod's ranks) with every strategy collective call going
    through Horovod."""
    strategy = resolve("ddp", collective="horovod", launcher="horovod")
    assert type(strategy.collective).__name__ == "HorovodCollective"
    for first, last, same, _, _ in strategy.launch(train):
        assert last < first and same


@pytest.mark.parametrize(
    ("flags", "error", "words"),
    [
        ({"op": "max"}, MisconfigurationError, ["op='max'", "'mean'"]),
        ({"backward_passes_per_step": 0}, MisconfigurationError, ["backward_passes_per_step=0"]),
        ({"compression": "zip"}, MisconfigurationError, ["compression='zip'", "'fp16'"]),
        ({"op": "sum", "gradient_predivide_factor": 2.0}, MisconfigurationError, ["op='mean'"]),
        ({"op": "adasum"}, UnavailableError, ["MPI", "op='mean'"]),
        ({"op": "adasum", "collective": "torch"}, MisconfigurationError, ["collective 'torch'", "op='mean'"]),
    ],
)
def test_bad_options_are_refused_when_resolving(flags, error, words):
    with pytest.raises(error) as info:
        resolve(**flags)
    for word in words:
        assert word in str(info.value), str(info.value)
