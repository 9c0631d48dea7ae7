"""Each lowering of the ort_training backend against onnxruntime-training's own kernel
on random inputs (where it is installed), run by onnxruntime and by onnx.reference; every
installed backend's training step, in standard operators, reproduces graphkit's training
on onnx.reference, a runtime that knows no com.microsoft operator."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS, mlp_onnx, requires_ort_training
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import graphkit as gk
from graphkit.backends.ort_training.lowering import lower_to_standard
from graphkit.engine.ort_engine import Runner
from graphkit.errors import IncompatibleModelError
from graphkit.training_info import initial_state
from graphkit_train import OrtGradientOptimizer

F32, F64, I64 = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.INT64
TYPE = {np.dtype(np.float32): F32, np.dtype(np.float64): F64, np.dtype(np.int64): I64}


def one_node(op_type, feeds, n_outputs=1, out_type=None, **attrs):
    """A model of one com.microsoft node over ``feeds``."""
    node = helper.make_node(
        op_type,
        list(feeds),
        [f"y{i}" for i in range(n_outputs)],
        domain="com.microsoft",
        **attrs,
    )
    inputs = [
        helper.make_tensor_value_info(n, TYPE[np.asarray(v).dtype], None) for n, v in feeds.items()
    ]
    first = TYPE[np.asarray(next(iter(feeds.values()))).dtype]
    outputs = [helper.make_tensor_value_info(o, out_type or first, None) for o in node.output]
    graph = helper.make_graph([node], op_type, inputs, outputs)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def kernel_outputs(model, feeds):
    """The com.microsoft kernel's outputs; where onnxruntime-training has only a float32
    kernel, that kernel on the inputs cast to float32 (then compare at float32 precision)."""
    try:  # as bytes: onnxruntime's own kernels, none lowered for speed
        return Runner(model.SerializeToString())(feeds), False
    except IncompatibleModelError:
        narrow = onnx.ModelProto()
        narrow.CopyFrom(model)
        for value in [*narrow.graph.input, *narrow.graph.output]:
            if value.type.tensor_type.elem_type == F64:
                value.type.tensor_type.elem_type = F32
        cast = {n: v.astype(np.float32) if v.dtype == np.float64 else v for n, v in feeds.items()}
        runner = Runner(narrow.SerializeToString())
        return [o.astype(np.float64) for o in runner(cast)], True


def check(model, feeds, rtol=1e-6, atol=1e-7):
    """The kernel's outputs equal the lowered graph's, on onnx.reference and (where it has
    the standard kernels: no float64 Erf in 1.19.2) on onnxruntime."""
    expected, narrowed = kernel_outputs(model, feeds)
    if narrowed:
        rtol, atol = max(rtol, 1e-5), max(atol, 1e-6)
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    lower_to_standard(lowered)
    assert {o.domain for o in lowered.opset_import} <= {"", "ai.onnx"}
    runs = [ReferenceEvaluator(lowered).run(None, feeds)]
    try:
        runs.append(Runner(lowered)(feeds))
    except IncompatibleModelError as exc:
        assert "'Erf'" in str(exc), exc
    for got in runs:
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.dtype == e.dtype
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)


@st.composite
def broadcastable(draw):
    rank = draw(st.integers(0, 4))
    full = draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank))
    pair = []
    for _ in range(2):
        keep = draw(st.integers(0, rank))
        dims = [d if not draw(st.booleans()) else 1 for d in full[rank - keep :]]
        pair.append(dims)
    return pair


@requires_ort_training
@settings(max_examples=60, deadline=None)
@given(broadcastable())
def test_broadcast_gradient_args(pair):
    a, b = (np.array(s, dtype=np.int64) for s in pair)
    check(one_node("BroadcastGradientArgs", {"a": a, "b": b}, 2, I64), {"a": a, "b": b})


@requires_ort_training
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "op,attrs,inputs",
    [
        ("SigmoidGrad", {}, "dy,sigmoid"),
        ("TanhGrad", {}, "dy,tanh"),
        ("ReluGrad", {}, "dy,relu"),
        ("LeakyReluGrad", {"alpha": 0.2}, "dy,x"),
        ("GeluGrad", {}, "dy,x"),
        ("FastGeluGrad", {}, "dy,x"),
        ("SoftmaxGrad_13", {"axis": 1}, "dy,softmax1"),
        ("LogSoftmaxGrad_13", {"axis": -1}, "dy,logsoftmax"),
        ("SoftmaxGrad", {"axis": 1}, "dy,softmax12"),
    ],
)
def test_elementwise_and_softmax_gradients(op, attrs, inputs, dtype, rng):
    x = rng.normal(size=(3, 4, 5))
    values = {
        "dy": rng.normal(size=x.shape),
        "x": x,
        "sigmoid": 1 / (1 + np.exp(-x)),
        "tanh": np.tanh(x),
        "relu": np.maximum(x, 0),
        "softmax1": np.exp(x) / np.exp(x).sum(axis=1, keepdims=True),
        "logsoftmax": x - np.log(np.exp(x).sum(axis=-1, keepdims=True)),
        "softmax12": np.exp(x) / np.exp(x).sum(axis=(1, 2), keepdims=True),
    }
    feeds = {n: values[n].astype(dtype) for n in inputs.split(",")}
    model = one_node(op, feeds, **attrs)
    check(model, feeds, rtol=1e-5 if dtype == np.float32 else 1e-12)


@requires_ort_training
@pytest.mark.parametrize("attrs", [{}, {"transA": 1}, {"transB": 1, "alpha": 0.5}])
def test_fused_matmul(attrs, rng):
    a = rng.normal(size=(2, 3, 4) if not attrs.get("transA") else (2, 4, 3)).astype(np.float32)
    b = rng.normal(size=(4, 5) if not attrs.get("transB") else (5, 4)).astype(np.float32)
    check(one_node("FusedMatMul", {"a": a, "b": b}, **attrs), {"a": a, "b": b}, rtol=1e-5)


@requires_ort_training
@pytest.mark.parametrize("down", [0, 1])
def test_scale(down, rng):
    x, s = rng.normal(size=(3, 2)).astype(np.float32), np.array(4.0, np.float32)
    check(one_node("Scale", {"x": x, "s": s}, scale_down=down), {"x": x, "s": s})


@requires_ort_training
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_sum_training(keepdims, rng):
    x, axes = rng.normal(size=(3, 4, 2)).astype(np.float32), np.array([0, 2], np.int64)
    check(
        one_node("ReduceSumTraining", {"x": x, "axes": axes}, keepdims=keepdims),
        {"x": x, "axes": axes},
    )


@requires_ort_training
def test_gather_elements_grad_adds_repeated_indices(rng):
    dy = rng.normal(size=(3, 6)).astype(np.float32)
    shape = np.array([3, 4], np.int64)
    indices = rng.integers(0, 4, size=(3, 6)).astype(np.int64)  # repeats on purpose
    feeds = {"dy": dy, "shape": shape, "indices": indices}
    check(one_node("GatherElementsGrad", feeds, axis=1), feeds, rtol=1e-5)


@requires_ort_training
@pytest.mark.parametrize(
    "axis,data_shape,indices",
    [
        (0, (7, 3), [[1, 1, -1], [0, 6, 1]]),  # an embedding: repeated, negative
        (1, (2, 5, 3), [4, 0, 4, -2]),
        (-1, (3, 4), [[3], [0]]),
        (2, (2, 3, 4), 1),  # a scalar index removes the axis
    ],
)
def test_gather_grad(axis, data_shape, indices, rng):
    indices = np.array(indices, np.int64)
    out_shape = data_shape[: axis % len(data_shape)] + indices.shape
    out_shape += data_shape[axis % len(data_shape) + 1 :]
    feeds = {
        "shape": np.array(data_shape, np.int64),
        "indices": indices,
        "dy": rng.normal(size=out_shape).astype(np.float32),
    }
    check(one_node("GatherGrad", feeds, out_type=F32, axis=axis), feeds, rtol=1e-5)


@requires_ort_training
@pytest.mark.parametrize(
    "starts,ends,axes,steps",
    [([1], [3], [0], [1]), ([0, 1], [4, 5], [0, 1], [2, 2]), ([-3], [100], [1], [2])],
)
def test_slice_grad(starts, ends, axes, steps, rng):
    shape = np.array([4, 5], np.int64)
    sliced = rng.normal(size=(4, 5))[
        tuple(
            slice(starts[axes.index(i)], ends[axes.index(i)], steps[axes.index(i)])
            if i in axes
            else slice(None)
            for i in range(2)
        )
    ]
    feeds = {
        "dy": sliced.astype(np.float32),
        "shape": shape,
        "starts": np.array(starts, np.int64),
        "ends": np.array(ends, np.int64),
        "axes": np.array(axes, np.int64),
        "steps": np.array(steps, np.int64),
    }
    check(one_node("SliceGrad", feeds, out_type=F32), feeds)


@requires_ort_training
@pytest.mark.parametrize(
    "attrs,outputs",
    [
        ({"pads": [1, 1, 1, 1]}, 3),
        ({"pads": [0, 1, 2, 0], "dilations": [2, 1]}, 3),
        ({"pads": [1, 1, 1, 1], "strides": [2, 2]}, 2),  # dX not asked: the first layer
        ({"pads": [0, 0, 0, 0], "strides": [3, 2]}, 2),  # strides that do not divide
        ({"pads": [1, 0, 1, 1], "strides": [2, 2]}, 3),  # dX at a stride that does not divide
        ({"pads": [0, 1, 2, 0], "strides": [3, 1], "dilations": [1, 2]}, 3),
        ({"pads": [1, 1, 1, 1], "strides": [2, 2], "group": 3}, 3),  # depthwise
        ({"pads": [0, 0, 0, 0], "group": 3}, 2),
    ],
)
def test_conv_grad(attrs, outputs, rng):
    attrs = dict(attrs)
    group = attrs.pop("group", 1)
    x = rng.normal(size=(2, 3, 7, 6)).astype(np.float32)
    w = rng.normal(size=(6 if group > 1 else 4, 3 // group, 3, 2)).astype(np.float32)
    forward = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], group=group, **attrs)],
        "conv",
        [
            helper.make_tensor_value_info("x", F32, x.shape),
            helper.make_tensor_value_info("w", F32, w.shape),
        ],
        [helper.make_tensor_value_info("y", F32, None)],
    )
    y_shape = (
        ReferenceEvaluator(helper.make_model(forward, opset_imports=[helper.make_opsetid("", 18)]))
        .run(None, {"x": x, "w": w})[0]
        .shape
    )
    feeds = {"dy": rng.normal(size=y_shape).astype(np.float32), "x": x, "w": w}
    model = one_node("ConvGrad", feeds, 3, group=group, **attrs)
    if outputs == 2:
        model.graph.node[0].output[0] = ""
        del model.graph.output[0]
    check(model, feeds, rtol=1e-4, atol=1e-5)


@requires_ort_training
@pytest.mark.parametrize("channels", [3, 8])  # 8: dX is a Conv by the flipped weight
@pytest.mark.parametrize(
    "attrs,outputs",
    [
        ({"pads": [1, 1, 1, 1]}, 3),
        ({"pads": [0, 1, 2, 0], "dilations": [2, 1]}, 3),
        ({"pads": [1, 1, 1, 1], "strides": [2, 2]}, 2),  # dX not asked: the first layer
        ({"pads": [1, 0, 1, 1], "strides": [2, 2]}, 3),
        ({"pads": [3, 1, 1, 1]}, 3),  # a pad wider than the kernel: dX a ConvTranspose
    ],
)
def test_conv_grad_on_cpu_matches_the_kernel(channels, attrs, outputs, rng):
    """A CPU session's ConvGrad with static shapes runs as conv_adjoints' forms (dW a
    product of patches; dX a Conv, or a ConvTranspose): its outputs are the kernel's."""
    from graphkit.backends.ort_training.lowering import lower_slow_cpu_ops

    x = rng.normal(size=(4, channels, 7, 6)).astype(np.float32)
    w = rng.normal(size=(5, channels, 3, 2)).astype(np.float32)
    forward = helper.make_model(
        helper.make_graph(
            [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)],
            "conv",
            [helper.make_tensor_value_info(n, F32, v.shape) for n, v in (("x", x), ("w", w))],
            [helper.make_tensor_value_info("y", F32, None)],
        ),
        opset_imports=[helper.make_opsetid("", 18)],
    )
    dy = rng.normal(size=ReferenceEvaluator(forward).run(None, {"x": x, "w": w})[0].shape)
    feeds = {"dy": dy.astype(np.float32), "x": x, "w": w}
    model = one_node("ConvGrad", feeds, 3, **attrs)
    for value in model.graph.input:  # static shapes, as a specialized step has
        value.CopyFrom(helper.make_tensor_value_info(value.name, F32, feeds[value.name].shape))
    if outputs == 2:
        model.graph.node[0].output[0] = ""
        del model.graph.output[0]
    expected, _ = kernel_outputs(model, feeds)
    lowered = lower_slow_cpu_ops(model)
    ops = [n.op_type for n in lowered.graph.node]
    assert "ConvGrad" not in ops and "Concat" in ops, ops  # the patches
    flipped = channels >= 8 and outputs == 3 and "strides" not in attrs and attrs["pads"][0] < 3
    assert ("ConvTranspose" in ops) == (outputs == 3 and not flipped), ops
    got = Runner(lowered.SerializeToString())(feeds)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "attrs",
    [
        {"pads": [1, 1, 1, 1]},
        {"pads": [0, 1, 0, 1], "strides": [2, 3], "output_padding": [1, 0]},
        {"pads": [1, 0, 1, 0], "dilations": [2, 1], "strides": [2, 2]},
        {"pads": [0, 0, 0, 0], "strides": [2, 2], "group": 3},
    ],
)
def test_conv_transpose_grad_against_torch(attrs, rng):
    """onnxruntime-training 1.19.2 has no CPU kernel for ConvTransposeGrad: torch's
    autograd is the reference."""
    torch = pytest.importorskip("torch")
    attrs = dict(attrs)
    group = attrs.pop("group", 1)
    x = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
    w = rng.normal(size=(3, 2, 3, 2)).astype(np.float32)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    pads = attrs.get("pads", [0, 0, 0, 0])
    y = torch.nn.functional.conv_transpose2d(
        tx,
        tw,
        stride=attrs.get("strides", 1),
        padding=pads[:2],
        output_padding=attrs.get("output_padding", 0),
        groups=group,
        dilation=attrs.get("dilations", 1),
    )
    dy = rng.normal(size=tuple(y.shape)).astype(np.float32)
    y.backward(torch.tensor(dy))
    expected = [tx.grad.numpy(), tw.grad.numpy(), dy.sum(axis=(0, 2, 3))]
    feeds = {"dy": dy, "x": x, "w": w}
    lowered = one_node("ConvTransposeGrad", feeds, 3, group=group, **attrs)
    lower_to_standard(lowered)
    for got in (Runner(lowered)(feeds), ReferenceEvaluator(lowered).run(None, feeds)):
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4)


@requires_ort_training
def test_max_pool_grad_scatters_to_the_maxima(rng):
    x = rng.normal(size=(2, 3, 5, 6)).astype(np.float32)
    dy = rng.normal(size=(2, 3, 2, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[3, 2], strides=[2, 2]),
            helper.make_node(
                "MaxPoolGrad", ["dy", "i"], ["dx"], kernel_shape=[3, 2], strides=[2, 2]
            ),
        ],
        "max_pool_grad",
        [
            helper.make_tensor_value_info("x", F32, x.shape),
            helper.make_tensor_value_info("dy", F32, dy.shape),
        ],
        [helper.make_tensor_value_info("dx", F32, x.shape)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    check(model, {"x": x, "dy": dy})


@requires_ort_training
@pytest.mark.parametrize(
    "shapes", [((3, 4), (3, 1)), ((4,), (3, 4)), ((2, 3), (2, 3)), ((3, 1), ())]
)
def test_div_grad_sums_back_to_each_operand(shapes, rng):
    a = rng.normal(size=shapes[0]).astype(np.float32)
    b = (rng.uniform(0.5, 2.0, size=shapes[1])).astype(np.float32)
    dy = rng.normal(size=np.broadcast_shapes(a.shape, b.shape)).astype(np.float32)
    feeds = {"dy": dy, "a": a, "b": b}
    check(one_node("DivGrad", feeds, 2), feeds, rtol=1e-5, atol=1e-6)


@requires_ort_training
@pytest.mark.parametrize("axis,shape", [(-1, (4, 5)), (1, (2, 3, 4)), (-2, (2, 3, 4))])
def test_layer_norm_grad(axis, shape, rng):
    x = rng.normal(size=shape).astype(np.float32)
    normalized = tuple(range(axis % len(shape), len(shape)))
    mean = x.mean(axis=normalized, keepdims=True)
    inv_std = 1 / np.sqrt(x.var(axis=normalized, keepdims=True) + 1e-5)
    scale = rng.normal(size=x.shape[axis % len(shape) :]).astype(np.float32)
    feeds = {
        "dy": rng.normal(size=shape).astype(np.float32),
        "x": x,
        "scale": scale,
        "mean": mean.astype(np.float32),
        "inv_std": inv_std.astype(np.float32),
    }
    check(
        one_node("LayerNormalizationGrad", feeds, 3, axis=axis, epsilon=1e-5),
        feeds,
        rtol=1e-4,
        atol=1e-5,
    )


def test_an_operator_the_table_does_not_know_is_listed(rng):
    model = one_node("BiasSoftmax", {"x": rng.normal(size=(2, 3)).astype(np.float32)})
    model.graph.node.append(helper.make_node("MaxPoolGrad", ["a", "b"], ["c"], name="pool_grad"))
    with pytest.raises(
        IncompatibleModelError, match=r"2 operator.*BiasSoftmax.*MaxPoolGrad.*pool_grad"
    ):
        lower_to_standard(model)


def mlp(activation, n_out, dtype):
    return mlp_onnx(4, 6, n_out, activation, dtype)


def cnn():
    """Conv (stride 1, padded) + ReLU + MaxPool + Flatten + MatMul: 3 classes."""
    rng = np.random.default_rng(0)
    inits = {
        "K": (rng.normal(size=(3, 1, 3, 3)) * 0.3).astype(np.float32),
        "kb": np.zeros(3, np.float32),
        "W": (rng.normal(size=(27, 3)) * 0.1).astype(np.float32),
        "b": np.zeros(3, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["X", "K", "kb"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("MatMul", ["f", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("X", F32, ["N", 1, 6, 6])],
        [helper.make_tensor_value_info("Y", F32, ["N", 3])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize(
    "activation,loss,dtype",
    [
        ("Relu", "squared_error", np.float32),
        ("Tanh", "squared_error", np.float32),
        ("Sigmoid", "cross_entropy", np.float32),
        ("Relu", "cross_entropy", np.float64),
        ("cnn", "cross_entropy", np.float32),
    ],
)
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_a_lowered_training_step_trains_on_onnx_reference(activation, loss, dtype, backend, rng):
    """20 steps of Adam on onnx.reference (no com.microsoft kernels) follow graphkit: the
    backend's step in standard operators (ort_training's lowered, native's as it is)."""
    n_out = 3
    X = rng.normal(size=(200, 4)).astype(dtype)
    model = mlp(activation, n_out, dtype) if activation != "cnn" else cnn()
    y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 0) if loss == "cross_entropy" else X[:, :3]
    y = y.astype(dtype) if loss == "squared_error" else y
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model, loss),
        learning_rate=(gk.optimizers.adam(), 0.01),
        max_iter=1,
        batch_size=10,
        shuffle=False,
        backend=backend,
    )
    if activation == "cnn":
        X = rng.normal(size=(200, 1, 6, 6)).astype(dtype)
    trainer.fit(X, y)
    step = trainer.training_step_
    lowered = onnx.ModelProto()
    lowered.CopyFrom(step.model)
    lowered = trainer._backend.to_standard(lowered)
    assert all(n.domain in ("", "ai.onnx") for n in lowered.graph.node)
    reference = ReferenceEvaluator(lowered)
    resident = dict(step.initial)
    outputs = [o.name for o in lowered.graph.output]
    losses = []
    for i in range(0, 200, 10):
        feeds = {step.features: X[i : i + 10], step.label: y[i : i + 10], **resident}
        out = dict(zip(outputs, reference.run(None, feeds)))
        losses.append(float(out[step.loss]))
        resident = {n: out[f"{n}.next"] for n in resident}
    state = trainer.get_state()
    tol = 1e-4 if dtype == np.float32 else 1e-10
    for name in step.weights:
        np.testing.assert_allclose(resident[name], state[name], rtol=tol, atol=tol)
    np.testing.assert_allclose(np.mean(losses), trainer.train_losses_[0], rtol=tol)


def test_an_exported_step_keeps_training_where_the_trainer_stopped(rng, tmp_path):
    from graphkit_train import OrtGradientForwardBackwardOptimizer

    X = rng.normal(size=(100, 4)).astype(np.float32)
    y = np.tanh(X[:, :3]).astype(np.float32)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(mlp("Tanh", 3, np.float32)),
        learning_rate=(gk.optimizers.adam(), gk.schedules.cosine(0.01, 100)),
        max_iter=1,
        batch_size=10,
        shuffle=False,
    )
    trainer.fit(X, y)
    path = tmp_path / "step.onnx"
    trainer.export_training_step(path)
    exported = onnx.load(path)
    onnx.checker.check_model(exported, full_check=True)
    assert {o.domain for o in exported.opset_import} <= {"", "ai.onnx"}

    step = trainer.training_step_
    reference = ReferenceEvaluator(exported)
    outputs = [o.name for o in exported.graph.output]
    # the first batch runs on the exported values: the initial state the step carries
    resident = initial_state(exported)
    assert not {t.name for t in exported.graph.initializer} & set(resident)  # no defaults
    for i in range(0, 100, 10):
        feeds = {step.features: X[i : i + 10], step.label: y[i : i + 10], **resident}
        out = dict(zip(outputs, reference.run(None, feeds)))
        resident = {n.removesuffix(".next"): v for n, v in out.items() if n.endswith(".next")}
    trainer.set_params(warm_start=True).fit(X, y)  # the same epoch, by graphkit
    resident = step.public(resident)  # Adam's state packed end to end, named per weight
    for name, value in trainer.get_state().items():
        np.testing.assert_allclose(resident[name], value, rtol=1e-4, atol=1e-5, err_msg=name)

    with pytest.raises(TypeError, match="no fused training step"):
        from graphkit.training.export import export_training_step

        export_training_step(OrtGradientForwardBackwardOptimizer(mlp("Tanh", 3, np.float32)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_an_exported_epoch_is_graphkits_epoch(dtype, rng, tmp_path):
    """The step in a Loop over the batches of a permutation (a short last batch, sample
    weights): the same weights and batch losses as graphkit's shuffled epoch."""
    X = rng.normal(size=(95, 4)).astype(dtype)
    y = np.tanh(X[:, :3]).astype(dtype)
    w = rng.uniform(0.5, 2.0, size=95).astype(dtype)

    def trainer():
        return OrtGradientOptimizer(
            gk.add_loss_output(mlp("Tanh", 3, dtype), weight_name="weight"),
            learning_rate=(gk.optimizers.adam(), gk.schedules.cosine(0.01, 100)),
            max_iter=1,
            batch_size=10,
            random_state=5,
        )

    exported = trainer().export_training_epoch(tmp_path / "epoch.onnx")
    onnx.checker.check_model(onnx.load(tmp_path / "epoch.onnx"), full_check=True)
    assert any(n.op_type == "Loop" for n in exported.graph.node)
    graphkit = trainer().fit(X, y, w)
    step = graphkit.training_step_
    feeds = {
        "X": X,
        step.label: y,
        "weight": w,
        "permutation": np.random.default_rng(5).permutation(95),  # graphkit's first epoch
        "batch_size": np.array(10, np.int64),
        **initial_state(exported),  # the weights and optimizer state it starts from
    }
    names = [o.name for o in exported.graph.output]
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for run in (Runner(exported), ReferenceEvaluator(exported).run):
        out = dict(zip(names, run(feeds) if isinstance(run, Runner) else run(None, feeds)))
        assert out["batch_losses"].size == 10
        for name, value in graphkit.get_state().items():
            np.testing.assert_allclose(out[f"{name}.next"], value, rtol=tol, atol=tol)
        np.testing.assert_allclose(out["batch_losses"].mean(), graphkit.train_losses_[0], rtol=tol)


# -- the form of the opset a lowering goes into ------------------------------------------


def layer_norm_model(dtype, opset):
    """X -> LayerNormalization(scale, bias, axis=-1) -> MatMul W -> Y."""
    rng = np.random.default_rng(3)
    inits = {
        "scale": rng.normal(size=4).astype(dtype),
        "bias": rng.normal(size=4).astype(dtype),
        "W": rng.normal(size=(4, 3)).astype(dtype),
    }
    elem = TYPE[np.dtype(dtype)]
    graph = helper.make_graph(
        [
            helper.make_node("LayerNormalization", ["X", "scale", "bias"], ["H"], axis=-1),
            helper.make_node("MatMul", ["H", "W"], ["Y"]),
        ],
        "layer_norm",
        [helper.make_tensor_value_info("X", elem, ["N", 4])],
        [helper.make_tensor_value_info("Y", elem, ["N", 3])],
        [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    return model, inits


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_float64_layer_norm_trains_one_sgd_step_as_torch(backend, rng):
    """One SGD step of a float64 LayerNorm + MatMul under the mean squared error equals
    torch's float64 autograd (onnxruntime-training once inlined its LayerNormalizationGrad
    function body, whose ReduceMean has an ``axes`` attribute that opset 18 refuses)."""
    from graphkit_train.trainers.full import Trainer

    model, inits = layer_norm_model(np.float64, 18)
    X, Y = rng.normal(size=(6, 4)), rng.normal(size=(6, 3))
    trainer = Trainer(
        model,
        loss="squared_error",
        max_iter=1,
        batch_size=6,
        shuffle=False,
        backend=backend,
        optimizer="sgd",
        schedule=0.1,
    )
    trainer.fit(X, Y)

    torch = pytest.importorskip("torch")
    weights = {k: torch.tensor(v, requires_grad=True) for k, v in inits.items()}
    hidden = torch.nn.functional.layer_norm(
        torch.tensor(X), (4,), weights["scale"], weights["bias"], eps=1e-5
    )
    loss = torch.nn.functional.mse_loss(hidden @ weights["W"], torch.tensor(Y))
    loss.backward()
    state = trainer.get_state()
    np.testing.assert_allclose(trainer.train_losses_[0], loss.item(), rtol=1e-12)
    for name, w in weights.items():
        expected = (w - 0.1 * w.grad).detach().numpy()
        assert state[name].dtype == np.float64
        # float32 statistics would leave 1e-8 here (see lowering.layer_norm_grad)
        np.testing.assert_allclose(state[name], expected, rtol=1e-10, atol=1e-12, err_msg=name)


@requires_ort_training
@pytest.mark.parametrize("opset", [15, 17, 18])
def test_layer_norm_grad_lowered_for_the_graphs_opset(opset, rng):
    """Below opset 18 ReduceMean takes its axes as an attribute: the lowering of a graph
    of opset 15 or 17 loads and equals the float32 kernel; opset 18 takes them as input."""
    shape = (4, 5)
    x = rng.normal(size=shape).astype(np.float32)
    feeds = {
        "dy": rng.normal(size=shape).astype(np.float32),
        "x": x,
        "scale": rng.normal(size=5).astype(np.float32),
        "mean": x.mean(axis=1, keepdims=True),
        "inv_std": (1 / np.sqrt(x.var(axis=1, keepdims=True) + 1e-5)).astype(np.float32),
    }
    model = one_node("LayerNormalizationGrad", feeds, 3, axis=-1, epsilon=1e-5)
    model.opset_import[0].version = opset
    shapes = {**{n: v.shape for n, v in feeds.items()}, "y0": shape, "y1": (5,), "y2": (5,)}
    for value in [*model.graph.input, *model.graph.output]:  # the checker wants them
        value.CopyFrom(helper.make_tensor_value_info(value.name, F32, shapes[value.name]))
    expected, _ = kernel_outputs(model, feeds)
    lower_to_standard(model)
    onnx.checker.check_model(model, full_check=True)
    means = [n for n in model.graph.node if n.op_type == "ReduceMean"]
    assert means and all((len(n.input) == 1) == (opset < 18) for n in means)
    for got in (Runner(model)(feeds), ReferenceEvaluator(model).run(None, feeds)):
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-5)


def test_axes_for_opset():
    from graphkit._graph import axes_for_opset, int_constant

    nodes = [
        int_constant("axes", [1]),
        int_constant("none", []),
        helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=1),
        helper.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=0),
        helper.make_node("ReduceSum", ["x", "none"], ["same"], noop_with_empty_axes=1),
        helper.make_node("Unsqueeze", ["m", "outer"], ["u"]),
    ]
    # from opset 18 every axes is an input: nothing changes
    assert axes_for_opset(nodes, 18) == nodes
    at17 = axes_for_opset(nodes, 17, {"outer": [0]})
    assert [(n.op_type, list(n.input)) for n in at17] == [
        ("Constant", []),
        ("Constant", []),
        ("ReduceSum", ["x", "axes"]),  # an input from opset 13
        ("ReduceMean", ["x"]),
        ("ReduceSum", ["x", "none"]),
        ("Unsqueeze", ["m", "outer"]),
    ]
    at12 = axes_for_opset(nodes, 12, {"outer": [0]})
    assert [(n.op_type, list(n.input)) for n in at12] == [
        ("ReduceSum", ["x"]),
        ("ReduceMean", ["x"]),
        ("Identity", ["x"]),  # empty axes with noop_with_empty_axes: the data itself
        ("Unsqueeze", ["m"]),
    ]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    shapes = {"s": [2, 1], "same": [2, 3], "u": [1, 2]}
    outputs = [helper.make_tensor_value_info(n, F32, d) for n, d in shapes.items()]
    graph = helper.make_graph(at12, "g", [helper.make_tensor_value_info("x", F32, [2, 3])], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)], ir_version=7)
    onnx.checker.check_model(model, full_check=True)
    s, same, u = Runner(model)({"x": x})
    np.testing.assert_array_equal(s, x.sum(axis=1, keepdims=True))
    np.testing.assert_array_equal(same, x)
    np.testing.assert_array_equal(u, x.mean(axis=1)[None])
    with pytest.raises(IncompatibleModelError, match="computed at run time.*opset 13"):
        axes_for_opset(nodes, 12)


@requires_ort_training
@pytest.mark.parametrize("opset", [12, 18])
def test_unfolded_batch_norm_for_the_graphs_opset(opset, rng):
    """ort_training's inference BatchNormalization rewrite, X a + b with a, b unsqueezed
    over the spatial axes, is valid ONNX of the graph's opset and equals numpy's formula."""
    from graphkit.backends.ort_training.rewrites import unfold_batch_norm

    c = 3
    inits = {
        "scale": rng.normal(size=c),
        "bias": rng.normal(size=c),
        "mean": rng.normal(size=c),
        "var": rng.uniform(0.5, 2, size=c),
    }
    graph = helper.make_graph(
        [helper.make_node("BatchNormalization", ["X", *inits], ["Y"], epsilon=1e-3)],
        "bn",
        [helper.make_tensor_value_info("X", F32, ["N", c, 4, 5])],
        [helper.make_tensor_value_info("Y", F32, ["N", c, 4, 5])],
        [onnx.numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)
    unfolded = unfold_batch_norm(model)
    assert "BatchNormalization" not in {n.op_type for n in unfolded.graph.node}
    onnx.checker.check_model(unfolded, full_check=True)
    x = rng.normal(size=(2, c, 4, 5)).astype(np.float32)
    spatial = (1, c, 1, 1)
    a = inits["scale"] / np.sqrt(inits["var"] + 1e-3)
    expected = x * a.reshape(spatial) + (inits["bias"] - inits["mean"] * a).reshape(spatial)
    np.testing.assert_allclose(Runner(unfolded)({"X": x})[0], expected, rtol=1e-5, atol=1e-5)
