"""A step's values that depend on its step counter alone, computed for the whole epoch
before the epoch's Scan (graphkit.training.counter, wired by
graphkit.training.epoch.scan_over_batches).

References: numpy from the formula, step by step; the trainers' one-run-per-batch path
(no Scan, nothing moved), which the parity tests check against torch.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import pytest
from conftest import mlp_onnx, on_both_runtimes
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import optimizers, schedules
from graphkit._graph import all_graphs
from graphkit.engine.ort_engine import inference_session
from graphkit.training.counter import counter_values
from graphkit.training.epoch import scan_over_batches
from graphkit_train import OrtGradientOptimizer

B1 = 0.9


def corrected_step(
    opset: int = 18, counter_elem: int = TensorProto.INT64, **also_outputs: None
) -> onnx.ModelProto:
    """w.next = w - s * mean(x, rows), s = sqrt(c) / c, c = 1 - 0.9 ** (t + 1): Adam's
    shape of bias correction, reshaped to [1] as a packed update reads it; t.next = t + 1;
    loss = sum(w.next)."""
    counter_type = helper.tensor_dtype_to_np_dtype(counter_elem)
    nodes = [
        helper.make_node("Add", ["t", "one"], ["t.next"]),
        helper.make_node("Add", ["t", "one"], ["t1"]),
        helper.make_node("Cast", ["t1"], ["tf"], to=TensorProto.FLOAT),
        helper.make_node("Pow", ["b1", "tf"], ["power"]),
        helper.make_node("Sub", ["unit", "power"], ["c"]),
        helper.make_node("Sqrt", ["c"], ["root"]),
        helper.make_node("Div", ["root", "c"], ["s"]),
        helper.make_node("Reshape", ["s", "rank1"], ["s1"]),
        helper.make_node("ReduceMean", ["x", "rows"], ["g"], keepdims=0)
        if opset >= 18
        else helper.make_node("ReduceMean", ["x"], ["g"], keepdims=0, axes=[0]),
        helper.make_node("Mul", ["s1", "g"], ["delta"]),
        helper.make_node("Sub", ["w", "delta"], ["w.next"]),
        helper.make_node("ReduceSum", ["w.next"], ["loss"], keepdims=0),
    ]
    initializers = [
        numpy_helper.from_array(np.array(1, counter_type), "one"),
        numpy_helper.from_array(np.array(B1, np.float32), "b1"),
        numpy_helper.from_array(np.array(1.0, np.float32), "unit"),
        numpy_helper.from_array(np.array([1], np.int64), "rank1"),
        numpy_helper.from_array(np.array([0], np.int64), "rows"),
    ]
    outputs = ["w.next", "t.next", "loss"]
    outputs += list(also_outputs)  # results also read outside the step
    graph = helper.make_graph(
        nodes,
        "step",
        [
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("t", counter_elem, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
        ],
        [
            helper.make_tensor_value_info(
                o,
                counter_elem if o == "t.next" else TensorProto.FLOAT,
                [3] if o == "w.next" else [],
            )
            for o in outputs
        ],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def numpy_epoch(w, t, x):
    w, t = w.astype(np.float32).copy(), int(t)
    for batch in x:
        c = np.float32(1) - np.float32(B1) ** np.float32(t + 1)
        w = w - (np.sqrt(c) / c) * batch.mean(axis=0)
        t += 1
    return w, t


def body_of(model: onnx.ModelProto) -> onnx.GraphProto:
    scan = next(n for n in model.graph.node if n.op_type == "Scan")
    return next(a.g for a in scan.attribute if a.name == "body")


@pytest.mark.parametrize("counter_elem", [TensorProto.INT64, TensorProto.INT32])
def test_counter_arithmetic_runs_before_the_scan_and_equals_numpy(counter_elem):
    step = corrected_step(counter_elem=counter_elem)
    epoch = scan_over_batches(step, ["x"], ["w", "t"], "loss", 4)
    onnx.checker.check_model(epoch, full_check=True)
    body = [n.op_type for n in body_of(epoch).node]
    assert not {"Pow", "Cast"} & set(body)  # moved out
    assert body.count("Sub") == 1 and "Add" not in body  # the update's; the counter's
    # increment too: nothing in the step reads the counter any more, the epoch counts
    # after its Scan, which neither carries nor increments it
    scan = next(n for n in epoch.graph.node if n.op_type == "Scan")
    assert "t" not in scan.input and "t.next" not in scan.output
    assert "Sqrt" not in body  # moved too, in float64 (onnxruntime's float32 vector
    # kernel rounds otherwise than its one-element kernel, the float64 ones alike)
    outer = {n.op_type: n for n in epoch.graph.node}
    assert set(outer) >= {"Range", "Pow", "Sub", "Sqrt", "Scan"}
    sqrt_input = outer["Sqrt"].input[0]
    (widening,) = [n for n in epoch.graph.node if n.output[0] == sqrt_input]
    assert widening.op_type == "Cast" and widening.attribute[0].i == TensorProto.DOUBLE
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 4, 3)).astype(np.float32)  # 300 steps' square roots
    w = rng.normal(size=3).astype(np.float32)
    t = np.array(5, helper.tensor_dtype_to_np_dtype(counter_elem))
    expected_w, expected_t = numpy_epoch(w, t, x)
    feeds = {"x": x, "w": w, "t": t}
    for new_w, new_t in on_both_runtimes(epoch, feeds):
        np.testing.assert_allclose(new_w, expected_w, rtol=1e-6)
        assert int(new_t) == expected_t
    # to the bit what the step computes batch by batch
    session, w_step, t_step = inference_session(step), w, t
    for batch in x:
        w_step, t_step = session.run(["w.next", "t.next"], {"x": batch, "w": w_step, "t": t_step})
    np.testing.assert_array_equal(inference_session(epoch).run(None, feeds)[0], w_step)


def test_nothing_moves_without_a_counter_or_before_opset_11():
    step = corrected_step()
    assert counter_values(step, ["w"]) is None  # t not carried: not a counter
    older = scan_over_batches(corrected_step(opset=10), ["x"], ["w", "t"], "loss", 4)
    assert "Pow" in {n.op_type for n in body_of(older).node}


def test_a_value_the_step_outputs_stays_in_the_step():
    step = corrected_step(c=None)  # c is also an output of the step
    values = counter_values(step, ["w", "t"])
    moved = {o for n in values.nodes for o in n.output}
    assert "c" not in moved and {"t1", "tf", "power"} <= moved
    assert values.frontier == ["power"]  # what the step still reads of them


def test_body_reads_no_constant_it_lost():
    """The constants only moved nodes read leave the body (onnxruntime warns about
    unused initializers), those still read stay."""
    epoch = scan_over_batches(corrected_step(), ["x"], ["w", "t"], "loss", 4)
    body = body_of(epoch)
    names = {t.name for t in body.initializer}
    assert "step/b1" not in names and "step/unit" not in names
    assert "step/one" not in names  # the increment went too: counted after the Scan
    assert "step/rows" in names  # the mean's axes, still read


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: optimizers.adam(learning_rate=0.01),
        lambda: optimizers.adamw(learning_rate=schedules.cosine(0.01, 20)),
        lambda: optimizers.sgd(learning_rate=schedules.warmup(schedules.cosine(0.05, 20), 5)),
    ],
    ids=["adam", "adamw+cosine", "sgd+warmup"],
)
def test_trainers_epochs_move_the_counter_arithmetic_and_train_as_batch_by_batch(optimizer):
    """The fused epoch (counter arithmetic moved out) against one run per batch (no
    Scan: nothing moved), over epochs and runs of 3 batches that continue the counter."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(40, 3)).astype(np.float32)
    y = rng.normal(size=(40, 2)).astype(np.float32)
    states = {}
    for steps_per_run in (1, 3, "epoch"):
        trainer = OrtGradientOptimizer(
            gk.add_loss_output(mlp_onnx(3, 4, 2, scale=0.5)),
            max_iter=3,
            batch_size=8,
            learning_rate=optimizer(),
            random_state=3,
            steps_per_run=steps_per_run,
        )
        trainer.fit(X, y)
        states[steps_per_run] = trainer.get_state()
        if steps_per_run != 1:
            (runner,) = trainer._fused_runners.values()
            outer = {n.op_type for n in runner.scan_model.graph.node}
            assert "Range" in outer  # its counter's values, computed before the Scan
            readers = [
                n.op_type
                for g in all_graphs(body_of(runner.scan_model))
                for n in g.node
                if "step/step" in n.input
            ]
            assert readers == []  # all moved: the epoch counts after its Scan
    for other in (3, "epoch"):
        for key, value in states[1].items():
            np.testing.assert_allclose(states[other][key], value, rtol=2e-5, atol=1e-6)


def counter_read_by_the_update(keep_reading: bool) -> onnx.ModelProto:
    """w.next = w - 0.1 * mean(x) (SGD: the counter unread), or, with ``keep_reading``,
    minus t too, broadcast by an Expand (which stays in the step, and the counter with
    it)."""
    nodes = [
        helper.make_node("Add", ["t", "one"], ["t.next"]),
        helper.make_node("ReduceMean", ["x", "rows"], ["g"], keepdims=0),
        helper.make_node("Mul", ["g", "rate"], ["delta"]),
        helper.make_node("Sub", ["w", "delta"], ["w0"]),
    ]
    if keep_reading:
        nodes += [
            helper.make_node("Expand", ["t", "three"], ["ts"]),
            helper.make_node("Cast", ["ts"], ["tf"], to=TensorProto.FLOAT),
            helper.make_node("Sub", ["w0", "tf"], ["w.next"]),
        ]
    else:
        nodes.append(helper.make_node("Identity", ["w0"], ["w.next"]))
    nodes.append(helper.make_node("ReduceSum", ["w.next"], ["loss"], keepdims=0))
    graph = helper.make_graph(
        nodes,
        "step",
        [
            helper.make_tensor_value_info("w", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("t", TensorProto.INT64, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
        ],
        [
            helper.make_tensor_value_info("w.next", TensorProto.FLOAT, [3]),
            helper.make_tensor_value_info("t.next", TensorProto.INT64, []),
            helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
        ],
        [
            numpy_helper.from_array(np.array(1, np.int64), "one"),
            numpy_helper.from_array(np.array([0], np.int64), "rows"),
            numpy_helper.from_array(np.array(0.1, np.float32), "rate"),
            numpy_helper.from_array(np.array([3], np.int64), "three"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


@pytest.mark.parametrize("keep_reading", [False, True])
def test_a_counter_nothing_else_reads_is_counted_after_the_scan(keep_reading):
    """SGD at a fixed rate reads no counter: the Scan neither carries nor increments it,
    the epoch adds the batches after it. A counter a kept node reads stays carried. The
    counter and the weights as the step run batch by batch computes them, to the bit,
    on onnxruntime and onnx.reference."""
    step = counter_read_by_the_update(keep_reading)
    epoch = scan_over_batches(step, ["x"], ["w", "t"], "loss", 4)
    onnx.checker.check_model(epoch, full_check=True)
    scan = next(n for n in epoch.graph.node if n.op_type == "Scan")
    assert ("t" in scan.input) == keep_reading
    assert ("Add" in {n.op_type for n in body_of(epoch).node}) == keep_reading
    rng = np.random.default_rng(2)
    x = rng.normal(size=(9, 4, 3)).astype(np.float32)
    w, t = rng.normal(size=3).astype(np.float32), np.array(7, np.int64)
    session, w_step, t_step = inference_session(step), w, t
    for batch in x:
        w_step, t_step = session.run(["w.next", "t.next"], {"x": batch, "w": w_step, "t": t_step})
    assert int(t_step) == 16
    for new_w, new_t in on_both_runtimes(epoch, {"x": x, "w": w, "t": t}):
        np.testing.assert_array_equal(new_w, w_step)
        assert int(new_t) == 16 and new_t.dtype == np.int64
