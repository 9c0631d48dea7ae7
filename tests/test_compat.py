"""The IR-version / opset policy: what is converted, what is refused, and the message."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx
from onnx import TensorProto, helper, numpy_helper

from graphkit import IncompatibleModelError, add_loss_output
from graphkit.compat import (
    MAX_IR_VERSION,
    MAX_OPSET,
    PORTABLE,
    Ceiling,
    finalize,
    make_compatible,
    opset_of,
)
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


# -- a backend's ceiling: what its onnxruntime loads ----------------------------------------

# what each onnxruntime this project installs loads, found by hand: 1.19.2 is
# onnxruntime-training's, 1.20.0 the floors', 1.32.0 the plain wheel on CPython 3.11 and 3.13
KNOWN_CEILINGS = {"1.19.2": Ceiling(10, 21), "1.20.0": Ceiling(10, 21), "1.32.0": Ceiling(14, 28)}


def test_the_runtime_ceiling_is_what_that_onnxruntime_loads():
    from graphkit.engine import ort_engine

    version = ort_engine.version()
    if version not in KNOWN_CEILINGS:
        pytest.skip(f"no ceiling recorded for onnxruntime {version}")
    assert ort_engine.runtime_ceiling() == KNOWN_CEILINGS[version]


def test_each_backend_writes_up_to_its_ceiling():
    """native: what its onnxruntime loads; ort_training: opset 21 and IR 10 always."""
    from graphkit import backends
    from graphkit.engine import ort_engine

    installed = {b.name for b in backends.available() if b.installed}
    if "native" in installed:
        assert backends.get("native").ceiling == ort_engine.runtime_ceiling()
    if "ort_training" in installed:
        assert backends.get("ort_training").ceiling == PORTABLE == Ceiling(10, 21)


def _attention_model(opset: int) -> onnx.ModelProto:
    """``Y = Attention(X W_q, X W_k, X W_v)``, a model of ``opset`` (23 or later)."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["X", f"W{c}"], [c]) for c in "qkv"]
    nodes.append(
        helper.make_node("Attention", ["q", "k", "v"], ["Y"], q_num_heads=2, kv_num_heads=2)
    )
    graph = helper.make_graph(
        nodes,
        "attention",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3, 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3, 4])],
        [
            numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), f"W{c}")
            for c in "qkv"
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)


@pytest.mark.parametrize(
    "ceiling, kept",
    [(Ceiling(11, 23), True), (Ceiling(11, 22), False), (PORTABLE, False)],
    ids=["opset 23 kept", "down to 22", "down to 21"],
)
def test_a_model_is_converted_down_to_the_ceiling_and_no_further(ceiling, kept):
    """At or under the ceiling a model keeps its opset and its Attention; above it, the
    Attention is onnx's function body and the opset the ceiling's. Either way it computes
    what onnx.reference's Attention kernel computes on the original."""
    from onnx.reference import ReferenceEvaluator

    model = _attention_model(23)
    converted = make_compatible(model, ceiling=ceiling)
    assert opset_of(converted) == min(23, ceiling.opset)
    assert converted.ir_version <= ceiling.ir_version
    assert ("Attention" in {n.op_type for n in converted.graph.node}) is kept
    X = np.random.default_rng(1).normal(size=(2, 3, 4)).astype(np.float32)
    (expected,) = ReferenceEvaluator(model).run(None, {"X": X})
    (got,) = ReferenceEvaluator(converted).run(None, {"X": X})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opset, ir", [(18, 10), (21, 10), (23, 11), (24, 12), (28, 14)])
def test_finalize_writes_the_ir_version_an_opset_needs(opset, ir):
    """onnx >= 1.18 stamps its newest IR version; an opset-21 model must say 10 for
    onnxruntime 1.19.2 to load it, an opset-23 one needs 11 (onnx's versioning table)."""
    model = _attention_model(23) if opset >= 23 else model_with(10, opset, np.ones((2, 1)))
    model.opset_import[0].version = opset
    model.ir_version = onnx.IR_VERSION
    assert finalize(model, check=False).ir_version == ir


def test_finalize_keeps_the_ir_version_newer_element_types_need(rng):
    """An opset-21 model holding a FLOAT4E2M1 tensor, as a backend whose ceiling is IR 11
    or newer takes it, keeps IR 11: the IR version that type arrived in (onnx's
    TensorProto docs), where opset 21 alone needs only 10."""
    model = model_with(11, 21, rng.normal(size=(2, 1)))
    model.graph.initializer.append(
        TensorProto(name="scale", data_type=23, dims=[2], raw_data=b"\x21")
    )
    assert finalize(model, check=False).ir_version == 11
    onnx.checker.check_model(model)
