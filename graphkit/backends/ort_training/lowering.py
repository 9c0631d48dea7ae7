"""Gradient operators of onnxruntime-training, rewritten with standard ONNX operators.

onnxruntime-training's gradient graphs use operators of its own (``com.microsoft``:
``BroadcastGradientArgs``, ``ReluGrad``...). No other runtime implements them, and some
of their kernels exist for float32 only. Each entry of :data:`LOWERINGS` replaces one such
node with standard operators computing the formula in its docstring; each is
checked against onnxruntime-training's own kernel on random inputs
(``tests/test_lowering.py``). The lowerings write opset 18's operators; each replacement
then takes the form of the opset of the graph it goes into
(:func:`graphkit._graph.axes_for_opset`: below opset 18 a ``ReduceMean`` takes its axes
as an attribute, below 13 a ``ReduceSum`` or an ``Unsqueeze`` too).

* :func:`lower_float32_only_ops`: the operators whose kernels are float32-only, on a
  float64 gradient graph.
* :func:`lower_to_standard`: every operator, so that the graph runs on plain onnxruntime
  or ``onnx.reference``; an operator (or attribute combination) the table does not know
  raises an error listing them all.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import onnx
from onnx import TensorProto, helper, numpy_helper

from graphkit._graph import (
    NodeWriter,
    all_graphs,
    axes_for_opset,
    constant_tensors,
    outer_reads,
    static_shape,
)
from graphkit.backends import conv_adjoints, pool_adjoints
from graphkit.compat import opset_of
from graphkit.engine.ort_engine import is_float64
from graphkit.errors import IncompatibleModelError
from graphkit.tensor_store import tensor_value

Lowering = Callable[[onnx.NodeProto], "list[onnx.NodeProto] | None"]
"""A node -> its replacement, or None when its attributes are outside what is known."""

make = helper.make_node


Dims = tuple[int | str | None, ...]


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    """The node's attributes as Python values (ints, floats, lists, tensors...)."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _base(node: onnx.NodeProto) -> str:
    return f"{node.name or node.output[0]}/lowered"


def _constant_like(name: str, value: float, like: str) -> list[onnx.NodeProto]:
    return [
        make("Constant", [], [f"{name}/value"], value_float=float(value)),
        make("CastLike", [f"{name}/value", like], [name]),
    ]


def _ints(name: str, values: list[int]) -> onnx.NodeProto:
    return make("Constant", [], [name], value_ints=list(values))


def _int(name: str, value: int) -> onnx.NodeProto:
    return make("Constant", [], [name], value_int=int(value))


# -- the float32-only kernels -----------------------------------------------------------------


def fused_matmul(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """FusedMatMul(A, B) = alpha op(A) @ op(B), op a transpose of the last two axes

    A MatMul (which broadcasts the batch axes as FusedMatMul does) of the operands, each
    transposed by a one-operand Einsum ``...ij->...ji`` when asked (their rank is not
    known here). One two-operand Einsum would do it all, but onnx's shape inference
    wants the ellipses of its operands to stand for as many axes, which a rank-3
    activation times a 2-D weight breaks: the export would fail ``onnx.checker``.
    """
    attrs = _attrs(node)
    if attrs.get("transBatchA") or attrs.get("transBatchB"):
        return None
    alpha = float(attrs.get("alpha", 1.0))
    out, base = node.output[0], _base(node)
    product = out if alpha == 1.0 else f"{base}/product"
    operands, nodes = [], []
    for name, flag, role in ((node.input[0], "transA", "a"), (node.input[1], "transB", "b")):
        if attrs.get(flag):
            transposed = f"{base}/{role}_t"
            nodes.append(make("Einsum", [name], [transposed], equation="...ij->...ji"))
            name = transposed
        operands.append(name)
    nodes.append(make("MatMul", operands, [product]))
    if alpha != 1.0:
        nodes += _constant_like(f"{base}/alpha", alpha, product)
        nodes.append(make("Mul", [product, f"{base}/alpha"], [out]))
    return nodes


def relu_grad(node: onnx.NodeProto, slope: float = 0.0) -> list[onnx.NodeProto]:
    """ReluGrad(dY, Y) = dY * (Y > 0);  LeakyReluGrad(dY, Y) = dY * (Y > 0 ? 1 : alpha)"""
    dy, y = node.input[0], node.input[1]
    base = _base(node)
    nodes = _constant_like(f"{base}/zero", 0.0, y) + _constant_like(f"{base}/slope", slope, y)
    nodes += _constant_like(f"{base}/one", 1.0, y)
    nodes.append(make("Greater", [y, f"{base}/zero"], [f"{base}/positive"]))
    nodes.append(
        make("Where", [f"{base}/positive", f"{base}/one", f"{base}/slope"], [f"{base}/gate"])
    )
    nodes.append(make("Mul", [dy, f"{base}/gate"], [node.output[0]]))
    return nodes


def softmax_grad(node: onnx.NodeProto, log: bool) -> list[onnx.NodeProto]:
    """SoftmaxGrad_13(dY, Y) = Y (dY - sum(dY Y, axis));
    LogSoftmaxGrad_13(dY, Y) = dY - exp(Y) sum(dY, axis)"""
    dy, y = node.input[0], node.input[1]
    axis = int(_attrs(node).get("axis", -1))
    base = _base(node)
    nodes = [_ints(f"{base}/axes", [axis])]
    if log:
        nodes.append(make("ReduceSum", [dy, f"{base}/axes"], [f"{base}/sum"], keepdims=1))
        nodes.append(make("Exp", [y], [f"{base}/p"]))
        nodes.append(make("Mul", [f"{base}/p", f"{base}/sum"], [f"{base}/scaled"]))
        nodes.append(make("Sub", [dy, f"{base}/scaled"], [node.output[0]]))
    else:
        nodes.append(make("Mul", [dy, y], [f"{base}/dyy"]))
        nodes.append(
            make("ReduceSum", [f"{base}/dyy", f"{base}/axes"], [f"{base}/sum"], keepdims=1)
        )
        nodes.append(make("Sub", [dy, f"{base}/sum"], [f"{base}/centered"]))
        nodes.append(make("Mul", [y, f"{base}/centered"], [node.output[0]]))
    return nodes


def scale(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """Scale(X, s) = X * s, or X / s with scale_down (the kernel casts s to float32)"""
    x, factor = node.input[0], node.input[1]
    base = _base(node)
    binary = "Div" if _attrs(node).get("scale_down") else "Mul"
    return [
        make("CastLike", [factor, x], [f"{base}/factor"]),
        make(binary, [x, f"{base}/factor"], [node.output[0]]),
    ]


# -- the others ----------------------------------------------------------------------------------


def broadcast_gradient_args(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """BroadcastGradientArgs(shape_a, shape_b) -> (axes_a, axes_b): the axes, in the
    broadcast result's numbering and in decreasing order, along which each operand's
    gradient must be summed. With both shapes left-padded with 1 to rank r, axis i is in
    axes_a when it is a padding axis of a, or when a_i = 1 and b_i != 1 (and symmetrically)."""
    a, b = node.input[0], node.input[1]
    base = _base(node)
    nodes = [
        make("Size", [a], [f"{base}/rank_a"]),
        make("Size", [b], [f"{base}/rank_b"]),
        make("Max", [f"{base}/rank_a", f"{base}/rank_b"], [f"{base}/rank"]),
        helper.make_node(
            "Constant",
            [],
            [f"{base}/one"],
            value=helper.make_tensor("one", TensorProto.INT64, [], [1]),
        ),
        helper.make_node(
            "Constant",
            [],
            [f"{base}/minus_one"],
            value=helper.make_tensor("minus_one", TensorProto.INT64, [], [-1]),
        ),
        _ints(f"{base}/vector", [1]),
        make("Sub", [f"{base}/rank", f"{base}/one"], [f"{base}/last"]),
        make(
            "Range",
            [f"{base}/last", f"{base}/minus_one", f"{base}/minus_one"],
            [f"{base}/axes"],
        ),  # r-1, ..., 0
    ]
    padded = {}
    for side, shape, rank in (("a", a, f"{base}/rank_a"), ("b", b, f"{base}/rank_b")):
        pad = f"{base}/{side}/pad"
        nodes += [
            make("Sub", [f"{base}/rank", rank], [pad]),
            make("Reshape", [pad, f"{base}/vector"], [f"{pad}/vector"]),
            make(
                "ConstantOfShape",
                [f"{pad}/vector"],
                [f"{pad}/ones"],
                value=helper.make_tensor("one", TensorProto.INT64, [1], [1]),
            ),
            make("Concat", [f"{pad}/ones", shape], [f"{base}/{side}/full"], axis=0),
            make("Gather", [f"{base}/{side}/full", f"{base}/axes"], [f"{base}/{side}/dims"]),
            make("Equal", [f"{base}/{side}/dims", f"{base}/one"], [f"{base}/{side}/is_one"]),
            make("Less", [f"{base}/axes", pad], [f"{base}/{side}/padding"]),
        ]
        padded[side] = f"{base}/{side}"
    for side, other, out in (("a", "b", node.output[0]), ("b", "a", node.output[1])):
        if not out:
            continue
        s = padded[side]
        nodes += [
            make("Not", [f"{padded[other]}/is_one"], [f"{s}/other_not_one"]),
            make("And", [f"{s}/is_one", f"{s}/other_not_one"], [f"{s}/broadcast"]),
            make("Or", [f"{s}/padding", f"{s}/broadcast"], [f"{s}/reduced"]),
            make("Compress", [f"{base}/axes", f"{s}/reduced"], [out]),
        ]
    return nodes


def sigmoid_grad(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """SigmoidGrad(dY, Y) = dY Y (1 - Y)"""
    dy, y = node.input[0], node.input[1]
    base = _base(node)
    return [
        *_constant_like(f"{base}/one", 1.0, y),
        make("Sub", [f"{base}/one", y], [f"{base}/complement"]),
        make("Mul", [dy, y], [f"{base}/dyy"]),
        make("Mul", [f"{base}/dyy", f"{base}/complement"], [node.output[0]]),
    ]


def tanh_grad(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """TanhGrad(dY, Y) = dY (1 - Y^2)"""
    dy, y = node.input[0], node.input[1]
    base = _base(node)
    return [
        *_constant_like(f"{base}/one", 1.0, y),
        make("Mul", [y, y], [f"{base}/square"]),
        make("Sub", [f"{base}/one", f"{base}/square"], [f"{base}/slope"]),
        make("Mul", [dy, f"{base}/slope"], [node.output[0]]),
    ]


def gelu_grad(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """GeluGrad(dY, X) = dY (Phi(X) + X phi(X)), Phi(x) = (1 + erf(x / sqrt 2)) / 2,
    phi(x) = exp(-x^2 / 2) / sqrt(2 pi)"""
    dy, x = node.input[0], node.input[1]
    base = _base(node)
    return [
        *_constant_like(f"{base}/half", 0.5, x),
        *_constant_like(f"{base}/one", 1.0, x),
        *_constant_like(f"{base}/inv_sqrt2", 1.0 / math.sqrt(2.0), x),
        *_constant_like(f"{base}/inv_sqrt2pi", 1.0 / math.sqrt(2.0 * math.pi), x),
        make("Mul", [x, f"{base}/inv_sqrt2"], [f"{base}/scaled"]),
        make("Erf", [f"{base}/scaled"], [f"{base}/erf"]),
        make("Add", [f"{base}/erf", f"{base}/one"], [f"{base}/erf1"]),
        make("Mul", [f"{base}/erf1", f"{base}/half"], [f"{base}/cdf"]),
        make("Mul", [x, x], [f"{base}/square"]),
        make("Mul", [f"{base}/square", f"{base}/half"], [f"{base}/half_square"]),
        make("Neg", [f"{base}/half_square"], [f"{base}/exponent"]),
        make("Exp", [f"{base}/exponent"], [f"{base}/gauss"]),
        make("Mul", [f"{base}/gauss", f"{base}/inv_sqrt2pi"], [f"{base}/pdf"]),
        make("Mul", [x, f"{base}/pdf"], [f"{base}/xpdf"]),
        make("Add", [f"{base}/cdf", f"{base}/xpdf"], [f"{base}/slope"]),
        make("Mul", [dy, f"{base}/slope"], [node.output[0]]),
    ]


def fast_gelu_grad(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """FastGeluGrad(dY, X), the derivative of x (1 + tanh(u)) / 2 with
    u = k (x + c x^3), k = sqrt(2 / pi), c = 0.044715:
    dY ((1 + t) / 2 + x (1 - t^2) k (1 + 3 c x^2) / 2), t = tanh(u)"""
    dy, x = node.input[0], node.input[1]
    base = _base(node)
    k, c = math.sqrt(2.0 / math.pi), 0.044715
    return [
        *_constant_like(f"{base}/half", 0.5, x),
        *_constant_like(f"{base}/one", 1.0, x),
        *_constant_like(f"{base}/k", k, x),
        *_constant_like(f"{base}/c", c, x),
        *_constant_like(f"{base}/c3", 3.0 * c, x),
        make("Mul", [x, x], [f"{base}/x2"]),
        make("Mul", [f"{base}/x2", f"{base}/c"], [f"{base}/cx2"]),
        make("Add", [f"{base}/one", f"{base}/cx2"], [f"{base}/inner1"]),
        make("Mul", [x, f"{base}/inner1"], [f"{base}/inner"]),
        make("Mul", [f"{base}/inner", f"{base}/k"], [f"{base}/u"]),
        make("Tanh", [f"{base}/u"], [f"{base}/t"]),
        make("Add", [f"{base}/one", f"{base}/t"], [f"{base}/t1"]),
        make("Mul", [f"{base}/t1", f"{base}/half"], [f"{base}/left"]),
        make("Mul", [f"{base}/t", f"{base}/t"], [f"{base}/t2"]),
        make("Sub", [f"{base}/one", f"{base}/t2"], [f"{base}/sech2"]),
        make("Mul", [f"{base}/x2", f"{base}/c3"], [f"{base}/c3x2"]),
        make("Add", [f"{base}/one", f"{base}/c3x2"], [f"{base}/du1"]),
        make("Mul", [f"{base}/du1", f"{base}/k"], [f"{base}/du"]),
        make("Mul", [x, f"{base}/sech2"], [f"{base}/xs"]),
        make("Mul", [f"{base}/xs", f"{base}/du"], [f"{base}/xsdu"]),
        make("Mul", [f"{base}/xsdu", f"{base}/half"], [f"{base}/right"]),
        make("Add", [f"{base}/left", f"{base}/right"], [f"{base}/slope"]),
        make("Mul", [dy, f"{base}/slope"], [node.output[0]]),
    ]


def reduce_sum_training(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """ReduceSumTraining(X, axes) = ReduceSum(X, axes) (opset 13+ takes axes as an input)"""
    return [make("ReduceSum", list(node.input), list(node.output), **_attrs(node))]


def softmax_grad_v1(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """SoftmaxGrad (opset < 13 semantics: the input seen as 2-D at ``axis``):
    dX = Y (dY - sum(dY Y over the axes >= axis))"""
    dy, y = node.input[0], node.input[1]
    axis = int(_attrs(node).get("axis", 1))
    base = _base(node)
    return [
        make("Flatten", [dy], [f"{base}/dy2"], axis=axis),
        make("Flatten", [y], [f"{base}/y2"], axis=axis),
        make("Mul", [f"{base}/dy2", f"{base}/y2"], [f"{base}/dyy"]),
        _ints(f"{base}/axes", [1]),
        make("ReduceSum", [f"{base}/dyy", f"{base}/axes"], [f"{base}/sum"], keepdims=1),
        make("Sub", [f"{base}/dy2", f"{base}/sum"], [f"{base}/centered"]),
        make("Mul", [f"{base}/y2", f"{base}/centered"], [f"{base}/dx2"]),
        make("Shape", [y], [f"{base}/shape"]),
        make("Reshape", [f"{base}/dx2", f"{base}/shape"], [node.output[0]]),
    ]


def _zeros_like_shape(base: str, shape: str, like: str) -> list[onnx.NodeProto]:
    """``{base}/zeros``: zeros of the int64 ``shape``, with the dtype of ``like``."""
    return [
        make("ConstantOfShape", [shape], [f"{base}/zeros_f32"]),
        make("CastLike", [f"{base}/zeros_f32", like], [f"{base}/zeros"]),
    ]


def gather_elements_grad(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """GatherElementsGrad(dY, shape, indices) = ScatterElements(zeros(shape), indices, dY,
    axis, reduction=add): each gathered element's gradient added back to its source"""
    dy, shape, indices = node.input[0], node.input[1], node.input[2]
    axis = int(_attrs(node).get("axis", 0))
    base = _base(node)
    return [
        *_zeros_like_shape(base, shape, dy),
        make(
            "ScatterElements",
            [f"{base}/zeros", indices, dy],
            [node.output[0]],
            axis=axis,
            reduction="add",
        ),
    ]


def gather_grad(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """GatherGrad(shape, indices, dY) on ``axis``: zeros(shape) with each slice of dY added
    at the position its index names (repeated indices add up, negative ones count from
    the end). In the 3-D view (P, D, R) = (before the axis, the axis, after it), dY is
    (P, Q, R) for Q indices: transposed to (Q, P, R), it is a ScatterND (reduction add)
    of rows into zeros (D, P, R)."""
    shape, indices, dy = node.input[0], node.input[1], node.input[2]
    axis = int(_attrs(node).get("axis", 0))
    base = _base(node)
    scalar = lambda name, value: helper.make_node(  # noqa: E731
        "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [], [value])
    )
    return [
        *_zeros_like_shape(base, shape, dy),
        scalar(f"{base}/axis_value", axis),
        scalar(f"{base}/zero", 0),
        scalar(f"{base}/one", 1),
        _ints(f"{base}/vector", [1]),
        _ints(f"{base}/flat", [-1]),
        make("Size", [shape], [f"{base}/rank"]),
        make("Less", [f"{base}/axis_value", f"{base}/zero"], [f"{base}/negative"]),
        make("Add", [f"{base}/axis_value", f"{base}/rank"], [f"{base}/wrapped_axis"]),
        make(
            "Where",
            [f"{base}/negative", f"{base}/wrapped_axis", f"{base}/axis_value"],
            [f"{base}/axis"],
        ),
        make("Add", [f"{base}/axis", f"{base}/one"], [f"{base}/after"]),
        make("Reshape", [f"{base}/axis", f"{base}/vector"], [f"{base}/axis_1d"]),
        make("Reshape", [f"{base}/after", f"{base}/vector"], [f"{base}/after_1d"]),
        make("Reshape", [f"{base}/zero", f"{base}/vector"], [f"{base}/zero_1d"]),
        make("Reshape", [f"{base}/rank", f"{base}/vector"], [f"{base}/rank_1d"]),
        make("Slice", [shape, f"{base}/zero_1d", f"{base}/axis_1d"], [f"{base}/before_dims"]),
        make("Slice", [shape, f"{base}/axis_1d", f"{base}/after_1d"], [f"{base}/D"]),
        make("Slice", [shape, f"{base}/after_1d", f"{base}/rank_1d"], [f"{base}/after_dims"]),
        make("ReduceProd", [f"{base}/before_dims"], [f"{base}/P"], keepdims=1),
        make("ReduceProd", [f"{base}/after_dims"], [f"{base}/R"], keepdims=1),
        make("Concat", [f"{base}/P", f"{base}/flat", f"{base}/R"], [f"{base}/pqr"], axis=0),
        make("Reshape", [dy, f"{base}/pqr"], [f"{base}/dy3"]),
        make("Transpose", [f"{base}/dy3"], [f"{base}/qpr"], perm=[1, 0, 2]),
        make("Cast", [indices], [f"{base}/indices64"], to=TensorProto.INT64),
        make("Reshape", [f"{base}/indices64", f"{base}/flat"], [f"{base}/index_flat"]),
        make("Squeeze", [f"{base}/D", f"{base}/zero_1d"], [f"{base}/D_scalar"]),
        make("Add", [f"{base}/index_flat", f"{base}/D_scalar"], [f"{base}/shifted"]),
        make("Mod", [f"{base}/shifted", f"{base}/D_scalar"], [f"{base}/positive"]),
        make("Unsqueeze", [f"{base}/positive", f"{base}/flat"], [f"{base}/index"]),
        make("Concat", [f"{base}/D", f"{base}/P", f"{base}/R"], [f"{base}/dpr"], axis=0),
        make("Reshape", [f"{base}/zeros", f"{base}/dpr"], [f"{base}/zeros3"]),
        make(
            "ScatterND",
            [f"{base}/zeros3", f"{base}/index", f"{base}/qpr"],
            [f"{base}/scattered"],
            reduction="add",
        ),
        make("Transpose", [f"{base}/scattered"], [f"{base}/pdr"], perm=[1, 0, 2]),
        make("Reshape", [f"{base}/pdr", shape], [node.output[0]]),
    ]


def slice_grad(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """SliceGrad(dY, shape, starts, ends[, axes[, steps]]): zeros(shape) with dY written
    at the sliced positions (the flat positions are sliced like the input was)"""
    dy, shape, *slicing = node.input
    base = _base(node)
    return [
        *_zeros_like_shape(base, shape, dy),
        _ints(f"{base}/all", [-1]),
        make("ReduceProd", [shape], [f"{base}/size"], keepdims=0),
        helper.make_node(
            "Constant",
            [],
            [f"{base}/zero"],
            value=helper.make_tensor("z", TensorProto.INT64, [], [0]),
        ),
        helper.make_node(
            "Constant",
            [],
            [f"{base}/one"],
            value=helper.make_tensor("o", TensorProto.INT64, [], [1]),
        ),
        make("Range", [f"{base}/zero", f"{base}/size", f"{base}/one"], [f"{base}/flat"]),
        make("Reshape", [f"{base}/flat", shape], [f"{base}/positions"]),
        make("Slice", [f"{base}/positions", *slicing], [f"{base}/picked"]),
        make("Reshape", [f"{base}/picked", f"{base}/all"], [f"{base}/picked_flat"]),
        make("Unsqueeze", [f"{base}/picked_flat", f"{base}/all"], [f"{base}/index"]),
        make("Reshape", [dy, f"{base}/all"], [f"{base}/dy_flat"]),
        make("Reshape", [f"{base}/zeros", f"{base}/all"], [f"{base}/zeros_flat"]),
        make(
            "ScatterND",
            [f"{base}/zeros_flat", f"{base}/index", f"{base}/dy_flat"],
            [f"{base}/scattered"],
        ),
        make("Reshape", [f"{base}/scattered", shape], [node.output[0]]),
    ]


def _sum_to_shape(base: str, value: str, axes: str, shape: str, out: str) -> list[onnx.NodeProto]:
    """``out`` = ``value`` summed over ``axes`` and reshaped to ``shape``."""
    return [
        make("ReduceSum", [value, axes], [f"{base}/summed"], keepdims=1, noop_with_empty_axes=1),
        make("Reshape", [f"{base}/summed", shape], [out]),
    ]


def conv_transpose_grad(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """ConvTransposeGrad(dY, X, W) -> (dX, dW, dB): a ConvTranspose is the adjoint of a
    Conv with the same attributes, so

    * dX = Conv(dY, W) (same strides, pads, dilations, groups);
    * dW = the correlation of dY with X: Conv(dY^T, X^T) with strides and dilations
      swapped, cropped to W's size, group by group;
    * dB = sum of dY over every axis but the channels.

    Explicit pads only (``auto_pad`` NOTSET, no ``output_shape``).
    """
    geometry = _conv_geometry(node)
    if geometry is None:
        return None
    group, pads, strides, dilations = geometry
    dx_out, dw_out, db_out = (list(node.output) + ["", "", ""])[:3]
    dy, x, w = node.input[0], node.input[1], node.input[2]
    base = _base(node)
    nodes = _bias_grad(base, dy, db_out, len(strides))
    if dx_out:
        nodes.append(
            make(
                "Conv",
                [dy, w],
                [dx_out],
                pads=pads,
                strides=strides,
                dilations=dilations,
                group=group,
            )
        )
    if dw_out:  # W is (C_in, C_out / group, k...): the roles of X and dY swap
        nodes += _weight_grad(f"{base}/dw", dy, x, w, dw_out, group, pads, strides, dilations)
    return nodes


def div_grad(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """DivGrad(dY, A, B) -> (dA, dB) = (dY / B, -dY A / B^2), each summed back to its
    operand's shape over the axes broadcasting stretched"""
    dy, a, b = node.input[0], node.input[1], node.input[2]
    base = _base(node)
    da, db = (list(node.output) + ["", ""])[:2]
    axes = helper.make_node(
        "BroadcastGradientArgs",
        [f"{base}/shape_a", f"{base}/shape_b"],
        [f"{base}/axes_a", f"{base}/axes_b"],
        name=f"{base}/axes",
    )
    nodes = [
        make("Shape", [a], [f"{base}/shape_a"]),
        make("Shape", [b], [f"{base}/shape_b"]),
        *broadcast_gradient_args(axes),
        make("Div", [dy, b], [f"{base}/dy_over_b"]),
    ]
    if da:
        nodes += _sum_to_shape(
            f"{base}/a", f"{base}/dy_over_b", f"{base}/axes_a", f"{base}/shape_a", da
        )
    if db:
        nodes += [
            make("Mul", [f"{base}/dy_over_b", a], [f"{base}/dya_over_b"]),
            make("Div", [f"{base}/dya_over_b", b], [f"{base}/ratio"]),
            make("Neg", [f"{base}/ratio"], [f"{base}/db_full"]),
            *_sum_to_shape(f"{base}/b", f"{base}/db_full", f"{base}/axes_b", f"{base}/shape_b", db),
        ]
    return nodes


def layer_norm_grad(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """LayerNormalizationGrad(dY, X, scale, mean, inv_std) -> (dX, dScale, dBias), in the
    2-D view (rows, normalized) at ``axis``, with x^ = (X - mean) inv_std, g = dY scale:

        dX = inv_std (g - mean(g) - x^ mean(g x^))   (means over the normalized axes)
        dScale = sum over rows of dY x^;  dBias = sum over rows of dY

    mean and inv_std = 1 / sqrt(mean((X - mean)^2) + epsilon) are computed again from X,
    in X's type: the forward's are float32 by default (``stash_type=1``) even for float64
    X, whose normalized values onnxruntime computes in float64, and x^ from them would
    put float32's error (1e-8, relative) into a float64 dScale and dX.
    """
    dy, x, scale_ = node.input[:3]
    attrs = _attrs(node)
    axis = int(attrs.get("axis", -1))
    epsilon = float(attrs.get("epsilon", 1e-5))
    dx, dscale, dbias = (list(node.output) + ["", "", ""])[:3]
    base = _base(node)
    nodes = [
        make("Flatten", [dy], [f"{base}/dy"], axis=axis),
        make("Flatten", [x], [f"{base}/x"], axis=axis),
        _ints(f"{base}/rows", [0]),
        _ints(f"{base}/columns", [1]),
        make("ReduceMean", [f"{base}/x", f"{base}/columns"], [f"{base}/mean_x"], keepdims=1),
        make("Sub", [f"{base}/x", f"{base}/mean_x"], [f"{base}/centered"]),
        make("Mul", [f"{base}/centered", f"{base}/centered"], [f"{base}/squares"]),
        make("ReduceMean", [f"{base}/squares", f"{base}/columns"], [f"{base}/var"], keepdims=1),
        *_constant_like(f"{base}/epsilon", epsilon, f"{base}/x"),
        make("Add", [f"{base}/var", f"{base}/epsilon"], [f"{base}/var_eps"]),
        make("Sqrt", [f"{base}/var_eps"], [f"{base}/std"]),
        make("Reciprocal", [f"{base}/std"], [f"{base}/inv_x"]),
        make("Mul", [f"{base}/centered", f"{base}/inv_x"], [f"{base}/xhat"]),
        make("Shape", [scale_], [f"{base}/scale_shape"]),
    ]
    if dx:
        nodes += [
            _ints(f"{base}/row_vector", [1, -1]),
            make("Reshape", [scale_, f"{base}/row_vector"], [f"{base}/scale"]),
            make("Mul", [f"{base}/dy", f"{base}/scale"], [f"{base}/g"]),
            make("ReduceMean", [f"{base}/g", f"{base}/columns"], [f"{base}/g_mean"], keepdims=1),
            make("Mul", [f"{base}/g", f"{base}/xhat"], [f"{base}/gx"]),
            make("ReduceMean", [f"{base}/gx", f"{base}/columns"], [f"{base}/gx_mean"], keepdims=1),
            make("Sub", [f"{base}/g", f"{base}/g_mean"], [f"{base}/g_centered"]),
            make("Mul", [f"{base}/xhat", f"{base}/gx_mean"], [f"{base}/projection"]),
            make("Sub", [f"{base}/g_centered", f"{base}/projection"], [f"{base}/inner"]),
            make("Mul", [f"{base}/inner", f"{base}/inv_x"], [f"{base}/dx2"]),
            make("Shape", [x], [f"{base}/x_shape"]),
            make("Reshape", [f"{base}/dx2", f"{base}/x_shape"], [dx]),
        ]
    if dscale:
        nodes += [
            make("Mul", [f"{base}/dy", f"{base}/xhat"], [f"{base}/dyx"]),
            make("ReduceSum", [f"{base}/dyx", f"{base}/rows"], [f"{base}/dscale"], keepdims=0),
            make("Reshape", [f"{base}/dscale", f"{base}/scale_shape"], [dscale]),
        ]
    if dbias:
        nodes += [
            make("ReduceSum", [f"{base}/dy", f"{base}/rows"], [f"{base}/dbias"], keepdims=0),
            make("Reshape", [f"{base}/dbias", f"{base}/scale_shape"], [dbias]),
        ]
    return nodes


def max_pool_grad(
    node: onnx.NodeProto,
    producers: dict[str, onnx.NodeProto],
    shapes: dict[str, Dims] | None = None,
) -> list[onnx.NodeProto] | None:
    """MaxPoolGrad(dY, Indices): zeros shaped like the MaxPool's input, with dY added at
    the flat positions ``Indices`` holds (storage_order 0: row-major over the whole
    tensor, batch and channels included). A ``MaxUnpool`` where the pooling's windows
    tile a float32 input whose spatial size ``shapes`` knows
    (:mod:`graphkit.backends.pool_adjoints`), a ``ScatterND`` elsewhere."""
    pool = producers.get(node.input[1])
    if pool is None or pool.op_type != "MaxPool" or _attrs(pool).get("storage_order", 0):
        return None
    unpooled = _max_pool_grad_unpooled(node, pool, (shapes or {}).get(pool.input[0]))
    if unpooled is not None:
        return unpooled
    dy, indices, x = node.input[0], node.input[1], pool.input[0]
    base = _base(node)
    return [
        make("Shape", [x], [f"{base}/shape"]),
        *_zeros_like_shape(base, f"{base}/shape", dy),
        _ints(f"{base}/all", [-1]),
        make("Reshape", [f"{base}/zeros", f"{base}/all"], [f"{base}/zeros_flat"]),
        make("Reshape", [indices, f"{base}/all"], [f"{base}/indices_flat"]),
        make("Unsqueeze", [f"{base}/indices_flat", f"{base}/all"], [f"{base}/index"]),
        make("Reshape", [dy, f"{base}/all"], [f"{base}/dy_flat"]),
        make(
            "ScatterND",
            [f"{base}/zeros_flat", f"{base}/index", f"{base}/dy_flat"],
            [f"{base}/scattered"],
            reduction="add",
        ),
        make("Reshape", [f"{base}/scattered", f"{base}/shape"], [node.output[0]]),
    ]


def _max_pool_grad_unpooled(
    node: onnx.NodeProto, pool: onnx.NodeProto, shape: Dims | None
) -> list[onnx.NodeProto] | None:
    """MaxPoolGrad as a ``MaxUnpool`` of dY at ``pool``'s indices, each kept inside its
    window (:mod:`graphkit.backends.pool_adjoints`), or None where the windows do not
    tile an input of ``shape`` (storage_order 0 assumed)."""
    unpool = _unpooling(pool, shape)
    if unpool is None or shape is None:
        return None
    size = [int(d) for d in shape[2:]]  # type: ignore[arg-type]
    base = _base(node)
    counter = itertools.count()
    writer = NodeWriter(lambda stem: f"{base}/{stem}_{next(counter)}")
    kernel, strides, pads, dilations, _ = _pool_geometry(pool)
    starts = pool_adjoints.window_starts(kernel, strides, pads, dilations, size)
    starts_name = writer.op("Constant", [], value=numpy_helper.from_array(starts))
    indices = pool_adjoints.indices_in_windows(
        writer.op, node.input[1], starts_name, len(size), math.prod(size)
    )
    writer.nodes.append(make("MaxUnpool", [node.input[0], indices], [node.output[0]], **unpool))
    return writer.nodes


def _unpooling(pool: onnx.NodeProto, shape: Dims | None) -> dict | None:
    """:func:`graphkit.backends.pool_adjoints.unpooling` for a MaxPool node whose input
    has ``shape`` (None: unknown; its batch and channels may be symbolic)."""
    attrs = _attrs(pool)
    if shape is None or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID"):
        return None
    return pool_adjoints.unpooling(*_pool_geometry(pool), list(shape[2:]))


def _pool_geometry(pool: onnx.NodeProto) -> tuple[list[int], list[int], list[int], list[int], int]:
    """A MaxPool node's kernel, strides, pads, dilations and ceil_mode, defaults filled."""
    attrs = _attrs(pool)
    kernel = list(attrs["kernel_shape"])
    n = len(kernel)
    return (
        kernel,
        list(attrs.get("strides", [1] * n)),
        list(attrs.get("pads", [0] * 2 * n)),
        list(attrs.get("dilations", [1] * n)),
        int(attrs.get("ceil_mode", 0)),
    )


def _conv_weight_grad(
    base: str, x: str, dy: str, pads: list[int], strides: list[int], dilations: list[int]
) -> tuple[list[onnx.NodeProto], str]:
    """dW of a one-group Conv, uncropped: Conv(X^T, dY^T) with strides and dilations
    swapped (^T swaps batch and channels), transposed back."""
    swap = [1, 0, *range(2, 2 + len(strides))]
    nodes = [
        make("Transpose", [x], [f"{base}/x_t"], perm=swap),
        make("Transpose", [dy], [f"{base}/dy_t"], perm=swap),
        make(
            "Conv",
            [f"{base}/x_t", f"{base}/dy_t"],
            [f"{base}/dw_t"],
            pads=pads,
            strides=dilations,
            dilations=strides,
        ),
        make("Transpose", [f"{base}/dw_t"], [f"{base}/dw_full"], perm=swap),
    ]
    return nodes, f"{base}/dw_full"


def _conv_geometry(
    node: onnx.NodeProto,
) -> tuple[int, list[int], list[int], list[int]] | None:
    """``(group, pads, strides, dilations)`` of a Conv(Transpose)Grad node, defaults
    filled in; None for ``auto_pad``, ``output_shape`` or an unknown rank."""
    attrs = _attrs(node)
    if attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET") or "output_shape" in attrs:
        return None
    strides = list(attrs.get("strides", []))
    dilations = list(attrs.get("dilations", []))
    pads = list(attrs.get("pads", []))
    kernel = list(attrs.get("kernel_shape", []))
    spatial = len(pads) // 2 or len(strides) or len(dilations) or len(kernel)
    if not spatial:
        return None
    group = int(attrs.get("group", 1))
    return group, pads or [0] * (2 * spatial), strides or [1] * spatial, dilations or [1] * spatial


def _bias_grad(base: str, dy: str, out: str, spatial: int) -> list[onnx.NodeProto]:
    """``out`` = dY summed over every axis but the channels (nothing when not asked)."""
    if not out:
        return []
    return [
        _ints(f"{base}/bias_axes", [0, *range(2, 2 + spatial)]),
        make("ReduceSum", [dy, f"{base}/bias_axes"], [out], keepdims=0),
    ]


def _group_size(base: str, tensor: str, group: int, out: str) -> list[onnx.NodeProto]:
    """``out`` = the channels (axis 1) of ``tensor`` per group, a 1-D int64."""
    return [
        _ints(f"{base}/groups", [group]),
        _ints(f"{base}/one", [1]),
        _ints(f"{base}/two", [2]),
        make("Shape", [tensor], [f"{base}/shape"]),
        make("Slice", [f"{base}/shape", f"{base}/one", f"{base}/two"], [f"{base}/channels"]),
        make("Div", [f"{base}/channels", f"{base}/groups"], [out]),
    ]


def _weight_grad(
    base: str,
    source: str,
    grad: str,
    w: str,
    out: str,
    group: int,
    pads: list[int],
    strides: list[int],
    dilations: list[int],
) -> list[onnx.NodeProto]:
    """``out`` = the correlation of ``source`` with ``grad`` (a Conv's input and output
    gradient), group by group along the channels, cropped to ``w``'s shape."""
    spatial = len(strides)
    nodes = [
        _ints(f"{base}/zeros", [0] * (2 + spatial)),
        make("Shape", [w], [f"{base}/w_shape"]),
    ]
    if group == 1:
        part, full = _conv_weight_grad(base, source, grad, pads, strides, dilations)
        nodes += part
    else:
        nodes += _group_size(f"{base}/source", source, group, f"{base}/source_group")
        nodes += _group_size(f"{base}/grad", grad, group, f"{base}/grad_group")
        parts = []
        for g in range(group):
            gb = f"{base}/group{g}"
            nodes += _channel_slice(f"{gb}/s", source, f"{base}/source_group", g, f"{gb}/source")
            nodes += _channel_slice(f"{gb}/g", grad, f"{base}/grad_group", g, f"{gb}/grad")
            part, piece = _conv_weight_grad(
                gb, f"{gb}/source", f"{gb}/grad", pads, strides, dilations
            )
            nodes += part
            parts.append(piece)
        full = f"{base}/dw_full"
        nodes.append(make("Concat", parts, [full], axis=0))
    nodes.append(make("Slice", [full, f"{base}/zeros", f"{base}/w_shape"], [out]))
    return nodes


def _channel_slice(
    base: str, tensor: str, count: str, index: int, out: str, axis: int = 1
) -> list[onnx.NodeProto]:
    """``out`` = [index * count, (index + 1) * count) of ``tensor`` along ``axis``."""
    return [
        _ints(f"{base}/index", [index]),
        _ints(f"{base}/next", [index + 1]),
        _ints(f"{base}/axis", [axis]),
        make("Mul", [count, f"{base}/index"], [f"{base}/start"]),
        make("Mul", [count, f"{base}/next"], [f"{base}/end"]),
        make("Slice", [tensor, f"{base}/start", f"{base}/end", f"{base}/axis"], [out]),
    ]


def conv_grad(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """ConvGrad(dY, X, W) -> (dX, dW, dB) for explicit pads (``auto_pad`` NOTSET):

    * dB = sum of dY over every axis but the channels;
    * dW = Conv(X^T, dY^T) with strides and dilations swapped, cropped to W's size (^T
      swaps batch and channels): the correlation of the input with the output
      gradient, group by group (channel slices) when ``group`` > 1;
    * dX = ConvTranspose(dY, W) without padding, padded at the end by stride - 1 zeros
      (the output padding a stride that does not divide the input needs) and cropped to
      X's size from the leading pads.
    """
    geometry = _conv_geometry(node)
    if geometry is None:
        return None
    group, pads, strides, dilations = geometry
    spatial = len(strides)
    dx_out, dw_out, db_out = (list(node.output) + ["", "", ""])[:3]
    dy, x, w = node.input[0], node.input[1], node.input[2]
    base = _base(node)
    nodes = _bias_grad(base, dy, db_out, spatial)
    if dw_out:
        nodes += _weight_grad(f"{base}/dw", x, dy, w, dw_out, group, pads, strides, dilations)
    if dx_out:
        nodes += _input_by_conv_transpose(base, dy, x, w, dx_out, group, pads, strides, dilations)
    return nodes


def _input_by_conv_transpose(
    base: str,
    dy: str,
    x: str,
    w: str,
    dx_out: str,
    group: int,
    pads: list[int],
    strides: list[int],
    dilations: list[int],
) -> list[onnx.NodeProto]:
    """dX of ConvGrad: ConvTranspose(dY, W) without padding, padded at the end by
    stride - 1 zeros and cropped to X's size from the leading pads."""
    spatial = len(strides)
    nodes: list[onnx.NodeProto] = []
    end_pads = [0, 0] + [0] * spatial + [0, 0] + [s - 1 for s in strides]
    axes = list(range(2, 2 + spatial))
    # one ConvTranspose per group (onnx.reference has no grouped ConvTranspose)
    if group > 1:
        nodes += _group_size(f"{base}/dy", dy, group, f"{base}/o_group")
    parts = []
    for g in range(group):
        gb = f"{base}/dx_group{g}"
        dy_g, w_g = dy, w
        if group > 1:
            dy_g, w_g = f"{gb}/dy_part", f"{gb}/w_part"
            nodes += _channel_slice(f"{gb}/dy", dy, f"{base}/o_group", g, dy_g)
            nodes += _channel_slice(f"{gb}/w", w, f"{base}/o_group", g, w_g, axis=0)
        parts.append(f"{gb}/out")
        nodes.append(
            make(
                "ConvTranspose",
                [dy_g, w_g],
                [parts[-1]],
                strides=strides,
                dilations=dilations,
            )
        )
    if group > 1:
        nodes.append(make("Concat", parts, [f"{base}/dx_full"], axis=1))
    else:
        nodes.append(make("Identity", parts, [f"{base}/dx_full"]))
    nodes += [
        _ints(f"{base}/end_pads", end_pads),
        make("Pad", [f"{base}/dx_full", f"{base}/end_pads"], [f"{base}/dx_padded"]),
        make("Shape", [x], [f"{base}/x_dims"]),
        _ints(f"{base}/spatial_start", [2]),
        _ints(f"{base}/spatial_end", [2 + spatial]),
        make(
            "Slice",
            [f"{base}/x_dims", f"{base}/spatial_start", f"{base}/spatial_end"],
            [f"{base}/size"],
        ),
        _ints(f"{base}/begin", pads[:spatial]),
        make("Add", [f"{base}/begin", f"{base}/size"], [f"{base}/end"]),
        _ints(f"{base}/axes", axes),
        make(
            "Slice",
            [f"{base}/dx_padded", f"{base}/begin", f"{base}/end", f"{base}/axes"],
            [dx_out],
        ),
    ]
    return nodes


def conv_grad_on_cpu(
    node: onnx.NodeProto, shapes: dict[str, tuple[int, ...]]
) -> list[onnx.NodeProto] | None:
    """ConvGrad(dY, X, W) -> (dX, dW, dB) for a CPU session, its shapes static, in the
    forms of :mod:`graphkit.backends.conv_adjoints`: dW a product of patches, dX (stride
    1) a Conv of dY by the flipped weight, else :func:`conv_grad`'s ConvTranspose. None
    (the kernel stays) for a group, unknown shapes, or patches too large (then the
    kernel is faster than :func:`conv_grad`'s dW)."""
    geometry = _conv_geometry(node)
    if geometry is None:
        return None
    group, pads, strides, dilations = geometry
    dy, x, w = node.input[0], node.input[1], node.input[2]
    dx_out, dw_out, db_out = (list(node.output) + ["", "", ""])[:3]
    xs, ys, ws = shapes.get(x), shapes.get(dy), shapes.get(w)
    if group != 1 or xs is None or ys is None or ws is None:
        return None
    if dw_out and not conv_adjoints.patches_fit(xs[1], ws[2:], ys[2:]):
        return None
    base, spatial = _base(node), len(strides)
    nodes = _bias_grad(base, dy, db_out, spatial)
    if dw_out:
        nodes += _weight_by_patches(f"{base}/dw", x, dy, dw_out, xs, ys, ws, geometry)
    if dx_out:
        flipped = conv_adjoints.input_adjoint_pads(ws, group, strides, dilations, pads)
        if flipped is None:
            nodes += _input_by_conv_transpose(
                base, dy, x, w, dx_out, group, pads, strides, dilations
            )
        else:
            axes = list(range(2, 2 + spatial))
            nodes += [
                make("Transpose", [w], [f"{base}/w_t"], perm=[1, 0, *axes]),
                _ints(f"{base}/flip_starts", [-1] * spatial),
                _ints(f"{base}/flip_ends", [conv_adjoints.REVERSED_END] * spatial),
                _ints(f"{base}/flip_axes", axes),
                _ints(f"{base}/flip_steps", [-1] * spatial),
                make(
                    "Slice",
                    [
                        f"{base}/w_t",
                        f"{base}/flip_starts",
                        f"{base}/flip_ends",
                        f"{base}/flip_axes",
                        f"{base}/flip_steps",
                    ],
                    [f"{base}/w_flipped"],
                ),
                make(
                    "Conv", [dy, f"{base}/w_flipped"], [dx_out], dilations=dilations, pads=flipped
                ),
            ]
    return nodes


def _weight_by_patches(
    base: str,
    x: str,
    dy: str,
    out: str,
    xs: tuple[int, ...],
    ys: tuple[int, ...],
    ws: tuple[int, ...],
    geometry: tuple[int, list[int], list[int], list[int]],
) -> list[onnx.NodeProto]:
    """``out`` = dW as one batched product of patches, summed over the batch by a
    product with ones (onnxruntime's ReduceSum over a leading axis is the slower)."""
    _, pads, strides, dilations = geometry
    spatial = len(strides)
    batch, channels, outputs = xs[0], xs[1], ys[1]
    positions = math.prod(ys[2:])
    windows = conv_adjoints.patch_windows(ws[2:], ys[2:], strides, dilations)
    width = channels * len(windows)
    nodes = [
        _ints(f"{base}/axes", list(range(2, 2 + spatial))),
        _ints(f"{base}/steps", strides),
        _ints(f"{base}/two", [2]),
    ]
    padded = x
    if any(pads):
        padded = f"{base}/padded"
        nodes += [
            _ints(f"{base}/pads", [0, 0, *pads[:spatial], 0, 0, *pads[spatial:]]),
            make("Pad", [x, f"{base}/pads"], [padded]),
        ]
    pieces = []
    for i, (starts, ends) in enumerate(windows):
        pieces.append(f"{base}/piece{i}")
        nodes += [
            _ints(f"{base}/starts{i}", starts),
            _ints(f"{base}/ends{i}", ends),
            make(
                "Slice",
                [padded, f"{base}/starts{i}", f"{base}/ends{i}", f"{base}/axes", f"{base}/steps"],
                [f"{base}/patch{i}"],
            ),
            make("Unsqueeze", [f"{base}/patch{i}", f"{base}/two"], [pieces[-1]]),
        ]
    ones = helper.make_tensor(f"{base}/ones_value", TensorProto.FLOAT, [batch], [1.0] * batch)
    nodes += [
        make("Concat", pieces, [f"{base}/stacked"], axis=2),  # [N, C, K, out...]
        _ints(f"{base}/columns_shape", [batch, width, positions]),
        make("Reshape", [f"{base}/stacked", f"{base}/columns_shape"], [f"{base}/columns"]),
        make("Transpose", [f"{base}/columns"], [f"{base}/rows"], perm=[0, 2, 1]),
        _ints(f"{base}/dy_shape", [batch, outputs, positions]),
        make("Reshape", [dy, f"{base}/dy_shape"], [f"{base}/dy_flat"]),
        make("MatMul", [f"{base}/dy_flat", f"{base}/rows"], [f"{base}/product"]),
        _ints(f"{base}/per_sample", [batch, outputs * width]),
        make("Reshape", [f"{base}/product", f"{base}/per_sample"], [f"{base}/samples"]),
        make("Constant", [], [f"{base}/ones_float"], value=ones),
        make("CastLike", [f"{base}/ones_float", dy], [f"{base}/ones"]),
        make("MatMul", [f"{base}/ones", f"{base}/samples"], [f"{base}/summed"]),
        _ints(f"{base}/w_shape", list(ws)),
        make("Reshape", [f"{base}/summed", f"{base}/w_shape"], [out]),
    ]
    return nodes


LOWERINGS: dict[str, Lowering] = {
    "FusedMatMul": fused_matmul,
    "Scale": scale,
    "ReluGrad": relu_grad,
    "LeakyReluGrad": lambda n: relu_grad(n, float(_attrs(n).get("alpha", 0.01))),
    "SoftmaxGrad_13": lambda n: softmax_grad(n, log=False),
    "LogSoftmaxGrad_13": lambda n: softmax_grad(n, log=True),
    "SoftmaxGrad": softmax_grad_v1,
    "BroadcastGradientArgs": broadcast_gradient_args,
    "SigmoidGrad": sigmoid_grad,
    "TanhGrad": tanh_grad,
    "GeluGrad": gelu_grad,
    "FastGeluGrad": fast_gelu_grad,
    "ReduceSumTraining": reduce_sum_training,
    "GatherElementsGrad": gather_elements_grad,
    "GatherGrad": gather_grad,
    "SliceGrad": slice_grad,
    "ConvGrad": conv_grad,
    "ConvTransposeGrad": conv_transpose_grad,
    "DivGrad": div_grad,
    "LayerNormalizationGrad": layer_norm_grad,
}
"""com.microsoft operator -> its rewrite in standard operators."""

WITH_PRODUCERS: dict[str, Callable[..., list[onnx.NodeProto] | None]] = {
    "MaxPoolGrad": max_pool_grad,
}
"""Operators (onnxruntime places these in the default domain) whose rewrite reads the
node that produced one of their inputs."""

FLOAT32_ONLY = frozenset(
    {
        "FusedMatMul",
        "Scale",
        "ReluGrad",
        "LeakyReluGrad",
        "SoftmaxGrad_13",
        "LogSoftmaxGrad_13",
        "LayerNormalizationGrad",
    }
)
"""The operators onnxruntime-training implements for float32 only.

LayerNormalizationGrad has a kernel for float32 data and statistics only: with float64
data and float64 statistics its kernel fails at run time ("Tensor type mismatch"), and
with float32 statistics (a LayerNormalization's default ``stash_type``) onnxruntime
inlines the operator's function body, whose ``ReduceMean`` carries its axes as an
attribute, which a graph of opset 18 refuses ("Unrecognized attribute: axes for operator
ReduceMean")."""

SLOW_ON_CPU = frozenset(
    {"ReluGrad", "LeakyReluGrad", "GeluGrad", "FastGeluGrad", "LogSoftmaxGrad_13", "GatherGrad"}
)
"""The operators whose float32 CPU kernel is slower than their lowering, measured on
256x256 tensors with 2 threads (us, kernel -> lowering): ReluGrad 202 -> 44,
LeakyReluGrad 163 -> 45, GeluGrad 238 -> 139, FastGeluGrad 1171 -> 151,
LogSoftmaxGrad_13 163 -> 34 (SigmoidGrad, TanhGrad and SoftmaxGrad_13 kernels are the
faster). The lowerings of the last three differ from the kernels by an ulp or so.
GatherGrad (a ScatterND adding rows into zeros), measured where models use it: an
embedding table's gradient, [1000, 64] from [32, 16] ids, 1014 -> 75; the pick of q, k
or v from a fused projection, [32, 3, 4, 32, 16] at a scalar index, 2647 -> 155 (it made
a transformer encoder's full training 3x slower than its forward/backward training)."""

# ConvGrad is not in SLOW_ON_CPU: where its shapes are static (a specialized step), a CPU
# session runs conv_grad_on_cpu's forms instead, the kernel elsewhere (conv_grad's own
# weight gradient, a convolution by dY, is slower than the kernel's: 4948 us against 2082).

NO_CPU_KERNEL = frozenset({"ConvTransposeGrad"})
"""Gradient operators onnxruntime-training 1.19.2 emits but has no CPU kernel for, in
any element type: CPU sessions always run their lowering."""

SLOW_FROM = 4096
"""Elements from which a SLOW_ON_CPU kernel is slower than its lowering: below, the one
kernel call beats three (ReluGrad on 1000 elements: 3.1 us against 4.7; on 10,000: 11.6
against 10.0). Counted on the gradient: GatherGrad's third input, the others' second."""

RUNTIME_DOMAIN = "com.microsoft"
# gradient operators onnxruntime places in the default domain, which no other runtime has
INTERNAL_DEFAULT_DOMAIN = frozenset({"MaxPoolGrad", "AveragePoolGrad", "ConvGrad"})
# AveragePoolGrad reads the pooled input's shape from static graph dims; graphkit never
# produces it (prepare_for_training turns AveragePool into a Conv), so it stays refused.


STANDARD_DOMAINS = ("", "ai.onnx", "ai.onnx.ml")


def _is_standard(node: onnx.NodeProto) -> bool:
    if node.domain not in STANDARD_DOMAINS:
        return False
    return node.op_type not in INTERNAL_DEFAULT_DOMAIN


def _rewrite(model: onnx.ModelProto, choose: Callable[[onnx.NodeProto], bool]) -> list[str]:
    """Lower the chosen nodes in place; return the ones that could not be."""
    return _rewrite_graph(model.graph, choose, opset_of(model))


def _int_constants(graph: onnx.GraphProto) -> dict[str, list[int]]:
    """The integer values ``graph`` fixes (the axes a node may read from outside its
    replacement, as ReduceSumTraining does)."""
    return {
        name: [int(v) for v in tensor_value(t).ravel()]
        for name, t in constant_tensors(graph)
        if t.data_type in (TensorProto.INT64, TensorProto.INT32)
    }


def _for_opset(graph: onnx.GraphProto, opset: int | None) -> Callable[..., list[onnx.NodeProto]]:
    """Lowerings' nodes (opset 18's operators) -> the form ``opset`` takes in ``graph``."""
    if opset is None or opset >= 18:
        return list
    constants = _int_constants(graph)  # once per graph, for all its replacements
    return lambda nodes: axes_for_opset(nodes, opset, constants)


def _rewrite_graph(
    graph: onnx.GraphProto,
    choose: Callable[[onnx.NodeProto], bool],
    opset: int | None = None,
) -> list[str]:
    """Lower the chosen nodes of ``graph`` in place, for ``graph``'s ``ai.onnx`` opset
    (None: opset 18's form); return the ones that could not be."""
    producers = {out: n for n in graph.node for out in n.output if out}
    shapes = _float32_dims(graph) if any(n.op_type in WITH_PRODUCERS for n in graph.node) else {}
    chosen = [n for n in graph.node if choose(n)]
    for_opset = _for_opset(graph, opset) if chosen else list
    nodes: list[onnx.NodeProto] = []
    left = []
    for node in graph.node:
        replacement = None
        if choose(node):
            if node.domain == RUNTIME_DOMAIN and node.op_type in LOWERINGS:
                replacement = LOWERINGS[node.op_type](node)
            elif node.domain in ("", "ai.onnx") and node.op_type in WITH_PRODUCERS:
                replacement = WITH_PRODUCERS[node.op_type](node, producers, shapes)
            if replacement is None and not _is_standard(node):
                left.append(node)
        nodes.extend(for_opset(replacement) if replacement is not None else [node])
    del graph.node[:]
    graph.node.extend(nodes)
    return [f"{n.domain or 'ai.onnx'}:{n.op_type} (node {n.name!r})" for n in left]


def lower_float32_only_ops(model: onnx.ModelProto) -> None:
    """Rewrite the float32-only gradient operators of a float64 graph (in place)."""
    _rewrite(model, lambda node: node.op_type in FLOAT32_ONLY)


def _is_slow_on_cpu(node: onnx.NodeProto) -> bool:
    return node.domain == RUNTIME_DOMAIN and node.op_type in SLOW_ON_CPU


def _has_no_cpu_kernel(node: onnx.NodeProto) -> bool:
    return node.domain == RUNTIME_DOMAIN and node.op_type in NO_CPU_KERNEL


def _either(
    a: Callable[[onnx.NodeProto], bool], b: Callable[[onnx.NodeProto], bool]
) -> Callable[[onnx.NodeProto], bool]:
    """Chooses a node that ``a`` or ``b`` chooses."""
    return lambda node: a(node) or b(node)


def lower_slow_cpu_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` for a session on the CPU: the operators of :data:`NO_CPU_KERNEL` lowered
    always, those of :data:`SLOW_ON_CPU` where they are slow, ConvGrad as
    :func:`conv_grad_on_cpu` where its shapes are static, in every subgraph (a copy;
    ``model`` itself when there is nothing to lower).

    Slow kernels of float64 graphs are kept (their float32-only operators are lowered
    when they are built, and FastGeluGrad's float64 kernel is the faster), and so are
    those of graphs below opset 15 (the lowering casts its constants with CastLike).
    """
    nodes = [n for g in all_graphs(model.graph) for n in g.node]
    missing = any(_has_no_cpu_kernel(n) for n in nodes)
    slow = (
        (opset_of(model) or 0) >= 15
        and not is_float64(model)
        and any(_is_slow_on_cpu(n) or n.op_type in ("ConvGrad", "MaxPoolGrad") for n in nodes)
    )
    if not (missing or slow):
        return model
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    ranks = _ranks(_inferred(lowered)) if missing else {}
    opset = opset_of(lowered)
    # innermost first: rewriting a graph copies its nodes, subgraphs included
    for graph in reversed(list(all_graphs(lowered.graph))):
        _state_spatial_rank(graph, ranks)
        if slow:
            _lower_conv_grads(graph, opset)
            _lower_max_pool_grads(graph, opset)
        slow_here: Callable[[onnx.NodeProto], bool] = (
            _slow_here(graph) if slow else (lambda node: False)
        )
        _rewrite_graph(graph, _either(_has_no_cpu_kernel, slow_here), opset)
    return lowered


def _lower_conv_grads(graph: onnx.GraphProto, opset: int | None = None) -> None:
    """Each ConvGrad of ``graph`` whose shapes are static, as :func:`conv_grad_on_cpu`
    (where it applies), in place, in the form ``opset`` takes."""
    if not any(n.op_type == "ConvGrad" for n in graph.node):
        return
    for_opset = _for_opset(graph, opset)
    shapes = _static_dims(graph)
    shapes.update({t.name: tuple(t.dims) for t in graph.initializer})
    read = {name for n in graph.node for name in outer_reads(n)}
    read.update(o.name for o in graph.output)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        lowered = None
        if node.op_type == "ConvGrad" and node.domain in ("", RUNTIME_DOMAIN):
            wanted = onnx.NodeProto()
            wanted.CopyFrom(node)  # a gradient nothing reads is not computed
            wanted.output[:] = [o if o in read else "" for o in node.output]
            lowered = conv_grad_on_cpu(wanted, shapes)
        nodes.extend([node] if lowered is None else for_opset(lowered))
    del graph.node[:]
    graph.node.extend(nodes)


def _lower_max_pool_grads(graph: onnx.GraphProto, opset: int | None = None) -> None:
    """Each MaxPoolGrad of ``graph`` whose pooling's windows tile its input, as the
    ``MaxUnpool`` of :func:`max_pool_grad` (in place, in the form ``opset`` takes): the
    kernel takes 1151 us where MaxUnpool takes 131 (:mod:`graphkit.backends.pool_adjoints`);
    the others keep the kernel, which is about as fast as the scatter."""
    if not any(n.op_type == "MaxPoolGrad" for n in graph.node):
        return
    for_opset = _for_opset(graph, opset)
    shapes = _float32_dims(graph)
    producers = {out: n for n in graph.node for out in n.output if out}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        lowered = None
        pool = producers.get(node.input[1]) if node.op_type == "MaxPoolGrad" else None
        if pool is not None and pool.op_type == "MaxPool" and node.domain in ("", "ai.onnx"):
            if not _attrs(pool).get("storage_order", 0):
                lowered = _max_pool_grad_unpooled(node, pool, shapes.get(pool.input[0]))
        nodes.extend([node] if lowered is None else for_opset(lowered))
    del graph.node[:]
    graph.node.extend(nodes)


def _inferred(model: onnx.ModelProto) -> onnx.GraphProto:
    """``model``'s graph with the shapes onnx infers (operators it does not know, such as
    the gradient operators, are skipped); ``model``'s own graph if inference fails."""
    try:
        return onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # inference is a help here, never a requirement
        return model.graph


def _ranks(graph: onnx.GraphProto) -> dict[str, int]:
    """The rank of every tensor whose rank ``graph`` or one of its subgraphs states (a
    Scan body reads the weights of the graph around it)."""
    ranks = {}
    for sub in all_graphs(graph):
        ranks.update({t.name: len(t.dims) for t in sub.initializer})
        for value in (*sub.input, *sub.value_info, *sub.output):
            dims = static_shape(value)
            if dims is not None:
                ranks[value.name] = len(dims)
    return ranks


def _state_spatial_rank(graph: onnx.GraphProto, ranks: dict[str, int]) -> None:
    """Give each :data:`NO_CPU_KERNEL` node written with default attributes its
    ``strides`` (ones), read from its weight's rank, so that its lowering knows how many
    spatial axes it has."""
    for node in graph.node:
        if not _has_no_cpu_kernel(node) or len(node.input) < 3:
            continue
        given = {a.name for a in node.attribute}
        rank = ranks.get(node.input[2])
        if rank and rank > 2 and not given & {"strides", "pads", "dilations", "kernel_shape"}:
            node.attribute.append(helper.make_attribute("strides", [1] * (rank - 2)))


def _float32_dims(graph: onnx.GraphProto) -> dict[str, Dims]:
    """The shape of each float32 input, output and value_info of ``graph`` that declares
    one (a dim ``None`` or a name where it is not a number), and of the ``Identity`` of
    one (onnxruntime-training's builder reads each input through one). Float32 only:
    onnxruntime's ``MaxUnpool``, the one reader, has no other kernel."""
    shapes = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        dims = static_shape(value)
        if dims is not None and value.type.tensor_type.elem_type == TensorProto.FLOAT:
            shapes[value.name] = tuple(dims)
    for node in graph.node:
        if node.op_type == "Identity" and node.input[0] in shapes:
            shapes.setdefault(node.output[0], shapes[node.input[0]])
    return shapes


def _static_dims(graph: onnx.GraphProto) -> dict[str, tuple[int, ...]]:
    """The shape of each input, output and value_info of ``graph`` whose dims are all
    known."""
    shapes: dict[str, tuple[int, ...]] = {}
    for value in (*graph.input, *graph.value_info, *graph.output):
        dims = static_shape(value)
        known = [d for d in dims or () if isinstance(d, int)]
        if dims is not None and len(known) == len(dims):
            shapes[value.name] = tuple(known)
    return shapes


def _slow_here(graph: onnx.GraphProto) -> Callable[[onnx.NodeProto], bool]:
    """Whether a node of ``graph`` is slow on the CPU at its size: of SLOW_ON_CPU, on a
    tensor of unknown or at least ``SLOW_FROM`` elements (its second input, the
    activation, has the size of the gradient)."""
    sizes = {name: math.prod(dims) for name, dims in _static_dims(graph).items()}

    def slow(node: onnx.NodeProto) -> bool:
        if not _is_slow_on_cpu(node):
            return False
        # the input the size of the gradient: GatherGrad(shape, indices, dY) reads it third
        position = 2 if node.op_type == "GatherGrad" else 1
        size = sizes.get(node.input[position]) if len(node.input) > position else None
        return size is None or size >= SLOW_FROM

    return slow


def lower_to_standard(model: onnx.ModelProto) -> onnx.ModelProto:
    """Rewrite every non-standard operator of ``model`` (in place; returned) so that it
    runs on any ONNX runtime, and drop the opset imports it no longer uses.

    Raises:
        IncompatibleModelError: operators (or attribute combinations) the table does not
            know; the message lists all of them.
    """
    left = _rewrite(model, lambda node: not _is_standard(node))
    if left:
        raise IncompatibleModelError(
            f"Cannot lower {len(left)} operator(s) to standard ONNX: {'; '.join(left)}. "
            f"graphkit knows {sorted([*LOWERINGS, *WITH_PRODUCERS])} (see the conditions "
            "in graphkit.backends.ort_training.lowering)."
        )
    used = {n.domain for n in model.graph.node}
    keep = [o for o in model.opset_import if o.domain in ("", "ai.onnx") or o.domain in used]
    del model.opset_import[:]
    model.opset_import.extend(keep)
    return model
