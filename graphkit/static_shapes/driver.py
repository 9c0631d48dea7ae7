""":func:`specialize`: the batch size fixed, then every rule of
:mod:`graphkit.static_shapes`, in order."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx

from graphkit._graph import copy_model
from graphkit.decay_factors import gather_decay
from graphkit.static_shapes.folding import Fold, fold
from graphkit.static_shapes.gemms import fuse_gemms
from graphkit.static_shapes.kernels import fewer_kernels
from graphkit.static_shapes.reductions import simplify_reductions
from graphkit.static_shapes.scan_bodies import specialize_scan_bodies
from graphkit.static_shapes.shape_constants import shapes_as_constants
from graphkit.static_shapes.shapes import static_shapes

FOLDING_ROUNDS = 4
"""Rounds of folding at most: folding a BroadcastGradientArgs opens more folding after it."""


def fix_batch(model: onnx.ModelProto, batch: Mapping[str, int]) -> onnx.ModelProto:
    """A copy of ``model`` whose inputs in ``batch`` have that first dimension (a symbolic
    dimension fixed so has that size wherever it appears); its outputs keep only their
    element type and rank, their shapes inferred again."""
    fixed = copy_model(model)
    inputs = {i.name: i for i in fixed.graph.input}
    symbols = {}  # a symbolic dimension fixed here has that size wherever it appears
    for name, size in batch.items():
        dims = inputs[name].type.tensor_type.shape.dim
        if dims:
            if dims[0].dim_param:
                symbols[dims[0].dim_param] = int(size)
            dims[0].Clear()
            dims[0].dim_value = int(size)
    for value in [*fixed.graph.value_info, *fixed.graph.input]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in symbols:
                size = symbols[dim.dim_param]
                dim.Clear()
                dim.dim_value = size
    # outputs keep only their element type: their shapes are inferred again
    for output in fixed.graph.output:
        for dim in output.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.Clear()
    # the gradient builder's value_info is kept: onnxruntime 1.19.2 crashes on some
    # gradient graphs (a ConvGrad after a MaxPoolGrad) whose types it has to infer again
    return fixed


def specialize(
    model: onnx.ModelProto, batch: Mapping[str, int], folds: Sequence[Fold] = ()
) -> onnx.ModelProto:
    """``model`` with the first dimension of each input in ``batch`` fixed to its value,
    and every computation that became constant folded away (see
    :mod:`graphkit.static_shapes`), ``folds`` (a backend's, for its own operators)
    included.

    The result computes the same values as ``model`` on inputs of those sizes; its
    outputs and inputs keep their names.
    """
    fixed = fix_batch(model, batch)
    for _ in range(FOLDING_ROUNDS):
        shapes_as_constants(fixed)
        fixed = fold(fixed)
        changed = [f(fixed) for f in folds]
        if not any(changed):
            break
    fixed = simplify_reductions(fixed)
    # the reductions' rewrites leave Reshapes a backend's simplifications may merge
    if any([f(fixed) for f in folds]):
        fixed = fold(fixed)
    # one inference for both: fewer_kernels changes no shape fuse_gemms reads
    shapes = static_shapes(fixed)
    fewer_kernels(fixed, shapes)
    fuse_gemms(fixed, shapes)
    gather_decay(fixed, shapes)  # reads no name fuse_gemms rewrites
    specialize_scan_bodies(fixed, folds, specialize)
    return fixed


__all__ = ["FOLDING_ROUNDS", "fix_batch", "specialize"]
