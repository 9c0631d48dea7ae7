"""Rule: ``x * 1 -> x``, where the constant factor is all ones (floating point) and the
product has ``x``'s shape (the ones broadcast nothing).

Multiplying by one is exact: the values are the same. A graph output is kept (its name
must stay computed)."""

from __future__ import annotations

import numpy as np
import onnx

from graphkit.static_shapes.reductions.context import Context


def times_ones(ctx: Context, node: onnx.NodeProto) -> str | None:
    """The other factor of ``x * 1`` when the product has x's shape, else None."""
    if node.op_type != "Mul":
        return None
    for one, x in (node.input, reversed(node.input)):
        value = ctx.constants.get(one)
        if (
            value is not None
            and value.dtype.kind == "f"
            and np.all(value == 1)
            and x in ctx.shapes
            and ctx.shapes.get(node.output[0]) == ctx.shapes[x]
        ):
            return x
    return None


__all__ = ["times_ones"]
