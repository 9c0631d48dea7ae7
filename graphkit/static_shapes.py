"""Specialize a graph to a concrete batch size, so that its shape arithmetic disappears.

A training step built for a dynamic batch dimension spends most of its kernels on shape
plumbing: ``Shape``, ``Reshape(label, Shape(Y))``, ``Expand``, and onnxruntime-training's
``BroadcastGradientArgs``, which tells a gradient which axes to sum. Once every input
shape is known, all of it is constant. :func:`specialize` fixes the batch dimension of
the named inputs and folds what became constant:

* onnxscript's constant folding (with onnx shape inference) evaluates ``Shape``, ``Size``,
  shape arithmetic and every node whose inputs are all constant;
* :func:`broadcast_gradient_args` evaluates ``BroadcastGradientArgs`` on constant shapes
  (onnx's shape inference does not know that operator);
* unused nodes go, common subexpressions (the same bias-correction power in every weight's
  Adam update) are computed once.

onnxscript's *rewrite rules* are deliberately not applied: they treat a constant within
1e-8 of zero as zero (``x + 1e-8 -> x``), which deletes Adam's epsilon. Folding only
evaluates what the graph computes, so the specialized graph computes the same values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from graphkit._graph import copy_model

_MS = "com.microsoft"


def broadcast_gradient_args(a: Sequence[int], b: Sequence[int]) -> tuple[list[int], list[int]]:
    """onnxruntime's BroadcastGradientArgs on concrete shapes: for each operand, the axes
    of the broadcast result (decreasing) its gradient is summed over. With both shapes
    left-padded with 1 to rank r, axis i belongs to a's list when it pads a, or when
    a_i = 1 and b_i != 1; symmetrically for b."""
    rank = max(len(a), len(b))
    pa = [1] * (rank - len(a)) + list(a)
    pb = [1] * (rank - len(b)) + list(b)
    axes_a = [i for i in reversed(range(rank)) if i < rank - len(a) or (pa[i] == 1 != pb[i])]
    axes_b = [i for i in reversed(range(rank)) if i < rank - len(b) or (pb[i] == 1 != pa[i])]
    return axes_a, axes_b


def _fold_broadcast_gradient_args(model: onnx.ModelProto) -> bool:
    """Replace each BroadcastGradientArgs whose two inputs are constant by initializers."""
    constants = {t.name: t for t in model.graph.initializer}
    kept, folded = [], False
    for node in model.graph.node:
        if (
            node.op_type == "BroadcastGradientArgs"
            and node.domain == _MS
            and all(name in constants for name in node.input)
        ):
            shapes = [numpy_helper.to_array(constants[name]).tolist() for name in node.input]
            for name, axes in zip(node.output, broadcast_gradient_args(*shapes)):
                if name:
                    model.graph.initializer.append(
                        numpy_helper.from_array(np.array(axes, dtype=np.int64), name)
                    )
            folded = True
        else:
            kept.append(node)
    del model.graph.node[:]
    model.graph.node.extend(kept)
    return folded


def _fold(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant folding with shape inference, dead-node removal and CSE (no rewrites)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer._constant_folding import FoldConstantsPass

    passes = ir.passes.Sequential(
        common.InlinePass(),
        FoldConstantsPass(shape_inference=True, input_size_limit=8192, output_size_limit=8192),
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedOpsetsPass(),
    )
    graph = ir.serde.deserialize_model(model)
    passes(graph)
    return ir.serde.serialize_model(graph)


def specialize(model: onnx.ModelProto, batch: Mapping[str, int]) -> onnx.ModelProto:
    """``model`` with the first dimension of each input in ``batch`` fixed to its value,
    and every computation that became constant folded away (see the module docstring).

    The result computes the same values as ``model`` on inputs of those sizes; its
    outputs and inputs keep their names.
    """
    fixed = copy_model(model)
    inputs = {i.name: i for i in fixed.graph.input}
    for name, size in batch.items():
        dims = inputs[name].type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_value = int(size)
    # outputs keep only their element type: their shapes are inferred again
    for output in fixed.graph.output:
        for dim in output.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.Clear()
    # the gradient builder's value_info is kept: onnxruntime 1.19.2 crashes on some
    # gradient graphs (a ConvGrad after a MaxPoolGrad) whose types it has to infer again
    for _ in range(4):  # folding a BroadcastGradientArgs opens more folding after it
        fixed = _fold(fixed)
        if not _fold_broadcast_gradient_args(fixed):
            break
    return fixed


__all__ = ["broadcast_gradient_args", "specialize"]
