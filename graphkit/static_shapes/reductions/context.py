"""What the rules of :func:`graphkit.static_shapes.simplify_reductions` share while they
rewrite one graph: its shapes, constants and element types, the names taken, and new
constants and Reshapes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from graphkit._graph import fresh_name, graph_names, read_counts
from graphkit.tensor_store import tensor_value


class Context:
    """One graph's state during :func:`graphkit.static_shapes.simplify_reductions`.

    ``shapes``, ``elem`` and ``constants`` grow as the rules add tensors; ``producer``
    and ``reads`` are those of the graph before any rewrite (the rules only ask them
    about the original tensors)."""

    def __init__(self, graph: onnx.GraphProto, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.graph, self.shapes = graph, dict(shapes)
        self.constants = {t.name: tensor_value(t) for t in graph.initializer}
        self.elem = {
            v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info]
        }
        self.elem.update({t.name: t.data_type for t in graph.initializer})
        self.taken = graph_names(graph)
        self.ranked: dict[tuple[str, int], str] = {}  # (constant, rank) -> reshaped copy
        self.producer = {o: n for n in graph.node for o in n.output}
        self.reads = read_counts(graph.node, (o.name for o in graph.output))
        self.views: dict[str, str] = {}  # a squeezed copy's name -> the tensor it views
        self.orphans: list[onnx.NodeProto] = []  # nodes a rewrite may have left unread

    def fresh(self, base: str) -> str:
        """A name no tensor of the graph has (nor any this rewrite gave)."""
        return fresh_name(base, self.taken)

    def constant(self, base: str, value: np.ndarray) -> str:
        """The name of a new initializer holding ``value``."""
        name = self.fresh(base)
        self.graph.initializer.append(numpy_helper.from_array(value, name))
        self.constants[name] = value
        return name

    def reshape(self, x: str, shape: Sequence[int], output: str) -> onnx.NodeProto:
        """``output = Reshape(x, shape)``, the shape a new initializer."""
        target = self.constant(f"{output}/shape", np.array(shape, dtype=np.int64))
        return onnx.helper.make_node("Reshape", [x, target], [output])


__all__ = ["Context"]
