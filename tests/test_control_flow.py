"""Control flow (If, Loop, Scan) in a model to train.

onnxruntime-training's gradient builders have no gradient for control flow and, when an
``If`` lies between the weights and the loss, abort the process (SIGABRT) instead of
raising: on the ort_training backend graphkit refuses such graphs before calling them,
naming the node. The native backend differentiates If, Loop and Scan: the same graphs
train. On every backend, control flow off that path trains, and weights read inside a
subgraph are parameters like any other.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit_train import ForwardBackwardTrainer, Trainer

V = helper.make_tensor_value_info


def _model(nodes, initializers) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "control_flow",
        [V("X", TensorProto.FLOAT, ["N", 3])],
        [V("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(np.full((3, 1), 0.5, np.float32), "W"), *initializers],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _branch(then_nodes, then_out, else_nodes, else_out, cond="cond", output="Y"):
    """``If(ReduceSum(X) > 0)`` choosing between two branches."""
    then_g = helper.make_graph(then_nodes, "then", [], [V(then_out, TensorProto.FLOAT, None)])
    else_g = helper.make_graph(else_nodes, "else", [], [V(else_out, TensorProto.FLOAT, None)])
    return [
        helper.make_node("ReduceSum", ["X"], ["s"], keepdims=0),
        helper.make_node("Greater", ["s", "zero"], [cond]),
        helper.make_node(
            "If", [cond], [output], then_branch=then_g, else_branch=else_g, name="branch"
        ),
    ]


ZERO = numpy_helper.from_array(np.array(0, np.float32), "zero")


def if_after_the_weights() -> onnx.ModelProto:
    """Y = If(sum(X) > 0, Z, Z + Z) with Z = X W: the branches read Z from outside."""
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Z"])]
    nodes += _branch(
        [helper.make_node("Identity", ["Z"], ["t"])], "t",
        [helper.make_node("Add", ["Z", "Z"], ["e"])], "e",
    )  # fmt: skip
    return _model(nodes, [ZERO])


def weights_inside_a_branch() -> onnx.ModelProto:
    """Y = If(sum(X) > 0, X W, X W + X W): W is read only inside the branches."""
    nodes = _branch(
        [helper.make_node("MatMul", ["X", "W"], ["t"])], "t",
        [helper.make_node("MatMul", ["X", "W"], ["m"]), helper.make_node("Add", ["m", "m"], ["e"])],
        "e",
    )  # fmt: skip
    return _model(nodes, [ZERO])


def scan_over_rows() -> onnx.ModelProto:
    """Y = Scan over the rows of X of x_i W (W read from inside the body)."""
    body = helper.make_graph(
        [
            helper.make_node("Unsqueeze", ["x_i", "axis"], ["row"]),
            helper.make_node("MatMul", ["row", "W"], ["product"]),
            helper.make_node("Squeeze", ["product", "axis"], ["y_i"]),
            helper.make_node("Identity", ["carry"], ["carry_out"]),
        ],
        "body",
        [V("carry", TensorProto.FLOAT, [1]), V("x_i", TensorProto.FLOAT, [3])],
        [V("carry_out", TensorProto.FLOAT, [1]), V("y_i", TensorProto.FLOAT, [1])],
    )
    nodes = [
        helper.make_node(
            "Scan", ["carry0", "X"], ["carryN", "Y"], body=body, num_scan_inputs=1, name="rows"
        )
    ]
    return _model(
        nodes,
        [
            numpy_helper.from_array(np.zeros(1, np.float32), "carry0"),
            numpy_helper.from_array(np.array([0], np.int64), "axis"),
        ],
    )


def if_beside_the_weights() -> onnx.ModelProto:
    """Y = X W + If(sum(X) > 0, sum(X), max(X)): the branch does not read the weights."""
    nodes = [helper.make_node("MatMul", ["X", "W"], ["Z"])]
    nodes += _branch(
        [helper.make_node("ReduceSum", ["X"], ["t"], keepdims=1)], "t",
        [helper.make_node("ReduceMax", ["X"], ["e"], keepdims=1)], "e",
        output="A",
    )  # fmt: skip
    nodes.append(helper.make_node("Add", ["Z", "A"], ["Y"]))
    return _model(nodes, [ZERO])


ON_THE_PATH = {
    "if_after_the_weights": ("If", "branch"),
    "weights_inside_a_branch": ("If", "branch"),
    "scan_over_rows": ("Scan", "rows"),
}


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_control_flow_on_the_path_is_refused_or_trains_and_never_ends_the_process(
    backend, tmp_path
):
    """ort_training refuses each case, naming the node; native trains it. Every case runs
    in a child process: a regression there aborts the child, not the suite, and the test
    names the case that did."""
    for name in ON_THE_PATH:
        onnx.save(globals()[name](), tmp_path / f"{name}.onnx")
    script = textwrap.dedent(
        """
        import json, sys
        import numpy as np, onnx, graphkit as gk
        from graphkit_train import ForwardBackwardTrainer, Trainer
        X = np.random.default_rng(0).normal(size=(12, 3)).astype(np.float32)
        y = X.sum(axis=1).astype(np.float32)
        folder, backend, names = sys.argv[1], sys.argv[2], sys.argv[3:]
        entries = {
            "gradient_model": lambda m: gk.gradient_model(
                gk.add_loss_output(m), "loss", ["W"], backend=backend),
            "Trainer": lambda m: Trainer(
                m, ["W"], loss="mse", max_iter=1, backend=backend).fit(X, y),
            "ForwardBackwardTrainer": lambda m: ForwardBackwardTrainer(
                m, ["W"], max_iter=1, backend=backend).fit(X, y),
        }
        for name in names:
            model = onnx.load(f"{folder}/{name}.onnx")
            for entry, run in entries.items():
                print(json.dumps([name, entry]), flush=True)  # the last line if it dies
                try:
                    run(model)
                    outcome = "trained"
                except gk.MissingGradientError as exc:
                    outcome = str(exc)
                print(json.dumps([name, entry, outcome]), flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), backend, *ON_THE_PATH],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert done.returncode == 0, f"the process ended on {lines[-1]}: {done.stderr[-2000:]}"
    outcomes = [line for line in lines if len(line) == 3]
    assert len(outcomes) == 3 * len(ON_THE_PATH)
    for name, entry, message in outcomes:
        op_type, node = ON_THE_PATH[name]
        if backend == "ort_training":
            expected = f"no gradient for control flow: {op_type} node '{node}'"
            assert expected in message, (name, entry, message)
        else:
            assert message == "trained", (name, entry, message)


def test_weights_read_inside_a_subgraph_are_parameters():
    roles = gk.parameters.explain(weights_inside_a_branch())
    assert roles["W"] == "parameter (read by MatMul input 1)"
    assert list(gk.get_train_initializer(scan_over_rows())) == ["W"]


def _numpy_sgd(X, y, epochs, batch_size, lr):
    """SGD on mean((X W + A(X) - y)^2), A = sum(X_batch) if positive else max(X_batch)."""
    W = np.full((3, 1), 0.5)
    for _ in range(epochs):
        for start in range(0, len(X), batch_size):
            xb = X[start : start + batch_size].astype(np.float64)
            yb = y[start : start + batch_size, None].astype(np.float64)
            a = xb.sum() if xb.sum() > 0 else xb.max()
            residual = xb @ W + a - yb
            W -= lr * 2 * xb.T @ residual / len(xb)
    return W


@pytest.mark.parametrize("trainer", ["full", "forward/backward"])
def test_control_flow_beside_the_weights_trains_like_numpy(trainer):
    rng = np.random.default_rng(1)
    X = rng.normal(size=(30, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -1.0, 2.0]) + 0.5).astype(np.float32)
    settings = dict(max_iter=3, batch_size=6, shuffle=False, optimizer="sgd")
    if trainer == "full":
        model = Trainer(if_beside_the_weights(), ["W"], loss="mse", **settings)
    else:
        model = ForwardBackwardTrainer(if_beside_the_weights(), ["W"], **settings)
    state = model.fit(X, y).get_state()
    np.testing.assert_allclose(state["W"], _numpy_sgd(X, y, 3, 6, 0.01), rtol=1e-4, atol=1e-5)
