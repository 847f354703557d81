"""``local_sgd_ft`` and ``diloco_ft``: replica groups that train a window of
steps on their own and sync at its end (TorchFT's LocalSGD and DiLoCo),
real processes, a group killed with SIGKILL in the middle of a window."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys

import pytest
from ft_job import CHECKPOINTED, Job

from phalanx_core import CheckpointDirectory
from phalanx_core.testing.processes import is_alive

H = 4  # sync_every: a window of four steps (the script's step takes 0.1 s)
#: The outer optimizer without momentum: the paper's (Nesterov, 0.9, lr 0.7),
#: tuned for windows of hundreds of AdamW steps, sends the script's small
#: regression (SGD, windows of 4) to inf within 200 steps, which a slow
#: restart under load reached.
OUTER = ("-o", "outer_momentum=0")
#: Between the groups only: compressed's int8 all-reduce.
INT8 = ("-o", "across=compressed", "-o", 'across_options={"dtype": "int8"}')


@pytest.mark.parametrize(
    ("strategy", "devices", "options"),
    [
        ("diloco_ft", 1, OUTER),
        ("local_sgd_ft", 1, ()),
        ("diloco_ft", 1, (*OUTER, "-o", "fragments=2", "--collective", "compressed")),
        ("diloco_ft", 1, (*OUTER, "-o", "fragments=2", "-o", "fragment_sync_delay=1", *INT8)),
        ("diloco_ft", 2, OUTER),
        ("diloco_hsdp_ft", 2, OUTER),
    ],
    ids=[
        "diloco_ft",
        "local_sgd_ft",
        "diloco_ft-2-fragments-compressed",
        "diloco_ft-2-fragments-delayed-int8",
        "diloco_ft-groups-of-2",
        "diloco_hsdp_ft-groups-of-2",
    ],
)
def test_a_killed_group_heals_at_a_sync_while_the_others_train_on(tmp_path, strategy, devices, options):
    # Three groups of one rank, windows of four steps. Group 1's rank 0
    # stops at step 9 (the window of steps 8 to 11), its batch in hand,
    # and is killed there: the two others sync without it at the window's
    # end and train on, never restarted; group 1, started again, trains a
    # window from its own weights, heals at its first sync (the model of
    # the window's start, its window not in the sync) and is in every sync
    # after. diloco_ft-2-fragments-compressed: the model synced in two
    # fragments (its two Linear layers), one every two steps (Streaming
    # DiLoCo), in bf16 between the groups. diloco_ft-2-fragments-delayed-int8:
    # the same in int8 between the groups (compressed's), each fragment's
    # all-reduce started a step before its sync (fragment_sync_delay=1):
    # group 1 is killed in that delay (step 9 is the last of the window of
    # steps 8 and 9), after its all-reduce, so the survivors' sync fails
    # at its commit (the groups check in again there) and the window's
    # samples are dealt again, group 1's share with them.
    # diloco_ft-groups-of-2: two ranks a group (DDP within it); TorchFT
    # heals each rank of a group from a source of its own, and every rank
    # ends with the same weights.
    # diloco_hsdp_ft-groups-of-2: the same with FSDP within each group (a
    # rank holds half of the model; rank r of every group syncs shard r).
    fragments = "-o" in options and "fragments=2" in options
    job = Job(
        tmp_path,
        "--devices",
        str(devices),
        "--replica-groups",
        "3",
        "--max-restarts",
        "1",
        "-o",
        f"sync_every={H}",
        *options,
        strategy=strategy,
        # Epochs of 20 steps (6 samples a step): the window of steps 8 to 11
        # inside the first. With groups of 2 (12 samples a step, epochs of
        # 10 steps) that window runs past the first epoch's end: group 1's
        # share of the first epoch's last steps is dealt at the next
        # epoch's start.
        park_at=9,
    )
    victim_file = job.out / "victim"
    job.wait_for(victim_file.exists, "group 1 at step 9")
    victim = int(victim_file.read_text())
    os.kill(victim, signal.SIGKILL)
    job.wait_for(
        lambda: any(s[0] == 1 and s[1] == 0 and s[2] != victim and s[5] for s in job.syncs),
        "group 1's window in a sync again",
    )
    last = max(s[3] for s in job.steps)
    job.stop_after(0, at_least=(last // H + 3) * H)  # at a window's end: every group just synced
    assert job.finish() == 0, job.output
    output = job.output

    # The survivors were never restarted; group 1 was, once.
    for group in (0, 2):
        assert len(job.pids(group)) == 1, output
    assert "replica group 1 failed (a rank was killed by SIGKILL)" in output
    assert "starting it again (1 of 1); the other groups go on" in output
    assert not is_alive(victim)
    returned = job.pids(1)[1]
    # The two others synced without group 1: the window it died in.
    syncs = collections.defaultdict(dict)  # step -> group -> (committed, contributed, parts)
    for group, rank, pid, step, committed, contributed, parts in job.syncs:
        if rank == 0:
            syncs[step][group, pid] = (committed, contributed, parts)
    # Group 1's first sync: it healed in it (committed, its window not in it);
    # every one after: its window in it.
    back = [
        (committed, contributed)
        for group, _, pid, _, committed, contributed, _ in job.syncs
        if pid == returned
    ]
    assert back[0] == (True, False), back
    assert all(entry == (True, True) for entry in back[1:]), back
    # Every committed sync left the groups in it alike: the model (the
    # synced fragment's weights, under fragments), never a split brain.
    for step, groups in syncs.items():
        committed = [parts for committed, _, parts in groups.values() if committed]
        if fragments:  # one of the two fragments was synced: its sums alike
            assert any(len({parts.split(",")[i] for parts in committed}) == 1 for i in range(2)), (
                step,
                groups,
            )
        else:
            assert len(set(committed)) == 1, (step, groups)
    survivors_alone = [step for step, groups in syncs.items() if len([1 for g, _ in groups if g != 1]) == 2
                       and not any(g == 1 for g, _ in groups)]  # fmt: skip
    assert survivors_alone, sorted(syncs)
    if not fragments:  # every rank ends at a sync of the whole model: the same weights everywhere
        import torch

        ends = job.ends()
        assert sorted(ends) == [0, 1, 2]
        every_rank = sorted(job.out.glob("group*-rank*-*.pt"))
        assert len(every_rank) == 3 * devices, [path.name for path in every_rank]
        for path in every_rank:
            weights = torch.load(path)["weights"]
            assert all(a.equal(b) for a, b in zip(ends[0]["weights"], weights, strict=True)), path.name
        assert [ends[group]["restarts"] for group in (0, 1, 2)] == [0, 1, 0]
    # Every sample of an epoch was in one window a sync took, the share of
    # the window group 1 died in (given back) included; where that window
    # ran past the epoch's end, the share of the old epoch is in the next.
    trained = job.windows_trained()
    everything = set(range(120))
    assert len(trained) >= 2, trained
    carried: set[int] = set()
    for epoch in sorted(trained)[:-1]:
        counts = trained[epoch]
        missing = everything - set(counts)
        assert missing <= set(trained[epoch + 1]), (epoch, sorted(missing), output)
        assert len(missing) <= 2 * devices * 2, (epoch, sorted(missing))  # a group's share of 2 steps
        if devices == 1:
            assert not missing, (epoch, sorted(missing), output)  # the windows end with the epochs
        repeated = sum(n - 1 for n in counts.values())
        assert repeated < 2 * 3 * devices + len(carried), (epoch, counts)  # the end filled from the start
        carried = missing
    if INT8[-1] in options:  # between the groups in int8 (parts to their ranks), no float32 all-reduce
        for path in job.out.glob("group*-rank*-*.pt"):
            import torch

            across = torch.load(path)["across"]
            assert across["collective"] == "CompressedCollective", across
            assert "float32" not in across["calls"] and across["calls"]["all_to_all"] >= 2, across
    elif "compressed" in options:  # between the groups in bf16 (the collective's inner one got no float32)
        for path in job.out.glob("group*-rank*-*.pt"):
            import torch

            across = torch.load(path)["across"]
            assert across["collective"] == "CompressedCollective", across
            assert "float32" not in across["calls"] and across["calls"]["bfloat16"] >= 2, across


@pytest.mark.parametrize(
    ("windowed", "synchronous", "devices"),
    [("diloco_ft", "ddp_ft", 1), ("diloco_hsdp_ft", "hsdp_ft", 2)],
    ids=["diloco_ft-ddp_ft", "diloco_hsdp_ft-hsdp_ft"],
)
def test_a_checkpoint_at_a_sync_resumes_under_diloco_ft_and_under_ddp_ft(
    tmp_path, windowed, synchronous, devices
):
    # diloco_hsdp_ft: two ranks a group, each holding half of the model;
    # the first checkpoint one file (state_dict_type=full, read here), the
    # others torch.distributed.checkpoint directories (sharded).
    import torch

    (tmp_path / "train.py").write_text(CHECKPOINTED)
    out = tmp_path / "out"
    out.mkdir()

    def run(strategy: str, until: int, *options: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "phalanx", "run", "--strategy", strategy, "--accelerator", "cpu",
             "--devices", str(devices), "--replica-groups", "2", "-o", "min_replicas=2", *options,
             "train.py", str(out), str(until)],
            cwd=tmp_path, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    full = ("-o", "state_dict_type=full") if devices > 1 else ()
    first = run(windowed, 6, "-o", "sync_every=3", *full)
    assert re.findall(r"RESUMED group=\d at=(\d+) step=(\d+)", first) == [("0", "0")] * 2
    assert sorted(step for _, step in re.findall(r"WROTE group=(\d) step=(\d+)", first)) == ["3", "6"], first
    saved = torch.load(out / "ckpt" / CheckpointDirectory(out / "ckpt").path(6).name, weights_only=True)
    assert saved["torchft"]["step"] == 6 + 1  # counted as ddp_ft counts: a step each, and the setup's
    outer = saved["window"]["outer"]
    assert len(outer) == 1 and outer[0]["state"], saved["window"]
    # The outer optimizer's momentum whole, as the model's weights (not a rank's shard).
    shapes = sorted(tuple(t.shape) for t in saved["model"].values())
    assert sorted(tuple(s["momentum_buffer"].shape) for s in outer[0]["state"].values()) == shapes, outer

    again = run(windowed, 9, "-o", "sync_every=3")
    assert re.findall(r"RESUMED group=\d at=(\d+) step=(\d+)", again) == [("6", "6")] * 2
    assert sorted(step for _, step in re.findall(r"WROTE group=(\d) step=(\d+)", again)) == ["9"]
    # Under the synchronous strategy, from the same checkpoint (its outer
    # optimizer's state left out), and back.
    synchronous_run = run(synchronous, 12)
    assert re.findall(r"RESUMED group=\d at=(\d+) step=(\d+)", synchronous_run) == [("9", "9")] * 2
    back = run(windowed, 15, "-o", "sync_every=3")
    assert re.findall(r"RESUMED group=\d at=(\d+) step=(\d+)", back) == [("12", "12")] * 2


def test_the_options_are_checked_before_any_rank_starts():
    import phalanx

    cases = [
        ("diloco_ft", {"sync_every": 0}, "sync_every=0; expected the number of training steps"),
        ("local_sgd_ft", {"sync_every": 2.5}, "sync_every=2.5"),
        ("diloco_ft", {"sync_every": 10, "fragments": 3}, "sync_every=10 is not a multiple of fragments=3"),
        (
            "diloco_ft",
            {"sync_every": 10, "fragments": 2, "fragment_sync_delay": 5},
            "expected an int from 0 to 4",
        ),
        ("diloco_ft", {"fragment_update_alpha": 2}, "fragment_update_alpha=2"),
        ("diloco_hsdp_ft", {"fragments": 0}, "strategy 'diloco_hsdp_ft': fragments=0"),
        ("diloco_hsdp_ft", {"state_dict_type": "both"}, "strategy 'diloco_hsdp_ft': state_dict_type='both'"),
        ("diloco_ft", {"outer_lr": 0.5, "outer_optimizer": print}, "give the one or the others"),
        ("diloco_ft", {"outer_optimizer": 3}, "expected a callable"),
        ("diloco_ft", {"outer_optimizer": lambda params: None.step}, "the outer optimizer could not be made"),
    ]
    from phalanx_core import MisconfigurationError

    for name, options, message in cases:
        with pytest.raises(MisconfigurationError, match=re.escape(message)):
            phalanx.resolve(name, accelerator="cpu", **options)


def test_explain_shows_the_window_the_outer_optimizer_and_what_crosses_per_sync():
    argv = [sys.executable, "-m", "phalanx", "explain", "--strategy", "diloco_ft", "--accelerator", "cpu",
            "--replica-groups", "3", "-o", "sync_every=100", "-o", "fragments=2", "--collective", "compressed"]  # fmt: skip
    text = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "sync_every=100" in text and "fragments=2" in text, text
    assert "outer optimizer" in text, text
