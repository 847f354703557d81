"""Training through a collective, and the bytes it carried: the rank
program of :class:`~phalanx.testing.suites.TrafficSuite`.

Each rank trains a small model for a few SGD steps under the strategy (DDP,
FSDP, or its own DDP over ``strategy.process_group`` under ``manual``), with
its own batch each step, while every tensor operation of the strategy's
collective object counts its calls and the bytes of the tensors it was
given. It then trains the same model alone, on every rank's batches, with
the gradients averaged by hand: what data-parallel training over any
correct transport reaches, to rounding.

Importing this module imports no torch; the rank program does.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..collective import OPERATIONS

__all__ = ["STEPS", "TENSOR_OPERATIONS", "count_calls", "run_traffic"]

#: SGD steps each rank takes.
STEPS = 3
#: The contract's operations on tensors (the object ones pickle, and are not
#: training traffic).
TENSOR_OPERATIONS = tuple(op for op in OPERATIONS if not op.endswith("_object"))
_BATCH = 8
_LR = 0.1


def count_calls(collective: Any) -> tuple[Counter[str], Counter[str]]:
    """Wrap every tensor operation of ``collective`` (this object only, as
    instance attributes) so that it counts its calls and the bytes of the
    tensors given to it; return the two counters, by operation name."""
    calls: Counter[str] = Counter()
    carried: Counter[str] = Counter()

    def wrap(operation: str, method: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[operation] += 1
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    if hasattr(tensor, "element_size") and hasattr(tensor, "numel"):
                        carried[operation] += tensor.element_size() * tensor.numel()
            return method(*args, **kwargs)

        counted.__name__ = operation
        return counted

    for operation in TENSOR_OPERATIONS:
        setattr(collective, operation, wrap(operation, getattr(collective, operation)))
    return calls, carried


def _model(torch: Any) -> Any:
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(torch: Any, rank: int, step: int) -> tuple[Any, Any]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(_BATCH, 16, generator=generator)
    return x, torch.randn(_BATCH, 4, generator=generator)


def _flat(module: Any) -> Any:
    import torch

    parts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in module.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in parts])


def _reference(world_size: int) -> Any:
    """The same steps in one process: each step's gradient is the mean of
    every rank's."""
    import torch

    model = _model(torch)
    optimizer = torch.optim.SGD(model.parameters(), lr=_LR)
    for step in range(STEPS):
        total = [torch.zeros_like(p) for p in model.parameters()]
        for rank in range(world_size):
            model.zero_grad()
            x, y = _batch(torch, rank, step)
            torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
            for t, p in zip(total, model.parameters(), strict=True):
                t.add_(p.grad)
        for t, p in zip(total, model.parameters(), strict=True):
            p.grad = t / world_size
        optimizer.step()
    return _flat(model)


def run_traffic(strategy: Any, kind: str) -> dict[str, Any]:
    """In every rank: train under ``strategy`` (``kind``: ``"ddp"``,
    ``"fsdp"`` or ``"manual"``) with the collective's operations counted.
    Returns this rank's weights, the reference weights, the counters and
    the bytes of the model's gradients."""
    import functools

    import torch

    rank = strategy.global_rank
    calls, carried = count_calls(strategy.collective)
    model = _model(torch)
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    factory = functools.partial(torch.optim.SGD, lr=_LR)
    if kind == "manual":
        wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=strategy.process_group)
        optimizer = factory(wrapped.parameters())
    else:
        wrapped, optimizer = strategy.setup(model, factory)
    for step in range(STEPS):
        x, y = _batch(torch, rank, step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(wrapped(x), y)
        if kind == "manual":
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        else:
            strategy.backward(loss)
            strategy.optimizer_step(optimizer)
    return {
        "rank": rank,
        "weights": _flat(wrapped.module if kind == "manual" else wrapped).tolist(),
        "reference": _reference(strategy.world_size).tolist(),
        "calls": dict(calls),
        "bytes": dict(carried),
        "gradient_bytes": gradient_bytes,
        "process_group": type(getattr(strategy, "process_group", None)).__name__,
    }
