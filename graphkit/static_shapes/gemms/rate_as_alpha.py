"""Rule: ``Gemm(A, B) * lr`` (a Gemm without ``C``, times a scalar constant that float32
holds exactly: the learning rate) -> ``Gemm(A, B, alpha=alpha * lr)``.

The same formula in one kernel (see :mod:`graphkit.static_shapes.gemms`). Not where the
product is read elsewhere, nor where ``lr`` broadcasts it to a larger shape, nor for a
one-column product of a large operand (:data:`.context.GEMV_FUSED_UP_TO`)."""

from __future__ import annotations

import onnx

from graphkit.static_shapes.gemms.context import Context


def rate_as_alpha(ctx: Context, index: int, node: onnx.NodeProto) -> bool:
    """Rewrites the Mul ``node`` (at ``index``) in place as the scaled Gemm; whether it
    did."""
    if node.op_type != "Mul":
        return False
    for inner, scale in (node.input, reversed(node.input)):
        gemm, value = ctx.plain_gemm(inner), ctx.rate(scale)
        if gemm is None or value is None:
            continue
        if ctx.shapes.get(node.output[0]) != ctx.shapes.get(inner):
            continue
        alpha = float(next((a.f for a in gemm.attribute if a.name == "alpha"), 1.0))
        ctx.take_over(index, inner, list(gemm.input), alpha=alpha * value)
        return True
    return False


__all__ = ["rate_as_alpha"]
