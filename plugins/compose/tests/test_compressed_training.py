"""``compressed`` on the wire and in training: half the bytes of its inner
collective for float32 (counted on the inner collective itself), DDP's and
FSDP's traffic through it, weights within bf16's rounding of the plain
collective's, and loss curves that agree over 200 steps."""

from __future__ import annotations

import functools
import time

import pytest
import torch

import phalanx
from phalanx_core.testing.traffic import count_calls

_STEPS = 200


def bytes_of_an_all_reduce(strategy, dtype):
    """What the collective that carries the bytes was given for one
    all_reduce of 1 MiB of ``dtype``, and the result."""
    carrier = getattr(strategy.collective, "inner", strategy.collective)
    _, carried = count_calls(carrier)
    tensor = torch.full((1 << 18,), float(strategy.global_rank + 1), dtype=dtype)
    strategy.collective.all_reduce(tensor)
    return carried["all_reduce"], tensor[:3].tolist(), tensor.dtype == dtype


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_float32_goes_in_half_the_bytes_and_other_dtypes_as_they_are(wire):
    plain = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="spawn")
    compressed = phalanx.resolve(
        "ddp",
        accelerator="cpu",
        devices=2,
        launcher="spawn",
        collective="compressed",
        inner="torch",
        dtype=wire,
    )
    for dtype, ratio in ((torch.float32, 0.5), (torch.float64, 1.0), (torch.int32, 1.0)):
        base = plain.launch(bytes_of_an_all_reduce, dtype)
        over = compressed.launch(bytes_of_an_all_reduce, dtype)
        for (plain_bytes, plain_values, _), (bytes_, values, kept) in zip(base, over, strict=True):
            assert bytes_ == plain_bytes * ratio, (dtype, bytes_, plain_bytes)
            assert values == plain_values == [3, 3, 3] and kept, (dtype, values)


def train(strategy, kind, steps):
    """``steps`` steps of a small model on every rank's own batches; the
    loss of each step (averaged over the ranks), the final weights, and the
    calls the strategy's collective got."""
    calls, _ = count_calls(strategy.collective)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    model, optimizer = strategy.setup(model, functools.partial(torch.optim.SGD, lr=0.02))
    generator = torch.Generator().manual_seed(strategy.global_rank)
    target = torch.nn.Linear(32, 1)
    torch.nn.init.normal_(target.weight, std=0.2, generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=generator)
        with torch.no_grad():
            y = target(x)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        losses.append(strategy.all_reduce(loss.detach().double(), "mean").item())
    state = strategy.unwrap_module(model).state_dict()
    weights = torch.cat([_full(t).flatten().double() for _, t in sorted(state.items())])
    return losses, weights.tolist(), dict(calls)


def _full(tensor):
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_training_follows_the_plain_collective_within_bf16_rounding(kind):
    flags = {"accelerator": "cpu", "devices": 2, "launcher": "spawn"}
    plain = phalanx.resolve(kind, **flags).launch(train, kind, _STEPS)
    for feedback in (False, True):
        compressed = phalanx.resolve(
            kind, collective="compressed", inner="torch", error_feedback=feedback, **flags
        ).launch(train, kind, _STEPS)
        (plain_losses, plain_weights, _), (losses, weights, calls) = plain[0], compressed[0]
        # The strategy's own traffic went through the compressed collective.
        if kind == "ddp":  # a bucket of gradients a step, and the loss's
            assert calls.get("all_reduce", 0) >= 2 * _STEPS, calls
        else:  # the parameters gathered, the gradients reduce-scattered, a step
            assert min(calls.get("all_gather_into", 0), calls.get("reduce_scatter_into", 0)) >= _STEPS, calls
        assert compressed[0][1] == compressed[1][1]  # the replicas agree exactly
        # The curves agree at every step: under DDP (only the gradients are
        # rounded) within bf16's relative rounding, 2**-8, of the plain
        # loss (6e-4 seen); under FSDP, whose all-gathers round the
        # parameters the forward pass uses too, within 2**-5 (1.7e-2 seen).
        # And both learn.
        tolerance = 2**-8 if kind == "ddp" else 2**-5
        for step, (a, b) in enumerate(zip(plain_losses, losses, strict=True)):
            assert abs(a - b) <= tolerance * abs(a), (feedback, step, a, b)
        assert losses[-1] < 0.01 * losses[0]
        torch.testing.assert_close(torch.tensor(weights), torch.tensor(plain_weights), rtol=2**-7, atol=2e-3)


def overlap(strategy):
    """8 asynchronous all_reduces of 4 MB of float32 (integers, exact in
    bf16) started one after another, the last rank a second late; how many
    were not done when the calls returned (None on the late rank); whether each result is right once waited on; and what
    phalanx's process group hands DDP for one (c10d's future itself, with
    the copy back chained on it, or its own Python handle)."""
    from phalanx_torch.process_group import CollectiveProcessGroup

    collective = strategy.collective
    rank, size = strategy.global_rank, strategy.world_size
    late = rank == size - 1  # starts a second late: no handle of the others can be done before
    tensors = [torch.full((1 << 20,), float(rank + i)) for i in range(8)]
    if late:
        time.sleep(1.0)
    works = [collective.all_reduce(t, async_op=True) for t in tensors]
    pending = None if late else sum(not w.is_completed() for w in works)
    right = all(
        w.wait() is t and bool((t == sum(k + i for k in range(size))).all())
        for i, (w, t) in enumerate(zip(works, tensors, strict=True))
    )
    group = CollectiveProcessGroup(collective)
    bucket = torch.full((1000,), float(rank + 1))
    work = group.allreduce([bucket])
    value = work.get_future().wait()
    handed = type(work).__name__
    group.unregister()
    return pending, right, handed, value[0] is bucket and bucket[:2].tolist()


def test_async_all_reduce_returns_before_it_is_done_and_ddp_gets_the_backends_future():
    """The copy back into float32 is chained on the inner operation's c10d
    future: the call returns at once, the handle completes by itself, and
    the process group gives torch a Work over that future (``NativeWork``),
    not its own Python handle that waits."""
    strategy = phalanx.resolve(
        "ddp", accelerator="cpu", devices=2, launcher="spawn", collective="compressed", inner="torch"
    )
    for pending, right, handed, value in strategy.launch(overlap):
        assert right, "a result differs from the sum"
        assert pending in (None, 8), f"{pending} of 8 all_reduces pending when the calls returned"
        assert handed == "NativeWork", handed
        assert value == [3.0, 3.0], value
