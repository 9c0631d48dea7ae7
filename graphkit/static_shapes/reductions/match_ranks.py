"""Rule: a one-element operand of ``Add``, ``Sub``, ``Mul``, ``Div`` of a lower rank than
the other operand gets its rank.

onnxruntime broadcasts a lower-rank scalar over an ``(n, 1)`` tensor one element at a
time, 12 us for n = 1000 instead of 2.3. The values are the same: a one-element tensor
broadcasts alike at any rank up to the result's. A constant is reshaped once (a copy of
the rank wanted); a computed scalar by a Reshape before the node (about 1 us), from
:data:`RESHAPE_SCALARS_FROM` elements of the other operand."""

from __future__ import annotations

import math

import onnx

from graphkit.static_shapes.reductions.context import Context

ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div"})
"""The binary operators whose one-element operand takes the other's rank."""

RESHAPE_SCALARS_FROM = 64
"""Elements of the other operand from which a computed scalar is reshaped to its rank:
onnxruntime's element-by-element broadcast costs about 2 + 0.01 n us, the Reshape 1."""


def match_ranks(ctx: Context, node: onnx.NodeProto) -> list[onnx.NodeProto]:
    """Gives a one-element operand of ``node`` the other operand's rank (``node`` is
    changed in place); the nodes to place before ``node`` (a computed scalar's
    Reshape), else none."""
    before = []
    a, b = node.input
    for k, (one, other) in enumerate(((a, b), (b, a))):
        shape = ctx.shapes.get(one)
        if shape is None or math.prod(shape) != 1 or other not in ctx.shapes:
            continue
        rank = len(ctx.shapes[other])
        if len(shape) >= rank:
            continue
        key = (one, rank)
        if key not in ctx.ranked:
            if one in ctx.constants:
                ones = ctx.constants[one].reshape((1,) * rank)
                ctx.ranked[key] = ctx.constant(one, ones)
            elif math.prod(ctx.shapes[other]) >= RESHAPE_SCALARS_FROM:
                ctx.ranked[key] = ctx.fresh(f"{one}/rank{rank}")
                before.append(ctx.reshape(one, (1,) * rank, ctx.ranked[key]))
            else:
                continue
        node.input[k] = ctx.ranked[key]
    return before


__all__ = ["ELEMENTWISE", "RESHAPE_SCALARS_FROM", "match_ranks"]
