"""TorchFT wired by hand: what a lost replica group costs the others, the
baseline that ``ddp_ft`` (issue 41) is measured against.

    pip install torchft==0.2.0          # beside torch; not a phalanx dependency
    python bench/torchft_by_hand.py [--groups 3] [--steps 150] [--step-time 0.25]
                                    [--kills 3] [--down 2] [--heartbeat-ms 1000]
                                    [--hosts N] [--json]

What runs, all on 127.0.0.1 (with ``--hosts N``: on N hosts made of network
namespaces, root and iproute2), CPU and gloo:

* TorchFT's lighthouse (``torchft.coordination.LighthouseServer``) in this
  process: ``min_replicas=1``, a 100 ms quorum tick, ``--heartbeat-ms``
  (TorchFT's default is 5000).
* ``--groups`` replica groups of one process each (this file with
  ``--group N``), each as TorchFT's own examples wire it: a ``TCPStore`` of
  the group's own, a ``Manager`` over a ``ProcessGroupGloo`` (timeouts 1 s,
  the quorum's 10 s), TorchFT's ``DistributedDataParallel`` and
  ``Optimizer`` wrappers, a small model, ``--step-time`` seconds of padding
  before each backward. Every committed step prints a line.
* The driver kills group 1 with SIGKILL ``--kills`` times, each time once
  the groups have committed 15 more steps, and starts it again ``--down``
  seconds later; the new process heals from a peer (TorchFT copies the
  state over HTTP; no checkpoint file exists).
* ``--hosts N`` (``--groups`` is then N): group i runs on host i, its store
  and manager on the host's address; the lighthouse runs on host 0 (as
  ``phalanx run`` puts it on node 0), and a kill is of every process of
  host 1 (a lost machine). ``bench/ddp_ft.py --hosts N`` runs this beside
  ``ddp_ft`` on the same hosts.

It prints, per kill: each survivor's longest gap between two committed
steps from the kill to the restart's first committed step, the steps a
survivor tried and did not commit, and the time from the restart to the
healed group's first commit; at the end, whether every group ended with the
same weights and how many states each loaded.

One change to TorchFT: its ``DistributedDataParallel`` comm hook asserts
when an all-reduce failed (torchft 0.2.0, ``ddp.py``: ``assert fut._fut``
after ``work.wait()`` returned False), which killed every survivor at the
first kill; the hook here waits and returns the bucket, and the failed step
is not committed (``Optimizer.step`` asks ``should_commit``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any


def group_main(args: argparse.Namespace) -> None:
    import torch
    from torch import nn
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    class Ddp(DistributedDataParallel):  # see the module's docstring
        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]
            state.allreduce(bucket.buffer()).wait()
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loads = [0]

    def load_state_dict(state: dict) -> None:
        loads[0] += 1
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict() -> dict:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    store = torch.distributed.TCPStore(args.address, 0, is_master=True, wait_for_workers=False)
    second = timedelta(seconds=1)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=second),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        replica_id=f"group_{args.group}",
        store_addr=args.address,
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname=args.address,
        timeout=second,
        quorum_timeout=timedelta(seconds=10),
        connect_timeout=timedelta(seconds=10),
    )
    ddp = Ddp(manager, model)
    optimizer = Optimizer(manager, inner)
    while manager.current_step() < args.steps:
        step = manager.current_step()
        optimizer.zero_grad()  # starts the quorum
        data = torch.Generator().manual_seed(step)
        x = torch.randn(64, 64, generator=data)
        loss = nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
        time.sleep(args.step_time)
        loss.backward()  # the comm hook: the manager's all-reduce
        optimizer.step()  # steps only if the quorum commits
        print("COMMIT" if manager.current_step() > step else "MISSED", step, flush=True)
    torch.save(
        {"weights": [p.detach() for p in model.parameters()], "loads": loads[0]},
        Path(args.out) / f"group{args.group}.pt",
    )
    manager.shutdown()


def serve_lighthouse(args: argparse.Namespace) -> None:
    """``--hosts``: the lighthouse, in a process of host 0's, until killed."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(
        bind=args.serve, min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100,
        heartbeat_timeout_ms=args.heartbeat_ms,
    )  # fmt: skip
    print(lighthouse.address(), flush=True)
    while True:
        time.sleep(60)


class Group:
    """One replica group's process and the times of its committed steps."""

    def __init__(self, index: int, argv: list[str], host: Any = None) -> None:
        self.index = index
        self.argv = argv
        self.host = host
        self.commits: list[float] = []
        self.missed = 0
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> float:
        started = time.monotonic()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        options: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL, "text": True}
        if self.host is None:
            self.process = subprocess.Popen(self.argv, env=env, **options)
        else:  # gloo on the host's interface, not its name's 127.0.1.1
            env["GLOO_SOCKET_IFNAME"] = self.host.interface
            self.process = self.host.popen(self.argv, env=env, **options)
        threading.Thread(target=self._read, args=(self.process,), daemon=True).start()
        return started

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("COMMIT"):
                self.commits.append(time.monotonic())
            elif line.startswith("MISSED"):
                self.missed += 1

    def kill(self, bed: Any = None) -> float:
        assert self.process is not None
        if bed is None:
            self.process.send_signal(signal.SIGKILL)
        else:
            bed.kill_all(self.host)  # the whole host
        killed = time.monotonic()
        self.process.wait()
        return killed

    def longest_gap(self, since: float, until: float) -> float:
        times = [t for t in self.commits if since <= t <= until]
        before = [t for t in self.commits if t < since]
        times = before[-1:] + times
        return max((b - a for a, b in itertools.pairwise(times)), default=float("nan"))


def wait_for(condition, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the groups stopped committing steps")
        time.sleep(0.05)


def driver(args: argparse.Namespace, bed: Any = None, first_kill_after: int = 15) -> dict:
    """Run the groups (on ``bed``'s hosts, one a host, where given) and
    kill group 1 ``args.kills`` times, the first once group 0 has committed
    ``first_kill_after`` steps."""
    os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum at info
    import torch

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server: Any
    if bed is None:
        from torchft.coordination import LighthouseServer

        server = LighthouseServer(
            bind=f"127.0.0.1:{port}",
            min_replicas=1,
            join_timeout_ms=1000,
            quorum_tick_ms=100,
            heartbeat_timeout_ms=args.heartbeat_ms,
        )
        url = server.address()
    else:
        serve = [sys.executable, __file__, "--serve", f"{bed.hosts[0].address}:{port}"]
        server = bed.hosts[0].popen(
            [*serve, "--heartbeat-ms", str(args.heartbeat_ms)], stdout=subprocess.PIPE, text=True
        )
        server.stdout.readline()  # up (its own address names host 0, which is 127.0.1.1 there)
        url = f"http://{bed.hosts[0].address}:{port}"
    out = tempfile.mkdtemp(prefix="torchft-by-hand-")
    common = ["--lighthouse", url, "--steps", str(args.steps)]
    common += ["--step-time", str(args.step_time), "--out", out]
    groups = []
    for i in range(args.groups):
        host = None if bed is None else bed.hosts[i]
        address = ["--address", host.address] if host is not None else []
        groups.append(Group(i, [sys.executable, __file__, "--group", str(i), *common, *address], host))
    kills = []
    try:
        for group in groups:
            group.start()
        victim, survivors = groups[1], [g for g in groups if g is not groups[1]]
        for kill in range(args.kills):
            target = len(survivors[0].commits) + (first_kill_after if kill == 0 else 15)
            wait_for(lambda t=target: len(survivors[0].commits) >= t, 120)
            missed = [g.missed for g in survivors]
            killed = victim.kill(bed)
            time.sleep(args.down)
            healed_from = len(victim.commits)
            restarted = victim.start()
            wait_for(lambda n=healed_from: len(victim.commits) > n, 120)
            back = victim.commits[healed_from]
            kills.append(
                {
                    "survivor_longest_gap_s": [round(g.longest_gap(killed, back), 3) for g in survivors],
                    "survivor_steps_not_committed": [
                        g.missed - m for g, m in zip(survivors, missed, strict=True)
                    ],
                    "restart_to_first_commit_s": round(back - restarted, 3),
                }
            )
        for group in groups:
            assert group.process is not None
            group.process.wait(timeout=600)
    finally:
        for group in groups:
            if group.process is not None and group.process.poll() is None:
                group.process.kill()
        if bed is None:
            server.shutdown()
        else:
            bed.kill_all(bed.hosts[0])
            server.wait()
    ends = [torch.load(Path(out) / f"group{g.index}.pt") for g in groups]
    first = ends[0]["weights"]
    same = all(all(torch.equal(a, b) for a, b in zip(first, end["weights"], strict=True)) for end in ends[1:])
    steady = [b - a for a, b in itertools.pairwise(groups[0].commits)]
    return {
        "groups": args.groups,
        "step_time_s": args.step_time,
        "heartbeat_ms": args.heartbeat_ms,
        "median_step_s": round(sorted(steady)[len(steady) // 2], 3),
        "kills": kills,
        "same_weights": same,
        "state_loads": [end["loads"] for end in ends],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--step-time", type=float, default=0.25)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--down", type=float, default=2.0, help="seconds the killed group stays down")
    parser.add_argument("--heartbeat-ms", type=int, default=1000)
    parser.add_argument("--hosts", type=int, help="N hosts of network namespaces, one group a host (root)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--group", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--lighthouse", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.group is not None:
        group_main(args)
        return
    if args.serve is not None:
        serve_lighthouse(args)
        return
    if args.hosts is None:
        result = driver(args)
    else:
        from phalanx_core.testing.hosts import TestBed

        args.groups = args.hosts
        with TestBed(args.hosts, subnet="192.168.83") as bed:
            result = driver(args, bed)
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"torchft by hand: {args.groups} groups of 1 process, step {result['median_step_s']} s "
        f"(padding {args.step_time} s), lighthouse heartbeat timeout {args.heartbeat_ms} ms"
    )
    for i, kill in enumerate(result["kills"], 1):
        gaps, lost = kill["survivor_longest_gap_s"], kill["survivor_steps_not_committed"]
        back = kill["restart_to_first_commit_s"]
        print(f"kill {i}: survivors' longest gap {gaps} s, steps not committed {lost}, ", end="")
        print(f"restart to first commit {back} s")
    same, loads = result["same_weights"], result["state_loads"]
    print(f"same weights on every group: {same}; state loads per group (the last process of each): {loads}")


if __name__ == "__main__":
    main()
