"""Training on a GPU (``device="cuda"``): the references' numbers, in float32.

The training tests run where onnxruntime has its CUDA provider and sees a GPU (a CUDA
build, ``onnxruntime-gpu`` for the native backend); elsewhere, CI included, they skip
with the reason. The references: numpy written from the formulas in float64 (SGD on an
MLP, from ``test_fused``); for AdamW, the same trainer on the CPU, which the optimizer
tests check against torch's AdamW; torch on the CPU for a CNN and for an ONNX layer
inside a torch model. The tests against torch run on ``"cpu"`` too, so that CI checks
what they compare before a GPU runs them; the provider list and the refused CPU
fallback are tested everywhere.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from conftest import export_torch, mlp_onnx, requires_torch
from onnx import TensorProto, helper, numpy_helper
from test_fused import mlp_sgd_numpy

import graphkit as gk
from graphkit import optimizers
from graphkit._graph import all_graphs
from graphkit.engine import cuda_splits, ort_engine
from graphkit.engine.ort_engine import Runner
from graphkit_train import (
    OrtGradientForwardBackward,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
)

HAS_CUDA = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
requires_cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason=f"onnxruntime {onnxruntime.__version__} has no CUDA provider here (no GPU build "
    "or no GPU): pip install onnxruntime-gpu on a machine with one",
)
# float32 on the GPU against float64 numpy: the rounding of 18 steps, not TF32's 1e-3
RTOL, ATOL = 2e-5, 2e-6
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]


def float32_rows():
    """53 rows at batch 10 (five full batches and a short one), weighted, an MLP 4-5-1."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(53, 4)).astype(np.float32)
    y = rng.normal(size=(53, 1)).astype(np.float32)
    w = rng.uniform(0.5, 2.0, size=53).astype(np.float32)
    return X, y, w, mlp_onnx(4, 5, 1, scale=0.5)


def assert_numpy_sgd(state, losses, model, X, y, w):
    initial = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    expected, expected_losses = mlp_sgd_numpy(initial, X, y, w, 10, 0.05, 3, seed=7)
    for name, value in expected.items():
        np.testing.assert_allclose(state[name], value, rtol=RTOL, atol=ATOL, err_msg=name)
    np.testing.assert_allclose(losses, expected_losses, rtol=RTOL)


@requires_cuda
@pytest.mark.parametrize("steps_per_run", [1, "epoch"])
def test_full_training_on_cuda_follows_numpy_sgd(steps_per_run):
    X, y, w, model = float32_rows()
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model, weight_name="weight"),
        max_iter=3,
        batch_size=10,
        learning_rate=optimizers.sgd(learning_rate=0.05),
        random_state=7,
        steps_per_run=steps_per_run,
        device="cuda",
    ).fit(X, y, sample_weight=w)
    assert_numpy_sgd(trainer.get_state(), trainer.train_losses_, model, X, y, w)


@requires_cuda
def test_forward_backward_training_on_cuda_follows_numpy_sgd():
    X, y, w, model = float32_rows()
    trainer = OrtGradientForwardBackwardOptimizer(
        model,
        max_iter=3,
        batch_size=10,
        learning_rate=optimizers.sgd(learning_rate=0.05),
        random_state=7,
        device="cuda",
    ).fit(X, y, sample_weight=w)
    assert_numpy_sgd(trainer.get_state(), trainer.train_losses_, model, X, y, w)


@requires_cuda
@pytest.mark.parametrize("steps_per_run", [1, "epoch"])
def test_adamw_on_cuda_equals_adamw_on_the_cpu(steps_per_run):
    X, y, _, model = float32_rows()
    fitted = {}
    for device in ("cpu", "cuda"):
        fitted[device] = OrtGradientOptimizer(
            gk.add_loss_output(model),
            max_iter=4,
            batch_size=10,
            learning_rate=optimizers.adamw(learning_rate=0.01, weight_decay=0.1),
            random_state=3,
            steps_per_run=steps_per_run,
            device=device,
        ).fit(X, y)
    cpu, cuda = fitted["cpu"].get_state(), fitted["cuda"].get_state()
    assert set(cpu) == set(cuda)
    for name, value in cpu.items():
        np.testing.assert_allclose(cuda[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(fitted["cuda"].train_losses_, fitted["cpu"].train_losses_, 1e-5)


@requires_cuda
def test_the_weights_live_on_the_gpu_and_matmuls_stay_float32():
    """The layer's weights are CUDA values, and a product of numbers that TF32 would
    round (mantissas of 23 bits) comes out as numpy's float32 product."""
    model = mlp_onnx(64, 64, 1, activation="Identity", scale=1.0)
    layer = OrtGradientForwardBackward(model, device="cuda")
    assert {v.device_name() for v in layer.weights.values()} == {"cuda"}
    X = np.random.default_rng(1).normal(size=(8, 64)).astype(np.float32) + np.float32(1 / 3)
    (Y,) = layer.forward([X])
    weights = {k: v.numpy() for k, v in layer.weights.items()}
    expected = (X.astype(np.float64) @ weights["W1"] + weights["b1"]) @ weights["W2"]
    expected += weights["b2"]
    np.testing.assert_allclose(Y.numpy(), expected, rtol=1e-5, atol=1e-5)


def small_cnn(rng: np.random.Generator) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Conv 3x3 (1 -> 4, padded) + ReLU + MaxPool 2 + Flatten + Gemm (64 -> 3) on 8x8."""
    weights = {
        "K": (rng.normal(size=(4, 1, 3, 3)) / 3).astype(np.float32),
        "c": (rng.normal(size=4) * 0.1).astype(np.float32),
        "W": (rng.normal(size=(64, 3)) / 8).astype(np.float32),
        "b": np.zeros(3, np.float32),
    }
    nodes = [
        helper.make_node("Conv", ["X", "K", "c"], ["h"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["h"], ["a"]),
        helper.make_node("MaxPool", ["a"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "W", "b"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return model, weights


def torch_cnn_sgd(weights, X, y, epochs: int, batch_size: int, lr: float):
    """The same CNN in torch on the CPU, SGD on cross-entropy, batches in order."""
    import torch

    conv = torch.nn.Conv2d(1, 4, 3, padding=1)
    dense = torch.nn.Linear(64, 3)
    with torch.no_grad():
        conv.weight.copy_(torch.from_numpy(weights["K"]))
        conv.bias.copy_(torch.from_numpy(weights["c"]))
        dense.weight.copy_(torch.from_numpy(weights["W"].T.copy()))
        dense.bias.copy_(torch.from_numpy(weights["b"]))
    net = torch.nn.Sequential(
        conv, torch.nn.ReLU(), torch.nn.MaxPool2d(2), torch.nn.Flatten(), dense
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(X), batch_size):
            optimizer.zero_grad()
            x, t = (
                torch.from_numpy(X[start : start + batch_size]),
                torch.from_numpy(y[start : start + batch_size]),
            )
            torch.nn.functional.cross_entropy(net(x), t).backward()
            optimizer.step()
    return {
        "K": conv.weight.detach().numpy(),
        "c": conv.bias.detach().numpy(),
        "W": dense.weight.detach().numpy().T,
        "b": dense.bias.detach().numpy(),
    }


@requires_torch
@pytest.mark.parametrize("device", DEVICES)
def test_a_cnn_trains_as_torch_sgd(device):
    """Conv, MaxPool and their gradients (cuDNN's on a GPU, in float32) against torch."""
    rng = np.random.default_rng(5)
    model, weights = small_cnn(rng)
    X = rng.normal(size=(40, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=40).astype(np.int64)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model, "cross_entropy"),
        max_iter=2,
        batch_size=10,
        learning_rate=optimizers.sgd(learning_rate=0.1),
        shuffle=False,
        device=device,
    ).fit(X, y)
    expected = torch_cnn_sgd(weights, X, y, epochs=2, batch_size=10, lr=0.1)
    state = trainer.get_state()
    for name, value in expected.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-4, atol=1e-6, err_msg=name)


@requires_torch
@pytest.mark.parametrize("device", DEVICES)
def test_an_onnx_layer_inside_torch_has_torch_gradients(device, tmp_path):
    """OnnxModule on the device, its tensors passed by DLPack, between torch layers:
    the gradients of every parameter equal the all-torch twin's on the CPU."""
    import torch

    from graphkit_train.torch_module import OnnxModule

    torch.manual_seed(0)
    tail = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    head = torch.nn.Linear(3, 4)
    layer = OnnxModule(export_torch(tail, tmp_path / "tail.onnx", 4), device=device)
    hybrid = torch.nn.Sequential(head, torch.nn.ReLU(), layer).to(device)
    twin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), tail)
    twin[0].load_state_dict(head.state_dict())
    X, y = torch.randn(16, 3), torch.randn(16, 1)
    torch.nn.functional.mse_loss(hybrid(X.to(device)), y.to(device)).backward()
    torch.nn.functional.mse_loss(twin(X), y).backward()
    for (name, a), b in zip(hybrid.named_parameters(), twin.parameters()):
        assert a.grad.device.type == device
        np.testing.assert_allclose(
            a.grad.cpu().numpy(), b.grad.numpy(), rtol=1e-5, atol=1e-6, err_msg=name
        )


@requires_cuda
def test_adamw_on_cuda_through_the_long_split_equals_adamw_on_the_cpu():
    """The packed update of 4,225 weights, whose Split the CUDA sessions run as Slices."""
    model = mlp_onnx(64, 64, 1, scale=0.2)
    assert (
        sum(i.dims[0] * (i.dims[1] if len(i.dims) > 1 else 1) for i in model.graph.initializer)
        >= cuda_splits.LONG_AXIS
    )
    rng = np.random.default_rng(2)
    X = rng.normal(size=(60, 64)).astype(np.float32)
    y = rng.normal(size=(60, 1)).astype(np.float32)
    states = {}
    for device in ("cpu", "cuda"):
        states[device] = (
            OrtGradientOptimizer(
                gk.add_loss_output(model),
                max_iter=3,
                batch_size=20,
                learning_rate=optimizers.adamw(learning_rate=0.01, weight_decay=0.1),
                shuffle=False,
                steps_per_run="epoch",
                device=device,
            )
            .fit(X, y)
            .get_state()
        )
    for name, value in states["cpu"].items():
        np.testing.assert_allclose(states["cuda"][name], value, rtol=1e-4, atol=1e-6, err_msg=name)


def _split_model(sizes: list[int], in_scan: bool) -> onnx.ModelProto:
    """x (a vector of sum(sizes)) split into len(sizes) outputs by a Split with constant
    sizes, at the top level or in the body of a Scan over rows of x (2 rows)."""
    n = sum(sizes)
    outputs = [f"part{i}" for i in range(len(sizes))]

    def vector(name: str, length: int, rows: tuple[int, ...] = ()) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [*rows, length])

    split = helper.make_graph(
        [helper.make_node("Split", ["x", "sizes"], outputs, axis=0)],
        "split",
        [vector("x", n)],
        [vector(o, s) for o, s in zip(outputs, sizes)],
    )
    sizes_init = numpy_helper.from_array(np.array(sizes, np.int64), "sizes")
    if not in_scan:
        split.initializer.append(sizes_init)
        graph = split
    else:
        scanned = [f"all_{o}" for o in outputs]
        scan = helper.make_node("Scan", ["X"], scanned, body=split, num_scan_inputs=1)
        graph = helper.make_graph(
            [scan],
            "scan",
            [vector("X", n, (2,))],
            [vector(o, s, (2,)) for o, s in zip(scanned, sizes)],
            [sizes_init],
        )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("in_scan", [False, True])
def test_a_long_split_becomes_slices_with_numpys_values(in_scan):
    sizes = [1000, 2500, 1, 1499]
    model = _split_model(sizes, in_scan)
    rewritten = cuda_splits.split_long_axes_as_slices(model)
    onnx.checker.check_model(rewritten, full_check=True)
    ops = [n.op_type for g in all_graphs(rewritten.graph) for n in g.node]
    assert "Split" not in ops and ops.count("Slice") == len(sizes)
    x = np.random.default_rng(0).normal(size=(2, sum(sizes))).astype(np.float32)
    feeds = {"X": x} if in_scan else {"x": x[0]}
    got = ort_engine.inference_session(rewritten).run(None, feeds)
    for part, expected in zip(got, np.split(x, np.cumsum(sizes)[:-1], axis=1)):
        np.testing.assert_array_equal(part, expected if in_scan else expected[0])


def test_a_short_split_or_one_of_computed_sizes_stays():
    short = _split_model([3, 5], in_scan=False)
    assert cuda_splits.split_long_axes_as_slices(short) is short
    computed = _split_model([3000, 2000], in_scan=False)
    computed.graph.node[0].input[1] = "x_sizes"  # not a constant any more
    computed.graph.node.insert(0, helper.make_node("Identity", ["sizes"], ["x_sizes"]))
    assert cuda_splits.split_long_axes_as_slices(computed) is computed


def test_a_split_whose_sizes_a_graph_input_can_override_stays():
    """Sizes in an initializer that is also a graph input are not constant: the caller
    may feed others, which Slice nodes with fixed bounds would ignore."""
    model = _split_model([3000, 2000], in_scan=False)
    model.graph.input.append(helper.make_tensor_value_info("sizes", TensorProto.INT64, [2]))
    assert cuda_splits.split_long_axes_as_slices(model) is model


class _RecordingRuntime:
    """onnxruntime with CUDA, whose sessions keep the model they were given."""

    SessionOptions = onnxruntime.SessionOptions
    __version__ = onnxruntime.__version__
    models: list[onnx.ModelProto] = []

    class InferenceSession:
        def __init__(self, data, options, providers, disabled_optimizers):
            _RecordingRuntime.models.append(onnx.load_from_string(data))

        @staticmethod
        def get_providers():
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_sessions_on_cuda_run_long_splits_as_slices(monkeypatch):
    monkeypatch.setattr(ort_engine, "onnxruntime", lambda: _RecordingRuntime)
    model = _split_model([3000, 2000], in_scan=False)
    cuda = ("CUDAExecutionProvider", {"device_id": "0"})
    ort_engine.inference_session(model, [cuda, "CPUExecutionProvider"])
    ort_engine.inference_session(model, ["CPUExecutionProvider"])
    on_cuda, on_cpu = ([n.op_type for n in m.graph.node] for m in _RecordingRuntime.models[-2:])
    assert "Split" not in on_cuda and on_cuda.count("Slice") == 2
    assert on_cpu == ["Split"]


class _Runtime:
    """onnxruntime as a CUDA build reports itself, for the provider list alone."""

    @staticmethod
    def get_available_providers():
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]


def test_cuda_providers_name_the_device_and_float32(monkeypatch):
    monkeypatch.setattr(ort_engine, "onnxruntime", lambda: _Runtime)
    providers, kind, index = ort_engine.providers_for("cuda:1")
    assert (kind, index) == ("cuda", 1)
    assert providers == [
        ("CUDAExecutionProvider", {"device_id": "1", "use_tf32": "0"}),
        "CPUExecutionProvider",
    ]


class _SessionOnTheCpu:
    """A session whose CUDA provider did not start: onnxruntime kept the CPU alone."""

    @staticmethod
    def get_providers():
        return ["CPUExecutionProvider"]


def test_a_cuda_provider_that_did_not_start_is_an_error_not_a_cpu_session():
    cuda = ("CUDAExecutionProvider", {"device_id": "0", "use_tf32": "0"})
    with pytest.raises(
        RuntimeError, match="could not start CUDAExecutionProvider.*onnxruntime-gpu"
    ):
        ort_engine._check_providers_loaded(_SessionOnTheCpu(), [cuda, "CPUExecutionProvider"])
    ort_engine._check_providers_loaded(_SessionOnTheCpu(), ["CPUExecutionProvider"])


def _unpool_model(
    shape: tuple[int, ...], with_output_shape: bool, in_scan: bool
) -> onnx.ModelProto:
    """MaxPool (2x2, stride 2) of x with its indices, then MaxUnpool of dy there: at the
    top level, or as a Scan body over a leading axis of x and dy."""
    n, c, h, w = shape
    floats = onnx.TensorProto.FLOAT
    nodes = [
        helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node(
            "MaxUnpool",
            ["dy", "i", "size"] if with_output_shape else ["dy", "i"],
            ["dx"],
            kernel_shape=[2, 2],
            strides=[2, 2],
        ),
    ]
    if with_output_shape:
        nodes.insert(0, helper.make_node("Shape", ["x"], ["size"]))
    inputs = [
        helper.make_tensor_value_info("x", floats, [n, c, h, w]),
        helper.make_tensor_value_info("dy", floats, [n, c, h // 2, w // 2]),
    ]
    graph = helper.make_graph(
        nodes, "unpool", inputs, [helper.make_tensor_value_info("dx", floats, [n, c, h, w])]
    )
    if in_scan:
        scan = helper.make_node("Scan", ["xs", "dys"], ["dxs"], body=graph, num_scan_inputs=2)
        graph = helper.make_graph(
            [scan],
            "scan",
            [
                helper.make_tensor_value_info("xs", floats, [2, n, c, h, w]),
                helper.make_tensor_value_info("dys", floats, [2, n, c, h // 2, w // 2]),
            ],
            [helper.make_tensor_value_info("dxs", floats, [2, n, c, h, w])],
        )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("in_scan", [False, True], ids=["top level", "scan body"])
@pytest.mark.parametrize("with_output_shape", [False, True], ids=["inferred", "given"])
def test_max_unpool_as_a_scatter_places_the_values_numpy_does(with_output_shape, in_scan, rng):
    from graphkit.engine.cuda_unpools import max_unpools_as_scatters

    shape = (3, 2, 6, 4)
    model = _unpool_model(shape, with_output_shape, in_scan)
    written = max_unpools_as_scatters(model)
    ops = {n.op_type for g in all_graphs(written.graph) for n in g.node}
    assert "MaxUnpool" not in ops and "ScatterND" in ops
    onnx.checker.check_model(written, full_check=True)
    lead = (2,) if in_scan else ()
    x = rng.normal(size=(*lead, *shape)).astype(np.float32)
    x[..., 0, :, :] = 0.0  # tied windows
    dy = rng.normal(size=(*lead, *shape[:2], 3, 2)).astype(np.float32)
    feeds = {"xs": x, "dys": dy} if in_scan else {"x": x, "dy": dy}
    (got,) = Runner(written)(feeds)
    # numpy: dy at each window's first maximum (row-major in the window)
    windows = x.reshape(*lead, 3, 2, 3, 2, 2, 2).swapaxes(-3, -2).reshape(*lead, 3, 2, 3, 2, 4)
    first = windows.argmax(-1)
    expected = (np.arange(4) == first[..., None]) * dy[..., None]
    expected = expected.reshape(*lead, 3, 2, 3, 2, 2, 2).swapaxes(-3, -2).reshape(x.shape)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(Runner(model)(feeds)[0], expected)


def test_sessions_on_cuda_run_max_unpools_as_scatters(monkeypatch):
    monkeypatch.setattr(ort_engine, "onnxruntime", lambda: _RecordingRuntime)
    model = _unpool_model((1, 1, 4, 4), with_output_shape=False, in_scan=False)
    cuda = ("CUDAExecutionProvider", {"device_id": "0"})
    ort_engine.inference_session(model, [cuda, "CPUExecutionProvider"])
    ort_engine.inference_session(model, ["CPUExecutionProvider"])
    on_cuda, on_cpu = ([n.op_type for n in m.graph.node] for m in _RecordingRuntime.models[-2:])
    assert "MaxUnpool" not in on_cuda and "ScatterND" in on_cuda
    assert on_cpu == ["MaxPool", "MaxUnpool"]


def test_max_unpools_at_two_depths_get_names_of_their_own(rng):
    """A MaxUnpool at the top level and one in a Scan body: the rewritten graph stays in
    single static assignment form (one name space for both), and runs."""
    from graphkit.engine.cuda_unpools import max_unpools_as_scatters

    inner = _unpool_model((3, 2, 6, 4), with_output_shape=False, in_scan=True)
    outer = _unpool_model((3, 2, 6, 4), with_output_shape=False, in_scan=False)
    graph = inner.graph
    graph.node.extend(outer.graph.node)
    graph.input.extend(outer.graph.input)
    graph.output.extend(outer.graph.output)
    written = max_unpools_as_scatters(inner)
    onnx.checker.check_model(written, full_check=True)
    feeds = {
        "xs": rng.normal(size=(2, 3, 2, 6, 4)).astype(np.float32),
        "dys": rng.normal(size=(2, 3, 2, 3, 2)).astype(np.float32),
        "x": rng.normal(size=(3, 2, 6, 4)).astype(np.float32),
        "dy": rng.normal(size=(3, 2, 3, 2)).astype(np.float32),
    }
    for got, expected in zip(Runner(written)(feeds), Runner(inner)(feeds)):
        np.testing.assert_array_equal(got, expected)
