"""Checkpoints: everything a trainer needs to continue exactly where it stopped.

A checkpoint holds the weights, the optimizer state, the step counter (hence the
schedule's position), the shuffling generator's state, the epoch count and the loss
history, in one ``.npz`` file (numpy arrays, no pickle) with a JSON header::

    trainer.save_checkpoint("run.ckpt")
    trainer = OrtGradientOptimizer(onx, ...).load_checkpoint("run.ckpt")
    trainer.fit(X, y, checkpoint="run.ckpt")   # resumes by itself when the file exists

It is written atomically (a temporary file in the same folder, fsync, rename), so a
process killed while writing leaves the previous checkpoint intact; the temporary file
such a process leaves is removed by the next write to that folder (see
:func:`_remove_stale_temporaries`), and a failed write (a full disk) raises
:class:`CheckpointWriteError` naming the checkpoint and leaves no temporary file. The
header records a format version and a hash of the graphs (structure, names, shapes and
dtypes, not the weight values), so a checkpoint from another model is refused with a
clear error, and a truncated or corrupted file with a :class:`CheckpointError` naming it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import socket
import tempfile
import time
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from graphkit import tensor_store
from graphkit.errors import GraphkitError

try:
    from lzma import LZMAError
except ImportError:  # a Python built without lzma: zipfile then raises RuntimeError
    LZMAError = zlib.error  # type: ignore[assignment,misc]

FORMAT = "graphkit-checkpoint"
VERSION = 1
_HEADER = "__header__"


class CheckpointError(GraphkitError, ValueError):
    """A checkpoint that cannot be read, or that belongs to another model."""


class CheckpointWriteError(GraphkitError, OSError):
    """A checkpoint that could not be written (a full disk, a folder without write
    permission): the message names the checkpoint and keeps the system's; ``errno`` is
    the original error's, which is chained as ``__cause__``."""

    def __str__(self) -> str:  # OSError would print "[Errno n] strerror: filename"
        return str(self.args[0]) if self.args else ""


# What reading a damaged zip can raise besides BadZipFile: a flipped flag bit asks for a
# password (RuntimeError) or a feature zipfile lacks (NotImplementedError), a flipped
# compression method sends stored bytes to a decompressor (zlib.error, LZMAError,
# OSError from bz2), a damaged header gives JSON of another shape (KeyError, TypeError,
# AttributeError); ValueError covers numpy's format checks and bad JSON or UTF-8.
_DAMAGED = (
    zipfile.BadZipFile,
    zlib.error,
    LZMAError,
    NotImplementedError,
    RuntimeError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
    EOFError,
    OSError,
)

# Temporary files are named ``.checkpoint-<pid>-<host>-<random>.tmp``: the writer's
# process id and a tag of its machine, so that a later write can tell a dead writer's
# leftover from a live writer's file (see _remove_stale_temporaries). Older versions of
# graphkit named them ``.checkpoint-<8 random characters>`` (tempfile's default).
_TEMPORARY = re.compile(r"\.checkpoint-(\d+)-([0-9a-f]{8})-[A-Za-z0-9_]+\.tmp")
_OLD_TEMPORARY = re.compile(r"\.checkpoint-[a-z0-9_]{8}")
# Past this age a temporary file is stale whoever wrote it: a checkpoint write takes
# seconds, and the age alone is safe for files whose writer cannot be checked (another
# machine sharing the folder, an older graphkit, Windows, a reused process id).
_STALE_SECONDS = 3600.0


def _host_tag() -> str:
    """Eight hex digits naming this machine (its host name's CRC-32)."""
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def graph_hash(*models: onnx.ModelProto) -> str:
    """sha256 of the models' structure: initializer values are left out, so training
    (which changes the weights) keeps the hash. A weight kept in its external data file
    (:mod:`graphkit.tensor_store`, a large frozen base) is not copied into a checkpoint:
    the hash records a digest of its bytes instead, so that a checkpoint resumes only
    on the same base weights."""
    h = hashlib.sha256()
    for model in models:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        for tensor in copy.graph.initializer:
            if tensor_store.is_stored(tensor):
                h.update(f"{tensor.name}:{tensor_store.digest(tensor)}".encode())
                del tensor.external_data[:]  # its location is this process's name for it
            shape = list(tensor.dims)
            tensor.ClearField("raw_data")
            for field in ("float_data", "double_data", "int32_data", "int64_data"):
                tensor.ClearField(field)
            tensor.dims[:] = shape
        copy.ClearField("doc_string")
        copy.graph.ClearField("doc_string")
        h.update(copy.SerializeToString(deterministic=True))
    return h.hexdigest()


def write(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], header: dict) -> None:
    """Write ``arrays`` and ``header`` to ``path`` atomically.

    Stale temporary files that killed writers left in the folder are removed first.

    Raises:
        CheckpointWriteError: the folder cannot be created or written, the disk is full,
            or another system error; it names ``path`` and chains the original error.
            The previous checkpoint at ``path``, if any, is left as it was, and no
            temporary file is left behind.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    payload = {f"a{i}": np.asarray(v) for i, v in enumerate(arrays.values())}
    header = {**header, "format": FORMAT, "version": VERSION, "arrays": list(arrays)}
    meta = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    # one dict of Any: mypy would match a dict of arrays against savez's allow_pickle
    named: dict[str, Any] = {_HEADER: meta, **payload}
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise _write_error(path, exc, f"its folder {folder!r} cannot be created") from exc
    _remove_stale_temporaries(folder)
    try:
        fd, temporary = tempfile.mkstemp(
            prefix=f".checkpoint-{os.getpid()}-{_host_tag()}-", suffix=".tmp", dir=folder
        )
    except OSError as exc:
        raise _write_error(path, exc, "no temporary file can be created in its folder") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **named)  # straight to the file: a model of gigabytes, once
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # the error that matters is the write's
            os.unlink(temporary)
        if isinstance(exc, OSError):
            raise _write_error(path, exc, "the previous checkpoint there is unchanged") from exc
        raise
    # make the rename itself durable
    try:
        directory = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except OSError as exc:
        raise _write_error(
            path, exc, "it was renamed into place, but its folder could not be synced"
        ) from exc


def _write_error(path: str, exc: OSError, what: str) -> CheckpointWriteError:
    """The error for a failed write of ``path``: the system's message, what state the
    files are in, and what to do."""
    hints = {
        errno.ENOSPC: "free some space or write the checkpoint elsewhere",
        errno.EDQUOT: "free some space or write the checkpoint elsewhere",
        errno.EACCES: "choose a folder you can write to",
        errno.EPERM: "choose a folder you can write to",
        errno.EROFS: "choose a folder on a writable file system",
    }
    hint = hints.get(exc.errno or 0, "check the folder and the disk")
    error = CheckpointWriteError(
        f"Could not write the checkpoint {path!r} ({type(exc).__name__}: {exc}); {what}: {hint}."
    )
    error.errno, error.strerror, error.filename = exc.errno, exc.strerror, path
    return error


def _remove_stale_temporaries(folder: str) -> None:
    """Remove the temporary files of writers killed in ``folder`` (SIGKILL, a crash, a
    power cut between the temporary file and the rename), best effort.

    A file another writer is writing right now must survive, so a temporary file is
    removed only when it is stale for sure: its writer is a process of this machine
    that no longer exists (the process id and machine tag in its name), or it is older
    than an hour, whoever wrote it. A dead writer's process id reused by a new process
    only delays the removal to that hour.
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return
    host, now = _host_tag(), time.time()
    for name in names:
        match = _TEMPORARY.fullmatch(name)
        if match is None and _OLD_TEMPORARY.fullmatch(name) is None:
            continue  # not a name this module makes
        candidate = os.path.join(folder, name)
        try:
            dead = match is not None and match[2] == host and not _alive(int(match[1]))
            if dead or now - os.stat(candidate).st_mtime > _STALE_SECONDS:
                os.unlink(candidate)
        except OSError:  # gone already (another writer's cleanup), or not ours to remove
            continue


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this machine (True when it cannot be told)."""
    if os.name == "nt":  # os.kill(pid, 0) would terminate it there: rely on the age
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's live process
        return True
    return True


def read(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, header)`` from a checkpoint file; raise :class:`CheckpointError`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"No checkpoint at {path!r}.")
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(bytes(data[_HEADER]).decode())
            names = header["arrays"] if isinstance(header, dict) else None
            if not isinstance(names, list):
                raise ValueError("its header is not a graphkit checkpoint's")
            arrays = {name: data[f"a{i}"] for i, name in enumerate(names)}
    except (PermissionError, IsADirectoryError) as exc:
        raise CheckpointError(
            f"{path!r} cannot be read ({type(exc).__name__}: {exc}): check that it is a "
            "file you may read."
        ) from None
    except _DAMAGED as exc:
        raise CheckpointError(
            f"{path!r} is not a readable graphkit checkpoint (truncated or corrupted: "
            f"{type(exc).__name__}: {exc}). Use an earlier checkpoint or train from scratch."
        ) from None
    if header.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not a graphkit checkpoint.")
    if header.get("version") != VERSION:
        raise CheckpointError(
            f"{path!r} has checkpoint format version {header.get('version')}; this graphkit "
            f"reads version {VERSION}."
        )
    return arrays, header


def check_frozen(path: str, header: dict[str, Any], frozen: Mapping[str, dict]) -> None:
    """Refuse a checkpoint written over other frozen weights than ``frozen``
    (:func:`graphkit.tensor_store.references`): a checkpoint holds no copy of them, so
    it resumes only on the same bytes."""
    recorded = header.get("frozen", {})
    for name, now in frozen.items():
        then = recorded.get(name)
        if then is not None and then.get("blake2b") != now["blake2b"]:
            raise CheckpointError(
                f"{path!r} was written over another frozen weight {name!r}: the bytes now in "
                f"{now['file']!r} differ from those it was trained with (blake2b "
                f"{then.get('blake2b')} then, {now['blake2b']} now). A checkpoint holds no "
                "copy of the frozen weights: resume it with the model files it was "
                "written with."
            )


def check_matches(
    path: str,
    header: dict[str, Any],
    arrays: Mapping[str, np.ndarray],
    expected: Mapping[str, np.ndarray],
    expected_hash: str,
) -> None:
    """Refuse a checkpoint of another model: its names, shapes, dtypes and graph hash."""
    if sorted(arrays) != sorted(expected):
        missing = sorted(set(expected) - set(arrays))
        unknown = sorted(set(arrays) - set(expected))
        raise CheckpointError(
            f"{path!r} does not fit this trainer: it lacks {missing} and has {unknown} "
            "(a checkpoint of another model or optimizer)."
        )
    for name, want in expected.items():
        got = arrays[name]
        if got.shape != want.shape or got.dtype != want.dtype:
            raise CheckpointError(
                f"{path!r} holds {name!r} as {got.dtype}{list(got.shape)}; this trainer "
                f"needs {want.dtype}{list(want.shape)} (a checkpoint of another model)."
            )
    if header.get("graph_hash") != expected_hash:
        raise CheckpointError(
            f"{path!r} was written for another graph (same weight names and shapes, other "
            "operators, loss or optimizer)."
        )
