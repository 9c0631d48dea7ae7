"""graphkit's own reverse rules, consulted before onnx-ad's.

onnx-ad 0.3.0 differentiates a few operators only when the *whole* shape of their input
is declared, batch dimension included, although their adjoint needs only the other
dimensions. graphkit's training graphs keep a symbolic batch dimension (the exported step
takes any batch size), so these rules replace onnx-ad's for:

* ``Conv``, with respect to its input: ``ConvTranspose`` of the incoming gradient with
  the weight, which needs the input's *spatial* size only (and spreads it back with the
  forward's own pads: onnx-ad's ``output_shape`` splits them evenly, which shifts the
  gradient of an unevenly padded convolution). Where they apply, the faster forms of
  :mod:`graphkit.backends.conv_adjoints` (a stride-1 input gradient as a ``Conv``, the
  weight gradient as a product of patches: a 28x28 CNN's batch 19 -> 10 ms);
* ``AveragePool``: the gradient divided by each window's count and spread back over the
  window (a grouped ``ConvTranspose`` with a kernel of ones), which needs the channel
  count and the spatial size only;
* ``Slice``: the gradient zero-padded back to the input's shape, which needs the size of
  the *sliced* axes only; with bounds computed in the graph (dynamo's ``EmbeddingBag``),
  padded by pads computed beside them;
* ``Concat``: the gradient split by the operands' extents, read at run time where one is
  not declared (TorchScript's rotary embedding).

Two rules are graphkit's for speed alone: a ``MaxPool`` whose windows tile its input
sends its gradient back with a ``MaxUnpool``, not onnx-ad's ``ScatterND``
(:mod:`graphkit.backends.pool_adjoints`), and a ``Relu``'s gradient reads its result,
not its input, so that onnxruntime can fuse the Relu into the node before it.

``Det`` is refused (onnx-ad takes its derivative for zero). It also completes two
rules: onnx-ad has no gradient for a ``ConvTranspose``'s weight (an
autoencoder's decoder), and gives an inference ``BatchNormalization`` no gradient for
its running mean and variance, which an exporter may tie to a trained weight.

Each falls back to onnx-ad's rule (and its explanation) when even those sizes are
unknown. Rules follow onnx-ad's conventions (a derivative carries a trailing axis of seed
directions) and use its helpers, which is why ``pyproject.toml`` pins its version.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from graphkit.backends import conv_adjoints, pool_adjoints
from graphkit.backends.native import recurrent

Rule = Callable[[Any, Any, list], list]


def _known(shape: tuple | None, axes: list[int]) -> bool:
    return shape is not None and all(shape[a] is not None for a in axes)


def transposing(attrs: dict, size: list[int], kernel: list[int]) -> dict:
    """The ``ConvTranspose`` attributes that spread a gradient back through a
    convolution or pooling of ``attrs`` over an input of spatial ``size`` with a
    ``kernel``: the same strides, dilations and pads, and the ``output_padding`` that
    restores the input's size (the positions the last stride did not reach).

    Not ``output_shape``: with it, ONNX derives the pads itself and splits them evenly,
    which shifts the gradient of a convolution padded unevenly (``pads=[0, 0, 1, 1]``,
    TensorFlow's SAME).
    """
    strides, dilations, pads = attrs["strides"], attrs["dilations"], attrs["pads"]
    n = len(size)
    padding = []
    for i in range(n):
        span = (kernel[i] - 1) * dilations[i] + 1
        positions = (size[i] + pads[i] + pads[n + i] - span) // strides[i] + 1
        reached = (positions - 1) * strides[i] + span - pads[i] - pads[n + i]
        padding.append(size[i] - reached)
    return {"strides": strides, "dilations": dilations, "pads": pads, "output_padding": padding}


def _bias_adjoint(ctx: Any, node: Any, seeded: str) -> list:
    """A (transposed) convolution's bias gradient, the incoming gradient summed over
    every axis but the channel's (``[]`` when it has no bias to differentiate)."""
    bias = node.input[2] if len(node.input) > 2 else ""
    if not bias or not ctx.asked_for(bias):
        return []
    outside = [a for a in range(ctx.rank(node.output[0])) if a != 1]
    return [ctx.reshape_like(ctx.reduce_sum(seeded, outside, keepdims=0), bias)]


def conv_reverse(ctx: Any, node: Any, grads: list) -> list:
    """``y = Conv(x, w, b)``: d/dx is a convolution of ``dy`` by the flipped, transposed
    weight where the strides are 1 and the weight has enough input channels
    (:func:`_input_adjoint_by_conv`), else ``ConvTranspose(dy, w)`` (:func:`transposing`);
    d/dw is a product of patches (:func:`_weight_adjoint_by_patches`) where the patches
    are small, else onnx-ad's; d/db is the summed ``dy``."""
    from onnx_ad import rules as ad

    x, w, y = node.input[0], node.input[1], node.output[0]
    shape, kernel = ctx.shapes.shape(x), ctx.shapes.static(w)
    known = _known(shape, list(range(2, len(shape or ())))) and kernel is not None
    if not known:
        return ad._conv_reverse(ctx, node, grads)
    attrs, spatial = ad._conv_attributes(ctx, node)
    seeded = ctx.full(grads[0], y)
    contributions: list = [None, None]
    if ctx.asked_for(x):
        folded = ad._fold_seed_into_batch(ctx, seeded, y)
        spread = _input_adjoint_by_conv(ctx, folded, w, attrs, list(kernel))
        if spread is None:
            transposed = transposing(attrs, list(shape[2:]), list(kernel[2:]))
            spread = ctx.b.op(
                "ConvTranspose", [folded, w], group=attrs["group"], stem="a_conv", **transposed
            )
        contributions[0] = ad._unfold_batch_into_seed(ctx, spread, x, ctx.rank(x))
    if ctx.asked_for(w):
        contributions[1] = _weight_adjoint_by_patches(
            ctx, node, attrs, spatial, seeded
        ) or ad._conv_weight_adjoint(ctx, node, attrs, spatial, seeded)
    return [*contributions, *_bias_adjoint(ctx, node, seeded)]


def _input_adjoint_by_conv(
    ctx: Any, folded: str, w: str, attrs: dict, kernel: list[int]
) -> str | None:
    """d/dx of a stride-1 ``y = Conv(x, w)``: ``Conv(dy, w')``
    (:mod:`graphkit.backends.conv_adjoints`), None where that form does not apply."""
    pads = conv_adjoints.input_adjoint_pads(
        kernel, attrs["group"], attrs["strides"], attrs["dilations"], attrs["pads"]
    )
    if pads is None:
        return None
    spatial = len(kernel) - 2
    swapped = ctx.b.op("Transpose", [w], perm=[1, 0, *range(2, 2 + spatial)], stem="a_conv_wt")
    flipped = ctx.b.op(
        "Slice",
        [
            swapped,
            ctx.b.ints([-1] * spatial),
            ctx.b.ints([conv_adjoints.REVERSED_END] * spatial),
            ctx.b.ints(list(range(2, 2 + spatial))),
            ctx.b.ints([-1] * spatial),
        ],
        stem="a_conv_wflip",
    )
    return ctx.b.op(
        "Conv", [folded, flipped], dilations=attrs["dilations"], pads=pads, stem="a_conv"
    )


def _weight_adjoint_by_patches(
    ctx: Any, node: Any, attrs: dict, spatial: int, seeded: str
) -> str | None:
    """d/dw of ``y = Conv(x, w)`` as one batched product of patches
    (:mod:`graphkit.backends.conv_adjoints`), the seed directions S riding with the
    output channels: ``dy`` as ``[N, O S, P]``. None where it does not apply: a group, a
    shape not declared, an opset before 13, patches above ``PATCHES_UP_TO``."""
    from onnx_ad import rules as ad

    x, w, y = node.input[0], node.input[1], node.output[0]
    shape, kernel, out = ctx.shapes.shape(x), ctx.shapes.static(w), ctx.shapes.shape(y)
    rank = 2 + spatial
    if (
        attrs["group"] != 1
        or ctx.opset < 13
        or kernel is None
        or not _known(shape, list(range(1, rank)))
        or not _known(out, list(range(1, rank)))
        or not conv_adjoints.patches_fit(shape[1], kernel[2:], out[2:])
    ):
        return None
    channels, positions = shape[1], math.prod(out[2:])
    windows = conv_adjoints.patch_windows(kernel[2:], out[2:], attrs["strides"], attrs["dilations"])
    pads = attrs["pads"]
    padded = (
        x if not any(pads) else ad._pad(ctx, x, [0, 0, *pads[:spatial]], [0, 0, *pads[spatial:]])
    )
    axes, steps = ctx.b.ints(list(range(2, rank))), ctx.b.ints(list(attrs["strides"]))
    patches = []
    for starts, ends in windows:
        patch = ctx.b.op(
            "Slice", [padded, ctx.b.ints(starts), ctx.b.ints(ends), axes, steps], stem="a_patch"
        )
        patches.append(ctx.b.op("Unsqueeze", [patch, ctx.b.ints([2])], stem="a_patch"))
    stacked = ctx.b.op("Concat", patches, axis=2, stem="a_patches")  # [N, C, K, out...]
    columns = ctx.b.op(
        "Reshape", [stacked, ctx.b.ints([-1, channels * len(windows), positions])], stem="a_patches"
    )
    rows = ctx.b.op("Transpose", [columns], perm=[0, 2, 1], stem="a_patches")  # [N, P, C K]
    # [N, O, out..., S] -> [N, O, S, out...] -> [N, O S, P]
    moved = ctx.b.op("Transpose", [seeded], perm=[0, 1, rank, *range(2, rank)], stem="a_dy")
    flat = ctx.b.op("Reshape", [moved, ctx.b.ints([0, -1, positions])], stem="a_dy")
    product = ctx.b.op("MatMul", [flat, rows], stem="a_conv_w")  # [N, O S, C K]
    summed = ctx.reduce_sum(product, [0], keepdims=0)
    split = ctx.b.op(
        "Reshape", [summed, ctx.b.ints([kernel[0], -1, channels, *kernel[2:]])], stem="a_split"
    )  # [O, S, C, k...] -> [O, C, k..., S]
    return ctx.b.op("Transpose", [split], perm=[0, *range(2, rank + 1), 1], stem="a_conv_weight")


def average_pool_reverse(ctx: Any, node: Any, grads: list) -> list:
    """d/dx of ``y = AveragePool(x)``: ``dy / count`` spread over each window."""
    from onnx_ad import rules as ad

    x, y = node.input[0], node.output[0]
    shape = ctx.shapes.shape(x)
    if not _known(shape, list(range(1, len(shape or ())))):
        return ad._average_pool_reverse(ctx, node, grads)  # its refusal
    attrs, _ = ad._pool_attributes(ctx, node, reverse=True)
    dtype = ctx.dtype(x)
    channels = shape[1]
    kernel = [channels, 1, *attrs["kernel_shape"]]
    ones = ctx.b.constant(np.ones(kernel), dtype, kernel)
    if ad.attribute(node, "count_include_pad", 0) or not any(attrs["pads"]):
        count = ctx.constant(float(np.prod(attrs["kernel_shape"])), dtype)
    else:  # padding excluded: the window sum of ones counts the real elements
        filled = ctx.b.op(
            "ConstantOfShape",
            [ctx.shape_of(x)],
            value=helper.make_tensor("one", dtype, [1], [1]),
            stem="ones",
        )
        summed = ctx.b.op("Conv", [filled, ones], group=channels, stem="count", **attrs)
        count = ctx.lift(summed)
    divided = ctx.b.op("Div", [ctx.full(grads[0], y), count])
    transposed = transposing(attrs, list(shape[2:]), attrs["kernel_shape"])
    folded = ad._fold_seed_into_batch(ctx, divided, y)
    spread = ctx.b.op(
        "ConvTranspose", [folded, ones], group=channels, stem="window_spread", **transposed
    )
    return [ad._unfold_batch_into_seed(ctx, spread, x, ctx.rank(x))]


def max_pool_reverse(ctx: Any, node: Any, grads: list) -> list:
    """d/dx of a float32 ``y = MaxPool(x)`` whose windows tile ``x`` without
    overlapping: ``dy`` put back at each window's maximum by a ``MaxUnpool``
    (:mod:`graphkit.backends.pool_adjoints`; onnxruntime's kernel is float32 only),
    onnx-ad's scatter elsewhere."""
    from onnx_ad import rules as ad

    x, y = node.input[0], node.output[0]
    shape = ctx.shapes.shape(x)
    unpool = None
    usable = ctx.opset >= 11 and ctx.shapes.dtype(x) == TensorProto.FLOAT  # its one kernel
    if usable and ad.attribute(node, "storage_order", 0) == 0 and shape is not None:
        attrs, _ = ad._pool_attributes(ctx, node, reverse=False)
        unpool = pool_adjoints.unpooling(
            attrs["kernel_shape"],
            attrs["strides"],
            attrs["pads"],
            attrs["dilations"],
            ad.attribute(node, "ceil_mode", 0),
            list(shape[2:]),
        )
    if unpool is None:
        return ad._max_pool_reverse(ctx, node, grads)
    # graphkit seeds one direction: the seed axis has size 1 (Squeeze refuses any other)
    dy = ctx.squeeze(ctx.full(grads[0], y), [-1])
    size = [int(d) for d in shape[2:]]
    starts = pool_adjoints.window_starts(
        attrs["kernel_shape"], attrs["strides"], attrs["pads"], attrs["dilations"], size
    )
    indices = pool_adjoints.indices_in_windows(
        lambda op_type, inputs, **kw: ctx.b.op(op_type, inputs, **kw),
        ad._max_pool_indices(ctx, node),
        ctx.b.constant(starts, TensorProto.INT64, list(starts.shape)),
        len(size),
        math.prod(size),
    )
    spread = ctx.b.op("MaxUnpool", [dy, indices], stem="a_maxpool", **unpool)
    return [ctx.reshape_like(spread, x)]  # a Reshape, which simplify sinks


def relu_reverse(ctx: Any, node: Any, grads: list) -> list:
    """d/dx of ``y = Relu(x)``: ``dy * Cast(y > 0)``, onnx-ad's formula on the result:
    ``y > 0`` exactly where ``x > 0`` (Relu'(0) = 0), and reading ``y`` leaves ``x``
    to the Relu alone, so onnxruntime fuses the Relu into the ``Gemm`` or ``Conv``
    before it (a kernel and a pass over the activations fewer). ``Cast`` and ``Mul``,
    not ``Where``: onnxruntime's ``Where(y > 0, dy, 0)`` takes 1.5x as long on 100
    elements and 4x on 800,000 (in a Scan, 2 threads)."""
    x, y = node.input[0], node.output[0]
    dtype = ctx.dtype(x, y)
    positive = ctx.b.op("Greater", [y, ctx.constant(0.0, dtype)])
    gate = ctx.b.op("Cast", [positive], to=dtype)
    return [ctx.b.op("Mul", [grads[0], ctx.lift(gate)], stem="a_" + x)]


def window_spread(ctx: Any, node: Any, attrs: dict, value: str) -> str:
    """onnx-ad's ``_window_spread`` (the adjoint of a pooling's window sum, used by its
    ``LpPool`` rule) with the forward's pads (:func:`transposing`): its own passes
    ``output_shape`` and so misplaces the gradient of an unevenly padded pooling; and,
    like the rules above, a symbolic batch dimension."""
    from onnx_ad import UnsupportedOperator
    from onnx_ad import rules as ad

    x, y = node.input[0], node.output[0]
    shape = ctx.shapes.shape(x)
    if not _known(shape, list(range(1, len(shape or ())))):
        raise UnsupportedOperator(
            f"{node.op_type} needs its input's channels and spatial size declared"
        )
    channels = shape[1]
    kernel = [channels, 1, *attrs["kernel_shape"]]
    ones = ctx.b.constant(np.ones(kernel), ctx.dtype(x), kernel)
    transposed = transposing(attrs, list(shape[2:]), attrs["kernel_shape"])
    folded = ad._fold_seed_into_batch(ctx, value, y)
    spread = ctx.b.op(
        "ConvTranspose", [folded, ones], group=channels, stem="window_spread", **transposed
    )
    return ad._unfold_batch_into_seed(ctx, spread, x, ctx.rank(x))


_WHOLE = 2**31 - 1
"""An end at or past this takes an axis to its end, whatever its extent (exporters write
``INT64_MAX`` or ``INT32_MAX``)."""


def slice_reverse(ctx: Any, node: Any, grads: list) -> list:
    """d/dx of ``y = Slice(x, starts, ends, axes, steps)``: ``dy`` zero-padded by what
    the slice cut off each sliced axis, its entries first spread ``step`` apart along an
    axis sliced with a step above 1 (:func:`_spread`). A negative step is onnx-ad's
    (which refuses it)."""
    from onnx_ad import rules as ad

    x = node.input[0]
    if len(node.input) > 2 and None in (ctx.integers(node.input[1]), ctx.integers(node.input[2])):
        axes = ad._constant_operand(ctx, node, 3, "axes")
        steps = ad._constant_operand(ctx, node, 4, "steps")
        return computed_slice_reverse(ctx, node, grads, axes, steps)
    starts, ends, axes, steps = ad._slice_bounds(ctx, node)
    shape = ctx.shapes.shape(x)
    if starts is None or ends is None or shape is None:
        return ad._slice_reverse(ctx, node, grads)
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [a % rank for a in axes]
    steps = [1] * len(axes) if steps is None else list(steps)
    # an axis taken whole (0 to the end: dynamo's `x[:, -1]` slices the batch axis so)
    # needs no padding, its extent unknown or not
    cut = [
        (a, s, e, k)
        for a, s, e, k in zip(axes, starts, ends, steps)
        if not (s == 0 and e >= _WHOLE and k == 1)
    ]
    if any(k < 1 for *_, k in cut) or not _known(shape, [a for a, *_ in cut]):
        return ad._slice_reverse(ctx, node, grads)  # a reversed slice: onnx-ad's refusal
    seeded = ctx.full(grads[0], node.output[0])
    before, after = [0] * rank, [0] * rank
    for axis, start, end, step in cut:
        extent = shape[axis]
        start = min(max(start + extent if start < 0 else start, 0), extent)
        end = min(max(end + extent if end < 0 else end, 0), extent)
        taken = max(0, -(-(end - start) // step))  # ceil((end - start) / step)
        if step > 1 and taken > 1:
            if ctx.opset < 15:  # Shape's start and end arrived in opset 15
                return ad._slice_reverse(ctx, node, grads)
            seeded = _spread(ctx, seeded, rank + 1, axis, taken, step)
        reach = (taken - 1) * step + 1 if taken else 0
        before[axis], after[axis] = start, max(extent - start - reach, 0)
    padded = ad._pad(ctx, seeded, [*before, 0], [*after, 0])
    return [padded] + [None] * (len(node.input) - 1)


def _spread(ctx: Any, value: str, rank: int, axis: int, count: int, step: int) -> str:
    """``value`` (of rank ``rank``) with its ``count`` entries along ``axis`` ``step``
    apart, zeros between them: the adjoint of taking every ``step``-th entry (an
    interleaved rotary embedding slices ``x[..., ::2]``). A new axis after ``axis`` is
    zero-padded to ``step`` and merged back in (``[.., count, ..] -> [.., count, step, ..]
    -> [.., count * step, ..]``), and the zeros after the last entry are cut off."""
    b = ctx.b
    grown = b.op("Unsqueeze", [value, b.ints([axis + 1])], stem="strided")
    pads = [0] * (2 * (rank + 1))
    pads[rank + 1 + axis + 1] = step - 1
    gapped = b.op("Pad", [grown, b.ints(pads)], mode="constant", stem="strided")
    head = [b.op("Shape", [gapped], end=axis, stem="strided_head")] if axis else []
    tail = b.op("Shape", [gapped], start=axis + 2, stem="strided_tail")
    merged = b.op("Concat", [*head, b.ints([count * step]), tail], axis=0, stem="strided")
    joined = b.op("Reshape", [gapped, merged], stem="strided")
    reach = (count - 1) * step + 1
    return b.op("Slice", [joined, b.ints([0]), b.ints([reach]), b.ints([axis])], stem="strided")


def computed_slice_reverse(
    ctx: Any, node: Any, grads: list, axes: list[int] | None, steps: list[int] | None
) -> list:
    """d/dx of ``y = Slice(x, starts, ends, axes)`` whose bounds are computed in the graph
    (dynamo's ``EmbeddingBag`` slices each bag's rows at offsets it reads in a ``Loop``):
    ``dy`` zero-padded by pads computed alongside, each bound normalized as ``Slice``
    does (a negative one counts from the end, then clamped to ``[0, extent]``; an end
    before its start gives an empty slice). Steps must be constant ones, the axes constant
    or absent (the leading ones)."""
    from onnx_ad import UnsupportedOperator

    if steps is not None and any(s != 1 for s in steps):
        raise UnsupportedOperator(
            "Slice with computed bounds is differentiated only with steps of 1"
        )
    if ctx.opset < 11:  # Pad reads its pads as an input from opset 11
        raise UnsupportedOperator("Slice with computed bounds needs opset 11 or later")
    x = node.input[0]
    rank = ctx.rank(x)
    b = ctx.b
    if axes is None:  # the leading axes, as many as the bounds have entries
        count = b.op("Size", [node.input[1]], stem="slice_count")
        scalar = lambda v: b.constant(v, TensorProto.INT64)  # noqa: E731
        where = b.op("Range", [scalar(0), count, scalar(1)], stem="slice_axes")
    else:
        where = b.ints([a % rank for a in axes])
    extents = b.op("Gather", [b.op("Shape", [x], stem="slice_shape"), where])
    zero = b.ints([0])

    def bound(operand: str) -> str:
        """``operand`` as ``Slice`` reads it: from the end when negative, clamped."""
        value = b.op("Cast", [operand], to=TensorProto.INT64, stem="slice_bound")
        wrapped = b.op(
            "Where",
            [b.op("Less", [value, zero]), b.op("Add", [value, extents]), value],
        )
        return b.op("Max", [b.op("Min", [wrapped, extents]), zero], stem="slice_bound")

    start = bound(node.input[1])
    end = b.op("Max", [bound(node.input[2]), start], stem="slice_end")
    # pads for every axis of x and the trailing seed axis, zero but on the sliced axes
    nothing = b.ints([0] * (rank + 1))
    before = b.op("ScatterElements", [nothing, where, start], stem="pads_before")
    after = b.op(
        "ScatterElements", [nothing, where, b.op("Sub", [extents, end])], stem="pads_after"
    )
    pads = b.op("Concat", [before, after], axis=0, stem="pads")
    seeded = ctx.full(grads[0], node.output[0])
    padded = b.op("Pad", [seeded, pads], mode="constant", stem="padded")
    return [padded] + [None] * (len(node.input) - 1)


def concat_reverse(ctx: Any, node: Any, grads: list) -> list:
    """d/dx_i of ``y = Concat(x_1, ..., x_k, axis)``: ``dy`` split along ``axis`` into
    the operands' extents. Where one is not declared (TorchScript's rotary embedding
    concatenates halves whose extent it computes from ``Shape``), the extents are read
    at run time and the gradient ``Split`` by them (onnx-ad's rule needs them all
    declared)."""
    from onnx_ad import rules as ad

    axis = ad._concat_axis(ctx, node)
    shapes = [ctx.shapes.shape(name) for name in node.input]
    if all(shape is not None and shape[axis] is not None for shape in shapes) or ctx.opset < 13:
        return ad._concat_reverse(ctx, node, grads)
    b = ctx.b
    where = b.ints([axis])
    extents = [b.op("Gather", [b.op("Shape", [x], stem="concat_shape"), where]) for x in node.input]
    sizes = b.op("Concat", extents, axis=0, stem="concat_extents")
    seeded = ctx.full(grads[0], node.output[0])
    parts = b.op("Split", [seeded, sizes], outputs=len(node.input), axis=axis, stem="a_concat")
    return [parts] if isinstance(parts, str) else list(parts)


def batch_norm_reverse(ctx: Any, node: Any, grads: list) -> list:
    """Inference BatchNormalization ``y = s (x - m) / sqrt(v + e) + b``: onnx-ad's rule
    for x, s and b, and the statistics too (an exporter may tie a trained weight to them,
    as TorchScript ties ``running_var = Identity(weight)``):
    ``dm = -sum(dy) s / sqrt(v + e)``, ``dv = -sum(dy z) s / (2 (v + e))`` with
    ``z = (x - m) / sqrt(v + e)``, sums over every axis but the channel."""
    from onnx_ad import rules as ad

    contributions = list(ad._batch_norm_reverse(ctx, node, grads))
    mean, variance = node.input[3], node.input[4]
    if not (ctx.asked_for(mean) or ctx.asked_for(variance)):
        return contributions
    _, standardized = ad._batch_norm_parts(ctx, node, [None] * len(node.input))
    scale = node.input[1]
    dtype = ctx.dtype(node.output[0], node.input[0])
    shifted = ctx.b.op("Add", [variance, ctx.constant(ad.attribute(node, "epsilon", 1e-5), dtype)])
    rank = ctx.rank(node.output[0])
    outside = [a for a in range(rank) if a != 1]
    seeded = ctx.full(grads[0], node.output[0])

    def per_channel(value: str, factor: str, like: str) -> str:
        summed = ctx.reduce_sum(value, outside, keepdims=0)  # [C, seeds]
        return ctx.reshape_like(ctx.b.op("Mul", [summed, ctx.lift(factor)]), like)

    if ctx.asked_for(mean):  # factor -s / sqrt(v + e)
        factor = ctx.b.op("Neg", [ctx.b.op("Div", [scale, ctx.b.op("Sqrt", [shifted])])])
        contributions[3] = per_channel(seeded, factor, mean)
    if ctx.asked_for(variance):  # factor -s / (2 (v + e))
        half = ctx.b.op("Mul", [shifted, ctx.constant(-2.0, dtype)])
        factor = ctx.b.op("Div", [scale, half])
        product = ctx.b.op("Mul", [seeded, ctx.lift(standardized)])
        contributions[4] = per_channel(product, factor, variance)
    return contributions


def conv_transpose_reverse(ctx: Any, node: Any, grads: list) -> list:
    """``y = ConvTranspose(x, W, b)`` (group 1): onnx-ad's rule for x and b, and the
    weight, which onnx-ad refuses.

    ``y[n, o, i s + k d - p] += x[n, c, i] W[c, o, k]``, so
    ``dW[c, o, k] = sum_{n, i} x[n, c, i] dy[n, o, i s + k d - p]``: a convolution of
    ``dy`` (batch and channel axes swapped) by ``x`` (likewise) with the strides and
    dilations exchanged and the transposed convolution's pads, cropped to the kernel.
    """
    from onnx_ad import rules as ad

    x, w, y = node.input[0], node.input[1], node.output[0]
    attrs, spatial = ad._conv_attributes(ctx, node)
    kernel = ctx.shapes.static(w)
    if not ctx.asked_for(w) or attrs["group"] != 1 or kernel is None:
        return ad._conv_transpose_reverse(ctx, node, grads)  # or its refusal
    rank = ctx.rank(x)
    pads = ad._conv_transpose_pads(ctx, node, attrs, spatial)
    seeded = ctx.full(grads[0], y)  # [N, O, spatial..., seeds]
    contributions: list = [None, None]
    if ctx.asked_for(x):
        convolution = dict(attrs, pads=pads)
        folded = ad._fold_seed_into_batch(ctx, seeded, y)
        back = ctx.b.op("Conv", [folded, w], stem="a_convt", **convolution)
        contributions[0] = ad._unfold_batch_into_seed(ctx, back, x, rank)
    # [N, O, spatial..., S] -> [O, S, N, spatial...] -> [O S, N, spatial...]
    moved = ctx.b.op(
        "Transpose", [seeded], perm=[1, rank, 0, *range(2, rank)], stem="a_convt_moved"
    )
    static_y = ctx.shapes.static(y)
    tail = None if static_y is None else [static_y[0], *static_y[2:]]
    merged = ad._merge_leading(ctx, moved, tail)
    swapped = ctx.b.op("Transpose", [x], perm=[1, 0, *range(2, rank)], stem="a_convt_x")
    product = ctx.b.op(
        "Conv",
        [merged, swapped],
        strides=attrs["dilations"],
        dilations=attrs["strides"],
        pads=pads,
        stem="a_convt_w",
    )
    cropped = ctx.b.op(
        "Slice",
        [
            product,
            ctx.b.ints([0] * spatial),
            ctx.b.ints(list(kernel[2:])),
            ctx.b.ints(list(range(2, rank))),
        ],
        stem="a_convt_crop",
    )
    # [O S, C, k...] -> [O, S, C, k...] -> [C, O, k..., S]
    split = ctx.b.op("Reshape", [cropped, ctx.b.ints([kernel[1], -1, kernel[0], *kernel[2:]])])
    contributions[1] = ctx.b.op(
        "Transpose",
        [split],
        perm=[2, 0, *range(3, 3 + spatial), 1],
        stem="a_convt_weight",
    )
    return [*contributions, *_bias_adjoint(ctx, node, seeded)]


def det_reverse(ctx: Any, node: Any, grads: list) -> list:
    """``Det``: refused. onnx-ad 0.3.0 lists it among the operators whose derivative is
    zero, which is false (d det(A) / dA = det(A) inverse(A)^T): a weight reaching the
    loss through it and another path would get part of its gradient, silently. Its
    gradient needs a matrix inverse, for which ``ai.onnx`` has no operator."""
    from onnx_ad import UnsupportedOperator

    raise UnsupportedOperator(
        "Det has a derivative (det(A) inverse(A)^T) that standard ONNX cannot write: "
        "ai.onnx has no matrix inverse"
    )


REVERSE: dict[str, Rule] = {
    "Det": det_reverse,
    "ConvTranspose": conv_transpose_reverse,
    "BatchNormalization": batch_norm_reverse,
    "Conv": conv_reverse,
    "AveragePool": average_pool_reverse,
    "MaxPool": max_pool_reverse,
    "Relu": relu_reverse,
    "Slice": slice_reverse,
    "Concat": concat_reverse,
    "LSTM": recurrent.lstm_reverse,
    "GRU": recurrent.gru_reverse,
}
"""graphkit's reverse rules by operator, consulted before onnx-ad's."""


def naming_the_node(rule: Rule) -> Rule:
    """``rule``, whose refusals (onnx-ad's ``UnsupportedOperator``) name the node."""
    from onnx_ad import UnsupportedOperator

    def named(ctx: Any, node: Any, grads: list) -> list:
        try:
            return rule(ctx, node, grads)
        except UnsupportedOperator as exc:
            where = node.name or node.output[0]
            if repr(where) in str(exc) or f"'{where}'" in str(exc):
                raise
            raise UnsupportedOperator(f"{node.op_type} node {where!r}: {exc}") from exc

    return named


@contextmanager
def consulted_first() -> Iterator[None]:
    """graphkit's rules in onnx-ad's table for the duration of one differentiation, every
    rule's refusal naming its node, :func:`window_spread` for its helper, and the
    recurrent nodes :mod:`.recurrent` differentiates kept from onnx-ad's expansion into a
    ``Scan`` (onnx-ad reads its module-level table and functions; the originals are put
    back afterwards)."""
    from onnx_ad import rules as ad

    # the module, which the package's ``reverse`` function hides as an attribute
    ad_reverse: Any = importlib.import_module("onnx_ad.reverse")

    saved, spread = dict(ad.REVERSE), ad._window_spread
    expand = ad_reverse.expand_recurrent
    ad.REVERSE.update(REVERSE)
    for op, rule in list(ad.REVERSE.items()):
        ad.REVERSE[op] = naming_the_node(rule)
    ad._window_spread = window_spread
    ad_reverse.expand_recurrent = recurrent.expanding_the_others(expand)
    try:
        yield
    finally:
        ad.REVERSE.clear()
        ad.REVERSE.update(saved)
        ad._window_spread = spread
        ad_reverse.expand_recurrent = expand


__all__ = ["REVERSE", "consulted_first", "naming_the_node"]
