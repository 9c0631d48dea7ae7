"""Operators newer than graphkit's opset ceiling, expanded into the ones they are made of.

ONNX defines some operators as functions of older ones: a fixed body (``Swish``,
``SwiGLU``), or one built for each node from its attributes and input types (a
*context-dependent* function: ``Attention``, ``RMSNormalization``, ``RotaryEmbedding``).
torch's dynamo exporter writes ``Attention`` (``F.scaled_dot_product_attention``) and
``RMSNormalization`` (``nn.RMSNorm``) from opset 23 on. None of these exists at opset 21,
the newest onnxruntime-training 1.19.2 loads, so onnx's version converter cannot take
such a model down to it. :func:`new_operators_expanded`, which
:func:`graphkit.compat.make_compatible` runs before converting a model down, replaces
each node of an operator the ceiling's opset lacks by the body onnx itself has for it
(``OpSchema.get_context_dependent_function``, or ``OpSchema.function_body`` with the
node's attributes, or their defaults, bound): the same function, in operators every
backend differentiates, after which the model converts down like any other::

    Y = Attention(Q, K, V, attn_mask, is_causal=1)
    ==>  the MatMul, Mul (scale), Add / Where (mask), Softmax, MatMul of onnx's body

A body that holds such an operator itself (``SwiGLU``'s ``Swish``) is expanded in turn.
Only the main graph is expanded; a node whose input types shape inference cannot give
is left as it is (and refused by the opset conversion, naming the opset).
"""

from __future__ import annotations

import onnx
from onnx import defs

ROUNDS = 4
"""How many times bodies are expanded in turn (a body holding a newer operator)."""


def new_operators_expanded(model: onnx.ModelProto, ceiling: int = 21) -> onnx.ModelProto:
    """``model`` with each node of its main graph whose operator does not exist at opset
    ``ceiling`` replaced by onnx's function body for it (a copy; ``model`` itself when
    there is none)."""
    out = model
    for _ in range(ROUNDS):
        expanded = _expanded_once(out, ceiling)
        if expanded is out:
            break
        out = expanded
    return out


def _expanded_once(model: onnx.ModelProto, ceiling: int) -> onnx.ModelProto:
    if not any(_expandable(n, ceiling) for n in model.graph.node):
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
        body = _body(node, types, opsets.get("", 0)) if _expandable(node, ceiling) else None
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


def _expandable(node: onnx.NodeProto, ceiling: int) -> bool:
    """Whether ``node`` is a standard operator opset ``ceiling`` does not have."""
    if node.domain not in ("", "ai.onnx"):
        return False
    try:
        defs.get_schema(node.op_type, ceiling, "")
    except defs.SchemaError:
        return defs.has(node.op_type)
    return False


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
        if schema.has_function:  # type: ignore[attr-defined]  # (onnx's stubs lack it)
            return _bound(schema, node)
        built = schema.get_context_dependent_function(node.SerializeToString(), inputs)  # type: ignore[attr-defined]  # (onnx's stubs lack it)
    except Exception:  # no body for this node (an unsupported attribute, say)
        return None
    if not built:
        return None
    return onnx.FunctionProto.FromString(built)


def _bound(schema: defs.OpSchema, node: onnx.NodeProto) -> onnx.FunctionProto:
    """``schema``'s fixed body, each reference to an attribute (``@alpha``) replaced by
    ``node``'s value for it, else the schema's default (else the attribute left out)."""
    given = {a.name: a for a in node.attribute}
    body = onnx.FunctionProto()
    body.CopyFrom(schema.function_body)
    for inner in body.node:
        kept = []
        for attribute in inner.attribute:
            if not attribute.ref_attr_name:
                kept.append(attribute)
                continue
            source = given.get(attribute.ref_attr_name)
            if source is None and attribute.ref_attr_name in schema.attributes:
                default = schema.attributes[attribute.ref_attr_name].default_value
                source = default if default.type else None
            if source is not None:
                bound = onnx.AttributeProto()
                bound.CopyFrom(source)
                bound.name = attribute.name
                kept.append(bound)
        del inner.attribute[:]
        inner.attribute.extend(kept)
    return body


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


__all__ = ["new_operators_expanded"]
