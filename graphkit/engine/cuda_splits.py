"""Long splits as slices, for onnxruntime's CUDA provider.

onnxruntime's CUDA ``Split`` kernel fills, on the host and at every call, a table with
one entry per position of the split axis (which output each position goes to) and
copies it to the GPU before its kernel runs. For the packed optimizer update of
:mod:`graphkit.training.step`, a ``Split`` of every weight laid end to end, that is one
entry per weight: measured on an H100 with onnxruntime-gpu 1.31.1
(``benchmarks/results/peers-cuda.md``), the ``Split`` of the 669,706 weights of the MLP
784-512-512-10 took 4.2 ms a call, more than the rest of the training step. A ``Slice``
per output copies the same values with a table per dimension, not per position.

:func:`split_long_axes_as_slices` rewrites every ``Split`` whose sizes are constant and
whose axis is at least :data:`LONG_AXIS` long into one ``Slice`` per output, in the
graph and in its subgraphs (a ``Scan`` body runs the update of a whole-epoch run). The
outputs keep their names and values; shorter splits, whose table is small, stay.
``graphkit.engine.ort_engine.inference_session`` applies it to the sessions it opens
on CUDA.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from graphkit._graph import (
    all_graphs,
    constant_tensors,
    copy_model,
    fresh_name,
    graph_names,
    int_constant,
)
from graphkit.tensor_store import tensor_value

LONG_AXIS = 4096
"""Positions along the split axis from which a ``Split`` becomes ``Slice`` nodes."""


def split_long_axes_as_slices(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each long ``Split`` of constant sizes written as ``Slice`` nodes
    (see the module docstring); ``model`` itself when there is none."""
    constants = _constants(model)
    if not any(_slices_of(n, constants) for g in all_graphs(model.graph) for n in g.node):
        return model
    model = copy_model(model)
    taken = graph_names(model.graph)
    # lazily: a subgraph is reached through its parent's rewritten nodes
    for graph in all_graphs(model.graph):
        nodes: list[onnx.NodeProto] = []
        for node in graph.node:
            bounds = _slices_of(node, constants)
            if not bounds:
                nodes.append(node)
                continue
            axes = fresh_name(f"{node.name or 'split'}/axes", taken)
            nodes.append(int_constant(axes, [_axis(node)]))
            for output, (start, end) in zip(node.output, bounds):
                if not output:  # an output nobody reads
                    continue
                starts, ends = (
                    fresh_name(f"{output}/start", taken),
                    fresh_name(f"{output}/end", taken),
                )
                nodes += [int_constant(starts, [start]), int_constant(ends, [end])]
                nodes.append(
                    helper.make_node(
                        "Slice",
                        [node.input[0], starts, ends, axes],
                        [output],
                        name=fresh_name(f"{output}/slice", taken),
                    )
                )
        del graph.node[:]
        graph.node.extend(nodes)
    return model


def _slices_of(
    node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]
) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each output of a long ``Split`` with constant sizes; ``[]``
    for any other node."""
    if node.op_type != "Split" or node.domain not in ("", "ai.onnx"):
        return []
    if len(node.input) < 2 or node.input[1] not in constants:
        return []  # sizes from the input's shape (equal parts), computed or fed: left alone
    sizes = [int(s) for s in tensor_value(constants[node.input[1]]).reshape(-1)]
    if len(sizes) != len(node.output) or sum(sizes) < LONG_AXIS or min(sizes, default=0) < 0:
        return []
    ends = np.cumsum(sizes).tolist()
    return list(zip([0, *ends[:-1]], ends))


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _constants(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """The constants of the graph and its subgraphs, by name (names are unique across
    them), as tensors: only a ``Split``'s sizes are ever read into numpy."""
    return {name: t for g in all_graphs(model.graph) for name, t in constant_tensors(g)}


__all__ = ["LONG_AXIS", "split_long_axes_as_slices"]
