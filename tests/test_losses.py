"""Every loss against numpy written from its formula (and sklearn / torch where they have
it), in onnxscript eager mode and compiled in onnxruntime; custom losses' automatic
gradients against finite differences."""

from __future__ import annotations

import functools

import numpy as np
import onnx
import pytest
from conftest import NO_GRADIENT, default_backend, names_operator
from hypothesis import given, settings
from hypothesis import strategies as st
from onnxscript.values import Opset

from graphkit import (
    DTypeError,
    IncompatibleModelError,
    MissingGradientError,
    ShapeError,
    UnknownNameError,
    losses,
)
from graphkit.dsl import FLOAT, INT64, op, script

# -- numpy references, written from the formulas -------------------------------------------

REGRESSION_REFS = {
    "squared_error": (lambda d, **k: d**2, lambda d, **k: 2 * d),
    "absolute_error": (lambda d, **k: np.abs(d), lambda d, **k: np.sign(d)),
    "elastic": (
        lambda d, l1_weight, l2_weight: l1_weight * np.abs(d) + l2_weight * d**2,
        lambda d, l1_weight, l2_weight: l1_weight * np.sign(d) + 2 * l2_weight * d,
    ),
    "huber": (
        lambda d, delta: np.where(np.abs(d) <= delta, 0.5 * d**2, delta * (np.abs(d) - delta / 2)),
        lambda d, delta: np.clip(d, -delta, delta),
    ),
}


def _onehot(y, k):
    return np.eye(k)[y]


def _log_softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def reference(name, p, y, **params):
    """(per-sample loss (N,), gradient of each sample's loss w.r.t. p) in float64."""
    p = p.astype(np.float64)
    if name in REGRESSION_REFS:
        f, df = REGRESSION_REFS[name]
        d = p - y.reshape(p.shape)
        return f(d, **params).reshape(len(p), -1).sum(axis=1), df(d, **params)
    if name == "sigmoid_log_loss":
        s = p.reshape(-1)
        loss = np.logaddexp(0.0, s) - y * s
        return loss, (1 / (1 + np.exp(-s)) - y).reshape(p.shape)
    if name == "cross_entropy":
        oh = _onehot(y, p.shape[1])
        return -(oh * _log_softmax(p)).sum(axis=1), np.exp(_log_softmax(p)) - oh
    if name == "log_loss":
        eps = params.get("eps", 1e-15)
        if params.get("binary"):
            q = p.reshape(-1)
            loss = -(y * np.log(np.maximum(q, eps)) + (1 - y) * np.log(np.maximum(1 - q, eps)))
            grad = np.where(q >= eps, -y / np.maximum(q, eps), 0) + np.where(
                1 - q >= eps, (1 - y) / np.maximum(1 - q, eps), 0
            )
            return loss, grad.reshape(p.shape)
        oh = _onehot(y, p.shape[1])
        loss = -np.log(np.maximum(p[np.arange(len(y)), y], eps))
        return loss, np.where(p >= eps, -oh / np.maximum(p, eps), 0)
    raise KeyError(name)


def reduce_reference(per_sample, grad, weight, reduction, values=1):
    """``values``: what a regression mean divides by besides the weights, the k values
    per sample (the mean over all N k values, as torch.nn.MSELoss())."""
    w = np.ones(len(per_sample)) if weight is None else weight.astype(np.float64)
    rows = grad.reshape(len(per_sample), -1) * w[:, None]
    rows = rows.reshape(grad.shape)
    if reduction == "none":
        return w * per_sample, rows
    if reduction == "sum":
        return (w * per_sample).sum(), rows
    return (w * per_sample).sum() / (values * w.sum()), rows / (values * w.sum())


def regression_values(name, p):
    """k for a regression loss (its mean is over every predicted value), 1 otherwise."""
    return p[0].size if name in REGRESSION_REFS else 1


@functools.cache
def cached_loss(name, reduction, params=()):
    return losses.get(name, reduction=reduction, **dict(params))


def make_inputs(name, rng, n, k, dtype, params):
    if name in REGRESSION_REFS:
        return rng.normal(size=(n, k)).astype(dtype), rng.normal(size=(n, k)).astype(dtype)
    if name == "sigmoid_log_loss":
        return rng.normal(scale=3, size=(n, 1)).astype(dtype), rng.integers(0, 2, n)
    if name == "log_loss" and params.get("binary"):
        return rng.uniform(0.01, 0.99, size=(n, 1)).astype(dtype), rng.integers(0, 2, n)
    k = max(k, 2)
    z = rng.normal(size=(n, k))
    if name == "log_loss":
        z = np.exp(_log_softmax(z))
    return z.astype(dtype), rng.integers(0, k, n)


CASES = [
    ("squared_error", ()),
    ("absolute_error", ()),
    ("elastic", (("l1_weight", 0.3), ("l2_weight", 0.7))),
    ("huber", (("delta", 0.8),)),
    ("sigmoid_log_loss", ()),
    ("cross_entropy", ()),
    ("log_loss", ()),
    ("log_loss", (("binary", True),)),
]


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_loss_matches_numpy(name, params, dtype, reduction, weighted, rng):
    loss = cached_loss(name, reduction, params)
    p, y = make_inputs(name, rng, 7, 3, dtype, dict(params))
    w = rng.uniform(0.5, 2.0, size=7).astype(dtype) if weighted else None
    expected_loss, expected_grad = reduce_reference(
        *reference(name, p, y, **dict(params)), w, reduction, regression_values(name, p)
    )
    rtol = 1e-5 if dtype == np.float32 else 1e-12

    value, grad = loss.value_and_grad(p, y, w)
    assert value.dtype == dtype and grad.dtype == dtype and grad.shape == p.shape
    np.testing.assert_allclose(value, expected_loss, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(grad, expected_grad, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(loss(p, y, w), expected_loss, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("name,params", CASES)
def test_loss_eager_mode_matches_numpy(name, params, rng):
    """The onnxscript functions themselves, run eagerly, give the formula's values."""
    loss = cached_loss(name, "mean", params)
    p, y = make_inputs(name, rng, 5, 2, np.float64, dict(params))
    feeds = loss.check_inputs(p, y)
    expected_loss, expected_grad = reduce_reference(
        *reference(name, p, y, **dict(params)), None, "mean", regression_values(name, p)
    )
    np.testing.assert_allclose(
        loss.function()(feeds["prediction"], feeds["label"]), expected_loss, rtol=1e-12
    )
    value, grad = loss.value_and_grad_function()(feeds["prediction"], feeds["label"])
    np.testing.assert_allclose(value, expected_loss, rtol=1e-12)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 12),
    k=st.integers(1, 4),
    dtype=st.sampled_from([np.float32, np.float64]),
    l1=st.floats(0, 2),
    l2=st.floats(0, 2),
    delta=st.floats(0.05, 3),
    seed=st.integers(0, 2**16),
)
def test_regression_losses_hypothesis(n, k, dtype, l1, l2, delta, seed):
    rng = np.random.default_rng(seed)
    p, y = (rng.normal(size=(n, k)).astype(dtype) for _ in range(2))
    rtol = 2e-5 if dtype == np.float32 else 1e-11
    for name, params in [
        ("elastic", {"l1_weight": l1, "l2_weight": l2}),
        ("huber", {"delta": delta}),
    ]:
        loss = cached_loss(name, "sum", tuple(params.items()))
        value, grad = loss.value_and_grad(p, y)
        per_sample, g = reference(name, p, y, **params)
        np.testing.assert_allclose(value, per_sample.sum(), rtol=rtol, atol=rtol)
        np.testing.assert_allclose(grad, g, rtol=rtol, atol=rtol)


def test_one_dimensional_labels_match_column_predictions(rng):
    """scikit-learn users pass y as (N,): it pairs with a (N, 1) prediction."""
    p = rng.normal(size=(6, 1))
    y = rng.normal(size=6)
    assert losses.get("squared_error")(p, y) == pytest.approx(
        np.mean((p[:, 0] - y) ** 2), rel=1e-12
    )


def test_cross_entropy_matches_torch(rng):
    torch = pytest.importorskip("torch")
    z = rng.normal(scale=5, size=(8, 4))
    y = rng.integers(0, 4, 8)
    zt = torch.tensor(z, requires_grad=True)
    expected = torch.nn.functional.cross_entropy(zt, torch.tensor(y))
    expected.backward()
    value, grad = losses.get("cross_entropy").value_and_grad(z, y)
    np.testing.assert_allclose(value, expected.item(), rtol=1e-12)
    np.testing.assert_allclose(grad, zt.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_log_loss_matches_sklearn(rng):
    from sklearn.metrics import log_loss

    p = np.exp(_log_softmax(rng.normal(size=(10, 3))))
    y = rng.integers(0, 3, 10)
    w = rng.uniform(0.1, 1, 10)
    assert losses.get("log")(p, y, w) == pytest.approx(
        log_loss(y, p, sample_weight=w, labels=[0, 1, 2]), rel=1e-10
    )


def test_huber_matches_torch(rng):
    torch = pytest.importorskip("torch")
    p, y = rng.normal(scale=2, size=(9, 2)), rng.normal(size=(9, 2))
    expected = torch.nn.HuberLoss(reduction="sum", delta=0.7)(torch.tensor(p), torch.tensor(y))
    assert losses.get("huber", delta=0.7, reduction="sum")(p, y) == pytest.approx(
        expected.item(), rel=1e-12
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_log_loss_is_stable_at_extreme_scores(dtype):
    s = np.array([[1e4], [-1e4], [1e4], [-1e4], [0.0]], dtype=dtype)
    y = np.array([1, 0, 0, 1, 1])
    value, grad = losses.get("sigmoid_log_loss", reduction="none").value_and_grad(s, y)
    assert np.all(np.isfinite(value)) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(value, [0, 0, 1e4, 1e4, np.log(2)], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(grad[:, 0], [0, 0, 1, -1, -0.5], atol=1e-6)


def test_cross_entropy_is_stable_at_extreme_logits():
    z = np.array([[1e4, -1e4, 0.0], [-1e4, 1e4, 0.0]], dtype=np.float32)
    value, grad = losses.get("cross_entropy", reduction="none").value_and_grad(z, np.array([0, 0]))
    assert np.all(np.isfinite(value)) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(value, [0, 2e4], rtol=1e-6)


@pytest.mark.parametrize("name,params", CASES)
def test_loss_models_pass_checker(name, params):
    loss = cached_loss(name, "mean", params)
    for dtype in (np.float32, np.float64):
        for weighted in (False, True):
            for model in (loss.value_model(dtype, weighted), loss.gradient_model(dtype, weighted)):
                onnx.checker.check_model(model, full_check=True)
                assert model.ir_version <= 10
                assert all(
                    o.version <= 21 for o in model.opset_import if o.domain in ("", "ai.onnx")
                )


# -- custom losses --------------------------------------------------------------------


@script()
def log_cosh(prediction: FLOAT, label: FLOAT) -> FLOAT:
    """mean log(cosh(p - y)), cosh written with Exp (Cosh has no gradient)."""
    d = prediction - label
    half = op.CastLike(0.5, d)
    return op.ReduceMean(op.Log((op.Exp(d) + op.Exp(op.Neg(d))) * half), keepdims=0)


@script()
def weighted_quartic(prediction: FLOAT, label: FLOAT, weight: FLOAT) -> FLOAT:
    d = prediction - label
    return op.ReduceSum(
        op.Unsqueeze(weight, op.Constant(value_ints=[1])) * d * d * d * d, keepdims=0
    )


@script()
def focal_like(prediction: FLOAT, label: INT64) -> FLOAT:
    """A classification loss on logits: -sum (1 - p_y)^2 log p_y."""
    log_p = op.LogSoftmax(prediction, axis=1)
    classes = op.Range(
        op.Constant(value_int=0),
        op.Squeeze(op.Shape(prediction, start=1, end=2)),
        op.Constant(value_int=1),
    )
    onehot = op.CastLike(
        op.Equal(op.Unsqueeze(label, op.Constant(value_ints=[1])), classes), prediction
    )
    log_py = op.ReduceSum(onehot * log_p, op.Constant(value_ints=[1]), keepdims=0)
    one = op.CastLike(1.0, prediction)
    q = one - op.Exp(log_py)
    return op.Neg(op.ReduceSum(q * q * log_py, keepdims=0))


def finite_difference(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[index] += eps
        down[index] -= eps
        grad[index] = (f(up) - f(down)) / (2 * eps)
    return grad


@pytest.mark.parametrize(
    "fn,kind",
    [(log_cosh, "regression"), (weighted_quartic, "weighted"), (focal_like, "classification")],
)
def test_custom_loss_gradient_matches_finite_differences(fn, kind, rng):
    loss = losses.custom_loss(fn)
    if kind == "classification":
        # LogSoftmaxGrad has a float32 kernel only: gradient in float32, reference in float64
        p, y = rng.normal(size=(6, 3)), rng.integers(0, 3, 6)
        assert loss.task == "classification"
        _, grad = loss.value_and_grad(p.astype(np.float32), y)
        expected = finite_difference(lambda q: float(loss(q, y)), p)
        np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-6)
        return
    else:
        p, y = rng.normal(size=(6, 2)), rng.normal(size=(6, 2))
        w = rng.uniform(0.5, 1.5, 6) if kind == "weighted" else None
    value, grad = loss.value_and_grad(p, y, w)
    np.testing.assert_allclose(
        grad, finite_difference(lambda q: float(loss(q, y, w)), p), rtol=1e-6, atol=1e-8
    )
    if kind == "regression":
        assert value == pytest.approx(np.mean(np.log(np.cosh(p - y))), rel=1e-12)


def test_float64_gradient_through_log_softmax(rng):
    """LogSoftmaxGrad has no float64 kernel in onnxruntime: graphkit lowers it."""
    loss = losses.custom_loss(focal_like)
    p, y = rng.normal(size=(4, 3)), rng.integers(0, 3, 4)
    _, grad = loss.value_and_grad(p, y)
    assert grad.dtype == np.float64
    np.testing.assert_allclose(
        grad, finite_difference(lambda q: float(loss(q, y)), p), rtol=1e-6, atol=1e-9
    )


@script()
def erf_loss(prediction: FLOAT, label: FLOAT) -> FLOAT:
    return op.ReduceMean(op.Erf(prediction - label), keepdims=0)


def test_float64_operator_without_kernel_is_explained(rng):
    loss = losses.custom_loss(erf_loss)
    with pytest.raises(IncompatibleModelError, match="no kernel for operator 'Erf'.*float32"):
        loss(rng.normal(size=(4, 1)), rng.normal(size=(4, 1)))


def test_custom_loss_works_in_float32(rng):
    loss = losses.custom_loss(log_cosh)
    p, y = rng.normal(size=(5, 1)).astype(np.float32), rng.normal(size=(5, 1)).astype(np.float32)
    value, grad = loss.value_and_grad(p, y)
    assert grad.dtype == np.float32
    np.testing.assert_allclose(grad, np.tanh(p - y) / p.size, rtol=1e-5)


@script()
def softplus_loss(prediction: FLOAT, label: FLOAT) -> FLOAT:
    return op.ReduceSum(op.Softplus(prediction - label), keepdims=0)


@script()
def cosh_loss(prediction: FLOAT, label: FLOAT) -> FLOAT:
    return op.ReduceSum(op.Cosh(prediction - label), keepdims=0)


MICROSOFT = Opset("com.microsoft", 1)


@script()
def fast_gelu_loss(prediction: FLOAT, label: FLOAT) -> FLOAT:
    return op.ReduceSum(MICROSOFT.FastGelu(prediction - label), keepdims=0)


NO_GRADIENT_LOSSES = {"Cosh": cosh_loss, "FastGelu": fast_gelu_loss}


def test_op_without_gradient_is_named(rng):
    """A custom loss with an operator the backend has no gradient for
    (conftest.NO_GRADIENT): the error names it."""
    op_type = NO_GRADIENT[default_backend()][1]
    loss = losses.custom_loss(NO_GRADIENT_LOSSES[op_type])
    with pytest.raises(MissingGradientError, match=names_operator(op_type)):
        loss.value_and_grad(rng.normal(size=(3, 1)), rng.normal(size=(3, 1)))


def test_a_custom_loss_with_softplus_gets_its_gradient(rng):
    """The builder has no Softplus gradient; the backend's rewrite gives it one:
    d/dp sum softplus(p - y) = sigmoid(p - y)."""
    p, y = rng.normal(size=(5, 1)), rng.normal(size=(5, 1))
    value, grad = losses.custom_loss(softplus_loss).value_and_grad(p, y)
    np.testing.assert_allclose(value, np.logaddexp(0, p - y).sum(), rtol=1e-12)
    np.testing.assert_allclose(grad, 1 / (1 + np.exp(-(p - y))), rtol=1e-12)


def test_custom_loss_must_be_onnxscript():
    with pytest.raises(TypeError, match="onnxscript function"):
        losses.custom_loss(lambda prediction, label: prediction)


# -- bad input ------------------------------------------------------------------------


def test_unknown_loss_lists_valid_names():
    with pytest.raises(UnknownNameError, match="Valid names.*squared_error") as info:
        losses.get("squared_eror")
    assert "cross_entropy" in str(info.value) and "huber" in str(info.value)


def test_seed_class_name_is_no_loss_name():
    """The seed's classes are objects of graphkit.seed; the error names the one to use."""
    with pytest.raises(UnknownNameError, match="graphkit.seed.SquareLearningLoss.*'squared_error'"):
        losses.get("SquareLearningLoss")
    with pytest.raises(UnknownNameError, match="graphkit.seed.ElasticLearningLoss"):
        losses.get("ElasticLearningLoss", l1_weight=0.1)


def test_integer_labels_to_regression_loss():
    with pytest.raises(DTypeError, match="needs float labels.*astype"):
        losses.get("squared_error")(np.zeros((3, 1)), np.array([0, 1, 2]))


def test_float_labels_to_classification_loss():
    with pytest.raises(DTypeError, match="needs integer class labels"):
        losses.get("cross_entropy")(np.zeros((3, 2)), np.array([0.0, 1.0, 1.0]))


def test_label_and_prediction_shapes_that_cannot_match():
    with pytest.raises(ShapeError, match="Label shape"):
        losses.get("squared_error")(np.zeros((4, 2)), np.zeros(4))
    with pytest.raises(ShapeError, match="one class per row"):
        losses.get("cross_entropy")(np.zeros((4, 3)), np.zeros(5, dtype=np.int64))
    with pytest.raises(ShapeError, match="K >= 2"):
        losses.get("cross_entropy")(np.zeros((4, 1)), np.zeros(4, dtype=np.int64))


def test_class_label_out_of_range():
    """The loss called eagerly refuses the labels the trainers refuse, with their words."""
    with pytest.raises(ValueError, match=r"must be integers in \[0, 2\]"):
        losses.get("cross_entropy")(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(ValueError, match="a binary loss takes 0 and 1"):
        losses.get("sigmoid_log_loss")(np.zeros((2, 1)), np.array([0, 2]))


def test_bad_hyper_parameters():
    with pytest.raises(ValueError, match="delta"):
        losses.get("huber", delta=0)
    with pytest.raises(ValueError, match="reduction"):
        losses.get("squared_error", reduction="avg")
    with pytest.raises(ValueError, match="l1_weight"):
        losses.get("elastic", l1_weight=-1)
