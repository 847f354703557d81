"""A job that survives a lost rank, on one node: ``phalanx run
--max-restarts 1`` restarts every rank after one is killed with SIGKILL,
and the script goes on from its newest complete checkpoint with
``strategy.resume()``: no sample of an epoch is trained on twice or
skipped, and the final weights equal those of a run that was never
interrupted. A job stopped on 3 ranks goes on on 2 with the rest of the
epoch split anew.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from phalanx_core.testing.processes import TAG_VAR, left_behind, new_tag, scheduler_free_environment

pytestmark = pytest.mark.subprocess

SCRIPT = Path(__file__).parent / "run_scripts" / "resumable.py"
SAMPLES, EPOCHS = 48, 2


def run(out: Path, *args: str, devices: int = 2, max_restarts: int | None = 1, tag: str = ""):
    command = [sys.executable, "-m", "phalanx", "run", "--strategy", "ddp", "--accelerator", "cpu",
               "--devices", str(devices)]  # fmt: skip
    if max_restarts is not None:
        command += ["--max-restarts", str(max_restarts)]
    return subprocess.run(
        [*command, str(SCRIPT), str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=scheduler_free_environment(**({TAG_VAR: tag} if tag else {})),
    )


def trained(out: Path) -> dict[int, Counter]:
    """Every sample each epoch trained on, counted, from every rank's log
    (``seen-*.txt``, and ``job<N>-seen-*.txt`` of earlier jobs, whose
    attempts come first): an attempt's steps after the step the next
    attempt resumed from were lost with it (they are in no checkpoint), and
    do not count."""
    lines = []
    logs = [(int(p.name[3:].split("-")[0]), p) for p in out.glob("job*-seen-*.txt")]
    logs += [(len({job for job, _ in logs}), p) for p in out.glob("seen-*.txt")]
    for job, log in logs:
        for line in log.read_text().splitlines():
            attempt, epoch, step, *indices = map(int, line.split())
            lines.append((job * 100 + attempt, epoch, step, indices))
    resumed = {}  # attempt -> the first step it trained, minus one
    for attempt, _, step, _ in lines:
        resumed[attempt] = min(resumed.get(attempt, step), step - 1)
    order = sorted(resumed)
    following = dict(itertools.pairwise(order))
    counts: dict[int, Counter] = {e: Counter() for e in range(EPOCHS)}
    for attempt, epoch, step, indices in lines:
        if attempt in following and step > resumed[following[attempt]]:
            continue
        counts[epoch].update(indices)
    return counts


def assert_every_sample_once(out: Path) -> None:
    for epoch, counts in trained(out).items():
        assert sorted(counts) == list(range(SAMPLES)), (epoch, sorted(counts))
        assert set(counts.values()) == {1}, (epoch, [i for i, n in counts.items() if n > 1])


def final_weights(out: Path) -> dict:
    return torch.load(out / "final.pt", weights_only=True)["model"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    done = run(out, max_restarts=None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((out / "done.json").read_text()) == {"restarts": 0, "world": 2, "steps": 12}
    assert_every_sample_once(out)
    return final_weights(out)


@pytest.mark.parametrize("kill_at", [4, 7, 11])
def test_a_killed_rank_is_restarted_and_the_run_ends_as_if_nothing_happened(tmp_path, uninterrupted, kill_at):
    tag = new_tag()
    done = run(tmp_path, str(kill_at), tag=tag)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "done.json").read_text()) == {"restarts": 1, "world": 2, "steps": 12}
    said = "phalanx run: rank 1 failed (killed by SIGKILL); every rank is stopped and started again (restart 1 of 1)"
    assert said in done.stderr, done.stderr[-3000:]
    assert_every_sample_once(tmp_path)
    weights = final_weights(tmp_path)
    assert all(torch.equal(weights[k], uninterrupted[k]) for k in uninterrupted), (weights, uninterrupted)
    assert not left_behind(tag)


def test_without_restarts_the_killed_rank_ends_the_job(tmp_path):
    done = run(tmp_path, "4", max_restarts=0)
    assert done.returncode != 0
    assert "rank 1" in done.stderr and "SIGKILL" in done.stderr
    assert not (tmp_path / "done.json").exists()


def test_a_job_stopped_on_three_ranks_goes_on_on_two_splitting_the_rest_of_the_epoch(tmp_path):
    # 48 samples, batch 4: 4 steps of 12 samples per epoch on 3 ranks; stop
    # after step 3 (36 samples of epoch 0), go on on 2 ranks (8 per step).
    first = run(tmp_path, "0", "3", devices=3, max_restarts=None)
    assert first.returncode == 0, first.stderr[-3000:]
    for log in tmp_path.glob("seen-*.txt"):
        log.rename(tmp_path / f"job0-{log.name}")
    second = run(tmp_path, devices=2, max_restarts=None)
    assert second.returncode == 0, second.stderr[-3000:]
    counts = trained(tmp_path)
    for epoch in range(EPOCHS):
        assert sorted(counts[epoch]) == list(range(SAMPLES)), epoch
        assert set(counts[epoch].values()) == {1}, epoch
    # The second job resumed from step 2 (the save at step 2; step 3 was lost):
    # it gave the 24 samples left of epoch 0 to 2 ranks in 3 steps, then epoch 1 in 6.
    assert json.loads((tmp_path / "done.json").read_text()) == {"restarts": 0, "world": 2, "steps": 2 + 3 + 6}


def test_max_restarts_given_to_resolve_restarts_a_launch_of_fn():
    done = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "restart_launch.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=scheduler_free_environment(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESULT [(0, 1, 2.0), (1, 1, 2.0)]" in done.stdout, done.stdout


@pytest.mark.parametrize("slow", [False, True], ids=["promptly", "a-rank-slow-to-end"])
def test_a_launch_of_fn_on_two_nodes_restarts_both_and_returns_each_node_its_ranks_values(slow):
    # slow: node 0's rank outlives its lost peer by 3 s, so node 0 sees node 1
    # wait to join while its own rank still runs; it must still say the
    # restart, with the job's count (it said "asked to join, not counted").
    import socket

    with socket.socket() as probe:  # a port nothing listens on now; node 0's store takes it
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = scheduler_free_environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    nodes = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT.parent / "restart_launch.py"), "2", *(["slow"] if slow else [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**env, "NODE_RANK": str(node)},
        )
        for node in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    found = []
    for node, (out, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
        # The script runs in the node's rank too, where launch returns the same.
        lines = [eval(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
        assert lines and all(v == lines[0] for v in lines), out
        values = lines[0]
        assert len(values) == 2 and sum(v is not None for v in values) == 1, values
        found += [v for v in values if v is not None]
        assert "(restart 1 of 1)" in err, err[-3000:]
    assert sorted(found) == [(0, 1, 2.0), (1, 1, 2.0)], found


def test_under_torchrun_max_restarts_is_refused_saying_to_give_it_to_torchrun():
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
         str(SCRIPT.parent / "restart_launch.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=scheduler_free_environment(),
    )  # fmt: skip
    assert done.returncode != 0
    assert "option max_restarts=1 is launcher 'subprocess''s" in done.stderr
    assert "torchrun --max-restarts" in done.stderr
