"""Full training: the loss is part of the graph, one fused ONNX graph per training step.

:class:`OrtGradientOptimizer` builds the training step once
(:func:`graphkit_train.step.build_training_step`) and runs it once per mini-batch. The
weights, the optimizer state, the step counter and the epoch's loss sum stay in
onnxruntime ``OrtValue`` buffers: two sets, bound once to two ``IOBinding`` objects that
alternate (one reads set A and writes set B, the other the reverse). Only the batch's
features and labels are bound per step, and the loss is read back once per epoch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from graphkit._ort import inference_session, onnxruntime
from graphkit.errors import ConvergenceError, ShapeError, UnknownNameError
from graphkit.rewrite import (
    META_PREDICTION,
    get_train_initializer,
    initializers_to_inputs,
    metadata,
    set_weights,
    strip_loss_output,
)
from graphkit_train._base import (
    ParamsMixin,
    as_state,
    check_features,
    check_labels,
    check_sample_weight,
    input_value,
    providers_for,
    select_learning_rate,
    validation_period,
)
from graphkit_train.step import LOSS_SUM, STEP, TrainingStep, build_training_step, next_name


def load_model(model: onnx.ModelProto | bytes | str | os.PathLike[str]) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(os.fspath(model))


class OrtGradientOptimizer(ParamsMixin):
    """Train the weights of an ONNX graph whose loss is one of its outputs.

    Args:
        model_onnx: a training graph, e.g. from :func:`graphkit.add_loss_output`
            (a ModelProto, its bytes or a path).
        weights_to_train: names of the float initializers to train (None: all of them).
        loss_output_name: the output holding the loss.
        max_iter: number of epochs.
        batch_size: rows per training step.
        learning_rate: a float (SGD at that constant rate), a name (``"SGD"``,
            ``"SGDNesterov"``, ``"adam"``...), a ``LearningRate*`` object, a graphkit
            optimizer (constant rate 0.01) or an ``(optimizer, schedule)`` pair.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (needs the CUDA build).
        warm_start: continue from where the previous ``fit`` stopped (weights, optimizer
            state, step count and shuffling sequence) instead of the initial weights.
        verbose: show a progress bar with the loss and the learning rate.
        validation_every: validate every ``validation_every * max_iter`` epochs (a float
            below 1) or every ``validation_every`` epochs; 0 never.
        sample_weight_name: name of the sample-weight input of graphs not made by
            ``add_loss_output`` (which records it).
        shuffle: draw a new permutation of the rows every epoch.
        random_state: seed of the permutations.

    Attributes (after ``fit``):
        train_losses_: mean batch loss of every epoch.
        validation_losses_: loss on ``(X_val, y_val)`` at each validation.
        learning_rate_: the resolved learning-rate object.
        training_step_: the :class:`~graphkit_train.step.TrainingStep` (its ``model`` is
            the fused ONNX graph).
    """

    def __init__(
        self,
        model_onnx: Any,
        weights_to_train: list[str] | None = None,
        loss_output_name: str = "loss",
        max_iter: int = 100,
        batch_size: int = 10,
        learning_rate: Any = "SGD",
        device: str = "cpu",
        warm_start: bool = False,
        verbose: int = 0,
        validation_every: float | int = 0.1,
        sample_weight_name: str = "weight",
        shuffle: bool = True,
        random_state: int | None = None,
    ) -> None:
        self.model_onnx = model_onnx
        self.weights_to_train = weights_to_train
        self.loss_output_name = loss_output_name
        self.max_iter = max_iter
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.device = device
        self.warm_start = warm_start
        self.verbose = verbose
        self.validation_every = validation_every
        self.sample_weight_name = sample_weight_name
        self.shuffle = shuffle
        self.random_state = random_state
        self._invalidate()

    # -- building --------------------------------------------------------------------------

    def _invalidate(self) -> None:
        self._built = False
        self._buffers: list[dict[str, Any]] | None = None
        self._current = 0
        self._rng: np.random.Generator | None = None

    def _build(self) -> None:
        if self._built:
            return
        if not (isinstance(self.max_iter, int) and self.max_iter >= 1):
            raise ValueError(f"max_iter must be an int >= 1, got {self.max_iter!r}.")
        if not (isinstance(self.batch_size, int) and self.batch_size >= 1):
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}.")
        self._providers, self._ort_device, self._device_id = providers_for(self.device)
        self.train_onnx_ = load_model(self.model_onnx)
        weights = self.weights_to_train
        if weights is None:
            weights = list(get_train_initializer(self.train_onnx_))
        self.learning_rate_ = select_learning_rate(self.learning_rate)
        self.training_step_: TrainingStep = build_training_step(
            self.train_onnx_,
            weights,
            self.learning_rate_,
            self.loss_output_name,
            self.sample_weight_name,
        )
        step = self.training_step_
        self._step_session = inference_session(step.model, self._providers)
        # the training graph and the prediction graph, reading the weights as inputs
        self.evaluation_onnx_ = initializers_to_inputs(self.train_onnx_, step.weights)
        self.prediction_onnx_ = strip_loss_output(self.evaluation_onnx_)
        self._eval_session = inference_session(self.evaluation_onnx_, self._providers)
        self._predict_session = inference_session(self.prediction_onnx_, self._providers)
        self._built = True

    def _ortvalue(self, array: np.ndarray) -> Any:
        ort = onnxruntime()
        return ort.OrtValue.ortvalue_from_numpy(np.array(array), self._ort_device, self._device_id)

    def _allocate(self, values: Mapping[str, np.ndarray]) -> None:
        """Two buffer sets holding ``values``, and the two bindings that alternate."""
        step = self.training_step_
        self._buffers = [{n: self._ortvalue(values[n]) for n in step.resident} for _ in range(2)]
        self._loss_scratch = self._ortvalue(values[LOSS_SUM])
        self._bindings = []
        for k in (0, 1):
            binding = self._step_session.io_binding()
            for name in step.resident:
                binding.bind_ortvalue_input(name, self._buffers[k][name])
                binding.bind_ortvalue_output(next_name(name), self._buffers[1 - k][name])
            binding.bind_ortvalue_output(step.loss, self._loss_scratch)
            self._bindings.append(binding)
        self._current = 0

    @property
    def _fitted(self) -> bool:
        return self._buffers is not None

    # -- state -----------------------------------------------------------------------------

    def get_state(self) -> dict[str, np.ndarray]:
        """Weights, optimizer state and ``"step"`` (updates applied), as numpy copies."""
        if not self._fitted:
            raise RuntimeError("Nothing trained yet: call fit() or set_state() first.")
        current = self._buffers[self._current]  # type: ignore[index]
        names = [*self.training_step_.weights, *self.training_step_.state, STEP]
        return {name: current[name].numpy().copy() for name in names}

    def set_state(self, state: Mapping[str, Any]) -> OrtGradientOptimizer:
        """Load weights (and optionally optimizer state and ``"step"``) to train from.

        Missing optimizer state starts at its initial value; the next ``fit`` with
        ``warm_start=True`` continues from this state.
        """
        self._build()
        step = self.training_step_
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
        return self

    # -- training --------------------------------------------------------------------------

    def fit(
        self,
        X: Any,
        y: Any,
        sample_weight: Any = None,
        X_val: Any = None,
        y_val: Any = None,
    ) -> OrtGradientOptimizer:
        """Train for ``max_iter`` epochs of shuffled mini-batches.

        Raises:
            ConvergenceError: the loss of an epoch is NaN or infinite; the weights and the
                optimizer state are restored to the end of the last good epoch.
        """
        self._build()
        step = self.training_step_
        X, y, w = self._check(X, y, sample_weight)
        validation = None
        if X_val is not None:
            if y_val is None:
                raise ValueError("X_val is given without y_val.")
            validation = self._check(X_val, y_val, None, "X_val", "y_val")
        if not (self.warm_start and self._fitted):
            self._allocate(step.initial)
            self.train_losses_: list[float] = []
            self.validation_losses_: list[float] = []
            self._rng = np.random.default_rng(self.random_state)
        assert self._rng is not None
        n = len(X)
        period = validation_period(self.validation_every, self.max_iter)
        zero = np.zeros_like(step.initial[LOSS_SUM])
        epochs = range(self.max_iter)
        progress = _progress(epochs, self.verbose)
        for epoch in progress if progress is not None else epochs:
            current = self._buffers[self._current]  # type: ignore[index]
            snapshot = {name: value.numpy().copy() for name, value in current.items()}
            current[LOSS_SUM].update_inplace(zero)
            order = self._rng.permutation(n) if self.shuffle else None
            Xe, ye = (X, y) if order is None else (X[order], y[order])
            we = None if w is None else (w if order is None else w[order])
            n_batches = 0
            for start in range(0, n, self.batch_size):
                stop = start + self.batch_size
                binding = self._bindings[self._current]
                binding.bind_cpu_input(step.features, Xe[start:stop])
                binding.bind_cpu_input(step.label, ye[start:stop])
                if we is not None:
                    binding.bind_cpu_input(step.sample_weight, we[start:stop])
                self._step_session.run_with_iobinding(binding)
                self._current = 1 - self._current
                n_batches += 1
            loss = float(self._buffers[self._current][LOSS_SUM].numpy()) / n_batches  # type: ignore[index]
            if not np.isfinite(loss):
                self._restore(snapshot)
                raise ConvergenceError(
                    f"The loss became {loss} during epoch {len(self.train_losses_) + 1}; the "
                    "weights and optimizer state are those of the previous epoch. Lower the "
                    "learning rate or scale the features."
                )
            self.train_losses_.append(loss)
            if validation is not None and period and (epoch + 1) % period == 0:
                self.validation_losses_.append(self._loss(*validation))
            if progress is not None:
                lr = self.learning_rate_.value(int(self._buffers[self._current][STEP].numpy()))  # type: ignore[index]
                progress.set_postfix(loss=f"{loss:.5g}", lr=f"{lr:.3g}")
        return self

    def _restore(self, values: Mapping[str, np.ndarray]) -> None:
        current = self._buffers[self._current]  # type: ignore[index]
        for name, value in values.items():
            current[name].update_inplace(value)

    def _check(
        self, X: Any, y: Any, sample_weight: Any, x_name: str = "X", y_name: str = "y"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        step = self.training_step_
        model = self.train_onnx_
        X = check_features(X, input_value(model, step.features), x_name)
        y = check_labels(y, input_value(model, step.label), len(X), y_name)
        if step.sample_weight is None:
            if sample_weight is not None:
                raise ValueError(
                    "sample_weight given but the training graph has no sample-weight input; "
                    "build it with add_loss_output(..., weight_name='weight')."
                )
            return X, y, None
        if sample_weight is None:
            sample_weight = np.ones(len(X))
        return X, y, check_sample_weight(sample_weight, len(X), X.dtype)

    # -- using the trained weights ---------------------------------------------------------

    def _bind_weights(self, binding: Any) -> None:
        current = self._buffers[self._current]  # type: ignore[index]
        for name in self.training_step_.weights:
            binding.bind_ortvalue_input(name, current[name])

    def _run(self, session: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not self._fitted:
            raise RuntimeError("Nothing trained yet: call fit() first.")
        binding = session.io_binding()
        self._bind_weights(binding)
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        names = [o.name for o in session.get_outputs()]
        for name in names:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        return dict(zip(names, binding.copy_outputs_to_cpu()))

    def _loss(self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> float:
        step = self.training_step_
        feeds = {step.features: X, step.label: y}
        if w is not None:
            feeds[step.sample_weight] = w  # type: ignore[index]
        return float(self._run(self._eval_session, feeds)[step.loss])

    def predict(self, X: Any) -> np.ndarray:
        """The output the loss was computed on, with the trained weights (1-D for one
        column)."""
        self._build()
        step = self.training_step_
        X = check_features(X, input_value(self.train_onnx_, step.features))
        outputs = self._run(self._predict_session, {step.features: X})
        name = metadata(self.train_onnx_).get(META_PREDICTION) or next(iter(outputs))
        result = outputs[name]
        return result[:, 0] if result.ndim == 2 and result.shape[1] == 1 else result

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """Minus the loss on ``(X, y)``: higher is better, as scikit-learn's scorers."""
        self._build()
        return -self._loss(*self._check(X, y, sample_weight))

    def get_trained_onnx(self, model: onnx.ModelProto | None = None) -> onnx.ModelProto:
        """The prediction graph (or ``model``, e.g. the original one) with the trained weights."""
        self._build()
        weights = {n: v for n, v in self.get_state().items() if n in self.training_step_.weights}
        target = strip_loss_output(self.train_onnx_) if model is None else load_model(model)
        return set_weights(target, weights)

    def save_onnx_graph(self, export: str | os.PathLike[str] | type[bytes]) -> dict[str, Any]:
        """Export every graph the trainer uses.

        Args:
            export: a folder (created if needed) or the type ``bytes`` to serialize in
                memory.

        Returns:
            ``{name: path}`` or ``{name: serialized bytes}`` for ``training_step`` (the
            fused graph), ``evaluation`` (the loss, weights as inputs), ``prediction``
            (weights as inputs) and, once trained, ``trained`` (the prediction graph with
            the trained weights).
        """
        self._build()
        graphs = {
            "training_step": self.training_step_.model,
            "evaluation": self.evaluation_onnx_,
            "prediction": self.prediction_onnx_,
        }
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
        model = load_model(params["model_onnx"])
        params["model_onnx"] = model.SerializeToString()
        state: dict[str, Any] = {"params": params}
        if self._fitted:
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
            self._rng = np.random.default_rng()
            if state["rng"] is not None:
                self._rng.bit_generator.state = state["rng"]


def _progress(epochs: range, verbose: int) -> Any:
    if not verbose:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(epochs, desc="epochs", unit="epoch")


__all__ = ["OrtGradientOptimizer", "load_model"]
