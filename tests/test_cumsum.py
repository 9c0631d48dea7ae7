"""Gradients through ``CumSum`` on both backends, against numpy.

onnxruntime-training 1.19.2 has no gradient for ``CumSum``: its backend rewrites each
float one as a ``MatMul`` by a triangular matrix of ones
(:func:`graphkit.backends.ort_training.rewrites.cumsum_as_matmul`); the native backend
differentiates it as it is (onnx-ad's rule: the cumulative sum of the incoming gradient
in the other direction).
"""

from __future__ import annotations

import itertools
import warnings

import numpy as np
import onnx
import onnx.reference
import pytest
from conftest import INSTALLED_BACKENDS, requires_ort_training
from onnx import helper, numpy_helper

import graphkit as gk
from graphkit.backends.ort_training.rewrites import cumsum_as_matmul
from graphkit_train import ForwardBackwardTrainer, OrtGradientOptimizer

FLAGS = list(itertools.product([0, 1], [0, 1]))  # (exclusive, reverse)
N, D = 3, 5
LR = 0.1


def np_cumsum(x: np.ndarray, axis: int, exclusive: int, reverse: int) -> np.ndarray:
    """ONNX's CumSum: with ``reverse`` the sums run from the end; with ``exclusive`` each
    one leaves its own element out."""
    if reverse:
        x = np.flip(x, axis)
    y = np.cumsum(x, axis)
    if exclusive:
        y = y - x
    return np.flip(y, axis) if reverse else y


def np_cumsum_grad(g: np.ndarray, axis: int, exclusive: int, reverse: int) -> np.ndarray:
    """The gradient of ``sum(g * CumSum(x))`` with respect to x: y_j sums x_i over the
    i before j (after, with ``reverse``), so x_i reaches the y_j after it (before it):
    the cumulative sum of ``g`` in the other direction, with the same ``exclusive``."""
    return np_cumsum(g, axis, exclusive, 1 - reverse)


def _inputs(dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    X = rng.normal(size=(N, D)).astype(dtype)
    W = (rng.normal(size=(1, D)) + 1).astype(dtype)
    G = rng.normal(size=(N, D)).astype(dtype)
    return X, W, G


def _loss_model(exclusive: int, reverse: int, dtype=np.float32) -> onnx.ModelProto:
    """loss = sum(G * CumSum(X * W, axis=1)), G a fixed (untrained) tensor."""
    X, W, G = _inputs(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("Mul", ["X", "W"], ["h"]),
        helper.make_node(
            "CumSum", ["h", "axis"], ["c"], exclusive=exclusive, reverse=reverse, name="cumsum"
        ),
        helper.make_node("Mul", ["c", "G"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "cumsum",
        [helper.make_tensor_value_info("X", elem, ["N", D])],
        [helper.make_tensor_value_info("loss", elem, [])],
        [
            numpy_helper.from_array(W, "W"),
            numpy_helper.from_array(G, "G"),
            numpy_helper.from_array(np.array(1, np.int64), "axis"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize(("exclusive", "reverse"), FLAGS)
def test_the_numpy_gradient_is_the_derivative(exclusive, reverse):
    """The formula the backends are held to, against central differences (float64)."""
    X, _, G = _inputs(np.float64)
    expected = np_cumsum_grad(G, 1, exclusive, reverse)
    eps = 1e-6
    numeric = np.zeros_like(X)
    for index in np.ndindex(X.shape):
        step = np.zeros_like(X)
        step[index] = eps
        plus = (G * np_cumsum(X + step, 1, exclusive, reverse)).sum()
        minus = (G * np_cumsum(X - step, 1, exclusive, reverse)).sum()
        numeric[index] = (plus - minus) / (2 * eps)
    np.testing.assert_allclose(numeric, expected, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("exclusive", "reverse"), FLAGS)
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_gradients_through_cumsum_equal_numpy(backend, exclusive, reverse, dtype):
    model = _loss_model(exclusive, reverse, dtype)
    gradient = gk.gradient_model(model, "loss", ["X", "W"], backend=backend)
    X, W, G = _inputs(dtype)
    out = gk.run(gradient, {"X": X})
    dh = np_cumsum_grad(G.astype(np.float64), 1, exclusive, reverse)
    loss = (G * np_cumsum(X.astype(np.float64) * W, 1, exclusive, reverse)).sum()
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out["loss"], loss, rtol=rtol)
    np.testing.assert_allclose(out["X_grad"], dh * W, rtol=rtol, atol=rtol)
    np.testing.assert_allclose(
        out["W_grad"], (dh * X).sum(axis=0, keepdims=True), rtol=rtol, atol=rtol
    )
    assert out["X_grad"].dtype == dtype


def _prediction_model(exclusive: int, reverse: int) -> onnx.ModelProto:
    """Y = CumSum(X * W, axis=1), the graph a trainer is given."""
    _, W, _ = _inputs(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["X", "W"], ["h"]),
            helper.make_node(
                "CumSum", ["h", "axis"], ["Y"], exclusive=exclusive, reverse=reverse, name="cs"
            ),
        ],
        "cumsum_prediction",
        [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, ["N", D])],
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["N", D])],
        [
            numpy_helper.from_array(W, "W"),
            numpy_helper.from_array(np.array(1, np.int64), "axis"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("trainer", ["full", "forward_backward"])
@pytest.mark.parametrize(("exclusive", "reverse"), FLAGS)
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_one_sgd_step_through_cumsum_equals_numpy(backend, exclusive, reverse, trainer):
    X, W, _ = _inputs(np.float32)
    y = np.random.default_rng(1).normal(size=(N, D)).astype(np.float32)
    model = _prediction_model(exclusive, reverse)
    settings = dict(weights_to_train=["W"], max_iter=1, batch_size=N, shuffle=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if trainer == "full":
            fitted = OrtGradientOptimizer(
                gk.add_loss_output(model, "squared_error"),
                learning_rate=LR,
                backend=backend,
                **settings,
            ).fit(X, y)
        else:
            fitted = ForwardBackwardTrainer(
                model, optimizer="sgd", schedule=LR, backend=backend, **settings
            ).fit(X, y)
    X64, W64 = X.astype(np.float64), W.astype(np.float64)
    dY = 2 * (np_cumsum(X64 * W64, 1, exclusive, reverse) - y) / y.size
    dW = (np_cumsum_grad(dY, 1, exclusive, reverse) * X64).sum(axis=0, keepdims=True)
    np.testing.assert_allclose(fitted.get_state()["W"], W64 - LR * dW, rtol=1e-5, atol=1e-7)


# -- the rewrite for onnxruntime-training ----------------------------------------------------


def _cumsum_model(shape: list, axis: int | None, exclusive: int, reverse: int) -> onnx.ModelProto:
    """Y = CumSum(X, axis); ``axis`` None: the axis is a graph input (not a constant)."""
    inputs = [helper.make_tensor_value_info("X", onnx.TensorProto.FLOAT, shape)]
    initializers = []
    if axis is None:
        inputs.append(helper.make_tensor_value_info("axis", onnx.TensorProto.INT64, []))
    else:
        initializers.append(numpy_helper.from_array(np.array(axis, np.int64), "axis"))
    graph = helper.make_graph(
        [
            helper.make_node(
                "CumSum", ["X", "axis"], ["Y"], exclusive=exclusive, reverse=reverse, name="cs"
            )
        ],
        "cumsum",
        inputs,
        [helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, shape)],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize(("exclusive", "reverse"), FLAGS)
@pytest.mark.parametrize(
    ("shape", "axis"),
    [(["N", 5], 1), (["N", 5], -1), (["N", 5], 0), ([2, "T", 3], 1), ([2, "T", 3], -2), ([4], 0)],
)
def test_the_rewrite_computes_cumsum(shape, axis, exclusive, reverse):
    """``MatMul`` by the triangle (after a ``Transpose`` for an axis that is not the
    last), equal to CumSum up to float rounding, on onnxruntime and onnx.reference."""
    model = _cumsum_model(shape, axis, exclusive, reverse)
    rewritten = cumsum_as_matmul(model)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "CumSum" not in ops and "MatMul" in ops
    onnx.checker.check_model(rewritten, full_check=True)
    dims = [d if isinstance(d, int) else 7 for d in shape]
    X = np.random.default_rng(3).normal(size=dims).astype(np.float32)
    expected = np_cumsum(X.astype(np.float64), axis, exclusive, reverse)
    for runtime in (
        lambda m: gk.run(m, {"X": X})["Y"],
        lambda m: onnx.reference.ReferenceEvaluator(m).run(None, {"X": X})[0],
    ):
        np.testing.assert_allclose(runtime(rewritten), expected, rtol=1e-5, atol=1e-6)


def test_a_cumsum_of_unknown_axis_is_left():
    model = _cumsum_model(["N", 5], None, 0, 0)
    assert [n.op_type for n in cumsum_as_matmul(model).graph.node] == ["CumSum"]


@requires_ort_training
def test_onnxruntime_training_refuses_a_cumsum_it_cannot_rewrite_naming_native():
    """The axis is a graph input: no triangle to write; the refusal names the node and
    the native backend."""
    model = _cumsum_model(["N", 5], None, 0, 0)
    model.graph.node.append(helper.make_node("ReduceSum", ["Y"], ["loss"], keepdims=0))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []))
    with pytest.raises(gk.MissingGradientError, match=r"'CumSum' \(node 'cs'\).*native"):
        gk.gradient_model(model, "loss", ["X"], backend="ort_training")
