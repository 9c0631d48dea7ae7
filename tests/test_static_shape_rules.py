"""Each rule of graphkit.static_shapes on a small graph of its own: the same values
before and after it (onnxruntime, its optimizations off, on random inputs), the
structure it writes (operator counts), and a graph it must leave as it is.

The rules run through the functions :func:`graphkit.static_shapes.specialize` calls
(``simplify_reductions``, ``fewer_kernels``, ``fuse_gemms``...), each graph built so that
only the rule under test applies; the end-to-end checks (training steps, torch
parity) are tests/test_fused.py, test_native.py and test_kernel_counts.py."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphkit._graph import copy_model
from graphkit.static_shapes import (
    GEMV_FUSED_UP_TO,
    RESHAPE_SCALARS_FROM,
    SIGN_MASK_UP_TO,
    fewer_kernels,
    fix_batch,
    fold,
    fuse_gemms,
    integer_arithmetic_as_constants,
    known_parts_as_constants,
    matmul_transposes,
    shapes_as_constants,
    simplify_reductions,
    specialize,
    specialize_scan_bodies,
    static_shapes,
)

ELEM = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.int64): TensorProto.INT64,
}

Shape = Sequence[int | str]


def build(
    nodes: list[onnx.NodeProto],
    inputs: Mapping[str, Shape | tuple[Shape, type]],
    outputs: Mapping[str, type] | Sequence[str],
    initializers: Mapping[str, np.ndarray] | None = None,
    opset: int = 18,
) -> onnx.ModelProto:
    """A model of ``nodes``; an input is ``shape`` (float32) or ``(shape, dtype)``, an
    output ``name`` (float32) or ``{name: dtype}``, its shape left to inference."""
    values = []
    for name, spec in inputs.items():
        shape, dtype = spec if isinstance(spec, tuple) else (spec, np.float32)
        values.append(helper.make_tensor_value_info(name, ELEM[np.dtype(dtype)], list(shape)))
    if not isinstance(outputs, Mapping):
        outputs = dict.fromkeys(outputs, np.float32)
    results = [
        helper.make_tensor_value_info(name, ELEM[np.dtype(dtype)], None)
        for name, dtype in outputs.items()
    ]
    inits = [numpy_helper.from_array(v, n) for n, v in (initializers or {}).items()]
    graph = helper.make_graph(nodes, "rule", values, results, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def run(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    return session.run(None, dict(feeds))


def feeds_for(model: onnx.ModelProto, seed: int = 0, **sizes: int) -> dict[str, np.ndarray]:
    """Random inputs of ``model``'s shapes (a symbolic dimension: ``sizes[name]``)."""
    rng = np.random.default_rng(seed)
    kinds = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}
    feeds = {}
    for value in model.graph.input:
        tensor = value.type.tensor_type
        shape = [d.dim_value or sizes[d.dim_param] for d in tensor.shape.dim]
        feeds[value.name] = rng.normal(size=shape).astype(kinds[tensor.elem_type])
    return feeds


def ops(model_or_graph: onnx.ModelProto | onnx.GraphProto) -> collections.Counter[str]:
    graph = getattr(model_or_graph, "graph", model_or_graph)
    return collections.Counter(n.op_type for n in graph.node)


def same_values(
    before: onnx.ModelProto,
    after: onnx.ModelProto,
    feeds: Mapping[str, np.ndarray] | None = None,
    rtol: float = 1e-6,
) -> None:
    feeds = feeds_for(before) if feeds is None else feeds
    for x, z in zip(run(before, feeds), run(after, feeds), strict=True):
        assert x.shape == z.shape and x.dtype == z.dtype
        np.testing.assert_allclose(z, x, rtol=rtol, atol=rtol)


def in_place(rule: Callable[[onnx.ModelProto, dict], None]) -> Callable:
    """A rule that rewrites a model in place given its static shapes, as a function
    from a model to a rewritten copy."""

    def apply(model: onnx.ModelProto) -> onnx.ModelProto:
        out = copy_model(model)
        rule(out, static_shapes(out))
        return out

    return apply


kernels = in_place(fewer_kernels)


def reductions(model: onnx.ModelProto) -> onnx.ModelProto:
    """:func:`simplify_reductions` on ``model`` typed as folding leaves it (its
    value_info holds every tensor's element type)."""
    return simplify_reductions(onnx.shape_inference.infer_shapes(model))


gemm_rules = in_place(fuse_gemms)
f32 = np.float32


# -- folding -------------------------------------------------------------------------------


def test_shape_becomes_a_constant_where_inference_knows_it():
    nodes = [
        helper.make_node("Shape", ["X"], ["s"], start=-1),
        helper.make_node(
            "ConstantOfShape", ["s"], ["z"], value=numpy_helper.from_array(np.array([0.5], f32))
        ),
        helper.make_node("Add", ["X", "z"], ["Y"]),
    ]
    model = build(nodes, {"X": [3, 4]}, ["Y"])
    out = copy_model(model)
    assert shapes_as_constants(out)
    assert ops(out) == {"ConstantOfShape": 1, "Add": 1}
    (s,) = [numpy_helper.to_array(t) for t in out.graph.initializer if t.name == "s"]
    assert s.tolist() == [4]
    same_values(model, out)


def test_shape_of_an_unknown_shape_or_a_graph_output_stays():
    nodes = [
        helper.make_node("Shape", ["X"], ["s"]),
        helper.make_node("Shape", ["W"], ["t"]),
    ]
    model = build(nodes, {"X": ["N", 4], "W": [2, 2]}, {"s": np.int64, "t": np.int64})
    out = copy_model(model)
    assert not shapes_as_constants(out)
    assert out == model


def test_a_static_part_of_a_symbolic_batch_shape_and_its_arithmetic_become_constants():
    """dynamo's gate slice of an LSTM weight: ``W[k H : (k + 1) H]`` with ``H`` read off
    the last axis of a symbolic-batch state: the bounds constants, the slice static."""
    nodes = [
        helper.make_node("Shape", ["h"], ["hidden"], start=1),  # [N, 2] -> [2]
        helper.make_node("Mul", ["hidden", "two"], ["end"]),
        helper.make_node("Slice", ["W", "hidden", "end", "axis"], ["part"]),
        helper.make_node("MatMul", ["h", "part"], ["Y"]),
    ]
    inits = {
        "W": np.arange(12, dtype=f32).reshape(6, 2),
        "two": np.array([2]),
        "axis": np.array([0]),
    }
    model = build(nodes, {"h": ["N", 2]}, ["Y"], inits)
    out = copy_model(model)
    assert known_parts_as_constants(out)
    assert integer_arithmetic_as_constants(out)
    assert ops(out) == {"Slice": 1, "MatMul": 1}
    values = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    assert values["hidden"].tolist() == [2] and values["end"].tolist() == [4]
    assert static_shapes(fix_batch(out, {"h": 3}))["part"] == (2, 2)
    same_values(model, out, feeds_for(model, N=3))


def test_a_symbolic_part_a_float_computation_or_an_output_stays():
    nodes = [
        helper.make_node("Shape", ["h"], ["batch"], end=1),  # N: symbolic
        helper.make_node("Mul", ["W", "W"], ["W2"]),  # floats: data, never folded
        helper.make_node("Add", ["one", "one"], ["two"]),  # an output
        helper.make_node("Identity", ["W2"], ["Y"]),
    ]
    inits = {"W": np.ones((2, 2), f32), "one": np.array([1])}
    model = build(nodes, {"h": ["N", 2]}, {"Y": f32, "two": np.int64, "batch": np.int64}, inits)
    out = copy_model(model)
    assert not known_parts_as_constants(out)
    assert not integer_arithmetic_as_constants(out)
    assert out == model


def test_folding_evaluates_what_is_constant_and_keeps_tiny_constants():
    nodes = [
        helper.make_node("Add", ["a", "b"], ["c"]),  # constant: folded
        helper.make_node("Mul", ["X", "c"], ["Xc"]),
        helper.make_node("Add", ["Xc", "eps"], ["Y"]),  # 1e-8 is not zero
    ]
    inits = {"a": np.full(4, 2, f32), "b": np.full(4, 3, f32), "eps": np.array(1e-8, f32)}
    model = build(nodes, {"X": [3, 4]}, ["Y"], inits)
    out = fold(model)
    assert ops(out) == {"Mul": 1, "Add": 1}
    np.testing.assert_array_equal(run(out, {"X": np.zeros((3, 4), f32)})[0], f32(1e-8))
    same_values(model, out)


def test_folding_leaves_computations_on_large_constants():
    big = np.ones(8193, f32)  # above the folding's size limit: a weight-sized tensor
    nodes = [helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("Mul", ["X", "c"], ["Y"])]
    model = build(nodes, {"X": [8193]}, ["Y"], {"a": big, "b": big})
    out = fold(model)
    assert ops(out) == {"Add": 1, "Mul": 1}
    same_values(model, out)


def test_the_batch_size_is_fixed_wherever_its_symbol_appears():
    nodes = [helper.make_node("Add", ["X", "Z"], ["Y"])]
    model = build(nodes, {"X": ["N", 2], "Z": ["N", 2]}, ["Y"])
    fixed = fix_batch(model, {"X": 5})
    dims = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in fixed.graph.input]
    assert dims == [[5, 2], [5, 2]]
    unfixed = fix_batch(model, {})
    assert unfixed.graph.input[1].type.tensor_type.shape.dim[0].dim_param == "N"


# -- simplify_reductions: one pass of node rules --------------------------------------------


def test_multiplying_by_ones_goes():
    nodes = [helper.make_node("Mul", ["X", "ones"], ["P"]), helper.make_node("Relu", ["P"], ["Y"])]
    model = build(nodes, {"X": [3, 4]}, ["Y"], {"ones": np.ones(4, f32)})
    out = reductions(model)
    assert ops(out) == {"Relu": 1}
    assert not out.graph.initializer  # the ones, unread
    same_values(model, out)


def test_a_product_by_ones_read_inside_nested_subgraphs_is_renamed_there_too():
    """dynamo's EmbeddingBag multiplies the table's rows by ones and slices them in an
    If inside a Loop's body: the read three scopes down follows the rename."""
    inner = helper.make_graph(
        [helper.make_node("Relu", ["P"], ["r"])],
        "inner",
        [],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["P"], ["n"])],
        "other",
        [],
        [helper.make_tensor_value_info("n", TensorProto.FLOAT, None)],
    )
    body = helper.make_graph(
        [helper.make_node("If", ["c"], ["branch"], then_branch=inner, else_branch=other)],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("branch", TensorProto.FLOAT, None),
        ],
    )
    nodes = [
        helper.make_node("Mul", ["X", "ones"], ["P"]),
        helper.make_node("Loop", ["trips", "yes"], ["Y"], body=body),
    ]
    inits = {"ones": np.ones(4, f32), "trips": np.array(2, np.int64), "yes": np.array(True)}
    model = build(nodes, {"X": [3, 4]}, ["Y"], inits)
    out = reductions(model)
    assert "Mul" not in ops(out)
    onnx.checker.check_model(out, full_check=True)
    feeds = feeds_for(model)
    np.testing.assert_array_equal(run(out, feeds)[0], np.stack([np.maximum(feeds["X"], 0)] * 2))


def test_ones_that_broadcast_or_a_product_that_is_an_output_stay():
    nodes = [
        helper.make_node("Mul", ["X", "ones"], ["P"]),  # [3, 1] * [1, 4]: broadcasts
        helper.make_node("Mul", ["P", "one"], ["Y"]),  # an output
    ]
    inits = {"ones": np.ones((1, 4), f32), "one": np.ones(1, f32)}
    model = build(nodes, {"X": [3, 1]}, ["Y"], inits)
    out = reductions(model)
    assert ops(out) == {"Mul": 2}
    same_values(model, out)


def test_a_reshape_to_the_shape_a_tensor_has_goes():
    nodes = [
        helper.make_node("Reshape", ["X", "same"], ["R"]),
        helper.make_node("Reshape", ["R", "other"], ["Q"]),  # [3, 4] -> [4, 3]: stays
        helper.make_node("Relu", ["Q"], ["Y"]),
    ]
    inits = {"same": np.array([3, 4]), "other": np.array([4, 3])}
    model = build(nodes, {"X": [3, 4]}, ["Y"], inits)
    out = reductions(model)
    assert ops(out) == {"Reshape": 1, "Relu": 1}
    assert out.graph.node[0].input[0] == "X"
    same_values(model, out)


def test_a_one_element_operand_takes_the_other_operands_rank():
    rows = RESHAPE_SCALARS_FROM
    nodes = [
        helper.make_node("Mul", ["X", "c"], ["P"]),  # a constant: reshaped once
        helper.make_node("ReduceMax", ["V"], ["s"], keepdims=0),
        helper.make_node("Add", ["P", "s"], ["Y"]),  # computed: a Reshape before
    ]
    model = build(nodes, {"X": [rows, 1], "V": [3]}, ["Y"], {"c": np.array(0.5, f32)})
    out = reductions(model)
    assert ops(out) == {"Mul": 1, "ReduceMax": 1, "Reshape": 1, "Add": 1}
    shapes = static_shapes(out)
    for node in out.graph.node:
        if node.op_type in ("Mul", "Add"):
            assert [len(shapes[i]) for i in node.input] == [2, 2]
    same_values(model, out)


def test_a_computed_scalar_of_a_small_operation_or_a_same_rank_operand_stays():
    nodes = [
        helper.make_node("ReduceMax", ["V"], ["s"], keepdims=0),
        helper.make_node("Add", ["X", "s"], ["P"]),  # fewer than RESHAPE_SCALARS_FROM
        helper.make_node("Mul", ["P", "c"], ["Y"]),  # already of rank 2
    ]
    inits = {"c": np.full((1, 1), 0.5, f32)}
    model = build(nodes, {"X": [RESHAPE_SCALARS_FROM - 1, 1], "V": [3]}, ["Y"], inits)
    out = reductions(model)
    assert out.graph.node == model.graph.node
    same_values(model, out)


def test_a_transpose_only_matmuls_read_is_left_to_onnxruntime():
    """A vector's transpose ([3, 1] -> [1, 3]) would become a Reshape (it only moves an
    axis of size 1) but for a MatMul reading it: onnxruntime fuses it there."""
    nodes = [
        helper.make_node("Transpose", ["A"], ["T"], perm=[1, 0]),
        helper.make_node("MatMul", ["T", "B"], ["Y"]),
    ]
    model = build(nodes, {"A": [3, 1], "B": [3, 5]}, ["Y"])
    assert matmul_transposes(model.graph, static_shapes(model)) == {"T"}
    out = reductions(model)
    assert ops(out) == {"Transpose": 1, "MatMul": 1}
    same_values(model, out)


def test_a_transpose_something_else_reads_is_not_left():
    nodes = [
        helper.make_node("Transpose", ["A"], ["T"], perm=[1, 0]),
        helper.make_node("MatMul", ["T", "B"], ["M"]),
        helper.make_node("Add", ["M", "T"], ["Y"]),
    ]
    model = build(nodes, {"A": [3, 1], "B": [3, 3]}, ["Y"])
    assert matmul_transposes(model.graph, static_shapes(model)) == set()
    out = reductions(model)
    assert ops(out) == {"Reshape": 1, "MatMul": 1, "Add": 1}  # only a unit axis moved
    same_values(model, out)


@pytest.mark.parametrize(
    "node, shape, kernel_rank, opset",
    [
        (helper.make_node("Transpose", ["X"], ["Y"], perm=[3, 1, 2, 0]), [2, 3, 1, 4], 3, 18),
        (helper.make_node("ReduceMean", ["X"], ["Y"], axes=[1], keepdims=1), [2, 3, 1], 2, 17),
        (helper.make_node("ReduceMax", ["X", "axes"], ["Y"], keepdims=0), [2, 3, 1], 2, 18),
    ],
    ids=["Transpose", "ReduceMean", "ReduceMax"],
)
def test_a_transpose_or_a_reduction_runs_without_the_axes_of_size_1(
    node, shape, kernel_rank, opset
):
    inits = {"axes": np.array([1])} if len(node.input) > 1 else {}
    model = build([node], {"X": shape}, ["Y"], inits, opset=opset)
    out = reductions(model)
    assert ops(out) == {node.op_type: 1, "Reshape": 2}
    shapes = static_shapes(out)
    (kernel,) = [n for n in out.graph.node if n.op_type == node.op_type]
    assert len(shapes[kernel.input[0]]) == kernel_rank
    same_values(model, out)


def test_a_transpose_or_a_reduction_without_axes_of_size_1_stays():
    nodes = [
        helper.make_node("Transpose", ["X"], ["T"], perm=[1, 0, 2]),
        helper.make_node("ReduceMean", ["T"], ["Y"], axes=[2], keepdims=1),
    ]
    model = build(nodes, {"X": [2, 3, 4]}, ["Y"], opset=17)
    out = reductions(model)
    assert out.graph.node == model.graph.node
    same_values(model, out)


@pytest.mark.parametrize(
    "shape, axes, keepdims, written",
    [
        ([4, 1, 3], [1], 0, {"Reshape": 1}),  # nothing to add up
        ([1, 5, 1], [1], 1, {"ReduceSum": 1, "Reshape": 1}),  # a full reduction
        ([6, 4], [0], 0, {"MatMul": 1}),  # a bias gradient: ones @ X
        ([2, 3, 4], [0, 1], 1, {"Reshape": 2, "MatMul": 1}),  # a leading block
        ([4, 2, 3], [1, 2], 0, {"Reshape": 2, "MatMul": 1}),  # a trailing block: X @ ones
    ],
)
def test_a_reduce_sum_of_known_shape_becomes_what_runs_fastest(shape, axes, keepdims, written):
    node = helper.make_node("ReduceSum", ["X", "axes"], ["Y"], keepdims=keepdims)
    model = build([node], {"X": shape}, ["Y"], {"axes": np.array(axes)})
    out = reductions(model)
    assert ops(out) == written
    for kernel in out.graph.node:
        if kernel.op_type == "ReduceSum":
            assert len(kernel.input) == 1  # every axis
        if kernel.op_type == "MatMul":  # the ones a vector, or a column on the right
            ones = {t.name: t for t in out.graph.initializer}
            assert kernel.input[0] in ones or list(ones[kernel.input[1]].dims)[1:] == [1]
    same_values(model, out, rtol=1e-5)


@pytest.mark.parametrize(
    "shape, axes, dtype",
    [([2, 3, 4], [1], np.float32), ([6, 4], [0], np.int64)],
    ids=["middle axis", "integers"],
)
def test_a_reduce_sum_of_a_middle_axis_or_of_integers_stays(shape, axes, dtype):
    node = helper.make_node("ReduceSum", ["X", "axes"], ["Y"], keepdims=0)
    model = build([node], {"X": (shape, dtype)}, {"Y": dtype}, {"axes": np.array(axes)})
    out = reductions(model)
    assert out.graph.node == model.graph.node
    feeds = {"X": np.arange(np.prod(shape)).reshape(shape).astype(dtype)}
    same_values(model, out, feeds)


def _batched_gradient(read_elsewhere: bool) -> onnx.ModelProto:
    """``sum_b x_b^T dy_b``, a weight's gradient from a [B, S, in] input; the batched
    products read by a Relu too with ``read_elsewhere``."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["xt", "dy"], ["P"]),
        helper.make_node("ReduceSum", ["P", "axes"], ["G"], keepdims=0),
    ]
    outputs = ["G"]
    if read_elsewhere:
        nodes.append(helper.make_node("Relu", ["P"], ["Q"]))
        outputs.append("Q")
    return build(nodes, {"x": [4, 5, 3], "dy": [4, 5, 2]}, outputs, {"axes": np.array([0])})


def test_a_batched_product_summed_over_the_batch_is_one_product():
    model = _batched_gradient(read_elsewhere=False)
    out = reductions(model)
    assert ops(out) == {"Reshape": 2, "Transpose": 1, "MatMul": 1}
    shapes = static_shapes(out)
    (product,) = [n for n in out.graph.node if n.op_type == "MatMul"]
    assert [shapes[i] for i in product.input] == [(3, 20), (20, 2)]
    same_values(model, out, rtol=1e-5)


def test_a_batched_product_read_elsewhere_is_summed_by_ones():
    """The batched products are computed anyway: summed as ones @ P (P as [4, 6])."""
    model = _batched_gradient(read_elsewhere=True)
    out = reductions(model)
    assert ops(out) == {"Transpose": 1, "MatMul": 2, "Reshape": 2, "Relu": 1}
    same_values(model, out, rtol=1e-5)


# -- fewer_kernels ---------------------------------------------------------------------------


def test_a_full_sum_of_squares_is_one_kernel():
    nodes = [
        helper.make_node("Mul", ["d", "d"], ["sq"]),
        helper.make_node("Reshape", ["sq", "flat"], ["v"]),
        helper.make_node("ReduceSum", ["v"], ["L"], keepdims=0),
    ]
    model = build(nodes, {"d": [6, 2]}, ["L"], {"flat": np.array([-1])})
    out = kernels(model)
    assert ops(out) == {"ReduceSumSquare": 1}
    same_values(model, out, rtol=1e-5)


def test_a_sum_of_squares_kept_or_of_another_product_stays():
    nodes = [
        helper.make_node("Mul", ["d", "d"], ["sq"]),
        helper.make_node("ReduceSum", ["sq"], ["L"], keepdims=1),  # keeps its dims
        helper.make_node("Mul", ["d", "e"], ["de"]),
        helper.make_node("ReduceSum", ["de"], ["M"], keepdims=0),  # not a square
    ]
    model = build(nodes, {"d": [6, 2], "e": [6, 2]}, ["L", "M"])
    out = kernels(model)
    assert out.graph.node == model.graph.node


def _sum_of_sums(columns: int) -> onnx.ModelProto:
    rows = 6
    nodes = [
        helper.make_node("MatMul", ["m", "ones"], ["P"]),
        helper.make_node("Reshape", ["P", "flat"], ["R"]),
        helper.make_node("Neg", ["R"], ["N"]),
        helper.make_node("ReduceSum", ["N"], ["L"], keepdims=0),
    ]
    inits = {"ones": np.ones((3, columns), f32), "flat": np.array([rows * columns])}
    return build(nodes, {"m": [rows, 3]}, ["L"], inits)


def test_a_full_sum_of_per_sample_sums_is_one_sum():
    model = _sum_of_sums(columns=1)
    out = kernels(model)
    assert ops(out) == {"ReduceSum": 1, "Neg": 1}
    assert out.graph.node[0].input[0] == "m"
    same_values(model, out, rtol=1e-5)


def test_a_full_sum_of_a_product_by_a_matrix_of_ones_stays():
    model = _sum_of_sums(columns=2)
    out = kernels(model)
    assert out.graph.node == model.graph.node


def _relu_mask(size: int) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Relu", ["x"], ["y"]),
        helper.make_node("Greater", ["y", "zero"], ["g"]),
        helper.make_node("Cast", ["g"], ["mask"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["mask", "dy"], ["dx"]),
    ]
    return build(nodes, {"x": [size], "dy": [size]}, ["dx"], {"zero": np.array(0, f32)})


def test_a_small_relu_gradient_mask_is_a_sign():
    model = _relu_mask(SIGN_MASK_UP_TO)
    out = kernels(model)
    assert ops(out) == {"Relu": 1, "Sign": 1, "Mul": 1}
    same_values(model, out)


def test_a_large_relu_gradient_mask_stays():
    model = _relu_mask(SIGN_MASK_UP_TO + 1)
    out = kernels(model)
    assert out.graph.node == model.graph.node


def _doubled(shape: list[int], c: np.ndarray) -> onnx.ModelProto:
    nodes = [helper.make_node("Mul", ["a", "c"], ["x"]), helper.make_node("Sum", ["x", "x"], ["s"])]
    return build(nodes, {"a": shape}, ["s"], {"c": c})


def test_a_scaled_tensor_added_to_itself_is_scaled_twice():
    model = _doubled([3, 4], np.full(4, 0.3, f32))
    out = kernels(model)
    assert ops(out) == {"Mul": 1}
    twice = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    np.testing.assert_array_equal(twice[out.graph.node[0].input[1]], np.full(4, 0.6, f32))
    same_values(model, out, rtol=0)  # doubling is exact


def test_a_scale_that_broadcasts_the_tensor_stays():
    model = _doubled([3, 1], np.full((1, 4), 0.3, f32))
    out = kernels(model)
    assert out.graph.node == model.graph.node


# -- gemms ----------------------------------------------------------------------------------


def test_the_transpose_of_a_product_is_the_product_of_the_transposes():
    nodes = [
        helper.make_node("MatMul", ["A", "B"], ["P"]),
        helper.make_node("Transpose", ["P"], ["Y"], perm=[1, 0]),
    ]
    model = build(nodes, {"A": [3, 4], "B": [4, 5]}, ["Y"])
    out = gemm_rules(model)
    assert ops(out) == {"Gemm": 1}
    (gemm,) = out.graph.node
    assert list(gemm.input) == ["B", "A"]
    assert {a.name: a.i for a in gemm.attribute} == {"transA": 1, "transB": 1}
    same_values(model, out, rtol=1e-5)


def test_a_batched_transposed_product_cancels_its_operands_transpose():
    nodes = [
        helper.make_node("Transpose", ["A0"], ["A"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["A", "B"], ["P"]),
        helper.make_node("Transpose", ["P"], ["Y"], perm=[0, 2, 1]),
    ]
    model = build(nodes, {"A0": [2, 4, 3], "B": [2, 4, 5]}, ["Y"])
    out = gemm_rules(model)
    assert ops(out) == {"Transpose": 1, "MatMul": 1}  # B's, for A's that cancelled
    (product,) = [n for n in out.graph.node if n.op_type == "MatMul"]
    assert product.input[1] == "A0"
    same_values(model, out, rtol=1e-5)


def test_a_batched_transposed_product_of_plain_operands_stays():
    """Two Transposes for one: not written."""
    nodes = [
        helper.make_node("MatMul", ["A", "B"], ["P"]),
        helper.make_node("Transpose", ["P"], ["Y"], perm=[0, 2, 1]),
    ]
    model = build(nodes, {"A": [2, 3, 4], "B": [2, 4, 5]}, ["Y"])
    out = gemm_rules(model)
    assert out.graph.node == model.graph.node


def _transposed_matmul(columns: int) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "dy"], ["G"]),
    ]
    return build(nodes, {"x": [6, 3], "dy": [6, columns]}, ["G"])


def test_a_one_column_product_of_a_transpose_is_a_gemm():
    model = _transposed_matmul(columns=1)
    out = gemm_rules(model)
    assert ops(out) == {"Gemm": 1}
    assert {a.name: a.i for a in out.graph.node[0].attribute} == {"transA": 1, "transB": 0}
    same_values(model, out, rtol=1e-5)


def test_a_small_unscaled_product_of_a_transpose_stays_for_fused_matmul():
    model = _transposed_matmul(columns=2)
    out = gemm_rules(model)
    assert out.graph.node == model.graph.node


def _scaled_gemm(rate: np.ndarray, add: bool = False, rows: int = 3, inner: int = 4):
    nodes = [
        helper.make_node("Gemm", ["A", "B"], ["G"]),
        helper.make_node("Mul", ["G", "lr"], ["U"]),
    ]
    dtype = rate.dtype.type
    inputs = {"A": ([rows, inner], dtype), "B": ([inner, 1], dtype)}
    if add:
        nodes.append(helper.make_node("Add", ["W", "U"], ["Y"]))
        inputs["W"] = ([rows, 1], dtype)
    return build(nodes, inputs, {"Y" if add else "U": dtype}, {"lr": rate})


def test_a_scaled_gemm_takes_the_rate_as_alpha():
    model = _scaled_gemm(np.array(0.125, f32))
    out = gemm_rules(model)
    assert ops(out) == {"Gemm": 1}
    assert {a.name: a.f for a in out.graph.node[0].attribute} == {"alpha": 0.125}
    same_values(model, out, rtol=1e-6)


def test_a_rate_float32_cannot_hold_stays_a_mul():
    model = _scaled_gemm(np.array(0.1, np.float64))
    out = gemm_rules(model)
    assert out.graph.node == model.graph.node


def test_an_update_of_a_scaled_gemm_is_its_c():
    model = _scaled_gemm(np.array(0.125, f32), add=True)
    out = gemm_rules(model)
    assert ops(out) == {"Gemm": 1}
    (gemm,) = out.graph.node
    assert list(gemm.input) == ["A", "B", "W"] and list(gemm.output) == ["Y"]
    assert {a.name: a.f for a in gemm.attribute} == {"alpha": 0.125, "beta": 1.0}
    same_values(model, out, rtol=1e-6)


def test_a_one_column_gemm_of_a_large_operand_keeps_its_rate_and_update():
    """onnxruntime's one-column Gemm runs its fast path only with alpha 1 and no C."""
    model = _scaled_gemm(np.array(0.125, f32), add=True, rows=GEMV_FUSED_UP_TO // 4 + 1)
    out = gemm_rules(model)
    assert out.graph.node == model.graph.node


def test_gemms_leave_opsets_below_11():
    nodes = [
        helper.make_node("MatMul", ["A", "B"], ["P"]),
        helper.make_node("Transpose", ["P"], ["Y"], perm=[1, 0]),
    ]
    model = build(nodes, {"A": [3, 4], "B": [4, 5]}, ["Y"], opset=10)
    out = gemm_rules(model)
    assert out.graph.node == model.graph.node


# -- Scan bodies -----------------------------------------------------------------------------


def _scan(rows: int | str) -> onnx.ModelProto:
    """A running sum over rows, its body adding a zero tensor of its input's shape."""
    body = helper.make_graph(
        [
            helper.make_node("Shape", ["x_t"], ["sh"]),
            helper.make_node("ConstantOfShape", ["sh"], ["z"]),
            helper.make_node("Add", ["s", "x_t"], ["s1"]),
            helper.make_node("Add", ["s1", "z"], ["s2"]),
            helper.make_node("Identity", ["s2"], ["y_t"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("s", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("x_t", TensorProto.FLOAT, None),
        ],
        [
            helper.make_tensor_value_info("s2", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("y_t", TensorProto.FLOAT, None),
        ],
    )
    scan = helper.make_node("Scan", ["s0", "X"], ["S", "Ys"], body=body, num_scan_inputs=1)
    return build([scan], {"s0": [4], "X": [rows, 4]}, ["S", "Ys"])


def test_a_scan_body_is_specialized_as_a_graph_of_its_own():
    model = _scan(5)
    out = copy_model(model)
    specialize_scan_bodies(out, (), specialize)
    body = next(a.g for a in out.graph.node[0].attribute if a.name == "body")
    assert ops(body) == {"ConstantOfShape": 1, "Add": 2, "Identity": 1}  # Shape: a constant
    (sh,) = [t for t in body.initializer if t.name == "sh"]
    assert numpy_helper.to_array(sh).tolist() == [4]
    assert [i.name for i in body.input] == ["s", "x_t"]
    same_values(model, out)


def test_a_scan_body_with_inputs_of_unknown_shape_stays():
    model = _scan("N")
    out = copy_model(model)
    specialize_scan_bodies(out, (), specialize)
    assert out == model
    same_values(model, out, feeds_for(model, N=5))


# -- sparse row updates --------------------------------------------------------------------


def _embedding_sgd(reduction: str = "add", also_read: bool = False) -> onnx.ModelProto:
    """The native backend's SGD step of a Gather-read table: W + s * squeeze(scatter-add)."""
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
        helper.make_node("ScatterND", ["zeros", "I", "U"], ["scattered"], reduction=reduction),
        helper.make_node("Squeeze", ["scattered", "seed"], ["grad"]),
        helper.make_node("Mul", ["grad", "s"], ["update"]),
        helper.make_node("Add", ["W", "update"], ["W_next"]),
    ]
    outputs = ["W_next", "grad"] if also_read else ["W_next"]
    return build(
        nodes,
        {"W": [10, 3], "I": ([5, 1], np.int64), "U": [5, 3, 1]},
        outputs,
        {
            "shape": np.array([10, 3, 1]),
            "seed": np.array([-1]),
            "s": np.array(-0.5, f32),
        },
    )


def _table_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "W": rng.normal(size=(10, 3)).astype(f32),
        "I": np.array([[2], [7], [2], [-1], [0]]),  # a row read twice, a negative index
        "U": rng.normal(size=(5, 3, 1)).astype(f32),
    }


def test_an_embedding_sgd_step_scatters_into_the_table():
    model = _embedding_sgd()
    out = kernels(model)
    assert ops(out) == {"Squeeze": 1, "Mul": 1, "ScatterND": 1}
    feeds = _table_feeds()
    expected = feeds["W"].copy()
    for index, rows in zip(feeds["I"][:, 0], feeds["U"][..., 0]):
        expected[index] += -0.5 * rows  # numpy: the rows the Gather read, each time
    (got,) = run(out, feeds)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    same_values(model, out, feeds)


def test_a_scatter_without_add_or_a_gradient_read_elsewhere_stays():
    for model in (_embedding_sgd(reduction="none"), _embedding_sgd(also_read=True)):
        assert kernels(model).graph.node == model.graph.node


def test_onnxruntime_trainings_gather_grad_update_scatters_into_the_table():
    nodes = [
        helper.make_node("GatherGrad", ["shape", "I", "dY"], ["grad"], domain="com.microsoft"),
        helper.make_node("Mul", ["grad", "s"], ["update"]),
        helper.make_node("Add", ["W", "update"], ["W_next"]),
    ]
    model = build(
        nodes,
        {"W": [10, 3], "I": ([2, 2], np.int64), "dY": [2, 2, 3]},
        ["W_next"],
        {"shape": np.array([10, 3]), "s": np.array(-0.5, f32)},
    )
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    out = kernels(model)
    assert ops(out) == {"Unsqueeze": 1, "Mul": 1, "ScatterND": 1}
    rng = np.random.default_rng(1)
    feeds = {
        "W": rng.normal(size=(10, 3)).astype(f32),
        "I": np.array([[1, 4], [4, 9]]),
        "dY": rng.normal(size=(2, 2, 3)).astype(f32),
    }
    expected = feeds["W"].copy()
    for index, rows in zip(feeds["I"].ravel(), feeds["dY"].reshape(-1, 3)):
        expected[index] += -0.5 * rows
    (got,) = run(out, feeds)  # standard operators only: any onnxruntime runs it
    np.testing.assert_allclose(got, expected, rtol=1e-6)
