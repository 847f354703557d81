"""``ddp_ft`` for real: TorchFT's lighthouse, replica groups of gloo ranks on
this host, a rank killed with SIGKILL while the job trains."""

from __future__ import annotations

import collections
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft", reason="phalanx-torchft's tests need torchft: pip install 'torchft>=0.2,<0.3'")

from ft_job import CHECKPOINTED, Job, a_late_group_once_the_job_has_finished, ranks_of
from phalanx_torchft.launcher import ReplicaGroupsLauncher

import phalanx
from phalanx_core import CheckpointDirectory, MisconfigurationError
from phalanx_core.testing.processes import descendants, is_alive


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


#: The parameters of the tests' model: its float32 gradients, in bytes.
GRADIENT_BYTES = (8 * 16 + 16 + 16 * 1 + 1) * 4


@pytest.mark.parametrize(
    ("strategy", "devices", "fsdp_options", "workers", "collective"),
    [
        ("ddp_ft", 1, False, 0, "torch"),
        ("ddp_ft", 2, False, 0, "compressed"),
        ("ddp_ft", 1, False, 2, "torch"),
        ("hsdp_ft", 2, False, 0, "across=compressed"),
        ("hsdp_ft", 2, True, 0, "torch"),
    ],
    ids=[
        "ddp_ft-1",
        "ddp_ft-2-compressed",
        "ddp_ft-1-loader-workers",
        "hsdp_ft-2-torch-within-compressed-across",
        "hsdp_ft-2-units-bf16-offload",
    ],
)
def test_a_killed_group_heals_from_a_peer_while_the_others_train_on(
    tmp_path, strategy, devices, fsdp_options, workers, collective
):
    # ddp_ft-2-compressed: compressed (bf16 on the wire) within each group
    # and between the groups; hsdp_ft-2-torch-within-compressed-across: the
    # torch collective within, compressed between (-o across=compressed).
    # hsdp_ft-2-units-bf16-offload: each Linear its own FSDP unit
    # (shard_modules), bf16 parameters with float32 reductions (mp_policy),
    # parameters and optimizer state in CPU memory (cpu_offload).
    # ddp_ft-1-loader-workers: the DataLoader's 2 workers read the steps
    # ahead; the kill and the return change the steps' samples. Its script
    # loops over epochs as a DDP script does (loader.set_epoch(epoch)), and
    # group 1 is killed in epoch 1: started again, its script is at
    # set_epoch(0) when it heals into epoch 1.
    park_at = 23 if workers else 10
    job = Job(
        tmp_path,
        "--devices",
        str(devices),
        "--replica-groups",
        "3",
        "--max-restarts",
        "1",
        *(["--option", collective] if collective.startswith("across=") else ["--collective", collective]),
        strategy=strategy,
        park_at=park_at,
        fsdp_options=fsdp_options,
        workers=workers,
        epoch_loop=bool(workers),
    )
    # Group 1's rank 0 stops at step park_at with its batch in hand; killed there.
    victim_file = job.out / "victim"
    job.wait_for(victim_file.exists, f"group 1 at step {park_at}")
    victim = int(victim_file.read_text())
    left = descendants(victim)  # its loader workers, if any
    assert len(left) == workers, left
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    job.wait_for(lambda: len(job.pids(1)) == 2, "group 1 training again")
    # Into the next epoch (20 steps of 3 groups of one rank), however
    # soon group 1 came back.
    job.stop_after(10, at_least=park_at + 20)
    assert job.finish() == 0, "".join(job.lines)
    output = "".join(job.lines)

    # The survivors were never restarted: one process each, from start to end.
    for group in (0, 2):
        assert len(job.pids(group)) == 1, output
    assert "replica group 1 failed (a rank was killed by SIGKILL)" in output
    assert "starting it again (1 of 1); the other groups go on" in output
    assert not alive(victim)
    if workers:
        # Its loader workers, which held its sockets open (and the
        # survivors in their all-reduce with it until they exited), were
        # ended with it by its group's launcher.
        assert f"rank 0 failed and left {workers} process(es) of its own running" in output, output
        assert not [pid for pid in left if is_alive(pid)], left
        # The script's epoch loop: group 1 healed into a later epoch (1 or,
        # back late, 2) while its script was at set_epoch(0), and went on
        # from there (the epochs' samples below: each once). Where its
        # first step was an epoch's last one (1 in 20; seen under load),
        # that step ends the script's epoch 0 and the loader says so at
        # set_epoch(1), the job being in epoch 2 by then.
        joined = re.search(r"replica group 1 joined the job in epoch (\d+) \(healed from its peers\) while its "
                           r"script is at set_epoch\((\d+)\)", output)  # fmt: skip
        assert joined and int(joined[1]) >= 1 and int(joined[2]) < int(joined[1]), output

    # They went on without group 1, and took it back.
    after = [s for s in job.steps if s[0] == 0 and s[6] > killed_at]
    assert any(s[5] == 2 and s[4] for s in after), output  # a step committed by two groups
    assert after[-1][5] == 3, output  # and three at the end

    # Every group ends with the same weights, which the restarted group
    # copied from a peer: no checkpoint exists to read.
    ends = job.ends()
    assert sorted(ends) == [0, 1, 2]
    first = ends[0]["weights"]
    import torch

    every_rank = sorted(job.out.glob("group*-rank*-*.pt"))
    assert len(every_rank) == 3 * devices
    for path in every_rank:  # each rank of each group: one model
        weights = torch.load(path)["weights"]
        assert all(a.equal(b) for a, b in zip(first, weights, strict=True)), path.name
    # The restarted group loaded its state once, from a peer, at the step
    # the job had reached. A survivor may copy its peers' state too, without
    # a restart: at the start, where every group but one copies the first
    # quorum's weights (TorchFT's init_sync: the groups were seeded unlike
    # on purpose) or a group that joined after the first quorum catches up
    # (seen at step 2 on a loaded machine); and where an all-reduce broke
    # on one survivor and completed on another (the kill, or the quorum
    # that takes the restarted group in): TorchFT commits a step per group,
    # and the one that did not commit copies the step from the one that
    # did (seen at step 63, 5 steps after the restarted group came back).
    assert len(ends[1]["loads"]) == 1
    assert [ends[group]["restarts"] for group in (0, 1, 2)] == [0, 1, 0]  # strategy.restart_count

    # The gradients between the groups went through the collective named,
    # every one of them: under compressed, the torch collective under it
    # got each float32 gradient TorchFT averaged in bf16, half its bytes
    # (the plain torch collective: the float32 itself), and no float32 at
    # all. (The groups' first step sends the leader's state as bytes,
    # uint8; the step's members go as int64.)
    compressed = collective in ("compressed", "across=compressed")
    wire, ratio = ("bfloat16", 2) if compressed else ("float32", 1)
    kind = "CompressedCollective" if compressed else "TorchCollective"
    for path in every_rank:
        across = torch.load(path)["across"]
        assert across["collective"] == kind, across
        assert set(across["calls"]) <= {wire, "uint8", "int64"}, across
        assert across["calls"][wire] >= 5, across  # a step each (the restarted group: from its return)
        assert across["sizes"][wire] == {size // ratio for size in across["given"]}, across
    assert ends[1]["loads"][0] >= park_at
    for group in (0, 2):
        assert len(ends[group]["loads"]) <= 2, ends[group]["loads"]
    assert not job.diverged(), job.diverged()  # every step's committers alike after it
    assert not list(tmp_path.glob("**/*.ckpt")) and not list(tmp_path.glob("**/checkpoint*"))

    # Every sample of an epoch was in one committed step, the batch of the
    # step the victim died in (given back) included; an epoch's last step
    # repeats a few (fewer than its ranks) where the rest does not fill it.
    trained = job.trained()
    everything = set(range(120))
    assert len(trained) >= 2, trained  # the kill inside the first epoch, and more after
    for epoch in sorted(trained):
        counts = trained[epoch]
        repeated = sum(n - 1 for n in counts.values())
        if epoch < max(trained):
            assert set(counts) == everything, (epoch, sorted(everything - set(counts)), output)
        # The epoch's end: one short step, two where a share of it went back.
        short = max(job.short_steps().get(epoch, 0), 1)
        assert repeated == 0 or (set(counts) == everything and repeated < short * 3 * devices), (
            epoch,
            counts,
        )
    readers = {int(path.name.rsplit("-", 1)[1]) for path in job.out.glob("read-by-*")}
    ranks = {s[2] for s in job.steps}
    if workers:
        # Only the workers read samples; the survivors read again where the
        # groups of a step changed (the kill, the return).
        assert readers and not readers & ranks, (readers, ranks)
        assert ends[0]["rereads"] >= 1 and ends[2]["rereads"] >= 1, ends
    else:
        assert readers <= ranks, (readers, ranks)


FAILING = textwrap.dedent(
    """
    import sys, time, torch, phalanx
    from pathlib import Path
    strategy = phalanx.resolve()
    strategy.launch()
    which, go = sys.argv[1], Path("go")

    def lookup(settings):
        return settings["missing"]

    if which == "group-1-once" and strategy.replica_group == 1 and strategy.restart_count == 0:
        lookup({})  # group 1's first start, before any step
    model = torch.nn.Linear(4, 1)
    model, optimizer = strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    while which == "group-1-once" and not go.exists():  # until the test saw group 1 held
        time.sleep(0.05)
    together = 0  # steps with every group in them (group 1 back)
    while together < 3:
        optimizer.zero_grad()
        strategy.backward(model(torch.randn(2, 4)).sum())
        if which == "every":
            lookup({})  # every group's first step
        strategy.optimizer_step(optimizer)
        together += strategy.participants == 3 and strategy.committed
        time.sleep(0.05)
    print(f"DONE group={strategy.replica_group} restarts={strategy.restart_count}", flush=True)
    """
)


@pytest.mark.parametrize("which", ["every", "group-1-once"])
def test_an_error_before_the_first_step_ends_the_job_at_once_only_where_every_group_has_it(tmp_path, which):
    # every: each group raises in its first step: the job ends after one
    # start of each (no restart could fix it), the traceback shown once.
    # group-1-once: only group 1's first start raises, before any step:
    # it is held while the others train (once the test saw it held), and
    # started again once they committed a step; the job ends well.
    (tmp_path / "failing.py").write_text(FAILING)
    command = [sys.executable, "-m", "phalanx", "run", "--strategy", "ddp_ft", "--accelerator", "cpu"]
    command += ["--replica-groups", "3", "--max-restarts", "3", "failing.py", which]
    log = tmp_path / "output.txt"
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            cwd=tmp_path,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        try:
            deadline = time.monotonic() + 120
            while which != "every" and "held until" not in log.read_text() and time.monotonic() < deadline:
                assert process.poll() is None, log.read_text()
                time.sleep(0.05)
            (tmp_path / "go").write_text("")
            code = process.wait(180)
        finally:
            if process.poll() is None:
                process.kill()
    output = log.read_text()
    if which == "every":
        assert code == 1, output
        assert "starting it again" not in output, output
        assert output.count("Traceback (most recent call last):") == 1, output  # the root cause's, whole
        assert output.count("KeyError: 'missing' (the same traceback as group") == 2, output  # the others'
        assert (
            "every replica group (3) failed alike before the job committed a step: KeyError: 'missing'"
            in output
        )
        assert "DONE" not in output
    else:
        assert code == 0, output
        assert "replica group 1 failed (exit status 1) before the job committed a step; held until" in output
        assert output.count("starting it again") == 1, output
        assert "replica group 1 failed (exit status 1); starting it again (1 of 3)" in output, output
        assert sorted(re.findall(r"DONE group=(\d) restarts=(\d)", output)) == [
            ("0", "0"),
            ("1", "1"),
            ("2", "0"),
        ]


def test_a_group_that_fails_past_its_restarts_fails_the_job_and_the_others_finish(tmp_path):
    job = Job(tmp_path, "--devices", "1", "--replica-groups", "2", "--max-restarts", "0")
    job.wait_for(lambda: any(s[0] == 0 and s[3] >= 5 for s in job.steps), "group 0 at step 5")
    [victim] = job.pids(0)
    os.kill(victim, signal.SIGKILL)
    job.wait_for(lambda: "may not start again (max_restarts=0)" in "".join(job.lines), "group 0 given up")
    job.stop_after(5)
    code = job.finish()
    output = "".join(job.lines)
    assert code == 128 + signal.SIGKILL, output
    assert "replica group 0 failed 1 time(s), more than max_restarts=0" in output
    assert sorted(job.ends()) == [1]  # group 1 trained to the end alone


def test_a_rank_that_stalls_holds_its_own_group_until_its_timeout_and_the_others_train_on(tmp_path):
    # Three groups of two ranks. At step 5 group 1's rank 1 stops itself
    # (SIGSTOP: alive, answering nothing) in its gradients' all-reduce.
    # Groups 0 and 2 drop that step once their all-reduce with it gives up
    # (replica_timeout), and train on as two groups (a majority of the three
    # that beat to the lighthouse), never restarted: a step's commit, a
    # barrier of the group's ranks, waits twice replica_timeout for them
    # (with replica_timeout, a survivor's rank gave up there first, and its
    # group was restarted). Group 1's rank 0 waits for the stopped rank in
    # DDP's own collective within the group until the group's collective
    # timeout (-o timeout, 1800 s by default; 10 s here): then group 1 fails,
    # is started again (its stopped rank killed) and heals.
    flags = ("-o", "replica_timeout=3", "-o", "timeout=10")
    job = Job(
        tmp_path, "--devices", "2", "--replica-groups", "3", "--max-restarts", "1", *flags, stall_at=(1, 1, 5)
    )
    stalled_file = job.out / "stalled"
    job.wait_for(stalled_file.exists, "group 1's rank 1 stalled")
    stalled = int(stalled_file.read_text())
    stalled_at = time.monotonic()
    job.wait_for(
        lambda: all(
            sum(1 for s in job.steps if s[0] == group and s[6] > stalled_at and s[4] and s[5] == 2) >= 3
            for group in (0, 2)
        ),
        "groups 0 and 2 training without group 1",
    )
    job.wait_for(
        lambda: any(s[0] == 1 and s[1] == 1 and s[2] != stalled and s[4] and s[5] == 3 for s in job.steps),
        "group 1 started again and training with the others",
    )
    job.stop_after(5)
    assert job.finish() == 0, job.output
    output = job.output
    assert not alive(stalled), output
    for group, rank in itertools.product((0, 2), (0, 1)):
        assert len(ranks_of(job, group, rank)) == 1, output  # groups 0 and 2 never restarted
    assert "replica group 0 failed" not in output and "replica group 2 failed" not in output, output
    assert "Timed out waiting 10000ms" in output, output  # group 1's own collective timeout
    # (Said as the stalled rank's kill: the timed-out rank 0 only lost its peer.)
    assert (
        "phalanx run: replica group 1 failed (a rank was killed by SIGKILL); starting it again (1 of 1)"
        in output
    )
    assert not job.diverged(), (job.diverged(), output)
    import torch

    every_rank = sorted(job.out.glob("group*-rank*-*.pt"))
    assert len(every_rank) == 6, ([p.name for p in every_rank], output)
    first = torch.load(every_rank[0])["weights"]
    for path in every_rank[1:]:
        assert all(a.equal(b) for a, b in zip(first, torch.load(path)["weights"], strict=True)), path.name


def test_a_group_late_for_the_jobs_end_stops_and_is_not_started_again(tmp_path):
    # Woken after the others ended, group 1 finds the job finished at its
    # step's quorum: it stops rather than train alone (JobFinishedError),
    # and is not started again: it would find no peer to heal from.
    job = Job(tmp_path, "--devices", "1", "--replica-groups", "3", park_at=10)
    a_late_group_once_the_job_has_finished(job, groups=3, kill=False)


def test_node_0_says_which_port_it_needs_when_the_one_after_the_main_port_is_taken(tmp_path):
    import socket

    from phalanx_torchft._end import JobEnd

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        end = JobEnd(0, 2, "127.0.0.1", port, "127.0.0.1", tmp_path / "finished")
        with pytest.raises(
            MisconfigurationError, match=rf"cannot listen on 127.0.0.1:{port}, the port after"
        ):
            end.start()
        end.close()


def processes_of(job: Job) -> list[int]:
    """Every process whose command names the job's output folder: the
    groups' launching processes and their ranks."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if str(job.out).encode() in command:
                found.append(int(entry.name))
    return found


def test_the_lighthouses_process_killed_takes_every_group_with_it(tmp_path):
    # On one host the lighthouse lives in phalanx run's own process: losing
    # it is losing the job, and nothing of it may stay behind.
    job = Job(tmp_path, "--devices", "2", "--replica-groups", "2")
    job.wait_for(lambda: any(s[3] >= 3 for s in job.steps), "step 3")
    running = processes_of(job)
    assert len(running) >= 2 * (1 + 2), running  # each group's launching process and its two ranks
    job.process.kill()
    job.process.wait(10)
    deadline = time.monotonic() + 60
    while processes_of(job) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(job) == [], "processes of the job outlived phalanx run"


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_lighthouse_run_elsewhere_carries_the_quorum_and_its_loss_is_a_named_error(tmp_path):
    # TorchFT's own lighthouse binary, as an operator runs it beside a job:
    # phalanx run --lighthouse URL starts none of its own and every group
    # asks that one; when it dies, every group stops with NoQuorumError
    # within quorum_timeout and phalanx run ends, nothing left behind.
    port = free_port()
    binary = Path(sys.executable).parent / "torchft_lighthouse"
    log = open(tmp_path / "lighthouse.txt", "w")  # noqa: SIM115 - the lighthouse writes it while it runs
    lighthouse = subprocess.Popen(
        [str(binary), "--bind", f"127.0.0.1:{port}", "--min_replicas", "2", "--join_timeout_ms", "200",
         "--quorum_tick_ms", "50", "--heartbeat_timeout_ms", "1000"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "RUST_LOG": "info"},
    )  # fmt: skip
    try:
        job = Job(
            tmp_path, "--devices", "1", "--replica-groups", "2", "--max-restarts", "0",
            "--lighthouse", f"http://127.0.0.1:{port}", "-o", "quorum_timeout=3",
        )  # fmt: skip
        job.wait_for(
            lambda: {s[0] for s in job.steps if s[3] >= 3 and s[5] == 2} == {0, 1}, "both groups at step 3"
        )
        # The quorums are that process's: its log names them.
        assert "Valid quorum found [2/2 participants healthy]" in (tmp_path / "lighthouse.txt").read_text()
        before = max(s[3] for s in job.steps)
        lighthouse.kill()
        lighthouse.wait(10)
        code = job.finish(timeout=120)
        output = job.output
        assert code != 0, output
        for group in (0, 1):
            assert f"NoQuorumError: replica group {group}: no quorum for step" in output, output
            assert f"lighthouse at http://127.0.0.1:{port} in time" in output, output
        # No step was committed long after the loss: the groups stopped.
        assert max(s[3] for s in job.steps if s[4]) <= before + 5, output
        assert processes_of(job) == [], "processes of the job outlived phalanx run"
    finally:
        if lighthouse.poll() is None:
            lighthouse.kill()
            lighthouse.wait(10)
        log.close()


def test_the_replica_groups_options_are_checked():
    with pytest.raises(MisconfigurationError, match=r"min_replicas=3 is more than replica_groups=2"):
        phalanx.resolve("ddp_ft", accelerator="cpu", replica_groups=2, min_replicas=3)
    with pytest.raises(MisconfigurationError, match=r"replica_groups=0; expected an int of at least 1"):
        phalanx.resolve("ddp_ft", accelerator="cpu", replica_groups=0)
    with pytest.raises(MisconfigurationError, match=r"heartbeat_timeout=-1; expected a number of seconds"):
        phalanx.resolve("ddp_ft", accelerator="cpu", heartbeat_timeout=-1)
    with pytest.raises(MisconfigurationError, match=r"strategy 'ddp_ft': replica_timeout=0; expected"):
        phalanx.resolve("ddp_ft", accelerator="cpu", replica_timeout=0)
    with pytest.raises(
        MisconfigurationError, match=r"static_graph=True lets DDP reorder its gradient buckets"
    ):
        phalanx.resolve("ddp_ft", accelerator="cpu", static_graph=True)
    with pytest.raises(MisconfigurationError, match=r"strategy 'hsdp_ft': quorum_timeout=-2; expected"):
        phalanx.resolve("hsdp_ft", accelerator="cpu", quorum_timeout=-2)
    with pytest.raises(MisconfigurationError, match=r"strategy 'hsdp_ft': state_dict_type='both'"):
        phalanx.resolve("hsdp_ft", accelerator="cpu", state_dict_type="both")  # fsdp's own options
    with pytest.raises(MisconfigurationError, match=r"strategy 'hsdp_ft': cpu_offload=3; give True"):
        phalanx.resolve("hsdp_ft", accelerator="cpu", cpu_offload=3)
    with pytest.raises(
        MisconfigurationError,
        match=r"replica_groups=4 on num_nodes=3 hosts: .* multiple of 3\).*replica-groups 3$",
    ):
        ReplicaGroupsLauncher(num_nodes=3, node_rank=0, replica_groups=4)
    with pytest.raises(
        MisconfigurationError,
        match=r"replica_groups=4 on num_nodes=6 hosts: .*groups 6, 3 \(2 hosts a group\), 2 \(3 hosts a group\)$",
    ):
        ReplicaGroupsLauncher(num_nodes=6, node_rank=0, replica_groups=4)
    with pytest.raises(MisconfigurationError, match=r"lighthouse='node0:29510'; give a running TorchFT"):
        phalanx.resolve("ddp_ft", accelerator="cpu", lighthouse="node0:29510")
    with pytest.raises(
        MisconfigurationError, match=r"the hosts elect the lighthouse .* give one or the other"
    ):
        ReplicaGroupsLauncher(
            num_nodes=3, node_rank=0, replica_groups=3, lighthouse="http://10.0.0.1:29510",
            rendezvous="etcd://10.0.0.1:2379/job",
        )  # fmt: skip
    with pytest.raises(
        MisconfigurationError, match=r"rendezvous='etcd://10.0.0.1:2379/job' with num_nodes=1"
    ):
        ReplicaGroupsLauncher(replica_groups=3, rendezvous="etcd://10.0.0.1:2379/job")


SRUN_STEP = {  # node 1 of an srun step of one task on each of two nodes, job 4321
    "SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1", "SLURM_NTASKS": "2", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "10.1.0.[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}  # fmt: skip


def test_under_srun_one_task_per_node_runs_the_launcher_with_slurms_layout(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in SRUN_STEP.items():
        monkeypatch.setenv(name, value)
    plan = phalanx.plan("ddp_ft", accelerator="cpu", devices=2, num_nodes=2, replica_groups=4)
    assert plan.environment.name == "slurm" and plan.launcher.name == "replica_groups"
    assert "started one process per node" in plan.launcher.reason
    launcher = phalanx.resolve("ddp_ft", accelerator="cpu", devices=2, num_nodes=2, replica_groups=4).launcher
    assert isinstance(launcher, ReplicaGroupsLauncher)
    assert launcher.node_rank == 1 and launcher.groups_here == range(2, 4)
    assert launcher.num_processes == 2  # ranks per group: this launcher's to start
    assert launcher._main() == (
        "10.1.0.1",
        14321,
    )  # node 0: the step's first node; 10000 + the job id's digits
    # Two tasks per node: srun started the ranks' count, not one agent per node.
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_STEP_TASKS_PER_NODE", "2(x2)")
    with pytest.raises(
        MisconfigurationError,
        match=r"started 4 process\(es\) for num_nodes=2: start one process per node \(srun --ntasks-per-node=1",
    ):
        phalanx.resolve("ddp_ft", accelerator="cpu", devices=2, num_nodes=2, replica_groups=4)
    # Inside a group's rank (torch elastic's): the ranks run in place.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "phalanx-group-1")
    assert phalanx.plan("ddp_ft", accelerator="cpu", devices=1).launcher.name == "in_process"


def test_fewer_groups_than_hosts_spread_each_group_over_hosts():
    # Four hosts, two groups: node 3 runs the second part of group 1, whose
    # store node 2 hosts.
    launcher = ReplicaGroupsLauncher(num_nodes=4, node_rank=3, replica_groups=2, num_processes=2)
    assert (launcher.hosts_per_group, launcher.groups_here, launcher.part) == (2, range(1, 2), 1)
    said = launcher.explain()["groups"]
    assert said.startswith("2 replica groups of 4 rank(s) each, each on 2 hosts (2 a host); this host runs "
                           "part 1 of group 1, whose store node 2 hosts."), said  # fmt: skip
    first = ReplicaGroupsLauncher(num_nodes=4, node_rank=2, replica_groups=2)
    assert (first.groups_here, first.part) == (range(1, 2), 0)
    assert "runs part 0 of group 1 and hosts the group's store" in first.explain()["groups"]
    # One group on three hosts: allowed (no group to heal from, but a job).
    assert ReplicaGroupsLauncher(num_nodes=3, node_rank=2, replica_groups=1).part == 2


def test_a_main_address_on_loopback_is_refused_on_several_hosts(monkeypatch):
    # Node 0's name listed as 127.0.1.1 on its own host (Debian's hosts file):
    # the other hosts' groups could not reach this host's groups there.
    monkeypatch.setenv("MASTER_ADDR", "127.0.1.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    launcher = ReplicaGroupsLauncher(num_nodes=2, node_rank=1, replica_groups=2)
    with pytest.raises(
        MisconfigurationError, match=r"leads to this host's loopback.*an IP address of this host"
    ):
        launcher.run_script(["train.py"])


def test_explain_shows_the_groups_the_lighthouse_and_the_quorum_rule():
    argv = [sys.executable, "-m", "phalanx", "explain", "--strategy", "ddp_ft", "--accelerator", "cpu",
            "--devices", "2", "-o", "replica_groups=3", "-o", "min_replicas=2", "-o", "heartbeat_timeout=0.5"]  # fmt: skip
    said = json.loads(
        subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120, check=True).stdout
    )
    said = said["launcher_says"]
    assert said["groups"].startswith("3 replica groups of 2 rank(s) each on this host")
    assert "up to 3 time(s) each" in said["groups"]
    assert said["lighthouse"].startswith("TorchFT's, in phalanx run's own process")
    assert "a heartbeat younger than 0.5 s (heartbeat_timeout)" in said["quorum"]
    assert "at least 2 (min_replicas) and more than half of the heartbeating groups" in said["quorum"]
    several = [
        *argv,
        "--num-nodes",
        "3",
        "--node-rank",
        "1",
        "--main-address",
        "10.1.0.1",
        "--main-port",
        "29400",
    ]
    said = json.loads(
        subprocess.run([*several, "--json"], capture_output=True, text=True, timeout=120, check=True).stdout
    )["launcher_says"]
    assert said["groups"].startswith(
        "3 replica groups of 2 rank(s) each on 3 hosts, groups 1 to 1 on this one"
    )
    assert said["lighthouse"].startswith("TorchFT's, in node 0's phalanx run process at 10.1.0.1:29400")
    text = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    assert [
        line[:12].strip() for line in text.splitlines() if line.startswith(("groups", "lighthouse", "quorum"))
    ] == [
        "groups",
        "lighthouse",
        "quorum",
    ]


@pytest.mark.parametrize(("strategy", "devices"), [("ddp_ft", 1), ("hsdp_ft", 2)], ids=["ddp_ft", "hsdp_ft"])
def test_a_checkpoint_is_written_by_one_group_with_torchfts_step_and_resumed_by_all(
    tmp_path, strategy, devices
):
    import torch

    (tmp_path / "train.py").write_text(CHECKPOINTED)
    out = tmp_path / "out"
    out.mkdir()

    def run(until: int) -> str:
        # min_replicas=2: no step without both groups (a group started late
        # on a loaded machine would otherwise find the other's newer checkpoint).
        done = subprocess.run(
            [sys.executable, "-m", "phalanx", "run", "--strategy", strategy, "--accelerator", "cpu",
             "--devices", str(devices), "--replica-groups", "2", "-o", "min_replicas=2",
             "train.py", str(out), str(until)],
            cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    first = run(6)
    assert re.findall(r"RESUMED group=\d at=(\d+) step=(\d+)", first) == [("0", "0")] * 2
    writers = re.findall(r"WROTE group=(\d) step=(\d+)", first)
    assert sorted(step for _, step in writers) == ["3", "6"], first  # one writer per save
    if strategy == "ddp_ft":  # one file (hsdp_ft's is a sharded directory, read back below)
        saved = torch.load(out / "ckpt" / CheckpointDirectory(out / "ckpt").path(6).name, weights_only=True)
        assert saved["torchft"]["step"] == 6 + 1  # TorchFT's count has the step that made the groups alike

    again = run(9)
    # Both groups start at the saved step: TorchFT's step came back with it.
    assert re.findall(r"RESUMED group=\d at=(\d+) step=(\d+)", again) == [("6", "6")] * 2
    assert sorted(step for _, step in re.findall(r"WROTE group=(\d) step=(\d+)", again)) == ["9"]


ACCUMULATED = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset
    import phalanx

    out, stop = Path(sys.argv[1]), int(sys.argv[2])
    strategy = phalanx.resolve()
    strategy.launch()
    torch.manual_seed(strategy.replica_group)  # unlike on purpose

    class Samples(Dataset):
        def __len__(self):
            return 64

        def __getitem__(self, i):
            return i, torch.randn(8, generator=torch.Generator().manual_seed(i))

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    if strategy.name == "hsdp_ft":  # FSDP's setup takes optimizer factories, of all the parameters
        import functools
        first, second = functools.partial(torch.optim.SGD, lr=0.05), functools.partial(torch.optim.Adam, lr=0.01)
    else:
        first = torch.optim.SGD(model[0].parameters(), lr=0.05)
        second = torch.optim.Adam(model[2].parameters(), lr=0.01)
    model, first, second = strategy.setup(model, first, second)
    loader = strategy.setup_dataloader(DataLoader(Samples(), batch_size=2, shuffle=True))
    batches = iter(loader)
    while strategy.current_step < stop:
        first.zero_grad()
        second.zero_grad()
        taken = []
        for micro in range(2):  # two micro-batches a step, synchronised once
            try:
                ids, x = next(batches)
            except StopIteration:
                batches = iter(loader)
                ids, x = next(batches)
            taken.append(f"{loader.epoch}:{','.join(map(str, ids.tolist()))}")
            with strategy.no_backward_sync(model, enabled=micro == 0):
                with strategy.forward_context():
                    loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
                strategy.backward(loss / 2)
        strategy.optimizer_step(first)
        strategy.optimizer_step(second)
        print(f"ACCUMULATED group={strategy.replica_group} rank={strategy.global_rank} "
              f"committed={strategy.committed} participants={strategy.participants} "
              f"taken={' '.join(taken)}", flush=True)
    whole = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    if strategy.global_rank == 0:
        torch.save(whole, out / f"group{strategy.replica_group}.pt")
    """
)


@pytest.mark.parametrize(("strategy", "devices"), [("ddp_ft", 1), ("hsdp_ft", 2)])
def test_mixed_precision_gradient_accumulation_and_two_optimizers(tmp_path, strategy, devices):
    import torch

    (tmp_path / "train.py").write_text(ACCUMULATED)
    done = subprocess.run(
        [sys.executable, "-m", "phalanx", "run", "--strategy", strategy, "--accelerator", "cpu", "--devices",
         str(devices), "--replica-groups", "2", "--precision", "bf16-mixed", "train.py", str(tmp_path), "12"],
        cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    steps = re.findall(
        r"ACCUMULATED group=(\d) rank=\d committed=(\w+) participants=(\d) taken=(.*)", done.stdout
    )
    assert len(steps) == 2 * devices * 12, done.stdout
    assert {(committed, participants) for _, committed, participants, _ in steps} == {("True", "2")}
    # Both groups end alike: each step's two micro-batches of both groups,
    # averaged once (no_backward_sync), stepped by both optimizers.
    a, b = (torch.load(tmp_path / f"group{g}.pt") for g in (0, 1))
    assert all(x.equal(y) for x, y in zip(a, b, strict=True))
    # Every sample of the first epoch in exactly one micro-batch of one group.
    first_epoch = collections.Counter(
        int(i)
        for *_, taken in steps
        for part in taken.split()
        if part.startswith("0:")
        for i in part[2:].split(",")
    )
    assert sorted(first_epoch) == list(range(64)) and set(first_epoch.values()) == {1}, first_epoch


def test_the_ray_replica_groups_options_are_checked():
    # Its runs are in the ray session (plugins/ray/tests/test_cluster.py);
    # its options are checked where it is built, without ray.
    from phalanx_torchft.ray_groups import RayReplicaGroupsLauncher

    with pytest.raises(MisconfigurationError, match=r"placement_timeout=0; expected seconds, more than 0"):
        RayReplicaGroupsLauncher(placement_timeout=0)
    with pytest.raises(MisconfigurationError, match=r"address='  '; give a Ray address"):
        RayReplicaGroupsLauncher(address="  ")
    with pytest.raises(MisconfigurationError, match=r"replica_groups=3 on num_nodes=2 hosts"):
        RayReplicaGroupsLauncher(replica_groups=3, num_nodes=2)
    with pytest.raises(MisconfigurationError, match=r"would spread each group over 2 nodes"):
        RayReplicaGroupsLauncher(replica_groups=2, num_nodes=4)
    launcher = RayReplicaGroupsLauncher(replica_groups=4, num_nodes=2, address="auto")
    said = launcher.explain()
    assert said["hosts"].startswith("2 Ray node(s) with 1 free CPU(s) each"), said
    assert "2 on each of 2 Ray node(s)" in said["groups"], said


def test_the_whole_script_of_torchft_md_is_the_example_and_runs_as_written(tmp_path):
    # torchft.md opens with a DDP script (set_epoch, loader workers) and the
    # command that runs it: the same as examples/train_ft.py, and it runs.
    root = Path(__file__).resolve().parents[3]
    page = (root / "docs" / "content" / "torchft.md").read_text()
    section = page[page.index("## A whole script") : page.index("## When to choose it")]
    script = re.search(r"```python\n(.*?)```", section, re.S)
    assert script and script[1] in (root / "examples" / "train_ft.py").read_text()
    run = re.search(r"^(phalanx run --strategy ddp_ft .*examples/train_ft\.py)$", section, re.M)
    assert run, section
    done = subprocess.run(
        [sys.executable, "-m", *run[1].split()],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.findall(r"epoch (\d): loss", done.stdout) == ["0", "1", "2"], done.stdout
