"""Checkpoint files that are not whole, or not this model's, under real
strategies: ``single_device`` (one file), ``manual`` (a file per rank) and
``fsdp`` (a sharded torch.distributed.checkpoint directory, and one full
file), the last two with two real ranks over gloo. Every load error is a
MisconfigurationError that names the file, raised on every rank, and leaves
the module as it was.

What the ranks run is defined at the top level of this module; the
launches fork, and each is bounded by the collective's timeout.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader

import phalanx

pytestmark = pytest.mark.subprocess

#: Seconds a collective may wait before its rank fails.
TIMEOUT = 60


def make_model(seed: int = 0, hidden: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2))


def full(tensor) -> torch.Tensor:
    tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
    return tensor.detach().clone()


def params(model) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def error_of(load) -> tuple[str, str]:
    """The type and message of what ``load()`` raised."""
    try:
        load()
    except Exception as exc:  # noqa: BLE001 - returned to the test, which checks the type
        return type(exc).__name__, str(exc)
    return "nothing", ""


# -- one file: single_device -----------------------------------------------------------------


def single_device_errors(strategy, directory):
    directory = Path(directory)
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.Adam, lr=0.01))
    path = directory / "ckpt.pt"
    strategy.save_checkpoint(path, {"model": model, "optimizer": optimizer, "step": 3})
    truncated = directory / "truncated.pt"
    truncated.write_bytes(path.read_bytes()[:1000])

    fresh, fresh_optimizer = strategy.setup(make_model(seed=1), functools.partial(torch.optim.Adam, lr=0.01))
    before = params(fresh)
    other_keys = strategy.setup(nn.Sequential(nn.Linear(4, 16)))
    other_shapes, other_optimizer = strategy.setup(
        make_model(hidden=8), functools.partial(torch.optim.Adam, lr=0.01)
    )
    shapes_before = params(other_shapes)
    errors = {
        "truncated": error_of(lambda: strategy.load_checkpoint(truncated, {"model": fresh})),
        "other-keys": error_of(lambda: strategy.load_checkpoint(path, {"model": other_keys})),
        "other-shapes": error_of(lambda: strategy.load_checkpoint(path, {"model": other_shapes})),
        "other-shapes-not-strict": error_of(
            lambda: strategy.load_checkpoint(path, {"model": other_shapes}, strict=False)
        ),
        "not-a-module-state": error_of(lambda: strategy.load_checkpoint(path, {"step": fresh})),
        "other-optimizer": error_of(
            lambda: strategy.load_checkpoint(
                path, {"model": fresh, "optimizer": torch.optim.Adam([nn.Parameter(torch.ones(1))])}
            )
        ),
    }
    untouched = same(before, params(fresh)) and same(shapes_before, params(other_shapes))
    rest = strategy.load_checkpoint(path, {"model": fresh, "optimizer": fresh_optimizer})
    return errors, untouched, rest, same(params(model), params(fresh)), str(path), str(truncated)


def test_single_device_load_errors_name_the_file_and_load_nothing(tmp_path):
    strategy = phalanx.resolve("single_device", accelerator="cpu")
    [(errors, untouched, rest, loaded, path, truncated)] = strategy.launch(
        single_device_errors, str(tmp_path)
    )
    assert all(kind == "MisconfigurationError" for kind, _ in errors.values()), errors
    assert errors["truncated"][1].startswith(
        f"cannot load the checkpoint file {truncated!r}: it is truncated: it begins as a torch.save archive "
        "(zip), but its 1,000 bytes end before the archive's index"
    )
    assert errors["other-keys"][1].startswith(
        f"load_checkpoint({path!r}): the module under 'model' does not match the checkpoint: missing from "
        "the checkpoint: none; in the checkpoint, not in the module: ['2.bias', '2.weight']"
    )
    for case in ("other-shapes", "other-shapes-not-strict"):
        assert errors[case][1] == (
            f"load_checkpoint({path!r}): the module under 'model' does not match the checkpoint: 3 tensor(s) "
            "have another shape: 0.bias is (16,) in the checkpoint and (8,) in the module; 0.weight is "
            "(16, 4) in the checkpoint and (8, 4) in the module; 2.weight is (2, 16) in the checkpoint and "
            "(2, 8) in the module. Load it into a module like the one it was saved from"
        )
    assert errors["not-a-module-state"][1] == (
        f"load_checkpoint({path!r}): the entry 'step' is not a module's state dict (it holds a value of "
        "type int); give the key under which the module was saved"
    )
    assert errors["other-optimizer"][1].startswith(
        f"load_checkpoint({path!r}): the entry 'optimizer' does not fit the Adam it was given to (ValueError: "
    )
    assert untouched  # every refusal came before anything was loaded (the model, too)
    assert rest == {"step": 3} and loaded  # and the file itself loads


# -- a file per rank: manual -----------------------------------------------------------------


def manual_per_rank(strategy, path):
    model = make_model(seed=strategy.global_rank)
    strategy.save_checkpoint(path, {"model": model, "rank": strategy.global_rank})
    if strategy.global_rank == 0:
        mine = strategy.rank_checkpoint_path(path, rank=1)
        mine.write_bytes(mine.read_bytes()[:500])  # rank 1's file, cut short
    strategy.barrier()
    fresh = make_model(seed=5)
    before = params(fresh)
    found = error_of(lambda: strategy.load_checkpoint(path, {"model": fresh}))
    return found, same(before, params(fresh)), same(params(model), params(fresh))


def test_manual_a_damaged_rank_file_is_that_ranks_error_naming_the_file(tmp_path):
    path = tmp_path / "ckpt"
    strategy = phalanx.resolve("manual", accelerator="cpu", devices=2, launcher="fork", timeout=TIMEOUT)
    (found0, _, loaded0), (found1, untouched1, _) = strategy.launch(manual_per_rank, str(path))
    assert found0 == ("nothing", "") and loaded0  # rank 0's file is whole
    kind, message = found1
    assert kind == "MisconfigurationError" and untouched1
    assert message.startswith(
        f"cannot load the checkpoint file {str(path / 'rank-00001.pt')!r}: it is truncated: it begins as a "
        "torch.save archive (zip), but its 500 bytes end before the archive's index"
    )


# -- fsdp: a sharded directory and a full file ------------------------------------------------


def _first_record(directory: Path) -> tuple[str, int, int]:
    """The file, offset and length of the first record the .metadata
    places in a shard file."""
    metadata = FileSystemReader(directory).read_metadata()
    info = min(metadata.storage_data.values(), key=lambda i: (i.relative_path, i.offset))
    return info.relative_path, info.offset, info.length


def _damage(directory: Path, case: str) -> str:
    """Damage the sharded checkpoint ``directory`` as ``case`` says; return
    the name of the file damaged."""
    metadata = directory / ".metadata"
    shard, offset, length = _first_record(directory)
    if case == "metadata-empty":
        metadata.write_bytes(b"")
        return ".metadata"
    if case == "metadata-truncated":
        metadata.write_bytes(metadata.read_bytes()[: metadata.stat().st_size // 2])
        return ".metadata"
    if case == "metadata-text":
        metadata.write_text("not metadata\n")
        return ".metadata"
    if case == "shard-missing":
        (directory / shard).unlink()
        return shard
    if case == "shard-truncated":
        data = (directory / shard).read_bytes()
        (directory / shard).write_bytes(data[: len(data) - 100])
        return shard
    if case == "shard-record-damaged":
        with open(directory / shard, "r+b") as file:
            file.seek(offset)
            file.write(b"\xff" * min(64, length))
        return shard
    raise AssertionError(case)


SHARDED_CASES = (
    "metadata-empty",
    "metadata-truncated",
    "metadata-text",
    "shard-missing",
    "shard-truncated",
    "shard-record-damaged",
)


def fsdp_damaged(strategy, root):
    root = Path(root)
    model, optimizer = strategy.setup(make_model(), functools.partial(torch.optim.AdamW, lr=0.01))
    state = {"model": model, "optimizer": optimizer, "step": 3}
    strategy.save_checkpoint(root / "good", state)
    strategy.state_dict_type = "full"
    strategy.save_checkpoint(root / "full.pt", state)
    damaged = {}
    if strategy.global_rank == 0:
        for case in SHARDED_CASES:
            shutil.copytree(root / "good", root / case)
            damaged[case] = _damage(root / case, case)
        (root / "full-truncated.pt").write_bytes((root / "full.pt").read_bytes()[:2000])
    strategy.barrier()

    fresh, fresh_optimizer = strategy.setup(make_model(seed=1), functools.partial(torch.optim.AdamW, lr=0.01))
    found, untouched = {}, {}
    for case in (*SHARDED_CASES, "full-truncated.pt"):
        before = params(fresh)
        found[case] = error_of(lambda case=case: strategy.load_checkpoint(root / case, {"model": fresh}))
        untouched[case] = same(before, params(fresh))
    narrow = strategy.setup(make_model(hidden=8))
    for case in ("good", "full.pt"):  # whole checkpoints of another model
        before = params(narrow)
        found[f"other-shapes-{case}"] = error_of(
            lambda case=case: strategy.load_checkpoint(root / case, {"model": narrow})
        )
        untouched[f"other-shapes-{case}"] = same(before, params(narrow))
    strategy.load_checkpoint(root / "good", {"model": fresh, "optimizer": fresh_optimizer})

    # A sharded save over a checkpoint that does not finish (its staging
    # directory cannot be made: a file is in the way) leaves the previous
    # checkpoint whole at the path.
    strategy.state_dict_type = "sharded"
    if strategy.global_rank == 0:
        shutil.copytree(root / "good", root / "unfinished")
        (root / "unfinished.partial").write_text("in the way")
    strategy.barrier()
    try:
        strategy.save_checkpoint(root / "unfinished", {"model": model, "step": 99})
    except (CheckpointException, OSError):
        pass
    else:
        raise AssertionError("the save with a file in place of its staging directory finished")
    before = params(fresh)
    found["unfinished"] = error_of(lambda: strategy.load_checkpoint(root / "unfinished", {"model": fresh}))
    kept = same(before, params(fresh))  # the previous checkpoint's weights (good's)
    return found, damaged, untouched, same(params(model), params(fresh)), kept


def test_fsdp_a_damaged_checkpoint_is_every_ranks_error_naming_the_directory_and_file(tmp_path):
    strategy = phalanx.resolve(
        "fsdp", accelerator="cpu", devices=2, launcher="fork", timeout=TIMEOUT, state_dict_type="sharded"
    )
    (found0, damaged, untouched0, loaded0, kept0), (found1, _, untouched1, loaded1, kept1) = strategy.launch(
        fsdp_damaged, str(tmp_path)
    )
    # Nothing was loaded from a damaged checkpoint, where the damage shows
    # before reading (a file missing or short, the .metadata); a record
    # damaged inside a file shows only once torch.distributed.checkpoint
    # has read the others into the module.
    for untouched in (untouched0, untouched1):
        assert {case for case, kept in untouched.items() if not kept} <= {"shard-record-damaged"}
    assert loaded0 and loaded1  # the whole one still loads
    assert found0 == found1  # the same error on both ranks
    assert all(kind == "MisconfigurationError" for case, (kind, _) in found0.items() if case != "unfinished")
    assert damaged["shard-missing"].endswith(".distcp")
    for case in SHARDED_CASES:
        message = found0[case][1]
        assert message.startswith(
            f"load_checkpoint({str(tmp_path / case)!r}): the sharded checkpoint is damaged: its file "
            f"{damaged[case]!r} "
        ), message
        assert message.endswith(
            "Load an earlier checkpoint, or copy this directory again in full from where it came from"
        )
    prefix = f"load_checkpoint({str(tmp_path / 'metadata-empty')!r}): the sharded checkpoint is damaged: "
    assert found0["metadata-empty"][1].startswith(prefix + "its file '.metadata' is empty (0 bytes)")
    for case in ("metadata-truncated", "metadata-text"):
        assert "' cannot be read (" in found0[case][1]
        assert "): it is truncated, damaged, or not a checkpoint's metadata." in found0[case][1]
    assert (
        f"{damaged['shard-missing']!r} is missing (its .metadata lists it; the directory has "
        in (found0["shard-missing"][1])
    )
    assert "' is truncated: it has " in found0["shard-truncated"][1]
    assert "bytes, and the .metadata places records up to byte " in found0["shard-truncated"][1]
    assert "' has a damaged record of '" in found0["shard-record-damaged"][1]
    assert (
        "it is not a torch.save file: its " in found0["shard-record-damaged"][1]
        and "bytes begin with ff ff ff ff ff ff ff ff" in found0["shard-record-damaged"][1]
    )
    for case in ("good", "full.pt"):
        assert found0[f"other-shapes-{case}"][1] == (
            f"load_checkpoint({str(tmp_path / case)!r}): the module under 'model' does not match the "
            "checkpoint: 3 tensor(s) have another shape: 0.bias is (16,) in the checkpoint and (8,) in the "
            "module; 0.weight is (16, 4) in the checkpoint and (8, 4) in the module; 2.weight is (2, 16) in "
            "the checkpoint and (2, 8) in the module. Load it into a module like the one it was saved from"
        )
    # The save that did not finish left the previous checkpoint, whole.
    assert found0["unfinished"] == ("nothing", "")
    assert kept0 and kept1
    truncated = str(tmp_path / "full-truncated.pt")
    assert found0["full-truncated.pt"][1].startswith(
        f"cannot load the checkpoint file {truncated!r}: it is truncated: it begins as a torch.save archive "
        "(zip), but its 2,000 bytes end before the archive's index"
    )
