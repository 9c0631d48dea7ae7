"""Rule: ``W + s * ScatterND(zeros, I, U, add)`` -> ``ScatterND(W, I, s * U, add)``, and
``W + s * GatherGrad(shape, I, dY)`` -> ``ScatterND(W, Unsqueeze(I, -1), s * dY, add)``.

The gradient of a ``Gather`` (an embedding lookup) is zero but for the rows it read: the
native backend writes it as a scatter-add into a zero tensor of the table's shape
(``ConstantOfShape``), which SGD then scales by ``-lr`` and adds to the table. For a
table of gigabytes that is three table-sized tensors per step (the zeros, onnxruntime
folds into a constant of every session; the gradient; its scaled copy), for a few rows
changed. Scattering the scaled rows into the table itself computes
``W[i] + s * (U_1 + U_2 ...)`` as ``(W[i] + s * U_1) + s * U_2 ...``: equal but for the
rounding order where a row is read several times (within 1 ulp per repeat, as torch's
sparse embedding gradients). A unit axis the gradient squeezes after the scatter (the
native backend's seed axis) is squeezed from ``U`` instead. onnxruntime-training writes
the same gradient as one ``com.microsoft.GatherGrad`` (axis 0, int64 indices).

Only where ``s`` holds one value, every intermediate has no other reader and the zeros'
shape is the table's (with the squeezed unit axes)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import fresh_name
from graphkit.static_shapes.kernels.context import Context
from graphkit.static_shapes.shapes import STANDARD


def sparse_row_update(ctx: Context, node: onnx.NodeProto) -> bool:
    """Rewrites the ``Add`` ``node`` in place as a scatter-add into the table (see the
    module docstring) when it is such an update; whether it did."""
    if node.op_type != "Add" or len(node.input) != 2:
        return False
    for table, scaled_name in (node.input, reversed(node.input)):
        scaled = ctx.only_mul(scaled_name)
        if scaled is None or table == scaled_name:
            continue
        for gradient, scale in (scaled.input, reversed(scaled.input)):
            if _rewrite(ctx, node, table, scaled, gradient, scale):
                return True
    return False


def _rewrite(
    ctx: Context,
    node: onnx.NodeProto,
    table: str,
    scaled: onnx.NodeProto,
    gradient: str,
    scale: str,
) -> bool:
    shape, scale_shape = ctx.shapes.get(table), ctx.shapes.get(scale)
    if shape is None or scale_shape is None or int(np.prod(scale_shape)) != 1:
        return False
    if len(scale_shape) > len(shape):
        return False  # the product would have a larger rank than the table
    if _gather_grad(ctx, node, table, scaled, gradient, scale, shape):
        return True
    if ctx.shapes.get(gradient) != shape or ctx.shapes.get(node.output[0]) != shape:
        return False
    squeeze = _only(ctx, gradient, "Squeeze")
    scatter_name = squeeze.input[0] if squeeze is not None else gradient
    scatter = _only(ctx, scatter_name, "ScatterND")
    if scatter is None or _reduction(scatter) != "add":
        return False
    zeros_name, indices, updates = scatter.input
    zeros = _only(ctx, zeros_name, "ConstantOfShape")
    if zeros is None or not _is_zero(zeros):
        return False
    data_shape = ctx.shapes.get(zeros_name)
    index_shape = ctx.shapes.get(indices)
    if data_shape is None or index_shape is None or not index_shape:
        return False
    depth, rows = index_shape[-1], len(index_shape) - 1
    axes = _axes(ctx, squeeze, len(data_shape))
    if axes is None or any(a < depth or data_shape[a] != 1 for a in axes):
        return False  # a Squeeze of indexed axes, or of axes not known
    if tuple(d for a, d in enumerate(data_shape) if a not in axes) != tuple(shape):
        return False
    source = updates
    if squeeze is not None:  # the Squeeze, moved onto the updates (the same axes of them)
        axes_name = fresh_name(f"{squeeze.output[0]}/row_axes", ctx.taken)
        row_axes = np.array([rows + a - depth for a in axes], np.int64)
        ctx.graph.initializer.append(numpy_helper.from_array(row_axes, axes_name))
        source = fresh_name(f"{squeeze.output[0]}/rows", ctx.taken)
        squeeze.CopyFrom(
            helper.make_node("Squeeze", [updates, axes_name], [source], name=squeeze.name)
        )
    _scatter_scaled(ctx, node, scaled, table, indices, source, scale)
    ctx.dropped.update({id(scatter), id(zeros)})
    return True


def _gather_grad(
    ctx: Context,
    node: onnx.NodeProto,
    table: str,
    scaled: onnx.NodeProto,
    gradient: str,
    scale: str,
    shape: tuple[int, ...],
) -> bool:
    """onnxruntime-training's form: ``W + s * GatherGrad(shape, I, dY)`` (axis 0) ->
    ``ScatterND(W, Unsqueeze(I, -1), s * dY, add)``, the GatherGrad rewritten in place
    as the Unsqueeze."""
    grad = ctx.producer.get(gradient)
    if grad is None or grad.op_type != "GatherGrad" or grad.domain != "com.microsoft":
        return False
    axis = next((a.i for a in grad.attribute if a.name == "axis"), 0)
    if axis != 0 or ctx.reads.get(gradient) != 1 or len(grad.input) != 3:
        return False
    declared = ctx.constants.get(grad.input[0])
    if declared is None or tuple(int(d) for d in declared.ravel()) != tuple(shape):
        return False
    indices, rows = grad.input[1], grad.input[2]
    index_shape = ctx.shapes.get(indices)
    if index_shape is None or ctx.shapes.get(rows) != (*index_shape, *shape[1:]):
        return False
    if _elem_type(ctx, indices) != onnx.TensorProto.INT64:
        return False  # ScatterND takes int64 indices only
    axes_name = fresh_name(f"{gradient}/index_axis", ctx.taken)
    ctx.graph.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), axes_name))
    unsqueezed = fresh_name(f"{gradient}/indices", ctx.taken)
    grad.CopyFrom(helper.make_node("Unsqueeze", [indices, axes_name], [unsqueezed], name=grad.name))
    _scatter_scaled(ctx, node, scaled, table, unsqueezed, rows, scale)
    return True


def _scatter_scaled(
    ctx: Context,
    node: onnx.NodeProto,
    scaled: onnx.NodeProto,
    table: str,
    indices: str,
    rows: str,
    scale: str,
) -> None:
    """The ``Mul`` ``scaled`` rewritten as ``rows * scale`` and the ``Add`` ``node`` as
    ``ScatterND(table, indices, rows * scale, add)``, in place."""
    rows_scaled = fresh_name(f"{scaled.output[0]}/rows", ctx.taken)
    scaled.CopyFrom(helper.make_node("Mul", [rows, scale], [rows_scaled], name=scaled.name))
    node.CopyFrom(
        helper.make_node(
            "ScatterND",
            [table, indices, rows_scaled],
            list(node.output),
            name=node.name,
            reduction="add",
        )
    )


def _elem_type(ctx: Context, name: str) -> int | None:
    """The declared element type of ``name`` (a graph input, a typed value or an
    initializer), None if not declared."""
    graph = ctx.graph
    for value in [*graph.input, *graph.value_info]:
        if value.name == name:
            return value.type.tensor_type.elem_type
    return next((t.data_type for t in graph.initializer if t.name == name), None)


def _only(ctx: Context, name: str, op_type: str) -> onnx.NodeProto | None:
    """The standard ``op_type`` node producing ``name`` if nothing else reads ``name``."""
    node = ctx.producer.get(name)
    if node is None or node.op_type != op_type or node.domain not in STANDARD:
        return None
    return node if ctx.reads.get(name) == 1 else None


def _reduction(node: onnx.NodeProto) -> str:
    for attribute in node.attribute:
        if attribute.name == "reduction":
            return attribute.s.decode()
    return "none"


def _is_zero(node: onnx.NodeProto) -> bool:
    """Whether the ConstantOfShape ``node`` fills with zero (its default)."""
    for attribute in node.attribute:
        if attribute.name == "value":
            return not numpy_helper.to_array(attribute.t).any()
    return True


def _axes(ctx: Context, node: onnx.NodeProto | None, rank: int) -> list[int] | None:
    """The constant, non-negative axes of the Squeeze ``node`` (None: not constant)."""
    if node is None:
        return []
    if len(node.input) < 2 or node.input[1] not in ctx.constants:
        return None
    return sorted(int(a) % rank for a in ctx.constants[node.input[1]].ravel())


__all__ = ["sparse_row_update"]
