"""graphkit/constant_branches.py: an If on a constant becomes the branch it takes; the
rewritten graph computes what onnx.reference computes on the original. An If on data,
or on a float initializer (a weight training may change), stays."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from graphkit._graph import all_graphs
from graphkit.constant_branches import constant_branches_taken

F32 = TensorProto.FLOAT


def _branch(name: str, op: str, source: str) -> onnx.GraphProto:
    """A branch computing ``op(source)`` (an outer tensor) into its one output."""
    return helper.make_graph(
        [helper.make_node(op, [source], [f"{name}_out"])],
        name,
        [],
        [helper.make_tensor_value_info(f"{name}_out", F32, None)],
    )


def _if(cond: str, output: str, source: str = "X") -> onnx.NodeProto:
    return helper.make_node(
        "If",
        [cond],
        [output],
        then_branch=_branch(f"then_{output}", "Relu", source),
        else_branch=_branch(f"else_{output}", "Neg", source),
    )


def _model(nodes, inits=(), shape=(3, 4)) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("X", F32, [3, 4])],
        [helper.make_tensor_value_info("Y", F32, list(shape))],
        list(inits),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _ifs(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "If" for g in all_graphs(model.graph) for n in g.node)


def _same_values(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    onnx.checker.check_model(after, full_check=True)
    x = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    expected = ReferenceEvaluator(before).run(None, {"X": x})
    got = ReferenceEvaluator(after).run(None, {"X": x})
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("flag", [True, False])
def test_an_if_on_a_computed_constant_becomes_the_branch_it_takes(flag):
    """The condition computed from Constant nodes (dynamo's ``mode == 1``)."""
    nodes = [
        helper.make_node("Constant", [], ["mode"], value_int=1),
        helper.make_node("Constant", [], ["wanted"], value_int=1 if flag else 0),
        helper.make_node("Equal", ["mode", "wanted"], ["cond"]),
        _if("cond", "Y"),
    ]
    model = _model(nodes)
    out = constant_branches_taken(model)
    assert _ifs(out) == 0
    assert ("Relu" if flag else "Neg") in {n.op_type for n in out.graph.node}
    _same_values(model, out)


def test_an_if_on_a_constant_inside_a_loop_body_is_inlined_there():
    """Three scopes deep, as in dynamo's EmbeddingBag: Loop body -> If on a constant ->
    If on a constant, the outer Constant read from inside."""
    inner = helper.make_node(
        "If",
        ["also"],
        ["picked"],
        then_branch=_branch("deep_then", "Abs", "X"),
        else_branch=_branch("deep_else", "Neg", "X"),
    )
    outer_branch = helper.make_graph(
        [helper.make_node("Not", ["no"], ["also"]), inner],
        "outer_then",
        [],
        [helper.make_tensor_value_info("picked", F32, None)],
    )
    body = helper.make_graph(
        [
            helper.make_node(
                "If",
                ["yes"],
                ["row"],
                then_branch=outer_branch,
                else_branch=_branch("outer_else", "Neg", "X"),
            )
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("row", F32, None),
        ],
    )
    nodes = [
        helper.make_node("Constant", [], ["yes"], value=numpy_helper.from_array(np.array(True))),
        helper.make_node("Not", ["yes"], ["no"]),
        helper.make_node("Loop", ["trips", "yes"], ["Y"], body=body),
    ]
    model = _model(nodes, [numpy_helper.from_array(np.array(2, np.int64), "trips")], (2, 3, 4))
    out = constant_branches_taken(model)
    assert _ifs(out) == 0
    _same_values(model, out)


def test_an_if_on_data_or_on_a_float_initializer_stays():
    """A float initializer may be a weight: a condition read from one is not a constant."""
    nodes = [
        helper.make_node("ReduceSum", ["X"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["on_data"]),
        helper.make_node("Greater", ["W", "zero"], ["on_weight"]),
        _if("on_data", "A"),
        _if("on_weight", "B", source="A"),
        helper.make_node("Identity", ["B"], ["Y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(1.0, np.float32), "W"),
    ]
    model = _model(nodes, inits)
    assert constant_branches_taken(model) is model


def test_an_if_on_a_random_draw_stays():
    """A condition drawn anew at each run is no constant, though its inputs are."""
    nodes = [
        helper.make_node("RandomUniform", [], ["u"], shape=[1]),
        helper.make_node("Constant", [], ["half"], value_float=0.5),
        helper.make_node("Less", ["u", "half"], ["heads"]),
        helper.make_node("Squeeze", ["heads"], ["cond"]),
        _if("cond", "Y"),
    ]
    model = _model(nodes)
    assert constant_branches_taken(model) is model
