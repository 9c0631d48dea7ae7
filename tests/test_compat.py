"""The IR-version / opset policy: what is converted, what is refused, and the message."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx
from onnx import TensorProto, helper, numpy_helper

from graphkit import IncompatibleModelError, add_loss_output
from graphkit.compat import MAX_IR_VERSION, MAX_OPSET, make_compatible, opset_of
from graphkit.engine.ort_engine import Runner


def model_with(ir_version, opset, coef):
    model = linear_regression_onnx(coef, np.zeros(1))
    model.ir_version = ir_version
    model.opset_import[0].version = opset
    return model


def test_newer_ir_version_is_lowered(rng):
    coef = rng.normal(size=(2, 1))
    model = model_with(11, 18, coef)
    fixed = make_compatible(model)
    assert fixed.ir_version == MAX_IR_VERSION
    X = rng.normal(size=(3, 2))
    np.testing.assert_allclose(Runner(fixed)({"X": X})[0], X @ coef)
    assert add_loss_output(model).ir_version <= MAX_IR_VERSION


def test_opset_22_is_converted_down(rng):
    coef = rng.normal(size=(2, 1))
    fixed = make_compatible(model_with(10, 22, coef))
    assert opset_of(fixed) == MAX_OPSET
    X = rng.normal(size=(3, 2))
    np.testing.assert_allclose(Runner(fixed)({"X": X})[0], X @ coef)


def test_old_opset_is_converted_up_for_training(rng):
    """ReduceMean's axes moved from attribute (13) to input (18): the converter handles it."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "coef"], ["XW"]),
            helper.make_node("ReduceMean", ["XW"], ["Y"], axes=[1], keepdims=1),
        ],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, ["N", 1])],
        [numpy_helper.from_array(rng.normal(size=(2, 3)), "coef")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=7)
    trained = add_loss_output(model)
    assert opset_of(trained) == 18
    X, y = rng.normal(size=(4, 2)), rng.normal(size=(4, 1))
    coef = numpy_helper.to_array(model.graph.initializer[0])
    expected = np.mean(((X @ coef).mean(axis=1, keepdims=True) - y) ** 2)
    assert Runner(trained)({"X": X, "label": y})[0] == pytest.approx(expected, rel=1e-12)


def test_unknown_future_opset_is_refused_with_advice(rng):
    with pytest.raises(IncompatibleModelError, match="opset 30.*opset_version=18"):
        make_compatible(model_with(10, 30, rng.normal(size=(2, 1))))


def test_new_element_type_is_refused(rng):
    model = model_with(11, 18, rng.normal(size=(2, 1)))
    scale = TensorProto(
        name="scale", data_type=23, dims=[2], raw_data=b"\x21"
    )  # FLOAT4E2M1 (IR 11)
    model.graph.initializer.append(scale)
    with pytest.raises(IncompatibleModelError, match="IR version 11.*(FLOAT4E2M1|element type 23)"):
        make_compatible(model)


def test_model_without_default_opset_is_refused(rng):
    model = model_with(10, 18, rng.normal(size=(2, 1)))
    model.opset_import[0].domain = "ai.onnx.ml"
    with pytest.raises(IncompatibleModelError, match="no ai.onnx opset"):
        make_compatible(model)


def test_already_compatible_model_is_unchanged(rng):
    model = model_with(10, 18, rng.normal(size=(2, 1)))
    assert make_compatible(model).SerializeToString() == model.SerializeToString()
    onnx.checker.check_model(make_compatible(model))


def test_inputs_and_outputs_without_a_shape():
    """onnx.checker refuses an input or output that declares its element type but no
    shape (onnxruntime runs it): an output gets the shape inference gives it, and trains
    like numpy's SGD; an input, which nothing can tell, is refused naming it."""
    import graphkit as gk
    from graphkit_train import Trainer

    W = np.array([[0.5], [-0.25], [1.0]], np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])],
        "shapeless",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(W, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    rng = np.random.default_rng(0)
    X = rng.normal(size=(8, 3)).astype(np.float32)
    y = rng.normal(size=8).astype(np.float32)
    fitted = Trainer(model, loss="squared_error", optimizer="sgd", batch_size=8, max_iter=1)
    fitted.fit(X, y)
    gradient = 2 * X.T @ (X @ W - y[:, None]) / 8  # one batch of mean squared error
    np.testing.assert_allclose(fitted.get_state()["W"], W - 0.01 * gradient, rtol=1e-5)

    graph.input[0].type.tensor_type.ClearField("shape")
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(gk.IncompatibleModelError, match=r"\['X', 'Y'\] declare an element type"):
        gk.add_loss_output(model, "squared_error")
