"""Checkpoints: everything a trainer needs to continue exactly where it stopped.

A checkpoint holds the weights, the optimizer state, the step counter (hence the
schedule's position), the shuffling generator's state, the epoch count and the loss
history, in one ``.npz`` file (numpy arrays, no pickle) with a JSON header::

    trainer.save_checkpoint("run.ckpt")
    trainer = OrtGradientOptimizer(onx, ...).load_checkpoint("run.ckpt")
    trainer.fit(X, y, checkpoint="run.ckpt")   # resumes by itself when the file exists

It is written atomically (a temporary file in the same folder, fsync, rename), so a
process killed while writing leaves the previous checkpoint intact. The header records a
format version and a hash of the graphs (structure, names, shapes and dtypes, not the
weight values), so a checkpoint from another model is refused with a clear error.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from graphkit.errors import GraphkitError

FORMAT = "graphkit-checkpoint"
VERSION = 1
_HEADER = "__header__"


class CheckpointError(GraphkitError, ValueError):
    """A checkpoint that cannot be read, or that belongs to another model."""


def graph_hash(*models: onnx.ModelProto) -> str:
    """sha256 of the models' structure: initializer values are left out, so training
    (which changes the weights) keeps the hash."""
    h = hashlib.sha256()
    for model in models:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        for tensor in copy.graph.initializer:
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
    """Write ``arrays`` and ``header`` to ``path`` atomically."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    buffer = io.BytesIO()
    payload = {f"a{i}": np.asarray(v) for i, v in enumerate(arrays.values())}
    header = {**header, "format": FORMAT, "version": VERSION, "arrays": list(arrays)}
    meta = np.frombuffer(json.dumps(header).encode(), dtype=np.uint8)
    np.savez(buffer, **{_HEADER: meta}, **payload)
    fd, temporary = tempfile.mkstemp(prefix=".checkpoint-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(buffer.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    # make the rename itself durable
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read(path: str | os.PathLike[str]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """``(arrays, header)`` from a checkpoint file; raise :class:`CheckpointError`."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"No checkpoint at {path!r}.")
    try:
        with np.load(path, allow_pickle=False) as data:
            header = json.loads(bytes(data[_HEADER]).decode())
            names = header["arrays"]
            arrays = {name: data[f"a{i}"] for i, name in enumerate(names)}
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError) as exc:
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
