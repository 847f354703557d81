"""The launcher toolkit's pure parts, as tables: the root-cause rule, the
one error's shape, signal names, and reading a rank's traceback from a
tool's tagged output. (Its process parts run in every launcher's
LauncherSuite.)"""

from __future__ import annotations

import re
import signal

import pytest

from phalanx_core import MisconfigurationError
from phalanx_core.launching import (
    RANK_LINE,
    RankFailure,
    RankLines,
    carried_variables,
    check_count,
    last_tracebacks,
    rank_variables,
    root_cause,
    signal_name,
    worker_failed,
)

RAISED = "Traceback (most recent call last):\n  File 'x.py', line 1, in fn\nValueError: boom\n"
LOST = "Traceback (most recent call last):\n  File 'x.py', line 2, in fn\nDistNetworkError: Connection reset by peer\n"


@pytest.mark.parametrize(
    ("failures", "first"),
    [
        # a signal death (OOM) before a raised error, whatever the times
        ([RankFailure(0, 1, RAISED, when=1.0), RankFailure(1, -9, when=5.0)], 1),
        # a raised error before a lost peer's, even a later one
        ([RankFailure(0, 1, LOST, when=1.0), RankFailure(1, 1, RAISED, when=2.0)], 1),
        # a lost peer's error before a rank the launcher stopped
        ([RankFailure(0, -signal.SIGTERM, when=1.0), RankFailure(1, 1, LOST, when=2.0)], 1),
        # same kind: the earlier, then the lower rank
        ([RankFailure(2, 1, RAISED, when=2.0), RankFailure(1, 1, RAISED, when=1.0)], 1),
        ([RankFailure(2, 1, RAISED, when=1.0), RankFailure(1, 1, RAISED, when=1.0)], 1),
        # a death the launcher could not see (a Ray actor) is a cause
        ([RankFailure(0, 1, RAISED, when=1.0), RankFailure(3, died="gone", when=9.0)], 3),
        # a backend's own lost-peer mark
        ([RankFailure(0, 1, "X\nHorovodInternalError: shut down\n", 1.0, peer_lost_marks=("HorovodInternalError",)),
          RankFailure(1, 1, RAISED, when=2.0)], 1),
    ],
)  # fmt: skip
def test_the_root_cause_rule(failures, first):
    assert root_cause(failures).rank == first


def test_worker_failed_names_the_root_cause_and_keeps_every_failure():
    lost, raised = (
        RankFailure(0, 1, LOST, when=1.0, node=0, host="a"),
        RankFailure(3, 1, RAISED, 2.0, node=1, host="b"),
    )
    error = worker_failed("mine", [lost, raised], 4, stopped="Every other rank was stopped")
    lines = str(error).splitlines()
    assert (
        lines[0]
        == "the launched job failed: rank 3 of 4 on node 1 (host b) (launcher 'mine') failed first, with exit code 1."
    )
    assert "ValueError: boom" in str(error) and lines[-1].startswith(
        "Every other rank was stopped. Fix the error rank 3"
    )
    assert (error.rank, error.node, error.host, error.exitcode) == (3, 1, "b", 1)
    assert error.failures == (raised, lost)


def test_a_sigkilled_rank_is_named_with_the_out_of_memory_advice():
    error = worker_failed("mine", [RankFailure(1, -9, when=1.0)], 2)
    assert (error.signal, error.exitcode, error.traceback) == ("SIGKILL", -9, None)
    assert "failed first, killed by SIGKILL (exit code -9)." in str(error) and "out-of-memory" in str(error)


def test_a_record_crosses_nodes_as_plain_data():
    failure = RankFailure(2, -11, None, 3.5, node=1, host="b", peer_lost_marks=("Mine",))
    assert RankFailure.from_dict(failure.to_dict()) == failure


@pytest.mark.parametrize(
    ("code", "shell", "name"),
    [
        (-9, False, "SIGKILL"),
        (137, True, "SIGKILL"),
        (137, False, None),
        (1, True, None),
        (0, False, None),
        (None, False, None),
    ],
)
def test_signal_names(code, shell, name):
    assert signal_name(code, shell=shell) == name


def test_check_count_refuses_what_is_not_a_count():
    assert check_count("mine", "num_processes", 2) == 2
    for bad in (0, -1, True, 1.5, "2"):
        with pytest.raises(
            MisconfigurationError, match=r"launcher 'mine': num_processes=.*expected an int of at least 1"
        ):
            check_count("mine", "num_processes", bad)


def test_rank_variables_are_torchruns():
    assert rank_variables(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1,
                          main_address="10.0.0.1", main_port=29500, agent_store=True) == {
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "NODE_RANK": "1",
        "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True",
    }  # fmt: skip


MPI_TAG = re.compile(r"^\[\d+,(\d+)\]<stderr>:(.*)$")


def test_last_tracebacks_reads_each_ranks_last_one_with_its_chain():
    output = [
        "[1,0]<stderr>:[rank0]: Traceback (most recent call last):",
        "[1,0]<stderr>:[rank0]:   File 'a.py', line 1, in f",
        "[1,0]<stderr>:[rank0]: KeyError: 'x'",
        "[1,1]<stderr>:some other line",
        "[1,0]<stderr>:",
        "[1,0]<stderr>:The above exception was the direct cause of the following exception:",
        "[1,0]<stderr>:",
        "[1,0]<stderr>:Traceback (most recent call last):",
        "[1,0]<stderr>:  File 'a.py', line 3, in g",
        "[1,0]<stderr>:ValueError: from the key",
        "not a rank's line",
        "[1,1]<stderr>:Traceback (most recent call last):",  # cut off: no exception line yet
    ]
    found = last_tracebacks([(float(i), line) for i, line in enumerate(output)], MPI_TAG)
    assert list(found) == [0]
    text, when = found[0]
    assert text.startswith("Traceback (most recent call last):\n  File 'a.py', line 1, in f\nKeyError: 'x'\n")
    assert text.endswith("ValueError: from the key\n") and when == 9.0


MPI_WRITE_TAG = re.compile(r"\[\d+,(\d+)\]<(?:stdout|stderr)>:")


def test_rank_lines_puts_writes_back_together_into_lines_marked_with_their_rank():
    # What mpirun --tag-output gave for two ranks that each wrote a line in
    # two flushed writes (a tag on each write, no line end added), then a
    # line left without its end, then mpirun's own report.
    output = (
        "[1,0]<stdout>:hello there\n"
        "[1,0]<stdout>:part1 [1,1]<stdout>:hello there\n"
        "[1,1]<stdout>:part1 [1,0]<stdout>:part2\n"
        "[1,0]<stdout>:no line end[1,1]<stdout>:part2\n"
        "[1,1]<stdout>:a\n[1,1]<stdout>:b\n"  # one write of two lines: a tag on each
        "mpirun: a rank failed\n"
    )
    whole = RankLines(MPI_WRITE_TAG)
    lines = [line for text in output.splitlines(keepends=True) for line in whole.feed(text)]
    lines += whole.close()
    assert lines == [
        "[rank0]: hello there\n",
        "[rank1]: hello there\n",
        "[rank0]: part1 part2\n",
        "[rank1]: part1 part2\n",
        "[rank1]: a\n",
        "[rank1]: b\n",
        "mpirun: a rank failed\n",
        "[rank0]: no line end\n",
    ]
    assert [RANK_LINE.match(line).groups() for line in lines[:2]] == [
        ("0", "hello there"),
        ("1", "hello there"),
    ]


def test_rank_lines_continues_a_rank_write_broken_by_the_pipe_read():
    # A rank's write with a line end inside, read in two pieces by the
    # reader: the piece after the line end carries no tag of its own.
    whole = RankLines(MPI_WRITE_TAG)
    lines = whole.feed("[1,0]<stderr>:Traceback (most recent call last):\n")
    lines += whole.feed("[1,0]<stderr>:  File 'a.py'")
    lines += whole.feed(", line 1\n")
    assert lines == ["[rank0]: Traceback (most recent call last):\n", "[rank0]:   File 'a.py', line 1\n"]


def test_carried_variables_are_the_users_settings_not_one_launchs_own():
    environ = {
        "PHALANX_HANG_REPORT": "30", "PHALANX_PLUGINS": "torch", "PHALANX_LAUNCH_INDEX": "2",
        "PHALANX_LAUNCH_RESULTS_DIR": "/tmp/r", "RANK": "0", "PATH": "/bin", "XPHALANX_Y": "1",
    }  # fmt: skip
    assert carried_variables(environ) == {"PHALANX_HANG_REPORT": "30", "PHALANX_PLUGINS": "torch"}


def test_script_store_hosts_a_loopback_store_unless_the_user_named_another_address(monkeypatch):
    import socket

    from phalanx_core.launching import script_store

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with script_store() as variables:
        assert variables["MASTER_ADDR"] == "127.0.0.1" and variables["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        with socket.create_connection(("127.0.0.1", int(variables["MASTER_PORT"])), timeout=5):
            pass  # the store answers there
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    with script_store() as variables:
        assert variables == {}


def test_sample_finding_counts_each_sample_once_without_a_lost_rounds_steps(tmp_path):
    from phalanx_core.testing.samples import sample_finding

    # Round (0, 0) on 2 ranks trained steps 1-3 of epoch 0, then was lost;
    # round (1, 2) on 3 ranks resumed from step 2's checkpoint: step 3 of
    # the first round was lost with it and does not count.
    (tmp_path / "seen-a-0.txt").write_text("0 0 2 0 1 0\n0 0 2 0 2 2\n0 0 2 0 3 4\n")
    (tmp_path / "seen-a-1.txt").write_text("0 0 2 0 1 1\n0 0 2 0 2 3\n0 0 2 0 3 5\n")
    (tmp_path / "seen-b-0.txt").write_text("1 2 3 0 3 4 5\n")
    assert sample_finding(tmp_path, samples=6, epochs=1) is None
    (tmp_path / "seen-b-0.txt").write_text("1 2 3 0 3 4\n")
    assert sample_finding(tmp_path, samples=6, epochs=1) == "epoch 0: 1 samples never trained ([5]...)"
    # A round on another world size may repeat up to world - 1 samples (padding).
    (tmp_path / "seen-b-0.txt").write_text("1 2 3 0 3 4 5 0\n")
    assert sample_finding(tmp_path, samples=6, epochs=1) is None
    (tmp_path / "seen-b-0.txt").write_text("1 2 3 0 3 4 5 0 1 2\n")
    assert sample_finding(tmp_path, samples=6, epochs=1).startswith("epoch 0: 3 repeats, 2 allowed")
