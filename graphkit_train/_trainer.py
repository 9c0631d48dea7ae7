"""The training loop both trainers share.

A trainer owns a *resident session*: a graph whose inputs include the weights, the
optimizer state, ``step`` and ``loss_sum``, and whose ``.next`` outputs hold their new
values (the fused training step, or the update step of forward/backward training).
Those values live in two sets of OrtValues bound once to two IOBindings that
alternate: one reads set A and writes set B, the other the reverse. A subclass says how
one batch runs (:meth:`BaseTrainer._run_batch`); the loop, the per-epoch loss read-back,
the rollback on NaN, the state, pickling and exports are here.
"""

from __future__ import annotations

import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from graphkit._ort import onnxruntime
from graphkit.compat import load_model
from graphkit.errors import ConvergenceError, ShapeError, UnknownNameError
from graphkit.parameters import untie_constants
from graphkit.rewrite import set_weights
from graphkit_train._base import (
    ParamsMixin,
    as_state,
    check_features,
    check_labels,
    check_sample_weight,
    validation_period,
)
from graphkit_train.step import LOSS_SUM, STEP, UpdateStep, next_name


class BaseTrainer(ParamsMixin, ABC):
    """Mini-batch training around a resident session; see the module docstring.

    Subclasses set in ``_build``: ``update_step_`` (an :class:`UpdateStep`),
    ``_resident_session``, ``_features_value``, ``_label_value``,
    ``_accepts_sample_weight``, ``_requires_sample_weight``,
    ``_providers``, ``_ort_device``, ``_device_id``; and implement ``_run_batch``,
    ``_predict_outputs``, ``_loss``, ``_prediction_model`` and ``_graphs``.
    """

    exc: bool = True  # raise ConvergenceError on NaN (forward/backward can warn instead)

    # -- building --------------------------------------------------------------------------

    def _invalidate(self) -> None:
        self._built = False
        self._buffers: list[dict[str, Any]] | None = None
        self._current = 0
        self._rng: np.random.Generator | None = None

    @abstractmethod
    def _build(self) -> None:
        """Build graphs and sessions from the parameters (once; see ``_invalidate``)."""

    def _check_loop_params(self) -> None:
        if not (isinstance(self.max_iter, int) and self.max_iter >= 1):
            raise ValueError(f"max_iter must be an int >= 1, got {self.max_iter!r}.")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}.")

    def _ortvalue(self, array: np.ndarray) -> Any:
        ort = onnxruntime()
        return ort.OrtValue.ortvalue_from_numpy(np.array(array), self._ort_device, self._device_id)

    def _allocate(self, values: Mapping[str, np.ndarray]) -> None:
        """Two buffer sets holding ``values``, and the two bindings that alternate."""
        step = self.update_step_
        self._buffers = [{n: self._ortvalue(values[n]) for n in step.resident} for _ in range(2)]
        self._bindings = []
        for k in (0, 1):
            binding = self._resident_session.io_binding()
            for name in step.resident:
                binding.bind_ortvalue_input(name, self._buffers[k][name])
                binding.bind_ortvalue_output(next_name(name), self._buffers[1 - k][name])
            self._bind_scratch(binding)
            self._bindings.append(binding)
        self._current = 0

    def _bind_scratch(self, binding: Any) -> None:
        """Bind the session's outputs that are not resident (subclasses)."""

    @property
    def _fitted(self) -> bool:
        return self._buffers is not None

    @property
    def _resident(self) -> dict[str, Any]:
        """The buffer set holding the current values."""
        if self._buffers is None:
            raise RuntimeError("Nothing trained yet: call fit() or set_state() first.")
        return self._buffers[self._current]

    # -- state -----------------------------------------------------------------------------

    def get_state(self) -> dict[str, np.ndarray]:
        """Weights, optimizer state and ``"step"`` (updates applied), as numpy copies."""
        current = self._resident
        step = self.update_step_
        return {n: current[n].numpy().copy() for n in [*step.weights, *step.state, STEP]}

    def set_state(self, state: Mapping[str, Any]) -> BaseTrainer:
        """Load weights (and optionally optimizer state and ``"step"``) to train from.

        Missing optimizer state starts at its initial value; the next ``fit`` with
        ``warm_start=True`` continues from this state.
        """
        self._build()
        step = self.update_step_
        unknown = sorted(set(state) - {*step.weights, *step.state, STEP})
        if unknown:
            raise UnknownNameError(
                f"Unknown state entries {unknown}; expected weights {step.weights}, "
                f"optimizer state {step.state} and 'step'."
            )
        values = dict(step.initial)
        for name, value in state.items():
            value = np.asarray(value)
            expected = step.initial[name]
            if value.shape != expected.shape:
                raise ShapeError(
                    f"State {name!r} has shape {value.shape}, expected {expected.shape}."
                )
            values[name] = value.astype(expected.dtype)
        self._allocate(values)
        if not hasattr(self, "train_losses_"):
            self.train_losses_: list[float] = []
            self.validation_losses_: list[float] = []
        return self

    # -- the loop --------------------------------------------------------------------------

    def fit(
        self,
        X: Any,
        y: Any,
        sample_weight: Any = None,
        X_val: Any = None,
        y_val: Any = None,
    ) -> BaseTrainer:
        """Train for ``max_iter`` epochs of shuffled mini-batches.

        Raises:
            ConvergenceError: the loss of an epoch is NaN or infinite; the weights and the
                optimizer state are restored to the end of the last good epoch (with
                ``exc=False``, a warning instead, and training stops).
        """
        self._build()
        X, y, w = self._check(X, y, sample_weight)
        validation = None
        if X_val is not None:
            if y_val is None:
                raise ValueError("X_val is given without y_val.")
            validation = self._check(X_val, y_val, None, "X_val", "y_val")
        if not (self.warm_start and self._fitted):
            self._allocate(self.update_step_.initial)
            self.train_losses_ = []
            self.validation_losses_ = []
            self._rng = np.random.default_rng(self.random_state)
        if self._rng is None:  # state loaded with set_state()
            self._rng = np.random.default_rng(self.random_state)
        n = len(X)
        period = validation_period(self.validation_every, self.max_iter)
        zero = np.zeros_like(self.update_step_.initial[LOSS_SUM])
        progress = _progress(self.max_iter, self.verbose)
        for epoch in range(self.max_iter):
            snapshot = {name: value.numpy().copy() for name, value in self._resident.items()}
            self._resident[LOSS_SUM].update_inplace(zero)
            order = self._rng.permutation(n) if self.shuffle else None
            Xe, ye = (X, y) if order is None else (X[order], y[order])
            we = None if w is None else (w if order is None else w[order])
            n_batches = 0
            for start in range(0, n, self.batch_size):
                stop = start + self.batch_size
                self._run_batch(
                    self._bindings[self._current],
                    Xe[start:stop],
                    ye[start:stop],
                    None if we is None else we[start:stop],
                )
                self._current = 1 - self._current
                n_batches += 1
            loss = float(self._resident[LOSS_SUM].numpy()) / n_batches
            if not np.isfinite(loss):
                self._restore(snapshot)
                message = (
                    f"The loss became {loss} during epoch {len(self.train_losses_) + 1}; the "
                    "weights and optimizer state are those of the previous epoch. Lower the "
                    "learning rate or scale the features."
                )
                if self.exc:
                    raise ConvergenceError(message)
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                break
            self.train_losses_.append(loss)
            if validation is not None and period and (epoch + 1) % period == 0:
                self.validation_losses_.append(self._loss(*validation))
            if progress is not None:
                lr = self.learning_rate_.value(int(self._resident[STEP].numpy()))
                progress.update(1)
                progress.set_postfix(loss=f"{loss:.5g}", lr=f"{lr:.3g}", refresh=False)
        if progress is not None:
            progress.close()
        return self

    @abstractmethod
    def _run_batch(self, binding: Any, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> None:
        """One training step on a batch; ``binding`` reads the current resident set."""

    def _restore(self, values: Mapping[str, np.ndarray]) -> None:
        for name, value in values.items():
            self._resident[name].update_inplace(value)

    def _check(
        self, X: Any, y: Any, sample_weight: Any, x_name: str = "X", y_name: str = "y"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        X = check_features(X, self._features_value, x_name)
        y = check_labels(y, self._label_value, len(X), y_name)
        if sample_weight is None:
            if not self._requires_sample_weight:
                return X, y, None
            sample_weight = np.ones(len(X))
        elif not self._accepts_sample_weight:
            raise ValueError(
                "sample_weight given but the training graph has no sample-weight input; "
                "build it with add_loss_output(..., weight_name='weight')."
            )
        return X, y, check_sample_weight(sample_weight, len(X), X.dtype)

    # -- using the trained weights ---------------------------------------------------------

    def predict(self, X: Any) -> np.ndarray:
        """The output the loss is computed on, with the trained weights (1-D for one
        column)."""
        self._build()
        result = self._predict_outputs(check_features(X, self._features_value))
        return result[:, 0] if result.ndim == 2 and result.shape[1] == 1 else result

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Minus the loss on ``(X, y)``: higher is better, as scikit-learn's scorers."""
        self._build()
        return -self._loss(*self._check(X, y, sample_weight))

    def get_trained_onnx(self, model: onnx.ModelProto | None = None) -> onnx.ModelProto:
        """The prediction graph (or ``model``, e.g. the original one) with the trained weights."""
        self._build()
        weights = {n: v for n, v in self.get_state().items() if n in self.update_step_.weights}
        target = self._prediction_model() if model is None else load_model(model)
        # a constant the exporter merged with a weight must keep its value
        return set_weights(untie_constants(target, weights), weights)

    def save_onnx_graph(self, export: str | os.PathLike[str] | type[bytes]) -> dict[str, Any]:
        """Export every graph the trainer uses.

        Args:
            export: a folder (created if needed) or the type ``bytes`` to serialize in
                memory.

        Returns:
            ``{name: path}`` or ``{name: serialized bytes}``; once trained, ``trained``
            is the prediction graph with the trained weights.
        """
        self._build()
        graphs = self._graphs()
        if self._fitted:
            graphs["trained"] = self.get_trained_onnx()
        if export is bytes:
            return {name: g.SerializeToString() for name, g in graphs.items()}
        folder = os.fspath(export)  # type: ignore[arg-type]
        os.makedirs(folder, exist_ok=True)
        paths = {}
        for name, graph in graphs.items():
            paths[name] = os.path.join(folder, f"{name}.onnx")
            onnx.save(graph, paths[name])
        return paths

    # -- pickling --------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        params = self.get_params()
        params["model_onnx"] = load_model(params["model_onnx"]).SerializeToString()
        state: dict[str, Any] = {"params": params}
        if self._built and self._fitted:
            state["trained"] = self.get_state()
            state["train_losses_"] = self.train_losses_
            state["validation_losses_"] = self.validation_losses_
            state["rng"] = self._rng.bit_generator.state if self._rng is not None else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        params = dict(state["params"])
        params["model_onnx"] = onnx.load_from_string(params["model_onnx"])
        self.__init__(**params)  # type: ignore[misc]
        if "trained" in state:
            self.set_state(as_state(state["trained"]))
            self.train_losses_ = list(state["train_losses_"])
            self.validation_losses_ = list(state["validation_losses_"])
            if state["rng"] is not None:
                self._rng = np.random.default_rng()
                self._rng.bit_generator.state = state["rng"]

    # -- subclass hooks --------------------------------------------------------------------

    update_step_: UpdateStep

    @abstractmethod
    def _predict_outputs(self, X: np.ndarray) -> np.ndarray:
        """The prediction output for checked features, with the current weights."""

    @abstractmethod
    def _loss(self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> float:
        """The loss on checked data, with the current weights."""

    @abstractmethod
    def _prediction_model(self) -> onnx.ModelProto:
        """The prediction graph, weights as initializers."""

    @abstractmethod
    def _graphs(self) -> dict[str, onnx.ModelProto]:
        """Every graph the trainer runs, by name (for ``save_onnx_graph``)."""


def _progress(total: int, verbose: int) -> Any:
    if not verbose:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="epochs", unit="epoch")
