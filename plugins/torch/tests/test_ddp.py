"""The DDP strategies: gradient accumulation and module creation on the
device, in real gloo groups (every CPU precision: test_precisions_accelerators)."""

from __future__ import annotations

import functools

import pytest
import torch

import phalanx

pytestmark = pytest.mark.subprocess


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def accumulate(strategy):
    torch.manual_seed(0)
    model, optimizer = strategy.setup(torch.nn.Linear(4, 1), functools.partial(torch.optim.SGD, lr=0.1))
    x = torch.full((8, 4), float(strategy.global_rank + 1))  # each rank its own data
    with strategy.no_backward_sync(model):
        strategy.backward(model(x).sum())
    local = grads(model).clone()
    strategy.backward(model(x).sum())  # synchronised: the mean over ranks of both backwards
    synced = grads(model).clone()
    with strategy.no_backward_sync(model, enabled=False):
        pass
    return local, synced


def test_no_backward_sync_keeps_gradients_local_until_the_next_synchronised_backward():
    strategy = phalanx.resolve("ddp_fork", accelerator="cpu", devices=2)
    (local0, synced0), (local1, synced1) = strategy.launch(accumulate)
    assert not torch.equal(local0, local1)  # nothing was reduced inside the context
    torch.testing.assert_close(synced0, synced1)
    torch.testing.assert_close(synced0, (2 * local0 + 2 * local1) / 2)  # mean over ranks of two backwards


def create_on_device(strategy):
    with strategy.module_init_context():
        made = torch.nn.Linear(3, 3)
    with strategy.module_init_context(empty_init=True):
        skipped = torch.nn.init.constant_(torch.zeros(2), 5.0)
    return str(made.weight.dtype), str(made.weight.device), skipped.tolist()


@pytest.mark.parametrize(
    ("precision", "dtype"), [("32-true", "torch.float32"), ("bf16-true", "torch.bfloat16")]
)
def test_module_init_context_creates_in_the_precision_dtype_and_can_skip_init(precision, dtype):
    strategy = phalanx.resolve("ddp_fork", accelerator="cpu", devices=2, precision=precision)
    assert strategy.launch(create_on_device) == [(dtype, "cpu", [0.0, 0.0])] * 2
    assert torch.get_default_dtype() == torch.float32  # restored
