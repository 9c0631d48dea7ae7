"""Rule: ``Reshape(x, s) -> x`` where ``x`` already has the shape ``s`` (a bias
flattened to the shape it has).

A Reshape moves no data: the values are the same, a kernel fewer."""

from __future__ import annotations

import onnx

from graphkit.static_shapes.reductions.context import Context


def reshape_to_own_shape(ctx: Context, node: onnx.NodeProto) -> str | None:
    """The input of a Reshape to the shape it already has, else None."""
    if node.op_type != "Reshape":
        return None
    x = node.input[0]
    if x in ctx.shapes and ctx.shapes.get(node.output[0]) == ctx.shapes[x]:
        return x
    return None


__all__ = ["reshape_to_own_shape"]
