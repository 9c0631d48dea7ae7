"""Rule: ``Shape(x)`` of a tensor whose shape onnx's inference fixes -> that shape, an
initializer.

onnxscript's folding leaves the ``Shape`` of a ``Scan``'s output (an LSTM's last state),
whose shape onnx's inference knows; this rule makes it a constant, which the next
folding then propagates."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from graphkit._graph import constant_tensors, inferred_dims
from graphkit.static_shapes.shapes import STANDARD, static_shapes
from graphkit.tensor_store import tensor_value


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


def known_parts_as_constants(model: onnx.ModelProto) -> bool:
    """Replaces, in place, each ``Shape`` whose part (its ``start`` and ``end``) onnx's
    inference fixes by that part as an initializer, the other axes of the tensor may be
    symbolic; whether it replaced any. A graph output stays computed.

    torch's dynamo exporter slices an LSTM's or GRU's gates out of its weights up to
    ``Shape(h0, start=2)``, the hidden size, of an initial state whose batch axis is
    symbolic: with the bound a constant, the slices have static shapes, and their
    gradients need nothing else (``graphkit.backends.native.rules.slice_reverse``)."""
    graph = model.graph
    if not any(n.op_type == "Shape" for n in graph.node):
        return False  # no shape inference to pay for
    shapes = inferred_dims(model)
    outputs = {o.name for o in graph.output}
    replaced = []
    for node in graph.node:
        if node.op_type != "Shape" or node.domain not in STANDARD or node.output[0] in outputs:
            continue
        shape = shapes.get(node.input[0])
        if shape is None:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        part = shape[attrs.get("start", 0) : attrs.get("end", len(shape))]
        if None in part:
            continue
        graph.initializer.append(numpy_helper.from_array(np.array(part, np.int64), node.output[0]))
        replaced.append(node)
    for node in replaced:
        graph.node.remove(node)
    return bool(replaced)


SMALL = 64
"""The most elements of an integer constant :func:`integer_arithmetic_as_constants`
evaluates from: bounds, axes and shapes, never a tensor of data."""


def integer_arithmetic_as_constants(model: onnx.ModelProto) -> bool:
    """Evaluates, in place, each node of the main graph whose inputs are all small integer
    constants (at most :data:`SMALL` elements) and whose outputs are too, in order, its
    outputs becoming initializers; whether it evaluated any. A graph output stays
    computed, and no float tensor is ever folded: a frozen weight stays one tensor.

    What is left of a bound that :func:`known_parts_as_constants` fixed: dynamo writes an
    LSTM's gate slices as ``Slice(W, k * hidden, (k + 1) * hidden)``, the products
    ``Mul`` nodes, and a ``Slice`` of a symbolic-batch tensor with bounds ``Reshape``d
    from constants."""
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    integers = (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    known = {
        name: tensor_value(t)
        for name, t in constant_tensors(graph)
        if t.data_type in integers and np.prod(t.dims, dtype=np.int64) <= SMALL
    }
    outputs = {o.name for o in graph.output}
    opsets = {o.domain or "": o.version for o in model.opset_import}
    subgraphs = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
    folded = []
    for node in graph.node:
        inputs = [i for i in node.input if i]
        if (
            node.domain not in STANDARD
            or any(i not in known for i in inputs)
            or any(a.type in subgraphs for a in node.attribute)
            or outputs.intersection(node.output)
        ):
            continue
        try:
            evaluate = ReferenceEvaluator(node, opsets=opsets)
            values = evaluate.run(None, {i: known[i] for i in inputs})
        except Exception:  # an operator the reference cannot run: left to onnxruntime
            continue
        arrays = [np.asarray(v) for v in values]
        if not all(a.dtype in (np.int64, np.int32) and a.size <= SMALL for a in arrays):
            continue
        known.update(zip(node.output, arrays))
        if node.op_type == "Constant":  # value_int(s) too: known, and left as it is
            continue
        for name, array in zip(node.output, arrays):
            graph.initializer.append(numpy_helper.from_array(array, name))
        folded.append(node)
    for node in folded:
        graph.node.remove(node)
    return bool(folded)


__all__ = ["integer_arithmetic_as_constants", "known_parts_as_constants", "shapes_as_constants"]
