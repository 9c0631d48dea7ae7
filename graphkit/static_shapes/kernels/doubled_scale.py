"""Rule: ``Sum(x, x)`` with ``x = a * c`` (``c`` a floating-point constant that broadcasts
``a`` to no larger shape) -> ``a * 2c``.

A squared error's gradient, ``d (d * d) = d dy + d dy``: one kernel instead of two, and
doubling is exact, so the values are the same. Only where nothing else reads ``x``."""

from __future__ import annotations

import onnx
from onnx import numpy_helper

from graphkit._graph import fresh_name
from graphkit.static_shapes.kernels.context import Context


def doubled_scale(ctx: Context, node: onnx.NodeProto) -> bool:
    """Rewrites the Sum ``node`` in place as ``a * 2c`` (``2c`` a new initializer) if it
    is such a sum; whether it did."""
    if node.op_type != "Sum" or len(node.input) != 2 or node.input[0] != node.input[1]:
        return False
    scaled = ctx.only_mul(node.input[0])
    for c, a in (scaled.input, reversed(scaled.input)) if scaled is not None else ():
        value = ctx.constants.get(c)
        if value is None or value.dtype.kind != "f" or c == a:
            continue
        if a not in ctx.shapes or ctx.shapes.get(a) != ctx.shapes.get(node.output[0]):
            continue  # c broadcasts a to a larger shape: keep the Mul
        twice = fresh_name(f"{c}/twice", ctx.taken)
        doubled = (value * 2).astype(value.dtype)
        ctx.graph.initializer.append(numpy_helper.from_array(doubled, twice))
        ctx.dropped.add(id(scaled))
        node.CopyFrom(onnx.helper.make_node("Mul", [a, twice], list(node.output)))
        return True
    return False


__all__ = ["doubled_scale"]
