"""``phalanx run``: a script run on every rank of a named strategy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import phalanx
from phalanx._flags import RUN_FLAGS_VAR
from phalanx_core import MisconfigurationError

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "run_scripts"


def run(*args: str, timeout: float = 120, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_"))}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-m", "phalanx", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def test_ddp_on_two_ranks_prefixes_every_line_with_its_rank():
    done = run(
        "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", str(SCRIPTS / "report.py"), "hi"
    )
    assert done.returncode == 0, done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if "strategy=" in line)
    assert lines == [
        "[rank0]: hi strategy=DDPStrategy precision=32-true launcher=InProcessLauncher world=2 rank=0",
        "[rank1]: hi strategy=DDPStrategy precision=32-true launcher=InProcessLauncher world=2 rank=1",
    ]


def test_the_training_example_runs_under_a_spawn_strategy():
    done = run(
        "--strategy", "ddp_spawn", "--accelerator", "cpu", "--devices", "2", "--precision", "bf16-mixed",
        "examples/train.py", "--steps", "20",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    [line] = [line for line in done.stdout.splitlines() if "loss" in line]
    assert line.startswith("[rank0]: loss ")
    first, last = (float(x) for x in line.split("loss ")[1].split(" after")[0].split(" -> "))
    assert last < first


def test_one_process_runs_in_place_with_the_flags_as_defaults():
    done = run("--accelerator", "cpu", "--precision", "64", str(SCRIPTS / "report.py"), "one")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "one strategy=SingleDeviceStrategy precision=64-true launcher=InProcessLauncher world=1 rank=0"
    )


def test_the_same_value_in_code_and_on_the_command_line_is_fine():
    done = run(
        "--strategy", "single_device", "--precision", "bf16", str(SCRIPTS / "report.py"), "same",
        "strategy=phalanx-torch:single_device", "precision=bf16-mixed",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "precision=bf16-mixed" in done.stdout


def test_a_different_value_in_code_is_an_error_naming_both():
    done = run("--strategy", "single_device", str(SCRIPTS / "report.py"), "x", "strategy=ddp")
    assert done.returncode == 1
    assert (
        "`phalanx run --strategy single_device` and resolve(strategy='ddp') in the script disagree"
        in done.stderr
    )


def test_a_failing_rank_shows_its_traceback_once_and_the_exit_code_is_not_zero():
    done = run("--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", str(SCRIPTS / "fail.py"))
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert output.count("ValueError: rank one broke on purpose") == 1
    assert "[rank1]: ValueError: rank one broke on purpose" in output
    assert "[rank1]: [rank1]" not in output  # torch's own prefix is not added on top
    assert (
        "phalanx run: rank 1 raised first; its traceback is in the lines above marked [rank1]" in done.stderr
    )
    assert "Sending process" not in output  # elastic's agent is quiet
    # Rank 0 only lost its peer: its error in one line, no traceback.
    assert "[rank0]: Traceback" not in output
    # Rank 1 left before rank 0's barrier waited on it (a timeout that says
    # so), or before rank 0 called it (a connection that rank 1 closed).
    assert re.search(
        r"\[rank0\]: phalanx_core\.errors\.Collective(Timeout|Connection)Error: "
        r"barrier\(\) on the 'torch' collective \(gloo, rank 0 of 2\) .*"
        r"\(this rank lost a peer; its traceback is shown only if no rank failed before\)",
        output,
    )


def test_a_rank_that_lost_its_peer_and_failed_first_shows_its_whole_traceback():
    done = run("--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", str(SCRIPTS / "leave_early.py"))
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert "[rank0]: (its traceback, which it left out above: no rank failed before it)" in output
    assert "[rank0]: Traceback (most recent call last):" in output
    # line, traceback; a timeout that says rank 1 left, or the connection it closed
    assert (
        len(
            re.findall(
                r"\[rank0\]: phalanx_core\.errors\.Collective(Timeout|Connection)Error: barrier\(\)", output
            )
        )
        == 2
    )
    assert done.stderr.endswith(
        "phalanx run: rank 0 raised first; its traceback is in the lines above marked [rank0]. "
        "The other ranks were stopped.\n"
    )


def test_a_rank_that_raised_and_is_still_exiting_is_named_rather_than_the_peer_that_lost_it():
    # Rank 1 raises, then lingers in its exception hook; rank 0 loses it and
    # exits first. torch 2.9's elastic reported only the ranks that had
    # exited when it looked (rank 0, which only lost its peer) and stopped
    # rank 1 unreported: its error file names it.
    done = run(
        "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", str(SCRIPTS / "fail_slow_exit.py")
    )
    assert done.returncode == 1
    assert (
        "phalanx run: rank 1 raised first; its traceback is in the lines above marked [rank1]" in done.stderr
    ), done.stderr[-3000:]


def test_bad_flags_are_refused_before_any_rank_starts():
    done = run("--strategy", "single_device", "--devices", "2", str(SCRIPTS / "report.py"), "x")
    assert done.returncode == 1
    assert "phalanx run: error: strategy 'single_device' runs on one device" in done.stderr
    done = run("--strategy", "ddp", "--launcher", "rocket", str(SCRIPTS / "report.py"), "x")
    assert "unknown launcher 'rocket'" in done.stderr
    done = run("--accelerator", "cpu", "no/such/script.py")
    assert done.returncode == 1 and "no script at 'no/such/script.py'" in done.stderr


def test_run_flags_fill_the_defaults_of_resolve_in_the_script(monkeypatch):
    monkeypatch.setenv(
        RUN_FLAGS_VAR, '{"strategy": "single_device", "accelerator": "cpu", "precision": "64"}'
    )
    assert phalanx.under_run()
    registry = phalanx.Registry()
    plan = registry.plan()
    assert (plan.strategy.name, plan.accelerator.name, plan.precision.name) == (
        "single_device",
        "cpu",
        "64-true",
    )
    assert registry.plan(precision="64-true").precision.name == "64-true"
    with pytest.raises(MisconfigurationError, match=r"--precision 64` and resolve\(precision='bf16-mixed'\)"):
        registry.plan(precision="bf16-mixed")
    strategy = registry.resolve("single_device", accelerator="cpu")
    with pytest.raises(MisconfigurationError, match=r"passes a ready SingleDeviceStrategy instance"):
        registry.plan(strategy)
    monkeypatch.setenv(RUN_FLAGS_VAR, "{not json")
    with pytest.raises(MisconfigurationError, match=r"is not the JSON `phalanx run` writes"):
        registry.plan()


def test_two_nodes_on_this_machine_make_one_world():
    import socket

    with socket.socket() as s:  # a port for node 0's rendezvous
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_"))}

    def node(rank: int) -> subprocess.Popen[str]:
        flags = ["--strategy", "ddp", "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2"]
        flags += ["--node-rank", str(rank), "--main-address", "127.0.0.1", "--main-port", port]
        command = [sys.executable, "-m", "phalanx", "run", *flags, str(SCRIPTS / "report.py"), f"node{rank}"]
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )

    nodes = [node(0), node(1)]
    outs = []
    try:
        for proc in nodes:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            outs.append(out)
    finally:
        for proc in nodes:
            proc.kill()
    assert "[rank0]: node0 strategy=DDPStrategy" in outs[0] and "world=2 rank=0" in outs[0]
    assert "[rank1]: node1 strategy=DDPStrategy" in outs[1] and "world=2 rank=1" in outs[1]


def test_a_node_without_the_jobs_secret_is_refused_and_the_others_train_on_their_own():
    import socket

    with socket.socket() as s:  # a port for node 0's rendezvous
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_"))}

    def node(rank: int, secret: str) -> subprocess.Popen[str]:
        flags = ["--strategy", "ddp", "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2:3"]
        flags += ["--max-restarts", "1", "--node-rank", str(rank), "--main-address", "127.0.0.1"]
        flags += ["--main-port", port, "-o", "last_call=2"]
        command = [sys.executable, "-m", "phalanx", "run", *flags, str(SCRIPTS / "report.py"), f"node{rank}"]
        env = {**base, "PHALANX_JOB_SECRET": secret}
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )

    # Node 2's secret is not the job's: whatever place it takes in the
    # round, it gets no rank, and nodes 0 and 1 meet as a job of two.
    nodes = [node(0, "s3cret"), node(1, "s3cret"), node(2, "another")]
    outs, errs = [], []
    try:
        for proc in nodes:
            out, err = proc.communicate(timeout=120)
            outs.append(out)
            errs.append(err)
    finally:
        for proc in nodes:
            proc.kill()
    assert [proc.returncode for proc in nodes[:2]] == [0, 0], errs
    assert "world=2 rank=0" in outs[0] and "world=2 rank=1" in outs[1], outs
    assert nodes[2].returncode != 0 and not outs[2], (outs[2], errs[2])
    assert "did not prove the job's secret (PHALANX_JOB_SECRET)" in errs[2], errs[2]
    assert "Traceback" not in errs[2], errs[2]
    assert any("without proving the job's secret" in err for err in errs[:2]), errs


def test_a_stranger_asking_to_join_a_running_job_is_refused_and_the_job_trains_on(tmp_path):
    import json
    import socket
    import time

    with socket.socket() as s:  # a port for node 0's rendezvous
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PHALANX_", "TORCHELASTIC_"))}
    job = ROOT / "tests" / "multihost" / "elastic_job.py"
    out = tmp_path / "out"
    out.mkdir()

    def node(rank: int, secret: str) -> subprocess.Popen[str]:
        flags = ["--strategy", "ddp", "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2:3"]
        flags += ["--max-restarts", "1", "--node-rank", str(rank), "--main-address", "127.0.0.1"]
        flags += ["--main-port", port, "-o", "last_call=2"]
        # 120 steps of 0.25 s at least: time for the stranger's interpreter to start.
        command = [sys.executable, "-m", "phalanx", "run", *flags, str(job), str(out), "240", "0.25"]
        env = {**base, "PHALANX_JOB_SECRET": secret}
        # Into files: a pipe that nobody reads while the test waits for
        # another process fills, and stops the node that writes to it.
        with open(tmp_path / f"node{rank}.txt", "w") as log:
            return subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT
            )

    nodes = [node(0, "s3cret"), node(1, "s3cret")]
    stranger = None
    try:
        deadline = time.monotonic() + 120
        while not any(p.stat().st_size for p in out.glob("seen-*.txt")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any(out.glob("seen-*.txt")), "the job of two never trained"
        # A third node asks to join with another secret while the two train:
        # it is refused, and they go on in the same round.
        stranger = node(2, "another")
        stranger.wait(timeout=90)
        assert not (out / "done.json").exists(), "the stranger was not refused while the job trained"
        for proc in nodes:
            proc.wait(timeout=120)
    finally:
        for proc in [*nodes, *([stranger] if stranger else [])]:
            proc.kill()
    said = [(tmp_path / f"node{rank}.txt").read_text() for rank in range(3)]
    assert stranger.returncode != 0 and "did not prove the job's secret (PHALANX_JOB_SECRET)" in said[2], (
        said[2]
    )
    assert "Traceback" not in said[2], said[2]
    assert [proc.returncode for proc in nodes] == [0, 0], said[:2]
    done = json.loads((out / "done.json").read_text())
    assert done["restarts"] == 0 and done["world"] == 2, done
    assert sum("asked to join the job without proving its secret" in text for text in said[:2]) == 1, said[:2]
    assert "restart" not in (said[0] + said[1]).lower(), said[:2]


def test_a_missing_script_is_refused_before_any_rank_starts():
    done = run("--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", "no_such_script.py")
    assert done.returncode == 1
    assert done.stderr.startswith("phalanx run: error: no script at 'no_such_script.py' (from ")
    assert "[rank" not in done.stderr


def test_a_missing_module_is_refused_before_any_rank_starts():
    done = run("--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", "-m", "no_such_module.train")
    assert done.returncode == 1
    assert done.stderr.startswith(
        "phalanx run: error: -m no_such_module.train: no module 'no_such_module' on the path the ranks "
        "search (the working directory "
    ), done.stderr
    assert "[rank" not in done.stderr and "Traceback" not in done.stderr


def test_a_module_in_the_working_directory_runs_on_every_rank(tmp_path):
    (tmp_path / "job_module.py").write_text(
        "import phalanx\nprint('rank', phalanx.resolve().launch(lambda s: s.global_rank))\n"
    )
    done = run(
        "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", "-m", "job_module", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    # Under phalanx run, launch() returns this rank's result in its place.
    assert "[rank0]: rank [0, None]" in done.stdout and "[rank1]: rank [None, 1]" in done.stdout, done.stdout


def test_strategy_options_on_the_command_line_reach_resolve_and_the_script_reads_the_plan():
    done = run(
        "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2",
        "--option", "find_unused_parameters=True", "-o", "bucket_cap_mb=5",
        str(SCRIPTS / "options.py"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    wanted = "plan=ddp options={'find_unused_parameters': True, 'bucket_cap_mb': 5}"
    lines = sorted(line for line in done.stdout.splitlines() if "plan=" in line)
    assert [line.split(": ", 1)[1].split(" flags=")[0] for line in lines] == [
        f"rank=0 {wanted}",
        f"rank=1 {wanted}",
    ]
    assert lines[0].endswith("flags={'find_unused_parameters': True, 'bucket_cap_mb': 5}")


def test_an_option_given_in_code_and_on_the_command_line_must_agree():
    same = run(
        "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", "--option", "static_graph=true",
        str(SCRIPTS / "options.py"), "static_graph=True",
    )  # fmt: skip
    assert same.returncode == 0, same.stderr
    differ = run(
        "--strategy", "ddp", "--accelerator", "cpu", "--devices", "2", "--option", "static_graph=true",
        str(SCRIPTS / "options.py"), "static_graph=False",
    )  # fmt: skip
    assert differ.returncode == 1
    assert (
        "`phalanx run --option static_graph=True` and resolve(static_graph=False) in the script disagree"
        in differ.stdout + differ.stderr
    )


def test_bad_options_are_refused_before_any_rank_starts():
    done = run("--strategy", "ddp", "--option", "find_unused=True", str(SCRIPTS / "options.py"))
    assert done.returncode == 1
    assert "option find_unused=True is taken by no part of this plan" in done.stderr
    assert "find_unused_parameters" in done.stderr  # the names that exist
    done = run("--strategy", "ddp", "--option", "find_unused_parameters", str(SCRIPTS / "options.py"))
    assert done.returncode == 2
    assert "write an option as NAME=VALUE" in done.stderr
    done = run("--strategy", "ddp", "-o", "timeout=5", "-o", "timeout=6", str(SCRIPTS / "options.py"))
    assert done.returncode == 1 and "--option timeout is given twice, as 5 and 6" in done.stderr


def test_outside_phalanx_run_there_are_no_run_flags_and_the_plan_is_the_code_s():
    assert phalanx.run_flags() == {}
    strategy = phalanx.resolve("single_device", accelerator="cpu", deterministic=True)
    assert strategy.plan.strategy.name == "single_device"
    assert dict(strategy.plan.options) == {"deterministic": True}
