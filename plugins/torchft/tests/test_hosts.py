"""``ddp_ft`` on several hosts (network namespaces of a test bed): one
replica group a host, TorchFT's lighthouse in node 0's ``phalanx run``.
A host killed whole (every process, as a lost machine) and one cut off
the network: the other hosts' groups train on without a restart, and the
lost group, back, heals from a peer."""

from __future__ import annotations

import itertools
import os
import re
import signal
import time

import pytest

pytest.importorskip("torchft", reason="phalanx-torchft's tests need torchft: pip install 'torchft>=0.2,<0.3'")

from ft_job import Job, a_late_group_once_the_job_has_finished, ranks_of

from phalanx_core.testing.hosts import TestBed, missing


@pytest.fixture
def bed():
    if missing() is not None:
        pytest.fail(f"these tests need network namespaces: {missing()}")
    with TestBed(3, subnet="192.168.79") as made:
        yield made


def same_weights_everywhere(job: Job, groups: int) -> None:
    import torch

    ends = sorted(job.out.glob("group*-rank*-*.pt"))
    # With the job's output: a group that ended without its weights says why there.
    assert len(ends) == groups, ([p.name for p in ends], job.output)
    first = torch.load(ends[0])["weights"]
    for path in ends[1:]:
        weights = torch.load(path)["weights"]
        assert all(a.equal(b) for a, b in zip(first, weights, strict=True)), path.name


def node1_killed_and_replaced_the_others_never_restarted(job: Job) -> str:
    """After a job whose node1 was killed whole and started again: the
    other nodes and the replacement ended well, node1's first run by
    SIGKILL, and no launcher restarted a group; the job's output."""
    output = job.output
    assert job.codes[0] == 0 and job.codes[2] == 0 and job.codes[3] == 0, (job.codes, output)
    assert job.codes[1] == -signal.SIGKILL, job.codes
    for group in (0, 2):  # never restarted: one process each
        assert len(job.pids(group)) == 1, output
    assert "phalanx run: replica group" not in output, output  # no launcher restarted a group
    return output


def test_a_lost_host_drops_out_and_its_replacement_heals_from_a_peer(bed, tmp_path):
    job = Job(tmp_path, "--devices", "1", "--replica-groups", "3", hosts=bed.hosts, park_at=10)
    victim_file = job.out / "victim"
    job.wait_for(victim_file.exists, "group 1 (node1) at step 10")
    killed = bed.kill_all(bed.hosts[1])  # its phalanx run, its group's launcher, its rank
    assert killed >= 3, killed
    job.processes[1].wait(30)
    # The other hosts' groups go on alone: steps of two groups.
    job.wait_for(
        lambda: sum(1 for s in job.steps if s[0] == 0 and s[5] == 2 and s[4]) >= 3, "steps of 2 groups"
    )
    # The host comes back (a replacement with node1's name and address).
    job.start(1)
    job.wait_for(lambda: len(job.pids(1)) == 2, "node1's group training again")
    job.stop_after(8)
    job.finish()
    output = node1_killed_and_replaced_the_others_never_restarted(job)
    # Group 1 died holding its step-10 batch: no step from 10 on had three groups
    # until its replacement came. (A survivor whose all-reduce broke where the
    # other's completed copies the step from it, as TorchFT heals: not counted.)
    two = [s for s in job.steps if s[0] == 0 and s[3] >= 10 and s[4] and s[7]]
    assert two and two[0][5] == 2, output
    back = [s for s in job.steps if s[2] == job.pids(1)[1]]
    assert any(s[4] and s[5] == 3 for s in back), output  # the replacement trained with the others
    same_weights_everywhere(job, 3)
    assert not job.diverged(), (job.diverged(), output)
    ends = job.ends()
    assert len(ends[1]["loads"]) == 1 and ends[1]["loads"][0] >= 10, ends[1]["loads"]  # healed, no checkpoint

    trained = job.trained()
    for epoch in sorted(trained)[:-1]:
        assert set(trained[epoch]) == set(range(120)), (epoch, output)


def test_under_diloco_ft_a_lost_host_is_left_out_of_the_syncs_and_its_replacement_heals_at_one(bed, tmp_path):
    # diloco_ft, windows of 4 steps, one group a host; node1 killed whole
    # at step 9 (the window of steps 8 to 11), its batch in hand.
    window = 4
    options = ("-o", f"sync_every={window}", "-o", "outer_momentum=0")
    job = Job(
        tmp_path, "--devices", "1", "--replica-groups", "3", *options,
        strategy="diloco_ft", hosts=bed.hosts, park_at=9,
    )  # fmt: skip
    victim_file = job.out / "victim"
    job.wait_for(victim_file.exists, "group 1 (node1) at step 9")
    victim = int(victim_file.read_text())
    killed = bed.kill_all(bed.hosts[1])  # its phalanx run, its group's launcher, its rank
    assert killed >= 3, killed
    job.processes[1].wait(30)
    # The other hosts' groups sync alone (each sync's quorum: two groups).
    job.wait_for(
        lambda: sum(1 for s in job.steps if s[0] == 0 and s[3] >= 12 and s[5] == 2) >= 2 * window,
        "windows of the two other groups",
    )
    job.start(1)  # the host back: a replacement with node1's name and address
    job.wait_for(
        lambda: any(s[0] == 1 and s[2] != victim and s[5] for s in job.syncs), "node1's window in a sync"
    )
    last = max(s[3] for s in job.steps)
    job.stop_after(0, at_least=(last // window + 3) * window)  # at a window's end
    job.finish()
    output = node1_killed_and_replaced_the_others_never_restarted(job)
    # The replacement healed at its first sync (its window not in it), and
    # its window was in every sync after.
    replacement = ranks_of(job, 1, 0)[-1]
    back = [
        (committed, contributed)
        for _, _, pid, _, committed, contributed, _ in job.syncs
        if pid == replacement
    ]
    assert back and back[0] == (True, False), (back, output)
    assert all(entry == (True, True) for entry in back[1:]), back
    same_weights_everywhere(job, 3)
    # Every sample of an epoch in one window a sync took; where a window
    # ran past the epoch's end (with two groups an epoch is 7.5 windows),
    # the share of its old-epoch steps that a group not in the sync was
    # dealt (node1's lost window, or its replacement's first, blind one) is
    # trained at the next epoch's start, within a window's share.
    trained = job.windows_trained()
    for epoch in sorted(trained)[:-1]:
        missing = set(range(120)) - set(trained[epoch])
        assert missing <= set(trained[epoch + 1]), (epoch, sorted(missing), output)
        assert len(missing) <= window * 2, (epoch, sorted(missing))


def test_a_host_cut_off_the_network_drops_out_and_heals_when_it_is_back(bed, tmp_path):
    # Short timeouts: a survivor's all-reduce with the cut host's group
    # gives up after replica_timeout, the cut group's quorum after
    # quorum_timeout (then its rank fails and node1 restarts the group).
    timeouts = ("-o", "replica_timeout=3", "-o", "quorum_timeout=5")
    job = Job(tmp_path, "--devices", "1", "--replica-groups", "3", *timeouts, hosts=bed.hosts)
    job.wait_for(lambda: any(s[0] == 1 and s[3] >= 10 for s in job.steps), "group 1 (node1) at step 10")
    bed.cut(bed.hosts[1])
    cut_at = time.monotonic()
    job.wait_for(
        lambda: sum(1 for s in job.steps if s[0] == 0 and s[6] > cut_at and s[4] and s[5] == 2) >= 5,
        "steps of the two other groups",
    )
    # Cut for longer than quorum_timeout: the cut group's quorum fails, its
    # rank raises, and node1's launcher starts the group again, into the cut.
    time.sleep(max(0.0, cut_at + 8 - time.monotonic()))
    bed.reconnect(bed.hosts[1])
    back_at = time.monotonic()
    job.wait_for(
        lambda: any(s[0] == 1 and s[6] > cut_at and s[4] and s[5] == 3 for s in job.steps), "group 1 back"
    )
    job.stop_after(8)
    assert job.finish() == 0, job.output
    output = job.output
    assert job.codes == [0, 0, 0], (job.codes, output)
    # The cut group's rank said why it stopped, and node1 started the group again.
    assert "NoQuorumError: replica group 1: no quorum for step" in output, output
    assert "phalanx run: replica group 1 failed (exit status 1); starting it again (1 of 3)" in output
    for group in (0, 2):  # never restarted: one process each
        assert len(job.pids(group)) == 1, output
    # No split brain: every group that committed a step holds the same weights
    # after it; and the cut group committed nothing once the quorum it may
    # have had when the cut came was used (a step: 0.1 s, 2 s allowed): no lighthouse, no quorum.
    assert not job.diverged(), (job.diverged(), output)
    alone = [s for s in job.steps if s[0] == 1 and cut_at + 2.0 < s[6] < back_at and s[4]]
    assert not alone, (alone, output)
    same_weights_everywhere(job, 3)
    trained = job.trained()
    for epoch in sorted(trained)[:-1]:
        assert set(trained[epoch]) == set(range(120)), (epoch, output)


def test_the_lighthouses_host_lost_stops_every_group_with_a_named_error(bed, tmp_path):
    timeouts = ("-o", "replica_timeout=3", "-o", "quorum_timeout=3", "--max-restarts", "1")
    job = Job(tmp_path, "--devices", "1", "--replica-groups", "3", *timeouts, hosts=bed.hosts)
    job.wait_for(lambda: any(s[3] >= 5 for s in job.steps), "step 5")
    bed.kill_all(bed.hosts[0])  # node 0: the lighthouse and group 0
    lost_at = time.monotonic()
    job.finish(timeout=120)
    output = job.output
    for node in (1, 2):
        assert job.codes[node] == 1, (job.codes, output)
        assert bed.pids(bed.hosts[node]) == [], output  # nothing of the job left on the host
    for group in (1, 2):
        assert f"NoQuorumError: replica group {group}: no quorum for step" in output, output
        assert f"replica group {group} failed 2 time(s), more than max_restarts=1" in output, output
    # No step committed without the lighthouse, once a quorum it gave before it
    # was lost is used (a step takes 0.1 s, 2 s allowed; a commit asks the group's own
    # manager, not the lighthouse).
    late = [s for s in job.steps if s[6] > lost_at + 2.0 and s[4]]
    assert not late, (late, output)
    assert not job.diverged(), (job.diverged(), output)


def lighthouse_host(bed: TestBed, job: Job) -> int:
    """The bed's host whose ``phalanx run`` last said it runs the job's
    lighthouse (the elected one)."""
    said = re.findall(r"this host runs the job's lighthouse now \(term \d+\), at ([\d.]+):", job.output)
    assert said, job.output
    return next(i for i, host in enumerate(bed.hosts) if host.address == said[-1])


def test_with_the_rendezvous_in_etcd_the_lighthouses_host_lost_leaves_the_others_training(bed, tmp_path):
    # An etcd member on each host; every host stands for the lighthouse.
    # The elected one's host is killed whole (its group and its etcd member
    # with it): another host takes the lighthouse over, and the two other
    # groups train on, never restarted, to the end, alike, every sample of
    # an epoch in one committed step.
    endpoints = bed.start_etcd(tmp_path)
    flags = ("--devices", "1", "--replica-groups", "3", "--max-restarts", "1")
    job = Job(tmp_path, *flags, "--rendezvous", f"etcd://{endpoints}/ft-lighthouse", hosts=bed.hosts)
    job.wait_for(lambda: any(s[3] >= 8 and s[5] == 3 for s in job.steps), "step 8 with three groups")
    leader = lighthouse_host(bed, job)
    survivors = [group for group in range(3) if group != leader]
    bed.kill_all(bed.hosts[leader])  # its lighthouse, its group, its etcd member
    lost_at = time.monotonic()
    job.wait_for(
        lambda: any(s[6] > lost_at and s[4] and s[5] == 2 for s in job.steps), "a step of the two others"
    )
    after = min(s[6] for s in job.steps if s[6] > lost_at and s[4] and s[5] == 2)
    job.stop_after(5, at_least=45)  # into the third epoch (20 steps of three groups, 30 of two)
    for node, process in enumerate(job.processes):
        if node != leader:
            assert process.wait(180) == 0, job.output
    output = job.output
    # The first lighthouse, then another host's (and, as that host's groups
    # end before the last one's, maybe the last host's).
    said = re.findall(r"this host runs the job's lighthouse now \(term \d+\), at ([\d.]+):", output)
    assert len(said) >= 2 and bed.hosts[leader].address not in said[1:], output
    for group in survivors:
        assert len(job.pids(group)) == 1, output  # never restarted
        assert f"replica group {group} failed" not in output, output
    same_weights_everywhere(job, 2)
    assert not job.diverged(), job.diverged()
    trained = job.trained()
    for epoch in sorted(trained)[:-1]:
        assert set(trained[epoch]) == set(range(120)), (epoch, sorted(set(range(120)) - set(trained[epoch])))
    print(f"the lighthouse's host lost: the others' next committed step {after - lost_at:.2f} s after")


def test_with_the_rendezvous_in_etcd_the_lighthouses_host_cut_off_and_back_splits_no_brain(bed, tmp_path):
    # The elected lighthouse's host is cut off the network (its etcd member
    # too, alone in its part): it stops serving once it can renew its lease
    # no more (0.6 s, before its lighthouse could drop the groups it no
    # longer hears and make a quorum of its own group), another host takes
    # over once the lease ends, and the two others train on. The cut group
    # gets no quorum (it stops, and its host starts it again, into the cut);
    # back, it follows the new lighthouse and heals. No step is committed
    # by two quorums with different members: every group that committed a
    # step holds the same weights after it.
    endpoints = bed.start_etcd(tmp_path)
    flags = ("--devices", "1", "--replica-groups", "3", "-o", "replica_timeout=3")
    job = Job(tmp_path, *flags, "--rendezvous", f"etcd://{endpoints}/ft-split", hosts=bed.hosts)
    job.wait_for(lambda: any(s[3] >= 8 and s[5] == 3 for s in job.steps), "step 8 with three groups")
    leader = lighthouse_host(bed, job)
    others = [group for group in range(3) if group != leader]
    bed.cut(bed.hosts[leader])
    cut_at = time.monotonic()
    job.wait_for(
        lambda: sum(1 for s in job.steps if s[0] == others[0] and s[6] > cut_at and s[4] and s[5] == 2) >= 5,
        "steps of the two other groups",
    )
    time.sleep(max(0.0, cut_at + 8 - time.monotonic()))
    bed.reconnect(bed.hosts[leader])
    back_at = time.monotonic()
    job.wait_for(
        lambda: any(s[0] == leader and s[6] > back_at and s[4] and s[5] == 3 for s in job.steps),
        "the cut group back",
    )
    job.stop_after(8)
    assert job.finish() == 0, job.output
    output = job.output
    assert job.codes == [0, 0, 0], (job.codes, output)
    assert "this host stops running the job's lighthouse (term" in output, output
    for group in others:
        assert len(job.pids(group)) == 1, output  # never restarted
    assert not job.diverged(), (job.diverged(), output)
    alone = [s for s in job.steps if s[0] == leader and cut_at + 2.0 < s[6] < back_at and s[4]]
    assert not alone, (alone, output)
    same_weights_everywhere(job, 3)


def test_a_host_without_the_jobs_secret_joins_no_quorum_and_is_named(bed, tmp_path):
    # Two hosts of the job share PHALANX_JOB_SECRET; a third host runs the
    # same command with another secret (a stranger that reaches the
    # lighthouse's port). Its forwarder cannot prove the secret: the guard
    # names its address, the stranger's phalanx run says why it cannot take
    # part and ends with its group, which got no quorum and no weights; the
    # job's two groups train on alone, and node 0 names the stranger's
    # writes to the end store, which it ignores.
    job = Job(
        tmp_path,
        "--devices", "1", "--replica-groups", "3", "-o", "quorum_timeout=5",
        hosts=bed.hosts,
        env={**os.environ, "PHALANX_JOB_SECRET": "the job's"},
        started=[0, 1],
    )  # fmt: skip
    job.env = {**os.environ, "PHALANX_JOB_SECRET": "a stranger's"}
    job.start(2)
    job.wait_for(lambda: any(s[3] >= 10 and s[5] == 2 for s in job.steps), "step 10 of the job's two groups")
    stranger = bed.hosts[2].address
    job.wait_for(lambda: f"the lighthouse refused a connection from {stranger}" in job.output, "named")
    job.wait_for(lambda: job.processes[2].poll() is not None, "the stranger's end")
    assert job.processes[2].returncode == 1, job.output
    job.stop_after(3)
    for node in (0, 1):
        assert job.processes[node].wait(120) == 0, job.output
    output = job.output
    assert "did not let this host in: it did not prove the job's secret" in output, output
    assert "this host cannot take part in the job: the lighthouse at" in output, output
    assert "written without the proof of the job's secret (PHALANX_JOB_SECRET): ignored" in output, output
    assert not [s for s in job.steps if s[0] == 2], output  # not a step, not a heal
    assert not list(job.out.glob("group2-*.pt")), output
    same_weights_everywhere(job, 2)


def test_node_0_keeps_the_lighthouse_until_the_other_hosts_groups_have_ended(bed, tmp_path):
    # Node 0's groups end first; node 1's group, late, fails afterwards:
    # the lighthouse is still there, and node 1 does not start the group
    # again (no peer to heal from), so every host ends with 0.
    job = Job(tmp_path, "--devices", "1", "--replica-groups", "3", hosts=bed.hosts, park_at=10)
    # Node 0 says it waits, while group 1 is still parked: then it is killed.
    waits = r"the lighthouse stays until the groups of node\(s\) 1(, 2)? have ended"
    a_late_group_once_the_job_has_finished(job, groups=3, kill=True, before=(waits, "node 0 waiting"))


@pytest.mark.parametrize("strategy", ["ddp_ft", "hsdp_ft"])
def test_a_group_on_two_hosts_is_started_again_on_both_and_heals_from_a_peer(tmp_path, strategy):
    # Four hosts, two groups: each group a job of two hosts (one rank each),
    # its store on its first host. A rank of group 1 on its second host is
    # killed: the group's rank on the first host is stopped too, each host
    # starts its part again, they meet in a new store, and the group heals
    # from group 0, whose ranks are never touched. hsdp_ft: each group's
    # model sharded over its two hosts (FSDP), each shard healed from the
    # same shard of group 0.
    if missing() is not None:
        pytest.fail(f"these tests need network namespaces: {missing()}")
    with TestBed(4, subnet="192.168.79") as bed:
        flags = ("--devices", "1", "--replica-groups", "2")
        job = Job(tmp_path, *flags, strategy=strategy, hosts=bed.hosts, park_at=10)
        job.wait_for((job.out / "victim").exists, "group 1 (nodes 2 and 3) at step 10")
        second = [s[2] for s in job.steps if s[0] == 1 and s[1] == 1]
        assert second, job.output
        os.kill(second[-1], signal.SIGKILL)  # group 1's rank 1, on node 3; its rank 0 is parked on node 2
        job.wait_for(lambda: len(ranks_of(job, 1, 1)) == 2 and len(ranks_of(job, 1, 0)) == 2, "group 1 again")
        job.stop_after(8)
        assert job.finish() == 0, job.output
        output = job.output
        assert job.codes == [0, 0, 0, 0], (job.codes, output)
        for rank in (0, 1):
            assert len(ranks_of(job, 0, rank)) == 1, output  # group 0 never restarted
        # Both hosts of group 1 started their part again, once.
        assert output.count("phalanx run: replica group 1 failed") == 2, output
        assert "replica group 0 failed" not in output, output
        same_weights_everywhere(job, 4)
        assert not job.diverged(), (job.diverged(), output)
        for path in sorted(job.out.glob("group1-rank*-*.pt")):
            import torch

            end = torch.load(path)
            # Healed from group 0 (one load, at the job's step; no checkpoint), in its second start.
            assert len(end["loads"]) == 1 and end["loads"][0] >= 10, (path.name, end["loads"])
            assert end["restarts"] == 1, (path.name, end["restarts"])
        trained = job.trained()
        for epoch in sorted(trained)[:-1]:
            assert set(trained[epoch]) == set(range(120)), (epoch, output)


def test_a_lost_host_of_a_group_on_two_hosts_is_waited_for_until_the_job_ends(tmp_path):
    # Group 1 on nodes 2 and 3. Node 3 is lost: group 1's part on node 2
    # fails and waits for it in a new start, while group 0 trains alone.
    # Node 3 comes back: its part takes the newest start, and group 1 heals.
    # Node 3 is lost again and does not come back: the job ends when group
    # 0 does, and node 2 stops the part that waits, with status 0.
    if missing() is not None:
        pytest.fail(f"these tests need network namespaces: {missing()}")
    with TestBed(4, subnet="192.168.79") as bed:
        job = Job(tmp_path, "--devices", "1", "--replica-groups", "2", hosts=bed.hosts)
        # Both groups in a step (a group slow to start trains alone until it joins, by design).
        job.wait_for(lambda: any(s[0] == 1 and s[3] >= 5 and s[5] == 2 for s in job.steps), "both at step 5")
        assert bed.kill_all(bed.hosts[3]) >= 3
        lost_at = time.monotonic()
        job.wait_for(
            lambda: sum(1 for s in job.steps if s[0] == 0 and s[6] > lost_at + 2 and s[5] == 1 and s[4]) >= 3,
            "group 0 training alone",
        )
        job.start(3)  # node 3's replacement
        job.wait_for(lambda: len(ranks_of(job, 1, 1)) == 2, "group 1 on the replacement")
        # The replacement's part healed from group 0 (with group 1's part on node 2) and trains with it.
        job.wait_for(
            lambda: any(s[2] == ranks_of(job, 1, 1)[1] and s[4] and s[5] == 2 and s[7] for s in job.steps),
            "group 1 training with group 0 again",
        )
        healed = dict(job.ends())  # none yet: only the ends' files count
        assert not healed, healed
        assert bed.kill_all(bed.hosts[3]) >= 3  # lost again, for good
        again_at = time.monotonic()
        job.wait_for(
            lambda: (
                sum(1 for s in job.steps if s[0] == 0 and s[6] > again_at + 2 and s[5] == 1 and s[4]) >= 3
            ),
            "group 0 training alone again",
        )
        # Node 2's part waits for node 3 in a new start (its third).
        again = "phalanx run: replica group 1 failed (exit status 1); starting it again (2 of 3)"
        job.wait_for(lambda: again in job.output, "node 2 starting its part again")
        job.stop_after(5)
        job.finish()
        output = job.output
        assert job.codes[:3] == [0, 0, 0] and job.codes[3] == -signal.SIGKILL, (job.codes, output)
        assert job.codes[4] == -signal.SIGKILL, (job.codes, output)
        assert "replica group 1 waited for a host of its own after group 0 had ended the job" in output, (
            output
        )
        for rank in (0, 1):
            assert len(ranks_of(job, 0, rank)) == 1, output  # group 0 never restarted
        assert not job.diverged(), (job.diverged(), output)
        for host in bed.hosts[:3]:
            assert bed.pids(host) == [], output  # nothing of the job left


def test_a_host_of_a_group_on_two_hosts_cut_off_the_network_stops_the_group_until_it_is_back(tmp_path):
    # Group 1 on nodes 2 and 3; node 3 cut off for 25 s. Group 1's rank on
    # node 2 waits in the group's all-reduce with node 3's, but node 2's
    # part watches node 3's heartbeat: after 5 s (a part's host_lost_after)
    # it stops, naming node 3's host, and node 2 starts its part again, to
    # wait for node 3. Node 3's part, whose requests to the group's store go
    # unanswered, ends too, and takes the group's next start once the
    # network is back: group 1 heals from group 0, which was never stopped.
    # Group 1's manager on node 2 beats to the lighthouse until node 2's part
    # stops: no quorum of group 0 alone (one of two live groups is no
    # majority) until then, a stall shorter than TorchFT's default
    # quorum_timeout (10 s), so group 0 is never stopped.
    if missing() is not None:
        pytest.fail(f"these tests need network namespaces: {missing()}")
    with TestBed(4, subnet="192.168.79") as bed:
        job = Job(
            tmp_path, "--devices", "1", "--replica-groups", "2", "-o", "replica_timeout=3", hosts=bed.hosts
        )
        job.wait_for(lambda: any(s[0] == 1 and s[3] >= 5 and s[5] == 2 for s in job.steps), "both at step 5")
        bed.cut(bed.hosts[3])
        cut_at = time.monotonic()
        lost = "node 1 (host node3) is lost: its launching process stopped beating"
        job.wait_for(lambda: lost in job.output, "node 2 naming node 3's host", timeout=60)
        job.wait_for(
            lambda: sum(1 for s in job.steps if s[0] == 0 and s[6] > cut_at and s[5] == 1 and s[4]) >= 3,
            "group 0 training alone",
        )
        time.sleep(max(0.0, cut_at + 25 - time.monotonic()))
        bed.reconnect(bed.hosts[3])
        back_at = time.monotonic()
        job.wait_for(
            lambda: any(
                s[0] == 1 and s[1] == 1 and s[6] > back_at and s[4] and s[5] == 2 and s[7] for s in job.steps
            ),
            "group 1 training with group 0 again",
        )
        job.stop_after(5)
        assert job.finish() == 0, job.output
        output = job.output
        assert job.codes == [0, 0, 0, 0], (job.codes, output)
        for rank in (0, 1):
            assert len(ranks_of(job, 0, rank)) == 1, output  # group 0 never restarted
            assert len(ranks_of(job, 1, rank)) == 2, output  # group 1 started again once, on both hosts
        # No split brain: group 1 committed nothing on its own while cut.
        assert not job.diverged(), (job.diverged(), output)
        alone = [s for s in job.steps if s[0] == 1 and cut_at + 5 < s[6] < back_at and s[4]]
        assert not alone, (alone, output)
        same_weights_everywhere(job, 4)
        trained = job.trained()
        for epoch in sorted(trained)[:-1]:
            assert set(trained[epoch]) == set(range(120)), (epoch, output)
        commits = [
            s[6] for s in job.steps if s[0] == 0 and s[1] == 0 and s[4] and cut_at - 5 < s[6] < back_at
        ]
        gap = max(b - a for a, b in itertools.pairwise(commits))
        print(f"group 0's longest gap between two commits across the cut: {gap:.1f} s")


#: Put on the job's PYTHONPATH: on host node2, once the file that
#: SLOW_PART names exists, the next launching process of a group's part
#: sleeps as it starts, after its host's launcher offered the group's new
#: start and before the group's store is up, and says so in a file beside.
SLOW_PART = """
import os, pathlib, socket, time
marker = pathlib.Path(os.environ["SLOW_PART"])
command = pathlib.Path("/proc/self/cmdline").read_bytes().split(b"\\0")
if socket.gethostname() == "node2" and b"phalanx_torchft._group" in command and marker.exists():
    marker.unlink()
    marker.with_name("slow-part-started").write_text(str(os.getpid()))
    time.sleep(60)
"""


def test_a_part_whose_first_host_is_lost_after_it_offered_a_start_takes_the_replacements_start(tmp_path):
    # Group 1 on nodes 2 and 3. Group 1's rank on node 3 is killed: both
    # parts start again; node 2 offers the group's new start, and node 3
    # takes it. Node 2's part is slow to come up (SLOW_PART), and node 2 is
    # lost whole before the group's store is up: node 3's part waits for a
    # store that will never answer. Node 2's replacement offers the next
    # start: node 3 leaves the dead one and takes it (it would otherwise
    # wait until rendezvous_timeout, 900 s), and group 1 heals.
    if missing() is not None:
        pytest.fail(f"these tests need network namespaces: {missing()}")
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SLOW_PART)
    marker = tmp_path / "slow-part"
    env = {**os.environ, "SLOW_PART": str(marker)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
    with TestBed(4, subnet="192.168.79") as bed:
        job = Job(tmp_path, "--devices", "1", "--replica-groups", "2", hosts=bed.hosts, env=env)
        job.wait_for(lambda: any(s[0] == 1 and s[3] >= 5 and s[5] == 2 for s in job.steps), "both at step 5")
        marker.write_text("")
        os.kill(ranks_of(job, 1, 1)[-1], signal.SIGKILL)  # group 1's rank on node 3
        started = tmp_path / "slow-part-started"
        job.wait_for(started.exists, "node 2's new part, slow to come up")
        assert bed.kill_all(bed.hosts[2]) >= 2  # its phalanx run and the sleeping part
        lost_at = time.monotonic()
        job.wait_for(
            lambda: sum(1 for s in job.steps if s[0] == 0 and s[6] > lost_at + 2 and s[5] == 1 and s[4]) >= 3,
            "group 0 training alone",
        )
        job.start(2)  # node 2's replacement
        replaced_at = time.monotonic()
        job.wait_for(
            lambda: any(s[0] == 1 and s[6] > replaced_at and s[4] and s[5] == 2 and s[7] for s in job.steps),
            "group 1 training with group 0 again",
        )
        print(f"node 2 replaced to group 1's first commit: "
              f"{min(s[6] for s in job.steps if s[0] == 1 and s[6] > replaced_at and s[4]) - replaced_at:.1f} s")  # fmt: skip
        job.stop_after(5)
        job.finish()
        output = job.output
        assert job.codes[:2] == [0, 0] and job.codes[2] == -signal.SIGKILL, (job.codes, output)
        assert job.codes[3:] == [0, 0], (job.codes, output)
        assert "which that host no longer runs (it was started again, or replaced); the part takes" in output
        for rank in (0, 1):
            assert len(ranks_of(job, 0, rank)) == 1, output  # group 0 never restarted
        assert not job.diverged(), (job.diverged(), output)
        same_weights_everywhere(job, 4)
        for host in bed.hosts:
            assert bed.pids(host) == [], output  # nothing of the job left
