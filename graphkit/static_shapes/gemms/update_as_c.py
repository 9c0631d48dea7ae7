"""Rule: ``W + Gemm(A, B)`` (a Gemm without ``C``, the sum of W's shape: an SGD update)
-> ``Gemm(A, B, C=W, beta=1)``.

The same formula in one kernel (see :mod:`graphkit.static_shapes.gemms`). Not where the
product is read elsewhere, nor where the sum broadcasts, nor for a one-column product of
a large operand (:data:`.context.GEMV_FUSED_UP_TO`)."""

from __future__ import annotations

import onnx

from graphkit.static_shapes.gemms.context import Context


def update_as_c(ctx: Context, index: int, node: onnx.NodeProto) -> bool:
    """Rewrites the Add ``node`` (at ``index``) in place as the Gemm with ``C``;
    whether it did."""
    if node.op_type != "Add":
        return False
    for weight, inner in (node.input, reversed(node.input)):
        gemm = ctx.plain_gemm(inner)
        shape = ctx.shapes.get(weight)
        if gemm is None or shape is None:
            continue
        if not shape == ctx.shapes.get(node.output[0]) == ctx.shapes.get(inner):
            continue
        ctx.take_over(index, inner, [*gemm.input, weight], beta=1.0)
        return True
    return False


__all__ = ["update_as_c"]
