"""The native backend's fused-gate LSTM (graphkit/backends/native/lstm.py) against
onnxruntime's LSTM kernel (outputs) and torch's autograd (gradients)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import requires_torch
from onnx import TensorProto, helper, numpy_helper
from test_native import (
    RECURRENT,
    _Recurrent,
    assert_native_equals_torch,
    native_gradient,
    zoo_training,
)

from graphkit.backends.native import NativeBackend
from graphkit.backends.native.lstm import lstms_as_scans
from graphkit.engine.ort_engine import Runner
from graphkit.static_shapes import specialize

F32 = TensorProto.FLOAT
T, H, I = 6, 5, 3


def lstm_model(
    inputs: list[str], rng, outputs=("Y", "Y_h", "Y_c"), opset: int = 18, **attrs
) -> onnx.ModelProto:
    """One LSTM over X [T, N, I]; ``inputs`` names its inputs (W, R, B initializers; X,
    initial_h, initial_c graph inputs; '' for one left out)."""
    values = {
        "W": rng.normal(size=(1, 4 * H, I)),
        "R": rng.normal(size=(1, 4 * H, H)) * 0.5,
        "B": rng.normal(size=(1, 8 * H)),
        "P": rng.normal(size=(1, 3 * H)),
        "lens": None,
    }
    shapes = {"X": [T, "N", I], "h0": [1, "N", H], "c0": [1, "N", H]}
    graph = helper.make_graph(
        [helper.make_node("LSTM", inputs, list(outputs), hidden_size=H, **attrs)],
        "lstm",
        [helper.make_tensor_value_info(n, F32, shapes[n]) for n in inputs if n in shapes]
        + [helper.make_tensor_value_info("lens", TensorProto.INT32, ["N"])] * ("lens" in inputs),
        [
            helper.make_tensor_value_info(o, F32, [T, 1, "N", H] if o == "Y" else [1, "N", H])
            for o in outputs
            if o
        ],
        [
            numpy_helper.from_array(values[n].astype(np.float32), n)
            for n in inputs
            if n in ("W", "R", "B", "P")
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def feeds_for(model: onnx.ModelProto, rng, batch: int = 4) -> dict[str, np.ndarray]:
    feeds = {}
    for value in model.graph.input:
        if value.name == "lens":
            feeds["lens"] = np.full(batch, T, np.int32)
        else:
            dims = [batch if d.dim_param else d.dim_value for d in value.type.tensor_type.shape.dim]
            feeds[value.name] = rng.normal(size=dims).astype(np.float32)
    return feeds


WRITTEN = {
    "forward, bias, initial states": (["X", "W", "R", "B", "", "h0", "c0"], {}),
    "forward, no bias, zero states": (["X", "W", "R"], {}),
    "reverse": (["X", "W", "R", "B"], {"direction": "reverse"}),
    "initial cell only": (["X", "W", "R", "B", "", "", "c0"], {}),
}


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("case", sorted(WRITTEN))
@pytest.mark.parametrize("outputs", [("Y", "Y_h", "Y_c"), ("", "Y_h"), ("Y",)])
def test_the_fused_gate_scan_computes_the_lstm_kernels_outputs(case, outputs, opset, rng):
    inputs, attrs = WRITTEN[case]
    model = lstm_model(inputs, rng, outputs, opset=opset, **attrs)
    written = lstms_as_scans(model)
    assert "LSTM" not in {n.op_type for n in written.graph.node}
    onnx.checker.check_model(written, full_check=True)
    for batch in (4, 1):
        feeds = feeds_for(model, rng, batch)
        for got, expected in zip(Runner(written)(feeds), Runner(model)(feeds)):
            assert got.shape == expected.shape
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


LEFT = {
    "bidirectional": (["X", "W", "R"], {"direction": "bidirectional"}),
    "peepholes": (["X", "W", "R", "B", "", "", "", "P"], {}),
    "clip": (["X", "W", "R"], {"clip": 2.0}),
    "input_forget": (["X", "W", "R"], {"input_forget": 1}),
    "sequence_lens": (["X", "W", "R", "B", "lens"], {}),
    "other activations": (["X", "W", "R"], {"activations": ["Sigmoid", "Relu", "Tanh"]}),
}


@pytest.mark.parametrize("case", sorted(LEFT))
def test_other_lstms_are_left_to_onnx_ad(case, rng):
    inputs, attrs = LEFT[case]
    model = lstm_model(inputs, rng, **attrs)
    assert lstms_as_scans(model) is model


def test_the_native_backend_prepares_lstms_so(rng):
    model = lstm_model(["X", "W", "R", "B"], rng)
    prepared = NativeBackend().prepare(model)
    assert "Scan" in {n.op_type for n in prepared.graph.node}


@requires_torch
@pytest.mark.parametrize("case", [c for c in RECURRENT if c.id.startswith("LSTM")])
def test_fused_gate_gradients_equal_torch_autograd(case):
    """The zoo's LSTM classifier (torch-exported: the gates reordered by Slice and
    Concat before the LSTM) once written with fused gates: its native gradients equal
    torch's at two batch sizes."""
    import torch

    train, weights, data = zoo_training(case)
    written = lstms_as_scans(train)
    assert "LSTM" not in {n.op_type for n in written.graph.node}
    torch.manual_seed(0)
    net = _Recurrent("lstm")
    X, y = data.X_train, data.y_train
    batches = [(X[:16], y[:16]), (X[16:21], y[16:21])]
    assert_native_equals_torch(written, weights, net, batches, block=net.rnn.hidden_size)


@requires_torch
@pytest.mark.parametrize("case", [c for c in RECURRENT if c.id.startswith("LSTM")])
def test_specialized_fused_gate_gradients_equal_torch_and_lose_the_seed_plumbing(case):
    """Specialized to a batch size as the trainers run it, the fused-gate LSTM's adjoint
    Scan body (a graph of its own, specialized too) keeps no shape arithmetic and no
    seed-axis plumbing, and its gradients still equal torch's."""
    train, weights, data = zoo_training(case)
    written = lstms_as_scans(train)
    gradient = native_gradient(written, written.graph.output[0].name, weights)
    features = written.graph.input[0].name
    static = specialize(gradient, {features: 16, "y": 16}, NativeBackend().constant_folds)
    bodies = [
        a.g for n in static.graph.node if n.op_type == "Scan" for a in n.attribute if a.g.node
    ]
    assert len(bodies) == 2  # the LSTM's forward and its adjoint
    adjoint = max(bodies, key=lambda g: len(g.node))
    kinds = [n.op_type for n in adjoint.node]
    assert not {"Shape", "NonZero", "ReduceSum", "Unsqueeze", "Expand"} & set(kinds), kinds
    assert kinds.count("Transpose") <= 1  # a MatMul's operand: onnxruntime fuses it
    assert len(kinds) <= 40  # 143 as onnx-ad writes it
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = _Recurrent("lstm")
    X, y = data.X_train, data.y_train
    batches = [(X[:16], y[:16]), (X[16:21], y[16:21])]
    assert_native_equals_torch(
        written, weights, net, batches, block=net.rnn.hidden_size, static=True
    )
