"""Precisions and accelerators, by name, training for real."""

from __future__ import annotations

import functools

import pytest
import torch

import phalanx
from phalanx_core import MisconfigurationError, UnavailableError
from phalanx_torch.accelerators import CUDAAccelerator, MPSAccelerator

needs_cuda = pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a CUDA GPU")


def train(strategy, steps=30):
    torch.manual_seed(0)
    model, optimizer = strategy.setup(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)),
        functools.partial(torch.optim.SGD, lr=0.05),
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 8, generator=g)
    x, y = strategy.batch_to_device((x, x.sum(dim=1, keepdim=True)))
    losses, out_dtype = [], None
    for _ in range(steps):
        optimizer.zero_grad()
        with strategy.forward_context():
            out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y.float())
        out_dtype = out.dtype
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        losses.append(loss.item())
    param_dtype = next(model.parameters()).dtype
    return losses[0], losses[-1], str(param_dtype), str(out_dtype)


@pytest.mark.parametrize(
    ("precision", "param_dtype", "out_dtype"),
    [
        ("32-true", "torch.float32", "torch.float32"),
        ("64-true", "torch.float64", "torch.float64"),
        ("bf16-mixed", "torch.float32", "torch.bfloat16"),
        ("bf16-true", "torch.bfloat16", "torch.bfloat16"),
        ("16-true", "torch.float16", "torch.float16"),
    ],
)
def test_each_precision_trains_on_cpu(precision, param_dtype, out_dtype):
    strategy = phalanx.resolve("single_device", accelerator="cpu", precision=precision)
    [(first, last, params, out)] = strategy.launch(train)
    assert (params, out) == (param_dtype, out_dtype)
    assert last < first


@pytest.mark.subprocess
@pytest.mark.parametrize(
    ("precision", "param_dtype"),
    [
        ("32-true", "torch.float32"),
        ("64-true", "torch.float64"),
        ("bf16-mixed", "torch.float32"),
        ("bf16-true", "torch.bfloat16"),
        ("16-true", "torch.float16"),
    ],
)
def test_ddp_trains_in_every_cpu_precision(precision, param_dtype):
    strategy = phalanx.resolve("ddp_fork", accelerator="cpu", devices=2, precision=precision)
    first, second = strategy.launch(train, 20)
    assert first == second  # DDP keeps the ranks identical
    assert first[1] < first[0]
    assert first[2] == param_dtype


@pytest.mark.subprocess
def test_bf16_mixed_over_two_gloo_ranks():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cpu", devices=2, precision="bf16-mixed")
    results = strategy.launch(train, 20)
    assert len(results) == 2
    assert results[0] == results[1]  # DDP keeps the ranks identical
    assert results[0][1] < results[0][0]
    assert results[0][3] == "torch.bfloat16"


def test_16_mixed_on_cpu_is_refused_with_the_alternative():
    with pytest.raises(
        MisconfigurationError, match=r"'16-mixed' on accelerator 'cpu'.*use precision='bf16-mixed'"
    ):
        phalanx.resolve("single_device", accelerator="cpu", precision="16-mixed")


def test_precision_aliases():
    assert phalanx.plan("single_device", accelerator="cpu", precision="bf16").precision.name == "bf16-mixed"
    assert phalanx.plan("single_device", accelerator="cpu", precision=16).precision.name == "16-mixed"
    assert phalanx.plan("single_device", accelerator="cpu", precision=64).precision.name == "64-true"


def test_accelerators_say_why_they_are_unavailable():
    if torch.cuda.device_count() < 1:
        reason = CUDAAccelerator.availability().reason
        assert "accelerator='cpu'" in reason
        with pytest.raises(UnavailableError, match=r"accelerator 'cuda' cannot be used here: "):
            phalanx.resolve("single_device", accelerator="cuda")
        with pytest.raises(UnavailableError, match=r"accelerator 'cuda' cannot be used here"):
            phalanx.resolve("single_device", accelerator="gpu")  # the alias
    if not torch.backends.mps.is_available():
        assert "MPS" in MPSAccelerator.availability().reason
    plan = phalanx.plan(accelerator="auto")
    if torch.cuda.device_count() < 1:
        assert plan.accelerator.name in ("cpu", "mps")
        assert "skipped cuda:" in plan.accelerator.reason


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn", "fsdp", "manual"])
def test_parallel_strategies_on_mps_are_refused_saying_no_backend_moves_mps_tensors(monkeypatch, strategy):
    # As Fabric's tests fake a Mac: MPS there, one device.
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    with pytest.raises(MisconfigurationError, match=r"gloo moves cpu and cuda tensors only; no backend"):
        phalanx.resolve(strategy, accelerator="mps", devices=1)
    assert phalanx.resolve("single_device", accelerator="mps").root_device.type == "mps"


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build: 'gpu' is CUDA here")
def test_gpu_on_a_mac_names_mps(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with pytest.raises(UnavailableError, match=r"this machine's GPU is Apple's: use accelerator='mps'"):
        phalanx.resolve("single_device", accelerator="gpu")


# Every strategy in every precision on a GPU, 16-mixed's scaler in its
# checkpoints included: tests/test_cuda.py (programs of their own, so that
# CUDA is never initialised in pytest's process, which forks).


def nccl_all_reduce(strategy):
    t = torch.ones(1, device=strategy.root_device)
    strategy.all_reduce(t)
    return strategy.collective.backend, t.item()


@needs_cuda
def test_nccl_over_one_rank():
    strategy = phalanx.resolve("ddp_spawn", accelerator="cuda", devices=1)
    assert strategy.launch(nccl_all_reduce) == [("nccl", 1.0)]
