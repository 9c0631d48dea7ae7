"""Rule: ``MatMul(Transpose(A), B)`` (or ``A @ Transpose(B)``) of matrices, that a
learning rate scales, that has one column, or more than :data:`GEMM_ABOVE` elements ->
``Gemm(A, B, transA=1)`` (``transB``).

A weight's gradient, ``x^T dy``: onnxruntime's ``FusedMatMul`` with a transposed operand
takes 0.5 us on 10 x 10, its Gemm 0.33 (and the Gemm then takes the rate and the update:
:mod:`.rate_as_alpha`, :mod:`.update_as_c`); on large products the Gemm is faster, see
:data:`GEMM_ABOVE`; elsewhere the two are level and the FusedMatMul stays. The same
product."""

from __future__ import annotations

import math

import onnx

from graphkit.static_shapes.gemms.context import Context

GEMM_ABOVE = 65536
"""Elements of a product of matrices with a transposed operand above which it runs as a
``Gemm`` with a ``trans`` attribute rather than onnxruntime's ``FusedMatMul`` (what its
optimizer makes of ``MatMul(Transpose(A), B)``). In a Scan, us a product, FusedMatMul
against Gemm: 256 x 256 from 256 rows 116.5 / 115.6; 300 x 300 from 128, 95.3 / 87.5;
512 x 512 from 128, 264.8 / 212.6; 784 x 512 from 128 (the MLP 784-512-512-10's first
weight's gradient), 408.7 / 347.2; a transposed right operand, 512 x 512 from 128,
237.4 / 185.4. On 10 x 10 the FusedMatMul is faster (0.7 / 1.1)."""


def scaled(ctx: Context, name: str) -> bool:
    """Whether the one reader of ``name`` multiplies it by a rate Gemm can hold."""
    found = ctx.readers.get(name, [])
    if len(found) != 1 or found[0].op_type != "Mul" or name in ctx.outputs:
        return False
    return any(ctx.rate(i) is not None for i in found[0].input if i != name)


def transposed_matmul(ctx: Context, node: onnx.NodeProto) -> bool:
    """Rewrites the MatMul ``node`` in place as such a Gemm; whether it did."""
    if node.op_type != "MatMul" or not all(len(ctx.shapes.get(i, ())) == 2 for i in node.input):
        return False
    a, b = (ctx.transposed(i) for i in node.input)
    out = ctx.shapes.get(node.output[0], ())
    if (a is None and b is None) or not (
        out[-1:] == (1,) or scaled(ctx, node.output[0]) or math.prod(out) > GEMM_ABOVE
    ):
        return False  # onnxruntime's FusedMatMul is as fast there
    as_gemm = onnx.helper.make_node(
        "Gemm",
        [a or node.input[0], b or node.input[1]],
        list(node.output),
        name=node.name,
        transA=int(a is not None),
        transB=int(b is not None),
    )
    node.CopyFrom(as_gemm)
    return True


__all__ = ["GEMM_ABOVE", "transposed_matmul"]
