"""``CastLike`` nodes written as ``Cast`` once the type they cast to is known.

``CastLike(x, like)`` casts ``x`` to the element type of ``like``: it is

    CastLike(x, like) = Cast(x, to=elem_type(like))

with the same ``saturate`` (opset 19 on) and ``round_mode`` (opset 24 on) attributes,
which ``Cast`` of the same opset takes too. torch's dynamo exporter with
``optimize=False`` (the README's recipe for training) writes one for every
``Tensor.type_as`` and ``.to(x.dtype)`` it cannot resolve while tracing: ``nn.RMSNorm``'s
output cast back to its input's type, in BERT, ResNet and Llama graphs too.
onnxruntime-training 1.19.2's gradient builders have no gradient for ``CastLike``
("no gradient for operator 'CastLike'"), but one for ``Cast``; onnx-ad (the native
backend) differentiates both the same way (the incoming gradient cast back to ``x``'s
type). :func:`castlike_as_cast` resolves ``like``'s type from the graph's initializers,
its inputs, then onnx's shape inference; a ``CastLike`` whose ``like`` none of them types
stays as it is (the backend that cannot differentiate it then says so, naming it). Only
the main graph is rewritten (not the bodies of ``If``, ``Loop`` or ``Scan``).

``like`` is read for its type only: an initializer that only replaced ``CastLike`` nodes
read (and no graph input overrides) is dropped, as nothing reads it any more.
"""

from __future__ import annotations

import onnx
from onnx import helper

from graphkit._graph import GraphInfo, copy_model, outer_reads
from graphkit.compat import opset_of


def castlike_as_cast(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose main graph's ``CastLike`` nodes with a known target type
    are ``Cast`` nodes (see the module docstring); ``model`` itself when it has no
    ``CastLike``."""
    if not any(_is_castlike(n) for n in model.graph.node):
        return model
    out = copy_model(model)
    elem = GraphInfo(out).elem  # initializers, then inputs and inferred types
    keep_attributes = (opset_of(out) or 0) >= 19  # no attribute before saturate (19)
    likes: set[str] = set()
    for k, node in enumerate(out.graph.node):
        target = elem.get(node.input[1]) if _is_castlike(node) and len(node.input) > 1 else None
        if not target:
            continue
        cast = helper.make_node(
            "Cast", [node.input[0]], list(node.output), name=node.name, to=target
        )
        if keep_attributes:
            cast.attribute.extend(node.attribute)
        cast.doc_string = node.doc_string
        cast.metadata_props.extend(node.metadata_props)
        likes.add(node.input[1])
        out.graph.node[k].CopyFrom(cast)  # (node is that entry: read it before)
    _drop_unread_initializers(out.graph, likes)
    return out


def _is_castlike(node: onnx.NodeProto) -> bool:
    return node.op_type == "CastLike" and node.domain in ("", "ai.onnx")


def _drop_unread_initializers(graph: onnx.GraphProto, names: set[str]) -> None:
    """Remove the initializers of ``names`` that no node (or subgraph) and no graph output
    reads any more (one that is also a graph input stays: the graph's inputs are kept)."""
    read = {o.name for o in graph.output} | {i.name for i in graph.input}
    for node in graph.node:
        read |= outer_reads(node)
    unread = names - read
    if not unread:
        return
    kept = [t for t in graph.initializer if t.name not in unread]
    del graph.initializer[:]
    graph.initializer.extend(kept)


__all__ = ["castlike_as_cast"]
