"""A packed update's weights carried laid end to end through a fused epoch's Scan
(graphkit.training.packed_carry, wired by graphkit.training.epoch.scan_over_batches).

References: the step run batch by batch (no Scan, nothing rewritten), to the bit, on
onnxruntime and on onnx.reference; numpy for the formula of the hand-built step.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import pytest
from conftest import INSTALLED_BACKENDS, mlp_onnx, on_both_runtimes
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import optimizers
from graphkit.engine.ort_engine import inference_session
from graphkit.training.epoch import PACKED_WEIGHTS, scan_over_batches
from graphkit.training.packed_carry import packed_weights
from graphkit_train import OrtGradientOptimizer

F = TensorProto.FLOAT


def packed_step(piece_read_elsewhere: bool = False) -> onnx.ModelProto:
    """W [2, 3], b [3] laid end to end, decayed and moved against the batch's mean row
    (a packed update's shape): u = -0.1 * (g + 0.01 * [W, b]), g = [mean(x) @ 1, mean(x)]
    laid end to end; W.next = W + u[:6] as [2, 3], b.next = b + u[6:]; loss = sum(u)."""
    nodes = [
        helper.make_node("Reshape", ["W", "flat"], ["W_flat"]),
        helper.make_node("Concat", ["W_flat", "b"], ["weights"], axis=0),
        helper.make_node("ReduceMean", ["x", "rows"], ["g_b"], keepdims=0),  # [3]
        helper.make_node("Concat", ["g_b", "g_b", "g_b"], ["g_w"], axis=0),  # [9]
        helper.make_node("Slice", ["g_w", "zero", "six"], ["g_W"]),  # [6]
        helper.make_node("Concat", ["g_W", "g_b"], ["g"], axis=0),  # [9]
        helper.make_node("Mul", ["weights", "decay"], ["decayed"]),
        helper.make_node("Add", ["g", "decayed"], ["direction"]),
        helper.make_node("Mul", ["direction", "rate"], ["u"]),
        helper.make_node("Split", ["u", "sizes"], ["u_W", "u_b"], axis=0),
        helper.make_node("Reshape", ["u_W", "W_shape"], ["u_W2"]),
        helper.make_node("Add", ["W", "u_W2"], ["W.next"]),
        helper.make_node("Add", ["b", "u_b"], ["b.next"]),
        helper.make_node("ReduceSum", ["u"], ["loss"], keepdims=0),
    ]
    outputs = ["W.next", "b.next", "loss"]
    if piece_read_elsewhere:
        nodes.append(helper.make_node("Identity", ["u_b"], ["seen"]))
        outputs.append("seen")
    constants = {
        "flat": np.array([-1], np.int64),
        "rows": np.array([0], np.int64),
        "zero": np.array([0], np.int64),
        "six": np.array([6], np.int64),
        "decay": np.array(0.01, np.float32),
        "rate": np.array(-0.1, np.float32),
        "sizes": np.array([6, 3], np.int64),
        "W_shape": np.array([2, 3], np.int64),
    }
    shapes = {"W.next": [2, 3], "b.next": [3], "loss": [], "seen": [3]}
    graph = helper.make_graph(
        nodes,
        "step",
        [
            helper.make_tensor_value_info("W", F, [2, 3]),
            helper.make_tensor_value_info("b", F, [3]),
            helper.make_tensor_value_info("x", F, [4, 3]),
        ],
        [helper.make_tensor_value_info(o, F, shapes[o]) for o in outputs],
        [numpy_helper.from_array(v, k) for k, v in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def body_of(model: onnx.ModelProto) -> onnx.GraphProto:
    scan = next(n for n in model.graph.node if n.op_type == "Scan")
    return next(a.g for a in scan.attribute if a.name == "body")


def numpy_epoch(W, b, xs):
    W, b = W.copy(), b.copy()
    for x in xs:
        g_b = x.mean(axis=0)
        g = np.concatenate([np.tile(g_b, 2), g_b])
        u = np.float32(-0.1) * (g + np.float32(0.01) * np.concatenate([W.ravel(), b]))
        W, b = W + u[:6].reshape(2, 3), b + u[6:]
    return W, b


@pytest.mark.parametrize("read_elsewhere", [False, True])
def test_an_epoch_carries_the_weights_laid_end_to_end_and_trains_as_batch_by_batch(
    read_elsewhere,
):
    """The epoch's Scan carries W and b as one vector (its body: one Split to give the
    layers their weights, one Add for the update, no Concat of the weights), its inputs
    and outputs those of the step; the same weights as the step run batch by batch, to
    the bit, on onnxruntime and onnx.reference, and numpy's. A piece of the update read
    by another node: nothing changes."""
    step = packed_step(read_elsewhere)
    found = packed_weights(step, ["W", "b"])
    assert (found is None) == read_elsewhere
    epoch = scan_over_batches(step, ["x"], ["W", "b"], "loss", 4)
    onnx.checker.check_model(epoch, full_check=True)
    assert [i.name for i in epoch.graph.input] == ["x", "W", "b"]
    assert [o.name for o in epoch.graph.output] == ["W.next", "b.next"]
    body = body_of(epoch)
    carried = body.input[0].name
    if not read_elsewhere:
        assert carried == f"step/{PACKED_WEIGHTS}"
        kinds = [n.op_type for n in body.node]
        assert kinds.count("Split") == 1 and "Reshape" in kinds
        assert [n.op_type for n in body.node if carried in n.input] == ["Split", "Mul", "Add"]
    else:
        assert carried == "step/W"
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(25, 4, 3)).astype(np.float32)
    W = rng.normal(size=(2, 3)).astype(np.float32)
    b = rng.normal(size=3).astype(np.float32)
    session, W_step, b_step = inference_session(step), W, b
    for x in xs:
        W_step, b_step = session.run(["W.next", "b.next"], {"x": x, "W": W_step, "b": b_step})
    for W_epoch, b_epoch in on_both_runtimes(epoch, {"x": xs, "W": W, "b": b}):
        np.testing.assert_array_equal(W_epoch, W_step)
        np.testing.assert_array_equal(b_epoch, b_step)
    W_np, b_np = numpy_epoch(W, b, xs)
    np.testing.assert_allclose(W_step, W_np, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(b_step, b_np, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_a_trainers_fused_adamw_epoch_carries_its_weights_packed(backend):
    """AdamW on an MLP: the fused epoch's Scan carries the weights laid end to end, its
    epoch graph passes the full checker, and it trains as one run per batch does."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 3)).astype(np.float32)
    y = rng.normal(size=(40, 2)).astype(np.float32)
    states = {}
    for steps_per_run in (1, "epoch"):
        trainer = OrtGradientOptimizer(
            gk.add_loss_output(mlp_onnx(3, 4, 2, scale=0.5)),
            max_iter=2,
            batch_size=8,
            learning_rate=optimizers.adamw(learning_rate=0.01, weight_decay=0.1),
            shuffle=False,
            steps_per_run=steps_per_run,
            backend=backend,
        )
        trainer.fit(X, y)
        states[steps_per_run] = trainer.get_state()
    (runner,) = trainer._fused_runners.values()
    onnx.checker.check_model(runner.scan_model, full_check=True)
    assert body_of(runner.scan_model).input[0].name == f"step/{PACKED_WEIGHTS}"
    for key, value in states[1].items():
        np.testing.assert_allclose(states["epoch"][key], value, rtol=1e-6, atol=1e-7)
