"""The estimator protocol of a trainer: predict, predict_proba, classes_, score.

What scikit-learn asks of a fitted estimator, read from the loss the trainer minimizes
(:class:`graphkit.losses.Loss` says whether it takes class labels and how its output
becomes labels or probabilities) and computed with the current weights.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from graphkit.errors import ShapeError, not_fitted
from graphkit.training.batches import NamedRows, Rows
from graphkit_train.trainers.heads import Head
from graphkit_train.trainers.params import (
    check_feature_names,
    check_inputs,
    check_sample_weight,
    feature_names,
)

if TYPE_CHECKING:
    from graphkit.losses import Loss
    from graphkit.update_step import UpdateStep


class EstimatorMixin:
    """``predict``, ``predict_proba``, ``classes_``, ``score``, ``compute_loss``.

    The trainer provides ``_build``, ``_fitted``, ``_allocate``, ``_predict_outputs``,
    ``_loss``, ``_check``, ``_is_classifier``, ``loss_``, ``_input_values`` and
    ``_prediction_shape``.

    Data frames follow scikit-learn's convention: ``fit`` on a frame whose column names
    are all strings records them as ``feature_names_in_`` (``n_features_in_`` is the
    column count); ``predict``, ``predict_proba``, ``score``, ``compute_loss`` and a
    warm-started ``fit`` refuse a frame whose columns are not those names in that order
    (a ValueError listing the unexpected and the missing names, or saying the order
    differs). They are not reordered by name: the graph reads columns by position, and
    scikit-learn raises too. Select them as fitted: ``X[trainer.feature_names_in_]``.
    """

    # what the trainer provides, declared for the type checker (none exists at run time)
    loss_: Loss | None
    update_step_: UpdateStep
    _heads: list[Head] | None
    _input_values: list[onnx.ValueInfoProto]
    _prediction_shape: tuple[int | str, ...]
    _probed_classes: int | None
    _buffers: list[dict[str, Any]] | None

    if TYPE_CHECKING:

        @property
        def _fitted(self) -> bool: ...

        def _build(self) -> None: ...

        def _allocate(self, values: Mapping[str, np.ndarray]) -> None: ...

        def _predict_outputs(self, X: Rows) -> np.ndarray: ...

        def _loss(self, X: Rows, y: np.ndarray, w: np.ndarray | None) -> float: ...

        def _check(
            self, X: Any, y: Any, sample_weight: Any, x_name: str = "X", y_name: str = "y"
        ) -> tuple[Rows, np.ndarray, np.ndarray | None]: ...

        def _is_classifier(self) -> bool: ...

    def _fit_feature_names(self, X: Any, X_val: Any = None) -> None:
        """At ``fit``: record the column names of a data frame ``X`` as
        ``feature_names_in_`` (forget them for data without names), or, for a warm start
        of a fitted trainer, check them against those recorded; check held-out ``X_val``
        against them too (when it is a frame)."""
        owner = type(self).__name__
        if getattr(self, "warm_start", False) and self._fitted:
            check_feature_names(getattr(self, "feature_names_in_", None), X, owner, "X", 5)
        else:
            names = feature_names(X)
            if names is not None:
                self.feature_names_in_ = names
            else:
                self.__dict__.pop("feature_names_in_", None)
        if X_val is not None and feature_names(X_val) is not None:
            fitted = getattr(self, "feature_names_in_", None)
            check_feature_names(fitted, X_val, owner, "X_val", 5)

    def predict(self, X: Any) -> np.ndarray | dict[str, np.ndarray]:
        """Predictions with the trained weights, for ``X`` as ``fit`` takes it (one
        array, or ``{input name: array}`` for a model with several inputs).

        A regression graph returns the output the loss is computed on (1-D for one
        column); a classification graph returns class labels in ``classes_`` (argmax of
        the probabilities or logits; for one column, probability > 0.5 or score > 0).
        A graph with a loss per output returns ``{output name: prediction}`` for every
        output with a loss, each as above (the class labels of a classification head).

        A data frame must have the columns ``fit`` saw, in the same order
        (``feature_names_in_``): see the class docstring.
        """
        self._build()
        return self._predict_checked(self._features(X))

    def _predict_checked(self, X: Rows) -> Any:
        """``predict`` on features already checked by :meth:`_features`."""
        if self._heads is not None:
            outputs = self._predict_heads(X)
            return {h.output: h.prediction(outputs[h.output]) for h in self._heads}
        output = self._predict_outputs(X)
        if self._is_classifier() and self.loss_ is not None:
            return self.loss_.labels(output)
        return output[:, 0] if output.ndim == 2 and output.shape[1] == 1 else output

    def _features(self, X: Any, what: str = "X") -> Rows:
        """Checked features for a fitted trainer (NotFittedError comes first): one array,
        or :class:`~graphkit.training.batches.NamedRows` for a model with several inputs
        (given as ``{input name: array}``)."""
        if not self._fitted:
            raise not_fitted(
                f"This {type(self).__name__} is not fitted yet: call fit() or set_state() first."
            )
        # before the width: a frame missing columns is told which (as in scikit-learn)
        fitted = getattr(self, "feature_names_in_", None)
        check_feature_names(fitted, X, type(self).__name__, what)
        X = check_inputs(X, self._input_values, what, type(self).__name__)
        if isinstance(X, NamedRows):
            return X
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
        for ``sigmoid_log_loss``. A graph with a loss per output returns ``{output name:
        probabilities}`` for its classification heads.
        """
        if self._heads is not None:
            if not any(h.classifies and h.loss.prediction for h in self._heads):  # type: ignore[union-attr]
                raise AttributeError(
                    f"predict_proba: no output of this {type(self).__name__} has a "
                    "classification loss giving class probabilities."
                )
            return self._predict_proba
        if not (self._is_classifier() and self.loss_ is not None and self.loss_.prediction):
            raise AttributeError(
                f"predict_proba: the loss of this {type(self).__name__} gives no class "
                "probabilities (a regression loss, or a custom one)."
            )
        return self._predict_proba

    def _predict_proba(self, X: Any) -> Any:
        self._build()
        if self._heads is not None:
            outputs = self._predict_heads(self._features(X))
            return {
                h.output: h.loss.probabilities(outputs[h.output])  # type: ignore[union-attr]
                for h in self._heads
                if h.classifies and h.loss.prediction  # type: ignore[union-attr]
            }
        return self.loss_.probabilities(self._predict_outputs(self._features(X)))  # type: ignore[union-attr]

    @property
    def classes_(self) -> np.ndarray:
        """The class labels ``0 .. n_classes - 1`` of a classification graph."""
        if not self._is_classifier() or not self._fitted:
            raise AttributeError("classes_ exists once a classification graph is fitted.")
        return np.arange(self._n_classes())

    def _n_classes(self, head: Head | None = None) -> int:
        """Classes on the prediction's last axis: its columns (2 for one probability or
        score column), the vocabulary of (N, T, V) token logits; of the output of
        ``head`` for a graph with a loss per output."""
        loss = self.loss_ if head is None else head.loss
        if loss is None or not loss.multiclass:
            return 2
        shape = self._prediction_shape if head is None else head.prediction_shape
        columns = shape[-1] if len(shape) >= 2 else None
        if isinstance(columns, int):
            return columns
        # a dynamic class axis: one forward, once per build
        if head is not None:
            return int(self._probe(self._zero_row(), every_output=True)[head.output].shape[-1])
        if self._probed_classes is None:
            self._probed_classes = int(self._probe(self._zero_row()).shape[-1])
        return self._probed_classes

    def _probe(self, X: Rows, every_output: bool = False) -> Any:
        """The prediction with the current weights, or the initial ones before ``fit``
        (allocated for this call only: a failed check leaves no state behind); with
        ``every_output``, ``{output: value}`` of a graph with a loss per output."""
        predict = self._predict_heads if every_output else self._predict_outputs
        if self._fitted:
            return predict(X)
        self._allocate(self.update_step_.initial)
        try:
            return predict(X)
        finally:
            self._buffers = None

    def _predict_heads(self, X: Rows) -> dict[str, np.ndarray]:
        """``{output: value}`` of every output with a loss (graphs with a loss per output)."""
        raise TypeError(f"{type(self).__name__} trains one loss on one output.")

    def _zero_row(self) -> Rows:
        """One row of zeros for every input (its declared dims; 0 where unknown)."""
        rows = {}
        for value in self._input_values:
            dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
            elem = value.type.tensor_type.elem_type
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
            rows[value.name] = np.zeros((1, *dims[1:]), dtype=dtype)
        return next(iter(rows.values())) if len(rows) == 1 else NamedRows(rows)

    def score(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """scikit-learn's score: the coefficient of determination R^2 for a regression
        graph (averaged over outputs), the accuracy for a classification graph (for
        ``token_cross_entropy``, over the tokens not labelled ``ignore_index``); weighted
        by ``sample_weight``. The loss itself is :meth:`compute_loss`.

        A graph with a loss per output has no single score (an R^2 and an accuracy do not
        add up): it raises a ValueError; score each head's ``predict(X)[output]`` with
        its own metric, or compare :meth:`compute_loss` (the weighted total loss)."""
        self._build()
        if self._heads is not None:
            outputs = [h.output for h in self._heads]
            raise ValueError(
                f"score gives one number for one loss; this {type(self).__name__} has a loss "
                f"per output {outputs}. Score each head on predict(X)[output] with its own "
                "metric (sklearn.metrics.r2_score for a regression head, accuracy_score for "
                "a classification head), or use compute_loss(X, y) for the weighted total "
                "loss (lower is better)."
            )
        X = self._features(X)  # NotFittedError, and the feature count fitted with
        y = np.asarray(y)
        if len(y) != len(X):
            raise ShapeError(f"X has {len(X)} rows but y has {len(y)}; they must match.")
        w = None if sample_weight is None else check_sample_weight(sample_weight, len(X), float)
        prediction = self._predict_checked(X)
        if self._is_classifier():
            if self.loss_ is not None and self.loss_.token_labels:
                return _token_accuracy(prediction, y, w, self.loss_.params["ignore_index"])
            return float(np.average(prediction.reshape(-1) == y.reshape(-1), weights=w))
        return _r2(y.reshape(len(y), -1), prediction.reshape(len(y), -1), w)

    def compute_loss(self, X: Any, y: Any, sample_weight: Any = None) -> float:
        """The training loss on ``(X, y)`` with the current weights (lower is better): for
        a loss per output, ``y = {output name: labels}`` and the weighted total."""
        self._build()
        return self._loss(*self._check(self._features(X), y, sample_weight))


def _token_accuracy(
    prediction: np.ndarray, y: np.ndarray, w: np.ndarray | None, ignore_index: int
) -> float:
    """sum_i w_i sum_t m_it [p_it = y_it] / sum_i w_i sum_t m_it, m_it = [y_it != ignore_index]:
    the accuracy over the counted tokens (0 when none is)."""
    y = y.reshape(prediction.shape)
    counted = (y != ignore_index).reshape(len(y), -1)
    right = ((prediction == y).reshape(len(y), -1) & counted).sum(axis=1)
    weights = np.ones(len(y)) if w is None else w.astype(np.float64)
    total = float(weights @ counted.sum(axis=1))
    return float(weights @ right) / total if total else 0.0


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
