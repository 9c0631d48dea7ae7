"""``CastLike`` of a known type rewritten as ``Cast`` before differentiation
(:mod:`graphkit.castlike`): torch's dynamo exporter (``optimize=False``) writes one for
``nn.RMSNorm``'s ``type_as``, and onnxruntime-training has no gradient for it."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnx.reference
import pytest
from conftest import INSTALLED_BACKENDS, export_dynamo, requires_ort_training
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit.backends.ort_training.rewrites import prepare as ort_training_prepare
from graphkit.castlike import castlike_as_cast
from graphkit_train import ForwardBackwardTrainer, OrtGradientOptimizer

N, K, H = 6, 3, 2
LR = 0.1


def _castlike_model(opset: int = 18) -> onnx.ModelProto:
    """Y = tanh(X W) + b, computed through float64 and cast back by three ``CastLike``:
    like a graph input (X), an initializer (W) and an intermediate typed only by shape
    inference (h). Every cast is exact (float32 -> float64 -> float32)."""
    rng = np.random.default_rng(0)
    W = rng.normal(size=(K, H)).astype(np.float32)
    b = rng.normal(size=H).astype(np.float32)
    double = TensorProto.DOUBLE
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h"]),
        helper.make_node("Cast", ["h"], ["h64"], to=double),
        helper.make_node("CastLike", ["h64", "X"], ["a"], name="like_input"),
        helper.make_node("Tanh", ["a"], ["t"]),
        helper.make_node("Cast", ["t"], ["t64"], to=double),
        helper.make_node("CastLike", ["t64", "W"], ["f"], name="like_initializer"),
        helper.make_node("Cast", ["f"], ["f64"], to=double),
        helper.make_node("CastLike", ["f64", "h"], ["y0"], name="like_inferred"),
        helper.make_node("Add", ["y0", "b"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "castlike",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", H])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(b, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.normal(size=(N, K)).astype(np.float32), rng.normal(size=(N, H)).astype(np.float32)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_each_known_type_becomes_a_cast():
    model = _castlike_model()
    rewritten = castlike_as_cast(model)
    assert "CastLike" not in _ops(rewritten)
    casts = {n.name: n for n in rewritten.graph.node if n.name.startswith("like_")}
    assert sorted(casts) == ["like_inferred", "like_initializer", "like_input"]
    for node in casts.values():
        assert node.op_type == "Cast"
        assert helper.get_attribute_value(node.attribute[0]) == TensorProto.FLOAT
    assert "CastLike" in _ops(model)  # the original is left as it was
    onnx.checker.check_model(rewritten, full_check=True)


def test_the_rewritten_graph_computes_the_same_outputs():
    model = _castlike_model()
    X, _ = _data()
    expected = onnx.reference.ReferenceEvaluator(model).run(None, {"X": X})
    got = onnx.reference.ReferenceEvaluator(castlike_as_cast(model)).run(None, {"X": X})
    np.testing.assert_array_equal(got[0], expected[0])


def test_saturate_is_kept_from_opset_19():
    """``saturate=0`` (float8 overflow gives NaN instead of the largest value) carries
    over to the ``Cast``, which computes the same."""
    like = numpy_helper.from_array(np.zeros(1, np.float32), "like32")
    like8 = helper.make_tensor("like8", TensorProto.FLOAT8E4M3FN, [1], [0.0])
    graph = helper.make_graph(
        [helper.make_node("CastLike", ["X", "like8"], ["Y"], saturate=0)],
        "saturate",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT8E4M3FN, [4])],
        [like, like8],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)], ir_version=10)
    rewritten = castlike_as_cast(model)
    (cast,) = rewritten.graph.node
    attributes = {a.name: helper.get_attribute_value(a) for a in cast.attribute}
    assert cast.op_type == "Cast"
    assert attributes == {"to": TensorProto.FLOAT8E4M3FN, "saturate": 0}
    assert [t.name for t in rewritten.graph.initializer] == ["like32"]  # like8 no longer read
    X = np.array([1.0, -2.5, 1000.0, -1000.0], np.float32)
    expected = onnx.reference.ReferenceEvaluator(model).run(None, {"X": X})[0]
    got = onnx.reference.ReferenceEvaluator(rewritten).run(None, {"X": X})[0]
    np.testing.assert_array_equal(got.view(np.uint8), expected.view(np.uint8))


def test_a_castlike_of_unknown_type_is_left():
    """``like`` is the output of an operator onnx knows nothing of: no type to cast to."""
    graph = helper.make_graph(
        [
            helper.make_node("Mystery", ["X"], ["like"], domain="example.custom"),
            helper.make_node("CastLike", ["X", "like"], ["unknown"], name="unknown"),
            helper.make_node("CastLike", ["unknown", "X"], ["Y"], name="known"),
        ],
        "unknown",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", K])],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("example.custom", 1)],
        ir_version=10,
    )
    rewritten = castlike_as_cast(model)
    assert {n.name: n.op_type for n in rewritten.graph.node} == {
        "": "Mystery",
        "unknown": "CastLike",
        "known": "Cast",
    }


def _numpy_sgd_step(X: np.ndarray, y: np.ndarray, W: np.ndarray, b: np.ndarray):
    """One SGD step of mean((tanh(X W) + b - y)^2) (mean over all N H values)."""
    X, y, W, b = (v.astype(np.float64) for v in (X, y, W, b))
    t = np.tanh(X @ W)
    dY = 2 * (t + b - y) / y.size
    dW = X.T @ (dY * (1 - t**2))
    db = dY.sum(axis=0)
    return W - LR * dW, b - LR * db


@pytest.mark.parametrize("trainer", ["full", "forward_backward"])
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_a_castlike_on_the_gradient_path_trains_like_numpy(backend, trainer):
    model = _castlike_model()
    X, y = _data()
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    settings = dict(
        weights_to_train=["W", "b"],
        max_iter=1,
        batch_size=N,
        shuffle=False,
        backend=backend,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if trainer == "full":
            fitted = OrtGradientOptimizer(
                gk.add_loss_output(model, "squared_error"), learning_rate=LR, **settings
            ).fit(X, y)
        else:
            fitted = ForwardBackwardTrainer(
                model, loss="squared_error", optimizer="sgd", schedule=LR, **settings
            ).fit(X, y)
    state = fitted.get_state()
    W, b = _numpy_sgd_step(X, y, inits["W"], inits["b"])
    np.testing.assert_allclose(state["W"], W, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state["b"], b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_gradient_model_of_a_graph_with_castlike(backend):
    """A graph given to :func:`graphkit.gradient_model` as it is: onnxruntime-training's
    own rewrites resolve the ``CastLike`` there."""
    model = _castlike_model()
    X, _ = _data()
    model.graph.node.append(helper.make_node("ReduceSum", ["Y"], ["total"], keepdims=0))
    model.graph.output.append(helper.make_tensor_value_info("total", TensorProto.FLOAT, []))
    gradient = gk.gradient_model(model, "total", ["W"], backend=backend)
    W = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    t = np.tanh(X.astype(np.float64) @ W)
    expected = X.T.astype(np.float64) @ (1 - t**2)
    np.testing.assert_allclose(gk.run(gradient, {"X": X})["W_grad"], expected, rtol=1e-5)


@requires_ort_training
def test_onnxruntime_training_prepare_rewrites_castlike():
    assert "CastLike" not in _ops(ort_training_prepare(_castlike_model()))


# -- a real export ---------------------------------------------------------------------------


def _rms_norm_net():
    torch = pytest.importorskip("torch")

    class RMSNormHead(torch.nn.Module):
        """nn.RMSNorm then a Linear: dynamo writes RMSNorm's ``type_as(x)`` of its result
        as ``CastLike(result, x)`` (the hand-written formula ``x * rsqrt(mean(x^2) + eps)
        * weight`` exports with no CastLike)."""

        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.RMSNorm(4, eps=1e-6)
            self.linear = torch.nn.Linear(4, K)

        def forward(self, x):
            return self.linear(self.norm(x))

    torch.manual_seed(0)
    net = RMSNormHead().eval()
    with torch.no_grad():
        net.norm.weight.copy_(torch.rand(4) + 0.5)
    return net


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_a_dynamo_rms_norm_export_trains_like_torch(backend):
    torch = pytest.importorskip("torch")
    onx = export_dynamo(
        _rms_norm_net(), np.random.default_rng(0).normal(size=(2, 4)).astype(np.float32)
    )
    assert "CastLike" in _ops(onx), "the dynamo export is expected to hold a CastLike"
    rng = np.random.default_rng(2)
    X = rng.normal(size=(8, 4)).astype(np.float32)
    y = rng.normal(size=(8, K)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = OrtGradientOptimizer(
            gk.add_loss_output(onx, "squared_error"),
            max_iter=3,
            batch_size=len(X),
            shuffle=False,
            learning_rate=LR,
            backend=backend,
        ).fit(X, y)
    net = _rms_norm_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(torch.from_numpy(X)), torch.from_numpy(y)).backward()
        optimizer.step()
    state = trainer.get_state()
    for name, parameter in net.named_parameters():
        np.testing.assert_allclose(
            state[name], parameter.detach().numpy(), rtol=1e-5, atol=1e-7, err_msg=name
        )
