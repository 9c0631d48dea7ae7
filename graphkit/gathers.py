"""Gathers that take a tensor apart along an axis, written as one ``Split``.

Attention layers often compute queries, keys and values in one product, then read them
back one at a time: ``qkv[0]``, ``qkv[1]``, ``qkv[2]``, which an exporter writes as three
``Gather`` nodes with the constant scalar indices 0, 1 and 2 on one axis. Their gradient
is three scatters into zeros of the whole tensor, summed (each a kernel over all of it);
the same values as one ``Split`` followed by a ``Squeeze`` of each piece have a
``Concat`` for gradient. :func:`gathers_as_split` rewrites the first form into the
second before any gradient is built (the transformer encoder of ``benchmarks/peers.py``:
0.6 ms of a 7 ms batch went to the scatters and their sum).

Only gathers whose indices are constant scalars (of an initializer or a ``Constant``),
on an axis whose size is known, that between them read every position of that axis are
rewritten: the Split's pieces are then exactly the tensors the gathers returned.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import constant_tensors, fresh_name, graph_names
from graphkit.compat import opset_of
from graphkit.tensor_store import tensor_value

MIN_OPSET = 13
"""``Split`` and ``Squeeze`` take their sizes and axes as inputs from opset 13 on."""


def gathers_as_split(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (a copy) with each set of ``Gather`` nodes that reads all of an axis,
    one position each, replaced by a ``Split`` of that axis and a ``Squeeze`` per piece.
    The model itself where there is none (or below opset 13)."""
    if (opset_of(model) or 0) < MIN_OPSET:
        return model
    graph = model.graph
    constants = _scalar_constants(graph)
    groups: dict[tuple[str, int], list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        if node.op_type == "Gather" and node.domain in ("", "ai.onnx"):
            if node.input[1] in constants:
                axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
                groups[(node.input[0], axis)].append(node)
    groups = {key: nodes for key, nodes in groups.items() if len(nodes) > 1}
    if not groups:
        return model
    shapes = _shapes(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = graph_names(out.graph)
    replaced: dict[str, list[onnx.NodeProto]] = {}  # first gather's output -> new nodes
    dropped: set[str] = set()
    for (data, axis), nodes in groups.items():
        shape = shapes.get(data)
        if shape is None:
            continue
        if not -len(shape) <= axis < len(shape):
            continue
        axis %= len(shape)
        size = shape[axis]
        if not isinstance(size, int) or size < 2:
            continue
        positions = [int(constants[n.input[1]]) for n in nodes]
        if not all(-size <= p < size for p in positions):
            continue
        positions = [p % size for p in positions]
        if set(positions) != set(range(size)):
            continue
        replaced[nodes[0].output[0]] = _split(out.graph, data, axis, size, nodes, positions, taken)
        dropped.update(n.output[0] for n in nodes)
    if not replaced:
        return model
    kept: list[onnx.NodeProto] = []
    for node in out.graph.node:
        if node.op_type == "Gather" and node.output[0] in dropped:
            kept.extend(replaced.get(node.output[0], []))  # at the first gather's place
        else:
            kept.append(node)
    del out.graph.node[:]
    out.graph.node.extend(kept)
    return out


def _split(
    graph: onnx.GraphProto,
    data: str,
    axis: int,
    size: int,
    gathers: list[onnx.NodeProto],
    positions: list[int],
    taken: set[str],
) -> list[onnx.NodeProto]:
    """The Split of ``data`` and, for each gather, the Squeeze naming its output.

    The Split goes where the first gather was: every gather reads ``data`` only, and the
    readers of a later gather's output come after that gather, so after the first one.
    """
    stem = gathers[0].name or gathers[0].output[0]
    pieces = [fresh_name(f"{stem}/piece_{i}", taken) for i in range(size)]
    sizes = fresh_name(f"{stem}/sizes", taken)
    axes = fresh_name(f"{stem}/axis", taken)
    graph.initializer.append(numpy_helper.from_array(np.ones(size, np.int64), sizes))
    graph.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), axes))
    nodes = [helper.make_node("Split", [data, sizes], pieces, axis=axis, name=f"{stem}/split")]
    for gather, position in zip(gathers, positions):
        nodes.append(
            helper.make_node(
                "Squeeze",
                [pieces[position], axes],
                [gather.output[0]],
                name=f"{gather.name or gather.output[0]}/squeeze",
            )
        )
    return nodes


def _scalar_constants(graph: onnx.GraphProto) -> dict[str, int]:
    """The integer scalars of ``graph``'s constants (:func:`constant_tensors`)."""
    return {
        name: int(tensor_value(tensor))
        for name, tensor in constant_tensors(graph)
        if tensor.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
        and not list(tensor.dims)
    }


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Each tensor's inferred shape (with onnx's data propagation, which reads a shape
    an exporter computes from ``Shape`` nodes); a dimension it cannot tell is None."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception:  # noqa: BLE001  (a model onnx cannot infer: left as it is)
        return {}
    shapes: dict[str, list[int | None]] = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        kind = value.type.tensor_type
        if kind.HasField("shape"):
            shapes[value.name] = [
                d.dim_value if d.HasField("dim_value") else None for d in kind.shape.dim
            ]
    for tensor in inferred.graph.initializer:
        shapes[tensor.name] = list(tensor.dims)
    return shapes


__all__ = ["gathers_as_split"]
