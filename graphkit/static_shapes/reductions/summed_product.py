"""Rule: ``ReduceSum(MatMul(Transpose(x), dy), axes=[0])`` (the sum over the batch of a
batched ``x^T dy``: a weight's gradient where the weight multiplies a [B, S, in] input)
-> ``X^T DY``, one product of the batch laid end to end (X = x as [B S, in], DY = dy as
[B S, out]).

The same sum (added in another order): one matrix product instead of B small ones and
the sum of their results, a transformer's [32, 128, 64] feed-forward gradient: 96 us a
call against 116. Not where the batched product is read elsewhere too (it is computed
anyway)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import onnx

from graphkit.static_shapes.reductions.context import Context
from graphkit.static_shapes.shapes import STANDARD, last_two_swapped, transpose_perm


def summed_product(
    ctx: Context, x: str, batch: int, out_shape: Sequence[int], y: str
) -> list[onnx.NodeProto] | None:
    """The nodes computing ``y``, the sum over the leading ``batch`` elements of ``x``,
    as one product (see the module docstring); None where ``x`` is not such a product.
    The batched product and its Transpose become :attr:`Context.orphans`."""
    name = ctx.views.get(x, x)
    while True:  # through the views of the product
        if ctx.reads.get(name) != 1:
            return None  # read elsewhere too: the product is computed anyway
        node = ctx.producer.get(name)
        if node is None or node.op_type != "Reshape":
            break
        name = node.input[0]
    if node is None or node.op_type != "MatMul" or node.domain not in STANDARD:
        return None
    a, b = node.input
    transpose = ctx.producer.get(a)
    product, left, right = (ctx.shapes.get(name) for name in (node.output[0], a, b))
    if transpose is None or transpose.op_type != "Transpose":
        return None
    if product is None or left is None or right is None:
        return None
    rank = len(product)
    if rank < 3 or transpose_perm(transpose, rank) != last_two_swapped(rank):
        return None
    if not (left[:-2] == right[:-2] == product[:-2]) or math.prod(product[:-2]) != batch:
        return None
    rows, columns = batch * right[-2], (left[-2], right[-1])
    xt, x2, dy2 = (ctx.fresh(f"{y}/{stem}") for stem in ("rows", "rows_t", "dy_rows"))
    result = ctx.fresh(f"{y}/product") if tuple(out_shape) != columns else y
    nodes = [
        ctx.reshape(transpose.input[0], (rows, columns[0]), xt),
        onnx.helper.make_node("Transpose", [xt], [x2], perm=[1, 0]),
        ctx.reshape(b, (rows, columns[1]), dy2),
        onnx.helper.make_node("MatMul", [x2, dy2], [result]),
    ]
    ctx.shapes.update({xt: (rows, columns[0]), x2: (columns[0], rows)})
    ctx.shapes.update({dy2: (rows, columns[1]), result: columns})
    if result != y:
        nodes.append(ctx.reshape(result, out_shape, y))
    ctx.orphans += [node, transpose]
    return nodes


__all__ = ["summed_product"]
