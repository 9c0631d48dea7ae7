"""Gathers that take a tensor apart along an axis become one Split
(graphkit.gathers): the same values, the same training, against numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS
from onnx import TensorProto, helper, numpy_helper

from graphkit.engine.ort_engine import inference_session
from graphkit.gathers import gathers_as_split
from graphkit_train import OrtGradientForwardBackwardOptimizer

F32 = TensorProto.FLOAT


def _index(value: int, name: str, as_node: bool):
    """A scalar index, as a Constant node or an initializer."""
    tensor = numpy_helper.from_array(np.array(value, np.int64), name)
    if as_node:
        return [helper.make_node("Constant", [], [name], value=tensor)], []
    return [], [tensor]


def qkv_model(positions=(0, 1, -1), index_shape=()) -> onnx.ModelProto:
    """y = sum(q * k + v, axis 1) with h = x @ W (W 6x12) read as [batch, 3, 4] and q, k,
    v the gathers of ``positions`` on its axis 1 (an attention's fused projection)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Reshape", ["h", "three_by_four"], ["h3"]),
    ]
    inits = [
        numpy_helper.from_array((rng.normal(size=(6, 12)) / 3).astype(np.float32), "W"),
        numpy_helper.from_array(np.array([-1, 3, 4], np.int64), "three_by_four"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    for i, (position, name) in enumerate(zip(positions, "qkv")):
        made, tensors = _index(position, f"i_{name}", as_node=i != 1)
        if index_shape:
            tensors = [
                numpy_helper.from_array(np.full(index_shape, position, np.int64), f"i_{name}")
            ]
            made = []
        nodes += made
        inits += tensors
        nodes.append(helper.make_node("Gather", ["h3", f"i_{name}"], [name], axis=1))
    nodes += [
        helper.make_node("Mul", ["q", "k"], ["qk"]),
        helper.make_node("Add", ["qk", "v"], ["s"]),
        helper.make_node("ReduceSum", ["s", "axis1"], ["y"], keepdims=1),
    ]
    graph = helper.make_graph(
        nodes,
        "qkv",
        [helper.make_tensor_value_info("x", F32, ["N", 6])],
        [helper.make_tensor_value_info("y", F32, ["N", 1])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def numpy_forward(W: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    h = x @ W
    q, k, v = h[:, 0:4], h[:, 4:8], h[:, 8:12]
    return (q * k + v).sum(1, keepdims=True), (q, k, v)


def test_the_gathers_become_one_split_with_the_same_values():
    model = qkv_model()
    rewritten = gathers_as_split(model)
    onnx.checker.check_model(rewritten, full_check=True)
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Gather" not in ops and ops.count("Split") == 1 and ops.count("Squeeze") == 3
    x = np.random.default_rng(1).normal(size=(5, 6)).astype(np.float32)
    W = numpy_helper.to_array(model.graph.initializer[0])
    (y,) = inference_session(rewritten).run(None, {"x": x})
    np.testing.assert_allclose(y, numpy_forward(W, x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "positions, index_shape",
    [((0, 1, 1), ()), ((0, 1), ()), ((0, 1, 2), (1,)), ((0, 1, 3), ())],
    ids=["position 2 unread", "two of three", "1-D indices", "out of range"],
)
def test_gathers_that_do_not_take_the_axis_apart_stay(positions, index_shape):
    """Only gathers that read every position once, by scalar index, are a Split."""
    if len(positions) == 2:
        model = qkv_model((0, 1, 1))
        model.graph.node[-3].input[1] = "k"  # q * k + k: v unread
    else:
        model = qkv_model(positions, index_shape)
    assert gathers_as_split(model) is model


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_training_through_the_split_follows_numpy_sgd(backend):
    """Forward/backward SGD on the squared error through the rewritten gathers: dh is
    [dy k, dy q, dy] laid side by side (the Split's gradient, a Concat)."""
    model = qkv_model()
    rng = np.random.default_rng(2)
    X = rng.normal(size=(16, 6)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    trainer = OrtGradientForwardBackwardOptimizer(
        model,
        ["W"],
        max_iter=3,
        batch_size=8,
        shuffle=False,
        learning_loss="squared_error",
        learning_rate=0.05,
        backend=backend,
    ).fit(X, y)
    assert "Split" in [n.op_type for n in trainer.forward_backward_._model.graph.node]
    W = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    for _ in range(3):
        for start in range(0, 16, 8):
            x, t = X[start : start + 8].astype(np.float64), y[start : start + 8]
            pred, (q, k, _) = numpy_forward(W, x)
            dy = 2 * (pred - t) / len(x)
            dh = np.concatenate([dy * k, dy * q, np.broadcast_to(dy, q.shape)], axis=1)
            W = W - 0.05 * x.T @ dh
    np.testing.assert_allclose(trainer.get_state()["W"], W, rtol=2e-4, atol=1e-6)


def test_an_index_a_graph_input_can_override_is_not_a_constant():
    """An initializer that is also a graph input can be fed another value at run time."""
    model = qkv_model()
    model.graph.input.append(helper.make_tensor_value_info("i_k", TensorProto.INT64, []))
    assert gathers_as_split(model) is model
