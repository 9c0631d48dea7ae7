"""Keep training an exported step on any ONNX runtime: plain onnxruntime, onnx.reference.

:func:`graphkit.training.export.export_training_step` writes a training step in standard
ONNX whose metadata names its data inputs and resident tensors. :class:`PortableTrainer`
runs it epoch after epoch, as graphkit's own trainer does (same batches, same
``random_state`` permutation), with nothing but onnx, numpy and the runtime: like
:mod:`graphkit.training_info`, this file can be loaded where graphkit and
onnxruntime-training are not installed (with ``training_info.py`` and
``training/batches.py`` beside it, as in graphkit's source tree)::

    trainer = PortableTrainer("step.onnx", batch_size=32).fit(X, y, epochs=5)
    trainer.train_losses_, trainer.state()["W1"]
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import numpy_helper

if TYPE_CHECKING:  # checked against graphkit's modules, which the fallback loads by path
    from graphkit.compat import load_model
    from graphkit.training.batches import NamedRows, epoch_batches
    from graphkit.training_info import initial_state, session, set_initial_state
else:
    try:
        from graphkit.compat import load_model
        from graphkit.training.batches import NamedRows, epoch_batches
        from graphkit.training_info import initial_state, session, set_initial_state
    except ImportError:  # loaded from its file where graphkit is not installed: so are these
        import importlib.util
        import pathlib

        def _load(relative: str) -> object:
            path = pathlib.Path(__file__).parent / relative
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module

        _info = _load("training_info.py")
        session, initial_state = _info.session, _info.initial_state
        set_initial_state = _info.set_initial_state
        _batches = _load("training/batches.py")
        epoch_batches, NamedRows = _batches.epoch_batches, _batches.NamedRows

        def load_model(model: onnx.ModelProto | str | os.PathLike[str]) -> onnx.ModelProto:
            """onnx's own loading (external data read relative to the model's folder)."""
            return model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model))


META = "graphkit.training_step"
"""The metadata key of an exported step: JSON with features, inputs, label, labels and
heads (a loss per output: ``{output: label input}``), sample_weight, loss, resident."""


class PortableTrainer:
    """Mini-batch training with an exported training step.

    Args:
        step: the exported step (ModelProto or path).
        batch_size: rows per step.
        shuffle: a new permutation of the rows every epoch (numpy's ``default_rng``
            seeded with ``random_state``, as graphkit's trainers draw them).
        random_state: the seed.
        runtime: ``"onnxruntime"`` or ``"reference"`` (onnx.reference).
    """

    def __init__(
        self,
        step: onnx.ModelProto | str | os.PathLike[str],
        batch_size: int = 10,
        shuffle: bool = True,
        random_state: int | None = None,
        runtime: str = "onnxruntime",
    ) -> None:
        # by path, external data is read from the step's own folder only (load_model)
        self.model = load_model(step)
        meta = {p.key: p.value for p in self.model.metadata_props}
        if META not in meta:
            raise ValueError(
                "This model is not a graphkit training step: export one with "
                "OrtGradientOptimizer.export_training_step."
            )
        self.roles = json.loads(meta[META])
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
        self.batch_size, self.shuffle, self.runtime = batch_size, shuffle, runtime
        self._rng = np.random.default_rng(random_state)
        initial = initial_state(self.model)
        self._resident = {n: initial[n] for n in self.roles["resident"]}
        inputs = {i.name: i for i in self.model.graph.input}
        # a loss per output: {output: label input}; one loss: {None: label input}
        self.heads = dict(self.roles.get("heads") or {None: self.roles["label"]})
        self._label_ranks = {
            label: len(inputs[label].type.tensor_type.shape.dim) for label in self.heads.values()
        }
        # every feature input (steps exported before graphkit took several name one)
        self.inputs = list(self.roles.get("inputs") or [self.roles["features"]])
        weight = self.roles.get("sample_weight")
        self._weight_dtype = (
            onnx.helper.tensor_dtype_to_np_dtype(inputs[weight].type.tensor_type.elem_type)
            if weight
            else None
        )
        self._run = session(self.model, runtime)
        self._outputs = [o.name for o in self.model.graph.output]
        self.train_losses_: list[float] = []

    def state(self) -> dict[str, np.ndarray]:
        """The current weights, optimizer state, ``step`` and ``loss_sum``."""
        return {n: np.array(v) for n, v in self._resident.items()}

    def fit(
        self,
        X: np.ndarray | dict[str, np.ndarray],
        y: np.ndarray | dict[str, np.ndarray],
        sample_weight: np.ndarray | None = None,
        epochs: int = 1,
    ) -> PortableTrainer:
        """Train ``epochs`` more epochs; ``train_losses_`` gets each epoch's mean batch loss.

        Args:
            X: the features: an array, or ``{input name: array}`` for a step with several
                feature inputs (``self.inputs``).
            y: the labels; ``{output name: labels}`` for a step with a loss per output
                (``self.heads``).
            sample_weight: one weight per row, for a step exported with sample weights.
            epochs: how many epochs.

        Raises:
            ValueError: sample weights for a step without, or ``X`` not naming every
                feature input.
        """
        rows, labels = self._features(X), self._labels(y)
        weight = self.roles.get("sample_weight")
        if sample_weight is not None and not weight:
            raise ValueError("This training step takes no sample weights.")
        w = None
        if weight:
            w = np.ones(len(rows)) if sample_weight is None else np.asarray(sample_weight)
            w = w.astype(self._weight_dtype, copy=False)
        for _ in range(epochs):
            order = self._rng.permutation(len(rows)) if self.shuffle else None
            self._resident["loss_sum"] = np.zeros_like(self._resident["loss_sum"])
            batches = 0
            for X_batch, y_batch, w_batch in epoch_batches(rows, labels, w, order, self.batch_size):
                if isinstance(X_batch, NamedRows):
                    feeds = dict(X_batch.arrays)
                else:
                    feeds = {self.inputs[0]: X_batch}
                if isinstance(y_batch, NamedRows):
                    feeds.update(y_batch.arrays)
                else:
                    feeds[self.roles["label"]] = y_batch
                if weight and w_batch is not None:  # w_batch is None only without weight
                    feeds[weight] = w_batch
                out = dict(zip(self._outputs, self._run({**feeds, **self._resident})))
                self._resident = {n: out[f"{n}.next"] for n in self._resident}
                batches += 1
            self.train_losses_.append(float(self._resident["loss_sum"]) / batches)
        return self

    def _labels(self, y: np.ndarray | dict[str, np.ndarray]) -> np.ndarray | NamedRows:
        """One array for one loss, :class:`NamedRows` keyed by the label inputs for a loss
        per output (``y = {output name: labels}``); (N,) labels of an (N, 1) input become
        (N, 1)."""
        if None in self.heads:
            if isinstance(y, dict):
                raise ValueError("This training step has one loss: pass y as one array.")
            label = self.heads[None]
            y = np.asarray(y)
            return y.reshape(-1, 1) if y.ndim == 1 and self._label_ranks[label] == 2 else y
        if not isinstance(y, dict) or sorted(y) != sorted(self.heads):
            given = sorted(y) if isinstance(y, dict) else "one array"
            raise ValueError(
                f"y is {given}; this training step has a loss per output: pass y as a dict "
                f"{{output name: labels}} for {list(self.heads)}."
            )
        arrays = {}
        for output, label in self.heads.items():
            a = np.asarray(y[output])
            arrays[label] = a.reshape(-1, 1) if a.ndim == 1 and self._label_ranks[label] == 2 else a
        return NamedRows(arrays)

    def _features(self, X: np.ndarray | dict[str, np.ndarray]) -> np.ndarray | NamedRows:
        """One array for one feature input, :class:`NamedRows` of ``{name: array}`` for
        several."""
        if not isinstance(X, dict):
            if len(self.inputs) != 1:
                raise ValueError(
                    f"This training step takes {len(self.inputs)} feature inputs "
                    f"{self.inputs}: pass X as a dict {{input name: array}}."
                )
            return np.asarray(X)
        if sorted(X) != sorted(self.inputs):
            raise ValueError(
                f"X names {sorted(X)}; this training step's feature inputs are {self.inputs}."
            )
        arrays = {name: np.asarray(X[name]) for name in self.inputs}
        return arrays[self.inputs[0]] if len(arrays) == 1 else NamedRows(arrays)

    def to_model(self) -> onnx.ModelProto:
        """The step with the current values as its initial state
        (:func:`graphkit.training_info.initial_state`)."""
        out = onnx.ModelProto()
        out.CopyFrom(self.model)
        resident = {t.name for t in out.graph.initializer if t.name in self._resident}
        if resident:  # exported before the initial state was TrainingInfoProto: defaults
            for tensor in out.graph.initializer:
                if tensor.name in self._resident:
                    tensor.CopyFrom(
                        numpy_helper.from_array(self._resident[tensor.name], tensor.name)
                    )
        else:
            set_initial_state(out, self._resident)
        return out
