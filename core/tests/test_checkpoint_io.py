"""TorchCheckpointIO: atomic, fsynced writes, and load errors that name the
file and say what is wrong with it. Real files, real ``torch.save``, real
processes (one of them killed while it writes)."""

from __future__ import annotations

import fractions
import os
import pickle
import signal
import stat
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from phalanx_core import MisconfigurationError, PhalanxError, TorchCheckpointIO
from phalanx_core.checkpoint import HOST, clear_stale_partials, torch_save_damage

#: Seconds any subprocess of these tests may take.
DEADLINE = 120


def good_state() -> dict:
    return {"model": {"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.ones(3)}, "step": 7}


def partials(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.partial"))


# -- writing -------------------------------------------------------------------------------


def test_a_save_round_trips_and_leaves_only_the_file(tmp_path):
    path = tmp_path / "new" / "dir" / "ckpt.pt"
    io = TorchCheckpointIO()
    io.save(good_state(), path)
    io.save({**good_state(), "step": 8}, path)  # over the first one
    loaded = io.load(path)
    assert loaded["step"] == 8
    assert torch.equal(loaded["model"]["weight"], torch.arange(12.0).reshape(3, 4))
    assert [p.name for p in path.parent.iterdir()] == ["ckpt.pt"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # what open() would have made


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names open files through /proc")
def test_the_file_is_fsynced_before_the_rename_and_the_directories_after(tmp_path, monkeypatch):
    """The order that makes a save durable: the data on disk before the
    new name points at it, then the new name (and every directory made for
    it) on disk."""
    events: list[tuple[str, ...]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "a" / "b" / "ckpt.pt"
    TorchCheckpointIO().save(good_state(), path)
    monkeypatch.undo()

    [(_, temporary, target)] = [e for e in events if e[0] == "replace"]
    assert target == str(path)
    assert Path(temporary).parent == path.parent and Path(temporary).name.startswith(
        f"ckpt.pt.{HOST}-{os.getpid()}-"
    )
    assert events == [
        ("fsync", str(tmp_path)),  # the entry of the new directory a/
        ("fsync", str(tmp_path / "a")),  # the entry of b/
        ("fsync", temporary),  # the data
        ("replace", temporary, str(path)),
        ("fsync", str(path.parent)),  # the new name
    ]


def test_a_failed_save_removes_its_temporary_file_and_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ckpt.pt"
    io = TorchCheckpointIO()
    io.save(good_state(), path)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        io.save({"model": {"weight": torch.zeros(2)}, "hook": lambda: None}, path)  # cannot be pickled
    assert partials(tmp_path) == []
    assert io.load(path)["step"] == 7


WRITER = r"""
import sys, torch
from phalanx_core import TorchCheckpointIO
path, writer = sys.argv[1], int(sys.argv[2])
for step in range(30):
    TorchCheckpointIO().save({"writer": writer, "step": step, "data": torch.full((50_000,), writer)}, path)
"""


@pytest.mark.subprocess
def test_two_processes_saving_to_one_path_never_leave_a_partial_file(tmp_path):
    path = tmp_path / "ckpt.pt"
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(i)], stderr=subprocess.PIPE, text=True)
        for i in (1, 2)
    ]
    try:
        seen = set()
        deadline = time.monotonic() + DEADLINE
        while any(w.poll() is None for w in writers):  # read while they write: always a whole file
            assert time.monotonic() < deadline, "the writers did not finish in time"
            if path.exists():
                state = TorchCheckpointIO().load(path)
                assert torch.equal(state["data"], torch.full((50_000,), state["writer"]))
                seen.add(state["writer"])
        for w in writers:
            assert w.wait(timeout=DEADLINE) == 0, w.stderr.read() if w.stderr else ""
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=DEADLINE)
    final = TorchCheckpointIO().load(path)
    assert final["step"] == 29 and final["writer"] in (1, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


SAVER = r"""
import sys, torch
from phalanx_core import TorchCheckpointIO
path, megabytes = sys.argv[1], int(sys.argv[2])
TorchCheckpointIO().save({"step": 1, "weights": torch.arange(1000.0)}, path)
big = {"step": 2, "weights": [torch.ones(1 << 20) for _ in range(megabytes // 4)]}  # 4 MB each
TorchCheckpointIO().save(big, path)
"""


def _kill_while_saving(path: Path, megabytes: int) -> tuple[int, int | None]:
    """Start SAVER; SIGKILL it once its second save's temporary file has
    grown past 8 MB. Return its pid and its exit code (-SIGKILL if it was
    killed mid-write; 0 if it finished first)."""
    saver = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(path), str(megabytes)], stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + DEADLINE
        while saver.poll() is None and time.monotonic() < deadline:
            growing = [p for p in partials(path.parent) if _size(p) > 8 << 20]
            if growing and path.exists():
                saver.send_signal(signal.SIGKILL)
                break
            time.sleep(0.001)
        code = saver.wait(timeout=DEADLINE)
    finally:
        if saver.poll() is None:
            saver.kill()
            saver.wait(timeout=DEADLINE)
    assert code in (0, -signal.SIGKILL), saver.stderr.read() if saver.stderr else code
    return saver.pid, code


def _size(path: Path) -> int:
    """0 for a temporary file renamed into place since it was listed (its
    save finished between the listing and this look)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


@pytest.mark.subprocess
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path):
    for attempt in range(3):  # a machine that writes 384 MB before the poll sees it: again
        path = tmp_path / f"attempt-{attempt}" / "ckpt.pt"
        pid, code = _kill_while_saving(path, megabytes=384)
        if code == -signal.SIGKILL:
            break
    else:
        pytest.fail("the saver finished 384 MB three times before it could be killed")

    [leftover] = partials(path.parent)  # the killed save's, under its own name
    assert leftover.name.startswith(f"ckpt.pt.{HOST}-{pid}-")
    assert leftover.stat().st_size > 8 << 20
    state = TorchCheckpointIO().load(path)
    assert state["step"] == 1 and torch.equal(state["weights"], torch.arange(1000.0))
    assert sorted(state) == ["step", "weights"]

    # The leftover breaks nothing, and the next save to the path clears it
    # (its process is gone).
    TorchCheckpointIO().save({"step": 3}, path)
    assert TorchCheckpointIO().load(path) == {"step": 3}
    assert partials(path.parent) == []


# -- reading --------------------------------------------------------------------------------


def _damage_data_pkl(path: Path) -> None:
    """Overwrite the pickle inside a torch.save archive with zeros, leaving
    the archive's index whole."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    with open(path, "r+b") as file:
        file.seek(info.header_offset)
        name_length, extra_length = struct.unpack("<HH", file.read(30)[26:30])
        file.seek(info.header_offset + 30 + name_length + extra_length)
        file.write(b"\0" * info.compress_size)


def _write_case(path: Path, case: str) -> None:
    torch.save(good_state(), path)
    whole = path.read_bytes()
    if case == "empty":
        path.write_bytes(b"")
    elif case == "truncated":
        path.write_bytes(whole[: len(whole) // 2])
    elif case == "truncated-to-10-bytes":
        path.write_bytes(whole[:10])
    elif case == "damaged":
        _damage_data_pkl(path)
    elif case == "random-bytes":
        path.write_bytes(bytes((i * 7919 + 13) % 251 for i in range(4096)))
    elif case == "text":
        path.write_text("step: 7\nmodel: see model.bin\n")
    elif case == "pickle":
        path.write_bytes(pickle.dumps({"model": {"weight": [1.0, 2.0]}, "step": 7}))
    elif case == "other-zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("notes.txt", "not a checkpoint")
    elif case == "legacy-truncated":
        torch.save(good_state(), path, _use_new_zipfile_serialization=False)
        path.write_bytes(path.read_bytes()[:40])
    elif case == "a-list":
        torch.save([torch.ones(2), 7], path)
    elif case == "int-keys":
        torch.save({0: torch.ones(2)}, path)
    else:
        raise AssertionError(case)


CASES = {
    "empty": "it is empty (0 bytes). Load an earlier checkpoint, or copy this one again in full",
    "truncated": "it is truncated: it begins as a torch.save archive (zip), but its ",
    "truncated-to-10-bytes": "it is truncated: it begins as a torch.save archive (zip), but its 10 bytes end "
    "before the archive's index",
    "damaged": "it is damaged: its entry 'ckpt/data.pkl' fails its CRC check. Load an earlier checkpoint",
    "random-bytes": "it is not a torch.save file: its 4,096 bytes begin with 0d 97 26 b0 3f c9 58 e2, and "
    "torch.save writes a zip archive, which begins with 50 4b 03 04. Give the path of a file that "
    "save_checkpoint() wrote",
    "text": "it is not a torch.save file but text (29 bytes), beginning 'step: 7\\nmodel: see model.bin\\n'",
    "pickle": "it is not a torch.save file but a plain pickle (",
    "other-zip": "it is a zip archive that torch.save did not write (no data.pkl in notes.txt)",
    "legacy-truncated": "): it is truncated or damaged. Load an earlier checkpoint",
    "a-list": "torch.load reads a list from it, and a checkpoint is a dict of named entries",
    "int-keys": "torch.load reads a dict whose keys are not all strings from it",
}


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch's, reading the plain pickle
@pytest.mark.parametrize("weights_only", [True, False], ids=["weights_only", "any-pickle"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_file_that_is_not_a_whole_checkpoint_is_an_error_naming_it(tmp_path, case, weights_only):
    path = tmp_path / "ckpt.pt"
    _write_case(path, case)
    with pytest.raises(MisconfigurationError) as caught:
        TorchCheckpointIO().load(path, weights_only=weights_only)
    message = str(caught.value)
    assert isinstance(caught.value, PhalanxError)
    assert message.startswith(f"cannot load the checkpoint file {str(path)!r}: "), message
    assert CASES[case] in message, message
    if case not in ("a-list", "int-keys"):  # those load; the others fail inside torch.load
        assert caught.value.__cause__ is not None  # raised from torch's own error


def test_a_whole_file_with_objects_is_refused_naming_the_file_and_weights_only_false(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"ratio": fractions.Fraction(1, 3)}, path)
    with pytest.raises(MisconfigurationError) as caught:
        TorchCheckpointIO().load(path)
    message = str(caught.value)
    assert f"cannot load the checkpoint file {str(path)!r} with weights_only=True" in message, message
    assert "fractions.Fraction" in message and "weights_only=False" in message, message
    assert isinstance(caught.value.__cause__, pickle.UnpicklingError)  # torch's own words, chained
    assert TorchCheckpointIO().load(path, weights_only=False) == {"ratio": fractions.Fraction(1, 3)}


class _RunsCode:
    """A pickle that would run code when loaded: it touches ``marker``."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_file_whose_pickle_would_run_code_is_refused_and_nothing_runs(tmp_path):
    path, marker = tmp_path / "ckpt.pt", tmp_path / "ran"
    torch.save({"model": {"w": torch.ones(2)}, "payload": _RunsCode(marker)}, path)
    with pytest.raises(MisconfigurationError, match="nothing in it was run") as caught:
        TorchCheckpointIO().load(path)
    assert "it names io.open" in str(caught.value), caught.value  # what it would have called
    assert not marker.exists(), "loading the checkpoint ran code"


def test_torch_save_damage_finds_nothing_wrong_with_whole_files(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save(good_state(), path)
    with open(path, "rb") as file:
        assert torch_save_damage(file) is None
    torch.save(good_state(), path, _use_new_zipfile_serialization=False)
    with open(path, "rb") as file:
        assert torch_save_damage(file) is None  # the legacy format: not judged


def _dead_pid() -> int:
    """The pid of a process that ran and is gone (reaped)."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_later_save_clears_the_partial_files_of_killed_saves_to_its_path(tmp_path):
    path = tmp_path / "ckpt.pt"
    dead = _dead_pid()
    killed = [
        tmp_path / f"ckpt.pt.{HOST}-{dead}-0123abcd.partial",  # this host, its process gone
        tmp_path / f"ckpt.pt.{dead}-89abcdef.partial",  # an earlier version's name, no host
        tmp_path / f"ckpt.pt.{HOST}-{os.getpid()}-00000000.partial",  # this process's: never in flight now
    ]
    alive = tmp_path / f"ckpt.pt.{HOST}-1-11111111.partial"  # pid 1 runs: a save that may be running
    elsewhere = tmp_path / "ckpt.pt.otherhost-5-22222222.partial"  # another host's, newer than the checkpoint
    other = tmp_path / f"other.pt.{HOST}-{dead}-33333333.partial"  # another path's
    for leftover in (*killed, alive, elsewhere, other):
        leftover.write_bytes(b"half a checkpoint")
    os.utime(elsewhere, (time.time() + 60, time.time() + 60))
    TorchCheckpointIO().save(good_state(), path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["ckpt.pt", alive.name, elsewhere.name, other.name])
    # Another host's partial file older than the checkpoint is a save that
    # a later one outlived: cleared.
    os.utime(elsewhere, (time.time() - 60, time.time() - 60))
    assert clear_stale_partials(path) == [elsewhere]
