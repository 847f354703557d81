"""Rounds toward thousands of nodes, by simulation: phalanx's counted rounds
(the ``c10d`` rendezvous since 2026-11-26) against torch elastic's dynamic
rendezvous on the same store, in the same run.

    python bench/rounds_scale.py                                  # 64, 256, 1024 nodes, both
    python bench/rounds_scale.py --nodes 2048 --only counted --timeout 240

The driver hosts the job's store (``hosted_store``, its libuv thread in the
driver; the driver does nothing else, so its CPU time is the store's). Each
simulated node is a thread in one of ``--procs`` worker processes, with a
client of its own (made one at a time, up front: the client's constructor
looks its address up in the DNS), and does what a node's launching process
does with the store: ``_rounds.create`` from the parameters the launcher
gives (the handler the launcher uses: ``RoundRendezvous`` over the counted
rounds, or over elastic's dynamic handler with its c10d backend and a
keep-alive of ``keep_alive_for(N)``), ``next_rendezvous()`` and the read of
the job's restarts, then the rank loop's look for joining nodes
(``num_nodes_waiting()`` every 0.1 s). Until 2026-11-29 a node also did
elastic's agent's rank assignment on the round's store (one more request a
node); phalanx's agent loop numbers the ranks in two requests a node (and
node 0's two large ones), not simulated. Phases:

A. every node joins at once (``MIN = N - 1``, ``MAX = N``): the time to the
   last node's round, and the requests per node;
B. 10 s of training: requests per node and second, the store's CPU;
D. one node lost (its thread stops, its heartbeats with it), every other
   node meets again (as after a failure): the time to the last node's new
   round of ``N - 1``, and the requests per node.

Requests are counted at each client (``rendezvous_scale.CountedStore``).
Figures: bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

import torch.distributed as dist
from rendezvous_scale import LOOPBACK, MONITOR, CountedStore, Counts, elastic_dynamic, keep_alive_for
from torch.distributed.elastic.rendezvous import RendezvousParameters

from phalanx_core.launching import hosted_store
from phalanx_torch._nodes import job_store as _job_store
from phalanx_torch._nodes import rendezvous_place as _rendezvous_place
from phalanx_torch._nodes import rounds as _rounds


class Node:
    """One node's launching process, as far as the job's store sees it."""

    def __init__(self, index: int, cfg: SimpleNamespace, counts: Counts) -> None:
        self.index, self.cfg = index, cfg
        wait = datetime.timedelta(seconds=cfg.timeout)
        if cfg.etcd:  # the job's store in etcd, as the launcher makes it
            place = _rendezvous_place.parse_rendezvous(f"etcd://{LOOPBACK}:{cfg.etcd}/bench", LOOPBACK, 0)
            inner = _job_store.job_store(place, host=None, timeout=cfg.timeout)
        else:
            place = _rendezvous_place.parse_rendezvous(None, LOOPBACK, cfg.port)
            inner = dist.TCPStore(LOOPBACK, cfg.port, is_master=False, timeout=wait)
        self.client = CountedStore(inner, counts, "rdzv")
        params = RendezvousParameters(
            backend=_rounds.ELASTIC,
            endpoint=place.endpoint,
            run_id=place.name,
            min_nodes=cfg.nodes - 1,
            max_nodes=cfg.nodes,
            local_addr=f"node{index}",
            place=place,
            listen=LOOPBACK,
            job_store=_job_store.JobStore.given(place, self.client, timeout=cfg.timeout, hosted=True),
            timeout=cfg.timeout,
            join_timeout=cfg.timeout,
            last_call_timeout=cfg.last_call,
            close_timeout=30,
            keep_alive_interval=keep_alive_for(cfg.nodes),
            keep_alive_max_attempt=3,
        )
        if cfg.rendezvous == "counted":
            self.handler = _rounds.create(params)
        else:  # what _rounds.create made for node 0's store before the counted rounds
            self.handler = elastic_dynamic(params, self.client, place, cfg.timeout)
        self.stop = threading.Event()

    def meet(self) -> tuple[int, int, int]:
        info = self.handler.next_rendezvous()
        self.handler.restarts()  # the rank loop's read of the job's restarts (its ranks are arithmetic)
        return self.handler.round, info.rank, info.world_size

    def train(self, until: threading.Event) -> None:
        """The agent's loop while the ranks are healthy."""
        while not until.wait(MONITOR) and not self.stop.is_set():
            if self.handler.num_nodes_waiting() > 0:
                return

    def lose(self) -> None:
        """As if the node's host went away: no requests, no heartbeats."""
        self.stop.set()
        inner = self.handler._inner
        if hasattr(inner, "_stop_heartbeats"):
            inner._stop_heartbeats()


def _worker(indices: list[int], cfg: SimpleNamespace, commands: Any, events: Any) -> None:
    if cfg.nice:  # the nodes yield the cores to the store, as if it had cores of its own
        os.nice(cfg.nice)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a client (and a socket) a node
    counts = Counts()
    nodes = {i: Node(i, cfg, counts) for i in indices}
    events.put(("ready", indices[0]))
    training = threading.Event()
    while True:
        command, *args = commands.get()
        if command == "meet":
            who = [n for n in nodes.values() if not n.stop.is_set()]

            def one(node: Node) -> None:
                try:
                    result = node.meet()
                    events.put(("met", node.index, *result, time.monotonic()))
                except Exception as exc:  # noqa: BLE001 - reported to the driver
                    events.put(("error", node.index, f"{type(exc).__name__}: {exc}"[:300]))

            for node in who:
                threading.Thread(target=one, args=(node,), daemon=True).start()
        elif command == "train":
            training.clear()
            for node in nodes.values():
                threading.Thread(target=node.train, args=(training,), daemon=True).start()
        elif command == "pause":
            training.set()
        elif command == "lose":
            if args[0] in nodes:
                nodes[args[0]].lose()
        elif command == "counts":
            events.put(("counts", indices[0], counts.snapshot()))
        elif command == "quit":
            training.set()
            events.put(("bye", indices[0]))
            return


def _requests(table: dict[str, list[int]]) -> int:
    return sum(row[0] for row in table.values())


class Run:
    def __init__(self, n: int, rendezvous: str, args: argparse.Namespace) -> None:
        self.n, self.args = n, args
        _job_store.allow_connections(2 * n)
        self.store = hosted_store(LOOPBACK, 0, timeout=datetime.timedelta(seconds=args.timeout))
        self.etcd = _start_etcd() if args.store == "etcd" else None
        self.cfg = SimpleNamespace(
            etcd=self.etcd[1] if self.etcd else None,
            port=self.store.port,
            nodes=n,
            timeout=args.timeout,
            last_call=args.last_call,
            rendezvous=rendezvous,
            nice=args.nice,
        )
        ctx = mp.get_context("spawn")
        self.events: Any = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(args.procs)]
        shares = [list(range(n))[w :: args.procs] for w in range(args.procs)]
        self.procs = [
            ctx.Process(target=_worker, args=(share, self.cfg, q, self.events), daemon=True)
            for share, q in zip(shares, self.commands, strict=True)
            if share
        ]
        for proc in self.procs:
            proc.start()
        self._expect("ready", len(self.procs), 600)

    def _expect(self, kind: str, count: int, timeout: float) -> list[tuple[Any, ...]]:
        got, deadline = [], time.monotonic() + timeout
        while len(got) < count:
            try:
                event = self.events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                break
            if event[0] == "error":
                print(f"  node {event[1]}: {event[2]}", file=sys.stderr)
                count -= 1
            elif event[0] == kind:
                got.append(event)
        return got

    def send(self, *command: Any) -> None:
        for q in self.commands:
            q.put(command)

    def counts(self) -> int:
        """Requests so far: the calls every client made, or, in etcd, the
        requests its server handled (its metrics: an ``add`` is a read and
        one or more compare-and-swaps there)."""
        if self.etcd is not None:
            return _etcd_requests(self.etcd[1])
        self.send("counts")
        return sum(_requests(e[2]) for e in self._expect("counts", len(self.procs), 60))

    def meet(self, nodes: int) -> dict[str, Any]:
        before, cpu = self.counts(), time.process_time()
        start = time.monotonic()
        self.send("meet")
        met = self._expect("met", nodes, self.args.timeout + 30)
        took = max((e[5] for e in met), default=float("nan")) - start
        requests = self.counts() - before
        rounds = {(e[2], e[4]) for e in met}
        ranks = sorted(e[3] for e in met)
        return {
            "met": len(met),
            "seconds": took if len(met) == nodes else float("nan"),
            "rounds": sorted(rounds),
            "ranks_ok": ranks == list(range(len(met))),
            "per_node": requests / nodes,
            "store_cpu_s": time.process_time() - cpu,
        }

    def train(self, seconds: float) -> dict[str, Any]:
        before, cpu = self.counts(), time.process_time()
        self.send("train")
        time.sleep(seconds)
        self.send("pause")
        requests = self.counts() - before
        return {"per_node_s": requests / self.n / seconds, "store_cpu": (time.process_time() - cpu) / seconds}

    def close(self) -> None:
        self.send("quit")
        self._expect("bye", len(self.procs), 30)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        if self.etcd is not None:
            self.etcd[0].kill()
            self.etcd[0].wait()
            shutil.rmtree(self.etcd[2], ignore_errors=True)


def _start_etcd() -> tuple[subprocess.Popen, int, str]:
    """A one-member etcd on 127.0.0.1 (the ``etcd`` on PATH), its data in a
    new folder; waits until it answers."""
    etcd = shutil.which("etcd")
    if etcd is None:
        raise SystemExit("rounds_scale: --store etcd needs etcd on PATH (apt-get install etcd-server)")
    client, peer = _free_port(), _free_port()
    data = tempfile.mkdtemp(prefix="rounds-scale-etcd-")
    argv = [
        etcd, "--data-dir", data, "--listen-client-urls", f"http://{LOOPBACK}:{client}",
        "--advertise-client-urls", f"http://{LOOPBACK}:{client}",
        "--listen-peer-urls", f"http://{LOOPBACK}:{peer}", "--log-level", "error",
        "--quota-backend-bytes", str(8 << 30),
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from phalanx_torch._nodes import etcd3 as _etcd3

    _etcd3.check_reachable([(LOOPBACK, client)], 30)
    return process, client, data


def _etcd_requests(port: int) -> int:
    """The KV and lease requests etcd handled so far (``/metrics``)."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=30).read().decode()
    total = 0
    for line in text.splitlines():
        served = 'grpc_service="etcdserverpb.KV"' in line or 'grpc_service="etcdserverpb.Lease"' in line
        if line.startswith("grpc_server_handled_total{") and served:
            total += int(float(line.rsplit(" ", 1)[1]))
    return total


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return int(probe.getsockname()[1])


def _line(label: str, value: str) -> None:
    print(f"  {label:<44} {value}")


def run_one(n: int, rendezvous: str, args: argparse.Namespace) -> dict[str, Any]:
    print(
        f"\n== {n} nodes, {rendezvous} rounds on {args.store} ({args.procs} processes, "
        f"last call {args.last_call} s{f', nodes at nice {args.nice}' if args.nice else ''})",
        flush=True,
    )
    run = Run(n, rendezvous, args)
    try:
        a = run.meet(n)
        _line(
            "A. all join: last node in its round",
            f"{a['seconds']:.2f} s ({a['met']}/{n}, rounds {a['rounds']})",
        )
        _line("A. requests per node", f"{a['per_node']:.1f}")
        _line("A. store CPU", f"{a['store_cpu_s']:.2f} s")
        if a["met"] < n:
            _line("(no round formed: B and D skipped)", "")
            return {"nodes": n, "rendezvous": rendezvous, "A": a}
        b = run.train(args.steady)
        _line("B. requests per node and second", f"{b['per_node_s']:.2f}")
        _line("B. store CPU", f"{100 * b['store_cpu']:.1f} % of a core")
        run.send("lose", n - 1)
        d = run.meet(n - 1)
        _line(
            "D. node lost: last node in a round of N-1",
            f"{d['seconds']:.2f} s ({d['met']}/{n - 1}, rounds {d['rounds']})",
        )
        _line("D. requests per node", f"{d['per_node']:.1f}")
        return {"nodes": n, "rendezvous": rendezvous, "A": a, "B": b, "D": d}
    finally:
        run.close()
        del run.store


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="64,256,1024", help="node counts, comma-separated")
    parser.add_argument("--only", choices=["counted", "dynamic"], help="one rendezvous (default: both)")
    parser.add_argument("--procs", type=int, default=8, help="worker processes")
    parser.add_argument("--last-call", type=int, default=3, help="seconds (the launcher's last_call)")
    parser.add_argument("--steady", type=float, default=10.0, help="seconds of phase B")
    parser.add_argument("--timeout", type=float, default=120.0, help="each node's join timeout, s")
    parser.add_argument(
        "--store",
        choices=["c10d", "etcd"],
        default="c10d",
        help="node 0's store, or etcd",
    )
    parser.add_argument(
        "--nice",
        type=int,
        default=0,
        help="the worker processes' niceness (e.g. 19): the store (etcd, or the driver's) is then served "
        "first, as a real store's own cores would serve it, where the simulated nodes would take the cores",
    )
    args = parser.parse_args()
    if args.nice < 0 and os.geteuid() != 0:
        parser.error(f"--nice {args.nice}: a priority above the default needs root; give 0 to 19")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    print(f"rounds_scale: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}", flush=True)
    for n in (int(x) for x in args.nodes.split(",")):
        for rendezvous in [args.only] if args.only else ["counted", "dynamic"]:
            started = time.monotonic()
            run_one(n, rendezvous, args)
            print(f"  (phase run took {time.monotonic() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
