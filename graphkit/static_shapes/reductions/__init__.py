""":func:`simplify_reductions`: the rules that rewrite single nodes once shapes are known,
run over a graph in one pass.

Node by node, in the graph's order:

* a Transpose of :mod:`.matmul_transposes` is left for onnxruntime to fuse;
* a Transpose or a reduction of a tensor with axes of size 1: :mod:`.squeeze_units`
  (a ReduceSum inside it then takes :mod:`.reduce_sum` too, the Reshapes chained);
* any other ``ReduceSum``: :mod:`.reduce_sum` (with :mod:`.summed_product`);
* ``Add``, ``Sub``, ``Mul``, ``Div``: :mod:`.times_ones`, else :mod:`.match_ranks`;
* ``Reshape``: :mod:`.same_shape`.

Then reads of dropped tensors follow to what replaced them, the products
:mod:`.summed_product` left unread go, and so do the initializers nothing reads (the old
reductions' axes: onnxruntime warns about unused initializers)."""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from graphkit._graph import (
    REDUCTIONS,
    _subgraphs,
    copy_model,
    graph_names,
    outer_reads,
    read_counts,
    rename_subgraph_reads,
)
from graphkit.static_shapes.reductions.context import Context
from graphkit.static_shapes.reductions.match_ranks import (
    ELEMENTWISE,
    RESHAPE_SCALARS_FROM,
    match_ranks,
)
from graphkit.static_shapes.reductions.matmul_transposes import matmul_transposes
from graphkit.static_shapes.reductions.reduce_sum import reduce_sum
from graphkit.static_shapes.reductions.same_shape import reshape_to_own_shape
from graphkit.static_shapes.reductions.squeeze_units import squeeze_units
from graphkit.static_shapes.reductions.times_ones import times_ones
from graphkit.static_shapes.shapes import STANDARD, static_shapes


def simplify_reductions(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every ReduceSum of known shape replaced by faster equivalents
    (see the module docstring); multiplications by a constant of ones and reshapes to
    the shape a tensor already has are dropped.

    The sums are the same up to float rounding (a MatMul adds in another order).
    """
    out = copy_model(model)
    simplify(out.graph, static_shapes(out))
    return out


def simplify(graph: onnx.GraphProto, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Rewrites ``graph``'s nodes in place (see the module docstring)."""
    ctx = Context(graph, shapes)
    outputs = {o.name for o in graph.output}
    renamed: dict[str, str] = {}
    nodes: list[onnx.NodeProto] = []
    fused = matmul_transposes(graph, ctx.shapes)
    for node in graph.node:
        standard = node.domain in STANDARD
        replacement = None
        if node.op_type == "Transpose" and node.output[0] in fused:
            pass
        elif standard and (node.op_type in REDUCTIONS or node.op_type == "Transpose"):
            replacement = squeeze_units(ctx, node)
            if replacement is not None:
                inner = replacement[1] if len(replacement) == 3 else None
                if inner is not None and inner.op_type == "ReduceSum":
                    summed = reduce_sum(ctx, inner)
                    if summed is not None:
                        replacement[1:2] = summed
                        replacement = chain_reshapes(replacement)
            elif node.op_type == "ReduceSum":
                replacement = reduce_sum(ctx, node)
        elif standard and node.op_type in ELEMENTWISE:
            factor = times_ones(ctx, node) if node.output[0] not in outputs else None
            if factor is not None:
                renamed[node.output[0]] = factor
                continue
            nodes.extend(match_ranks(ctx, node))
        elif standard and node.op_type == "Reshape" and node.output[0] not in outputs:
            x = reshape_to_own_shape(ctx, node)
            if x is not None:
                renamed[node.output[0]] = x  # already of that shape (a bias flattened)
                continue
        nodes.extend(replacement if replacement is not None else [node])
    for node in nodes:
        node.input[:] = [follow(renamed, i) for i in node.input]
        if renamed and any(True for _ in _subgraphs(node)):  # read inside a Loop's body
            for name in outer_reads(node) & renamed.keys():
                rename_subgraph_reads(node, name, follow(renamed, name))
    nodes = without_orphans(nodes, ctx.orphans, outputs)
    del graph.node[:]
    graph.node.extend(nodes)
    read = {i for node in nodes for i in node.input} | outputs
    for node in nodes:
        read.update(name for sub in _subgraphs(node) for name in graph_names(sub))
    unused = [t for t in graph.initializer if t.name not in read]
    for tensor in unused:
        graph.initializer.remove(tensor)


def follow(renamed: Mapping[str, str], name: str) -> str:
    """What ``name`` reads now that the nodes of ``renamed``'s keys are gone."""
    while name in renamed:
        name = renamed[name]
    return name


def chain_reshapes(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with each Reshape read by the next Reshape merged into it (their
    intermediate names are this rewrite's own: nothing else reads them)."""
    merged: list[onnx.NodeProto] = []
    for node in nodes:
        last = merged[-1] if merged else None
        if (
            last is not None
            and node.op_type == last.op_type == "Reshape"
            and node.input[0] == last.output[0]
        ):
            node.input[0] = last.input[0]
            merged[-1] = node
        else:
            merged.append(node)
    return merged


def without_orphans(
    nodes: list[onnx.NodeProto], orphans: list[onnx.NodeProto], outputs: set[str]
) -> list[onnx.NodeProto]:
    """``nodes`` without the ``orphans`` no node reads any more (nor their inputs'
    producers that only they read), last first."""
    read = read_counts(nodes, outputs)
    dropped: set[int] = set()
    for orphan in orphans:  # a product before its operand's Transpose
        if any(read.get(o, 0) for o in orphan.output):
            continue
        dropped.add(id(orphan))
        for name in outer_reads(orphan):
            read[name] -= 1
    return [node for node in nodes if id(node) not in dropped]


__all__ = [
    "RESHAPE_SCALARS_FROM",
    "Context",
    "matmul_transposes",
    "simplify",
    "simplify_reductions",
]
