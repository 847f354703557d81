"""DDP and FSDP through the composed collectives against the plain torch
collective, and DDP over ``compressed`` against torch's own communication
hooks, in the same ranks, in interleaved blocks.

    python bench/composed_ddp.py [--steps 5] [--blocks 4] [--rate 1gbit] [--no-hosts] [--hidden 1024]

Each job is two ``phalanx run`` processes, one per node (``--node-rank``),
``--per-node`` ranks each; on loopback (127.0.0.1) and then, with root and
iproute2, on two test-bed hosts (phalanx_core.testing.hosts) whose link is
limited to ``--rate`` with ``tc tbf``. In every rank, the same MLP
(``--hidden``: 512 -> hidden -> 512, 4.2 MB of float32 gradients at 1024) is
trained several ways from the same weights on the same batches, ``--steps``
steps a block, the ways in rotating order each block:

* ``composed``: ``strategy.setup(model, ...)`` of ``ddp`` (or ``fsdp``)
  over the composed collective (its traffic through phalanx's process
  group);
* ``plain``: ``DistributedDataParallel`` (or ``fully_shard``) over torch's
  own gloo group of the same ranks (the one the torch collective made);
* DDP jobs over ``compressed`` also: ``bf16-hook``, plain DDP with
  ``bf16_compress_hook``; ``powersgd``, plain DDP with PowerSGD's hook
  (rank 1, error feedback, compressing from step 2; one bucket, as
  several mismatch their collectives over gloo). DDP's
  ``register_comm_hook`` refuses ``bf16_compress_hook`` by its name
  without NCCL; the bench registers it under another name (the hook runs on
  gloo as it is).

Printed: steps per second of each way (median of blocks), its ratio to
``plain`` (above 1: faster), and the loss of each model on one fixed batch
after the same steps; for DDP over ``compressed``, also its speed over the
bf16 hook's paired block by block (median and quartiles: the two ran back
to back in each block, so drift between blocks cancels). Jobs: ``compressed`` (1 rank per node) with DDP and
FSDP; ``hierarchical`` (2 ranks per node: both levels) with DDP and FSDP.
This prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = (
    ("compressed", "ddp", 1),
    ("compressed", "fsdp", 1),
    ("hierarchical", "ddp", 2),
    ("hierarchical", "fsdp", 2),
)


def make_model(hidden: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 512))


def _bf16_hook(hook):
    """torch's ``bf16_compress_hook`` itself, under another name: DDP's
    ``register_comm_hook`` refuses that name unless NCCL or XCCL is there
    (a check of the name; the hook runs on gloo as it is)."""

    def bf16_compress(state, bucket):
        return hook(state, bucket)

    return bf16_compress


def measure(strategy, kind: str, steps: int, blocks: int, hidden: int) -> dict:
    """The rank program: every way, ``blocks`` blocks of ``steps`` steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    sgd = functools.partial(torch.optim.SGD, lr=0.2)
    ways: dict[str, tuple] = {}
    model, optimizer = strategy.setup(make_model(hidden), sgd)
    ways["composed"] = (model, optimizer, strategy.backward, strategy.optimizer_step)

    def plain(hook=None, state=None, **ddp):
        net = make_model(hidden)
        if kind == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(net, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        else:
            net = DistributedDataParallel(net, **ddp)
            if hook is not None:
                net.register_comm_hook(state, hook)
        return net, sgd(net.parameters()), lambda loss: loss.backward(), lambda opt: opt.step()

    ways["plain"] = plain()
    if kind == "ddp" and strategy.collective.name == "compressed":
        ways["bf16-hook"] = plain(_bf16_hook(default_hooks.bf16_compress_hook), None)
        power = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2, use_error_feedback=True
        )
        # One bucket: PowerSGD starts its later all_reduces from gloo's
        # callback threads, in the order the buckets finish, which two
        # ranks can see differently (a collective mismatch: gloo aborts).
        ways["powersgd"] = plain(powerSGD_hook.powerSGD_hook, power, bucket_cap_mb=64)
    teacher = torch.nn.Linear(512, 512)
    torch.nn.init.normal_(teacher.weight, std=0.05, generator=torch.Generator().manual_seed(7))
    # Each way gets the same batches: its own generator, seeded by the rank.
    data = {name: torch.Generator().manual_seed(1000 + strategy.global_rank) for name in ways}

    def step(name: str) -> float:
        net, opt, backward, optimizer_step = ways[name]
        x = torch.randn(64, 512, generator=data[name])
        with torch.no_grad():
            y = torch.tanh(teacher(x))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        backward(loss)
        optimizer_step(opt)
        return float(loss.detach())

    for name in ways:  # warm up: two steps each (PowerSGD compresses from its second)
        step(name)
        step(name)
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for block in range(blocks):
        order = names[block % len(names) :] + names[: block % len(names)]
        for name in order:
            strategy.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                step(name)
            seconds[name].append((time.perf_counter() - start) / steps)
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        y = torch.tanh(teacher(x))
        losses = {name: float(torch.nn.functional.mse_loss(ways[name][0](x), y)) for name in ways}
    return {"seconds": seconds, "loss": losses, "steps": 2 + steps * blocks}


def _rank(args: argparse.Namespace) -> None:
    """A node's ranks under ``phalanx run`` (one job)."""
    import phalanx

    strategy = phalanx.resolve()
    results = strategy.launch(measure, args.kind, args.steps, args.blocks, args.hidden)
    if results[strategy.global_rank] is not None and strategy.global_rank == 0:
        print("RESULT " + json.dumps(results[0]), flush=True)


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_job(args, collective: str, kind: str, per_node: int, hosts=None) -> dict | None:
    """One job's two nodes, on loopback or on the test bed's ``hosts``."""
    from phalanx_core.testing.processes import scheduler_free_environment

    address, port = ("node0", "29631") if hosts else ("127.0.0.1", str(_port()))
    commands = [
        [sys.executable, "-m", "phalanx", "run", "--accelerator", "cpu", "--devices", str(per_node),
         "--num-nodes", "2", "--node-rank", str(node), "--main-address", address, "--main-port", port,
         "--strategy", kind, "--collective", collective, __file__, "--rank", "--kind", kind,
         "--steps", str(args.steps), "--blocks", str(args.blocks), "--hidden", str(args.hidden)]
        for node in (0, 1)
    ]  # fmt: skip
    environment = scheduler_free_environment(OMP_NUM_THREADS="1")
    pipes = {
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "text": True,
        "env": environment,
        "cwd": ROOT,
    }
    if hosts:
        processes = [host.popen(c, **pipes) for host, c in zip(hosts, commands, strict=True)]
    else:
        processes = [subprocess.Popen(c, **pipes) for c in commands]
    outputs = [p.communicate(timeout=1200) for p in processes]
    line = next((x for x in outputs[0][0].splitlines() if "RESULT " in x), None)
    if line is None:
        print(f"{collective}/{kind} failed:\n" + "\n".join(o[1][-3000:] for o in outputs), flush=True)
        return None
    return json.loads(line.split("RESULT ", 1)[1])


def report(where: str, collective: str, kind: str, per_node: int, found: dict) -> None:
    rates = {name: 1 / statistics.median(s) for name, s in found["seconds"].items()}
    plain = rates["plain"]
    print(f"{kind.upper()} through {collective}, 2 nodes x {per_node} ranks, {where} "
          f"(loss on a fixed batch after {found['steps']} steps):", flush=True)  # fmt: skip
    for name, rate in rates.items():
        print(f"  {name:9s} {rate:7.2f} steps/s  ratio to plain {rate / plain:.3f}  "
              f"loss {found['loss'][name]:.5f}", flush=True)  # fmt: skip
    if "bf16-hook" in rates:
        # Paired by block (the two ran back to back in it), which cancels
        # what drifts between blocks: the link, the other tenants.
        paired = [hook / mine for mine, hook in
                  zip(found["seconds"]["composed"], found["seconds"]["bf16-hook"], strict=True)]  # fmt: skip
        low, middle, high = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
        print(f"  composed / bf16-hook, paired by block: median {middle:.3f} "
              f"(quartiles {low:.3f}-{high:.3f}, {len(paired)} blocks)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--blocks", type=int, default=4, help="blocks per way")
    parser.add_argument("--hidden", type=int, default=1024, help="the MLP's hidden width")
    parser.add_argument("--rate", default="1gbit", help="the hosts' link rate (tc tbf)")
    parser.add_argument("--no-hosts", action="store_true", help="loopback only")
    parser.add_argument("--only", help="one collective: compressed or hierarchical")
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kind", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank:
        _rank(args)
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    jobs = [job for job in JOBS if args.only in (None, job[0])]
    for collective, kind, per_node in jobs:
        found = run_job(args, collective, kind, per_node)
        if found:
            report("loopback", collective, kind, per_node, found)
    if args.no_hosts:
        return
    from phalanx_core.testing.hosts import TestBed, missing

    if missing() is not None:
        print(f"test-bed part skipped: {missing()}")
        return
    with TestBed(2) as bed:
        for host in bed.hosts:
            host.run(["tc", "qdisc", "add", "dev", host.interface, "root", "tbf", "rate", args.rate,
                      "burst", "1mb", "latency", "100ms"], check=True)  # fmt: skip
        for collective, kind, per_node in jobs:
            found = run_job(args, collective, kind, per_node, hosts=bed.hosts)
            if found:
                report(f"link {args.rate}", collective, kind, per_node, found)


if __name__ == "__main__":
    main()
