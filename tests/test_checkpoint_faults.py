"""Checkpoint files against faults: every corrupted or truncated file is refused with a
CheckpointError naming it, a writer killed mid-write leaves no temporary file for long,
and a full disk (or any OS error) names the destination and leaves nothing behind."""

from __future__ import annotations

import errno
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from graphkit_train import checkpoint
from graphkit_train.checkpoint import CheckpointError

ARRAYS = {
    "coef": np.arange(8.0).reshape(4, 2),
    "intercept": np.array([0.5, -1.5], np.float32),
    "step": np.array(3, np.int64),
}
HEADER = {"epochs": 2, "train_losses": [1.0, 0.5]}


def _written(folder: Path) -> Path:
    path = folder / "run.ckpt"
    checkpoint.write(path, ARRAYS, HEADER)
    return path


def _assert_same_content(arrays, header) -> None:
    assert list(arrays) == list(ARRAYS)
    for name, want in ARRAYS.items():
        assert arrays[name].dtype == want.dtype and arrays[name].shape == want.shape, name
        np.testing.assert_array_equal(arrays[name], want, err_msg=name)
    assert header["epochs"] == 2 and header["train_losses"] == [1.0, 0.5]


def _assert_refused(path: Path) -> None:
    with pytest.raises(CheckpointError) as info:
        checkpoint.read(path)
    message = str(info.value)
    assert repr(str(path)) in message and "truncated or corrupted" in message, message
    assert "Use an earlier checkpoint or train from scratch" in message, message


def _central_entries(data: bytes) -> list[int]:
    """Offsets of the zip's central-directory entries (signature PK\\1\\2)."""
    offsets, start = [], 0
    while (found := data.find(b"PK\x01\x02", start)) != -1:
        offsets.append(found)
        start = found + 4
    return offsets


def test_central_directory_flags_and_compression_method_are_refused(tmp_path):
    data = _written(tmp_path).read_bytes()
    entries = _central_entries(data)
    assert len(entries) == 1 + len(ARRAYS)  # the header and each array
    bad = tmp_path / "bad.ckpt"
    for entry in entries:
        # general-purpose flag bit 0: "encrypted" (zipfile: RuntimeError, password required)
        corrupted = bytearray(data)
        corrupted[entry + 8] |= 0x01
        bad.write_bytes(bytes(corrupted))
        _assert_refused(bad)
        # the compression method: stored (0) becomes unknown or a compressor's, whose
        # decoder fails on stored bytes (zipfile: NotImplementedError, zlib / bz2 / lzma)
        for method in (1, 6, 8, 9, 12, 14, 19, 93, 97, 98, 99, 0xFFFF):
            corrupted = bytearray(data)
            corrupted[entry + 10 : entry + 12] = struct.pack("<H", method)
            bad.write_bytes(bytes(corrupted))
            _assert_refused(bad)
        # the version needed to extract (zipfile: NotImplementedError, "zip file version")
        corrupted = bytearray(data)
        corrupted[entry + 6 : entry + 8] = struct.pack("<H", 0x6D)
        bad.write_bytes(bytes(corrupted))
        _assert_refused(bad)


def test_every_byte_flip_and_truncation_is_refused_or_harmless(tmp_path):
    """A flipped bit either lands in a field the reader ignores (a timestamp), and the
    content is the one written, or the file is refused: never a foreign exception,
    never other values."""
    data = _written(tmp_path).read_bytes()
    bad = tmp_path / "bad.ckpt"
    refused = 0
    for position in range(len(data)):
        for flip in (0x01, 0x40, 0xFF):
            corrupted = bytearray(data)
            corrupted[position] ^= flip
            bad.write_bytes(bytes(corrupted))
            try:
                arrays, header = checkpoint.read(bad)
            except CheckpointError as exc:
                assert repr(str(bad)) in str(exc) and "truncated or corrupted" in str(exc)
                refused += 1
            else:
                _assert_same_content(arrays, header)
    assert refused > len(data)  # most bytes matter
    for length in range(len(data)):
        bad.write_bytes(data[:length])
        _assert_refused(bad)


def test_an_unreadable_file_says_so(tmp_path):
    folder = tmp_path / "a-folder.ckpt"
    folder.mkdir()
    with pytest.raises(CheckpointError, match=r"a-folder\.ckpt.*cannot be read.*IsADirectory"):
        checkpoint.read(folder)


def _temporary_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".checkpoint-"))


def _killed_writer_leftover(folder: Path) -> Path:
    """The temporary file of a process SIGKILLed just before its rename."""
    script = (
        "import os, signal, sys\n"
        "import numpy as np\n"
        "from graphkit_train import checkpoint\n"
        "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)\n"
        "checkpoint.write(sys.argv[1], {'w': np.zeros(3)}, {})\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(folder / "run.ckpt")])
    assert done.returncode == -9
    (leftover,) = [folder / name for name in _temporary_files(folder)]
    return leftover


def test_a_killed_writers_temporary_file_is_removed_by_the_next_write(tmp_path):
    leftover = _killed_writer_leftover(tmp_path)
    assert not (tmp_path / "run.ckpt").exists()
    checkpoint.write(tmp_path / "other.ckpt", ARRAYS, HEADER)
    assert _temporary_files(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.ckpt"]
    assert not leftover.exists()


def test_only_stale_temporary_files_are_removed(tmp_path):
    """A temporary file is stale when its writer (a process of this machine) is dead, or
    when it is over an hour old; a live writer's file and another machine's recent one
    (its process cannot be checked from here) stay."""
    leftover = _killed_writer_leftover(tmp_path).name
    _, dead_pid, host, rest = leftover.split("-", 3)
    assert int(dead_pid) > 0 and rest.endswith(".tmp")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = {
            f".checkpoint-{os.getpid()}-{host}-mine1234.tmp",  # this process: a live writer
            f".checkpoint-{sleeper.pid}-{host}-live1234.tmp",  # another live process
            f".checkpoint-{dead_pid}-0badc0de-otherhost.tmp",  # another machine, recent
            ".checkpoint-abcd_123",  # an older graphkit's name (no pid), recent
            ".checkpoint-notes.txt",  # not a name graphkit makes
        }
        old = {
            f".checkpoint-{sleeper.pid}-{host}-oldlive1.tmp",  # live pid, but 2 hours old
            f".checkpoint-{dead_pid}-0badc0de-oldother.tmp",
            ".checkpoint-zzzz_999",
        }
        two_hours_ago = time.time() - 7200
        for name in live | old:
            (tmp_path / name).write_bytes(b"partial")
        for name in old | {".checkpoint-notes.txt"}:
            os.utime(tmp_path / name, (two_hours_ago, two_hours_ago))
        checkpoint.write(tmp_path / "run.ckpt", ARRAYS, HEADER)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _temporary_files(tmp_path) == sorted(live)
    _assert_same_content(*checkpoint.read(tmp_path / "run.ckpt"))


def test_a_full_disk_names_the_checkpoint_and_leaves_no_temporary_file(tmp_path, monkeypatch):
    path = _written(tmp_path)
    before = path.read_bytes()

    def full_disk(fd):  # the first fsync is the temporary file's, before the rename
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError) as info:
        checkpoint.write(path, {**ARRAYS, "coef": ARRAYS["coef"] + 1}, HEADER)
    error = info.value
    assert isinstance(error, checkpoint.CheckpointWriteError)
    assert error.errno == errno.ENOSPC and error.filename == str(path)
    message = str(error)
    assert repr(str(path)) in message and "No space left on device" in message, message
    assert "free some space" in message, message
    assert isinstance(error.__cause__, OSError) and error.__cause__.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.ckpt"]  # no temporary file
    assert path.read_bytes() == before  # the previous checkpoint is intact


def test_an_unwritable_folder_names_the_checkpoint(tmp_path, monkeypatch):
    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", refused)
    path = tmp_path / "run.ckpt"
    with pytest.raises(checkpoint.CheckpointWriteError) as info:
        checkpoint.write(path, ARRAYS, HEADER)
    assert info.value.errno == errno.EACCES
    assert repr(str(path)) in str(info.value) and "Permission denied" in str(info.value)
    assert isinstance(info.value.__cause__, PermissionError)
    assert list(tmp_path.iterdir()) == []
