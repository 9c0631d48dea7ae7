"""Losses: onnxscript functions of (prediction, label[, weight]) and their gradients.

Each built-in loss is a pair of small scripted kernels, registered by name:

* ``<name>_loss(prediction, label) -> l``: the loss of each sample, shape ``(N,)``;
* ``<name>_grad(prediction, label) -> g``: d l_i / d prediction_i, shaped like the prediction.

A :class:`Loss` composes them with a reduction (``"mean"``, ``"sum"`` or ``"none"``,
optionally with sample weights) into ONNX models::

    loss = graphkit.losses.get("huber", delta=1.0, reduction="mean")
    loss(prediction, label)                  # runs the compiled graph
    loss.value_and_grad(prediction, label)   # (loss, d loss / d prediction)
    loss.gradient_model(numpy.float64)       # the ONNX model doing it

A user-written loss (:func:`custom_loss`) gets its gradient from the backend's gradient
source instead (:func:`graphkit.gradient_model`).

Labels: regression losses take float labels shaped like the prediction, ``(N, k)`` for
a model predicting k values per sample (for one value, ``(N,)`` and ``(N, 1)`` are
interchangeable); classification losses take int64 class indices ``(N,)``;
``token_cross_entropy`` takes int64 labels shaped like the prediction without its last
(class) axis, ``(N, T)`` for a language model's ``(N, T, V)`` logits, and composes its
own functions (:class:`LossFunctions`: its mean divides by the counted tokens).

Reductions over several values per sample: a regression loss's per-sample value is the
sum over the sample's k values, ``l_i = sum_j f(p_ij - y_ij)``. ``"sum"`` adds every
``w_i l_i``, so it is the sum over all N k values, as ``torch.nn.MSELoss(reduction="sum")``;
``"mean"`` divides that by k too, ``sum_i w_i l_i / (k sum_i w_i)``: the mean over all
N k values, as ``torch.nn.MSELoss()`` and scikit-learn's ``mean_squared_error`` (for
k = 1, nothing changes: the mean over the samples); ``"none"`` returns each ``w_i l_i``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, no_type_check

import numpy as np
import onnx
import onnxscript

from graphkit._graph import Dim, Shape, compile_function, float_dtype
from graphkit._reduce import REDUCTIONS, ones_like, reduce_sum, scale_rows, total_weight
from graphkit.dsl import FLOAT, INT64, f64, op, script
from graphkit.engine.ort_engine import Runner
from graphkit.errors import DTypeError, ShapeError
from graphkit.gradient import gradient_model
from graphkit.registry import Registry

REGRESSION = "regression"
CLASSIFICATION = "classification"


# -- regression kernels: functions of d = prediction - label ------------------------------


def _regression_kernels(elementwise: Any, elementwise_grad: Any) -> tuple[Any, Any]:
    """Per-sample kernels from an elementwise loss f(d) and its derivative f'(d)."""

    @script()
    @no_type_check
    def per_sample_loss(prediction: FLOAT, label: FLOAT) -> FLOAT:
        # l_i = sum_j f(prediction_ij - label_ij)
        d = prediction - op.Reshape(label, op.Shape(prediction))
        rows = op.Reshape(elementwise(d), op.Constant(value_ints=[0, -1]))
        return op.ReduceSum(rows, op.Constant(value_ints=[1]), keepdims=0)

    @script()
    @no_type_check
    def per_sample_grad(prediction: FLOAT, label: FLOAT) -> FLOAT:
        # g_ij = f'(prediction_ij - label_ij)
        d = prediction - op.Reshape(label, op.Shape(prediction))
        return elementwise_grad(d)

    return per_sample_loss, per_sample_grad


@script()
@no_type_check
def squared_error(d: FLOAT) -> FLOAT:
    """f(d) = d^2"""
    return d * d


@script()
@no_type_check
def squared_error_derivative(d: FLOAT) -> FLOAT:
    """f'(d) = 2 d"""
    return op.CastLike(2.0, d) * d


@script()
@no_type_check
def absolute_error(d: FLOAT) -> FLOAT:
    """f(d) = |d|"""
    return op.Abs(d)


@script()
@no_type_check
def absolute_error_derivative(d: FLOAT) -> FLOAT:
    """f'(d) = sign(d), 0 at d = 0"""
    return op.Sign(d)


def elastic_formula(l1_weight: float, l2_weight: float) -> tuple[Any, Any]:
    """``(f, f')``: the elastic formula and its derivative, elementwise (the elastic loss
    applies it to ``prediction - label``, the elastic penalty to each weight)."""
    a = np.array(l1_weight, dtype=np.float64)
    b = np.array(l2_weight, dtype=np.float64)
    two_b = np.array(2.0 * l2_weight, dtype=np.float64)  # a 0-d array: eager mode keeps float64

    @script()
    @no_type_check
    def elastic(d: FLOAT) -> FLOAT:
        """f(d) = l1_weight |d| + l2_weight d^2"""
        return op.CastLike(a, d) * op.Abs(d) + op.CastLike(b, d) * d * d

    @script()
    @no_type_check
    def elastic_derivative(d: FLOAT) -> FLOAT:
        """f'(d) = l1_weight sign(d) + 2 l2_weight d"""
        return op.CastLike(a, d) * op.Sign(d) + op.CastLike(two_b, d) * d

    return elastic, elastic_derivative


def _huber(delta: float) -> tuple[Any, Any]:
    c = np.array(delta, dtype=np.float64)

    @script()
    @no_type_check
    def huber(d: FLOAT) -> FLOAT:
        """f(d) = d^2 / 2 if |d| <= delta else delta (|d| - delta / 2)"""
        a = op.Abs(d)
        delta_ = op.CastLike(c, d)
        half = op.CastLike(0.5, d)
        return op.Where(a <= delta_, half * d * d, delta_ * (a - half * delta_))

    @script()
    @no_type_check
    def huber_derivative(d: FLOAT) -> FLOAT:
        """f'(d) = clip(d, -delta, delta)"""
        delta_ = op.CastLike(c, d)
        return op.Clip(d, op.Neg(delta_), delta_)

    return huber, huber_derivative


# -- regression means over several values per sample -------------------------------------


@script()
@no_type_check
def values_per_sample(prediction: FLOAT) -> FLOAT:
    """k = size(prediction) / rows: the values each sample predicts, read at run time."""
    rows = op.Squeeze(op.Shape(prediction, start=0, end=1))
    return op.CastLike(op.Size(prediction), prediction) / op.CastLike(rows, prediction)


@functools.cache
def _constant_values_per_sample(k: int) -> onnxscript.OnnxFunction:
    """k, known when the loss is built: the values each sample predicts."""
    c = np.array(float(k), dtype=np.float64)  # a 0-d array: eager mode keeps float64

    @script()
    @no_type_check
    def constant_values_per_sample(prediction: FLOAT) -> FLOAT:
        return op.CastLike(c, prediction)

    return constant_values_per_sample


def values_per_sample_of(prediction_shape: Sequence[Dim] | None) -> int | None:
    """The values each sample predicts: the product of the prediction's dims after the
    first (1 for a rank-1 prediction); None when one of them is not known."""
    if prediction_shape is None:
        return None
    per_sample = tuple(prediction_shape)[1:]
    if not all(isinstance(d, int) for d in per_sample):
        return None
    return math.prod(per_sample)  # type: ignore[arg-type]


# -- classification kernels ---------------------------------------------------------------


@script()
@no_type_check
def one_hot(label: INT64, prediction: FLOAT) -> FLOAT:
    """onehot_ik = 1 if label_i == k else 0, typed like the prediction (N, K).

    (ONNX OneHot has no float64 kernel in onnxruntime: Equal against Range instead.)
    """
    classes = op.Range(
        op.Constant(value_int=0),
        op.Squeeze(op.Shape(prediction, start=1, end=2)),
        op.Constant(value_int=1),
    )
    column = op.Reshape(label, op.Constant(value_ints=[-1, 1]))
    return op.CastLike(op.Equal(column, classes), prediction)


@script()
@no_type_check
def sigmoid_log_loss_loss(prediction: FLOAT, label: INT64) -> FLOAT:
    """l = log(1 + exp(s)) - y s with s the raw score, y in {0, 1}.

    Written max(s, 0) - y s + log(1 + exp(-|s|)): no exp overflows, no log of 0.
    """
    s = op.Reshape(prediction, op.Constant(value_ints=[-1]))
    y = op.CastLike(op.Reshape(label, op.Constant(value_ints=[-1])), s)
    zero = op.CastLike(0.0, s)
    one = op.CastLike(1.0, s)
    return op.Max(s, zero) - y * s + op.Log(one + op.Exp(op.Neg(op.Abs(s))))


@script()
@no_type_check
def sigmoid_log_loss_grad(prediction: FLOAT, label: INT64) -> FLOAT:
    """g = sigmoid(s) - y"""
    y = op.CastLike(op.Reshape(label, op.Shape(prediction)), prediction)
    return op.Sigmoid(prediction) - y


@script()
@no_type_check
def cross_entropy_loss(prediction: FLOAT, label: INT64) -> FLOAT:
    """l = -log softmax(z)_y = logsumexp(z) - z_y, z the logits (N, K)."""
    onehot = one_hot(label, prediction)
    log_p = op.LogSoftmax(prediction, axis=1)
    return op.Neg(op.ReduceSum(onehot * log_p, op.Constant(value_ints=[1]), keepdims=0))


@script()
@no_type_check
def cross_entropy_grad(prediction: FLOAT, label: INT64) -> FLOAT:
    """g = softmax(z) - onehot(y)"""
    onehot = one_hot(label, prediction)
    return op.Softmax(prediction, axis=1) - onehot


def _log_loss(eps: float) -> tuple[Any, Any]:
    e = np.array(eps, dtype=np.float64)

    @script()
    @no_type_check
    def log_loss_loss(prediction: FLOAT, label: INT64) -> FLOAT:
        """l = -log max(p_y, eps), p the probabilities (N, K)."""
        onehot = one_hot(label, prediction)
        p = op.Max(prediction, op.CastLike(e, prediction))
        return op.Neg(op.ReduceSum(onehot * op.Log(p), op.Constant(value_ints=[1]), keepdims=0))

    @script()
    @no_type_check
    def log_loss_grad(prediction: FLOAT, label: INT64) -> FLOAT:
        """g = -onehot(y) / p where p >= eps, 0 where the probability is clipped"""
        onehot = one_hot(label, prediction)
        eps_ = op.CastLike(e, prediction)
        p = op.Max(prediction, eps_)
        zero = op.CastLike(0.0, prediction)
        return op.Where(prediction >= eps_, op.Neg(onehot) / p, zero)

    return log_loss_loss, log_loss_grad


def _binary_log_loss(eps: float) -> tuple[Any, Any]:
    e = np.array(eps, dtype=np.float64)

    @script()
    @no_type_check
    def binary_log_loss_loss(prediction: FLOAT, label: INT64) -> FLOAT:
        """l = -y log max(p, eps) - (1 - y) log max(1 - p, eps), p = P(y = 1)."""
        p = op.Reshape(prediction, op.Constant(value_ints=[-1]))
        y = op.CastLike(op.Reshape(label, op.Constant(value_ints=[-1])), p)
        eps_ = op.CastLike(e, p)
        one = op.CastLike(1.0, p)
        return op.Neg(y * op.Log(op.Max(p, eps_)) + (one - y) * op.Log(op.Max(one - p, eps_)))

    @script()
    @no_type_check
    def binary_log_loss_grad(prediction: FLOAT, label: INT64) -> FLOAT:
        """g = -y / p + (1 - y) / (1 - p), each term 0 where its probability is clipped"""
        y = op.CastLike(op.Reshape(label, op.Shape(prediction)), prediction)
        eps_ = op.CastLike(e, prediction)
        one = op.CastLike(1.0, prediction)
        zero = op.CastLike(0.0, prediction)
        q = one - prediction
        pos = op.Where(prediction >= eps_, y / op.Max(prediction, eps_), zero)
        neg = op.Where(q >= eps_, (one - y) / op.Max(q, eps_), zero)
        return neg - pos

    return binary_log_loss_loss, binary_log_loss_grad


# -- token kernels: classes on the prediction's last axis ----------------------------------


@script()
@no_type_check
def last_axis_one_hot(label: INT64, prediction: FLOAT) -> FLOAT:
    """onehot_tk = 1 if label_t == k else 0, k on the prediction's last axis, typed like
    the prediction (label (N, d1, ...), prediction (N, d1, ..., V)); a label outside
    [0, V - 1] (an ignored one) gives a row of zeros. Equal against Range, as
    :func:`one_hot`."""
    classes = op.Range(
        op.Constant(value_int=0),
        op.Squeeze(op.Shape(prediction, start=-1)),
        op.Constant(value_int=1),
    )
    return op.CastLike(
        op.Equal(op.Unsqueeze(label, op.Constant(value_ints=[-1])), classes), prediction
    )


@script()
@no_type_check
def row_sums(x: FLOAT) -> FLOAT:
    """s_i = sum of every value of row i of x (any rank): shape (N,)."""
    rows = op.Reshape(x, op.Constant(value_ints=[0, -1]))
    return op.ReduceSum(rows, op.Constant(value_ints=[1]), keepdims=0)


def _token_kernels(ignore_index: int, label_smoothing: float) -> tuple[Any, Any, Any]:
    """``(loss of each row, gradient of each token, counted tokens of each row)`` of the
    token cross-entropy with logits z (N, d1, ..., V) and labels y (N, d1, ...).

    A token t is counted when y_t != ignore_index (m_t = 1), else m_t = 0. Its target
    distribution is the label smoothed by eps: q_tk = m_t ((1 - eps) onehot(y_t)_k + eps / V),
    so its loss is -sum_k q_tk log p_tk = m_t ((1 - eps)(-log p_{t,y_t}) + eps mean_k(-log p_tk))
    with p_t = softmax(z_t), as ``torch.nn.functional.cross_entropy(label_smoothing=eps)``.
    """
    ignored = np.array(ignore_index, dtype=np.int64)
    eps = f64(label_smoothing)
    kept = f64(1.0 - label_smoothing)

    @script()
    @no_type_check
    def counted(label: INT64, prediction: FLOAT) -> FLOAT:
        """m_t = 1 if label_t != ignore_index else 0, typed like the prediction."""
        return op.CastLike(op.Not(op.Equal(label, ignored)), prediction)

    @script()
    @no_type_check
    def smoothed_targets(prediction: FLOAT, label: INT64) -> FLOAT:
        """q_tk = m_t ((1 - eps) onehot(y_t)_k + eps / V): 0 for an ignored token."""
        classes = op.CastLike(op.Shape(prediction, start=-1), prediction)
        onehot = last_axis_one_hot(label, prediction)
        q = op.CastLike(kept, prediction) * onehot + op.CastLike(eps, prediction) / classes
        return q * op.Unsqueeze(counted(label, prediction), op.Constant(value_ints=[-1]))

    @script()
    @no_type_check
    def token_rows_loss(prediction: FLOAT, label: INT64) -> FLOAT:
        """l_i = -sum_{t,k} q_tk log softmax(z_t)_k over the tokens t of row i."""
        log_p = op.LogSoftmax(prediction, axis=-1)
        return op.Neg(row_sums(smoothed_targets(prediction, label) * log_p))

    @script()
    @no_type_check
    def token_grad(prediction: FLOAT, label: INT64) -> FLOAT:
        """g_tk = d l_i / d z_tk = m_t softmax(z_t)_k - q_tk"""
        m = op.Unsqueeze(counted(label, prediction), op.Constant(value_ints=[-1]))
        return op.Softmax(prediction, axis=-1) * m - smoothed_targets(prediction, label)

    @script()
    @no_type_check
    def token_rows_count(prediction: FLOAT, label: INT64) -> FLOAT:
        """c_i = sum_t m_t: the counted tokens of row i."""
        return row_sums(counted(label, prediction))

    return token_rows_loss, token_grad, token_rows_count


# -- composing kernels into loss functions ------------------------------------------------


def _value_function(
    kernel: Any, reduce: Any, weighted: bool, divisor: Any = None
) -> onnxscript.OnnxFunction:
    """``(prediction, label[, weight]) -> reduce(kernel(...))``, divided by
    ``divisor(prediction)`` when given (a mean over every predicted value)."""
    if divisor is not None:
        return _divided_value_function(kernel, reduce, weighted, divisor)
    if weighted:

        @script()
        @no_type_check
        def loss(prediction: FLOAT, label: FLOAT, weight: FLOAT) -> FLOAT:
            return reduce(
                kernel(prediction, label), op.Reshape(weight, op.Constant(value_ints=[-1]))
            )

    else:

        @script()
        @no_type_check
        def loss(prediction: FLOAT, label: FLOAT) -> FLOAT:
            per_sample = kernel(prediction, label)
            return reduce(per_sample, ones_like(per_sample))

    return loss


def _divided_value_function(
    kernel: Any, reduce: Any, weighted: bool, divisor: Any
) -> onnxscript.OnnxFunction:
    if weighted:

        @script()
        @no_type_check
        def loss(prediction: FLOAT, label: FLOAT, weight: FLOAT) -> FLOAT:
            # loss = reduce(l, w) / k
            w = op.Reshape(weight, op.Constant(value_ints=[-1]))
            return reduce(kernel(prediction, label), w) / divisor(prediction)

    else:

        @script()
        @no_type_check
        def loss(prediction: FLOAT, label: FLOAT) -> FLOAT:
            per_sample = kernel(prediction, label)
            return reduce(per_sample, ones_like(per_sample)) / divisor(prediction)

    return loss


def _value_and_grad_function(
    kernel: Any, kernel_grad: Any, reduce: Any, scale: Any, weighted: bool, divisor: Any = None
) -> onnxscript.OnnxFunction:
    """``(prediction, label[, weight]) -> (loss, d loss / d prediction)``, both divided by
    ``divisor(prediction)`` when given (a mean over every predicted value)."""
    if divisor is not None:
        return _divided_value_and_grad_function(
            kernel, kernel_grad, reduce, scale, weighted, divisor
        )
    if weighted:

        @script()
        @no_type_check
        def loss_and_grad(prediction: FLOAT, label: FLOAT, weight: FLOAT) -> tuple[FLOAT, FLOAT]:
            w = op.Reshape(weight, op.Constant(value_ints=[-1]))
            loss = reduce(kernel(prediction, label), w)
            prediction_grad = scale(kernel_grad(prediction, label), w)
            return loss, prediction_grad

    else:

        @script()
        @no_type_check
        def loss_and_grad(prediction: FLOAT, label: FLOAT) -> tuple[FLOAT, FLOAT]:
            per_sample = kernel(prediction, label)
            w = ones_like(per_sample)
            loss = reduce(per_sample, w)
            prediction_grad = scale(kernel_grad(prediction, label), w)
            return loss, prediction_grad

    return loss_and_grad


def _divided_value_and_grad_function(
    kernel: Any, kernel_grad: Any, reduce: Any, scale: Any, weighted: bool, divisor: Any
) -> onnxscript.OnnxFunction:
    if weighted:

        @script()
        @no_type_check
        def loss_and_grad(prediction: FLOAT, label: FLOAT, weight: FLOAT) -> tuple[FLOAT, FLOAT]:
            # loss = reduce(l, w) / k, g = scale(dl/dp, w) / k
            w = op.Reshape(weight, op.Constant(value_ints=[-1]))
            k = divisor(prediction)
            loss = reduce(kernel(prediction, label), w) / k
            prediction_grad = scale(kernel_grad(prediction, label), w) / k
            return loss, prediction_grad

    else:

        @script()
        @no_type_check
        def loss_and_grad(prediction: FLOAT, label: FLOAT) -> tuple[FLOAT, FLOAT]:
            per_sample = kernel(prediction, label)
            w = ones_like(per_sample)
            k = divisor(prediction)
            loss = reduce(per_sample, w) / k
            prediction_grad = scale(kernel_grad(prediction, label), w) / k
            return loss, prediction_grad

    return loss_and_grad


# -- the token cross-entropy's functions: a mean over the counted tokens -----------------


def _token_mean_function(
    rows_loss: Any, rows_count: Any, weighted: bool
) -> onnxscript.OnnxFunction:
    """``(prediction, label[, weight]) -> sum_i w_i l_i / sum_i w_i c_i``: the mean over
    every counted token of the batch (0 when none is counted: :func:`total_weight`)."""
    if weighted:

        @script()
        @no_type_check
        def loss(prediction: FLOAT, label: INT64, weight: FLOAT) -> FLOAT:
            w = op.Reshape(weight, op.Constant(value_ints=[-1]))
            tokens = total_weight(w * rows_count(prediction, label))
            return reduce_sum(rows_loss(prediction, label), w) / tokens

    else:

        @script()
        @no_type_check
        def loss(prediction: FLOAT, label: INT64) -> FLOAT:
            tokens = total_weight(rows_count(prediction, label))
            return op.ReduceSum(rows_loss(prediction, label), keepdims=0) / tokens

    return loss


def _token_mean_and_grad_function(
    rows_loss: Any, token_grad: Any, rows_count: Any, weighted: bool
) -> onnxscript.OnnxFunction:
    """``(prediction, label[, weight]) -> (loss, g)``: the mean of
    :func:`_token_mean_function` and g_itk = w_i (m_it softmax(z_it)_k - q_itk) / sum_j w_j c_j."""
    if weighted:

        @script()
        @no_type_check
        def loss_and_grad(prediction: FLOAT, label: INT64, weight: FLOAT) -> tuple[FLOAT, FLOAT]:
            w = op.Reshape(weight, op.Constant(value_ints=[-1]))
            tokens = total_weight(w * rows_count(prediction, label))
            loss = reduce_sum(rows_loss(prediction, label), w) / tokens
            prediction_grad = scale_rows(token_grad(prediction, label), w) / tokens
            return loss, prediction_grad

    else:

        @script()
        @no_type_check
        def loss_and_grad(prediction: FLOAT, label: INT64) -> tuple[FLOAT, FLOAT]:
            tokens = total_weight(rows_count(prediction, label))
            loss = op.ReduceSum(rows_loss(prediction, label), keepdims=0) / tokens
            prediction_grad = token_grad(prediction, label) / tokens
            return loss, prediction_grad

    return loss_and_grad


def _token_functions(ignore_index: int, label_smoothing: float, reduction: str) -> LossFunctions:
    """The token cross-entropy's functions for ``reduction``: ``"mean"`` divides by the
    counted tokens (its own functions); ``"sum"`` and ``"none"`` reduce the rows' losses
    as every built-in loss does (:data:`REDUCTIONS`)."""
    rows_loss, token_grad, rows_count = _token_kernels(ignore_index, label_smoothing)
    if reduction == "mean":
        return LossFunctions(
            value=functools.partial(_token_mean_function, rows_loss, rows_count),
            value_and_grad=functools.partial(
                _token_mean_and_grad_function, rows_loss, token_grad, rows_count
            ),
        )
    reduce, scale = REDUCTIONS[reduction]
    return LossFunctions(
        value=lambda weighted: _value_function(rows_loss, reduce, weighted),
        value_and_grad=lambda weighted: _value_and_grad_function(
            rows_loss, token_grad, reduce, scale, weighted
        ),
    )


def check_class_labels(y: np.ndarray, n_classes: int, binary: bool, what: str = "y") -> None:
    """Refuse class labels outside ``[0, n_classes - 1]`` (``{0, 1}`` for a binary loss).

    An out-of-range label would otherwise give a zero or undefined loss for its rows
    (a one-hot row of zeros) and a perfect-looking score.
    """
    if not y.size:
        return
    low, high = int(y.min()), int(y.max())
    if low >= 0 and high < n_classes:
        return
    if binary:
        raise ValueError(
            f"{what} holds labels from {low} to {high}; a binary loss takes 0 and 1. Encode "
            "the classes with sklearn.preprocessing.LabelEncoder (or y == positive_class)."
        )
    raise ValueError(
        f"{what} holds class labels from {low} to {high}; the model predicts {n_classes} "
        f"classes, so labels must be integers in [0, {n_classes - 1}]. Encode them with "
        "sklearn.preprocessing.LabelEncoder (labels 1..K become 0..K-1)."
    )


@dataclass(frozen=True)
class LossFunctions:
    """The scripted functions of a built-in loss that reduces its values itself, where
    per-sample kernels and :data:`REDUCTIONS` do not say it (the token cross-entropy's
    mean divides by the counted tokens, not by the samples). Each takes ``weighted``."""

    value: Callable[[bool], onnxscript.OnnxFunction]
    """``(prediction, label[, weight]) -> loss``"""
    value_and_grad: Callable[[bool], onnxscript.OnnxFunction]
    """``(prediction, label[, weight]) -> (loss, prediction_grad)``"""


class Loss:
    """A loss and its gradient with respect to the prediction, as ONNX graphs.

    Models take ``prediction``, ``label`` and, when ``weighted``, ``weight`` (one weight
    per sample); the value model returns ``loss``, the gradient model ``loss`` and
    ``prediction_grad``. Build instances with :func:`get` or :func:`custom_loss`.

    Attributes:
        name: registered name (or the custom function's name).
        task: ``"regression"`` (float labels) or ``"classification"`` (int64 labels).
        reduction: ``"mean"`` (weighted mean: sum w_i l_i / sum w_i; for a regression
            loss on k values per sample, divided by k too: the mean over every predicted
            value, as ``torch.nn.MSELoss()``), ``"sum"`` or ``"none"`` (one value per
            sample, the sum over its k values; the gradient is then that of their sum);
            None for a custom loss, which reduces the samples itself.
        params: the hyper-parameters the loss was built with.
        prediction: what a classification loss reads from the model: ``"probabilities"``,
            ``"logits"`` or a raw ``"score"`` (None for regression and custom losses);
            :meth:`labels` and :meth:`probabilities` follow it.
        token_labels: the classes are on the prediction's last axis and the labels are
            the prediction's shape without it, one class per position (``(N, T)`` labels
            for ``(N, T, V)`` logits): ``token_cross_entropy``.
    """

    def __init__(
        self,
        name: str,
        task: str,
        *,
        kernels: tuple[Any, Any] | None = None,
        reduction: str | None = "mean",
        function: onnxscript.OnnxFunction | None = None,
        functions: LossFunctions | None = None,
        params: dict[str, Any] | None = None,
        multiclass: bool = False,
        resolve: Callable[[Shape], Loss] | None = None,
        prediction: str | None = None,
        token_labels: bool = False,
    ) -> None:
        if function is None and reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, not {reduction!r}.")
        if sum(x is not None for x in (kernels, functions, function)) != 1:
            raise ValueError(
                "give one of kernels or functions (built-in loss) or function (custom loss)"
            )
        self.name = name
        self.task = task
        self.reduction = reduction
        self.kernels = kernels
        self.functions = functions
        self.custom = function
        self.params = dict(params or {})
        self.multiclass = multiclass
        self.prediction = prediction
        self.token_labels = token_labels
        self._declared_label = _declared_label_dims(function) if function is not None else None
        self._resolve = resolve
        self._runners: dict[tuple[Any, ...], Runner] = {}

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as "rebuild from the registry" (scripted closures do not pickle)."""
        if self.custom is not None:
            raise TypeError(
                f"Custom loss {self.name!r} cannot be pickled: its onnxscript function is "
                "code. Pickle the ONNX graph it produces instead."
            )
        return (_rebuild, (self.name, {**self.params, "reduction": self.reduction}))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Loss({self.name!r}{', ' + args if args else ''}, reduction={self.reduction!r})"

    def for_prediction(self, prediction_shape: Sequence[Dim]) -> Loss:
        """This loss with the choices left to the prediction's shape made.

        ``log_loss`` with ``binary=None`` is binary on one probability column ((N,) or
        (N, 1)) and multiclass on (N, K); every other loss is returned as is.
        """
        if self._resolve is None:
            return self
        return self._resolve(tuple(prediction_shape))

    def labels(self, output: np.ndarray) -> np.ndarray:
        """Class labels from the model's output: the argmax of (N, K) columns; for one
        column, probability > 0.5 or score > 0; for token labels (or any output of rank
        > 2), the argmax over the last axis ((N, T) from (N, T, V) logits)."""
        if self.token_labels or (output.ndim > 2 and output.shape[-1] > 1):
            return output.argmax(axis=-1)
        if output.ndim == 2 and output.shape[1] > 1:
            return output.argmax(axis=1)
        threshold = 0.5 if self.prediction == "probabilities" else 0.0
        return (output.reshape(-1) > threshold).astype(np.int64)

    def probabilities(self, output: np.ndarray) -> np.ndarray:
        """(N, K) class probabilities from the model's output: the output itself, its
        softmax (logits), or ``[1 - sigmoid(s), sigmoid(s)]`` (one score column)."""
        if self.prediction is None:
            raise TypeError(f"Loss {self.name!r} does not say what its prediction is.")
        if self.token_labels:  # (N, ..., V): the softmax over the last axis
            shifted = np.exp(output - output.max(axis=-1, keepdims=True))
            return shifted / shifted.sum(axis=-1, keepdims=True)
        if output.ndim == 2 and output.shape[1] > 1:
            if self.prediction == "logits":
                shifted = np.exp(output - output.max(axis=1, keepdims=True))
                return shifted / shifted.sum(axis=1, keepdims=True)
            return output
        p = output.reshape(-1)
        if self.prediction == "score":
            p = 1 / (1 + np.exp(-p))
        return np.stack([1 - p, p], axis=1)

    @property
    def is_custom(self) -> bool:
        return self.custom is not None

    @property
    def int64_inputs(self) -> tuple[str, ...]:
        return ("label",) if self.task == CLASSIFICATION else ()

    # -- onnxscript functions (callable eagerly on numpy arrays) --------------------------

    def function(
        self, weighted: bool = False, prediction_shape: Sequence[Dim] | None = None
    ) -> onnxscript.OnnxFunction:
        """The scripted loss ``(prediction, label[, weight]) -> loss``.

        Args:
            weighted: whether it takes sample weights.
            prediction_shape: the prediction's shape, when known: a regression mean over
                k values per sample then divides by the constant k (nothing for k = 1);
                None (or unknown dims) reads k from the prediction at run time.

        Raises:
            ValueError: a custom loss asked for with the other ``weighted``.
        """
        if self.custom is not None:
            if weighted != _takes_weight(self.custom):
                raise ValueError(
                    f"custom loss {self.name!r} {'has' if not weighted else 'has no'} weight "
                    "argument; it cannot be used "
                    + ("with" if weighted else "without")
                    + " sample weights."
                )
            return self.custom
        if self.functions is not None:
            return self.functions.value(weighted)
        kernels, reduction = self.kernels, self.reduction
        assert kernels is not None and reduction is not None  # a built-in loss has both
        reduce, _ = REDUCTIONS[reduction]
        divisor = self._divisor(prediction_shape)
        return _value_function(kernels[0], reduce, weighted, divisor)

    def value_and_grad_function(
        self, weighted: bool = False, prediction_shape: Sequence[Dim] | None = None
    ) -> onnxscript.OnnxFunction:
        """The scripted ``(prediction, label[, weight]) -> (loss, prediction_grad)``.

        Built-in losses only: a custom loss gets its gradient graph from
        :meth:`gradient_model`. ``prediction_shape`` as in :meth:`function`.

        Raises:
            TypeError: a custom loss.
        """
        if self.custom is not None:
            raise TypeError(
                f"{self.name!r} is a custom loss: its gradient is derived by the "
                "backend's gradient source, use gradient_model()."
            )
        if self.functions is not None:
            return self.functions.value_and_grad(weighted)
        assert self.kernels is not None and self.reduction is not None  # a built-in loss has one
        reduce, scale = REDUCTIONS[self.reduction]
        divisor = self._divisor(prediction_shape)
        return _value_and_grad_function(*self.kernels, reduce, scale, weighted, divisor)

    def _divisor(self, prediction_shape: Sequence[Dim] | None) -> Any:
        """What a mean divides by besides the weights: for a regression loss, the values
        per sample k (a scripted function of the prediction; None when k = 1 or for other
        reductions and losses, which are left as they are)."""
        if self.task != REGRESSION or self.reduction != "mean":
            return None
        k = values_per_sample_of(prediction_shape)
        if k is None:
            return values_per_sample
        return None if k == 1 else _constant_values_per_sample(k)

    # -- ONNX models -------------------------------------------------------------------

    def shapes(self, prediction_shape: Sequence[Dim], weighted: bool) -> dict[str, Shape]:
        """Shapes of the inputs and outputs of this loss's models for a prediction shape."""
        p = tuple(prediction_shape)
        if not p:
            raise ShapeError("A prediction needs at least one (batch) dimension.")
        shapes: dict[str, Shape] = {"prediction": p, "prediction_grad": p}
        shapes["label"] = self.label_shape(p)
        if weighted:
            shapes["weight"] = p[:1]
        if self.reduction is not None:
            shapes["loss"] = p[:1] if self.reduction == "none" else ()
        return shapes

    def label_shape(self, prediction_shape: Sequence[Dim]) -> Shape:
        """The labels' shape for a prediction of ``prediction_shape`` (the label input a
        training graph declares, the labels a trainer takes):

        * regression: the prediction's shape (float labels);
        * classification: ``(N,)``, one class per row;
        * token labels: the prediction's shape without its last (class) axis;
        * a custom loss with int64 labels: the rank its function declares for ``label``
          (``INT64["N", "T"]``: ``(N, T)``; its int dims kept), or, undeclared, the
          prediction's shape without its last axis (``(N,)`` for an ``(N, K)``
          prediction, ``(N, T)`` for ``(N, T, V)`` logits).
        """
        p = tuple(prediction_shape)
        if self.task == REGRESSION:
            return p
        if self.token_labels:
            return p[:-1]
        if self.custom is None or len(p) < 2:
            return p[:1]
        if not self._declared_label:
            return p[:-1]
        return _custom_label_shape(self._declared_label, p)

    def value_model(
        self,
        dtype: object = np.float32,
        weighted: bool = False,
        prediction_shape: Sequence[Dim] = ("N", "K"),
    ) -> onnx.ModelProto:
        """``(prediction, label[, weight]) -> loss`` as an ONNX model.

        ``prediction_shape`` fixes the declared shapes (``onnx.checker`` needs ranks):
        labels as :meth:`label_shape` says (regression labels with the prediction's
        shape, class labels ``(N,)`` int64, token labels the prediction's shape without
        its last axis), weights as ``(N,)``.
        """
        if self._resolve is not None:
            return self.for_prediction(prediction_shape).value_model(
                dtype, weighted, prediction_shape
            )
        fn = self.function(weighted, prediction_shape)
        shapes = self.shapes(prediction_shape, weighted)
        model = compile_function(fn, dtype, shapes, self.int64_inputs, outputs=["loss"])
        _check_signature(model, weighted, self.name)
        return model

    def gradient_model(
        self,
        dtype: object = np.float32,
        weighted: bool = False,
        prediction_shape: Sequence[Dim] = ("N", "K"),
    ) -> onnx.ModelProto:
        """``(prediction, label[, weight]) -> (loss, prediction_grad)`` as an ONNX model.

        Built-in losses use their analytic gradient; a custom loss is differentiated by
        the default backend's gradient source (:func:`graphkit.gradient_model`).
        """
        if self._resolve is not None:
            return self.for_prediction(prediction_shape).gradient_model(
                dtype, weighted, prediction_shape
            )
        if self.custom is None:
            fn = self.value_and_grad_function(weighted, prediction_shape)
            shapes = self.shapes(prediction_shape, weighted)
            return compile_function(
                fn, dtype, shapes, self.int64_inputs, outputs=["loss", "prediction_grad"]
            )
        value = self.value_model(dtype, weighted, prediction_shape)
        return gradient_model(value, "loss", ["prediction"])

    # -- evaluation --------------------------------------------------------------------

    def __call__(
        self, prediction: np.ndarray, label: np.ndarray, weight: np.ndarray | None = None
    ) -> np.ndarray:
        """The loss on numpy arrays, computed by the compiled ONNX graph."""
        return self._run("value", prediction, label, weight)[0]

    def value_and_grad(
        self, prediction: np.ndarray, label: np.ndarray, weight: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(loss, d loss / d prediction)`` on numpy arrays."""
        loss, grad = self._run("grad", prediction, label, weight)
        return loss, grad

    def _run(self, which: str, prediction: Any, label: Any, weight: Any) -> list[np.ndarray]:
        if self._resolve is not None:
            return self.for_prediction(np.shape(prediction))._run(which, prediction, label, weight)
        feeds = self.check_inputs(prediction, label, weight)
        dtype = feeds["prediction"].dtype
        # compiled for the dims after the batch: a regression mean divides by their size
        per_sample = feeds["prediction"].shape[1:]
        key = (which, dtype, weight is not None, per_sample)
        if key not in self._runners:
            build = self.value_model if which == "value" else self.gradient_model
            shape = ("N", *per_sample)
            self._runners[key] = Runner(build(dtype, weight is not None, shape))
        return self._runners[key](feeds)

    def check_inputs(
        self, prediction: Any, label: Any, weight: Any = None
    ) -> dict[str, np.ndarray]:
        """Validate and convert the arrays a loss is fed; raise a clear error otherwise.

        Float labels of a regression loss are cast to the prediction's dtype; integer
        labels of a classification loss are cast to int64. Anything else is refused.
        """
        prediction = np.asarray(prediction)
        if self._resolve is not None:
            return self.for_prediction(prediction.shape).check_inputs(prediction, label, weight)
        if prediction.dtype.kind != "f":
            raise DTypeError(f"The prediction must be float32 or float64, got {prediction.dtype}.")
        dtype = float_dtype(prediction.dtype)
        label = np.asarray(label)
        n = prediction.shape[0] if prediction.ndim else 1
        if prediction.ndim == 0:
            raise ShapeError("The prediction must have a batch dimension, got a scalar.")
        if self.task == REGRESSION:
            if label.dtype.kind not in "f":
                raise DTypeError(
                    f"Loss {self.name!r} is a regression loss and needs float labels, got "
                    f"{label.dtype}; pass y.astype(numpy.{dtype}) (or use a classification "
                    "loss such as 'cross_entropy' for class labels)."
                )
            if label.size != prediction.size or (label.ndim and label.shape[0] != n):
                raise ShapeError(
                    f"Label shape {label.shape} does not match prediction shape "
                    f"{prediction.shape}: a regression loss needs one label per predicted value."
                )
            label = label.astype(dtype, copy=False).reshape(prediction.shape)
        else:
            if label.dtype.kind not in "iu":
                raise DTypeError(
                    f"Loss {self.name!r} is a classification loss and needs integer class "
                    f"labels, got {label.dtype}; pass y.astype(numpy.int64) (or use a "
                    "regression loss for real-valued targets)."
                )
            if self.token_labels:
                label = self._checked_token_labels(prediction, label)
            elif len(self.label_shape(prediction.shape)) > 1:  # a custom loss's, rank kept
                label = _checked_label_shape(label, self.label_shape(prediction.shape))
            else:
                label = self._checked_row_labels(prediction, label)
        feeds = {"prediction": prediction, "label": label}
        if weight is not None:
            weight = np.asarray(weight, dtype=dtype)
            if weight.size != n:
                raise ShapeError(f"Got {weight.size} sample weights for {n} samples.")
            feeds["weight"] = weight.reshape(-1)
        return feeds

    def _checked_row_labels(self, prediction: np.ndarray, label: np.ndarray) -> np.ndarray:
        """One class label per row, as int64 (N,)."""
        n = prediction.shape[0]
        if label.size != n:
            raise ShapeError(
                f"Label shape {label.shape} does not match prediction shape "
                f"{prediction.shape}: a classification loss needs one class per row."
            )
        columns = prediction.shape[1] if prediction.ndim == 2 else 1
        if self.multiclass and (prediction.ndim != 2 or columns < 2):
            raise ShapeError(
                f"Loss {self.name!r} needs a (N, K) prediction with K >= 2 classes, "
                f"got shape {prediction.shape}."
            )
        if not self.is_custom:  # a custom loss says nothing of its classes
            n_classes = columns if self.multiclass else 2
            check_class_labels(label, n_classes, not self.multiclass, "the label")
        elif label.size and label.min() < 0:
            raise ValueError(f"Class labels must be >= 0, got {label.min()}.")
        return label.astype(np.int64, copy=False).reshape(n)

    def _checked_token_labels(self, prediction: np.ndarray, label: np.ndarray) -> np.ndarray:
        """One class label per position, as int64 shaped like the prediction without its
        last (class) axis; each in [0, V - 1] or ignore_index."""
        if prediction.ndim < 2:
            raise ShapeError(
                f"Loss {self.name!r} needs logits (N, ..., V), the classes on the last axis; "
                f"got shape {prediction.shape}."
            )
        expected = prediction.shape[:-1]
        if label.shape != expected:
            raise ShapeError(
                f"Label shape {label.shape} does not match prediction shape "
                f"{prediction.shape}: loss {self.name!r} takes one class label per position, "
                f"labels of shape {expected} (the prediction's shape without its last, "
                "class, axis)."
            )
        self.check_classes(label, prediction.shape[-1], "the label")
        return label.astype(np.int64, copy=False)

    def check_classes(self, y: np.ndarray, n_classes: int, what: str = "y") -> None:
        """Refuse class labels ``y`` outside the ``n_classes`` classes of the model (see
        :func:`check_class_labels`); token labels may also be ``ignore_index``. A custom
        loss says nothing of its classes: only negative labels of one class per row are
        refused, as :meth:`check_inputs` does.

        Raises:
            ValueError: naming the range of the labels, the valid one and, for token
                labels, the ignore_index.
        """
        if self.is_custom:  # it says nothing of its classes: as check_inputs
            if y.ndim == 1 and y.size and y.min() < 0:
                raise ValueError(f"{what}: class labels must be >= 0, got {y.min()}.")
            return
        if not self.token_labels:
            check_class_labels(y, n_classes, not self.multiclass, what)
            return
        ignore_index = self.params["ignore_index"]
        scored = y[y != ignore_index]
        if not scored.size:
            return
        low, high = int(scored.min()), int(scored.max())
        if low >= 0 and high < n_classes:
            return
        raise ValueError(
            f"{what} holds token labels from {low} to {high} (besides ignore_index="
            f"{ignore_index}); the model predicts {n_classes} classes on its last axis, so "
            f"labels must be integers in [0, {n_classes - 1}], or {ignore_index} "
            "(ignore_index) for a position that is not scored, such as padding."
        )


def _declared_label_dims(fn: onnxscript.OnnxFunction) -> tuple[Dim, ...] | None:
    """The dims a custom loss declares for its int64 ``label`` (``INT64["N", "T"]``:
    ``("N", "T")``); None for float labels, or int64 ones declared without a shape."""
    label = fn.to_model_proto().graph.input[1].type.tensor_type
    if label.elem_type != onnx.TensorProto.INT64 or not label.shape.dim:
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else d.dim_param for d in label.shape.dim)


def _custom_label_shape(declared: tuple[Dim, ...], prediction: Shape) -> Shape:
    """A custom loss's labels of the declared rank for a ``prediction`` shape: the
    prediction's batch dim, then the declared int dims; a symbolic one is the
    prediction's dim there when the labels are the prediction's shape without its last
    axis (tokens), a dim of the labels' own otherwise."""
    tokens = len(declared) == len(prediction) - 1
    dims: list[Dim] = [prediction[0]]
    for i, d in enumerate(declared[1:], 1):
        if isinstance(d, int) and d > 0:
            dims.append(d)
        elif tokens:
            dims.append(prediction[i])
        else:
            dims.append(f"label_{i}")
    return tuple(dims)


def _checked_label_shape(label: np.ndarray, expected: Shape) -> np.ndarray:
    """int64 labels of rank > 1 (a custom loss's), their shape kept: their rank and known
    dims must be ``expected``'s."""
    fits = label.ndim == len(expected) and all(
        not isinstance(d, int) or d == got for d, got in zip(expected, label.shape)
    )
    if not fits:
        raise ShapeError(
            f"Label shape {label.shape} does not match the labels the loss declares, "
            f"{tuple(expected)}: pass labels of that rank, one row per sample."
        )
    return label.astype(np.int64, copy=False)


def _takes_weight(fn: onnxscript.OnnxFunction) -> bool:
    return len(fn.function_ir.inputs) == 3


def _check_signature(model: onnx.ModelProto, weighted: bool, name: str) -> None:
    expected = ["prediction", "label"] + (["weight"] if weighted else [])
    got = [i.name for i in model.graph.input]
    if got != expected:
        raise ValueError(
            f"Loss {name!r} must be a function of {tuple(expected)}, got {tuple(got)}; "
            "rename its parameters."
        )
    if len(model.graph.output) != 1:
        raise ValueError(f"Loss {name!r} must return one tensor, got {len(model.graph.output)}.")


# -- the registry -------------------------------------------------------------------------

LOSSES: Registry[Loss] = Registry("loss")


@LOSSES.register("squared_error", "square_error", "l2", "mse")
def squared_error_loss(reduction: str = "mean") -> Loss:
    """l = sum_j (p_j - y_j)^2 per sample.

    For k values per sample, ``"mean"`` is the mean of (p - y)^2 over all N k values
    (``torch.nn.MSELoss()``, scikit-learn's ``mean_squared_error``), ``"sum"`` their sum.
    """
    kernels = _regression_kernels(squared_error, squared_error_derivative)
    return Loss("squared_error", REGRESSION, kernels=kernels, reduction=reduction)


@LOSSES.register("absolute_error", "l1", "mae")
def absolute_error_loss(reduction: str = "mean") -> Loss:
    """l = sum_j |p_j - y_j| per sample; gradient sign(p - y), 0 at p = y.

    For k values per sample, ``"mean"`` is the mean over all N k values
    (``torch.nn.L1Loss()``), ``"sum"`` their sum.
    """
    kernels = _regression_kernels(absolute_error, absolute_error_derivative)
    return Loss("absolute_error", REGRESSION, kernels=kernels, reduction=reduction)


@LOSSES.register("elastic", "elastic_error")
def elastic_loss(l1_weight: float = 0.5, l2_weight: float = 0.5, reduction: str = "mean") -> Loss:
    """l = sum_j l1_weight |d_j| + l2_weight d_j^2 with d = p - y.

    For k values per sample, ``"mean"`` is the mean over all N k values, ``"sum"``
    their sum.
    """
    _check_nonnegative(l1_weight=l1_weight, l2_weight=l2_weight)
    kernels = _regression_kernels(*elastic_formula(l1_weight, l2_weight))
    params = {"l1_weight": l1_weight, "l2_weight": l2_weight}
    return Loss("elastic", REGRESSION, kernels=kernels, reduction=reduction, params=params)


@LOSSES.register("huber")
def huber_loss(delta: float = 1.0, reduction: str = "mean") -> Loss:
    """l = sum_j huber(d_j): d^2/2 inside [-delta, delta], delta (|d| - delta/2) outside.

    Same convention as ``torch.nn.HuberLoss``: for k values per sample, ``"mean"`` is
    the mean over all N k values, ``"sum"`` their sum.
    """
    if not delta > 0:
        raise ValueError(f"delta must be > 0, got {delta}.")
    kernels = _regression_kernels(*_huber(delta))
    return Loss("huber", REGRESSION, kernels=kernels, reduction=reduction, params={"delta": delta})


@LOSSES.register("sigmoid_log_loss", "logistic", "neg_log")
def sigmoid_log_loss(reduction: str = "mean") -> Loss:
    """Binary log loss from a raw score s: log(1 + exp(s)) - y s; gradient sigmoid(s) - y.

    Stable for any score (no NaN or inf at |s| = 1e4).
    """
    kernels = (sigmoid_log_loss_loss, sigmoid_log_loss_grad)
    return Loss(
        "sigmoid_log_loss", CLASSIFICATION, kernels=kernels, reduction=reduction, prediction="score"
    )


@LOSSES.register("log_loss", "log", "nll")
def log_loss(eps: float = 1e-15, binary: bool | None = None, reduction: str = "mean") -> Loss:
    """Log loss on probabilities: -log max(p_y, eps).

    ``binary=True``: the prediction is one column p = P(y = 1), as in
    -y log p - (1 - y) log(1 - p). ``binary=False``: (N, K) class probabilities.
    ``binary=None`` (default): decided by the prediction's shape when the loss is used.
    """
    if not 0 < eps < 1:
        raise ValueError(f"eps must lie in (0, 1), got {eps}.")
    if binary is None:
        return Loss(
            "log_loss",
            CLASSIFICATION,
            kernels=_log_loss(eps),
            reduction=reduction,
            params={"eps": eps, "binary": None},
            multiclass=True,
            resolve=lambda shape: log_loss(eps, _one_column(shape), reduction),
            prediction="probabilities",
        )
    kernels = _binary_log_loss(eps) if binary else _log_loss(eps)
    params = {"eps": eps, "binary": binary}
    return Loss(
        "log_loss",
        CLASSIFICATION,
        kernels=kernels,
        reduction=reduction,
        params=params,
        multiclass=not binary,
        prediction="probabilities",
    )


@LOSSES.register("binary_log_loss")
def binary_log_loss(eps: float = 1e-15, reduction: str = "mean") -> Loss:
    """Log loss on one probability column p = P(y = 1): ``log_loss(binary=True)``.

    From a raw score instead of a probability, use ``sigmoid_log_loss``.
    """
    return log_loss(eps, binary=True, reduction=reduction)


@LOSSES.register("multiclass_log_loss")
def multiclass_log_loss(eps: float = 1e-15, reduction: str = "mean") -> Loss:
    """Log loss on (N, K) class probabilities: ``log_loss(binary=False)``."""
    return log_loss(eps, binary=False, reduction=reduction)


def _one_column(shape: Shape) -> bool:
    return len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)


@LOSSES.register("cross_entropy", "softmax_cross_entropy")
def cross_entropy(reduction: str = "mean") -> Loss:
    """Softmax cross-entropy from logits z (N, K): logsumexp(z) - z_y.

    Gradient softmax(z) - onehot(y); computed with LogSoftmax, stable for any logits.
    """
    kernels = (cross_entropy_loss, cross_entropy_grad)
    return Loss(
        "cross_entropy",
        CLASSIFICATION,
        kernels=kernels,
        reduction=reduction,
        multiclass=True,
        prediction="logits",
    )


@LOSSES.register("token_cross_entropy", "causal_lm", "lm_cross_entropy")
def token_cross_entropy(
    ignore_index: int = -100, label_smoothing: float = 0.0, reduction: str = "mean"
) -> Loss:
    """Softmax cross-entropy of every token, from logits z (N, T, V) (or (N, d1, ..., V),
    the classes on the last axis, as a causal language model's) and int64 labels
    (N, T) (the prediction's shape without its last axis; (N, V) logits take (N,)).

    A token's loss is ``torch.nn.functional.cross_entropy``'s: with label smoothing
    eps, (1 - eps)(-log p_y) + eps mean_k(-log p_k), p = softmax(z); a token labelled
    ``ignore_index`` adds 0 and is not counted. ``"mean"`` is the sum over the counted
    tokens divided by their number in the whole batch (not a mean of the rows' means),
    as ``F.cross_entropy(z.reshape(-1, V), y.reshape(-1))``; with sample weights w_i,
    sum_i w_i sum_t l_it / sum_i w_i c_i, c_i the row's counted tokens (0 when no token
    is counted). ``"sum"``: the sum over every token (weighted). ``"none"``: one value
    per sample, the sum of its tokens' losses (graphkit's ``"none"``, one value per
    sample; its gradient is that of their sum).

    Gradient (m_t = 1 for a counted token): m_t softmax(z_t) - m_t ((1 - eps)
    onehot(y_t) + eps / V), divided as the reduction says; computed with LogSoftmax and
    Softmax, stable for any logits.
    """
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must lie in [0, 1], got {label_smoothing}.")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {sorted(REDUCTIONS)}, not {reduction!r}.")
    ignore_index = int(ignore_index)
    label_smoothing = float(label_smoothing)
    return Loss(
        "token_cross_entropy",
        CLASSIFICATION,
        functions=_token_functions(ignore_index, label_smoothing, reduction),
        reduction=reduction,
        params={"ignore_index": ignore_index, "label_smoothing": label_smoothing},
        multiclass=True,
        prediction="logits",
        token_labels=True,
    )


def _rebuild(name: str, params: dict[str, Any]) -> Loss:
    return LOSSES.get(name, **params)


def get(name: str | Loss, **kwargs: Any) -> Loss:
    """The loss registered as ``name`` or an alias (the seed's class names are objects
    of :mod:`graphkit.seed`, not names).

    >>> get("huber", delta=2.0)
    Loss('huber', delta=2.0, reduction='mean')
    """
    if isinstance(name, Loss):
        if kwargs:
            raise ValueError("hyper-parameters cannot be given with a Loss instance")
        return name
    return LOSSES.get(name, **kwargs)


def resolve(loss: Any) -> Loss:
    """The loss a trainer's ``loss`` (the seed's ``learning_loss``) stands for: a
    :class:`Loss`, a registered name or alias, or an object with ``to_loss()`` (the
    seed's ``*LearningLoss`` instances)."""
    if isinstance(loss, (Loss, str)):
        return get(loss)
    if hasattr(loss, "to_loss"):
        return loss.to_loss()
    raise TypeError(
        f"learning_loss must be a graphkit Loss, a loss name or a *LearningLoss object, "
        f"not {type(loss).__name__} {loss!r}."
    )


def custom_loss(fn: Callable[..., Any], name: str | None = None) -> Loss:
    """A loss written by the user as an onnxscript function.

    Args:
        fn: a ``@script()`` function of ``(prediction, label)`` or
            ``(prediction, label, weight)`` returning the loss (usually a scalar: it
            reduces the samples itself). Annotate ``label`` with ``INT64`` for class
            labels, ``FLOAT`` for real targets; write constants with ``op.CastLike`` so
            it serves float32 and float64.
        name: a name for messages and reports (defaults to the function's).

    Returns:
        A :class:`Loss` whose gradient graph is derived by the backend's gradient source.

    Raises:
        MissingGradientError: when the gradient is built, if an operator has none.
    """
    if not isinstance(fn, onnxscript.OnnxFunction):
        raise TypeError(
            "A custom loss must be an onnxscript function: decorate it with "
            "@graphkit.dsl.script() (or onnxscript.script())."
        )
    proto = fn.to_model_proto()
    names = [i.name for i in proto.graph.input]
    if names[:2] != ["prediction", "label"] or len(names) not in (2, 3):
        raise ValueError(
            f"A custom loss takes (prediction, label) or (prediction, label, weight); "
            f"{fn.name} takes {tuple(names)}."
        )
    label_type = proto.graph.input[1].type.tensor_type.elem_type
    task = CLASSIFICATION if label_type == onnx.TensorProto.INT64 else REGRESSION
    return Loss(name or fn.name, task, function=fn, reduction=None)


def _check_nonnegative(**values: float) -> None:
    for key, value in values.items():
        if value < 0:
            raise ValueError(f"{key} must be >= 0, got {value}.")


__all__ = ["LOSSES", "Loss", "custom_loss", "get", "resolve"]
