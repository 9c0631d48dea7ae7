"""The native gradient source (``backend="native"``): onnx-ad 0.3.0's reverse rules behind
``graphkit/backends/native/adapter.py``, and graphkit's own rules for Conv (input
gradient), AveragePool and Slice (``rules.py``), which need no declared batch size.

Every test compares with a reference that is not the code under test:

1. onnxruntime-training's gradients, on every zoo model it can differentiate (one batch of
   16 rows; weights as graph inputs, as the trainers give them, and as initializers);
2. torch autograd: the zoo's GRU and LSTM classifiers, a CNN with two Conv layers,
   AvgPool2d (padded, count_include_pad=False) and MaxPool, and a model slicing its
   sequence, through both torch exporters; one gradient graph, two batch sizes;
3. central finite differences in float64 on graphs built with onnx.helper (Slice, Conv,
   AveragePool, Softplus/Elu/Mish, If, Loop, Scan);
4. the refusals: weights reached only through operators with no derivative, operators
   with no rule;
5. the trainers on ``backend="native"``: a numpy SGD of the same shuffled batches, and
   ``backend="ort_training"``;
6. every native gradient graph made here holds ``ai.onnx`` / ``ai.onnx.ml`` operators
   only and passes ``onnx.checker.check_model(full_check=True)``.

"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from zoo.models import CASES, FULL, _Recurrent, torch_export
from zoo.run import built

import graphkit as gk
from graphkit import backends
from graphkit.errors import MissingGradientError
from graphkit.prepare import trainable_weights
from graphkit.rewrite import initializers_to_inputs
from graphkit.static_shapes import specialize
from graphkit.train_mode import DROPOUT_SEED, training_form

INSTALLED = {b.name for b in backends.available() if b.installed}
pytestmark = pytest.mark.skipif(
    "native" not in INSTALLED, reason="the native backend (onnx-ad) is not installed"
)
needs_ort_training = pytest.mark.skipif(
    "ort_training" not in INSTALLED, reason="onnxruntime-training is not installed"
)

STANDARD_DOMAINS = {"", "ai.onnx", "ai.onnx.ml"}
DOUBLE = TensorProto.DOUBLE


# -- helpers -------------------------------------------------------------------------------


def _domains(graph: onnx.GraphProto):
    for node in graph.node:
        yield node.domain
        for attr in node.attribute:
            subgraphs = ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
            for sub in subgraphs:
                yield from _domains(sub)


def assert_standard(model: onnx.ModelProto) -> None:
    """Section 6: standard operators only (subgraphs included), and a valid model."""
    assert set(_domains(model.graph)) <= STANDARD_DOMAINS, set(_domains(model.graph))
    assert {o.domain for o in model.opset_import} <= STANDARD_DOMAINS
    assert not model.functions, [f"{f.domain}::{f.name}" for f in model.functions]
    onnx.checker.check_model(model, full_check=True)


def native_gradient(model: onnx.ModelProto, output: str, wrt: list[str]) -> onnx.ModelProto:
    grad = gk.gradient_model(model, output, wrt, backend="native")
    assert_standard(grad)
    return grad


def backend_runner(backend: str, model: onnx.ModelProto):
    """``feeds -> {name: value}`` through the backend's own session (the native one
    turns off an onnxruntime 1.19.2 optimizer that breaks recurrent gradients)."""
    session = backends.get(backend).inference_session(model)
    names = [o.name for o in session.get_outputs() if o.type.startswith("tensor")]
    return lambda feeds: dict(zip(names, session.run(names, feeds)))


def float64_runner(model: onnx.ModelProto):
    """``feeds -> {name: value}`` in float64: onnxruntime with its graph optimizations
    off (its fused kernels are float32 only) where it has the kernels, else onnx.reference
    (onnxruntime's CPU build has no float64 Conv, ConvTranspose or AveragePool)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
    except Exception as exc:  # onnxruntime's own NOT_IMPLEMENTED type
        if "NOT_IMPLEMENTED" not in str(exc):
            raise
        reference = ReferenceEvaluator(model)
        return lambda feeds: dict(zip(reference.output_names, reference.run(None, feeds)))
    names = [o.name for o in session.get_outputs()]
    return lambda feeds: dict(zip(names, session.run(None, feeds)))


def initializer_values(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}


def max_relative(got: dict, expected: dict, floor: float = 0.0) -> float:
    """max |got - expected| over every tensor, relative to the largest |expected| (or to
    ``floor`` when that is larger)."""
    scale = max([floor] + [float(np.abs(v).max()) for v in expected.values()])
    return max(float(np.abs(got[k] - v).max()) for k, v in expected.items()) / scale


# -- 1. the zoo against onnxruntime-training ----------------------------------------------


@functools.cache
def zoo_training(case):
    """``(training graph, weights, data)`` of a zoo case; the weights are
    ``graphkit.prepare.trainable_weights``' choice, the one the trainers make. A graph
    whose layers train in training mode is in its training form (batch statistics, the
    Dropout masks of step 0, seed 0: inputs :func:`zoo_feeds` fills)."""
    onx, data = built(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train = gk.add_loss_output(onx, case.loss, output_index=case.output_index, label_name="y")
    weights = trainable_weights(train, None)
    return training_form(train).model, weights, data


def zoo_feeds(train: onnx.ModelProto, X: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    label = next(i for i in train.graph.input if i.name == "y")
    rank = len(label.type.tensor_type.shape.dim)
    feeds = {train.graph.input[0].name: X, "y": y.reshape(len(y), -1) if rank == 2 else y}
    counters = {"step", DROPOUT_SEED} & {i.name for i in train.graph.input}
    return feeds | {name: np.array(0, np.int64) for name in counters}


@functools.cache
def zoo_native_gradient(case) -> onnx.ModelProto:
    train, weights, _ = zoo_training(case)
    return native_gradient(train, train.graph.output[0].name, weights)


def _needs_torch(case) -> None:
    if case.exporter != "skl2onnx":
        pytest.importorskip("torch")


DIFFERENTIABLE_BY_ORT = [
    pytest.param(
        case,
        id=case.id,
    )
    for case in CASES
    # a LoRA case's base is its full case's graph; native's own refusals are tested apart
    if case.refusal(FULL) is None and case.refusal(FULL, "native") is None and not case.lora
]


@needs_ort_training
@pytest.mark.parametrize("case", DIFFERENTIABLE_BY_ORT)
def test_zoo_gradients_equal_onnxruntime_training(case):
    """One batch of 16 rows: the gradient of the loss with respect to every weight, from
    native graphs taking the weights as inputs (the trainers' form) and as initializers,
    equals onnxruntime-training's within 1e-5 of the largest gradient."""
    _needs_torch(case)
    train, weights, data = zoo_training(case)
    loss = train.graph.output[0].name
    values = {w: initializer_values(train)[w] for w in weights}
    feeds = zoo_feeds(train, data.X_train[:16], data.y_train[:16])
    opened = initializers_to_inputs(train, weights)
    grads = [f"{w}_grad" for w in weights]

    expected = backend_runner(
        "ort_training", gk.gradient_model(opened, loss, weights, backend="ort_training")
    )({**feeds, **values})
    as_inputs = backend_runner("native", native_gradient(opened, loss, weights))(
        {**feeds, **values}
    )
    as_initializers = backend_runner("native", zoo_native_gradient(case))(feeds)

    reference = {g: expected[g] for g in grads}
    for got in (as_inputs, as_initializers):
        np.testing.assert_allclose(got[loss], expected[loss], rtol=1e-5, atol=1e-6)
        # gradients below 1e-3 are compared to 1e-3: the zoo's SGDClassifier is saturated
        # (loss 3.5e-7, gradients ~3e-7), where float32's rounding of probabilities near
        # 1 (6e-8) differs between the runtimes by 2% of the gradient
        assert max_relative({g: got[g] for g in grads}, reference, floor=1e-3) <= 1e-5, {
            g: float(np.abs(got[g] - reference[g]).max()) for g in grads
        }


# -- 2. torch autograd --------------------------------------------------------------------


def torch_gradient(name: str, value: np.ndarray, net, block: int | None = None) -> np.ndarray:
    """The torch gradient of the parameter that became the ONNX initializer ``name``:
    by name, else by value (as is, or transposed: a Linear exported as MatMul), else, for
    ``block`` > 0, gate block by gate block (an ONNX GRU/LSTM stacks torch's gates in
    another order and concatenates the two biases)."""
    params = dict(net.named_parameters())
    if name in params and tuple(params[name].shape) == value.shape:
        return params[name].grad.numpy()
    for p in params.values():
        v = p.detach().numpy()
        if v.shape == value.shape and np.array_equal(v, value):
            return p.grad.numpy()
        if v.ndim == 2 and v.T.shape == value.shape and np.array_equal(v.T, value):
            return p.grad.numpy().T
    if block:
        pieces = [
            (p.detach().numpy()[i : i + block], p.grad.numpy()[i : i + block])
            for p in params.values()
            if p.shape[0] % block == 0
            for i in range(0, p.shape[0], block)
        ]
        stacked = value.reshape(-1, block, *value.shape[2:])  # drops the direction axis
        grad = []
        for piece in stacked:
            match = [g for v, g in pieces if v.shape == piece.shape and np.array_equal(v, piece)]
            assert len(match) == 1, f"no single torch gate block for a piece of {name}"
            grad.append(match[0])
        return np.stack(grad).reshape(value.shape)
    raise KeyError(f"no torch parameter has the value of {name!r}")


def assert_native_equals_torch(train, weights, net, batches, block=None, static=False) -> float:
    """The native gradient graph of ``train`` (built once, batch size symbolic; with
    ``static``, specialized to each batch's size as the trainers run it) equals torch's
    ``.grad`` of cross entropy on every batch; the largest relative difference."""
    import torch

    loss = train.graph.output[0].name
    features = train.graph.input[0].name
    gradient = native_gradient(train, loss, weights)
    run = backend_runner("native", gradient)
    inits = initializer_values(train)
    worst = 0.0
    for X, y in batches:
        if static:
            folds = backends.get("native").constant_folds
            run = backend_runner(
                "native", specialize(gradient, {features: len(X), "y": len(X)}, folds)
            )
        out = run({features: X, "y": y})
        net.zero_grad()
        value = torch.nn.functional.cross_entropy(net(torch.tensor(X)), torch.tensor(y))
        value.backward()
        np.testing.assert_allclose(out[loss], value.item(), rtol=1e-5)
        expected = {w: torch_gradient(w, inits[w], net, block) for w in weights}
        got = {w: out[f"{w}_grad"] for w in weights}
        for w in weights:  # each parameter within 1e-5 of its largest torch gradient
            difference = float(np.abs(got[w] - expected[w]).max())
            assert difference <= 1e-5 * float(np.abs(expected[w]).max()), (w, len(X), difference)
        worst = max(worst, max_relative(got, expected))
    return worst


RECURRENT = [pytest.param(c, id=c.id) for c in CASES if c.name in ("GRU", "LSTM")]


@pytest.mark.parametrize("case", RECURRENT)
def test_recurrent_gradients_equal_torch_autograd_at_two_batch_sizes(case):
    """The zoo's GRU / LSTM classifier (onnxruntime-training refuses both in full
    training): the network is rebuilt with the zoo's seed, and every ONNX weight is
    matched to torch's by value."""
    torch = pytest.importorskip("torch")
    train, weights, data = zoo_training(case)
    torch.manual_seed(0)  # as tests/zoo/models.py:torch_model
    net = _Recurrent(case.name.lower())
    X, y = data.X_train, data.y_train
    batches = [(X[:16], y[:16]), (X[16:21], y[16:21])]
    assert_native_equals_torch(train, weights, net, batches, block=net.rnn.hidden_size)
    # as the trainers run it: specialized to each batch size, the Scans' bodies too
    assert_native_equals_torch(train, weights, net, batches, block=net.rnn.hidden_size, static=True)
    if "ort_training" in INSTALLED:  # why the zoo comparison leaves them out
        with pytest.raises(MissingGradientError, match=case.refusal(FULL)):
            gk.gradient_model(train, train.graph.output[0].name, weights, backend="ort_training")


def _torch_modules():
    import torch
    from torch import nn

    class Slicer(nn.Module):
        """A sequence (N, 5, 6): the mean of tokens 1:3, the last token, and the mean of
        features -6:-2 of every token."""

        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(6, 8)
            self.out = nn.Linear(20, 3)

        def forward(self, x):
            h = self.proj(x).tanh()
            middle = h[:, 1:3].mean(dim=1)
            last = h[:, -1]
            features = h[:, :, -6:-2].mean(dim=1)
            return self.out(torch.cat([middle, last, features], dim=-1))

    def cnn():
        return nn.Sequential(
            nn.Conv2d(1, 4, 3, padding=1),
            nn.ReLU(),
            nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False),
            nn.Conv2d(4, 6, 3, stride=2, padding=1),  # its input needs a gradient
            nn.Tanh(),
            nn.MaxPool2d(2, stride=1),
            nn.Flatten(),
            nn.Linear(24, 5),
        )

    return {"slicer": (Slicer, (5, 6), 3), "cnn": (cnn, (1, 10, 10), 5)}


@functools.cache
def torch_case(kind: str, dynamo: bool):
    """``(net, training graph, weights, input shape, classes)``; the net keeps the values
    the graph was exported with."""
    import torch

    make, shape, classes = _torch_modules()[kind]
    torch.manual_seed(0)
    net = make()
    example = np.zeros((2, *shape), np.float32)
    onx = torch_export(net, example, dynamo)
    train = gk.add_loss_output(onx, "cross_entropy", label_name="y")
    return net, train, trainable_weights(train, None), shape, classes


TORCH_CASES = [
    pytest.param(kind, dynamo, id=f"{kind}-{'dynamo' if dynamo else 'torchscript'}")
    for kind in ("cnn", "slicer")
    for dynamo in (False, True)
]


@pytest.mark.parametrize("kind,dynamo", TORCH_CASES)
def test_conv_pool_and_slice_gradients_equal_torch_autograd_at_two_batch_sizes(kind, dynamo):
    pytest.importorskip("torch")
    net, train, weights, shape, classes = torch_case(kind, dynamo)
    ops = [n.op_type for n in train.graph.node]
    if kind == "cnn":  # the graph holds what graphkit's own rules are for
        assert ops.count("Conv") == 2 and "MaxPool" in ops
        pool = next(n for n in train.graph.node if n.op_type == "AveragePool")
        attrs = {a.name: helper.get_attribute_value(a) for a in pool.attribute}
        assert attrs.get("count_include_pad", 0) == 0 and any(attrs["pads"])
    else:
        assert "Slice" in ops
    rng = np.random.default_rng(7)
    batches = [
        (rng.normal(size=(n, *shape)).astype(np.float32), rng.integers(0, classes, n))
        for n in (16, 5)
    ]
    assert_native_equals_torch(train, weights, net, batches)


# -- 3. central finite differences in float64 ---------------------------------------------


def make_model(
    nodes, inputs, initializers, output="loss", output_shape=(), opset=18
) -> onnx.ModelProto:
    """A float64 model of ``nodes``: ``inputs`` as (name, shape), one output."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, DOUBLE, s) for n, s in inputs],
        [helper.make_tensor_value_info(output, DOUBLE, list(output_shape))],
        [numpy_helper.from_array(np.asarray(v, np.float64), k) for k, v in initializers.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _int64(name: str, values) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64))
    )


def assert_matches_finite_differences(model, wrt, feeds_list, output="loss", eps=1e-6):
    """The native gradient of ``sum(output)`` with respect to ``wrt`` (initializers or
    graph inputs) equals central differences (step ``eps``) at every point of
    ``feeds_list``, within 1e-6 of the largest one; one gradient graph for all points.
    Returns the largest relative difference."""
    grad = native_gradient(model, output, wrt)
    run_grad = float64_runner(grad)
    inits = initializer_values(model)
    weights = [w for w in wrt if w in inits]
    forward = float64_runner(initializers_to_inputs(model, weights) if weights else model)
    worst = 0.0
    for feeds in feeds_list:
        point = {**{w: inits[w] for w in weights}, **feeds}
        got = run_grad(feeds)
        for name in wrt:
            base = point[name]
            expected = np.zeros_like(base)
            for index in np.ndindex(base.shape):
                sums = []
                for step in (eps, -eps):
                    moved = base.copy()
                    moved[index] += step
                    sums.append(float(np.sum(forward({**point, name: moved})[output])))
                expected[index] = (sums[0] - sums[1]) / (2 * eps)
            scale = float(np.abs(expected).max())
            assert scale > 0, f"{name}: the finite differences are all zero"
            np.testing.assert_allclose(
                got[f"{name}_grad"], expected, rtol=1e-6, atol=1e-6 * scale, err_msg=name
            )
            worst = max(worst, float(np.abs(got[f"{name}_grad"] - expected).max()) / scale)
    return worst


SLICES = {  # (starts, ends, axes) of x (N, 4, 7), never the batch axis
    "negative starts and ends": ([-6], [-1], [2]),
    "negative axis": ([-5], [-2], [-1]),
    "clamped bounds": ([-100], [100], [2]),
    "two axes": ([1, -3], [-1, 1000], [1, 2]),
}


STRIDED_SLICES = {  # (starts, ends, axes, steps) of x (N, 4, 7)
    "every other entry (an interleaved rotary embedding's x[..., ::2])": ([0], [7], [2], [2]),
    "odd entries": ([1], [1000], [-1], [2]),
    "step 3, the end not reached": ([1], [7], [2], [3]),
    "one entry, the step past the end": ([5], [7], [2], [4]),
    "negative start": ([-6], [100], [2], [2]),
    "two axes, both strided": ([1, 0], [4, 1000], [1, 2], [2, 3]),
    "two axes, one strided": ([0, 2], [3, -1], [1, 2], [1, 2]),
}
CONSTANT_SLICES = {**{k: (*v, None) for k, v in SLICES.items()}, **STRIDED_SLICES}


@pytest.mark.parametrize("bounds", sorted(CONSTANT_SLICES))
def test_slice_gradient_matches_finite_differences(bounds):
    """Constant bounds, steps of 1 (absent) or above: the gradient zero-padded, its
    entries first spread ``step`` apart on a strided axis."""
    starts, ends, axes, steps = CONSTANT_SLICES[bounds]
    operands = ["h", "starts", "ends", "axes"] + (["steps"] if steps else [])
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h0"]),
        helper.make_node("Tanh", ["h0"], ["h"]),
        _int64("starts", starts),
        _int64("ends", ends),
        _int64("axes", axes),
        *([_int64("steps", steps)] if steps else []),
        helper.make_node("Slice", operands, ["s"]),
        helper.make_node("Mul", ["s", "s"], ["s2"]),
        helper.make_node("ReduceSum", ["s2"], ["square"], keepdims=0),
        helper.make_node("ReduceSum", ["h"], ["plain"], keepdims=0),
        helper.make_node("Add", ["square", "plain"], ["loss"]),
    ]
    rng = np.random.default_rng(0)
    model = make_model(nodes, [("X", ["N", 4, 3])], {"W": rng.normal(size=(3, 7))})
    points = [{"X": rng.normal(size=(n, 4, 3))} for n in (2, 3)]
    assert_matches_finite_differences(model, ["W", "X"], points)


def test_a_reversed_slice_is_refused_naming_it():
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h"]),
        _int64("starts", [-1]),
        _int64("ends", [-1000]),
        _int64("axes", [2]),
        _int64("steps", [-1]),
        helper.make_node("Slice", ["h", "starts", "ends", "axes", "steps"], ["s"]),
        helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0),
    ]
    model = make_model(nodes, [("X", ["N", 4, 3])], {"W": np.ones((3, 7))})
    with pytest.raises(MissingGradientError, match="Slice"):
        gk.gradient_model(model, "loss", ["W"], backend="native")


COMPUTED_SLICES = {  # (starts, ends, axes or None) of x (N, 4, 7), computed in the graph
    **SLICES,
    "leading axes (the batch's too)": ([1, -3], [1000, 3], None),
}


def _computed_slice_model(bounds: list[int], axes, steps=None) -> onnx.ModelProto:
    """``loss = sum(s * s) + sum(h)``, ``s = Slice(h, starts, ends[, axes[, steps]])``
    with starts and ends read from the input ``B`` at run time (dynamo's EmbeddingBag
    computes them so): never constants to the gradient builder."""
    k = len(bounds) // 2
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h0"]),
        helper.make_node("Tanh", ["h0"], ["h"]),
        helper.make_node("Cast", ["B"], ["b"], to=TensorProto.INT64),
        _int64("first", [0]),
        _int64("middle", [k]),
        _int64("last", [2 * k]),
        helper.make_node("Slice", ["b", "first", "middle"], ["starts"]),
        helper.make_node("Slice", ["b", "middle", "last"], ["ends"]),
    ]
    operands = ["h", "starts", "ends"]
    if axes is not None:
        nodes.append(_int64("axes", axes))
        operands.append("axes")
    if steps is not None:
        nodes.append(_int64("steps", steps))
        operands.append("steps")
    nodes += [
        helper.make_node("Slice", operands, ["s"]),
        helper.make_node("Mul", ["s", "s"], ["s2"]),
        helper.make_node("ReduceSum", ["s2"], ["square"], keepdims=0),
        helper.make_node("ReduceSum", ["h"], ["plain"], keepdims=0),
        helper.make_node("Add", ["square", "plain"], ["loss"]),
    ]
    rng = np.random.default_rng(1)
    return make_model(nodes, [("X", ["N", 4, 3]), ("B", [2 * k])], {"W": rng.normal(size=(3, 7))})


@pytest.mark.parametrize("bounds", sorted(COMPUTED_SLICES))
def test_a_slice_at_computed_bounds_matches_finite_differences(bounds):
    """graphkit's rule for bounds known only at run time: pads computed in the graph,
    each bound normalized as Slice does (from the end when negative, then clamped)."""
    starts, ends, axes = COMPUTED_SLICES[bounds]
    model = _computed_slice_model(starts + ends, axes)
    rng = np.random.default_rng(0)
    b = np.array(starts + ends, np.float64)
    points = [{"X": rng.normal(size=(n, 4, 3)), "B": b} for n in (2, 3)]
    assert_matches_finite_differences(model, ["W", "X"], points)


def test_a_slice_at_computed_bounds_with_a_step_is_refused():
    model = _computed_slice_model([0, 7], [2], steps=[2])
    with pytest.raises(MissingGradientError, match="Slice.*steps of 1"):
        gk.gradient_model(model, "loss", ["W"], backend="native")


def test_a_concat_of_undeclared_extents_matches_finite_differences():
    """TorchScript's rotate_half: ``Concat(-x2, x1)`` of halves sliced at an extent it
    computes from ``Shape``, so none is declared; the gradient is split by extents read
    at run time. Two batch sizes."""
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h0"]),
        helper.make_node("Tanh", ["h0"], ["h"]),
        helper.make_node("Shape", ["h"], ["shape"]),
        _int64("last", [2]),
        _int64("two", [2]),
        _int64("zero", [0]),
        _int64("end", [2**62]),
        helper.make_node("Gather", ["shape", "last"], ["width"]),
        helper.make_node("Div", ["width", "two"], ["half"]),
        helper.make_node("Slice", ["h", "zero", "half", "last"], ["x1"]),
        helper.make_node("Slice", ["h", "half", "end", "last"], ["x2"]),
        helper.make_node("Neg", ["x2"], ["minus_x2"]),
        helper.make_node("Concat", ["minus_x2", "x1", "h"], ["rotated"], axis=-1),
        helper.make_node("Mul", ["rotated", "R"], ["weighted"]),
        helper.make_node("ReduceSum", ["weighted"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(2)
    model = make_model(
        nodes, [("X", ["N", 4, 3]), ("R", ["N", 4, 16])], {"W": rng.normal(size=(3, 8))}
    )
    points = [{"X": rng.normal(size=(n, 4, 3)), "R": rng.normal(size=(n, 4, 16))} for n in (2, 3)]
    assert "Split" in {n.op_type for n in native_gradient(model, "loss", ["W"]).graph.node}
    assert_matches_finite_differences(model, ["W", "X"], points)


def _conv_pool_model(count_include_pad: int, rng: np.random.Generator) -> onnx.ModelProto:
    """Conv (pads 1, strides 2) -> Tanh -> AveragePool (3x3, pads 1, strides 2) -> Conv
    (asymmetric pads, strides (2, 1)), the loss a weighted sum of its output."""
    nodes = [
        helper.make_node("Conv", ["X", "W1", "B1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Tanh", ["c1"], ["t1"]),
        helper.make_node(
            "AveragePool",
            ["t1"],
            ["p"],
            kernel_shape=[3, 3],
            pads=[1, 1, 1, 1],
            strides=[2, 2],
            count_include_pad=count_include_pad,
        ),
        helper.make_node("Conv", ["p", "W2"], ["c2"], pads=[0, 1, 1, 0], strides=[2, 1]),
        helper.make_node("Mul", ["c2", "R"], ["m"]),
        helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0),
    ]
    initializers = {
        "W1": rng.normal(size=(3, 2, 3, 3)),
        "B1": rng.normal(size=3),
        "W2": rng.normal(size=(2, 3, 2, 2)),
    }
    # X (N, 2, 9, 9) -> c1 (N, 3, 5, 5) -> p (N, 3, 3, 3) -> c2 (N, 2, 2, 3)
    return make_model(nodes, [("X", ["N", 2, 9, 9]), ("R", ["N", 2, 2, 3])], initializers)


@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_conv_and_average_pool_gradients_match_finite_differences(count_include_pad):
    """Both Conv layers (the second one's input gradient reaches W1) and the padded
    AveragePool, with the batch dimension symbolic: graphkit's own rules."""
    rng = np.random.default_rng(count_include_pad)
    model = _conv_pool_model(count_include_pad, rng)
    points = [
        {"X": rng.normal(size=(n, 2, 9, 9)), "R": rng.normal(size=(n, 2, 2, 3))} for n in (1, 2)
    ]
    assert_matches_finite_differences(model, ["W1", "B1", "W2"], points)
    assert_matches_finite_differences(model, ["X"], points[:1])


CONV_PATHS = {  # (input shape without the batch, weight shape, Conv attributes, path)
    # stride 1 and 8 input channels: d/dx is a Conv by the flipped weight
    "stride 1, dilated, uneven pads": (
        (8, 7, 6),
        (3, 8, 3, 2),
        {"dilations": [2, 1], "pads": [1, 0, 2, 1]},
        "conv",
    ),
    "1-D, stride 1": ((8, 9), (2, 8, 3), {"pads": [2, 0]}, "conv"),
    # a pad wider than the dilated kernel: ConvTranspose
    "pads wider than the kernel": ((8, 5, 5), (2, 8, 2, 2), {"pads": [2, 1, 1, 2]}, "transpose"),
    "3-D, strided": (
        (2, 5, 4, 4),
        (2, 2, 2, 2, 2),
        {"strides": [2, 1, 1], "pads": [1, 0, 0, 0, 1, 1]},
        "transpose",
    ),
}


@pytest.mark.parametrize("case", sorted(CONV_PATHS))
@pytest.mark.parametrize("patches", [True, False])
def test_conv_gradient_paths_match_finite_differences(case, patches, monkeypatch):
    """Each way graphkit's Conv rule writes a gradient (d/dx as a Conv or a
    ConvTranspose; d/dw as a product of patches, or onnx-ad's convolution by dy when the
    patches are above ``PATCHES_UP_TO``) equals central differences, batch symbolic."""
    from graphkit.backends import conv_adjoints

    if not patches:
        monkeypatch.setattr(conv_adjoints, "PATCHES_UP_TO", 0)
    sample, kernel, attributes, path = CONV_PATHS[case]
    nodes = [
        helper.make_node("Conv", ["X", "W", "B"], ["c"], **attributes),
        helper.make_node("Tanh", ["c"], ["t"]),
        helper.make_node("ReduceSumSquare", ["t"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(len(case))
    weights = {"W": rng.normal(size=kernel) * 0.3, "B": rng.normal(size=kernel[0])}
    model = make_model(nodes, [("X", ["N", *sample])], weights)
    grad = native_gradient(model, "loss", ["X", "W", "B"])
    ops = [n.op_type for n in grad.graph.node]
    assert ("ConvTranspose" in ops) == (path == "transpose"), ops
    stacked = any("a_patches" in o for n in grad.graph.node for o in n.output)
    assert stacked == patches, ops
    points = [{"X": rng.normal(size=(n, *sample))} for n in (1, 2)]
    assert_matches_finite_differences(model, ["W", "B"], points)
    assert_matches_finite_differences(model, ["X"], points[:1])


CONV_TRANSPOSES = {  # attributes of a ConvTranspose of X (N, 2, 4, 5) by W (2, 3, k, k)
    "strides 2, pads": dict(strides=[2, 2], pads=[1, 0, 0, 1]),
    "output_padding": dict(strides=[2, 3], output_padding=[1, 2]),
    "dilations": dict(dilations=[2, 1], pads=[1, 1, 1, 1]),
}


@pytest.mark.parametrize("attributes", sorted(CONV_TRANSPOSES))
def test_conv_transpose_weight_gradient_matches_finite_differences(attributes):
    """A decoder's ConvTranspose: its weight (graphkit's rule; onnx-ad has none), bias
    and input, with the batch dimension symbolic, at two batch sizes."""
    nodes = [
        helper.make_node("Tanh", ["X"], ["t"]),
        helper.make_node("ConvTranspose", ["t", "W", "B"], ["y"], **CONV_TRANSPOSES[attributes]),
        helper.make_node("Mul", ["y", "y"], ["y2"]),
        helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(1)
    weights = {"W": rng.normal(size=(2, 3, 3, 3)) * 0.5, "B": rng.normal(size=3)}
    model = make_model(nodes, [("X", ["N", 2, 4, 5])], weights)
    points = [{"X": rng.normal(size=(n, 2, 4, 5))} for n in (1, 3)]
    assert_matches_finite_differences(model, ["W", "B"], points)
    assert_matches_finite_differences(model, ["X"], points[:1])


UNEVEN = {  # (Conv pads, AveragePool pads, LpPool pads): the start padded less than the end
    "conv": ([0, 0, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0]),
    "average pool": ([1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 0]),
    "lp pool": ([1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]),
}


@pytest.mark.parametrize("where", sorted(UNEVEN))
def test_uneven_padding_matches_finite_differences(where):
    """TensorFlow's SAME with stride 2 is pads [0, 0, 1, 1]: the gradient is spread back
    with the forward's pads (ONNX's output_shape would split them evenly)."""
    conv, average, lp = UNEVEN[where]
    nodes = [
        helper.make_node("Conv", ["X", "W"], ["c"], pads=conv, strides=[2, 2]),
        helper.make_node("Tanh", ["c"], ["t"]),
        helper.make_node(
            "AveragePool", ["t"], ["a"], kernel_shape=[2, 2], pads=average, strides=[2, 1]
        ),
        helper.make_node("LpPool", ["a"], ["p"], kernel_shape=[2, 2], pads=lp, p=2),
        helper.make_node("Mul", ["p", "p"], ["p2"]),
        helper.make_node("ReduceSum", ["p2"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(5)
    model = make_model(nodes, [("X", ["N", 2, 8, 7])], {"W": rng.normal(size=(3, 2, 3, 3))})
    points = [{"X": rng.normal(size=(n, 2, 8, 7))} for n in (1, 2)]
    assert_matches_finite_differences(model, ["W"], points)
    assert_matches_finite_differences(model, ["X"], points[:1])


@pytest.mark.parametrize("mode", ["SAME_UPPER", "SAME_LOWER"])
def test_same_padding_matches_finite_differences(mode):
    """auto_pad=SAME_* (which onnx-ad refuses) becomes explicit pads first: a strided
    Conv and an AveragePool with an odd total padding, where UPPER and LOWER differ."""
    nodes = [
        helper.make_node("Conv", ["X", "W"], ["c"], auto_pad=mode, strides=[2, 2]),
        helper.make_node("Tanh", ["c"], ["t"]),
        helper.make_node("AveragePool", ["t"], ["p"], auto_pad=mode, kernel_shape=[2, 2]),
        helper.make_node("Mul", ["p", "p"], ["p2"]),
        helper.make_node("ReduceSum", ["p2"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(4)
    model = make_model(nodes, [("X", ["N", 2, 7, 6])], {"W": rng.normal(size=(3, 2, 3, 3))})
    points = [{"X": rng.normal(size=(n, 2, 7, 6))} for n in (1, 2)]
    assert_matches_finite_differences(model, ["W"], points)
    assert_matches_finite_differences(model, ["X"], points[:1])


def test_smooth_activations_and_a_shared_weight_match_finite_differences():
    """Softplus, Elu, Mish, Selu, HardSwish and PRelu (onnxruntime-training has no
    gradient for them); W is read twice, the output is not a scalar (summed)."""
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h"]),
        helper.make_node("Softplus", ["h"], ["a"]),
        helper.make_node("Elu", ["a"], ["b"], alpha=0.7),
        helper.make_node("Sub", ["b", "c"], ["b2"]),
        helper.make_node("Mish", ["b2"], ["m"]),
        helper.make_node("Selu", ["m"], ["s"]),
        helper.make_node("PRelu", ["s", "slope"], ["p"]),
        helper.make_node("HardSwish", ["p"], ["q"]),
        helper.make_node("Elu", ["q"], ["e"], alpha=1.3),
        helper.make_node("MatMul", ["e", "V"], ["v"]),
        helper.make_node("MatMul", ["X", "W"], ["again"]),
        helper.make_node("Mul", ["v", "again"], ["Y"]),
    ]
    rng = np.random.default_rng(2)
    initializers = {
        "W": rng.normal(size=(3, 5)),
        "c": rng.normal(size=5) + 1,
        "slope": rng.uniform(0.1, 0.5, size=5),
        "V": rng.normal(size=(5, 5)),
    }
    model = make_model(nodes, [("X", ["N", 3])], initializers, output="Y", output_shape=["N", 5])
    points = [{"X": rng.normal(size=(n, 3))} for n in (4, 2)]
    assert_matches_finite_differences(model, list(initializers), points, output="Y")


def test_if_whose_branches_read_the_weights_matches_finite_differences():
    """cond = sum(X) > 0; then: tanh(X W); else: (X W)^2 + b. Both branches, each point
    taking one."""
    value = helper.make_tensor_value_info
    then_branch = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["t0"]), helper.make_node("Tanh", ["t0"], ["t"])],
        "then",
        [],
        [value("t", DOUBLE, ["N", 4])],
    )
    else_branch = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["e0"]),
            helper.make_node("Mul", ["e0", "e0"], ["e1"]),
            helper.make_node("Add", ["e1", "b"], ["e"]),
        ],
        "else",
        [],
        [value("e", DOUBLE, ["N", 4])],
    )
    nodes = [
        helper.make_node("ReduceSum", ["X"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["cond"]),
        helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch),
        helper.make_node("Mul", ["y", "y"], ["y2"]),
        helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(3)
    initializers = {"W": rng.normal(size=(3, 4)), "b": rng.normal(size=4), "zero": 0.0}
    model = make_model(nodes, [("X", ["N", 3])], initializers)
    X = rng.normal(size=(5, 3))
    positive, negative = X - X.mean() + 0.5, X - X.mean() - 0.5
    assert_matches_finite_differences(model, ["W"], [{"X": positive}, {"X": negative}])
    assert_matches_finite_differences(model, ["W", "b"], [{"X": negative}])


def test_loop_accumulating_with_a_weight_matches_finite_differences():
    """h <- tanh(h W + b) three times, acc <- acc + h; loss = sum(acc^2)."""
    value = helper.make_tensor_value_info
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["h_in", "W"], ["hw"]),
            helper.make_node("Add", ["hw", "b"], ["hb"]),
            helper.make_node("Tanh", ["hb"], ["h_out"]),
            helper.make_node("Add", ["acc_in", "h_out"], ["acc_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            value("i", TensorProto.INT64, []),
            value("cond_in", TensorProto.BOOL, []),
            value("h_in", DOUBLE, [None, 4]),
            value("acc_in", DOUBLE, [None, 4]),
        ],
        [
            value("cond_out", TensorProto.BOOL, []),
            value("h_out", DOUBLE, [None, 4]),
            value("acc_out", DOUBLE, [None, 4]),
        ],
    )
    nodes = [
        _int64("trips", 3),
        helper.make_node(
            "Constant", [], ["keep_going"], value=numpy_helper.from_array(np.array(True))
        ),
        helper.make_node("Mul", ["X", "zero"], ["acc0"]),
        helper.make_node("Loop", ["trips", "keep_going", "X", "acc0"], ["h", "acc"], body=body),
        helper.make_node("Mul", ["acc", "acc"], ["a2"]),
        helper.make_node("ReduceSum", ["a2"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(4)
    initializers = {"W": rng.normal(size=(4, 4)) * 0.7, "b": rng.normal(size=4), "zero": 0.0}
    model = make_model(nodes, [("X", ["N", 4])], initializers)
    points = [{"X": rng.normal(size=(n, 4))} for n in (3, 1)]
    assert_matches_finite_differences(model, ["W", "b", "X"], points)


def test_scan_accumulating_with_weights_matches_finite_differences():
    """A recurrent net as a Scan over time: h <- tanh(x_t U + h W); the loss reads every
    step's output and the last state."""
    value = helper.make_tensor_value_info
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["x_t", "U"], ["xu"]),
            helper.make_node("MatMul", ["h_in", "W"], ["hw"]),
            helper.make_node("Add", ["xu", "hw"], ["z"]),
            helper.make_node("Tanh", ["z"], ["h_out"]),
            helper.make_node("Identity", ["h_out"], ["y_t"]),
        ],
        "step",
        [value("h_in", DOUBLE, [None, 4]), value("x_t", DOUBLE, [None, 3])],
        [value("h_out", DOUBLE, [None, 4]), value("y_t", DOUBLE, [None, 4])],
    )
    nodes = [
        helper.make_node("MatMul", ["H0", "scale"], ["h0"]),
        helper.make_node("Scan", ["h0", "S"], ["last", "ys"], body=body, num_scan_inputs=1),
        helper.make_node("Mul", ["ys", "ys"], ["y2"]),
        helper.make_node("ReduceSum", ["y2"], ["steps"], keepdims=0),
        helper.make_node("ReduceSum", ["last"], ["final"], keepdims=0),
        helper.make_node("Add", ["steps", "final"], ["loss"]),
    ]
    rng = np.random.default_rng(5)
    initializers = {
        "U": rng.normal(size=(3, 4)),
        "W": rng.normal(size=(4, 4)) * 0.5,
        "scale": rng.normal(size=(4, 4)),
    }
    model = make_model(nodes, [("H0", ["N", 4]), ("S", [5, "N", 3])], initializers)
    points = [{"H0": rng.normal(size=(n, 4)), "S": rng.normal(size=(5, n, 3))} for n in (2, 3)]
    assert_matches_finite_differences(model, ["U", "W", "scale", "S"], points)


def test_tied_batch_norm_statistics_match_finite_differences():
    """BatchNormalization(h, s, b, mean=b, var=s) in inference mode, as TorchScript
    exports a fresh BatchNorm1d (scale 1 = running_var, bias 0 = running_mean)."""
    nodes = [
        helper.make_node("Identity", ["s"], ["var"]),
        helper.make_node("Identity", ["b"], ["mean"]),
        helper.make_node("MatMul", ["X", "W"], ["h"]),
        helper.make_node("BatchNormalization", ["h", "s", "b", "mean", "var"], ["y"]),
        helper.make_node("Mul", ["y", "y"], ["y2"]),
        helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(6)
    initializers = {
        "W": rng.normal(size=(3, 4)),
        "s": rng.uniform(0.5, 2.0, size=4),
        "b": rng.normal(size=4),
    }
    model = make_model(nodes, [("X", ["N", 3])], initializers)
    assert_matches_finite_differences(model, ["W", "s", "b"], [{"X": rng.normal(size=(5, 3))}])


# -- 4. refusals ---------------------------------------------------------------------------


def _through(path: str) -> list[onnx.NodeProto]:
    """Nodes computing the float scalar ``k`` from W through ``path`` only."""
    to_float = helper.make_node("Cast", ["i"], ["f"], to=DOUBLE)
    total = helper.make_node("ReduceSum", ["f"], ["k"], keepdims=0)
    first = {
        "Shape": helper.make_node("Shape", ["W"], ["i"]),
        "ArgMax": helper.make_node("ArgMax", ["W"], ["i"], axis=0, keepdims=0),
        "Cast to int64": helper.make_node("Cast", ["W"], ["i"], to=TensorProto.INT64),
        "Floor": helper.make_node("Floor", ["W"], ["i"]),
        "Greater": helper.make_node("Greater", ["W", "b"], ["i"]),
    }[path]
    return [first, to_float, total]


ZERO_DERIVATIVE_PATHS = ["Shape", "ArgMax", "Cast to int64", "Floor", "Greater"]


@pytest.mark.parametrize("path", ZERO_DERIVATIVE_PATHS)
def test_a_weight_reached_only_through_a_zero_derivative_is_refused(path):
    """loss = sum(X b) * k(W): W reaches the loss, but its gradient is zero for any data."""
    nodes = [
        *_through(path),
        helper.make_node("MatMul", ["X", "b"], ["h"]),
        helper.make_node("Mul", ["h", "k"], ["hk"]),
        helper.make_node("ReduceSum", ["hk"], ["loss"], keepdims=0),
    ]
    rng = np.random.default_rng(8)
    model = make_model(
        nodes, [("X", ["N", 3])], {"W": rng.normal(size=(3, 4)), "b": rng.normal(size=(3, 4))}
    )
    with pytest.raises(MissingGradientError) as refused:
        gk.gradient_model(model, "loss", ["b", "W"], backend="native")
    assert "'W'" in str(refused.value) and "'b'" not in str(refused.value)


def test_a_weight_the_loss_never_reads_is_refused():
    nodes = [
        helper.make_node("MatMul", ["X", "b"], ["h"]),
        helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0),
        helper.make_node("MatMul", ["X", "W"], ["other"]),
    ]
    model = make_model(nodes, [("X", ["N", 3])], {"W": np.ones((3, 2)), "b": np.ones((3, 2))})
    with pytest.raises(MissingGradientError, match=r"\['W'\]"):
        gk.gradient_model(model, "loss", ["b", "W"], backend="native")


def _no_rule(kind: str) -> tuple[onnx.ModelProto, list[str]]:
    """A float32 graph with an operator onnx-ad 0.3.0 refuses on the path from W, named
    ``blocked``."""
    floats = TensorProto.FLOAT
    rng = np.random.default_rng(9)
    if kind == "BatchNormalization(training_mode=1)":
        nodes = [
            helper.make_node("MatMul", ["X", "W"], ["h"]),
            helper.make_node(
                "BatchNormalization",
                ["h", "s", "b", "mean", "var"],
                ["y", "running_mean", "running_var"],
                training_mode=1,
                name="blocked",
            ),
            helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
        ]
        inputs = [("X", ["N", 3])]
        values = {"W": rng.normal(size=(3, 4)), "s": np.ones(4), "b": np.zeros(4)}
        values.update(mean=np.zeros(4), var=np.ones(4))
    elif kind == "Det":  # onnx-ad takes its derivative for zero: graphkit refuses it
        nodes = [
            helper.make_node("MatMul", ["X", "W"], ["h"]),  # (N, 3, 3)
            helper.make_node("Det", ["h"], ["d"], name="blocked"),
            helper.make_node("Add", ["d", "d"], ["d2"]),
            helper.make_node("ReduceSum", ["d2"], ["loss"], keepdims=0),
        ]
        inputs = [("X", ["N", 3, 3])]
        values = {"W": rng.normal(size=(3, 3))}
    else:  # MaxRoiPool: no reverse rule at all
        nodes = [
            helper.make_node("Conv", ["X", "W"], ["c"]),
            helper.make_node(
                "MaxRoiPool", ["c", "rois"], ["p"], pooled_shape=[2, 2], name="blocked"
            ),
            helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0),
        ]
        inputs = [("X", ["N", 1, 6, 6]), ("rois", [2, 5])]
        values = {"W": rng.normal(size=(2, 1, 3, 3))}
    graph = helper.make_graph(
        nodes,
        kind,
        [helper.make_tensor_value_info(n, floats, s) for n, s in inputs],
        [helper.make_tensor_value_info("loss", floats, [])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in values.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    return model, ["W"]


NO_RULE = {
    "BatchNormalization(training_mode=1)": "BatchNormalization",
    "Det": "Det has a derivative",
    "MaxRoiPool": "MaxRoiPool",
}


@pytest.mark.parametrize("kind", sorted(NO_RULE))
def test_an_operator_without_a_rule_is_refused_with_its_name(kind):
    model, wrt = _no_rule(kind)
    with pytest.raises(MissingGradientError, match=NO_RULE[kind]) as refused:
        gk.gradient_model(model, "loss", wrt, backend="native")
    assert "onnx-ad" in str(refused.value)


@pytest.mark.parametrize(
    "kind",
    [
        "MaxRoiPool",
        "BatchNormalization(training_mode=1)",
    ],
)
def test_a_refusal_names_the_node(kind):
    model, wrt = _no_rule(kind)
    with pytest.raises(MissingGradientError) as refused:
        gk.gradient_model(model, "loss", wrt, backend="native")
    assert "'blocked'" in str(refused.value), str(refused.value)


# -- 5. the trainers ----------------------------------------------------------------------


@functools.cache
def regression_problem(kind: str):
    """``(training graph, X, y, initial weights in the trainer's names)``."""
    from skl2onnx import to_onnx
    from sklearn.linear_model import LinearRegression
    from sklearn.neural_network import MLPRegressor

    rng = np.random.default_rng(10)
    X = rng.normal(size=(90, 3)).astype(np.float32)
    y = (np.sin(X[:, 0]) - X[:, 1] * X[:, 2] + 0.1 * rng.normal(size=90)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "LinearRegression":  # fitted on a few rows: far from the optimum
            model = LinearRegression().fit(X[:5], y[:5] * 3)
            initial = {"W": model.coef_.reshape(3, 1), "b": np.atleast_1d(model.intercept_)}
        else:
            model = MLPRegressor(hidden_layer_sizes=(5,), max_iter=5, random_state=0).fit(X, y)
            initial = {
                "W1": model.coefs_[0],
                "b1": model.intercepts_[0],
                "W2": model.coefs_[1],
                "b2": model.intercepts_[1],
            }
        train = gk.add_loss_output(to_onnx(model, X[:1]), label_name="y")
    return train, X, y, {k: np.asarray(v, np.float64) for k, v in initial.items()}


def numpy_sgd(kind: str, epochs: int, batch_size: int, lr: float, seed: int):
    """The trainer's epochs in float64: a permutation of the rows per epoch from
    ``np.random.default_rng(random_state)`` (graphkit_train/trainers/base.py
    ``_run_epoch``), batches in that order (the last one shorter), the mean squared
    error of each batch, one SGD step per batch."""
    _, X, y, p = regression_problem(kind)
    p = {k: v.copy() for k, v in p.items()}
    rng = np.random.default_rng(seed)
    X64, y64 = X.astype(np.float64), y.astype(np.float64)
    for _ in range(epochs):
        order = rng.permutation(len(X))
        for start in range(0, len(X), batch_size):
            rows = order[start : start + batch_size]
            Xb, yb = X64[rows], y64[rows]
            if kind == "LinearRegression":
                d = 2 / len(rows) * (Xb @ p["W"] + p["b"] - yb[:, None])
                grads = {"W": Xb.T @ d, "b": d.sum(0)}
            else:
                z = Xb @ p["W1"] + p["b1"]
                a = np.maximum(z, 0)
                d = 2 / len(rows) * (a @ p["W2"] + p["b2"] - yb[:, None])
                dz = (d @ p["W2"].T) * (z > 0)
                grads = {"W2": a.T @ d, "b2": d.sum(0), "W1": Xb.T @ dz, "b1": dz.sum(0)}
            p = {k: v - lr * grads[k] for k, v in p.items()}
    return p


@functools.cache
def trained(kind: str, backend: str) -> dict[str, np.ndarray]:
    from graphkit_train import OrtGradientOptimizer

    train, X, y, _ = regression_problem(kind)
    trainer = OrtGradientOptimizer(
        train,
        max_iter=3,
        batch_size=16,
        learning_rate=(gk.optimizers.get("sgd"), 0.05),
        random_state=0,
        backend=backend,
    )
    trainer.fit(X, y)
    state = trainer.get_state()
    return {w: state[w] for w in trainer.update_step_.weights}


def _by_order(trained_weights: dict, reference: dict) -> dict:
    """The trainer's weights (skl2onnx's names, in the graph's order) under the reference's
    names, matched by position and checked by size."""
    assert len(trained_weights) == len(reference)
    named = dict(zip(reference, trained_weights.values()))
    for k, v in named.items():
        assert v.size == reference[k].size, (k, v.shape, reference[k].shape)
    return {k: v.reshape(reference[k].shape) for k, v in named.items()}


@pytest.mark.parametrize("kind", ["LinearRegression", "MLPRegressor"])
def test_native_trainer_equals_numpy_sgd(kind):
    expected = numpy_sgd(kind, epochs=3, batch_size=16, lr=0.05, seed=0)
    got = _by_order(trained(kind, "native"), expected)
    initial = regression_problem(kind)[3]
    assert any(not np.allclose(initial[k], expected[k], atol=1e-3) for k in expected)
    for k in expected:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6, err_msg=k)


@needs_ort_training
@pytest.mark.parametrize("kind", ["LinearRegression", "MLPRegressor"])
def test_native_trainer_equals_ort_training_trainer(kind):
    native, ort = trained(kind, "native"), trained(kind, "ort_training")
    assert list(native) == list(ort)
    for k in native:
        np.testing.assert_allclose(native[k], ort[k], rtol=1e-6, atol=1e-6, err_msg=k)


# -- 6. the emitted graphs ----------------------------------------------------------------


NATIVE_TRAINS = [c for c in CASES if c.refusal(FULL, "native") is None and not c.lora]
# where onnxruntime-training is installed, the comparison with it builds (and checks) the
# native gradient of every model both differentiate: the rest are checked here
STANDARD_CHECKED_HERE = [
    c for c in NATIVE_TRAINS if "ort_training" not in INSTALLED or c.refusal(FULL) is not None
]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in STANDARD_CHECKED_HERE])
def test_zoo_gradient_graphs_are_standard_onnx(case):
    """Every zoo model, GRU and LSTM included: ai.onnx / ai.onnx.ml operators only (in
    subgraphs too), no local functions, onnx.checker's full check (``native_gradient``;
    test_zoo_gradients_equal_onnxruntime_training checks the models both backends
    differentiate, where onnxruntime-training is installed)."""
    _needs_torch(case)
    assert_standard(zoo_native_gradient(case))


def test_graphkit_run_runs_a_native_recurrent_gradient():
    """As the README's quickstart runs a gradient graph: the weights as graph inputs."""
    pytest.importorskip("torch")
    case = next(c for c in CASES if c.name == "GRU" and c.exporter == "torch-script")
    train, weights, data = zoo_training(case)
    values = {w: initializer_values(train)[w] for w in weights}
    grad = native_gradient(
        initializers_to_inputs(train, weights), train.graph.output[0].name, weights
    )
    feeds = {**zoo_feeds(train, data.X_train[:4], data.y_train[:4]), **values}
    out = gk.run(grad, feeds)
    expected = backend_runner("native", grad)(feeds)
    for w in weights:
        np.testing.assert_allclose(out[f"{w}_grad"], expected[f"{w}_grad"], rtol=1e-6)


# -- the seed axis's plumbing, removed on static shapes -----------------------------------


def _plumbed_model() -> onnx.ModelProto:
    """What onnx-ad emits around a ReLU's rule and a weight's MatMul once shapes are
    static: the seed axis added by a Reshape and an Unsqueeze, an elementwise product, the
    axis moved first for a MatMul, and taken off again; plus a product whose reader cannot
    take a Reshape for free (a graph input beside it), which must stay as it is."""
    f32 = TensorProto.FLOAT
    nodes = [
        helper.make_node("Reshape", ["g", "last"], ["g_seeded"]),  # [10, 8] -> [10, 8, 1]
        helper.make_node("Greater", ["h", "zero"], ["positive"]),
        helper.make_node("Cast", ["positive"], ["mask"], to=f32),
        helper.make_node("Unsqueeze", ["mask", "minus_one"], ["mask_seeded"]),
        helper.make_node("Mul", ["g_seeded", "mask_seeded"], ["a"]),  # [10, 8, 1]
        helper.make_node("Mul", ["a", "half"], ["a_half"]),  # a constant [1, 8, 1]
        helper.make_node("Reshape", ["a_half", "first"], ["a_first"]),  # [1, 10, 8]
        helper.make_node("Transpose", ["x"], ["x_t"], perm=[1, 0]),  # [6, 10]
        helper.make_node("MatMul", ["x_t", "a_first"], ["w_seeded"]),  # [1, 6, 8]
        helper.make_node("Reshape", ["w_seeded", "matrix"], ["w_grad"]),  # [6, 8]
        helper.make_node("Reshape", ["g", "column"], ["g_column"]),  # [80, 1]
        helper.make_node("Mul", ["g_column", "two"], ["g2"]),
        helper.make_node("Add", ["g2", "c"], ["kept"]),  # c is an input: g2 stays [80, 1]
    ]
    ints = {
        "last": [10, 8, 1],
        "minus_one": [-1],
        "first": [1, 10, 8],
        "matrix": [6, 8],
        "column": [80, 1],
    }
    initializers = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
    initializers += [
        numpy_helper.from_array(np.float32(0), "zero"),
        numpy_helper.from_array(np.full((1, 8, 1), 0.5, np.float32), "half"),
        numpy_helper.from_array(np.float32(2), "two"),
    ]
    inputs = [("g", [10, 8]), ("h", [10, 8]), ("x", [10, 6]), ("c", [80, 1])]
    graph = helper.make_graph(
        nodes,
        "plumbing",
        [helper.make_tensor_value_info(n, f32, s) for n, s in inputs],
        [
            helper.make_tensor_value_info("w_grad", f32, [6, 8]),
            helper.make_tensor_value_info("kept", f32, [80, 1]),
        ],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_the_seed_axis_plumbing_goes_and_the_values_stay():
    """simplify (the native backend's fold) sinks the seed axis's Reshapes through the
    elementwise product and the MatMul until they cancel; the values are numpy's."""
    from graphkit.backends.native.simplify import simplify

    model = _plumbed_model()
    simplified = onnx.ModelProto()
    simplified.CopyFrom(model)
    assert simplify(simplified)
    onnx.checker.check_model(simplified, full_check=True)
    ops = [n.op_type for n in simplified.graph.node]
    # left: g_column's (its reader Add reads an input too) and the one naming the output
    assert ops.count("Reshape") + ops.count("Unsqueeze") == 2, ops
    assert ops.count("Mul") == 3 and "MatMul" in ops and "Add" in ops, ops
    rng = np.random.default_rng(0)
    feeds = {
        "g": rng.normal(size=(10, 8)).astype(np.float32),
        "h": rng.normal(size=(10, 8)).astype(np.float32),
        "x": rng.normal(size=(10, 6)).astype(np.float32),
        "c": rng.normal(size=(80, 1)).astype(np.float32),
    }
    w_grad, kept = backend_runner("native", simplified)(feeds).values()
    masked = feeds["g"] * (feeds["h"] > 0) * 0.5
    np.testing.assert_allclose(w_grad, feeds["x"].T @ masked, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(kept, feeds["g"].reshape(80, 1) * 2 + feeds["c"], rtol=1e-6)


def test_an_expand_sinks_with_the_seed_axis_and_the_values_stay():
    """An Expand whose result ends in the seed axis (a mean's gradient spread back over
    the averaged axis) runs without it, as its elementwise readers do; numpy's values."""
    from graphkit.backends.native.simplify import simplify

    f32 = TensorProto.FLOAT
    shapes = {"with_seed": [4, 1, 6, 1], "spread": [4, 3, 6, 1], "out": [4, 3, 6]}
    nodes = [
        helper.make_node("Reshape", ["g", "with_seed"], ["g1"]),
        helper.make_node("Expand", ["g1", "spread"], ["e"]),
        helper.make_node("Reshape", ["h", "spread"], ["h1"]),
        helper.make_node("Mul", ["e", "h1"], ["p"]),
        helper.make_node("Reshape", ["p", "out"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "expand",
        [
            helper.make_tensor_value_info("g", f32, [4, 1, 6]),
            helper.make_tensor_value_info("h", f32, [4, 3, 6]),
        ],
        [helper.make_tensor_value_info("y", f32, [4, 3, 6])],
        [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in shapes.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    assert simplify(model)
    onnx.checker.check_model(model, full_check=True)
    inferred = onnx.shape_inference.infer_shapes(model)
    kinds = {v.name: v for v in inferred.graph.value_info}
    (expand,) = [n for n in model.graph.node if n.op_type == "Expand"]
    dims = [d.dim_value for d in kinds[expand.output[0]].type.tensor_type.shape.dim]
    assert dims == [4, 3, 6]  # no trailing unit axis
    assert [n.op_type for n in model.graph.node].count("Reshape") <= 1
    rng = np.random.default_rng(0)
    feeds = {
        "g": rng.normal(size=(4, 1, 6)).astype(np.float32),
        "h": rng.normal(size=(4, 3, 6)).astype(np.float32),
    }
    (y,) = backend_runner("native", model)(feeds).values()
    np.testing.assert_allclose(y, np.broadcast_to(feeds["g"], (4, 3, 6)) * feeds["h"], rtol=1e-6)


def _simplified(nodes, inputs, outputs, ints):
    from graphkit.backends.native.simplify import simplify

    f32 = TensorProto.FLOAT
    graph = helper.make_graph(
        nodes,
        "simplified",
        [helper.make_tensor_value_info(n, f32, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, f32, s) for n, s in outputs.items()],
        [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    simplify(model)
    onnx.checker.check_model(model, full_check=True)
    return model


def test_carried_gradients_and_concats_sink_and_the_values_stay():
    """A Scan body's carried gradients are graph inputs with the seed axis
    (``[4, 3, 1]``): each is viewed once without it, the elementwise products and the
    Concat along an earlier axis run without it, and only the outputs' Reshapes are
    left; the values are numpy's."""
    nodes = [
        helper.make_node("Unsqueeze", ["a", "last"], ["a1"]),
        helper.make_node("Unsqueeze", ["b", "last"], ["b1"]),
        helper.make_node("Mul", ["dh", "a1"], ["p"]),  # dh: a graph input [4, 3, 1]
        helper.make_node("Mul", ["dh", "b1"], ["q"]),
        helper.make_node("Sum", ["dc", "q"], ["acc"]),  # dc too
        helper.make_node("Concat", ["p", "acc"], ["joined"], axis=-2),  # [4, 6, 1]
        helper.make_node("Reshape", ["joined", "flat"], ["out"]),
    ]
    model = _simplified(
        nodes,
        {"a": [4, 3], "b": [4, 3], "dh": [4, 3, 1], "dc": [4, 3, 1]},
        {"out": [4, 6]},
        {"last": [-1], "flat": [4, 6]},
    )
    kinds = [n.op_type for n in model.graph.node]
    # dh's and dc's views, and the one naming the output
    assert "Unsqueeze" not in kinds and kinds.count("Reshape") == 3, kinds
    shapes = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    (concat,) = [n for n in model.graph.node if n.op_type == "Concat"]
    assert [d.dim_value for d in shapes[concat.output[0]].type.tensor_type.shape.dim] == [4, 6]
    rng = np.random.default_rng(0)
    feeds = {n: rng.normal(size=s).astype(np.float32) for n, s in [("a", (4, 3)), ("b", (4, 3))]}
    feeds |= {n: rng.normal(size=(4, 3, 1)).astype(np.float32) for n in ("dh", "dc")}
    (out,) = backend_runner("native", model)(feeds).values()
    dh, dc = feeds["dh"][..., 0], feeds["dc"][..., 0]
    expected = np.concatenate([dh * feeds["a"], dc + dh * feeds["b"]], axis=1)
    np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_an_output_beside_a_graph_input_keeps_its_shape():
    """Viewing a graph input without its unit axis pays only where the node reading it
    sinks into readers that take it for free: here the sum is an output, so nothing
    moves."""
    nodes = [
        helper.make_node("Unsqueeze", ["a", "last"], ["a1"]),
        helper.make_node("Mul", ["a1", "a1"], ["p"]),
        helper.make_node("Add", ["p", "c"], ["out"]),  # c: a graph input [4, 3, 1]
    ]
    model = _simplified(nodes, {"a": [4, 3], "c": [4, 3, 1]}, {"out": [4, 3, 1]}, {"last": [-1]})
    assert [n.op_type for n in model.graph.node] == ["Unsqueeze", "Mul", "Add"]


def test_full_reductions_read_through_reshapes_and_matmul_transposes_stay():
    """A full reduction (keepdims 0) sums the Reshape's input; a Transpose of a column
    read only by a MatMul stays a Transpose (onnxruntime fuses it into the product)
    instead of becoming a Reshape; numpy's values."""
    nodes = [
        helper.make_node("Reshape", ["g", "seeded"], ["g1"]),
        helper.make_node("ReduceSum", ["g1"], ["total"], keepdims=0),
        helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["g", "wt"], ["product"]),
    ]
    model = _simplified(
        nodes,
        {"g": [5, 1], "w": [3, 1]},
        {"total": [], "product": [5, 3]},
        {"seeded": [5, 1, 1]},
    )
    kinds = [n.op_type for n in model.graph.node]
    assert kinds == ["ReduceSum", "Transpose", "MatMul"], kinds
    rng = np.random.default_rng(1)
    feeds = {"g": rng.normal(size=(5, 1)), "w": rng.normal(size=(3, 1))}
    feeds = {k: v.astype(np.float32) for k, v in feeds.items()}
    total, product = backend_runner("native", model)(feeds).values()
    np.testing.assert_allclose(total, feeds["g"].sum(), rtol=1e-6)
    np.testing.assert_allclose(product, feeds["g"] @ feeds["w"].T, rtol=1e-6)


def test_relu_gradient_reads_the_result_so_the_relu_fuses_into_its_gemm():
    """The native Relu rule reads y = Relu(x), not x, so x has one reader and
    onnxruntime can fuse Gemm + Relu (a FusedGemm). The gradient's values are checked
    against torch by the zoo and parity tests, whose networks use ReLU."""
    from conftest import mlp_onnx

    model = gk.add_loss_output(mlp_onnx(4, 5, 1))
    weights = trainable_weights(model, None)
    gradient = native_gradient(model, "loss", weights)
    relu = next(n for n in gradient.graph.node if n.op_type == "Relu")
    readers = [n.op_type for n in gradient.graph.node if relu.input[0] in n.input]
    assert readers == ["Relu"]
    greater = [n for n in gradient.graph.node if n.op_type == "Greater"]
    assert greater and all(g.input[0] == relu.output[0] for g in greater)


def test_the_layer_norm_gradient_reads_the_forward_statistics_and_equals_numpy():
    """Once shapes are static, the LayerNormalization adjoint reads the mean and
    1/sqrt(var + eps) the forward node reports instead of computing them again; the
    gradients are the formula's, in numpy (float64)."""
    from graphkit.static_shapes import specialize

    f32 = TensorProto.FLOAT
    rng = np.random.default_rng(5)
    gamma, beta = rng.normal(size=8), rng.normal(size=8)
    nodes = [
        helper.make_node("LayerNormalization", ["X", "gamma", "beta"], ["y"], epsilon=1e-3),
        helper.make_node("Tanh", ["y"], ["t"]),
        helper.make_node("ReduceSumSquare", ["t"], ["loss"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "layer_norm",
        [helper.make_tensor_value_info("X", f32, ["N", 3, 8])],
        [helper.make_tensor_value_info("loss", f32, [])],
        [
            numpy_helper.from_array(gamma.astype(np.float32), "gamma"),
            numpy_helper.from_array(beta.astype(np.float32), "beta"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    grad = native_gradient(model, "loss", ["X", "gamma", "beta"])
    static = specialize(grad, {"X": 4}, backends.get("native").constant_folds)
    onnx.checker.check_model(static, full_check=True)
    (norm,) = [n for n in static.graph.node if n.op_type == "LayerNormalization"]
    ops = [n.op_type for n in static.graph.node]
    assert len(norm.output) == 3 and all(norm.output), norm.output
    assert "Reciprocal" not in ops and "Sqrt" not in ops, ops
    X = rng.normal(size=(4, 3, 8)).astype(np.float32)
    got = backend_runner("native", static)({"X": X})
    x = X.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    inv = 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + 1e-3)
    xhat = (x - mean) * inv
    t = np.tanh(xhat * gamma + beta)
    dy = 2 * t * (1 - t**2)
    dxhat = dy * gamma
    dx = inv * (
        dxhat - dxhat.mean(-1, keepdims=True) - xhat * (dxhat * xhat).mean(-1, keepdims=True)
    )
    np.testing.assert_allclose(got["loss"], (t**2).sum(), rtol=1e-5)
    np.testing.assert_allclose(got["X_grad"], dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["gamma_grad"], (dy * xhat).sum((0, 1)), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["beta_grad"], dy.sum((0, 1)), rtol=1e-4, atol=1e-5)
