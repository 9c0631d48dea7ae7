"""Rule: a frozen weight the step dequantizes is dequantized again where the backward
reads it, instead of kept from the forward.

A gradient graph reads a product's weight ``W = DequantizeLinear(q, scale, zero)`` twice:
in the forward product, and in the backward's ``dX = dY W^T``. onnxruntime keeps each
such ``W`` alive from the one to the other, so a quantized base costs its float size
after all: LoRA on the 1.1B decoder with int8 weights peaked at 4.9 GB, above its 4.2 GB
of float weights. Here each reader after the first gets its own copy of the chain that
makes ``W`` (the ``DequantizeLinear`` and the ``Transpose``, ``Slice`` or ``Reshape``
after it), placed before that reader: the forward's ``W`` dies after the forward product,
and the backward's lives from its recomputation to its use, one weight at a time. The
price is a second dequantization of each weight per step.

The copies' nodes are named ``recompute/...`` (:data:`graphkit.engine.ort_engine.
RECOMPUTED`): onnxruntime's common-subexpression elimination, which would merge them back
into the forward's, is off for a session whose graph has them.
"""

from __future__ import annotations

import onnx

from graphkit._graph import fresh_name, graph_names
from graphkit.engine.ort_engine import RECOMPUTED

FOLLOWERS = frozenset({"Transpose", "Slice", "Reshape"})
"""Operators that may follow a ``DequantizeLinear`` in the chain that makes a weight."""


def recompute_dequantized_weights(model: onnx.ModelProto) -> bool:
    """Rewrites ``model`` in place (see the module docstring); whether it changed."""
    graph = model.graph
    constants = {t.name for t in graph.initializer}
    chain: dict[str, onnx.NodeProto] = {}  # tensor -> the chain node that makes it
    for node in graph.node:
        reads = [name for name in node.input if name]
        if node.op_type == "DequantizeLinear" and all(n in constants for n in reads):
            chain[node.output[0]] = node
        elif (
            node.op_type in FOLLOWERS
            and reads
            and reads[0] in chain
            and all(n in constants or n in chain for n in reads[1:])
        ):
            chain[node.output[0]] = node
    if not chain:
        return False
    chain_nodes = {id(n) for n in chain.values()}
    readers: dict[str, list[int]] = {}
    for position, node in enumerate(graph.node):
        if id(node) in chain_nodes:
            continue
        for name in node.input:
            if name in chain:
                readers.setdefault(name, []).append(position)
    taken = graph_names(graph)
    inserts: list[tuple[int, list[onnx.NodeProto], str, str]] = []
    for tensor, positions in readers.items():
        for position in sorted(set(positions))[1:]:
            copies, renamed = _copied_chain(tensor, chain, taken)
            inserts.append((position, copies, tensor, renamed))
    if not inserts:
        return False
    nodes = list(graph.node)
    for position, copies, tensor, renamed in sorted(inserts, key=lambda i: -i[0]):
        reader = nodes[position]
        reader.input[:] = [renamed if name == tensor else name for name in reader.input]
        nodes[position:position] = copies
    del graph.node[:]
    graph.node.extend(nodes)
    return True


def _copied_chain(
    tensor: str, chain: dict[str, onnx.NodeProto], taken: set[str]
) -> tuple[list[onnx.NodeProto], str]:
    """Copies of the chain nodes that make ``tensor``, in order, their outputs renamed;
    and the copy of ``tensor``."""
    order: list[onnx.NodeProto] = []
    name = tensor
    while name in chain:
        node = chain[name]
        order.insert(0, node)
        name = node.input[0]
    renamed: dict[str, str] = {}
    copies = []
    for node in order:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        copy.name = fresh_name(f"{RECOMPUTED}{node.name or node.output[0]}", taken)
        copy.input[:] = [renamed.get(n, n) for n in node.input]
        renamed[node.output[0]] = fresh_name(f"{RECOMPUTED}{node.output[0]}", taken)
        copy.output[:] = [renamed[node.output[0]]]
        copies.append(copy)
    return copies, renamed[tensor]


__all__ = ["FOLLOWERS", "recompute_dequantized_weights"]
