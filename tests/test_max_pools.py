"""Max pooling in training graphs, against torch's autograd and numpy: the gradient of
a ``MaxPool`` whose windows tile its input is a ``MaxUnpool``
(:mod:`graphkit.backends.pool_adjoints`) in both backends, float32 only; elsewhere the
scatter."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS, requires_torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from test_cuda import small_cnn, torch_cnn_sgd

import graphkit as gk
from graphkit.backends.ort_training.lowering import lower_slow_cpu_ops, lower_to_standard
from graphkit.backends.pool_adjoints import unpooling
from graphkit.engine.ort_engine import Runner
from graphkit.prepare import prepare_for_training
from graphkit_train import OrtGradientOptimizer

F32 = TensorProto.FLOAT

# -- which poolings unpool ----------------------------------------------------------------

# (spatial size, kernel, strides, pads, dilations, ceil_mode): whether MaxUnpool applies
POOLINGS = {
    "2x2 stride 2, even size": (((28, 28), (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 0), True),
    "2x2 stride 2, odd size": (((27, 27), (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 0), False),
    "ceil_mode, odd size": (((27, 27), (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 1), False),
    "ceil_mode, even size": (((8, 6), (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 1), True),
    "3x3 stride 3": (((9, 9), (3, 3), (3, 3), (0, 0, 0, 0), (1, 1), 0), True),
    "3x3 stride 2 (overlap)": (((9, 9), (3, 3), (2, 2), (0, 0, 0, 0), (1, 1), 0), False),
    "2x2 stride 1 (overlap)": (((6, 6), (2, 2), (1, 1), (0, 0, 0, 0), (1, 1), 0), False),
    "gaps between windows": (((11, 11), (2, 2), (3, 3), (0, 0, 0, 0), (1, 1), 0), True),
    "padded": (((10, 8), (2, 2), (2, 2), (1, 0, 1, 0), (1, 1), 0), True),
    "padded, even": (((10, 6), (2, 2), (2, 2), (1, 1, 1, 1), (1, 1), 0), True),
    "dilated": (((11, 11), (2, 2), (4, 4), (0, 0, 0, 0), (2, 2), 0), True),
    "1-d": (((12,), (2,), (2,), (0, 0), (1,), 0), True),
    "3-d": (((4, 6, 4), (2, 2, 2), (2, 2, 2), (0,) * 6, (1, 1, 1), 0), True),
    "3x2 windows": (((9, 8), (3, 2), (3, 2), (0, 0, 0, 0), (1, 1), 0), True),
}


@pytest.mark.parametrize("case", sorted(POOLINGS))
def test_unpooling_applies_where_windows_tile_the_input(case):
    (size, kernel, strides, pads, dilations, ceil), expected = POOLINGS[case]
    attrs = unpooling(kernel, strides, pads, dilations, ceil, list(size))
    assert (attrs is not None) == expected
    if attrs is not None:  # the inferred shape is the input's
        n = len(size)
        for i in range(n):
            out = (size[i] + pads[i] + pads[n + i] - attrs["kernel_shape"][i]) // strides[i] + 1
            span = attrs["kernel_shape"][i]
            assert (out - 1) * strides[i] + span - pads[i] - pads[n + i] == size[i]


def test_unpooling_needs_the_spatial_size():
    assert unpooling([2, 2], [2, 2], [0] * 4, [1, 1], 0, None) is None
    assert unpooling([2, 2], [2, 2], [0] * 4, [1, 1], 0, ["H", 28]) is None


def pool_model(size, kernel, strides, pads, dilations, ceil, channels=3) -> onnx.ModelProto:
    """loss = sum(MaxPool(x) * r), r a fixed random weighting of the pooled values."""
    attrs = dict(
        kernel_shape=list(kernel),
        strides=list(strides),
        pads=list(pads),
        dilations=list(dilations),
        ceil_mode=ceil,
    )
    probe = np.zeros((1, channels, *size), np.float32)
    pooled = ReferenceEvaluator(
        helper.make_model(
            helper.make_graph(
                [helper.make_node("MaxPool", ["x"], ["y"], **attrs)],
                "p",
                [helper.make_tensor_value_info("x", F32, None)],
                [helper.make_tensor_value_info("y", F32, None)],
            ),
            opset_imports=[helper.make_opsetid("", 18)],
        )
    ).run(None, {"x": probe})[0]
    r = np.random.default_rng(3).normal(size=pooled.shape[1:]).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MaxPool", ["x"], ["y"], **attrs),
            helper.make_node("Mul", ["y", "r"], ["weighted"]),
            helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
        ],
        "pool",
        [helper.make_tensor_value_info("x", F32, ["N", channels, *size])],
        [helper.make_tensor_value_info("loss", F32, [])],
        [numpy_helper.from_array(r, "r")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def tied_input(rng, shape) -> np.ndarray:
    """Normal values with ties in every window of some rows: a block of zeros, and a block
    of one repeated positive value (where first-maximum routing decides)."""
    x = rng.normal(size=shape).astype(np.float32)
    x[0] = 0.0
    if shape[0] > 1:
        x[1, 0] = 0.75
    return x


def torch_pool_gradient(x, size, kernel, strides, pads, dilations, ceil, r) -> np.ndarray:
    import torch

    n = len(size)
    pool = [torch.nn.functional.max_pool1d, torch.nn.functional.max_pool2d]
    pool.append(torch.nn.functional.max_pool3d)
    if list(pads[:n]) == list(pads[n:]):  # torch's own padding
        tx = torch.tensor(x, requires_grad=True)
        y = pool[n - 1](
            tx, list(kernel), list(strides), list(pads[:n]), list(dilations), ceil_mode=bool(ceil)
        )
        (y * torch.tensor(r)).sum().backward()
        return tx.grad.numpy()
    padded = np.pad(
        x,
        [(0, 0), (0, 0)] + [(pads[i], pads[n + i]) for i in range(n)],
        constant_values=-np.inf,
    )
    tx = torch.tensor(padded, requires_grad=True)
    y = pool[n - 1](tx, list(kernel), list(strides), 0, list(dilations), ceil_mode=bool(ceil))
    (y * torch.tensor(r)).sum().backward()
    grad = tx.grad.numpy()
    return grad[(slice(None), slice(None), *(slice(pads[i], pads[i] + size[i]) for i in range(n)))]


@requires_torch
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("case", sorted(POOLINGS))
def test_max_pool_gradient_equals_torch_ties_included(case, backend, rng):
    (size, kernel, strides, pads, dilations, ceil), unpools = POOLINGS[case]
    if ceil and backend == "native" and not unpools:
        pytest.skip("onnx-ad refuses ceil_mode in reverse mode where the windows overhang")
    model = pool_model(size, kernel, strides, pads, dilations, ceil)
    grad = gk.gradient_model(model, "loss", ["x"], backend=backend)
    graphs = {"native": grad}
    if backend == "ort_training":  # its kernel, its CPU sessions' graph, its export
        standard = onnx.ModelProto()
        standard.CopyFrom(grad)
        graphs = {"kernel": grad, "cpu": lower_slow_cpu_ops(grad)}
        graphs["standard"] = lower_to_standard(standard)
    r = numpy_helper.to_array(model.graph.initializer[0])
    for name, graph in graphs.items():
        ops = {n.op_type for n in graph.graph.node}
        assert ("MaxUnpool" in ops) == (unpools and name != "kernel"), (name, ops)
        if name in ("native", "standard"):  # the graphs written in standard ONNX
            onnx.checker.check_model(graph, full_check=True)
        for batch in (4, 1):
            x = tied_input(rng, (batch, 3, *size))
            expected = torch_pool_gradient(x, size, kernel, strides, pads, dilations, ceil, r)
            # exact where no position takes two gradients; else summed in another order
            tolerance = {"rtol": 0, "atol": 0} if unpools else {"rtol": 1e-6, "atol": 1e-6}
            np.testing.assert_allclose(_run(graph, x), expected, err_msg=name, **tolerance)
            # exports run on onnx.reference too (whose MaxPool indices leave out the
            # channel offset on some overlapping poolings, a scatter's input)
            if name in ("native", "standard") and unpools:
                (ref,) = ReferenceEvaluator(graph).run(["x_grad"], {"x": x})
                np.testing.assert_allclose(ref, expected, err_msg=name, **tolerance)


INFINITE = ["2x2 stride 2, even size", "3x3 stride 3", "dilated", "1-d", "3-d", "padded, even"]


@requires_torch
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("case", INFINITE)
def test_windows_of_minus_infinity_send_their_gradient_where_torch_does(case, backend, rng):
    """onnxruntime's MaxPool leaves the index of a window of -inf values unset (outside
    the window, or negative); torch sends that window's gradient to its first position
    inside the input, and so does graphkit's MaxUnpool."""
    (size, kernel, strides, pads, dilations, ceil), unpools = POOLINGS[case]
    assert unpools
    model = pool_model(size, kernel, strides, pads, dilations, ceil)
    grad = gk.gradient_model(model, "loss", ["x"], backend=backend)
    graphs = {"native": grad}
    if backend == "ort_training":
        standard = onnx.ModelProto()
        standard.CopyFrom(grad)
        graphs = {"cpu": lower_slow_cpu_ops(grad), "standard": lower_to_standard(standard)}
    r = numpy_helper.to_array(model.graph.initializer[0])
    x = rng.normal(size=(3, 3, *size)).astype(np.float32)
    x[0, 1] = -np.inf  # every window of an image
    x[1, 0] = -np.inf  # the first image: the unset index is negative
    x[2, 2].flat[::3] = -np.inf  # some windows
    expected = torch_pool_gradient(x, size, kernel, strides, pads, dilations, ceil, r)
    for name, graph in graphs.items():
        np.testing.assert_array_equal(_run(graph, x), expected, err_msg=name)
        (ref,) = ReferenceEvaluator(graph).run(["x_grad"], {"x": x})
        np.testing.assert_array_equal(ref, expected, err_msg=name)


@requires_torch
def test_a_float64_pooling_keeps_the_scatter(rng):
    """onnxruntime's MaxUnpool is float32 only: a float64 model's native gradient keeps
    onnx-ad's scatter, and equals torch's in float64."""
    model = pool_model((4, 6), (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 0)
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    r = numpy_helper.to_array(model.graph.initializer[0]).astype(np.float64)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(r, "r"))
    grad = gk.gradient_model(model, "loss", ["x"], backend="native")
    assert "MaxUnpool" not in {n.op_type for n in grad.graph.node}
    x = tied_input(rng, (2, 3, 4, 6)).astype(np.float64)
    expected = torch_pool_gradient(x, (4, 6), (2, 2), (2, 2), (0, 0, 0, 0), (1, 1), 0, r)
    np.testing.assert_array_equal(_run(grad, x), expected)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["x_grad"], {"x": x})[0]


@settings(max_examples=30, deadline=None)
@given(
    k=st.integers(2, 3),  # onnx.reference's MaxPool returns wrong indices for 1x1 windows
    extra=st.integers(0, 2),
    windows=st.integers(1, 4),
    pad=st.integers(0, 1),
    batch=st.integers(1, 3),
)
def test_unpooled_gradient_equals_a_scatter_of_the_indices(k, extra, windows, pad, batch):
    """Any tiling pooling: MaxUnpool with the attributes of ``unpooling`` (no output
    shape) on onnxruntime and onnx.reference equals numpy's scatter of dY at the indices
    MaxPool returns."""
    stride = k + extra
    pad = min(pad, k - 1)
    size = (windows - 1) * stride + k - 2 * pad
    if size < 1:
        return
    attrs = unpooling([k, k], [stride, stride], [pad] * 4, [1, 1], 0, [size, size])
    assert attrs is not None
    pool = dict(kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4)
    graph = helper.make_graph(
        [
            helper.make_node("MaxPool", ["x"], ["y", "i"], **pool),
            helper.make_node("MaxUnpool", ["dy", "i"], ["dx"], **attrs),
        ],
        "unpool",
        [helper.make_tensor_value_info(n, F32, None) for n in ("x", "dy")],
        [helper.make_tensor_value_info(n, t, None) for n, t in (("dx", F32), ("i", 7))],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    rng = np.random.default_rng(k * 100 + stride * 10 + size)
    x = tied_input(rng, (batch, 2, size, size))
    dy = rng.normal(size=(batch, 2, windows, windows)).astype(np.float32)
    for dx, indices in (
        Runner(model)({"x": x, "dy": dy}),
        ReferenceEvaluator(model).run(None, {"x": x, "dy": dy}),
    ):
        expected = np.zeros(x.size, np.float32)
        np.add.at(expected, indices.reshape(-1), dy.reshape(-1))
        np.testing.assert_array_equal(dx, expected.reshape(x.shape))


# -- training through the MaxUnpool adjoint ---------------------------------------------------


def images(rng, n=6) -> np.ndarray:
    """Images whose blank rows make a Conv's output tie across whole windows."""
    X = rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
    X[:, :, :4] = 0.0
    return X


@requires_torch
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_a_cnn_trains_as_torch_sgd_through_the_unpooling(backend, rng):
    """SGD through tests/test_cuda.py's Conv -> ReLU -> MaxPool -> Gemm network
    (MaxUnpool adjoint) on each backend against torch's, on images whose blank rows make
    windows tie."""
    model, weights = small_cnn(rng)
    X, y = images(rng, 32), rng.integers(0, 3, 32).astype(np.int64)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model, "cross_entropy"),
        list(weights),
        max_iter=2,
        batch_size=8,
        learning_rate=0.05,
        shuffle=False,
        backend=backend,
        validation_every=0,
    )
    trainer.fit(X, y)
    expected = torch_cnn_sgd(weights, X, y, epochs=2, batch_size=8, lr=0.05)
    state = trainer.get_state()
    for name, value in expected.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-4, atol=1e-5, err_msg=name)


@requires_torch
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_torch_exports_train_as_torch_through_the_unpooling(dynamo, rng):
    """A torch CNN exported by either exporter: two epochs of graphkit's SGD (the default
    backend) end on torch's weights."""
    import torch
    from zoo.models import torch_export

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(64, 3),
    )
    X, y = images(rng, 32), rng.integers(0, 3, 32)
    model = torch_export(net, X, dynamo)
    _, weights = prepare_for_training(model, None)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model, "cross_entropy"),
        max_iter=2,
        batch_size=8,
        learning_rate=0.05,
        shuffle=False,
        validation_every=0,
    )
    trainer.fit(X, y)
    sgd = torch.optim.SGD(net.parameters(), lr=0.05)
    net.train()
    for _ in range(2):
        for start in range(0, 32, 8):
            sgd.zero_grad()
            batch = torch.tensor(X[start : start + 8])
            loss = torch.nn.functional.cross_entropy(net(batch), torch.tensor(y[start : start + 8]))
            loss.backward()
            sgd.step()
    state = trainer.get_state()
    by_shape = {np.shape(state[w]): np.asarray(state[w]) for w in weights}
    assert len(by_shape) == len(weights) == 4  # the four shapes tell the weights apart
    for param in net.parameters():
        expected = param.detach().numpy()
        got = by_shape.get(expected.shape)
        if got is None:  # an exporter's MatMul holds the Linear's weight transposed
            got = by_shape[expected.T.shape].T
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
