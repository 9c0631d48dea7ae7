"""Rule: ``ReduceSum(a * a)`` (a full sum, the squared error's loss), or the full sum of a
``Reshape`` of ``a * a`` -> ``ReduceSumSquare(a)``.

One kernel instead of two, the same formula. Only where nothing else reads the product
(nor the Reshapes)."""

from __future__ import annotations

import onnx

from graphkit.static_shapes.kernels.context import Context, full_sum


def sum_of_squares(ctx: Context, node: onnx.NodeProto) -> bool:
    """Rewrites ``node`` in place as ``ReduceSumSquare`` if it is such a sum; whether it
    did."""
    if not full_sum(node):
        return False
    source, views = node.input[0], []
    view = ctx.producer.get(source)
    while view is not None and view.op_type == "Reshape" and ctx.reads.get(source) == 1:
        views.append(view)  # a full sum reads through Reshapes
        source = view.input[0]
        view = ctx.producer.get(source)
    square = ctx.only_mul(source)
    if square is None or square.input[0] != square.input[1]:
        return False
    ctx.dropped.update(map(id, [square, *views]))
    node.CopyFrom(
        onnx.helper.make_node("ReduceSumSquare", [square.input[0]], list(node.output), keepdims=0)
    )
    return True


__all__ = ["sum_of_squares"]
