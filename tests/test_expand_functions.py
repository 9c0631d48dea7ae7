"""graphkit/expand_functions.py: operators newer than opset 21 (opset 23's Attention,
RMSNormalization and RotaryEmbedding, Swish, SwiGLU) replaced by onnx's own function
bodies for them, against onnx.reference's kernels of the operators (outputs) and torch
(a dynamo export at opset 23, trained on both backends)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS, assert_sgd_epoch_equals_torch, requires_torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import graphkit as gk
from graphkit import backends
from graphkit.compat import opset_of
from graphkit.errors import IncompatibleModelError
from graphkit.expand_functions import new_operators_expanded
from graphkit.prepare import standard_model

F32 = TensorProto.FLOAT


def _model(node, inputs, inits=None, opset=23) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, F32, s) for n, s in inputs.items()],
        [
            helper.make_tensor_value_info(
                node.output[0], F32, [None] * len(next(iter(inputs.values())))
            )
        ],
        [numpy_helper.from_array(v, k) for k, v in (inits or {}).items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=11)


CASES = {  # (node, inputs, initializers, opset)
    "attention, causal, 4-D": (
        helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=1),
        {"Q": [2, 3, 5, 4], "K": [2, 3, 5, 4], "V": [2, 3, 5, 4]},
        None,
        23,
    ),
    "attention, grouped heads, 3-D, scale": (
        helper.make_node(
            "Attention", ["Q", "K", "V"], ["Y"], q_num_heads=4, kv_num_heads=2, scale=0.3
        ),
        {"Q": [2, 5, 16], "K": [2, 6, 8], "V": [2, 6, 8]},
        None,
        23,
    ),
    "attention, additive mask": (
        helper.make_node("Attention", ["Q", "K", "V", "M"], ["Y"]),
        {"Q": [1, 2, 3, 4], "K": [1, 2, 3, 4], "V": [1, 2, 3, 4], "M": [3, 3]},
        None,
        23,
    ),
    "rms normalization": (
        helper.make_node("RMSNormalization", ["X", "S"], ["Y"], axis=-1, epsilon=1e-5),
        {"X": [3, 4, 6]},
        {"S": np.linspace(0.5, 1.5, 6).astype(np.float32)},
        23,
    ),
}


_ROTARY_POSITIONS = np.array([[0, 1, 2, 3], [4, 5, 6, 7]], np.int64)
_ANGLES = np.outer(np.arange(8), [1.0, 0.1]).astype(np.float32)
CASES.update(
    {  # fixed bodies with attributes bound, nested ones
        "swish, alpha given (opset 24)": (
            helper.make_node("Swish", ["X"], ["Y"], alpha=0.7),
            {"X": [3, 5]},
            None,
            24,
        ),
        "swish, alpha defaulted": (
            helper.make_node("Swish", ["X"], ["Y"]),
            {"X": [3, 5]},
            None,
            24,
        ),
        "swiglu, a body holding a swish (opset 28)": (
            helper.make_node("SwiGLU", ["X", "B"], ["Y"], alpha=1.5),
            {"X": [3, 5], "B": [3, 5]},
            None,
            28,
        ),
        "rotary embedding (opset 23)": (
            helper.make_node(
                "RotaryEmbedding", ["X", "cos", "sin", "positions"], ["Y"], interleaved=1
            ),
            {"X": [2, 2, 4, 4]},
            {"cos": np.cos(_ANGLES), "sin": np.sin(_ANGLES), "positions": _ROTARY_POSITIONS},
            23,
        ),
    }
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_newer_operator_with_a_body_is_expanded(case):
    """Any operator opset 21 lacks and onnx defines a body for, fixed (its attributes
    bound, or their defaults) or context-dependent, against onnx.reference's own kernel
    of the operator; the model then converts down to graphkit's ceiling."""
    node, inputs, inits, opset = CASES[case]
    original = _model(node, inputs, inits, opset=opset)
    expanded = new_operators_expanded(original)
    assert not {node.op_type, "Swish"} & {n.op_type for n in expanded.graph.node}
    onnx.checker.check_model(expanded, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {n: rng.normal(size=s).astype(np.float32) for n, s in inputs.items()}
    (got,) = ReferenceEvaluator(expanded).run(None, feeds)
    (expected,) = ReferenceEvaluator(original).run(None, feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    converted = standard_model(original)  # then down to graphkit's ceiling
    assert {o.version for o in converted.opset_import if o.domain in ("", "ai.onnx")} == {21}


def _float64_weighted(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` in float64, its output ``Y`` weighted by fixed random ``R`` into ``Z``
    (so that a gradient of the sum sees every entry differently)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for value in [*out.graph.input, *out.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    for tensor in out.graph.initializer:
        array = numpy_helper.to_array(tensor)
        if array.dtype == np.float32:
            tensor.CopyFrom(numpy_helper.from_array(array.astype(np.float64), tensor.name))
    out.graph.output[0].name = "Z"
    out.graph.node.append(helper.make_node("Mul", ["Y", "R"], ["Z"]))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_newer_operator_is_differentiated_at_the_opset_the_runtime_loads(case):
    """On the native backend a model keeps its opset up to what onnxruntime loads (the
    operator itself runs the forward) and goes down to it past that (onnx's body runs
    it): either way d sum(R * Y) / d inputs equals central finite differences of
    onnx.reference's kernel of the operator, in float64."""
    node, inputs, inits, opset = CASES[case]
    model = _model(node, inputs, inits, opset=opset)
    shape = (
        ReferenceEvaluator(model)
        .run(None, {n: np.zeros(s, np.float32) for n, s in inputs.items()})[0]
        .shape
    )
    rng = np.random.default_rng(0)
    model = _float64_weighted(model)
    model.graph.initializer.append(numpy_helper.from_array(rng.normal(size=shape), "R"))
    native = backends.get("native")
    standard = standard_model(model, ceiling=native.ceiling)
    assert opset_of(standard) == min(opset, native.ceiling.opset)
    names = list(inputs)
    gradient = gk.gradient_model(standard, "Z", names, backend=native)
    feeds = {n: rng.normal(size=s) for n, s in inputs.items()}
    got = gk.run(gradient, feeds)
    reference = ReferenceEvaluator(model)
    eps = 1e-6
    for name in names:
        expected = np.zeros(inputs[name])
        for index in np.ndindex(*inputs[name]):
            sums = []
            for step in (eps, -eps):
                moved = {**feeds, name: feeds[name].copy()}
                moved[name][index] += step
                sums.append(float(reference.run(None, moved)[0].sum()))
            expected[index] = (sums[0] - sums[1]) / (2 * eps)
        np.testing.assert_allclose(
            got[f"{name}_grad"], expected, rtol=1e-6, atol=1e-7, err_msg=name
        )


def test_an_operator_without_a_body_is_left_to_the_conversion_which_names_it():
    node = helper.make_node("CumProd", ["X", "axis"], ["Y"])
    model = _model(node, {"X": [3, 4]}, {"axis": np.array(0, np.int64)}, opset=26)
    assert new_operators_expanded(model) is model
    with pytest.raises(IncompatibleModelError, match="opset 26.*No Previous Version of CumProd"):
        standard_model(model)


def test_a_model_at_opset_23_is_taken_down_to_graphkits_ceiling():
    node, inputs, inits, _ = CASES["rms normalization"]
    standard = standard_model(_model(node, inputs, inits))
    assert {o.version for o in standard.opset_import if o.domain in ("", "ai.onnx")} == {21}
    assert standard.ir_version <= 10


def _attention_block_at_opset_23(X: np.ndarray):
    """A torch block (RMSNorm, fused q/k/v projection, causal attention, a head) and its
    dynamo export at opset 23, where F.scaled_dot_product_attention is written as
    Attention and nn.RMSNorm as RMSNormalization."""
    import contextlib
    import io
    import warnings

    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.RMSNorm(8)
            self.qkv = torch.nn.Linear(8, 24)
            self.out = torch.nn.Linear(8, 1)

        def forward(self, x):
            q, k, v = self.qkv(self.norm(x)).reshape(x.shape[0], 6, 3, 2, 4).permute(2, 0, 3, 1, 4)
            h = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(h.transpose(1, 2).reshape(x.shape[0], 6, 8)).mean(1)

    torch.manual_seed(0)
    net = Block()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        onx = torch.onnx.export(
            net,
            (torch.from_numpy(X[:2]),),
            dynamo=True,
            optimize=False,
            opset_version=23,
            input_names=["X"],
            dynamic_shapes=({0: torch.export.Dim("N", min=1)},),
        ).model_proto
    assert {"Attention", "RMSNormalization"} <= {n.op_type for n in onx.graph.node}
    return net, onx


@requires_torch
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_an_opset_23_attention_block_trains_as_torch(backend):
    """An SGD epoch of the opset-23 block equals torch's within 1e-5: at opset 23 where the
    backend's onnxruntime loads it (native on onnxruntime >= 1.23), its Attention kept
    in the trained model; expanded and at opset 21 elsewhere."""
    import torch

    rng = np.random.default_rng(3)
    X = rng.normal(size=(16, 6, 8)).astype(np.float32)
    y = rng.normal(size=(16, 1)).astype(np.float32)
    net, onx = _attention_block_at_opset_23(X)
    trainer = assert_sgd_epoch_equals_torch(onx, net, X, y, backend)
    trained = trainer.get_trained_onnx()
    kept = backends.get(backend).ceiling.opset >= 23
    assert opset_of(trained) == (23 if kept else 21)
    assert ("Attention" in {n.op_type for n in trained.graph.node}) is kept
    onnx.checker.check_model(trained, full_check=True)
    with torch.no_grad():
        expected = net(torch.from_numpy(X)).numpy()
    (got,) = gk.run(trained, {"X": X}).values()
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@requires_torch
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_an_opset_23_attention_block_as_a_torch_layer_has_torchs_gradients(backend):
    """OnnxModule (forward/backward) of the opset-23 block: outputs, the input's gradient
    and every weight's gradient equal torch autograd's."""
    import torch

    from graphkit_train.torch_module import OnnxModule

    X = np.random.default_rng(4).normal(size=(5, 6, 8)).astype(np.float32)
    net, onx = _attention_block_at_opset_23(X)
    layer = OnnxModule(onx, list(net.state_dict()), backend=backend)
    ours, theirs = torch.from_numpy(X).requires_grad_(), torch.from_numpy(X).requires_grad_()
    got, expected = layer(ours), net(theirs)
    (got**2).sum().backward()
    (expected**2).sum().backward()
    np.testing.assert_allclose(
        got.detach().numpy(), expected.detach().numpy(), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(ours.grad.numpy(), theirs.grad.numpy(), rtol=1e-4, atol=1e-6)
    weights = dict(layer.named_parameters())  # torch's names, "." written "_"
    assert len(weights) == len(dict(net.named_parameters()))
    for name, parameter in net.named_parameters():
        np.testing.assert_allclose(
            weights[name.replace(".", "_")].grad.numpy(),
            parameter.grad.numpy(),
            rtol=1e-4,
            atol=1e-6,
            err_msg=name,
        )
