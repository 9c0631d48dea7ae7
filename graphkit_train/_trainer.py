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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from graphkit import backend
from graphkit.compat import load_model
from graphkit.errors import ConvergenceError, ShapeError, UnknownNameError, not_fitted
from graphkit.losses import Loss
from graphkit.parameters import untie_constants
from graphkit.rewrite import set_weights
from graphkit.transforms import ema_weights
from graphkit_train import checkpoint
from graphkit_train._base import (
    ParamsMixin,
    as_state,
    check_class_labels,
    check_features,
    check_labels,
    check_loop_param,
    check_sample_weight,
    validation_period,
)
from graphkit_train.batches import epoch_batches
from graphkit_train.distributed import ProcessGroup, digest, shard
from graphkit_train.progress import EpochProgress
from graphkit_train.step import LOSS, LOSS_SUM, STEP, UpdateStep, grad_name, next_name


class BindingCache:
    """Binds an OrtValue input only when its data pointer or shape changed (the seed's
    cache): an IOBinding holds its own reference to what it binds, so an unchanged
    pointer is the same live buffer."""

    def __init__(self, binding: Any) -> None:
        self.binding = binding
        self._bound: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.hits = 0
        self.binds = 0

    def bind(self, name: str, value: Any) -> None:
        key = (value.data_ptr(), tuple(value.shape()))
        if self._bound.get(name) == key:
            self.hits += 1
            return
        self.binding.bind_ortvalue_input(name, value)
        self._bound[name] = key
        self.binds += 1


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
        self._probed_classes: int | None = None

    @abstractmethod
    def _build(self) -> None:
        """Build graphs and sessions from the parameters (once; see ``_invalidate``)."""

    def _check_loop_params(self) -> None:
        check_loop_param("max_iter", self.max_iter)
        check_loop_param("batch_size", self.batch_size)
        check_loop_param("n_iter_no_change", self.n_iter_no_change)
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must lie in (0, 1), got {self.validation_fraction!r}."
            )
        if self.tol < 0:
            raise ValueError(f"tol must be >= 0, got {self.tol!r}.")

    def _ortvalue(self, array: np.ndarray) -> Any:
        return backend.ortvalue(np.array(array), self._ort_device, self._device_id)

    def _allocate(self, values: Mapping[str, np.ndarray]) -> None:
        """Two buffer sets holding ``values``, the two bindings that alternate, and a
        cache of what the update-step path binds in each."""
        step = self.update_step_
        self._buffers = [{n: self._ortvalue(values[n]) for n in step.resident} for _ in range(2)]
        self._bindings = []
        for k in (0, 1):
            binding = self._bind_resident(self._resident_session, k)
            self._bind_scratch(binding)
            self._bindings.append(binding)
        self._update_caches = [BindingCache(b) for b in self._bindings]
        self._weight_names = list(step.weights)
        self._grad_names = [grad_name(n) for n in step.weights]
        self._current = 0
        self._buffers_changed()

    def _bind_resident(self, session: Any, k: int) -> Any:
        """A binding of ``session`` reading buffer set ``k`` and writing set ``1 - k``."""
        binding = session.io_binding()
        for name in self.update_step_.resident:
            binding.bind_ortvalue_input(name, self._buffers[k][name])  # type: ignore[index]
            binding.bind_ortvalue_output(next_name(name), self._buffers[1 - k][name])  # type: ignore[index]
        return binding

    def _buffers_changed(self) -> None:
        """The buffer sets were (re)allocated: bindings made on the old ones are stale
        (subclasses that keep more bindings drop them here)."""

    def _bind_scratch(self, binding: Any) -> None:
        """Bind the session's outputs that are not resident (subclasses)."""

    @property
    def _fitted(self) -> bool:
        return self._buffers is not None

    @property
    def _resident(self) -> dict[str, Any]:
        """The buffer set holding the current values."""
        if self._buffers is None:
            raise not_fitted(
                f"This {type(self).__name__} is not fitted yet: call fit() or set_state() first."
            )
        return self._buffers[self._current]

    def __sklearn_is_fitted__(self) -> bool:
        return bool(getattr(self, "_buffers", None))

    # -- state -----------------------------------------------------------------------------

    def get_state(self) -> dict[str, np.ndarray]:
        """Weights, optimizer state and ``"step"`` (updates applied), as numpy copies."""
        current = self._resident
        step = self.update_step_
        return step.public(
            {n: current[n].numpy().copy() for n in [*step.weights, *step.state, STEP]}
        )

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write weights, optimizer state, step, the shuffling generator, the epoch count
        and the loss history to ``path``, atomically (see :mod:`graphkit_train.checkpoint`)."""
        arrays = self.get_state()
        header = {
            "trainer": type(self).__name__,
            "graph_hash": self._graph_hash(),
            "epochs": len(self.train_losses_),
            "train_losses": [float(x) for x in self.train_losses_],
            "validation_losses": [float(x) for x in self.validation_losses_],
            "rng": self._rng.bit_generator.state if self._rng is not None else None,
        }
        checkpoint.write(path, arrays, header)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> BaseTrainer:
        """Continue from a checkpoint of :meth:`save_checkpoint`: the next ``fit`` with
        ``warm_start=True`` (or ``checkpoint=path``) goes on exactly where it stopped.

        Raises:
            CheckpointError: the file is truncated or corrupted, or belongs to another
                model (other weights, shapes, dtypes, operators or optimizer).
        """
        self._build()
        arrays, header = checkpoint.read(path)
        step = self.update_step_
        expected = step.public({n: step.initial[n] for n in [*step.weights, *step.state, STEP]})
        checkpoint.check_matches(os.fspath(path), header, arrays, expected, self._graph_hash())
        self.set_state(arrays)
        self.train_losses_ = list(header["train_losses"])
        self.validation_losses_ = list(header["validation_losses"])
        if header["rng"] is not None:
            self._rng = np.random.default_rng()
            self._rng.bit_generator.state = header["rng"]
        return self

    def _graph_hash(self) -> str:
        """The structure of the user's graph and of the update step (no weight values)."""
        return checkpoint.graph_hash(load_model(self.model_onnx), self.update_step_.model)

    def set_state(self, state: Mapping[str, Any]) -> BaseTrainer:
        """Load weights (and optionally optimizer state and ``"step"``) to train from.

        Missing optimizer state starts at its initial value; the next ``fit`` with
        ``warm_start=True`` continues from this state.
        """
        self._build()
        step = self.update_step_
        unknown = sorted(set(state) - {*step.weights, *step.public_state, STEP})
        if unknown:
            raise UnknownNameError(
                f"Unknown state entries {unknown}; expected weights {step.weights}, "
                f"optimizer state {step.public_state} and 'step'."
            )
        values = step.public(step.initial)
        for name, value in state.items():
            value = np.asarray(value)
            expected = values[name]
            if value.shape != expected.shape:
                raise ShapeError(
                    f"State {name!r} has shape {value.shape}, expected {expected.shape}."
                )
            values[name] = value.astype(expected.dtype)
        self._allocate(step.internal(values))
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
        callback: Callable[[int, dict[str, float | None], BaseTrainer], Any] | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 1,
    ) -> BaseTrainer:
        """Train for ``max_iter`` epochs of shuffled mini-batches.

        Args:
            X, y, sample_weight: the training data (sample weights when the loss takes
                them).
            X_val, y_val: held-out data, scored every ``validation_every`` epochs (and
                every epoch for ``early_stopping``, which otherwise holds out
                ``validation_fraction`` of X).
            callback: called after every epoch as ``callback(epoch, losses, trainer)``
                with ``losses = {"train": ..., "validation": ... or None}``; returning
                True stops training.
            checkpoint: a file to write a checkpoint to every ``checkpoint_every``
                epochs and at the end (:meth:`save_checkpoint`). When the file exists,
                training resumes from it and runs the epochs left to ``max_iter``: a
                killed run, started again with the same call, ends with the weights an
                uninterrupted run would have.

        Raises:
            ConvergenceError: the loss of an epoch is NaN, infinite, or negative for a
                loss that cannot be (probabilities outside [0, 1]); the weights and the
                optimizer state are restored to the end of the last good epoch (with
                ``exc=False``, a warning instead, and training stops).
            ValueError: class labels outside the model's classes, and other bad input.
        """
        self._build()
        if checkpoint is not None and self.distributed:
            raise ValueError("checkpoint= is not supported with distributed=True yet.")
        check_loop_param("checkpoint_every", checkpoint_every)
        resumed = checkpoint is not None and os.path.exists(checkpoint)
        if resumed:
            self.load_checkpoint(checkpoint)  # type: ignore[arg-type]
        group = self._group = ProcessGroup() if self.distributed else None
        seed = self.random_state if group is None else group.broadcast_seed(self.random_state)
        max_iter = check_loop_param("max_iter", self.max_iter)
        batch_size = check_loop_param("batch_size", self.batch_size)
        X, y, w, validation = self._checked_data(
            (X, y, sample_weight), (X_val, y_val), group, seed, batch_size
        )
        if X.ndim == 2:
            self.n_features_in_ = int(X.shape[1])
        done = len(self.train_losses_) if resumed else 0
        if not ((self.warm_start or resumed) and self._fitted):
            self._allocate(self.update_step_.initial)
            self.train_losses_ = []
            self.validation_losses_ = []
            self._rng = np.random.default_rng(seed)
        if self._rng is None:  # state loaded with set_state()
            self._rng = np.random.default_rng(seed)
        period = 1 if self.early_stopping else validation_period(self.validation_every, max_iter)
        stopper = _EarlyStopping(self.n_iter_no_change, self.tol) if self.early_stopping else None
        zero = np.zeros_like(self.update_step_.initial[LOSS_SUM])
        shows = self.verbose and (group is None or group.rank == 0)
        progress = EpochProgress(max_iter) if shows else None
        self.n_iter_ = 0
        if group is None:
            self._prepare_epochs(X, y, w, batch_size)
        try:
            for epoch in range(done, max_iter):
                snapshot = {name: value.numpy().copy() for name, value in self._resident.items()}
                self._resident[LOSS_SUM].update_inplace(zero)
                loss = self._run_epoch(X, y, w, batch_size, group)
                problem = self._loss_problem(loss)
                if problem:
                    self._restore(snapshot)
                    message = (
                        f"The loss became {loss:.6g} during epoch {len(self.train_losses_) + 1}"
                        f"{problem}; the weights and optimizer state are those of the "
                        "previous epoch."
                    )
                    if self.exc:
                        raise ConvergenceError(message)
                    warnings.warn(message, RuntimeWarning, stacklevel=2)
                    break
                self.train_losses_.append(loss)
                self.n_iter_ += 1
                held_out = None
                if validation is not None and period and (epoch + 1) % period == 0:
                    held_out = self._held_out_loss(validation, group)
                    self.validation_losses_.append(held_out)
                if progress is not None:
                    lr = self.learning_rate_.learning_rate_at(int(self._resident[STEP].numpy()))
                    progress.update(epoch + 1, loss, held_out, lr)
                if stopper is not None and stopper.done(held_out, self):  # type: ignore[arg-type]
                    break
                stop = bool(
                    callback is not None
                    and callback(epoch + 1, {"train": loss, "validation": held_out}, self)
                )
                if checkpoint is not None and (
                    stop or epoch + 1 == max_iter or (epoch + 1) % checkpoint_every == 0
                ):
                    self.save_checkpoint(checkpoint)
                if stop if group is None else group.any(stop):
                    break
        finally:
            if progress is not None:
                progress.close()
        if stopper is not None and stopper.best is not None:
            self._restore(stopper.best)
            self.best_loss_ = stopper.best_loss
        return self

    def _checked_data(
        self,
        train: tuple[Any, Any, Any],
        held_out: tuple[Any, Any],
        group: ProcessGroup | None,
        seed: int | None,
        batch_size: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[Any, ...] | None]:
        """``(X, y, w, validation)`` checked; in distributed training a failure on one
        rank stops every rank with that rank's message."""
        failure: BaseException | None = None
        try:
            X, y, w = self._check(*train)
            validation = None
            X_val, y_val = held_out
            if X_val is not None:
                if y_val is None:
                    raise ValueError("X_val is given without y_val.")
                validation = self._check(X_val, y_val, None, "X_val", "y_val")
            elif self.early_stopping:
                X, y, w, validation = self._hold_out(X, y, w, seed)
            if group is not None and len(X) < group.world_size:
                raise ValueError(
                    f"{len(X)} training rows for {group.world_size} ranks: every rank needs "
                    "at least one row; use fewer processes."
                )
            self._check_probabilities(X[:batch_size])
        except Exception as exc:
            if group is None:
                raise
            failure = exc
        if group is not None:
            group.raise_if_any_failed(failure)
            group.check_same(self._digest(), "the model and its initial weights")
        return X, y, w, validation

    def _run_epoch(
        self,
        X: np.ndarray,
        y: np.ndarray,
        w: np.ndarray | None,
        batch_size: int,
        group: ProcessGroup | None,
    ) -> float:
        """One pass over the rows (this rank's share of them); the mean batch loss."""
        order = self._rng.permutation(len(X)) if self.shuffle else None  # type: ignore[union-attr]
        if group is None:
            return self._run_rows(X, y, w, order, batch_size)
        order = shard(np.arange(len(X)) if order is None else order, *group.place)
        return self._run_steps(X, y, w, order, batch_size, group)

    def _prepare_epochs(
        self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None, batch_size: int
    ) -> None:
        """Called once per ``fit`` before the first epoch, with the training data
        (subclasses that bind the whole data once do it here)."""

    def _run_rows(
        self,
        X: np.ndarray,
        y: np.ndarray,
        w: np.ndarray | None,
        order: np.ndarray | None,
        batch_size: int,
    ) -> float:
        """One epoch over the rows in ``order`` (all rows in order when None); the mean
        batch loss. Here one run per batch; full training overrides it."""
        return self._run_steps(X, y, w, order, batch_size, None)

    def _run_steps(
        self,
        X: np.ndarray,
        y: np.ndarray,
        w: np.ndarray | None,
        order: np.ndarray | None,
        batch_size: int,
        group: ProcessGroup | None,
    ) -> float:
        """One run of the resident session per batch."""
        bindings, run_batch = self._bindings, self._run_batch  # the hot loop: no lookups
        batches = 0
        for X_batch, y_batch, w_batch in epoch_batches(X, y, w, order, batch_size):
            if group is None:
                run_batch(bindings[self._current], X_batch, y_batch, w_batch)
            else:
                self._run_batch_distributed(group, X_batch, y_batch, w_batch)
            self._current = 1 - self._current
            batches += 1
        return float(self._resident[LOSS_SUM].numpy()) / batches

    def _hold_out(
        self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None, seed: int | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, tuple[Any, ...]]:
        """Split ``validation_fraction`` of the rows off for early stopping (seeded by
        ``random_state``, as scikit-learn's MLP does)."""
        n_val = int(round(self.validation_fraction * len(X)))
        if n_val < 1 or n_val >= len(X):
            raise ValueError(
                f"early_stopping holds out validation_fraction={self.validation_fraction} of "
                f"{len(X)} rows, which leaves {n_val} rows to validate on: pass more data, "
                "another fraction, or X_val and y_val."
            )
        order = np.random.default_rng(seed).permutation(len(X))
        val, train = order[:n_val], order[n_val:]
        held = (X[val], y[val], None if w is None else w[val])
        return X[train], y[train], None if w is None else w[train], held

    # -- the update-step path: gradients, (all-reduce), update ------------------------------

    @abstractmethod
    def _gradients(self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> tuple[Any, dict]:
        """``(loss, {weight: gradient})`` of one batch as OrtValues (weights unchanged)."""

    def _apply_update(self, binding: Any, loss: Any, grads: Mapping[str, Any]) -> None:
        """Run the update step on given gradients and loss (binding what changed)."""
        gradients = [grads[name]._ortvalue for name in self._weight_names]
        self._run_update(binding, loss, self._grad_names, gradients)

    def _run_update(
        self, binding: Any, loss: Any, inputs: Sequence[str], gradients: Sequence[Any]
    ) -> None:
        """Run the update step on the gradients (C OrtValues) bound to ``inputs``."""
        # gradients are new tensors every batch: bound without the cache's check
        bind = binding._iobinding.bind_ortvalue_input
        for name, gradient in zip(inputs, gradients):
            bind(name, gradient)
        self._update_caches[self._current].bind(LOSS, loss)
        self._resident_session.run_with_iobinding(binding)

    def _run_batch_distributed(
        self, group: ProcessGroup, X: np.ndarray, y: np.ndarray, w: np.ndarray | None
    ) -> None:
        """Local gradients, one all-reduce of them (see :mod:`graphkit_train.distributed`),
        the same update on every rank."""
        from graphkit_train.torch_module import _to_ortvalue, _to_tensor

        loss, grads = self._gradients(X, y, w)
        names = self.update_step_.weights
        weight = len(X) if w is None else float(w.sum())
        mean = self.loss_ is None or self.loss_.reduction != "sum"
        tensors = [_to_tensor(grads[n]) for n in names]  # DLPack views, as OnnxModule's
        reduced = group.average(tensors, _to_tensor(loss), weight, mean)
        values = [backend.python_ortvalue(_to_ortvalue(t)) for t in reduced]
        for value, tensor in zip(values, reduced):
            value._graphkit_owner = tensor  # the OrtValue borrows the tensor's memory
        self._apply_update(self._bindings[self._current], values[-1], dict(zip(names, values[:-1])))

    def _held_out_loss(self, validation: tuple[Any, ...], group: ProcessGroup | None) -> float:
        """The held-out loss; in distributed training each rank scores its share of the
        rows and the shares are averaged by their weight."""
        if group is None:
            return self._loss(*validation)
        X, y, w = validation
        rows = np.array_split(np.arange(len(X)), group.world_size)[group.rank]
        weight = float(len(rows) if w is None else w[rows].sum())
        value = self._loss(X[rows], y[rows], None if w is None else w[rows]) if weight else 0.0
        return group.weighted_mean(value, weight)

    def _digest(self) -> str:
        """A hash of the model and the initial weights (every rank must hold the same)."""
        model = load_model(self.model_onnx).SerializeToString()
        initial = self.update_step_.initial
        return digest(model, *[initial[name] for name in self.update_step_.weights])

    def _loss_problem(self, loss: float) -> str:
        """Why an epoch's loss cannot be right ("" when it can)."""
        if not np.isfinite(loss):
            return ". Lower the learning rate or scale the features"
        resolved = self.loss_
        if loss < 0 and resolved is not None and not resolved.is_custom:
            return (
                f", below zero, which {resolved.name!r} cannot be: the model's outputs left the "
                "range the loss takes (probabilities outside [0, 1]). Check weights_to_train_ "
                "for a constant being trained"
            )
        return ""

    def _check_probabilities(self, X: np.ndarray) -> None:
        """A log loss on probabilities refuses outputs that are not probabilities (logits
        or scores would be clipped at eps silently); checked on one batch."""
        resolved = self.loss_
        if resolved is None or resolved.prediction != "probabilities" or not len(X):
            return
        output = self._probe(X)
        low, high = float(output.min()), float(output.max())
        if low < -1e-6 or high > 1 + 1e-6:
            raise ValueError(
                f"The loss 'log' takes probabilities, but the model's output ranges from "
                f"{low:.4g} to {high:.4g}. For logits use 'cross_entropy'; for one raw score "
                "use 'sigmoid_log_loss'."
            )

    @abstractmethod
    def _run_batch(self, binding: Any, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> None:
        """One training step on a batch; ``binding`` reads the current resident set."""

    def _restore(self, values: Mapping[str, np.ndarray]) -> None:
        for name, value in values.items():
            self._resident[name].update_inplace(value)

    def _check(
        self, X: Any, y: Any, sample_weight: Any, x_name: str = "X", y_name: str = "y"
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        X = check_features(X, self._features_value, x_name, type(self).__name__)
        y = check_labels(y, self._label_value, len(X), y_name)
        if self._is_classifier() and self.loss_ is not None:
            check_class_labels(y, self._n_classes(), not self.loss_.multiclass, y_name)
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
        """Predictions with the trained weights.

        A regression graph returns the output the loss is computed on (1-D for one
        column); a classification graph returns class labels in ``classes_`` (argmax of
        the probabilities or logits; for one column, probability > 0.5 or score > 0).
        """
        self._build()
        return self._predict_checked(self._features(X))

    def _predict_checked(self, X: np.ndarray) -> np.ndarray:
        """``predict`` on features already checked by :meth:`_features`."""
        output = self._predict_outputs(X)
        if self._is_classifier() and self.loss_ is not None:
            return self.loss_.labels(output)
        return output[:, 0] if output.ndim == 2 and output.shape[1] == 1 else output

    def _features(self, X: Any, what: str = "X") -> np.ndarray:
        """Checked features for a fitted trainer (NotFittedError comes first)."""
        if not self._fitted:
            raise not_fitted(
                f"This {type(self).__name__} is not fitted yet: call fit() or set_state() first."
            )
        X = check_features(X, self._features_value, what, type(self).__name__)
        fitted_width = getattr(self, "n_features_in_", None)
        if X.ndim == 2 and fitted_width is not None and X.shape[1] != fitted_width:
            raise ShapeError(
                f"{what} has {X.shape[1]} features, but {type(self).__name__} is expecting "
                f"{fitted_width} features as input (the number it was fitted with)."
            )
        return X

    @property
    def predict_proba(self) -> Callable[[Any], np.ndarray]:
        """``predict_proba(X)``: class probabilities (N, n_classes), for classification
        graphs only (a regression graph has no such attribute, as in scikit-learn).

        The loss says how (:meth:`graphkit.losses.Loss.probabilities`): the output itself
        for ``log``, its softmax for ``cross_entropy``, ``[1 - sigmoid(s), sigmoid(s)]``
        for ``sigmoid_log_loss``.
        """
        if not (self._is_classifier() and self.loss_ is not None and self.loss_.prediction):
            raise AttributeError(
                f"predict_proba: the loss of this {type(self).__name__} gives no class "
                "probabilities (a regression loss, or a custom one)."
            )
        return self._predict_proba

    def _predict_proba(self, X: Any) -> np.ndarray:
        self._build()
        return self.loss_.probabilities(self._predict_outputs(self._features(X)))  # type: ignore[union-attr]

    @property
    def classes_(self) -> np.ndarray:
        """The class labels ``0 .. n_classes - 1`` of a classification graph."""
        if not self._is_classifier() or not self._fitted:
            raise AttributeError("classes_ exists once a classification graph is fitted.")
        return np.arange(self._n_classes())

    def _n_classes(self) -> int:
        """Columns of the prediction (2 for one probability or score column)."""
        if self.loss_ is None or not self.loss_.multiclass:
            return 2
        columns = self._prediction_shape[1] if len(self._prediction_shape) == 2 else None
        if isinstance(columns, int):
            return columns
        if self._probed_classes is None:  # a dynamic class axis: one forward, once per build
            probe = np.zeros((1, *self._features_shape()), dtype=self._features_dtype())
            self._probed_classes = int(self._probe(probe).shape[1])
        return self._probed_classes

    def _probe(self, X: np.ndarray) -> np.ndarray:
        """The prediction with the current weights, or the initial ones before ``fit``
        (allocated for this call only: a failed check leaves no state behind)."""
        if self._fitted:
            return self._predict_outputs(X)
        self._allocate(self.update_step_.initial)
        try:
            return self._predict_outputs(X)
        finally:
            self._buffers = None

    def _features_shape(self) -> tuple[int, ...]:
        dims = [d.dim_value for d in self._features_value.type.tensor_type.shape.dim]
        return tuple(dims[1:])

    def _features_dtype(self) -> np.dtype:
        elem = self._features_value.type.tensor_type.elem_type
        return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """scikit-learn's score: the coefficient of determination R^2 for a regression
        graph (averaged over outputs), the accuracy for a classification graph; weighted
        by ``sample_weight``. The loss itself is :meth:`compute_loss`."""
        self._build()
        X = self._features(X)  # NotFittedError, and the feature count fitted with
        y = np.asarray(y)
        if len(y) != len(X):
            raise ShapeError(f"X has {len(X)} rows but y has {len(y)}; they must match.")
        w = None if sample_weight is None else check_sample_weight(sample_weight, len(X), float)
        prediction = self._predict_checked(X)
        if self._is_classifier():
            return float(np.average(prediction.reshape(-1) == y.reshape(-1), weights=w))
        return _r2(y.reshape(len(y), -1), prediction.reshape(len(y), -1), w)

    def compute_loss(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """The training loss on ``(X, y)`` with the current weights (lower is better)."""
        self._build()
        return self._loss(*self._check(self._features(X), y, sample_weight))

    def get_trained_onnx(
        self, model: onnx.ModelProto | None = None, ema: bool = False
    ) -> onnx.ModelProto:
        """The prediction graph (or ``model``, e.g. the original one) with the trained
        weights, or with their moving average when ``ema`` (the optimizer's chain must
        end with :func:`graphkit.transforms.ema`)."""
        self._build()
        state = self.get_state()
        if ema:
            weights = ema_weights(state)
        else:
            weights = {n: v for n, v in state.items() if n in self.update_step_.weights}
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
            is the prediction graph with the trained weights. In distributed training
            only rank 0 writes files (the other ranks return ``{}``).
        """
        self._build()
        group = getattr(self, "_group", None)
        if group is not None and group.rank != 0 and export is not bytes:
            return {}
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
    loss_: Loss | None
    """The loss the trainer minimizes, resolved for the prediction (None when unknown:
    a custom loss or a graph not made by ``add_loss_output``)."""
    _prediction_shape: tuple[int | str, ...]

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


def _r2(y: np.ndarray, prediction: np.ndarray, w: np.ndarray | None) -> float:
    """1 - sum w (y - p)^2 / sum w (y - mean_w y)^2 per output, averaged over outputs."""
    y, prediction = y.astype(np.float64), prediction.astype(np.float64)
    weights = np.ones(len(y)) if w is None else w.astype(np.float64)
    mean = np.average(y, axis=0, weights=weights)
    residual = (weights[:, None] * (y - prediction) ** 2).sum(axis=0)
    total = (weights[:, None] * (y - mean) ** 2).sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        scores = np.where(total > 0, 1 - residual / total, np.where(residual > 0, 0.0, 1.0))
    return float(scores.mean())


class _EarlyStopping:
    """Stop when the held-out loss has not improved by ``tol`` for ``patience`` epochs,
    keeping the best weights (scikit-learn's ``n_iter_no_change`` / ``tol``)."""

    def __init__(self, patience: int, tol: float) -> None:
        self.patience, self.tol = patience, tol
        self.best: dict[str, np.ndarray] | None = None
        self.best_loss = np.inf
        self.waited = 0

    def done(self, loss: float, trainer: BaseTrainer) -> bool:
        if loss < self.best_loss - self.tol:
            self.waited = 0
        else:
            self.waited += 1
        if loss < self.best_loss:
            self.best_loss = loss
            self.best = {name: v.numpy().copy() for name, v in trainer._resident.items()}
        return self.waited >= self.patience
