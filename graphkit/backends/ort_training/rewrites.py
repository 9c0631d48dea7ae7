"""Rewrites that make a converted graph differentiable by onnxruntime-training 1.19.2.

Each computes the same function as the node it replaces:

* ``LayerNormalization`` declares its optional ``Mean`` and ``InvStdDev`` outputs, which
  the gradient builders need (without them: ``node_->OutputDefs().size() was false``);
* an inference ``BatchNormalization`` becomes ``X * a + b`` with
  ``a = scale / sqrt(var + epsilon)`` and ``b = bias - mean * a`` (the full-training
  gradient builder has no gradient for it);
* ``AveragePool`` becomes a convolution with a constant ``1 / prod(kernel)`` kernel over
  ``(N * C, 1, ...)``: onnxruntime's ``AveragePoolGrad`` reads shapes from static
  dimensions and divides by zero (SIGFPE, the process dies) on a symbolic batch;
* the activations its builders have no gradient for (``Elu``, ``Selu``, ``PRelu``,
  ``HardSigmoid``, ``HardSwish``, ``Softplus``, ``Mish``) become the standard operators
  of their definitions (:mod:`graphkit.backends.activations`);
* a ``CastLike`` of a known type becomes a ``Cast`` (:mod:`graphkit.castlike`; the
  standard rewrites did it already for a graph a trainer prepares, not for one given to
  :func:`graphkit.gradient_model` as it is);
* a float ``CumSum`` becomes a ``MatMul`` by a triangular matrix of ones
  (:func:`cumsum_as_matmul`): its builders have no gradient for ``CumSum``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphkit._graph import (
    GraphInfo,
    NodeWriter,
    axes_for_opset,
    constant_tensors,
    copy_model,
    fresh_name,
    graph_names,
    int_constant,
    namer,
)
from graphkit.backends.activations import (
    ACTIVATIONS,
    Replacement,
    activations_as_standard_ops,
    rewrite_all,
)
from graphkit.castlike import castlike_as_cast
from graphkit.errors import MissingGradientError
from graphkit.tensor_store import tensor_value
from graphkit.train_mode import is_marked

REWRITTEN = frozenset(
    {"LayerNormalization", "BatchNormalization", "AveragePool", "CastLike", "CumSum"}
)
"""The operators :func:`prepare` rewrites besides :data:`ACTIVATIONS`."""


def prepare(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the rewrites above applied (``model`` itself when none applies: the
    backend runs this on every graph it differentiates, prepared ones included)."""
    if not any(n.op_type in REWRITTEN or n.op_type in ACTIVATIONS for n in model.graph.node):
        return model
    model = average_pool_as_conv(unfold_batch_norm(declare_layer_norm_outputs(model)))
    return cumsum_as_matmul(activations_as_standard_ops(castlike_as_cast(model)))


def declare_layer_norm_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every LayerNormalization has its three outputs."""
    out = copy_model(model)
    taken = graph_names(out.graph)
    for node in out.graph.node:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            while len(node.output) < 3:
                node.output.append("")
            for i, role in ((1, "mean"), (2, "inv_std_dev")):
                if not node.output[i]:
                    node.output[i] = fresh_name(f"{node.output[0]}/{role}", taken)
    return out


def unfold_batch_norm(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every inference BatchNormalization is ``X * a + b`` (see module)."""
    return _rewrite(model, "BatchNormalization", _unfold_one_batch_norm)


def average_pool_as_conv(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every AveragePool is a convolution (see the module docstring).

    Raises:
        MissingGradientError: an AveragePool with ``ceil_mode=1`` (a convolution has no
            such option), naming the node.
    """
    return _rewrite(model, "AveragePool", _one_average_pool_as_conv)


def cumsum_as_matmul(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every float ``CumSum`` along an axis known here is a ``MatMul`` by a
    triangular matrix of ones, which onnxruntime-training's builders differentiate (they
    have no gradient for ``CumSum``).

    Along the last axis, of size ``n`` (read at run time: a symbolic axis is fine),

        CumSum(x, axis)[..., j] = sum_i x[..., i] T[i, j] = MatMul(x, T)[..., j]

    with ``T[i, j] = 1`` where ``i <= j`` (``i < j`` with ``exclusive=1``; ``i >= j``
    with ``reverse=1``; ``i > j`` with both), else 0; another axis is moved last by a
    ``Transpose`` and back. The sums are the same terms (times exact ones, plus exact
    zeros), added in the matrix product's order instead of one after another: equal up
    to float rounding. The gradient the builders take, ``dY T^T``, is the cumulative sum
    of ``dY`` in the other direction with the same ``exclusive``: CumSum's own gradient.
    The product costs ``n`` times the operations of a ``CumSum`` (and a ``n x n`` matrix),
    which is small beside the layers around it for the axes a model sums along.

    A ``CumSum`` stays as it is (and the builders, if it lies on the gradient's path,
    refuse it, naming it and the native backend) where its input is not float32, float64
    or float16, its axis is not a constant, or the axis is not the last one and the
    input's rank is unknown.
    """
    constants = dict(constant_tensors(model.graph))

    def replace(node: onnx.NodeProto, attrs: dict, info: GraphInfo) -> list[onnx.NodeProto] | None:
        return _one_cumsum_as_matmul(node, attrs, info, constants)

    return rewrite_all(model, {"CumSum": replace})


_CUMSUM_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)

_TRIANGLES = {  # (exclusive, reverse) -> how T[i, j] = 1 compares i and j
    (0, 0): ("Greater", True),  # i <= j: not i > j
    (1, 0): ("Less", False),  # i < j
    (0, 1): ("Less", True),  # i >= j: not i < j
    (1, 1): ("Greater", False),  # i > j
}


def _one_cumsum_as_matmul(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo, constants: dict[str, onnx.TensorProto]
) -> list[onnx.NodeProto] | None:
    x, axis_input = node.input[0], node.input[1]
    elem = info.elem.get(x)
    if elem not in _CUMSUM_TYPES or axis_input not in constants:
        return None
    axis_value = tensor_value(constants[axis_input])
    if axis_value.size != 1:
        return None
    axis = int(axis_value.ravel()[0])
    rank = info.rank.get(x)
    if rank is not None:
        if not -rank <= axis < rank:
            return None  # onnxruntime reports the bad axis when it runs the node
        axis %= rank
    last = axis == -1 or (rank is not None and axis == rank - 1)
    if not last and (rank is None or axis < 0):
        return None
    compare, negate = _TRIANGLES[(int(attrs.get("exclusive", 0)), int(attrs.get("reverse", 0)))]
    write = NodeWriter(namer(f"{node.name or node.output[0]}/as_matmul", info.taken))
    # i along the rows ([n, 1]), j along the columns ([n]): T[i, j] by broadcasting
    size = write.op("Gather", [write.op("Shape", [x]), _scalar(write, axis)], axis=0)
    j = write.op("Range", [_scalar(write, 0), size, _scalar(write, 1)])
    i = write.op("Reshape", [j, write.ints([-1, 1])])
    mask = write.op(compare, [i, j])
    if negate:
        mask = write.op("Not", [mask])
    triangle = write.op("Cast", [mask], to=elem)
    if last:
        write.nodes.append(helper.make_node("MatMul", [x, triangle], [node.output[0]]))
        return write.nodes
    assert rank is not None
    perm = [d for d in range(rank) if d != axis] + [axis]
    moved = write.op("Transpose", [x], perm=perm)
    summed = write.op("MatMul", [moved, triangle])
    back = [perm.index(d) for d in range(rank)]
    write.nodes.append(helper.make_node("Transpose", [summed], [node.output[0]], perm=back))
    return write.nodes


def _scalar(write: NodeWriter, value: int) -> str:
    """An int64 scalar Constant."""
    out = write.fresh("scalar")
    tensor = numpy_helper.from_array(np.array(value, dtype=np.int64))
    write.nodes.append(helper.make_node("Constant", [], [out], value=tensor))
    return out


def _rewrite(model: onnx.ModelProto, op_type: str, replace: Replacement) -> onnx.ModelProto:
    """A copy where each standard ``op_type`` node becomes ``replace(node, attributes,
    info)``'s nodes (None keeps the node as it is)."""
    return rewrite_all(model, {op_type: replace})


def _unfold_one_batch_norm(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo
) -> list[onnx.NodeProto] | None:
    rank = info.rank.get(node.input[0])
    if attrs.get("training_mode", 0) or len([o for o in node.output if o]) != 1 or rank is None:
        return None
    if is_marked(node):  # it trains with batch statistics (graphkit.train_mode)
        return None
    x, scale, bias, mean, var = node.input
    name = namer(f"{node.name or node.output[0]}/unfolded", info.taken)
    eps, std, a, shift, b = (name(s) for s in ("epsilon", "std", "a", "shift", "b"))
    epsilon = np.array(attrs.get("epsilon", 1e-5), dtype=info.dtype(scale))
    # a = scale / sqrt(var + epsilon); b = bias - mean a
    nodes = [
        helper.make_node("Constant", [], [eps], value=numpy_helper.from_array(epsilon)),
        helper.make_node("Add", [var, eps], [f"{std}/sq"]),
        helper.make_node("Sqrt", [f"{std}/sq"], [std]),
        helper.make_node("Div", [scale, std], [a]),
        helper.make_node("Mul", [mean, a], [shift]),
        helper.make_node("Sub", [bias, shift], [b]),
    ]
    if rank > 2:  # (C,) -> (C, 1, ..., 1) to broadcast over the spatial axes
        axes, a_bc, b_bc = name("axes"), name("a_bc"), name("b_bc")
        nodes += [
            int_constant(axes, list(range(1, rank - 1))),
            helper.make_node("Unsqueeze", [a, axes], [a_bc]),
            helper.make_node("Unsqueeze", [b, axes], [b_bc]),
        ]
        a, b = a_bc, b_bc
    scaled = name("scaled")
    nodes.append(helper.make_node("Mul", [x, a], [scaled]))
    nodes.append(helper.make_node("Add", [scaled, b], [node.output[0]]))
    # Unsqueeze takes its axes as an attribute below opset 13
    return axes_for_opset(nodes, info.opset)


def _one_average_pool_as_conv(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo
) -> list[onnx.NodeProto]:
    if attrs.get("ceil_mode", 0):
        raise MissingGradientError(
            f"AveragePool node {node.name!r} uses ceil_mode=1, whose gradient kernel in "
            "onnxruntime-training 1.19.2 crashes on a dynamic batch and which graphkit "
            "cannot rewrite. Export the pooling with ceil_mode=False."
        )
    kernel = list(attrs["kernel_shape"])
    dtype = info.dtype(node.input[0])
    name = namer(f"{node.name or node.output[0]}/as_conv", info.taken)
    x = node.input[0]
    lead, rest, flat_shape, flat = (name(s) for s in ("lead", "rest", "flat_shape", "flat"))
    weight, summed, averaged = name("weight"), name("summed"), name("averaged")
    conv = {k: v for k, v in attrs.items() if k in ("auto_pad", "pads", "strides", "dilations")}
    ones = numpy_helper.from_array(np.ones([1, 1, *kernel], dtype=dtype))
    # (N, C, ...) -> (N * C, 1, ...), a sum over each window by a kernel of ones
    nodes = [
        int_constant(lead, [-1, 1]),
        helper.make_node("Shape", [x], [rest], start=2),
        helper.make_node("Concat", [lead, rest], [flat_shape], axis=0),
        helper.make_node("Reshape", [x, flat_shape], [flat]),
        helper.make_node("Constant", [], [weight], value=ones),
        helper.make_node("Conv", [flat, weight], [summed], kernel_shape=kernel, **conv),
    ]
    padded = any(attrs.get("pads", [])) or attrs.get("auto_pad", "NOTSET") not in (
        "NOTSET",
        "VALID",
    )
    divisor = name("divisor")
    if attrs.get("count_include_pad", 0) or not padded:
        count = numpy_helper.from_array(np.array(np.prod(kernel), dtype=dtype))
        nodes.append(helper.make_node("Constant", [], [divisor], value=count))
    else:  # divide by the number of real (non-padding) cells under each window
        ones_lead, ones_shape, plane = name("ones_lead"), name("ones_shape"), name("plane")
        one = numpy_helper.from_array(np.ones(1, dtype=dtype))
        nodes += [
            int_constant(ones_lead, [1, 1]),
            helper.make_node("Concat", [ones_lead, rest], [ones_shape], axis=0),
            helper.make_node("ConstantOfShape", [ones_shape], [plane], value=one),
            helper.make_node("Conv", [plane, weight], [divisor], kernel_shape=kernel, **conv),
        ]
    spatial, channels, out_shape = name("spatial"), name("channels"), name("out_shape")
    nodes += [
        helper.make_node("Div", [summed, divisor], [averaged]),
        helper.make_node("Shape", [averaged], [spatial], start=2),
        helper.make_node("Shape", [x], [channels], start=0, end=2),
        helper.make_node("Concat", [channels, spatial], [out_shape], axis=0),
        helper.make_node("Reshape", [averaged, out_shape], [node.output[0]]),
    ]
    return nodes


__all__ = [
    "ACTIVATIONS",
    "REWRITTEN",
    "average_pool_as_conv",
    "cumsum_as_matmul",
    "declare_layer_norm_outputs",
    "prepare",
    "unfold_batch_norm",
]
