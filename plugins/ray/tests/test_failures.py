"""How a Ray job ends when it fails: a rank that raises while another is
stuck in a method that never returns, an actor killed with ``ray.kill``,
and Ctrl-C in the launching process. Each ends in seconds, with every actor
killed and no process left (the local Ray instance the job started is
stopped with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import phalanx
from phalanx_core import WorkerFailedError
from phalanx_core.testing.processes import (
    TAG_VAR,
    as_a_terminal_starts_it,
    new_tag,
    reap,
    scheduler_free_environment,
)


@pytest.fixture
def tag(monkeypatch):
    tag = new_tag()
    monkeypatch.setenv(TAG_VAR, tag)
    yield tag
    left = reap(tag, grace=10, children_of=os.getpid())
    assert not left, f"processes left behind (killed now): {left}"


def raise_while_rank_0_hangs(strategy):
    if strategy.global_rank == 1:
        time.sleep(1)
        raise ValueError("rank 1 gave up")
    time.sleep(3600)  # not in a collective: only killing ends it


def kill_own_actor(strategy):
    import ray

    if strategy.global_rank == 1:
        ray.kill(ray.get_runtime_context().current_actor)
        time.sleep(60)
    strategy.barrier()


def test_a_raising_rank_ends_a_rank_stuck_in_a_method_that_never_returns(tag):
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray")
    started = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        strategy.launch(raise_while_rank_0_hangs)
    print(f"ended {time.monotonic() - started:.1f} s after launch (rank 1 raised at 1 s)")
    error = info.value
    assert (error.rank, error.node) == (1, 0), error
    assert "ValueError: rank 1 gave up" in error.traceback
    assert "rank 1 of 2 on node 0" in str(error) and "Every other rank's actor was killed" in str(error)


def test_an_actor_killed_with_ray_kill_fails_the_job_naming_its_rank(tag):
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray")
    with pytest.raises(WorkerFailedError) as info:
        strategy.launch(kill_own_actor)
    error = info.value
    assert (error.rank, error.node, error.exitcode, error.signal, error.traceback) == (1, 0, None, None, None)
    assert "failed first, it died without a Python traceback" in str(error), error
    assert error.host, error


_CTRL_C = """\
import time

import phalanx


def wait(strategy):
    print("running", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray").launch(wait)
"""


def test_ctrl_c_in_the_launching_process_ends_every_rank(tag, tmp_path):
    script = tmp_path / "wait.py"
    script.write_text(textwrap.dedent(_CTRL_C))
    env = scheduler_free_environment(**{TAG_VAR: tag})
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        cwd=tmp_path, start_new_session=True, bufsize=1, preexec_fn=as_a_terminal_starts_it,
    )  # fmt: skip
    lines: list[str] = []
    errors: list[str] = []  # read as it comes: a full pipe would stop the process mid-teardown
    readers = [
        threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True),
        threading.Thread(target=lambda: errors.extend(process.stderr), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        deadline = time.monotonic() + 120
        while not {"[rank0]: running\n", "[rank1]: running\n"} <= set(lines) and time.monotonic() < deadline:
            assert process.poll() is None, "".join(errors)
            time.sleep(0.1)
        assert {"[rank0]: running\n", "[rank1]: running\n"} <= set(lines), lines
        process.send_signal(signal.SIGINT)
        started = time.monotonic()
        process.wait(timeout=60)
        print(f"exited {time.monotonic() - started:.1f} s after SIGINT")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for reader in readers:
        reader.join(10)
    err = "".join(errors)
    assert process.returncode != 0
    assert "KeyboardInterrupt" in err, err


def train_through_a_killed_actor(strategy, root, kill_at=5):
    """Trains 8 steps, saving every 2; rank 1's actor process is killed
    with SIGKILL at step ``kill_at`` of the first attempt. Returns what the
    last attempt saw."""
    import torch
    from torch import nn

    from phalanx_core import CheckpointDirectory

    torch.manual_seed(0)
    model, optimizer = strategy.setup(nn.Linear(3, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    checkpoints = CheckpointDirectory(root, keep=2)
    state = {"model": model, "optimizer": optimizer}
    step = start = strategy.resume(checkpoints, state)
    x = torch.ones(4, 3)
    while step < 8:
        step += 1
        if step == kill_at and strategy.restart_count == 0 and strategy.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        strategy.backward(model(x).pow(2).mean())
        strategy.optimizer_step(optimizer)
        if step % 2 == 0:
            checkpoints.save(strategy, step, state)
    return strategy.restart_count, start, step, [p.detach().clone() for p in model.parameters()]


def test_with_max_restarts_a_killed_actor_is_replaced_and_the_job_finishes(tag, tmp_path, capfd):
    strategy = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray", max_restarts=1)
    results = strategy.launch(train_through_a_killed_actor, str(tmp_path / "restarted"))
    assert [r[:3] for r in results] == [(1, 4, 8), (1, 4, 8)]  # resumed from step 4's checkpoint
    said = capfd.readouterr().err
    assert "launcher 'ray': rank 1 failed (its actor's process died: killed, or crashed)" in said
    assert "every rank is stopped and started again, placed anew (restart 1 of 1)" in said
    plain = phalanx.resolve("ddp", accelerator="cpu", devices=2, launcher="ray")
    uninterrupted = plain.launch(train_through_a_killed_actor, str(tmp_path / "plain"), kill_at=0)
    assert all(torch_equal(a, b) for a, b in zip(results[0][3], uninterrupted[0][3], strict=True))


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
