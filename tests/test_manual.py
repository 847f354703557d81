"""``manual``: phalanx gives ranks, processes and the group; the user places
and wraps. Plus the ``deterministic`` option every strategy takes."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import phalanx
from phalanx_core import MisconfigurationError

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("devices", ["1", "2"])
def test_the_manual_parallel_example_trains(devices):
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "manual_parallel.py"),
            "--devices",
            devices,
            "--steps",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    first, last = (float(x) for x in line.split("loss ")[1].split(" after")[0].split(" -> "))
    assert last < 0.3 * first
    assert line.endswith(f"on {devices} rank(s)")


def test_the_hand_sharded_tables_train_like_one_process_on_the_whole_batch():
    """Two ranks, each holding half the tables and exchanging lookups and
    their gradients with all_to_all, reach the tables one rank reaches."""
    spec = importlib.util.spec_from_file_location("manual_parallel", ROOT / "examples" / "manual_parallel.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    [one] = example.main(["--devices", "1", "--launcher", "fork", "--steps", "10"])
    two = example.main(["--devices", "2", "--launcher", "fork", "--steps", "10"])
    assert sorted(two[0]["tables"]) == ["0", "1"] and sorted(two[1]["tables"]) == ["2", "3"]
    assert one["last"] < 0.5 * one["first"]
    torch.testing.assert_close(two[0]["last"], one["last"], rtol=1e-5, atol=1e-6)
    for table, weight in {**two[0]["tables"], **two[1]["tables"]}.items():
        torch.testing.assert_close(weight, one["tables"][table], rtol=1e-5, atol=1e-6)


def test_setup_leaves_modules_and_optimizers_as_they_are():
    strategy = phalanx.resolve("manual", accelerator="cpu", devices=1, launcher="in_process", precision="64")

    def fn(strategy):
        model = torch.nn.Linear(2, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        same_model, same_opt = strategy.setup(model, optimizer)
        made = strategy.setup(model, functools.partial(torch.optim.Adam, lr=0.1))[1]
        with strategy.no_backward_sync(model):  # nothing of phalanx's to hold back
            pass
        return (
            same_model is model,
            same_opt is optimizer,
            model.weight.dtype,
            type(made).__name__,
            str(strategy.root_device),
            torch.distributed.is_initialized(),
        )

    [result] = strategy.launch(fn)
    assert result == (True, True, torch.float32, "Adam", "cpu", True)
    assert not torch.distributed.is_initialized()  # the group it made is gone


def save_per_rank(strategy, path):
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.fill_(strategy.global_rank)
    strategy.save_checkpoint(path, {"model": model, "rank": strategy.global_rank})
    back = torch.nn.Linear(2, 2)
    rest = strategy.load_checkpoint(path, {"model": back})
    return rest["rank"], back.weight[0, 0].item()


def test_each_rank_saves_and_loads_its_own_file(tmp_path):
    strategy = phalanx.resolve("manual", accelerator="cpu", devices=2, launcher="fork")
    assert strategy.launch(save_per_rank, tmp_path / "ckpt") == [(0, 0.0), (1, 1.0)]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        ".complete",
        "rank-00000.pt",
        "rank-00001.pt",
    ]
    one = phalanx.resolve("manual", accelerator="cpu", devices=1, launcher="in_process")
    with pytest.raises(FileNotFoundError, match=r"no file for rank 0 \(rank-00000.pt\); nothing was saved"):
        one.launch(lambda s: s.load_checkpoint(tmp_path / "elsewhere"))
    three = phalanx.resolve("manual", accelerator="cpu", devices=3, launcher="fork")
    with pytest.raises(phalanx.WorkerFailedError, match=r"saved by 2 rank\(s\), and this job has 3"):
        three.launch(lambda s: s.load_checkpoint(tmp_path / "ckpt"))


def test_fewer_ranks_than_saved_are_refused_not_given_a_part(tmp_path):
    """Rank 0 alone must not load rank-00000.pt and drop rank 1's part."""
    two = phalanx.resolve("manual", accelerator="cpu", devices=2, launcher="fork")
    two.launch(save_per_rank, tmp_path / "ckpt")
    one = phalanx.resolve("manual", accelerator="cpu", devices=1, launcher="in_process")
    with pytest.raises(MisconfigurationError) as refused:
        one.launch(lambda s: s.load_checkpoint(tmp_path / "ckpt"))
    message = str(refused.value)
    assert "saved by 2 rank(s), and this job has 1" in message, message
    assert "load it on 2 rank(s)" in message and "checkpoint_per_rank=False" in message, message


def test_a_save_by_fewer_ranks_removes_the_files_of_a_larger_one(tmp_path):
    """Saved by 3 ranks, then into the same directory by 2: rank-00002.pt
    goes, so that no load ever reads it beside the newer files."""
    path = tmp_path / "ckpt"
    phalanx.resolve("manual", accelerator="cpu", devices=3, launcher="fork").launch(save_per_rank, path)
    assert (path / "rank-00002.pt").is_file()
    two = phalanx.resolve("manual", accelerator="cpu", devices=2, launcher="fork")
    assert two.launch(save_per_rank, path) == [(0, 0.0), (1, 1.0)]
    assert sorted(p.name for p in path.iterdir()) == [".complete", "rank-00000.pt", "rank-00001.pt"]
    assert (path / ".complete").read_text() == "2\n"
    three = phalanx.resolve("manual", accelerator="cpu", devices=3, launcher="fork")
    with pytest.raises(phalanx.WorkerFailedError, match=r"saved by 2 rank\(s\), and this job has 3"):
        three.launch(lambda s: s.load_checkpoint(path))


def test_a_directory_without_its_mark_is_refused_as_unfinished(tmp_path):
    path = tmp_path / "ckpt"
    phalanx.resolve("manual", accelerator="cpu", devices=2, launcher="fork").launch(save_per_rank, path)
    (path / ".complete").unlink()  # as a save that ended between the files and the mark leaves it
    one = phalanx.resolve("manual", accelerator="cpu", devices=1, launcher="in_process")
    with pytest.raises(MisconfigurationError) as refused:
        one.launch(lambda s: s.load_checkpoint(path))
    message = str(refused.value)
    assert "has 2 rank file(s) but no .complete mark" in message, message
    assert "the save did not finish" in message and str(path / ".complete") in message, message


def test_one_file_from_rank_zero_when_asked(tmp_path):
    strategy = phalanx.resolve(
        "manual", accelerator="cpu", devices=2, launcher="fork", checkpoint_per_rank=False
    )
    assert strategy.launch(save_per_rank, tmp_path / "one.pt") == [(0, 0.0), (0, 0.0)]
    assert (tmp_path / "one.pt").is_file()
    with pytest.raises(MisconfigurationError, match=r"checkpoint_per_rank='yes'; give True"):
        phalanx.resolve("manual", accelerator="cpu", devices=1, checkpoint_per_rank="yes")


def test_options_only_ddp_understands_are_refused_for_manual():
    with pytest.raises(
        MisconfigurationError,
        match=r"option find_unused_parameters=True is taken by no part .*strategy 'manual' takes "
        r"checkpoint_io, checkpoint_per_rank, deterministic",
    ):
        phalanx.resolve("manual", accelerator="cpu", devices=2, find_unused_parameters=True)


def deterministic_state(strategy):
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.parametrize(("value", "expected"), [(True, (True, False)), ("warn", (True, True))])
def test_deterministic_is_switched_on_in_every_rank(value, expected):
    strategy = phalanx.resolve("ddp_fork", accelerator="cpu", devices=2, deterministic=value)
    assert strategy.launch(deterministic_state) == [expected, expected]
    single = phalanx.resolve("single_device", accelerator="cpu", deterministic=value)
    assert single.launch(deterministic_state) == [expected]
    assert deterministic_state(single) == (False, False)  # this process is as it was


def test_deterministic_of_the_wrong_kind_is_refused():
    with pytest.raises(MisconfigurationError, match=r"deterministic=1: give True"):
        phalanx.resolve("single_device", accelerator="cpu", deterministic=1)
