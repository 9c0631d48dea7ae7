"""What the rules of :func:`graphkit.static_shapes.gemms.fuse_gemms` share: the graph's
producers (by position) and readers before any rewrite, the Gemms a later node took over,
the nodes to insert, and the questions the rules ask of a tensor."""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import onnx

from graphkit._graph import graph_names, outer_reads
from graphkit.static_shapes.shapes import last_two_swapped, transpose_perm
from graphkit.tensor_store import tensor_value

GEMV_FUSED_UP_TO = 4096
"""Elements of a one-column product's first operand up to which its Gemm takes the
learning rate and the update (:mod:`.rate_as_alpha`, :mod:`.update_as_c`): 1.77 us
against 2.33 for 32 x 64, 6.77 against 4.15 for 1000 x 10 (their Gemm, Mul and Add)."""


class Context:
    """One graph's state during :func:`graphkit.static_shapes.gemms.fuse_gemms`."""

    def __init__(self, model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]]) -> None:
        graph = self.graph = model.graph
        self.shapes = shapes
        self.constants = {t.name: tensor_value(t) for t in graph.initializer}
        self.outputs = {o.name for o in graph.output}
        self.readers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in outer_reads(node):
                self.readers.setdefault(name, []).append(node)
        self.position = {o: k for k, n in enumerate(graph.node) for o in n.output}
        self.absorbed: set[int] = set()  # the positions of nodes a later node took over
        self.inserted: dict[int, list[onnx.NodeProto]] = {}  # new nodes before a position
        self.taken = graph_names(graph)

    def producer(self, name: str) -> onnx.NodeProto | None:
        return self.graph.node[self.position[name]] if name in self.position else None

    def swapped(self, name: str) -> str | None:
        """The input of the Transpose producing ``name`` if it swaps the last two axes."""
        node = self.producer(name)
        rank = len(self.shapes.get(name, ()))
        if node is None or node.op_type != "Transpose" or rank < 2:
            return None
        return node.input[0] if transpose_perm(node, rank) == last_two_swapped(rank) else None

    def transposed(self, name: str) -> str | None:
        """The matrix whose Transpose ``name`` is."""
        return self.swapped(name) if len(self.shapes.get(name, ())) == 2 else None

    def rate(self, name: str) -> float | None:
        """A scalar constant's value, where Gemm's float32 ``alpha`` holds it exactly (a
        float64 rate it cannot hold stays a Mul)."""
        value = self.constants.get(name)
        if value is None or value.size != 1:
            return None
        number = float(value.item())
        return number if float(np.float32(number)) == number else None

    def plain_gemm(self, name: str) -> onnx.NodeProto | None:
        """The Gemm without ``C`` producing ``name``, if only one node reads it and
        taking more into it keeps onnxruntime's fast path (not where the product has one
        column and its first operand more than :data:`GEMV_FUSED_UP_TO` elements)."""
        gemm = self.producer(name)
        if gemm is None or gemm.op_type != "Gemm" or len(gemm.input) > 2:
            return None
        if len(self.readers.get(name, [])) != 1 or name in self.outputs:
            return None
        # one column from a large operand: onnxruntime's fast path wants alpha 1, no C
        column = self.shapes.get(name, ())[-1:] == (1,)
        large = math.prod(self.shapes.get(gemm.input[0], (GEMV_FUSED_UP_TO + 1,)))
        return None if column and large > GEMV_FUSED_UP_TO else gemm

    def take_over(self, index: int, inner: str, inputs: list[str], **changes: float) -> None:
        """The node at ``index`` becomes the Gemm producing ``inner`` with ``inputs`` and
        its attributes ``changes``d; that Gemm goes."""
        gemm = self.graph.node[self.position[inner]]
        settings = {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}
        node = self.graph.node[index]
        fused = onnx.helper.make_node(
            "Gemm", inputs, list(node.output), name=node.name, **(settings | changes)
        )
        self.absorbed.add(self.position[inner])
        node.CopyFrom(fused)


__all__ = ["GEMV_FUSED_UP_TO", "Context"]
