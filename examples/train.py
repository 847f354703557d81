"""Train a small regression model under a named phalanx strategy.

    python examples/train.py --strategy single_device --accelerator cpu --steps 50
    python examples/train.py --strategy ddp_spawn --devices 2
    phalanx run --strategy ddp --devices 2 examples/train.py --steps 50

Prints the loss at the start and at the end of training on rank 0.
"""

from __future__ import annotations

import argparse
import functools

import torch

import phalanx


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def make_data(n: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=generator)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(n, 1, generator=generator)
    return x, y


def train(strategy, steps: int, lr: float = 0.05) -> dict[str, float]:
    """Run by the launcher on every rank; returns this rank's first and last loss."""
    torch.manual_seed(0)
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.SGD, lr=lr))
    x, y = strategy.batch_to_device(make_data())
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with strategy.forward_context():
            loss = torch.nn.functional.mse_loss(model(x), y)
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        losses.append(loss.detach())
    final = strategy.all_reduce(losses[-1].clone(), op="mean")
    strategy.print(f"loss {losses[0].item():.4f} -> {final.item():.4f} after {steps} steps")
    return {"first": losses[0].item(), "last": final.item()}


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", help="a strategy name (default: single_device, or phalanx run's)")
    parser.add_argument("--accelerator", help="an accelerator name (default: cpu, or phalanx run's)")
    parser.add_argument("--devices", help="N, -1, 'auto' or '0,2'")
    parser.add_argument("--precision", help="a precision name (default: 32-true)")
    parser.add_argument("--collective", help="a collective name (default: the strategy's)")
    parser.add_argument("--launcher", help="a launcher name (default: the strategy's)")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args(argv)
    flags = {k: v for k, v in vars(args).items() if k != "steps" and v is not None}
    if "devices" in flags and flags["devices"].lstrip("-").isdigit():
        flags["devices"] = int(flags["devices"])
    if not phalanx.under_run():  # phalanx run's flags are the defaults there
        flags.setdefault("strategy", "single_device")
        if "accelerator" not in flags:  # the CPU, unless the strategy runs elsewhere only (xla)
            only = phalanx.default_registry().get("strategy", flags["strategy"]).spec.accelerators
            flags["accelerator"] = "cpu" if not only or "cpu" in only else only[0]
    strategy = phalanx.resolve(**flags)
    return strategy.launch(train, args.steps)


if __name__ == "__main__":
    main()
