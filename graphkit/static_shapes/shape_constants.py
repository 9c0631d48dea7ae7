"""Rule: ``Shape(x)`` of a tensor whose shape onnx's inference fixes -> that shape, an
initializer.

onnxscript's folding leaves the ``Shape`` of a ``Scan``'s output (an LSTM's last state),
whose shape onnx's inference knows; this rule makes it a constant, which the next
folding then propagates."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from graphkit.static_shapes.shapes import STANDARD, static_shapes


def shapes_as_constants(model: onnx.ModelProto) -> bool:
    """Replaces, in place, each ``Shape`` of a tensor whose shape onnx's inference fixes
    by that shape as an initializer (its ``start`` and ``end`` applied); whether it
    replaced any. A graph output stays computed."""
    graph = model.graph
    if not any(n.op_type == "Shape" for n in graph.node):
        return False  # no shape inference to pay for
    shapes = static_shapes(model)
    outputs = {o.name for o in graph.output}
    found = [
        n
        for n in graph.node
        if n.op_type == "Shape"
        and n.domain in STANDARD
        and n.input[0] in shapes
        and n.output[0] not in outputs
    ]
    for node in found:
        attrs = {a.name: a.i for a in node.attribute}
        shape = shapes[node.input[0]]
        # ONNX's start and end count from the back when negative and are clamped: slicing
        part = shape[attrs.get("start", 0) : attrs.get("end", len(shape))]
        graph.initializer.append(numpy_helper.from_array(np.array(part, np.int64), node.output[0]))
        graph.node.remove(node)
    return bool(found)


__all__ = ["shapes_as_constants"]
