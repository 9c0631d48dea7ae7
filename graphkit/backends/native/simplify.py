"""The native gradient graphs' layout plumbing, removed once shapes are static.

onnx-ad gives every derivative a trailing axis of seed directions and moves it with
``Transpose``, ``Unsqueeze``, ``Reshape`` and ``Squeeze`` around each rule; graphkit
always seeds one direction, so after :func:`graphkit.static_shapes.specialize` that
axis has size 1 and most of the plumbing moves no data. Each kernel still costs a call
(about a microsecond on the CPU), which is most of a small model's step. :func:`simplify`
rewrites, on the main graph:

* a ``Transpose`` of a ``Transpose``: one ``Transpose`` (none when they cancel);
* a ``Transpose`` that moves only axes of size 1: a ``Reshape``;
* a chain of ``Reshape``/``Squeeze``/``Unsqueeze``/``Flatten`` whose intermediate results
  have no other reader: one ``Reshape`` to the last shape;
* a ``Reshape`` (or ``Identity``) whose input already has its output's shape: nothing,
  its readers read the input.

Every rewrite keeps the values: only where data sits in memory changes, never a number.
It is the native backend's entry in ``constant_folds`` (run by ``specialize``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import fresh_name, graph_names, outer_reads
from graphkit.static_shapes import static_shapes

_RESHAPES = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def simplify(model: onnx.ModelProto) -> bool:
    """Apply the rewrites of the module docstring in place; whether any applied."""
    # one shape inference: every rewrite keeps the shape of each tensor it leaves
    shapes = static_shapes(model)
    changed = False
    for rewrite in (_compose_transposes, _transposes_as_reshapes, _merge_reshapes, _drop_no_ops):
        while rewrite(model, shapes):
            changed = True
    return changed


def _readers(graph: onnx.GraphProto) -> dict[str, int]:
    count: dict[str, int] = {}
    for node in graph.node:
        for name in outer_reads(node):
            count[name] = count.get(name, 0) + 1
    for output in graph.output:
        count[output.name] = count.get(output.name, 0) + 1
    return count


def _perm(node: onnx.NodeProto, rank: int) -> list[int]:
    for attribute in node.attribute:
        if attribute.name == "perm":
            return list(attribute.ints)
    return list(range(rank))[::-1]


def _compose_transposes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)
    touched: set[int] = set()
    dropped = []
    for node in list(graph.node):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        inner = producer.get(node.input[0])
        if inner is None or inner.op_type != "Transpose" or inner.input[0] not in shapes:
            continue
        if id(inner) in touched or id(node) in touched:
            continue
        rank = len(shapes[inner.input[0]])
        first, second = _perm(inner, rank), _perm(node, rank)
        composed = [first[p] for p in second]
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("perm", composed))
        node.input[0] = inner.input[0]
        touched.update((id(inner), id(node)))
        if readers.get(inner.output[0], 0) == 1:
            dropped.append(inner)
    for inner in dropped:
        graph.node.remove(inner)
    return bool(touched)


def _transposes_as_reshapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    taken = graph_names(graph)
    changed = False
    for index, node in enumerate(graph.node):
        if node.op_type != "Transpose" or node.input[0] not in shapes:
            continue
        shape = shapes[node.input[0]]
        perm = _perm(node, len(shape))
        moved = [p for p in perm if shape[p] != 1]
        if moved != sorted(moved):
            continue  # real data movement
        target = fresh_name(f"{node.output[0]}/shape", taken)
        graph.initializer.append(
            numpy_helper.from_array(np.array([shape[p] for p in perm], np.int64), target)
        )
        graph.node[index].CopyFrom(
            helper.make_node("Reshape", [node.input[0], target], list(node.output), name=node.name)
        )
        changed = True
    return changed


def _merge_reshapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)
    taken = graph_names(graph)
    touched: set[int] = set()
    dropped = []
    for node in list(graph.node):
        if node.op_type not in _RESHAPES or node.output[0] not in shapes:
            continue
        inner = producer.get(node.input[0])
        if inner is None or inner.op_type not in _RESHAPES:
            continue
        if readers.get(inner.output[0], 0) != 1 or {id(inner), id(node)} & touched:
            continue
        target = fresh_name(f"{node.output[0]}/shape", taken)
        graph.initializer.append(
            numpy_helper.from_array(np.array(shapes[node.output[0]], np.int64), target)
        )
        node.CopyFrom(
            helper.make_node("Reshape", [inner.input[0], target], list(node.output), name=node.name)
        )
        touched.update((id(inner), id(node)))
        dropped.append(inner)
    for inner in dropped:
        graph.node.remove(inner)
    return bool(dropped)


def _drop_no_ops(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    outputs = {o.name for o in graph.output}
    dropped = []
    for node in list(graph.node):
        if node.op_type not in ("Reshape", "Identity") or node.output[0] in outputs:
            continue
        source, result = node.input[0], node.output[0]
        if node.op_type == "Reshape" and (
            source not in shapes or shapes.get(source) != shapes.get(result)
        ):
            continue
        dropped.append(node)
        graph.node.remove(node)
        _rename_reads(graph, result, source)
    return bool(dropped)


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every read of ``old`` (subgraphs included) reads ``new``."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename_reads_in(attribute.g, old, new)
            for sub in attribute.graphs:
                _rename_reads_in(sub, old, new)


def _rename_reads_in(graph: onnx.GraphProto, old: str, new: str) -> None:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined.update(o for n in graph.node for o in n.output)
    if old in defined:
        return  # the subgraph has a tensor of its own by that name
    if new in defined:  # it would read its own instead of the outer one
        raise ValueError(f"simplify: a subgraph defines {new!r}, which it reads from outside")
    _rename_reads(graph, old, new)
    for output in graph.output:
        if output.name == old:
            output.name = new


__all__ = ["simplify"]
