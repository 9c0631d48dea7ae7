"""Operators newer than graphkit's opset ceiling, expanded into the ones they are made of.

ONNX defines some operators as functions of older ones, their bodies built for each
node from its attributes and input types (a *context-dependent* function). torch's
dynamo exporter writes two of them from opset 23 on: ``Attention``
(``F.scaled_dot_product_attention``) and ``RMSNormalization`` (``nn.RMSNorm``). Neither
exists at opset 21, the newest onnxruntime-training 1.19.2 loads, so onnx's version
converter cannot take such a model down to it. :func:`new_operators_expanded`, which
:func:`graphkit.compat.make_compatible` runs before converting a model down, replaces
each of these nodes by the body onnx itself builds for it
(``OpSchema.get_context_dependent_function``): the same function, in operators every
backend differentiates, after which the model converts down like any other::

    Y = Attention(Q, K, V, attn_mask, is_causal=1)
    ==>  the MatMul, Mul (scale), Add / Where (mask), Softmax, MatMul of onnx's body

Only the main graph is expanded; a node whose input types shape inference cannot give
is left as it is (and refused by the opset conversion, naming the opset).
"""

from __future__ import annotations

import onnx
from onnx import defs

EXPANDED = frozenset({"Attention", "RMSNormalization"})
"""The operators :func:`new_operators_expanded` expands (opset 23's, as dynamo writes them)."""


def new_operators_expanded(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each node of :data:`EXPANDED` in its main graph replaced by onnx's
    function body for it (a copy; ``model`` itself when there is none)."""
    if not any(_expandable(n) for n in model.graph.node):
        return model
    try:
        typed = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # without types, no body can be built: the conversion says why
        return model
    types = {v.name: v.type for v in [*typed.input, *typed.value_info, *typed.output]}
    for tensor in model.graph.initializer:
        types.setdefault(tensor.name, _tensor_type(tensor))
    opsets = {o.domain or "": o.version for o in model.opset_import}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    fresh = _namer(out.graph)
    nodes: list[onnx.NodeProto] = []
    expanded = False
    for node in out.graph.node:
        body = _body(node, types, opsets.get("", 0)) if _expandable(node) else None
        if body is None:
            nodes.append(node)
            continue
        nodes.extend(_inlined(node, body, fresh, types))
        expanded = True
    if not expanded:
        return model
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _namer(graph: onnx.GraphProto):
    """Fresh names ``expanded/<name>[_k]`` no tensor or node of ``graph`` has. (Written
    here: :mod:`graphkit._graph` imports :mod:`graphkit.compat`, which imports this.)"""
    taken = {name for node in graph.node for name in [*node.input, *node.output, node.name]}
    taken |= {v.name for v in [*graph.input, *graph.output, *graph.initializer]}

    def fresh(name: str) -> str:
        candidate, k = f"expanded/{name}", 0
        while candidate in taken:
            k += 1
            candidate = f"expanded/{name}_{k}"
        taken.add(candidate)
        return candidate

    return fresh


def _expandable(node: onnx.NodeProto) -> bool:
    return node.op_type in EXPANDED and node.domain in ("", "ai.onnx")


def _tensor_type(tensor: onnx.TensorProto) -> onnx.TypeProto:
    return onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))


def _body(
    node: onnx.NodeProto, types: dict[str, onnx.TypeProto], opset: int
) -> onnx.FunctionProto | None:
    """onnx's function body for ``node`` at ``opset``, or None when an input's type is
    unknown or onnx builds none."""
    given = [name for name in node.input if name]
    if any(name not in types for name in given):
        return None
    inputs = [
        types[name].SerializeToString() if name else onnx.TypeProto().SerializeToString()
        for name in node.input
    ]
    try:
        schema = defs.get_schema(node.op_type, opset, "")
        built = schema.get_context_dependent_function(node.SerializeToString(), inputs)  # type: ignore[attr-defined]  # (onnx's stubs lack it)
    except Exception:  # no body for this node (an unsupported attribute, say)
        return None
    if not built:
        return None
    return onnx.FunctionProto.FromString(built)


def _inlined(
    node: onnx.NodeProto, body: onnx.FunctionProto, fresh, types: dict[str, onnx.TypeProto]
) -> list[onnx.NodeProto]:
    """``body``'s nodes computing ``node``'s outputs from its inputs, their other
    tensors renamed apart. A ``Cast`` of an input to the type it has already (the bodies
    cast to the computation's precision) is left out: onnxruntime-training's
    forward/backward builder fails on one ("Argument mismatch when removing edge")."""
    renamed = dict(zip(body.input, node.input))
    renamed.update(zip(body.output, node.output))
    nodes = []
    for inner in body.node:
        source = renamed.get(inner.input[0], "") if inner.input else ""
        to = next((a.i for a in inner.attribute if a.name == "to"), None)
        known = types.get(source)
        if (
            inner.op_type == "Cast"
            and known is not None
            and known.tensor_type.elem_type == to
            and inner.output[0] not in renamed
        ):
            renamed[inner.output[0]] = source  # no-op: read the input itself
            continue
        copy = onnx.NodeProto()
        copy.CopyFrom(inner)
        for k, name in enumerate(copy.input):
            if name:
                copy.input[k] = renamed.setdefault(name, fresh(name))
        for k, name in enumerate(copy.output):
            if name:
                copy.output[k] = renamed.setdefault(name, fresh(name))
        copy.name = fresh(inner.name or inner.op_type)
        nodes.append(copy)
    return nodes


__all__ = ["EXPANDED", "new_operators_expanded"]
