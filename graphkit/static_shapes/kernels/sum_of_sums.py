"""Rule: the full sum of partial sums, ``ReduceSum(MatMul(m, ones))`` (or ``ones @ m``),
through ``Reshape`` and ``Neg`` -> ``ReduceSum(m)``, negated as often.

A classification loss's per-sample sums, summed: the same sum in another order, the
MatMul and its views gone. Only where each node of the chain has no other reader, and
the ones are a vector or a column (every element of ``m`` summed once)."""

from __future__ import annotations

import numpy as np
import onnx

from graphkit._graph import fresh_name
from graphkit.static_shapes.kernels.context import Context, full_sum
from graphkit.static_shapes.shapes import STANDARD


def sum_of_sums(ctx: Context, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    """``node`` changed in place into the full sum of ``m``, and the nodes to place after
    it (a ``Neg`` where the chain negated an odd number of times); None where ``node``
    is not such a sum (unchanged)."""
    if not full_sum(node):
        return None
    chain, source = [], node.input[0]
    while ctx.reads.get(source) == 1 and source in ctx.producer:
        inner = ctx.producer[source]
        if inner.op_type not in ("Reshape", "Neg") or inner.domain not in STANDARD:
            break
        chain.append(inner)
        source = inner.input[0]
    product = ctx.producer.get(source)
    if product is None or product.op_type != "MatMul" or ctx.reads.get(source) != 1:
        return None
    m = None
    for ones, other in (product.input, reversed(product.input)):
        value = ctx.constants.get(ones)
        if value is not None and value.ndim in (1, 2) and np.all(value == 1):
            m = other if value.ndim == 2 and value.shape[1] == 1 or value.ndim == 1 else None
            break
    if m is None or len(ctx.shapes.get(m, ())) < 1:
        return None
    negated = sum(n.op_type == "Neg" for n in chain) % 2 == 1
    ctx.dropped.update(map(id, [product, *chain]))
    result = node.output[0]
    total = fresh_name(f"{result}/total", ctx.taken) if negated else result
    node.CopyFrom(onnx.helper.make_node("ReduceSum", [m], [total], keepdims=0))
    return [onnx.helper.make_node("Neg", [total], [result])] if negated else []


__all__ = ["sum_of_sums"]
