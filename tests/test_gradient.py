"""gradient_model: gradients of whole graphs against finite differences, in float32 and
in float64 (where graphkit lowers the gradient operators onnxruntime implements for
float32 only)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk

ACTIVATIONS = {
    "relu": [helper.make_node("Relu", ["z"], ["a"])],
    "leaky_relu": [helper.make_node("LeakyRelu", ["z"], ["a"], alpha=0.2)],
    "tanh": [helper.make_node("Tanh", ["z"], ["a"])],
    "sigmoid": [helper.make_node("Sigmoid", ["z"], ["a"])],
    "softmax": [helper.make_node("Softmax", ["z"], ["a"], axis=1)],
    "log_softmax": [helper.make_node("LogSoftmax", ["z"], ["a"], axis=-1)],
    "mean_centering": [
        helper.make_node("ReduceMean", ["z"], ["m"], keepdims=1),
        helper.make_node("Sub", ["z", "m"], ["a"]),
    ],
}


def two_layer(activation, dtype, rng):
    elem = TensorProto.DOUBLE if dtype == np.float64 else TensorProto.FLOAT
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["z"]),
        *ACTIVATIONS[activation],
        helper.make_node("Gemm", ["a", "W2", "b2"], ["Y"], transB=1, alpha=0.7),
    ]
    weights = {
        "W": rng.normal(size=(3, 4)),
        "b": rng.normal(size=4),
        "W2": rng.normal(size=(2, 4)),
        "b2": rng.normal(size=2),
    }
    graph = helper.make_graph(
        nodes,
        "two_layer",
        [helper.make_tensor_value_info("X", elem, ["N", 3])],
        [helper.make_tensor_value_info("Y", elem, ["N", 2])],
        [numpy_helper.from_array(v.astype(dtype), k) for k, v in weights.items()],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10
    ), weights


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_gradient_matches_finite_differences(activation, dtype, rng):
    model, weights = two_layer(activation, dtype, rng)
    train = gk.add_loss_output(model, "squared_error")
    grad = gk.gradient_model(gk.initializers_to_inputs(train, weights), "loss", weights)
    X, y = rng.normal(size=(6, 3)).astype(dtype), rng.normal(size=(6, 2)).astype(dtype)
    values = {k: v.astype(dtype) for k, v in weights.items()}
    out = gk.run(grad, {"X": X, "label": y, **values})
    as_inputs = gk.initializers_to_inputs(train, weights)

    def loss(name, value):
        feeds = {"X": X.astype(np.float64), "label": y.astype(np.float64), **weights, name: value}
        return float(
            gk.run(_as_float64(as_inputs) if dtype == np.float32 else as_inputs, feeds)["loss"]
        )

    eps = 1e-6
    for name, value in weights.items():
        expected = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            up, down = value.copy(), value.copy()
            up[index] += eps
            down[index] -= eps
            expected[index] = (loss(name, up) - loss(name, down)) / (2 * eps)
        tol = 1e-6 if dtype == np.float64 else 2e-3
        assert out[f"{name}_grad"].dtype == dtype
        np.testing.assert_allclose(out[f"{name}_grad"], expected, rtol=tol, atol=tol)


def _as_float64(model):
    """The same graph in float64: the finite-difference reference of a float32 graph."""
    copy = type(model)()
    copy.CopyFrom(model)
    for value in [*copy.graph.input, *copy.graph.output]:
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for init in copy.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name)
            )
    for node in copy.graph.node:
        for attr in node.attribute:
            if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(
                    numpy_helper.from_array(
                        numpy_helper.to_array(attr.t).astype(np.float64), attr.t.name
                    )
                )
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.DOUBLE
    return copy


def test_unknown_names(rng):
    model, _ = two_layer("relu", np.float64, rng)
    train = gk.add_loss_output(model)
    with pytest.raises(gk.UnknownNameError, match="not an output"):
        gk.gradient_model(train, "cost", ["W"])
    with pytest.raises(gk.UnknownNameError, match=r"\['V'\]"):
        gk.gradient_model(train, "loss", ["V"])
