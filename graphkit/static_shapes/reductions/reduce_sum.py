"""Rule: a ``ReduceSum`` whose shapes are known -> what onnxruntime runs fastest.

* a sum over axes of size 1: a ``Reshape`` (nothing to add up);
* every kept axis of size 1: a full reduction (onnxruntime's fast path), reshaped;
* a leading block of axes, in floating point: ``ones @ X`` (X as a matrix), first tried
  as :mod:`.summed_product`; a trailing block: ``X @ ones``, the ones a column
  (onnxruntime's MatMul by a 1-D right operand takes a slow path: 430 us for
  [4096, 32] @ [32], 9.5 for @ [32, 1], 11.7 for its ReduceSum). onnxruntime's ReduceSum
  over the batch axis of a 256x256 tensor takes 40 us, the MatMul 5 us: it is every bias
  gradient;
* empty axes with ``noop_with_empty_axes``: an ``Identity``.

The sums are the same up to float rounding (a MatMul adds in another order). Other
reductions (middle axes, integers, unknown shapes) are kept."""

from __future__ import annotations

import numpy as np
import onnx

from graphkit.static_shapes.reductions.context import Context
from graphkit.static_shapes.reductions.summed_product import summed_product
from graphkit.static_shapes.shapes import reduce_axes


def is_block(axes: list[int], rank: int) -> bool:
    """Whether sorted ``axes`` are the first or the last few axes, not all of them."""
    contiguous = axes == list(range(axes[0], axes[0] + len(axes)))
    return contiguous and len(axes) < rank and (axes[0] == 0 or axes[-1] == rank - 1)


def reduce_sum(ctx: Context, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """The nodes replacing one ReduceSum, or None to keep it."""
    x, y = node.input[0], node.output[0]
    noop = any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute)
    axes = reduce_axes(node, ctx.constants)
    if axes is None or x not in ctx.shapes or y not in ctx.shapes:
        return None
    shape, out_shape = ctx.shapes[x], ctx.shapes[y]
    if not axes:
        return [onnx.helper.make_node("Identity", [x], [y])] if noop else None
    rank = len(shape)
    axes = sorted({a % rank for a in axes})
    summed = int(np.prod([shape[a] for a in axes]))
    kept = int(np.prod([d for i, d in enumerate(shape) if i not in axes]))
    if summed == 1:  # nothing to add up
        return [ctx.reshape(x, out_shape, y)]
    if kept == 1:  # everything is added up: onnxruntime's fast full reduction
        if not out_shape:
            return [onnx.helper.make_node("ReduceSum", [x], [y], keepdims=0)]
        total = ctx.fresh(f"{y}/total")
        full = onnx.helper.make_node("ReduceSum", [x], [total], keepdims=0)
        return [full, ctx.reshape(total, out_shape, y)]
    elem = ctx.elem.get(x)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else None
    if dtype not in (np.float32, np.float64) or not is_block(axes, rank):
        return None
    if axes[0] == 0:
        batched = summed_product(ctx, x, summed, out_shape, y)
        if batched is not None:
            return batched
    # a block of leading axes: ones @ X; of trailing axes: X @ ones, the ones a column
    leading = axes[0] == 0
    ones = ctx.constant(f"{y}/ones", np.ones(summed if leading else (summed, 1), dtype))
    nodes = []
    matrix = x
    if rank != 2:
        matrix = ctx.fresh(f"{y}/matrix")
        nodes.append(ctx.reshape(x, (summed, kept) if leading else (kept, summed), matrix))
    product = y if leading and tuple(out_shape) == (kept,) else ctx.fresh(f"{y}/sums")
    factors = [ones, matrix] if leading else [matrix, ones]
    nodes.append(onnx.helper.make_node("MatMul", factors, [product]))
    if product != y:
        nodes.append(ctx.reshape(product, out_shape, y))
    return nodes


__all__ = ["is_block", "reduce_sum"]
