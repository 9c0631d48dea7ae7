"""Rule: the body of each top-level ``Scan`` whose inputs have static shapes is specialized
too, as a model of its own.

Its inputs get the shapes the Scan gives them, and what it reads from the graph around it
becomes inputs (constants: initializers). A recurrent layer's step (an LSTM's, its
gradient's) runs its shape arithmetic and a gradient's seed-axis plumbing at every time
step otherwise: 37 of the 67 kernels of an LSTM's adjoint step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import onnx

from graphkit._graph import outer_reads
from graphkit.static_shapes.folding import Fold
from graphkit.static_shapes.shapes import STANDARD, static_shapes

Specialize = Callable[[onnx.ModelProto, Mapping[str, int], Sequence[Fold]], onnx.ModelProto]
""":func:`graphkit.static_shapes.specialize`, passed in (it calls this rule)."""


def specialize_scan_bodies(
    model: onnx.ModelProto, folds: Sequence[Fold], specialize: Specialize
) -> None:
    """Specializes, in place, the body of each top-level ``Scan`` whose inputs have
    static shapes, with ``specialize`` (see the module docstring)."""
    if not any(n.op_type == "Scan" for n in model.graph.node):
        return  # no shape inference to pay for
    shapes = static_shapes(model)
    inferred = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.input, *inferred.value_info]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Scan" or node.domain not in STANDARD:
            continue
        attribute = next(a for a in node.attribute if a.name == "body")
        body = specialized_body(
            model, node, attribute.g, shapes, types, initializers, folds, specialize
        )
        if body is not None:
            attribute.g.CopyFrom(body)


def specialized_body(
    model: onnx.ModelProto,
    scan: onnx.NodeProto,
    body: onnx.GraphProto,
    shapes: Mapping[str, tuple[int, ...]],
    types: Mapping[str, int],
    initializers: Mapping[str, onnx.TensorProto],
    folds: Sequence[Fold],
    specialize: Specialize,
) -> onnx.GraphProto | None:
    """``body`` specialized (see :func:`specialize_scan_bodies`), None where an input's
    shape is not static or the body reads what the Scan's graph does not type."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in scan.attribute}
    scanned = int(attrs["num_scan_inputs"])
    states = len(scan.input) - scanned
    axes = list(attrs.get("scan_input_axes", [0] * scanned))
    inputs = []
    for k, (outer, value) in enumerate(zip(scan.input, body.input)):
        shape = shapes.get(outer)
        if shape is None or not outer:
            return None
        if k >= states:
            axis = axes[k - states] % len(shape)
            shape = shape[:axis] + shape[axis + 1 :]
        elem = value.type.tensor_type.elem_type or types.get(outer, 0)
        if not elem:
            return None
        inputs.append(onnx.helper.make_tensor_value_info(value.name, elem, list(shape)))
    local = {i.name for i in body.input} | {t.name for t in body.initializer}
    local |= {o for n in body.node for o in n.output}
    free = sorted(set().union(*(outer_reads(n) for n in body.node)) - local)
    outer_inputs, outer_constants = [], []
    for name in free:
        if name in initializers:
            outer_constants.append(initializers[name])
        elif name in shapes and types.get(name):
            value = onnx.helper.make_tensor_value_info(name, types[name], list(shapes[name]))
            outer_inputs.append(value)
        else:
            return None
    graph = onnx.GraphProto()
    graph.CopyFrom(body)
    del graph.input[:]
    graph.input.extend([*inputs, *outer_inputs])
    graph.initializer.extend(outer_constants)
    for output in graph.output:  # inferred again
        output.type.tensor_type.ClearField("shape")
    standalone = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    standalone.ir_version = model.ir_version
    fixed = specialize(standalone, {}, folds).graph
    names = [i.name for i in fixed.input]
    if names != [i.name for i in graph.input] or [o.name for o in fixed.output] != [
        o.name for o in body.output
    ]:
        return None  # folding gave up a name the Scan reads by position: keep the body
    del fixed.input[len(inputs) :]  # read from the graph around it again
    outer_names = {t.name for t in outer_constants}
    kept = [t for t in fixed.initializer if t.name not in outer_names]
    del fixed.initializer[:]
    fixed.initializer.extend(kept)
    fixed.name = body.name
    return fixed


__all__ = ["specialize_scan_bodies", "specialized_body"]
