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
shapes after the gradient. Elsewhere the scatter stays.
"""

from __future__ import annotations

from collections.abc import Sequence


def unpooling(
    kernel: Sequence[int],
    strides: Sequence[int],
    pads: Sequence[int],
    dilations: Sequence[int],
    ceil_mode: int,
    size: Sequence[int | None] | None,
) -> dict[str, list[int]] | None:
    """The ``MaxUnpool`` attributes that put a ``MaxPool``'s gradient back on its input
    of spatial ``size``, or None where windows overlap (a stride shorter than the dilated
    kernel), ``size`` is unknown, or the windows do not end exactly at the input's end."""
    n = len(kernel)
    if size is None or len(size) != n or any(not isinstance(s, int) for s in size):
        return None
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if any(s < span for s, span in zip(strides, spans)):
        return None  # overlapping windows: a position can take several gradients
    for i, extent in enumerate(size):
        reach = extent + pads[i] + pads[n + i] - spans[i]  # type: ignore[operator]
        if reach < 0 or reach % strides[i]:
            return None  # the last window stops short of the end (or, ceil_mode, overhangs it)
    return {"kernel_shape": spans, "strides": list(strides), "pads": list(pads)}


__all__ = ["unpooling"]
