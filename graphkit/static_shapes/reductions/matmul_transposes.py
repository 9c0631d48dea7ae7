"""Rule (a guard): a ``Transpose`` that swaps a tensor's last two axes and that only
MatMuls read is left as it is.

onnxruntime runs each such Transpose as an attribute of its MatMul (``FusedMatMul``), a
kernel less than the ``Reshape`` (:mod:`.squeeze_units`) a vector's transpose would
otherwise become. The native backend's clean-up reads the same set."""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from graphkit.static_shapes.shapes import last_two_swapped, transpose_perm


def matmul_transposes(graph: onnx.GraphProto, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The results of the Transposes in ``graph`` that swap a tensor's last two axes and
    that only MatMuls read: onnxruntime runs each as an attribute of its MatMul
    (``FusedMatMul``), a kernel less than the ``Reshape`` a vector's transpose would
    otherwise become."""
    readers: dict[str, list[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)
    outputs = {o.name for o in graph.output}
    fused = set()
    for node in graph.node:
        if node.op_type != "Transpose" or node.output[0] in outputs:
            continue
        rank = len(shapes.get(node.input[0], ()))
        if rank < 2 or transpose_perm(node, rank) != last_two_swapped(rank):
            continue
        if set(readers.get(node.output[0], ["none"])) == {"MatMul"}:
            fused.add(node.output[0])
    return fused


__all__ = ["matmul_transposes"]
