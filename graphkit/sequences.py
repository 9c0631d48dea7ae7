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

Any other use of a sequence is left as it is (and refused by the gradient source with
the operator's name).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import onnx
from onnx import helper

from graphkit._graph import constant_tensors, copy_model, graph_names, inferred_dims, namer
from graphkit.tensor_store import tensor_value


def sequences_as_tensors(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the patterns of the module docstring written with tensor operators
    (a copy; ``model`` itself when it has none)."""
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


__all__ = ["sequences_as_tensors"]
