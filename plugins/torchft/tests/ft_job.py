"""The training script of phalanx-torchft's tests and ``Job``, a ``phalanx
run`` of it (on this host, or one per host of a test bed), its output read
as it comes."""

from __future__ import annotations

import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCRIPT = textwrap.dedent(
    """
    import functools, os, signal, sys, time
    from pathlib import Path
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset
    import phalanx

    out = Path(sys.argv[1])
    stop = None  # the step every group stops at, once the test writes it
    # The step at which group 1's rank 0 stops, its batch in hand, to be killed.
    park = int((out / "park-at").read_text()) if (out / "park-at").exists() else None
    options = {}
    if (out / "fsdp-options").exists():  # hsdp_ft with FSDP's options that a command line cannot give
        from torch.distributed.fsdp import MixedPrecisionPolicy
        options = dict(
            shard_modules={nn.Linear},
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            cpu_offload=True,
        )
    strategy = phalanx.resolve(**options)
    strategy.launch()
    # "GROUP RANK STEP" in stall-at: that rank stops itself (SIGSTOP: alive,
    # answering nothing) at that step in its gradients' all-reduce, before
    # the one across groups, until its group is stopped.
    if (out / "stall-at").exists():
        group, rank, at = map(int, (out / "stall-at").read_text().split())
        if (strategy.replica_group, strategy.global_rank) == (group, rank):
            across = strategy.manager.allreduce

            def stalling(*args, **kwargs):
                if (
                    strategy.current_step >= at
                    and strategy.participants == strategy.replica_groups  # every group in the step
                    and not (out / "stalled").exists()
                ):
                    (out / "stalled.tmp").write_text(str(os.getpid()))
                    (out / "stalled.tmp").rename(out / "stalled")
                    os.kill(os.getpid(), signal.SIGSTOP)  # its threads too: gloo's sends stop mid-way
                return across(*args, **kwargs)

            strategy.manager.allreduce = stalling
    # The bytes each all_reduce between the groups gave the collective
    # that carries them (compressed's inner one), by dtype.
    # Each size (bytes) it got, by dtype; and the sizes of the float32
    # tensors the strategy gave TorchFT's manager to average.
    carrier = getattr(strategy.across, "inner", strategy.across)
    across_sizes, across_calls, given_sizes = {}, {}, set()
    reduce_across, average = carrier.all_reduce, strategy.manager.allreduce

    def carried(tensor, *args, **kwargs):
        kind = str(tensor.dtype).replace("torch.", "")
        across_sizes.setdefault(kind, set()).add(tensor.numel() * tensor.element_size())
        across_calls[kind] = across_calls.get(kind, 0) + 1
        return reduce_across(tensor, *args, **kwargs)

    def given(tensor, *args, **kwargs):
        if tensor.dtype == torch.float32:
            given_sizes.add(tensor.numel() * tensor.element_size())
        return average(tensor, *args, **kwargs)

    def parted(tensors, *args, **kwargs):  # compressed's int8 all_reduce: its parts to their ranks
        across_calls["all_to_all"] = across_calls.get("all_to_all", 0) + 1
        return part_across(tensors, *args, **kwargs)

    part_across = carrier.all_to_all
    carrier.all_reduce = carried
    carrier.all_to_all = parted
    strategy.manager.allreduce = given
    torch.manual_seed(strategy.replica_group)  # unlike on purpose: step 0 makes them alike
    loads = []

    class Model(nn.Sequential):
        def load_state_dict(self, state, *args, **kwargs):
            loads.append(strategy.current_step)
            return super().load_state_dict(state, *args, **kwargs)

    workers = int((out / "workers").read_text()) if (out / "workers").exists() else 0
    readers = set()

    class Samples(Dataset):
        def __len__(self):
            return 120

        def __getitem__(self, i):
            if os.getpid() not in readers:  # which processes read samples (the workers, if any)
                readers.add(os.getpid())
                (out / f"read-by-{os.getpid()}").write_text("")
            return i, torch.randn(8, generator=torch.Generator().manual_seed(i))

    model = Model(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    model, optimizer = strategy.setup(model, functools.partial(torch.optim.SGD, lr=0.05))
    loader = strategy.setup_dataloader(DataLoader(Samples(), batch_size=2, shuffle=True, num_workers=workers))
    local = lambda p: p.to_local() if hasattr(p, "to_local") else p  # hsdp_ft: this rank's shard
    batches = iter(loader)
    if (out / "epoch-loop").exists():  # a DDP script's epoch loop, set_epoch and all

        def epochs():
            epoch = 0
            while True:
                loader.set_epoch(epoch)
                yield from loader
                epoch += 1

        batches = epochs()
    where = f"group={strategy.replica_group} rank={strategy.global_rank} pid={os.getpid()}"
    # Each line also in a file of this process's: what a kill of the
    # processes that relay the output (a whole host) leaves unsaid is there.
    records = open(out / f"records-{os.getpid()}", "a", buffering=1)

    def say(line):
        print(line, flush=True)
        records.write(line + "\\n")
    while True:
        if stop is None and (out / "stop").exists():
            stop = int((out / "stop").read_text())
        if stop is not None and strategy.current_step >= stop:
            break
        step = strategy.current_step
        optimizer.zero_grad()
        try:
            ids, x = next(batches)
        except StopIteration:
            batches = iter(loader)
            ids, x = next(batches)
        say(f"BATCH {where} step={step} epoch={loader.batch_epoch} ids={','.join(map(str, ids.tolist()))}")
        victim = out / "victim"
        # Parked once every group is in the step (one slow to start has
        # joined): the others then heal it from the job's step.
        if park is not None and strategy.replica_group == 1 and strategy.global_rank == 0 and step >= park \
                and strategy.participants == strategy.replica_groups and not victim.exists():
            (out / "victim.tmp").write_text(str(os.getpid()))
            (out / "parked-at").write_text(str(step))
            (out / "victim.tmp").rename(victim)
            for _ in range(1200):  # the test kills this process here, its batch in hand, or wakes it
                if (out / "wake").exists():
                    break
                time.sleep(0.1)
        # In float32 whatever the model computes in: torch 2.9's mse_loss
        # cannot take the backward of a bfloat16 output against a float32 target.
        loss = nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True))
        time.sleep(0.1)
        strategy.backward(loss)
        strategy.optimizer_step(optimizer)
        say(f"STEP {where} step={step} committed={strategy.committed} "
              f"participants={strategy.participants} participating={strategy.participating} "
              f"t={time.monotonic():.3f} "
              f"sum={sum(float(local(p).detach().square().sum()) for p in model.parameters()):.6f}")
        if getattr(strategy, "at_sync", False):  # local_sgd_ft, diloco_ft: a window's end
            parts = ",".join(
                f"{sum(float(p.detach().square().sum()) for p in child.parameters()):.6f}"
                for child in strategy.unwrap_module(model).children() if any(True for _ in child.parameters())
            )
            say(f"SYNC {where} step={strategy.current_step} committed={strategy.committed} "
                f"contributed={strategy.contributed} parts={parts}")
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    torch.save(
        {"weights": whole, "loads": loads, "restarts": strategy.restart_count, "rereads": loader.rereads,
         "across": {"sizes": across_sizes, "calls": across_calls, "given": given_sizes,
                    "collective": type(strategy.across).__name__}},
        out / f"group{strategy.replica_group}-rank{strategy.global_rank}-{os.getpid()}.pt",
    )
    print(f"DONE {where}", flush=True)
    """
)

#: A script that saves a checkpoint every three steps and resumes from the newest.
CHECKPOINTED = textwrap.dedent(
    """
    import functools, os, sys
    from pathlib import Path
    import torch
    import phalanx
    from phalanx_core import CheckpointDirectory

    out, until = Path(sys.argv[1]), int(sys.argv[2])
    strategy = phalanx.resolve()
    strategy.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    model, optimizer = strategy.setup(model, functools.partial(torch.optim.SGD, lr=0.1))
    checkpoints = CheckpointDirectory(out / "ckpt")
    first = strategy.resume(checkpoints, {"model": model, "optimizer": optimizer})
    if strategy.global_rank == 0:
        print(f"RESUMED group={strategy.replica_group} at={first} step={strategy.current_step}", flush=True)
    while strategy.current_step < until:
        optimizer.zero_grad()
        strategy.backward(model(torch.ones(2, 4)).sum())
        strategy.optimizer_step(optimizer)
        if strategy.current_step % 3 == 0:
            checkpoints.save(strategy, strategy.current_step, {"model": model, "optimizer": optimizer})
            if strategy.is_global_zero:
                print(f"WROTE group={strategy.replica_group} step={strategy.current_step}", flush=True)
    """
)


LINE = re.compile(
    r"STEP group=(\d+) rank=(\d+) pid=(\d+) step=(\d+) committed=(\w+) participants=(\d+) "
    r"participating=(\w+) t=([\d.]+) sum=([\d.]+)"
)
BATCH = re.compile(r"BATCH group=(\d+) rank=(\d+) pid=(\d+) step=(\d+) epoch=(\d+) ids=([\d,]+)")
SYNC = re.compile(
    r"SYNC group=(\d+) rank=(\d+) pid=(\d+) step=(\d+) committed=(\w+) contributed=(\w+) parts=([\w.,+-]+)"
)


class Job:
    """A ``phalanx run`` of the script: on this host, or on each of
    ``hosts`` (a test bed's) as node ``i`` of ``len(hosts)``, node 0's
    address the main address; started by the command ``launch`` (``srun
    ...``) where given, on the bed's host ``where`` if given, in ``env``
    (default this process's). Every process's output is read as it comes,
    into one list of lines."""

    def __init__(
        self,
        tmp_path: Path,
        *flags: str,
        strategy: str = "ddp_ft",
        park_at: int | None = None,
        stall_at: tuple[int, int, int] | None = None,
        fsdp_options: bool = False,
        workers: int = 0,
        epoch_loop: bool = False,
        hosts: Sequence[Any] = (),
        port: int = 29640,
        launch: Sequence[str] = (),
        env: dict[str, str] | None = None,
        where: Any = None,
        started: Sequence[int] | None = None,
    ) -> None:
        (tmp_path / "train.py").write_text(SCRIPT)
        self.tmp_path = tmp_path
        self.out = tmp_path / "out"
        self.out.mkdir()
        if park_at is not None:
            (self.out / "park-at").write_text(str(park_at))
        if stall_at is not None:  # (group, rank, step)
            (self.out / "stall-at").write_text(" ".join(map(str, stall_at)))
        if workers:  # the DataLoader's num_workers
            (self.out / "workers").write_text(str(workers))
        if epoch_loop:  # for epoch in count(): loader.set_epoch(epoch); for batch in loader: ...
            (self.out / "epoch-loop").write_text("")
        if fsdp_options:  # shard each Linear, bf16 parameters, offloaded to CPU memory
            (self.out / "fsdp-options").write_text("")
        self.lines: list[str] = []
        # (group, rank, pid, step, committed, participants, t, participating, sum of squares)
        self.steps: list[tuple[int, int, int, int, bool, int, float, bool, str]] = []
        self.participated: dict[int, list[bool]] = {}  # by pid: each step's
        self.batches: dict[int, list[tuple[int, list[int]]]] = {}  # by pid: (epoch, ids)
        self.drawn: dict[int, list[tuple[int, int, int]]] = {}  # by pid: (group, rank, step) of each batch
        # local_sgd_ft, diloco_ft: (group, rank, pid, step, committed, contributed, parts' sums) of each
        # sync; by pid, its batches and syncs in order.
        self.syncs: list[tuple[int, int, int, int, bool, bool, str]] = []
        self.events: dict[int, list[tuple[str, Any, list[int]]]] = {}
        self.command = [
            *launch, sys.executable, "-m", "phalanx", "run", "--strategy", strategy, "--accelerator", "cpu",
            *flags,
        ]  # fmt: skip
        self.hosts = list(hosts)
        self.where = where  # the test bed's host that runs ``launch`` (default: this machine)
        self.port = port
        self.env = dict(os.environ if env is None else env)
        self._lock = threading.Lock()
        self.log: Any = open(tmp_path / "output.txt", "a")  # noqa: SIM115 - written as lines come
        self._readers: list[threading.Thread] = []
        self.processes: list[subprocess.Popen[str]] = []
        for node in range(len(self.hosts) or 1) if started is None else started:
            self.start(node)
        self.process = self.processes[0]

    def start(self, node: int = 0) -> subprocess.Popen[str]:
        """Start ``phalanx run`` on node ``node`` (again, for a host that
        comes back)."""
        command = self.command
        if self.hosts:
            command = [
                *command, "--num-nodes", str(len(self.hosts)), "--node-rank", str(node),
                "--main-address", self.hosts[0].address, "--main-port", str(self.port),
            ]  # fmt: skip
        command = [*command, "train.py", str(self.out)]
        env = {**self.env, "OMP_NUM_THREADS": "1"}
        options: dict[str, Any] = {
            "cwd": self.tmp_path, "env": env, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True
        }  # fmt: skip
        host = self.hosts[node] if self.hosts else self.where
        process = host.popen(command, **options) if host is not None else subprocess.Popen(command, **options)
        self.processes.append(process)
        reader = threading.Thread(target=self._read, args=(process,), daemon=True)
        reader.start()
        self._readers.append(reader)
        return process

    def _read(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with self._lock:
                self._parse(line)

    def _parse(self, line: str) -> None:
        self.lines.append(line)
        if self.log is not None:  # the whole output, where a failed assertion shows a part
            self.log.write(line)
            self.log.flush()
        found = LINE.search(line)
        if found:
            g, r, pid, step, committed, participants, participating, t, total = found.groups()
            self.steps.append(
                (int(g), int(r), int(pid), int(step), committed == "True", int(participants), float(t),
                 participating == "True", total)
            )  # fmt: skip
            self.participated.setdefault(int(pid), []).append(participating == "True")
        batch = BATCH.search(line)
        if batch:
            group, rank, pid, step, epoch, ids = batch.groups()
            self.batches.setdefault(int(pid), []).append((int(epoch), [int(i) for i in ids.split(",")]))
            self.drawn.setdefault(int(pid), []).append((int(group), int(rank), int(step)))
            self.events.setdefault(int(pid), []).append(
                ("batch", int(epoch), [int(i) for i in ids.split(",")])
            )
        sync = SYNC.search(line)
        if sync:
            group, rank, pid, step, committed, contributed, parts = sync.groups()
            self.syncs.append(
                (
                    int(group),
                    int(rank),
                    int(pid),
                    int(step),
                    committed == "True",
                    contributed == "True",
                    parts,
                )
            )
            self.events.setdefault(int(pid), []).append(("sync", contributed == "True", []))

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, condition, what: str, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while not condition():
            ended = all(p.poll() is not None for p in self.processes)
            if ended or time.monotonic() > deadline:
                stacks = "" if ended else self.stacks()
                self.stop()
                raise AssertionError(f"{what}: not seen; the job's output:\n{self.output}{stacks}")
            time.sleep(0.05)

    def stacks(self) -> str:
        """Every live process of the job (the launchers' descendants, in
        whatever namespace host they run) with its state, and the Python
        stacks of each as py-spy dumps them where py-spy is installed: what
        a job that stopped making progress was doing."""
        children: dict[int, list[int]] = collections.defaultdict(list)
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children[int(fields[1])].append(int(stat.parent.name))
        todo = [p.pid for p in self.processes if p.poll() is None]
        found: list[int] = []
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo.extend(children.get(pid, []))
        spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
        parts = ["\n--- the job's live processes" + ("" if spy else " (py-spy not installed: no stacks)")]
        for pid in sorted(found):
            try:
                command = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            parts.append(f"pid {pid} ({state}): {command[:300]}")
            if spy and "python" in command:
                dump = subprocess.run(
                    [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30, check=False
                )
                parts.append(textwrap.indent(dump.stdout + dump.stderr, "    "))
        return "\n".join(parts)

    def stop_after(self, more: int, at_least: int = 0) -> None:
        """Have every group stop at ``more`` steps after the last one seen
        (a step no group has reached yet: all of them stop at it), or at
        step ``at_least`` if that is later."""
        step = max(max(s[3] for s in self.steps) + more, at_least)
        (self.out / "stop.tmp").write_text(str(step))
        (self.out / "stop.tmp").rename(self.out / "stop")

    def finish(self, timeout: float = 180) -> int:
        """Wait for every process; the first one's exit status (``codes``:
        every one's)."""
        deadline = time.monotonic() + timeout
        try:
            for process in self.processes:
                process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stacks = self.stacks()
            self.stop()
            raise AssertionError(f"the job did not end; its output:\n{self.output}{stacks}") from None
        for reader in self._readers:
            reader.join(10)
        return self.process.returncode

    @property
    def codes(self) -> list[int | None]:
        return [p.returncode for p in self.processes]

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()

    def pids(self, group: int) -> list[int]:
        """The pids of ``group``'s rank 0 in the order they trained."""
        seen: list[int] = []
        for g, r, pid, *_ in self.steps:
            if g == group and r == 0 and pid not in seen:
                seen.append(pid)
        return seen

    def short_steps(self, batch: int = 2) -> dict[int, int]:
        """By epoch, the steps in which a rank drew a batch of fewer than
        ``batch`` samples: the epoch's last steps, each filled with fewer
        than its ranks' count of samples from the epoch's start (two where
        a share of the last step was given back)."""
        steps: dict[int, set[int]] = collections.defaultdict(set)
        for pid, drawn in self.drawn.items():
            for (_, _, step), (epoch, ids) in zip(drawn, self.batches[pid], strict=True):
                if len(ids) < batch:
                    steps[epoch].add(step)
        return {epoch: len(found) for epoch, found in steps.items()}

    def diverged(self) -> dict[int, set[str]]:
        """The steps after which the groups that committed them (taking
        part) hold different weights (rank 0's sum of squares): a split
        brain, which TorchFT's lighthouse must never let happen."""
        sums: dict[int, set[str]] = collections.defaultdict(set)
        for _, rank, _, step, committed, _, _, participating, total in self.steps:
            if committed and participating and rank == 0:
                sums[step].add(total)
        return {step: found for step, found in sums.items() if len(found) > 1}

    def trained(self) -> dict[int, collections.Counter[int]]:
        """By epoch, how many times each sample was in a committed step that
        its rank took part in (a rank's batches and steps, in order: a
        killed rank's last batch has no step). A rank's last batch without
        a step counts where the same rank of another group committed that
        step with as many groups as drew a batch for it: the stopped rank's
        gradient was in that step's all-reduce (else the all-reduce would
        have failed, and nothing been committed), though its own group
        could not commit it (a host cut off between the all-reduce and the
        commit)."""
        # From the ranks' own files: a killed host's last lines may never
        # have reached this process.
        record = Job.__new__(Job)
        record.lines, record.steps, record.participated, record.batches, record.drawn = [], [], {}, {}, {}
        record.syncs, record.events = [], {}
        record.log = None
        for path in sorted(self.out.glob("records-*")):
            for line in path.read_text().splitlines():
                record._parse(line)
        counts: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        committed_by_pid: dict[int, list[bool]] = collections.defaultdict(list)
        for _, _, pid, _, committed, *_ in record.steps:
            committed_by_pid[pid].append(committed)
        # (rank, step, epoch) -> the groups that drew a batch for it; (rank, step) -> each commit's participants
        groups_drawn: dict[tuple[int, int, int], set[int]] = collections.defaultdict(set)
        for pid, drawn in record.drawn.items():
            for (group, rank, step), (epoch, _) in zip(drawn, record.batches[pid], strict=True):
                groups_drawn[rank, step, epoch].add(group)
        commits: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
        for _, rank, _, step, committed, participants, _, participating, _ in record.steps:
            if committed and participating:
                commits[rank, step].add(participants)
        for pid, batches in record.batches.items():
            verdicts = list(zip(committed_by_pid[pid], record.participated.get(pid, []), strict=True))
            for (epoch, ids), (committed, participating) in zip(batches, verdicts, strict=False):
                if committed and participating:
                    counts[epoch].update(ids)
            if len(batches) == len(verdicts) + 1:  # stopped in its last step
                (epoch, ids), (_, rank, step) = batches[-1], record.drawn[pid][-1]
                if len(groups_drawn[rank, step, epoch]) in commits[rank, step]:
                    counts[epoch].update(ids)
        return counts

    def windows_trained(self) -> dict[int, collections.Counter[int]]:
        """Under ``local_sgd_ft`` and ``diloco_ft``: by epoch, how many
        times each sample was in a window that a sync took (its group's
        batches since its last sync, where that sync says the group
        contributed)."""
        record = Job.__new__(Job)
        record.lines, record.steps, record.participated, record.batches, record.drawn = [], [], {}, {}, {}
        record.syncs, record.events, record.log = [], {}, None
        for path in sorted(self.out.glob("records-*")):
            for line in path.read_text().splitlines():
                record._parse(line)
        counts: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
        for events in record.events.values():
            window: list[tuple[int, list[int]]] = []
            for kind, value, ids in events:
                if kind == "batch":
                    window.append((value, ids))
                    continue
                if value:
                    for epoch, taken in window:
                        counts[epoch].update(taken)
                window = []
        return counts

    def ends(self) -> dict[int, dict]:
        import torch

        return {
            int(path.name.split("-")[0][len("group") :]): torch.load(path)
            for path in sorted(self.out.glob("group*-rank0-*.pt"))
        }


def ranks_of(job: Job, group: int, rank: int) -> list[int]:
    """The pids that ran ``rank`` of ``group``, in the order they trained."""
    return list(dict.fromkeys(s[2] for s in job.steps if s[0] == group and s[1] == rank))


def kill_one_of_two_groups_and_check_it_heals(job: Job, park_at: int) -> None:
    """For a job of two groups started with ``park_at``: kill group 1's
    rank 0 at that step, let the job run on and end, and check that group
    1 alone was started again and healed from group 0 (one load, at the
    job's step, no checkpoint), both end alike, and no step diverged."""
    victim_file = job.out / "victim"
    job.wait_for(victim_file.exists, f"group 1 at step {park_at}")
    os.kill(int(victim_file.read_text()), signal.SIGKILL)
    job.wait_for(lambda: len(job.pids(1)) == 2, "group 1 training again")
    job.stop_after(5)
    assert job.finish() == 0, job.output
    assert len(job.pids(0)) == 1, job.output  # never restarted
    assert "replica group 1 failed (a rank was killed by SIGKILL)" in job.output
    ends = job.ends()
    assert sorted(ends) == [0, 1], job.output
    assert all(a.equal(b) for a, b in zip(ends[0]["weights"], ends[1]["weights"], strict=True))
    assert len(ends[1]["loads"]) == 1 and ends[1]["loads"][0] >= park_at, ends[1]["loads"]
    assert [ends[group]["restarts"] for group in (0, 1)] == [0, 1]
    assert not job.diverged(), job.diverged()


def a_late_group_once_the_job_has_finished(
    job: Job, groups: int, kill: bool, before: tuple[str, str] | None = None
) -> None:
    """For a job of ``groups`` groups started with ``park_at``: let the
    others end while group 1 is parked, then kill group 1's rank 0 (or
    wake it: it goes on with its step); check that group 1 trains no
    further and is not started again (it could heal from no one), that
    every ``phalanx run`` ends with 0, and that the others ended alike.
    ``before``: (a pattern of a line, what it says) that must be seen
    before group 1 is killed or woken."""
    victim_file = job.out / "victim"
    job.wait_for(victim_file.exists, "group 1 parked")
    job.stop_after(3)
    others = [group for group in range(groups) if group != 1]
    job.wait_for(lambda: all(f"DONE group={g} " in job.output for g in others), "the other groups' end")
    ranks = [int(m) for m in re.findall(r"DONE group=\d+ rank=\d+ pid=(\d+)", job.output)]
    job.wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ranks), "their ranks' end")
    if before is not None:
        job.wait_for(lambda: re.search(before[0], job.output), before[1])
    if kill:
        os.kill(int(victim_file.read_text()), signal.SIGKILL)
    else:
        (job.out / "wake").write_text("")
    assert job.finish() == 0, job.output
    output = job.output
    assert job.codes == [0] * len(job.processes), (job.codes, output)
    if not kill or "starting it again" in output:  # restarted before its host knew of the end
        assert "JobFinishedError: replica group 1: the job has finished (replica group " in output, output
    assert "replica group 1 failed (" in output and "had ended the job; not started again" in output, output
    # Nothing committed from the step it was parked in on (woken, that
    # step's all-reduce finds its peers gone, and the next step's quorum
    # stops it). Parked at park_at or later: once every group is in a step.
    parked = int((job.out / "parked-at").read_text())
    assert [s for s in job.steps if s[0] == 1 and s[3] >= parked and s[4]] == [], output
    ends = job.ends()
    assert sorted(ends) == others, output
    first = ends[others[0]]["weights"]
    assert all(all(a.equal(b) for a, b in zip(first, ends[g]["weights"], strict=True)) for g in others)
    assert not job.diverged(), job.diverged()
