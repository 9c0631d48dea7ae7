"""Specialize a graph to a concrete batch size, so that its shape arithmetic disappears.

A training step built for a dynamic batch dimension spends most of its kernels on shape
plumbing: ``Shape``, ``Reshape(label, Shape(Y))``, ``Expand``, and a gradient source's
own shape operators (onnxruntime-training's ``BroadcastGradientArgs``, which tells a
gradient which axes to sum). Once every input shape is known, all of it is constant.
:func:`specialize` (:mod:`.driver`) fixes the batch dimension of the named inputs, then
applies these rules in this order, each a module of its own (its formula, why, and what
it was measured to gain in its docstring):

1. folding, at most :data:`~.driver.FOLDING_ROUNDS` rounds of

   * :mod:`.shape_constants`: ``Shape`` of a tensor of inferred shape -> a constant;
   * :mod:`.folding`: onnxscript's constant folding (with onnx shape inference)
     evaluates ``Shape``, ``Size``, shape arithmetic and every node whose inputs are all
     constant; unused nodes go, common subexpressions (the same bias-correction power in
     every weight's Adam update) are computed once;
   * the backend's ``folds``, its own operators on constant inputs (onnx's shape
     inference does not know them; see ``constant_folds`` of
     :class:`graphkit.backends.base.GradientSource`);

2. :func:`simplify_reductions` (:mod:`.reductions`), one pass over the nodes:

   * :mod:`.reductions.reduce_sum`: each ``ReduceSum`` whose shape is now known as what
     onnxruntime runs fastest: a ``Reshape`` when it sums over axes of size 1, a full
     reduction when every kept axis has size 1, a ``MatMul`` with a vector of ones when
     it sums a leading or trailing block of axes (onnxruntime's ReduceSum over the batch
     axis of a 256x256 tensor takes 40 us, the MatMul 5 us: it is every bias gradient;
     the ones are a column for a trailing block, as a 1-D right operand is onnxruntime's
     slow path);
   * :mod:`.reductions.summed_product`: a sum over the batch of a batched ``x^T dy`` (a
     weight multiplying a [B, S, in] input) as one product of the batch laid end to
     end, ``X^T DY``;
   * :mod:`.reductions.squeeze_units`: each ``Transpose`` and each reduction
     (``ReduceSum``, ``ReduceMean``...) of a tensor with axes of size 1 (a gradient
     source's seed axis, ``[N, C, H, W, 1]``) on the tensor without them, between two
     ``Reshape`` (which move no data): onnxruntime's kernels take a slow path for such
     shapes, 50x for a Transpose of ``[64, 16, 28, 28, 1]`` (2930 us against 58), 35x
     for a ReduceSum over the softmax axis of ``[32, 4, 32, 32, 1]`` (400 us against
     11.5);
   * :mod:`.reductions.matmul_transposes`: a Transpose only MatMuls read is left to
     onnxruntime's ``FusedMatMul``;
   * :mod:`.reductions.times_ones` and :mod:`.reductions.same_shape`: multiplying by a
     constant of ones and reshaping a tensor to the shape it has go;
   * :mod:`.reductions.match_ranks`: a one-element constant operand of ``Add``, ``Sub``,
     ``Mul``, ``Div`` takes the rank of the other operand (onnxruntime broadcasts a
     lower-rank scalar over an ``(n, 1)`` tensor one element at a time);

   then the backend's ``folds`` again, and folding if they changed anything;
3. :func:`~.kernels.fewer_kernels` (:mod:`.kernels`): a squared error's sum of squares
   and its doubled gradient, a classification loss's sum of per-sample sums, and a small
   ReLU gradient's mask, one kernel each instead of two;
4. :func:`~.gemms.fuse_gemms` (:mod:`.gemms`): a weight's gradient and its SGD update as one
   ``Gemm``, a large product of a transposed matrix as a ``Gemm`` with its ``trans``
   attribute (:data:`GEMM_ABOVE`), and the transpose of a product as the product of the
   transposes (a transformer's native step: 5140 -> 4970 us a batch, 47 -> 25
   Transposes in the graph onnxruntime receives);
5. :func:`graphkit.decay_factors.gather_decay`: a decoupled weight decay's update
   (AdamW's) with its scalar factors gathered: two passes over the weights fewer;
6. :mod:`.scan_bodies`: the body of each ``Scan`` specialized the same way, as a graph
   of its own.

onnxscript's *rewrite rules* are deliberately not applied: they treat a constant within
1e-8 of zero as zero (``x + 1e-8 -> x``), which deletes Adam's epsilon. Folding only
evaluates what the graph computes, so the specialized graph computes the same values;
the rewrites above compute the same formulas, and only the gathered decay rounds in
another order (torch's).

The rules are protobuf code rather than onnxscript ``RewriteRule``\\ s: each reads
shapes inferred once for the whole graph, decides on readers of a tensor and on sizes
measured on onnxruntime, and the later rules depend on the node order and the names the
earlier ones write. The pattern rewriter does express :mod:`.kernels.sum_of_squares`
(one pattern per length of its Reshape chain), with the same nodes in the same order,
but it names the new node anew and drops the removed tensors' value_info (another
graph), and its round trip through onnx_ir takes twice as long on an MLP's step.
"""

from __future__ import annotations

from graphkit._graph import REDUCTIONS
from graphkit.static_shapes.driver import fix_batch, specialize
from graphkit.static_shapes.folding import Fold, fold
from graphkit.static_shapes.gemms import GEMM_ABOVE, GEMV_FUSED_UP_TO, fuse_gemms
from graphkit.static_shapes.kernels import SIGN_MASK_UP_TO, fewer_kernels
from graphkit.static_shapes.reductions import (
    RESHAPE_SCALARS_FROM,
    matmul_transposes,
    simplify_reductions,
)
from graphkit.static_shapes.scan_bodies import specialize_scan_bodies
from graphkit.static_shapes.shape_constants import (
    integer_arithmetic_as_constants,
    known_parts_as_constants,
    shapes_as_constants,
)
from graphkit.static_shapes.shapes import (
    last_two_swapped,
    reduce_axes,
    static_shapes,
    transpose_perm,
)

__all__ = [
    "GEMM_ABOVE",
    "GEMV_FUSED_UP_TO",
    "REDUCTIONS",
    "RESHAPE_SCALARS_FROM",
    "SIGN_MASK_UP_TO",
    "Fold",
    "fewer_kernels",
    "fix_batch",
    "fold",
    "fuse_gemms",
    "last_two_swapped",
    "matmul_transposes",
    "reduce_axes",
    "integer_arithmetic_as_constants",
    "known_parts_as_constants",
    "shapes_as_constants",
    "simplify_reductions",
    "specialize",
    "specialize_scan_bodies",
    "static_shapes",
    "transpose_perm",
]
