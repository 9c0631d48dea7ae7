"""The common sequence patterns of an exported graph written with tensor operators.

Neither gradient source differentiates ONNX's sequence operators: onnx-ad has no rule
for them and onnxruntime-training's builders stop at them ("unreachable from the output
node(s)"). torch's dynamo exporter writes a few simple ones, where a list of tensors
lives between one operator that makes it and others that take it apart again:

* ``SplitToSequence(x, split, axis)`` read only by ``SequenceAt(seq, i)`` with constant
  positions (GPT-2's ``qkv.split(n_embd, dim=2)``)::

      seq = SplitToSequence(x, split, axis);  q = SequenceAt(seq, 0) ...
      ==>  parts... = Split(x, sizes, axis);  q = parts[0] ...

  the sizes those of ``split`` (a 1-D constant), or, for a scalar ``split``, chunks of
  that size over the axis's static extent (the last one shorter); with ``keepdims=0``
  and no ``split``, each part is squeezed;
* ``ConcatFromSequence(SequenceConstruct(a, b, ...), axis, new_axis)``, its sequence read
  by nothing else::

      ==>  Concat(a, b, ..., axis)      (new_axis=1: each Unsqueezed at axis first)

* a ``Loop`` that appends one tensor a turn to a sequence it carries, started empty,
  read after the loop only by ``ConcatFromSequence`` along axis 0 (dynamo writes
  ``nn.EmbeddingBag`` so, a bag's row a turn; onnxruntime up to 1.32 crashes creating a
  session on that graph, in its constant folding, before training could start)::

      seq = Loop(..., SequenceEmpty()) { seq' = SequenceInsert(seq, row) }
      ConcatFromSequence(seq, axis=0)
      ==>  rows = Loop(...) { scan output: row }     (rows: turns x row's shape)
           Reshape(rows, [-1, row's shape[1:]])      (new_axis=1: rows as they are)

  the tensors a Loop stacks as its scan output are those the sequence held.

Any other use of a sequence is left as it is (and refused by the gradient source with
the operator's name).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper

from graphkit._graph import constant_tensors, copy_model, graph_names, inferred_dims, namer
from graphkit.compat import opset_of
from graphkit.tensor_store import tensor_value


def sequences_as_tensors(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the patterns of the module docstring written with tensor operators
    (a copy; ``model`` itself when it has none)."""
    model = _loops_stacking(model)
    kinds = {n.op_type for n in model.graph.node}
    if not kinds & {"SplitToSequence", "SequenceConstruct"}:
        return model
    rewritten = copy_model(model)
    graph = rewritten.graph
    nodes = list(graph.node)  # held: positions and identities stay valid
    readers: dict[str, list[int]] = defaultdict(list)
    for index, node in enumerate(nodes):
        for name in node.input:
            readers[name].append(index)
    outputs = {o.name for o in graph.output}
    constants = {
        name: tensor_value(t)
        for name, t in constant_tensors(graph)
        if t.data_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
    }
    extents = inferred_dims(rewritten)
    fresh = namer("sequence", graph_names(graph))
    replaced: dict[int, list[onnx.NodeProto]] = {}  # by position of the node written out
    dropped: set[int] = set()
    for index, node in enumerate(nodes):
        if node.domain not in ("", "ai.onnx") or node.output[0] in outputs:
            continue
        users = [nodes[k] for k in readers.get(node.output[0], [])]
        if node.op_type == "SplitToSequence":
            written = _split(node, users, constants, extents, fresh)
        elif node.op_type == "SequenceConstruct":
            written = _concat(node, users, fresh)
        else:
            continue
        if written is not None:
            replaced[index] = written
            dropped.update(readers.get(node.output[0], []))
    if not replaced:
        return model
    kept: list[onnx.NodeProto] = []
    for index, node in enumerate(nodes):
        if index not in dropped:
            kept.extend(replaced.get(index, [node]))
    del graph.node[:]
    graph.node.extend(kept)
    return rewritten


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _split(
    node: onnx.NodeProto,
    users: list[onnx.NodeProto],
    constants: dict[str, np.ndarray],
    extents: dict[str, list[int | None]],
    fresh,
) -> list[onnx.NodeProto] | None:
    """The nodes for a ``SplitToSequence`` whose every reader is a ``SequenceAt`` at a
    constant position, else None."""
    if not users or any(
        u.op_type != "SequenceAt" or u.input[1] not in constants or u.input[0] != node.output[0]
        for u in users
    ):
        return None
    attrs = _attributes(node)
    x = node.input[0]
    shape = extents.get(x)
    if shape is None:
        return None
    axis = int(attrs.get("axis", 0)) % len(shape)
    extent = shape[axis]
    split = node.input[1] if len(node.input) > 1 and node.input[1] else ""
    squeeze = not split and not attrs.get("keepdims", 1)
    if split:
        if split not in constants:
            return None
        value = constants[split]
        if value.ndim == 1:
            sizes = [int(v) for v in value]
        elif extent is None:
            return None
        else:
            chunk = int(value)
            sizes = [min(chunk, extent - start) for start in range(0, extent, chunk)]
    elif extent is None:
        return None
    else:
        sizes = [1] * extent
    count = len(sizes)
    positions = [int(constants[u.input[1]].reshape(())) for u in users]
    if any(not -count <= p < count for p in positions):
        return None  # SequenceAt out of range: onnxruntime's error, not ours
    parts = [fresh(f"{x}_part{k}") for k in range(count)]
    sizes_name = fresh("sizes")
    nodes = [
        helper.make_node(
            "Constant",
            [],
            [sizes_name],
            value=onnx.numpy_helper.from_array(np.array(sizes, np.int64)),
        ),
        helper.make_node("Split", [x, sizes_name], parts, axis=axis),
    ]
    axes = fresh("axes")
    if squeeze:
        nodes.append(
            helper.make_node(
                "Constant", [], [axes], value=onnx.numpy_helper.from_array(np.array([axis]))
            )
        )
    for user, position in zip(users, positions):
        part = parts[position % count]
        if squeeze:
            nodes.append(helper.make_node("Squeeze", [part, axes], [user.output[0]]))
        else:
            nodes.append(helper.make_node("Identity", [part], [user.output[0]]))
    return nodes


def _concat(
    node: onnx.NodeProto, users: list[onnx.NodeProto], fresh
) -> list[onnx.NodeProto] | None:
    """The nodes for a ``SequenceConstruct`` read by one ``ConcatFromSequence``, else None."""
    if len(users) != 1 or users[0].op_type != "ConcatFromSequence":
        return None
    (user,) = users
    attrs = _attributes(user)
    axis = int(attrs["axis"])
    items = list(node.input)
    nodes: list[onnx.NodeProto] = []
    if attrs.get("new_axis", 0):
        axes = fresh("axes")
        nodes.append(
            helper.make_node(
                "Constant", [], [axes], value=onnx.numpy_helper.from_array(np.array([axis]))
            )
        )
        lifted = [fresh(f"{item}_lifted") for item in items]
        nodes += [helper.make_node("Unsqueeze", [i, axes], [o]) for i, o in zip(items, lifted)]
        items = lifted
    nodes.append(helper.make_node("Concat", items, [user.output[0]], axis=axis))
    return nodes


def _loops_stacking(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each Loop that builds a sequence a turn at a time (module
    docstring) stacking the tensors as a scan output instead (a copy; ``model`` itself
    when there is none)."""
    if (opset_of(model) or 0) < 15 or not any(
        n.op_type == "SequenceEmpty" for n in model.graph.node
    ):
        return model  # (Shape's start attribute is opset 15's)
    rewritten = copy_model(model)
    graph = rewritten.graph
    fresh = namer("sequence", graph_names(graph))
    found = False
    while _stack_one(graph, fresh):  # one at a time: each renumbers the Loop's values
        found = True
    return rewritten if found else model


def _stack_one(graph: onnx.GraphProto, fresh) -> bool:
    """Rewrite the first Loop-carried sequence of the module docstring's pattern in
    ``graph``; whether there was one."""
    producers = {out: node for node in graph.node for out in node.output}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            readers[name].append(node)
    outputs = {o.name for o in graph.output}
    for loop in graph.node:
        if loop.op_type != "Loop" or loop.domain not in ("", "ai.onnx"):
            continue
        body = next(a.g for a in loop.attribute if a.name == "body")
        carried = len(loop.input) - 2
        for k in range(carried):
            start = producers.get(loop.input[2 + k])
            final = loop.output[k]
            concats = readers.get(final, [])
            if (
                start is None
                or start.op_type != "SequenceEmpty"
                or len(readers[start.output[0]]) != 1
                or final in outputs
                or not concats
                or any(c.op_type != "ConcatFromSequence" for c in concats)
                or any(_attributes(c).get("axis") != 0 for c in concats)
            ):
                continue
            row = _appended(body, body.input[2 + k].name, body.output[1 + k].name)
            if row is None:
                continue
            _as_scan_output(graph, loop, body, k, row, concats, fresh)
            graph.node.remove(start)
            return True
    return False


def _appended(body: onnx.GraphProto, sequence_in: str, sequence_out: str) -> str | None:
    """The tensor the body appends to its carried sequence, when it only does that: one
    ``SequenceInsert(sequence_in, row)`` (no position) producing ``sequence_out``."""
    readers = [n for n in body.node if sequence_in in n.input]
    if len(readers) != 1:
        return None
    (insert,) = readers
    if (
        insert.op_type != "SequenceInsert"
        or len([i for i in insert.input if i]) != 2
        or insert.input[0] != sequence_in
        or insert.output[0] != sequence_out
        or any(sequence_out in n.input for n in body.node)
    ):
        return None
    return insert.input[1]


def _as_scan_output(
    graph: onnx.GraphProto,
    loop: onnx.NodeProto,
    body: onnx.GraphProto,
    k: int,
    row: str,
    concats: list[onnx.NodeProto],
    fresh,
) -> None:
    """Carried sequence ``k`` of ``loop`` becomes a scan output of ``row``; each
    ``ConcatFromSequence`` of it a ``Reshape`` (or an ``Identity``) of the stack."""
    (insert,) = [n for n in body.node if n.output and n.output[0] == body.output[1 + k].name]
    body.node.remove(insert)
    del body.input[2 + k]
    del body.output[1 + k]
    scan_value = onnx.ValueInfoProto()
    scan_value.name = row
    body.output.append(scan_value)
    del loop.input[2 + k]
    stacked = fresh("stacked")
    outputs = list(loop.output)
    del outputs[k]
    del loop.output[:]
    loop.output.extend([*outputs, stacked])
    position = list(graph.node).index(loop) + 1
    for concat in concats:
        nodes: list[onnx.NodeProto]
        if _attributes(concat).get("new_axis", 0):
            nodes = [helper.make_node("Identity", [stacked], [concat.output[0]])]
        else:  # turns x row's shape -> (turns * row's first extent) x the rest
            shape, first, target = (fresh(s) for s in ("shape", "first", "target"))
            nodes = [
                helper.make_node("Shape", [stacked], [shape], start=2),
                helper.make_node(
                    "Constant", [], [first], value=onnx.numpy_helper.from_array(np.array([-1]))
                ),
                helper.make_node("Concat", [first, shape], [target], axis=0),
                helper.make_node("Reshape", [stacked, target], [concat.output[0]]),
            ]
        graph.node.remove(concat)
        for node in reversed(nodes):
            graph.node.insert(position, node)


__all__ = ["sequences_as_tensors"]
