"""Bad input gets a clear graphkit error, never a crash, a raw onnxruntime message or a
silently wrong result; the graph rewrites that avoid crashes compute the same function."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit.backends.ort_training.rewrites import average_pool_as_conv, unfold_batch_norm
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer


def _softmax_model(columns: int = 4) -> onnx.ModelProto:
    onx = linear_regression_onnx(np.zeros((3, columns), np.float32), np.zeros(columns, np.float32))
    onx.graph.node.append(helper.make_node("Softmax", ["Y"], ["P"], axis=1))
    onx.graph.output[0].name = "P"
    return onx


def _trainer(kind: str, loss: str, onx: onnx.ModelProto):
    if kind == "full":
        return OrtGradientOptimizer(gk.add_loss_output(onx, loss), max_iter=1)
    return OrtGradientForwardBackwardOptimizer(onx, learning_loss=loss, max_iter=1)


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
@pytest.mark.parametrize("loss", ["log", "cross_entropy"])
@pytest.mark.parametrize(
    "labels,shown", [([4], "0 to 4"), ([99], "0 to 99"), ([-1], "-1 to 3"), ("1..4", "1 to 4")]
)
def test_class_labels_outside_the_model_classes(kind, loss, labels, shown, rng):
    """Before: a loss of 0 for those rows (or dropped rows) and a perfect score."""
    X = rng.normal(size=(40, 3)).astype(np.float32)
    y = np.arange(40) % 4
    if labels == "1..4":
        y = y + 1
    else:
        y[5] = labels[0]
    onx = (
        _softmax_model()
        if loss == "log"
        else linear_regression_onnx(np.zeros((3, 4), np.float32), np.zeros(4, np.float32))
    )
    trainer = _trainer(kind, loss, onx)
    with pytest.raises(
        ValueError, match=rf"labels from {shown}; the model predicts 4 classes.*\[0, 3\]"
    ):
        trainer.fit(X, y)
    with pytest.raises(gk.NotFittedError):
        trainer.get_state()  # nothing was trained


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_binary_labels_must_be_0_or_1(kind, rng):
    onx = linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32))
    y = np.arange(30) % 2
    y[0] = 2
    with pytest.raises(ValueError, match="a binary loss takes 0 and 1"):
        _trainer(kind, "sigmoid_log_loss", onx).fit(rng.normal(size=(30, 3)), y)


def test_average_pool_no_longer_kills_the_process():
    """onnxruntime's AveragePoolGrad divides by zero (SIGFPE) on a symbolic batch; the
    forward/backward trainer on a torch CNN with AvgPool2d used to kill the interpreter."""
    pytest.importorskip("torch")
    code = textwrap.dedent(
        """
        import io, warnings
        import numpy as np, onnx, torch
        import graphkit_train as gt
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.AvgPool2d(2),
                                  torch.nn.Flatten(), torch.nn.Linear(8, 3)).eval()
        buffer = io.BytesIO()
        torch.onnx.export(net, (torch.zeros(2, 1, 4, 4),), buffer, input_names=["X"],
                          output_names=["Y"], dynamic_axes={"X": {0: "N"}}, dynamo=False)
        X = np.random.default_rng(0).normal(size=(30, 1, 4, 4)).astype(np.float32)
        y = np.arange(30) % 3
        trainer = gt.OrtGradientForwardBackwardOptimizer(
            onnx.load_from_string(buffer.getvalue()), learning_loss="cross_entropy",
            max_iter=2, batch_size=8).fit(X, y)
        print(len(trainer.train_losses_))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "2"


def _pool_model(**attrs) -> onnx.ModelProto:
    node = helper.make_node("AveragePool", ["X"], ["Y"], **attrs)
    graph = helper.make_graph(
        [node],
        "pool",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2, 7, 6])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize(
    "attrs",
    [
        dict(kernel_shape=[2, 2], strides=[2, 2]),
        dict(kernel_shape=[3, 2], strides=[2, 1], pads=[1, 0, 1, 1]),
        dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
        dict(kernel_shape=[3, 3], strides=[2, 2], auto_pad="SAME_UPPER"),
    ],
)
def test_average_pool_as_conv_matches_onnxruntime(attrs, rng):
    X = rng.normal(size=(3, 2, 7, 6)).astype(np.float32)
    original = gk.run(_pool_model(**attrs), {"X": X})["Y"]
    rewritten = gk.run(average_pool_as_conv(_pool_model(**attrs)), {"X": X})["Y"]
    assert rewritten.shape == original.shape
    np.testing.assert_allclose(rewritten, original, rtol=1e-5, atol=1e-6)


def test_average_pool_with_ceil_mode_is_refused():
    with pytest.raises(gk.MissingGradientError, match="AveragePool.*ceil_mode"):
        average_pool_as_conv(_pool_model(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1))


@pytest.mark.parametrize("shape", [(5, 3), (5, 3, 4, 2)])
def test_unfolded_batch_norm_matches_onnxruntime(shape, rng):
    params = {
        "scale": rng.normal(size=3),
        "bias": rng.normal(size=3),
        "mean": rng.normal(size=3),
        "var": rng.uniform(0.5, 2, size=3),
    }
    graph = helper.make_graph(
        [helper.make_node("BatchNormalization", ["X", *params], ["Y"], epsilon=1e-3)],
        "bn",
        [helper.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", *shape[1:]])],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, ["N", *shape[1:]])],
        [numpy_helper.from_array(v, k) for k, v in params.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    X = rng.normal(size=shape)
    unfolded = unfold_batch_norm(model)
    assert "BatchNormalization" not in {n.op_type for n in unfolded.graph.node}
    np.testing.assert_allclose(
        gk.run(unfolded, {"X": X})["Y"], gk.run(model, {"X": X})["Y"], rtol=1e-12
    )


def test_loss_that_is_not_a_scalar():
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["Y"]),
            helper.make_node("Sub", ["Y", "label"], ["d"]),
            helper.make_node("Mul", ["d", "d"], ["loss"]),
        ],
        "per_sample",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("label", TensorProto.FLOAT, ["N", 1]),
        ],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.zeros((3, 1), np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    with pytest.raises(gk.ShapeError, match="must be a scalar; reduce it"):
        OrtGradientOptimizer(model).fit(np.ones((4, 3)), np.ones(4))


def test_run_converts_a_too_new_opset_and_ir_version(rng):
    onx = linear_regression_onnx(rng.normal(size=(3, 2)), rng.normal(size=2))
    newer = onnx.version_converter.convert_version(onx, 23)
    newer.ir_version = 11
    X = rng.normal(size=(4, 3))
    np.testing.assert_allclose(gk.run(newer, {"X": X})["Y"], gk.run(onx, {"X": X})["Y"])


def test_truncated_or_corrupted_model_files(tmp_path, rng):
    onx = linear_regression_onnx(rng.normal(size=(3, 1)), rng.normal(size=1))
    path = tmp_path / "model.onnx"
    path.write_bytes(onx.SerializeToString()[:30])
    for use in (
        lambda m: gk.add_loss_output(m),
        lambda m: OrtGradientOptimizer(m).fit(np.ones((2, 3)), np.ones(2)),
        lambda m: OrtGradientForwardBackwardOptimizer(m).fit(np.ones((2, 3)), np.ones(2)),
        lambda m: gk.run(m, {"X": np.ones((2, 3))}),
    ):
        with pytest.raises(gk.IncompatibleModelError, match="model.onnx' is not a valid ONNX"):
            use(str(path))
    with pytest.raises(FileNotFoundError, match="missing.onnx"):
        gk.add_loss_output(str(tmp_path / "missing.onnx"))
    with pytest.raises(TypeError, match="not int"):
        gk.add_loss_output(3)


def test_add_loss_output_accepts_a_path_like_the_trainers(tmp_path, rng):
    onx = linear_regression_onnx(rng.normal(size=(3, 1)), rng.normal(size=1))
    onnx.save(onx, tmp_path / "model.onnx")
    from_path = gk.add_loss_output(tmp_path / "model.onnx")
    assert from_path.SerializeToString() == gk.add_loss_output(onx).SerializeToString()


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_empty_data(kind):
    onx = linear_regression_onnx(np.zeros((3, 1)), np.zeros(1))
    trainer = _trainer(kind, "squared_error", onx)
    with pytest.raises(ValueError, match="X is empty"):
        trainer.fit(np.zeros((0, 3)), np.zeros(0))


# -- models as exporters leave them ---------------------------------------------------------

V = helper.make_tensor_value_info
XY = np.ones((8, 3), np.float32), np.ones(8, np.float32)


def _entry_points(model: onnx.ModelProto):
    from graphkit_train import ForwardBackwardTrainer, Trainer

    yield "add_loss_output", lambda: gk.add_loss_output(model)
    yield "Trainer", lambda: Trainer(model, loss="mse", max_iter=1).fit(*XY)
    yield "ForwardBackwardTrainer", lambda: ForwardBackwardTrainer(model, max_iter=1).fit(*XY)


def _one_layer(nodes, elem=TensorProto.FLOAT, out="Y", init_dtype=np.float32, **outputs):
    graph = helper.make_graph(
        nodes,
        "g",
        [V("X", elem, ["N", 3])],
        [V(out, elem, ["N", 1]), *(V(n, elem, ["N", 1]) for n in outputs)],
        [
            numpy_helper.from_array(np.ones((3, 1), init_dtype), "W"),
            numpy_helper.from_array(np.ones((3, 1), init_dtype), "W2"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


ENTRIES = ["add_loss_output", "Trainer", "ForwardBackwardTrainer"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_float16_model_is_refused_for_float16_first(entry):
    """Before: "say which output with output_index" for a model with one output."""
    model = _one_layer(
        [helper.make_node("MatMul", ["X", "W"], ["Y"])], TensorProto.FLOAT16, "Y", np.float16
    )
    with pytest.raises(gk.DTypeError, match="'Y' is float16.*Convert the model to float32"):
        dict(_entry_points(model))[entry]()


@pytest.mark.parametrize("entry", [*ENTRIES, "run"])
def test_an_invalid_node_from_an_exporter_is_named(entry):
    """A node left in an older opset's form (ReduceMean's axes became an input at opset
    18): before, onnx's raw ValidationError or onnxruntime-training's builder text."""
    bad = helper.make_node("ReduceMean", ["Z"], ["Y"], axes=[1], keepdims=1, name="mean_old")
    model = _one_layer([helper.make_node("MatMul", ["X", "W"], ["Z"]), bad])
    entries = dict(_entry_points(model), run=lambda: gk.run(model, {"X": XY[0]}))
    with pytest.raises(
        gk.IncompatibleModelError, match=r"not valid ONNX \(node 'mean_old', ReduceMean\)"
    ):
        entries[entry]()


def _two_heads() -> onnx.ModelProto:
    """Y = X W (the head trained), Y2 = X W2 (another head)."""
    heads = [
        helper.make_node("MatMul", ["X", "W"], ["Y"]),
        helper.make_node("MatMul", ["X", "W2"], ["Y2"]),
    ]
    return _one_layer(heads, Y2=None)


@pytest.mark.parametrize("entry", ["gradient_model", "Trainer", "ForwardBackwardTrainer"])
def test_weights_the_loss_cannot_reach_are_named(entry):
    """Before: onnxruntime's "...cc:621 <lambda> [ONNXRuntimeError] ... unreachable" text."""
    from graphkit_train import ForwardBackwardTrainer, Trainer

    model = _two_heads()
    loss = gk.add_loss_output(model, output_index="Y")
    runs = {
        "gradient_model": lambda: gk.gradient_model(loss, "loss", ["W", "W2"]),
        "Trainer": lambda: Trainer(loss, ["W", "W2"], max_iter=1).fit(*XY),
        "ForwardBackwardTrainer": lambda: ForwardBackwardTrainer(
            model, ["W", "W2"], output_index="Y", max_iter=1
        ).fit(*XY),
    }
    with pytest.raises(gk.MissingGradientError, match=r"does not depend on \['W2'\]"):
        runs[entry]()


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_by_default_another_heads_parameters_are_left_alone(kind):
    """The default weights are the parameters the loss reads: W trains like numpy's SGD,
    W2 (the other output's head) keeps its value."""
    from graphkit_train import ForwardBackwardTrainer, Trainer

    rng = np.random.default_rng(0)
    X = rng.normal(size=(20, 3)).astype(np.float32)
    y = (X @ np.array([1.0, 2.0, -1.0])).astype(np.float32)
    settings = dict(max_iter=2, batch_size=5, shuffle=False, optimizer="sgd")
    if kind == "full":
        trainer = Trainer(gk.add_loss_output(_two_heads(), output_index="Y"), **settings)
    else:
        trainer = ForwardBackwardTrainer(_two_heads(), output_index="Y", **settings)
    state = trainer.fit(X, y).get_state()
    assert trainer.weights_to_train_ == ["W"] and "W2" not in state
    W = np.ones((3, 1))
    for _ in range(2):
        for start in range(0, 20, 5):
            xb, yb = X[start : start + 5].astype(np.float64), y[start : start + 5, None]
            W -= 0.01 * 2 * xb.T @ (xb @ W - yb) / 5
    np.testing.assert_allclose(state["W"], W, rtol=1e-5)


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_a_conv_transpose_trains_on_the_cpu_like_torch(kind):
    """onnxruntime-training 1.19.2 has no CPU kernel for ConvTransposeGrad (before: an
    error telling a float32 model to "train in float32"); CPU sessions run its standard
    lowering, and the weights follow torch's SGD on the same layer."""
    torch = pytest.importorskip("torch")
    from graphkit_train import ForwardBackwardTrainer, Trainer

    rng = np.random.default_rng(0)
    W = rng.normal(size=(2, 1, 2, 2)).astype(np.float32)
    X = rng.normal(size=(16, 2, 3, 3)).astype(np.float32)
    y = rng.normal(size=(16, 16)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("ConvTranspose", ["X", "W", "B"], ["Z"], name="up"),
            helper.make_node("Flatten", ["Z"], ["Y"], axis=1),
        ],
        "decoder",
        [V("X", TensorProto.FLOAT, ["N", 2, 3, 3])],
        [V("Y", TensorProto.FLOAT, ["N", 16])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(np.zeros(1, np.float32), "B")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    settings = dict(max_iter=2, batch_size=8, shuffle=False, optimizer="sgd")
    if kind == "full":
        trainer = Trainer(model, loss="mse", **settings)
    else:
        trainer = ForwardBackwardTrainer(model, **settings)
    state = trainer.fit(X, y).get_state()

    layer = torch.nn.ConvTranspose2d(2, 1, 2)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(W))
        layer.bias.zero_()
    sgd = torch.optim.SGD(layer.parameters(), lr=0.01)
    for _ in range(2):
        for start in range(0, 16, 8):
            sgd.zero_grad()
            out = layer(torch.from_numpy(X[start : start + 8])).flatten(1)
            # graphkit's squared error: the mean over every value, torch's MSELoss
            loss = torch.nn.functional.mse_loss(out, torch.from_numpy(y[start : start + 8]))
            loss.backward()
            sgd.step()
    np.testing.assert_allclose(state["W"], layer.weight.detach().numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(state["B"], layer.bias.detach().numpy(), rtol=1e-4, atol=1e-6)
