"""A max pooling's gradient as a ``MaxUnpool``, where its windows tile the input.

``y = MaxPool(x)`` with ``Indices`` (the position of each window's maximum, flat over the
whole input) has for gradient ``dy`` summed into zeros at those positions. Both backends
wrote that sum as a scatter (onnx-ad's ``ScatterND`` with ``reduction="add"``;
onnxruntime-training's ``MaxPoolGrad`` kernel). Where no two windows overlap, no position
receives two values, and the sum is the standard ``MaxUnpool(dy, Indices, shape(x))``,
which onnxruntime's CPU runs 4 to 9 times faster (1.19.2, 2 threads, 2x2 windows of
stride 2, us a call):

=====================  =========  ===========  =========
pooled input           ScatterND  MaxPoolGrad  MaxUnpool
=====================  =========  ===========  =========
64 x 16 x 28 x 28      1029       1151         131
64 x 32 x 14 x 14      484        550          106
=====================  =========  ===========  =========

(ScatterND and MaxUnpool: the time a graph of MaxPool and the gradient takes beyond
MaxPool alone; MaxPoolGrad: its kernel's time in onnxruntime's profile of a training
step. MaxPool itself costs 1857 and 932 us with its indices, 125 and 73 without.)

``MaxUnpool`` places the values by their flat index in its output, whose shape it infers
from its attributes, ``(out - 1) * stride + kernel - pads`` on each axis (an
``output_shape`` input may enlarge it, but onnx.reference scatters into the inferred
shape all the same). :func:`unpooling` returns attributes only where that inferred shape
is the input's (the windows tile the padded input exactly, as a 2x2 pooling of an even
size does): then no ``output_shape`` is needed, and shape inference keeps the static
shapes after the gradient. Elsewhere the scatter stays. onnxruntime's ``MaxUnpool`` has
a float32 kernel only, so float64 and float16 poolings keep the scatter too.

A window of -inf values alone has no valid index from onnxruntime's MaxPool;
:func:`indices_in_windows` sends it to the window's first position, where torch sends it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

Op = Callable[..., str]
"""``op(op_type, inputs, **attributes) -> output name``: how a caller writes one node."""


def unpooling(
    kernel: Sequence[int],
    strides: Sequence[int],
    pads: Sequence[int],
    dilations: Sequence[int],
    ceil_mode: int,
    size: Sequence[int | str | None] | None,
) -> dict[str, list[int]] | None:
    """The ``MaxUnpool`` attributes that put a ``MaxPool``'s gradient back on its input
    of spatial ``size``, or None where windows overlap (a stride shorter than the dilated
    kernel), ``size`` is unknown, or the windows do not end exactly at the input's end
    (where they do, ``ceil_mode`` pools the same windows as floor mode)."""
    n = len(kernel)
    known = [s for s in size or () if isinstance(s, int)]
    if size is None or len(size) != n or len(known) != n:
        return None
    spans = _spans(kernel, dilations)
    if any(s < span for s, span in zip(strides, spans)):
        return None  # overlapping windows: a position can take several gradients
    for i, extent in enumerate(known):
        reach = extent + pads[i] + pads[n + i] - spans[i]
        if reach < 0 or reach % strides[i]:
            return None  # the last window stops short of the end (or, ceil_mode, overhangs it)
    return {"kernel_shape": spans, "strides": list(strides), "pads": list(pads)}


def _spans(kernel: Sequence[int], dilations: Sequence[int]) -> list[int]:
    """Each axis's window extent on the input, dilations included."""
    return [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]


def window_starts(
    kernel: Sequence[int],
    strides: Sequence[int],
    pads: Sequence[int],
    dilations: Sequence[int],
    size: Sequence[int],
) -> np.ndarray:
    """The flat index, within one image of spatial ``size``, of each window's first
    position inside the input (int64, shaped like the pooled image): where torch puts a
    window's gradient when none of its values exceeds -inf."""
    n = len(size)
    spans = _spans(kernel, dilations)
    starts = []
    for i in range(n):
        count = (size[i] + pads[i] + pads[n + i] - spans[i]) // strides[i] + 1
        starts.append([max(o * strides[i] - pads[i], 0) for o in range(count)])
    steps = [math.prod(size[i + 1 :]) for i in range(n)]
    grids = np.meshgrid(*[np.array(s, np.int64) * t for s, t in zip(starts, steps)], indexing="ij")
    return np.sum(grids, axis=0).astype(np.int64)


def indices_in_windows(op: Op, indices: str, starts: str, spatial: int, image: int) -> str:
    """``indices`` with each window whose values never exceed the lowest float (all -inf,
    or NaN) sent to its first position inside the input, as torch sends it.

    onnxruntime's MaxPool leaves such a window's index where it started, -1 on every
    spatial axis: a flat index before the first element of the window's image (negative
    for the first image), which ``MaxUnpool`` writes over another window's gradient or
    refuses. Every index of a window is at least the flat index of the window's first
    position, so ``Max(indices, first positions)`` moves the unset ones and no other:
    one elementwise pass (a ``Where`` on a comparison took two, and 4% of the 28x28
    CNN's batch). ``starts`` names :func:`window_starts` as a constant; ``spatial`` is
    the number of spatial axes, ``image`` the elements of one image."""
    shape = op("Shape", [indices])
    images = op("Slice", [shape, _ints(op, [0]), _ints(op, [2])])  # N, C
    count = op("ReduceProd", [images], keepdims=0)
    first = op("Range", [_scalar(op, 0), count, _scalar(op, 1)])
    grid = op("Concat", [images, _ints(op, [1] * spatial)], axis=0)
    offsets = op("Reshape", [op("Mul", [first, _scalar(op, image)]), grid])
    return op("Max", [indices, op("Add", [offsets, starts])])


def _ints(op: Op, values: list[int]) -> str:
    return op("Constant", [], value_ints=values)


def _scalar(op: Op, value: int) -> str:
    return op("Constant", [], value_int=value)


__all__ = ["indices_in_windows", "unpooling", "window_starts"]
