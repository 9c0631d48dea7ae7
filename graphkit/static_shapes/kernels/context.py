"""What the rules of :func:`graphkit.static_shapes.kernels.fewer_kernels` share: the
graph's constants, producers and read counts (those before any rewrite), the names taken,
and the nodes a rule made unread."""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from graphkit._graph import graph_names, read_counts
from graphkit.static_shapes.shapes import STANDARD
from graphkit.tensor_store import tensor_value


class Context:
    """One graph's state during :func:`graphkit.static_shapes.kernels.fewer_kernels`."""

    def __init__(self, model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]]) -> None:
        graph = self.graph = model.graph
        self.shapes = shapes
        self.constants = {t.name: tensor_value(t) for t in graph.initializer}
        self.producer = {o: n for n in graph.node for o in n.output}
        self.reads = read_counts(graph.node, (o.name for o in graph.output))
        self.taken = graph_names(graph)
        self.dropped: set[int] = set()  # id() of the nodes a rule took into another

    def only_mul(self, name: str) -> onnx.NodeProto | None:
        """The standard ``Mul`` producing ``name`` if nothing else reads ``name``."""
        node = self.producer.get(name)
        if node is None or node.op_type != "Mul" or node.domain not in STANDARD:
            return None
        return node if self.reads.get(name) == 1 else None


def full_sum(node: onnx.NodeProto) -> bool:
    """Whether ``node`` is a ReduceSum of every axis to a scalar (no axes input,
    ``keepdims=0``, not ``noop_with_empty_axes``)."""
    if node.op_type != "ReduceSum" or len(node.input) != 1:
        return False
    keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
    noop = any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute)
    return not (keepdims or noop)


__all__ = ["Context", "full_sum"]
