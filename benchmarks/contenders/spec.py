"""One workload as every contender reads it: numpy and the standard library only, so
that the JAX and torch environments load it without graphkit.

A workload folder holds ``workload.npz`` (``X``, ``y`` and every initial weight as
``weight/<name>``), ``workload.json`` (the settings and the architecture) and, for
graphkit and onnx2torch, ``model.onnx`` (the prediction graph built from the same
weights). ``peers.py`` writes it; each contender trains from it in a process of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class NotApplicable(Exception):
    """This contender cannot train this workload (the table says why)."""


@dataclass
class Spec:
    folder: Path
    name: str
    X: np.ndarray
    # float targets (n, outputs) for "mse", int64 classes (n,) for "ce", int64 classes
    # (n, seq) for "token_ce"
    y: np.ndarray
    weights: dict[str, np.ndarray]  # initial weights, by name
    batch_size: int
    # "mse", "ce" (softmax cross-entropy of (n, classes) logits, mean over the batch) or
    # "token_ce" (that of every token of (n, seq, classes) logits, mean over the batch's
    # tokens, as torch's F.cross_entropy(logits.reshape(-1, classes), y.reshape(-1)))
    loss: str
    # "sequential" (layers), "transformer", "lstm", "gru" or "bilstm_tagger": see peers.py
    arch: dict
    optimizer: str  # "sgd" or "adamw"
    lr: float
    weight_decay: float
    threads: int
    device: str = "cpu"  # "cpu" or "cuda": where every contender trains

    @property
    def batches(self) -> int:
        return -(-len(self.X) // self.batch_size)

    @property
    def model_path(self) -> Path:
        return self.folder / "model.onnx"

    def slices(self) -> Iterator[slice]:
        """The epoch's batches, in order (no shuffling), a short last one included."""
        for start in range(0, len(self.X), self.batch_size):
            yield slice(start, start + self.batch_size)


def save(folder: Path, settings: dict, X, y, weights: dict[str, np.ndarray]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {"X": X, "y": y, **{f"weight/{k}": v for k, v in weights.items()}}
    np.savez(folder / "workload.npz", **arrays)
    (folder / "workload.json").write_text(json.dumps(settings, indent=1))


def load(folder: Path, optimizer: str) -> Spec:
    settings = json.loads((folder / "workload.json").read_text())
    with np.load(folder / "workload.npz") as data:
        arrays = {k: data[k] for k in data.files}
    weights = {k.split("/", 1)[1]: v for k, v in arrays.items() if k.startswith("weight/")}
    return Spec(
        folder=folder,
        name=settings["name"],
        X=arrays["X"],
        y=arrays["y"],
        weights=weights,
        batch_size=settings["batch_size"],
        loss=settings["loss"],
        arch=settings["arch"],
        optimizer=optimizer,
        lr=settings["lr"][optimizer],
        weight_decay=settings["weight_decay"] if optimizer == "adamw" else 0.0,
        threads=settings["threads"],
        device=settings.get("device", "cpu"),
    )
