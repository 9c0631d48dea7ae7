"""Constant folding: what became constant once the shapes are fixed is computed once.

onnxscript's constant folding (with onnx shape inference) evaluates ``Shape``, ``Size``,
shape arithmetic and every node whose inputs are all constant; unused nodes go, common
subexpressions (the same bias-correction power in every weight's Adam update) are
computed once. Folding only evaluates what the graph computes: the folded graph computes
the same values. onnxscript's *rewrite rules* are not run here (see
:mod:`graphkit.static_shapes`: they treat 1e-8 as zero).
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from graphkit import tensor_store

Fold = Callable[[onnx.ModelProto], bool]
"""Folds what it can of a model in place; whether it changed anything."""


def fold(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant folding with shape inference, dead-node removal and CSE (no rewrites).

    onnxscript's public ``fold_constants`` (onnxscript >= 0.3) is its
    ``FoldConstantsPass`` run in place with these options; the other passes are onnx_ir's
    public ones (onnx-ir >= 0.1.1 has them all)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import fold_constants

    # weights mapped from their file (graphkit.tensor_store) are inputs to the folding:
    # onnx_ir would look for a file by their stored name
    model, stored = tensor_store.stored_as_inputs(model)
    graph = ir.serde.deserialize_model(model)
    common.InlinePass()(graph)
    # nodes whose inputs and outputs have at most 8192 elements each: a step's shape
    # arithmetic and small constants, never a computation on weight-sized tensors
    fold_constants(graph, onnx_shape_inference=True, input_size_limit=8192, output_size_limit=8192)
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedOpsetsPass(),
    )(graph)
    return tensor_store.stored_as_initializers(ir.serde.serialize_model(graph), stored)


__all__ = ["Fold", "fold"]
