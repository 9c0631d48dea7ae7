"""Rule: ``Transpose(A @ B)`` (its last two axes swapped, the product read only there)
-> ``B^T A^T``.

Each operand's own Transpose cancels, or becomes a ``trans`` attribute (a Gemm, of
matrices), or a Transpose that onnxruntime runs inside its MatMul (batches: only where
one operand's cancels; two Transposes for one are not written). A weight stored as
[out, in] (torch's Linear) has the transpose of ``x^T dy`` for its gradient (it then
takes the Gemm rules too); attention's keys, the transpose of ``q^T d_scores``. The same
products: a transformer's native step, 5140 -> 4970 us a batch, 47 -> 25 Transposes in
the graph onnxruntime receives (with :mod:`.transposed_matmul`)."""

from __future__ import annotations

import onnx

from graphkit._graph import fresh_name
from graphkit.static_shapes.gemms.context import Context
from graphkit.static_shapes.shapes import STANDARD, last_two_swapped


def transposed_product(ctx: Context, index: int, node: onnx.NodeProto) -> onnx.NodeProto | None:
    """The node to write in place of ``node`` (at ``index``), None where it is not such
    a Transpose. New Transposes go to ``ctx.inserted`` before ``index``; the product
    to ``ctx.absorbed``."""
    inner = node.input[0] if node.op_type == "Transpose" else None
    if inner is None or ctx.swapped(node.output[0]) is None or inner in ctx.outputs:
        return None
    product = ctx.producer(inner)
    if product is None or product.op_type != "MatMul" or len(ctx.readers.get(inner, [])) != 1:
        return None
    ranks = [len(ctx.shapes.get(i, ())) for i in product.input]
    if product.domain not in STANDARD or min(ranks) < 2:
        return None
    a, b = product.input
    a0, b0 = ctx.swapped(a), ctx.swapped(b)
    if ranks == [2, 2]:
        ctx.absorbed.add(ctx.position[inner])
        return onnx.helper.make_node(
            "Gemm",
            [b0 or b, a0 or a],
            list(node.output),
            name=node.name,
            transA=int(b0 is None),
            transB=int(a0 is None),
        )
    if a0 is None and b0 is None:
        return None  # two Transposes for one
    operands = []
    for x, x0, rank in ((b, b0, ranks[1]), (a, a0, ranks[0])):
        if x0 is None:
            x0 = fresh_name(f"{x}/t", ctx.taken)
            ctx.inserted.setdefault(index, []).append(
                onnx.helper.make_node("Transpose", [x], [x0], perm=last_two_swapped(rank))
            )
        operands.append(x0)
    ctx.absorbed.add(ctx.position[inner])
    return onnx.helper.make_node("MatMul", operands, list(node.output), name=node.name)


__all__ = ["transposed_product"]
