"""Rule: a ``Transpose`` or a reduction (``ReduceSum``, ``ReduceMean``...) of a tensor
with axes of size 1 runs on the tensor without them, between two ``Reshape``:
``op(x) -> Reshape(op'(Reshape(x)))``.

The axes of size 1 are a gradient source's seed axis (``[N, C, H, W, 1]``); those a
reduction reduces stay. onnxruntime's kernels take a slow path for such shapes, 50x for
a Transpose of ``[64, 16, 28, 28, 1]`` (2930 us against 58), 35x for a ReduceSum over the
softmax axis of ``[32, 4, 32, 32, 1]`` (400 us against 11.5); at any size, as the slow
path costs microseconds even on a [32, 10, 1] reduction (a softmax classifier's step:
19.9 -> 15.5 us), more than the Reshapes (0.3 us each, and most cancel against their
neighbours'). The values are the same: only the shape the kernel sees changes, and a
Reshape moves no data."""

from __future__ import annotations

import numpy as np
import onnx

from graphkit.static_shapes.reductions.context import Context
from graphkit.static_shapes.shapes import reduce_axes, transpose_perm


def squeeze_units(ctx: Context, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """``node`` (a Transpose or a reduction) on its input without its axes of size 1:
    ``[Reshape, op, Reshape]``, or one Reshape for a Transpose that only moved those
    axes. None to keep the node: no such axis, or a ReduceSum that sums every axis of
    size > 1 (:func:`.reduce_sum.reduce_sum`'s full reduction)."""
    x, y = node.input[0], node.output[0]
    shape, out_shape = ctx.shapes.get(x), ctx.shapes.get(y)
    if shape is None or out_shape is None:
        return None
    rank = len(shape)
    changed = onnx.NodeProto()
    changed.CopyFrom(node)
    if node.op_type == "Transpose":
        perm = transpose_perm(node, rank)
        kept = [a for a in range(rank) if shape[a] != 1]
        if len(kept) == rank:
            return None
        moved = [kept.index(p) for p in perm if shape[p] != 1]
        if moved == sorted(moved):  # only the axes of size 1 moved
            return [ctx.reshape(x, out_shape, y)]
        del changed.attribute[:]
        changed.attribute.append(onnx.helper.make_attribute("perm", moved))
        inner_shape = tuple(shape[kept[p]] for p in moved)
    else:
        axes = reduce_axes(node, ctx.constants)
        if not axes:  # all axes, or an identity: nothing to squeeze
            return None
        axes = sorted({a % rank for a in axes})
        kept = [a for a in range(rank) if shape[a] != 1 or a in axes]
        if len(kept) == rank:
            return None
        if node.op_type == "ReduceSum" and all(shape[a] == 1 for a in kept if a not in axes):
            return None  # a full reduction, reduce_sum's fast path
        squeezed_axes = [kept.index(a) for a in axes]
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        inner_shape = tuple(
            1 if i in squeezed_axes else shape[a]
            for i, a in enumerate(kept)
            if keepdims or i not in squeezed_axes
        )
        if len(node.input) > 1 and node.input[1]:
            changed.input[1] = ctx.constant(f"{y}/axes", np.array(squeezed_axes, dtype=np.int64))
        else:
            for attribute in changed.attribute:
                if attribute.name == "axes":
                    attribute.ints[:] = squeezed_axes
    squeezed, result = ctx.fresh(f"{x}/squeezed"), ctx.fresh(f"{y}/squeezed")
    ctx.views[squeezed] = x
    changed.input[0], changed.output[0] = squeezed, result
    ctx.shapes[squeezed] = tuple(shape[a] for a in kept)
    ctx.shapes[result] = inner_shape
    if x in ctx.elem:
        ctx.elem[squeezed] = ctx.elem[x]
    return [
        ctx.reshape(x, ctx.shapes[squeezed], squeezed),
        changed,
        ctx.reshape(result, out_shape, y),
    ]


__all__ = ["squeeze_units"]
