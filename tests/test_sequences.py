"""graphkit/sequences.py: sequence patterns written with tensor operators, against
onnxruntime's sequence kernels (outputs), numpy (one SGD step) and torch (a dynamo
export of ``Tensor.split``, trained)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import (
    INSTALLED_BACKENDS,
    assert_sgd_epoch_equals_torch,
    export_dynamo,
    requires_torch,
)
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit.engine.ort_engine import Runner
from graphkit.sequences import sequences_as_tensors
from graphkit_train import OrtGradientOptimizer

F32 = TensorProto.FLOAT
SEQUENCE_OPS = {"SplitToSequence", "SequenceAt", "SequenceConstruct", "ConcatFromSequence"}


def model(nodes, inputs, outputs, inits=None, rank=2, opset=18) -> onnx.ModelProto:
    """``outputs``: names of float outputs of rank ``rank`` (sizes left unnamed)."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, F32, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, F32, [None] * rank) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in (inits or {}).items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds) -> None:
    onnx.checker.check_model(after, full_check=True)
    assert not SEQUENCE_OPS & {n.op_type for n in after.graph.node}
    for got, expected in zip(Runner(after)(feeds), Runner(before)(feeds), strict=True):
        assert got.shape == expected.shape
        np.testing.assert_array_equal(got, expected)


def split_then_at(split, positions, axis=1, keepdims=1, extent=10):
    inputs = ["X", "split"] if split is not None else ["X"]
    nodes = [helper.make_node("SplitToSequence", inputs, ["seq"], axis=axis, keepdims=keepdims)]
    outputs = [f"Y{k}" for k in range(len(positions))]
    for k, output in enumerate(outputs):
        nodes.append(helper.make_node("SequenceAt", ["seq", f"at{k}"], [output]))
    inits = {f"at{k}": np.array(p, np.int64) for k, p in enumerate(positions)}
    if split is not None:
        inits["split"] = np.array(split, np.int64)
    rank = 3 if split is not None or keepdims else 2
    return model(nodes, {"X": ["N", extent, 3]}, outputs, inits, rank)


@pytest.mark.parametrize(
    "split, positions, keepdims",
    [
        ([3, 3, 4], [0, 1, 2], 1),  # sizes
        (4, [0, 1, -1], 1),  # chunks of 4 over 10: 4, 4, 2; a negative position
        (None, [0, 9, 5], 0),  # one step each, squeezed
        (None, [2], 1),  # one step each, kept; only one part read
    ],
)
def test_a_split_to_sequence_read_at_constant_positions_is_a_split(split, positions, keepdims):
    original = split_then_at(split, positions, keepdims=keepdims)
    rewritten = sequences_as_tensors(original)
    assert "Split" in {n.op_type for n in rewritten.graph.node}
    feeds = {"X": np.random.default_rng(0).normal(size=(2, 10, 3)).astype(np.float32)}
    assert_same_outputs(original, rewritten, feeds)


@pytest.mark.parametrize("new_axis", [0, 1])
def test_a_constructed_sequence_concatenated_is_a_concat(new_axis):
    original = model(
        [
            helper.make_node("SequenceConstruct", ["A", "B", "C"], ["seq"]),
            helper.make_node("ConcatFromSequence", ["seq"], ["Y"], axis=1, new_axis=new_axis),
        ],
        {"A": ["N", 3], "B": ["N", 3], "C": ["N", 3]},
        ["Y"],
        rank=2 + new_axis,
    )
    rewritten = sequences_as_tensors(original)
    rng = np.random.default_rng(1)
    feeds = {n: rng.normal(size=(2, 3)).astype(np.float32) for n in "ABC"}
    assert_same_outputs(original, rewritten, feeds)


def test_other_uses_of_a_sequence_stay():
    """A sequence read by SequenceLength, a chunk size over an axis of unknown extent,
    and a position that is computed: left as they are."""
    counted = split_then_at([5, 5], [0])
    counted.graph.node.append(helper.make_node("SequenceLength", ["seq"], ["n"]))
    counted.graph.output.append(helper.make_tensor_value_info("n", TensorProto.INT64, []))
    assert sequences_as_tensors(counted) is counted
    unknown = split_then_at(4, [0], extent="T")
    assert sequences_as_tensors(unknown) is unknown
    computed = split_then_at([5, 5], [0])
    computed.graph.input.append(helper.make_tensor_value_info("at0", TensorProto.INT64, []))
    del computed.graph.initializer[[i.name for i in computed.graph.initializer].index("at0")]
    assert sequences_as_tensors(computed) is computed


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_one_sgd_step_through_a_split_sequence_equals_numpy(backend):
    """``Y = q * k + v`` with ``q, k, v`` the thirds of ``X W`` taken apart as a sequence:
    one SGD step of the squared error on W, against numpy's formula."""
    rng = np.random.default_rng(2)
    W = rng.normal(size=(3, 6)).astype(np.float32)
    onx = model(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("SplitToSequence", ["XW", "two"], ["seq"], axis=1),
            *[helper.make_node("SequenceAt", ["seq", f"at{k}"], [n]) for k, n in enumerate("qkv")],
            helper.make_node("Mul", ["q", "k"], ["qk"]),
            helper.make_node("Add", ["qk", "v"], ["Y"]),
        ],
        {"X": ["N", 3]},
        ["Y"],
        {"W": W, "two": np.array(2, np.int64), **{f"at{k}": np.array(k) for k in range(3)}},
    )
    X = rng.normal(size=(8, 3)).astype(np.float32)
    y = rng.normal(size=(8, 2)).astype(np.float32)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(onx, "squared_error"),
        ["W"],
        max_iter=1,
        batch_size=8,
        learning_rate=0.1,
        backend=backend,
    ).fit(X, y)
    x64, w64 = X.astype(np.float64), W.astype(np.float64)
    q, k, v = np.split(x64 @ w64, 3, axis=1)
    residual = 2 * (q * k + v - y) / y.size  # mean squared error's gradient
    grad = x64.T @ np.concatenate([residual * k, residual * q, residual], axis=1)
    np.testing.assert_allclose(trainer.get_state()["W"], w64 - 0.1 * grad, rtol=1e-5, atol=1e-7)


@requires_torch
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_a_dynamo_export_of_split_trains_as_torch(backend):
    """``Tensor.split`` as the README's dynamo recipe exports it (SplitToSequence and
    SequenceAt, GPT-2's attention writes it so): 3 SGD steps equal torch's."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.lin(x).split(2, dim=-1)
            return q * k + v

    torch.manual_seed(0)
    net = Net()
    rng = np.random.default_rng(3)
    X = rng.normal(size=(24, 3)).astype(np.float32)
    y = rng.normal(size=(24, 2)).astype(np.float32)
    onx = export_dynamo(net, X)
    assert "SplitToSequence" in {n.op_type for n in onx.graph.node}
    assert_sgd_epoch_equals_torch(onx, net, X, y, backend)


@pytest.mark.skipif(
    "ort_training" not in INSTALLED_BACKENDS, reason="onnxruntime-training is not installed"
)
@pytest.mark.parametrize("trainer", ["full", "forward_backward"])
def test_a_sequence_left_is_refused_in_the_users_names(trainer):
    """A part taken at a computed position stays a sequence: onnxruntime-training finds
    the weight "unreachable"; the refusal names the weight as the user knows it (not the
    forward/backward builder's internal name), the cause, and the native backend."""
    from graphkit.errors import MissingGradientError
    from graphkit_train import OrtGradientForwardBackwardOptimizer

    W = np.ones((3, 4), np.float32)
    onx = model(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("SplitToSequence", ["XW", "two"], ["seq"], axis=1),
            helper.make_node("ReduceMax", ["position"], ["at"], keepdims=0),  # computed
            helper.make_node("SequenceAt", ["seq", "at"], ["Y"]),
        ],
        {"X": ["N", 3]},
        ["Y"],
        {"W": W, "two": np.array(2, np.int64), "position": np.array([0, 1], np.int64)},
    )
    X, y = np.ones((4, 3), np.float32), np.ones((4, 2), np.float32)
    common = dict(max_iter=1, batch_size=4, backend="ort_training")
    if trainer == "full":
        fit = OrtGradientOptimizer(gk.add_loss_output(onx, "squared_error"), ["W"], **common)
    else:
        fit = OrtGradientForwardBackwardOptimizer(
            onx, ["W"], learning_loss="squared_error", **common
        )
    with pytest.raises(MissingGradientError, match=r"no path from the weight 'W'.*'native'"):
        fit.fit(X, y)


def loop_appending(new_axis: int = 0, also_read: bool = False) -> onnx.ModelProto:
    """A Loop over the rows of X (N x 4) appending ``row * W`` (1 x 4) a turn to a
    sequence started empty, concatenated after the loop (dynamo's nn.EmbeddingBag)."""
    body = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["i", "zero"], ["at"]),
            helper.make_node("Gather", ["X", "at"], ["row"], axis=0),
            helper.make_node("Mul", ["row", "W"], ["scaled"]),
            helper.make_node("SequenceInsert", ["seq_in", "scaled"], ["seq_out"]),
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_sequence_value_info("seq_in", F32, None),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_sequence_value_info("seq_out", F32, None),
        ],
    )
    nodes = [
        helper.make_node("Shape", ["X"], ["shape"], end=1),
        helper.make_node("Squeeze", ["shape"], ["n"]),
        helper.make_node("SequenceEmpty", [], ["empty"], dtype=F32),
        helper.make_node("Loop", ["n", "true", "empty"], ["rows"], body=body),
        helper.make_node("ConcatFromSequence", ["rows"], ["Y"], axis=0, new_axis=new_axis),
    ]
    inits = {
        "W": np.arange(1, 5, dtype=np.float32),
        "zero": np.array([0], np.int64),
        "true": np.array(True),
    }
    built = model(nodes, {"X": ["N", 4]}, ["Y"], inits, rank=3 if new_axis else 2)
    if also_read:
        built.graph.node.append(helper.make_node("SequenceLength", ["rows"], ["count"]))
        built.graph.output.append(helper.make_tensor_value_info("count", TensorProto.INT64, []))
    return built


@pytest.mark.parametrize("new_axis", [0, 1])
def test_a_loop_appending_to_a_sequence_is_a_loop_with_a_scan_output(new_axis):
    original = loop_appending(new_axis)
    rewritten = sequences_as_tensors(original)
    kinds = {n.op_type for n in rewritten.graph.node}
    assert not kinds & {"SequenceEmpty", "ConcatFromSequence"}
    X = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    assert_same_outputs(original, rewritten, {"X": X})


def test_a_loop_sequence_read_otherwise_stays():
    original = loop_appending(also_read=True)
    assert sequences_as_tensors(original) is original


EXPORTS = ["torchscript", "dynamo", "dynamo recipe (optimize=False)"]


@requires_torch
@pytest.mark.parametrize("export", EXPORTS)
def test_an_embedding_bag_trains_as_torch_on_native(export):
    """``nn.EmbeddingBag(mode="mean")`` as each exporter writes it: TorchScript's Loop
    over the bags, dynamo's Loop slicing the rows at offsets it computes per bag (the
    native rule for a Slice at computed bounds), and the README's recipe, which adds
    Ifs on constants that onnxruntime's constant folding crashes on
    (graphkit.constant_branches). One SGD epoch equals torch's; predictions too."""
    import torch
    from zoo.models import torch_export

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.EmbeddingBag(20, 4, mode="mean"), torch.nn.Linear(4, 2))
    rng = np.random.default_rng(5)
    X = rng.integers(0, 20, size=(16, 3)).astype(np.int64)
    y = rng.normal(size=(16, 2)).astype(np.float32)
    if export == EXPORTS[2]:
        onx = export_dynamo(net, X)
    else:
        onx = torch_export(net, X, dynamo=export == "dynamo")
    assert "Loop" in {n.op_type for n in onx.graph.node}
    trainer = assert_sgd_epoch_equals_torch(onx, net, X, y, "native")
    with torch.no_grad():
        expected = net(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(trainer.predict(X), expected, rtol=1e-5, atol=1e-6)
