"""``MaxUnpool`` as a ``ScatterND``, for onnxruntime's CUDA provider.

graphkit sends a tiling max pooling's gradient back with a ``MaxUnpool``
(:mod:`graphkit.backends.pool_adjoints`), which onnxruntime's CPU runs 4 to 9 times
faster than a scatter. onnxruntime's CUDA provider has no ``MaxUnpool`` kernel (its
``providers/cuda/nn`` holds the poolings, not the unpooling), so a CUDA session would
run the node on the CPU and copy its input and output across at every step.

:func:`max_unpools_as_scatters` writes each ``MaxUnpool`` as the same values: zeros of
the unpooled shape, ``X`` written at the flat positions ``I`` holds, in the graph and
its subgraphs (where two values share a position, after an overlapping pooling, both
keep one of them, not necessarily the same one). The unpooled shape is ``output_shape``
where it is given, else the one ``MaxUnpool`` infers from its attributes,
``(in - 1) * stride + kernel - pads`` on each spatial axis.
``graphkit.engine.ort_engine.inference_session`` applies it to the sessions it opens
on CUDA.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from graphkit._graph import NodeWriter, all_graphs, copy_model, graph_names, namer
from graphkit.compat import opset_of


def max_unpools_as_scatters(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ``MaxUnpool`` written as a ``ScatterND`` into zeros (a copy;
    ``model`` itself when it has none, or an opset before 15, which has no ``CastLike``:
    there the CPU runs the node)."""
    if (opset_of(model) or 0) < 15:
        return model
    if not any(_is_unpool(n) for g in all_graphs(model.graph) for n in g.node):
        return model
    rewritten = copy_model(model)
    # one name space: a subgraph's names must not repeat the graph's around it
    taken = set().union(*(graph_names(g) for g in all_graphs(rewritten.graph)))
    fresh = namer("unpool", taken)
    for graph in all_graphs(rewritten.graph):
        if not any(_is_unpool(n) for n in graph.node):
            continue
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            nodes.extend(_as_scatter(node, fresh) if _is_unpool(node) else [node])
        del graph.node[:]
        graph.node.extend(nodes)
    return rewritten


def _is_unpool(node: onnx.NodeProto) -> bool:
    return node.op_type == "MaxUnpool" and node.domain in ("", "ai.onnx")


def _as_scatter(node: onnx.NodeProto, fresh) -> list[onnx.NodeProto]:
    """The nodes that compute ``node``'s output with a ``ScatterND``."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    kernel = list(attrs["kernel_shape"])
    n = len(kernel)
    strides = list(attrs.get("strides", [1] * n))
    pads = list(attrs.get("pads", [0] * 2 * n))
    values, indices = node.input[0], node.input[1]
    w = NodeWriter(fresh)
    op, ints = w.op, w.ints

    if len(node.input) > 2 and node.input[2]:
        shape = node.input[2]
    else:  # (in - 1) * stride + kernel - pads, batch and channels as they are
        given = op("Shape", [values])
        spatial = op("Slice", [given, ints([2]), ints([2 + n])])
        stepped = op("Mul", [op("Sub", [spatial, ints([1] * n)]), ints(strides)])
        spans = [k - pads[i] - pads[n + i] for i, k in enumerate(kernel)]
        unpooled = op("Add", [stepped, ints(spans)])
        shape = op("Concat", [op("Slice", [given, ints([0]), ints([2])]), unpooled], axis=0)
    size = op("ReduceProd", [shape], keepdims=1)
    zero = op("CastLike", [_zero(w), values])
    zeros = op("Expand", [zero, size])
    flat = ints([-1])
    where = op("Unsqueeze", [op("Reshape", [indices, flat]), flat])
    placed = op("ScatterND", [zeros, where, op("Reshape", [values, flat])])
    w.nodes.append(helper.make_node("Reshape", [placed, shape], [node.output[0]]))
    return w.nodes


def _zero(w: NodeWriter) -> str:
    """A float32 scalar 0 written as a Constant; its name."""
    out = w.fresh("zero")
    zero = onnx.numpy_helper.from_array(np.array(0, np.float32))
    w.nodes.append(helper.make_node("Constant", [], [out], value=zero))
    return out


__all__ = ["max_unpools_as_scatters"]
