"""A convolution's gradient in the standard operators onnxruntime's CPU runs fastest.

Shared by the native backend's ``Conv`` rule (:mod:`graphkit.backends.native.rules`) and
ort_training's CPU lowering of ``ConvGrad``
(:func:`graphkit.backends.ort_training.lowering.conv_grad_on_cpu`), which build the same
nodes with their own builders:

* **d/dx of a stride-1 Conv** (group 1): ``Conv(dy, w')``, ``w'`` the weight with its two
  channel axes swapped and each spatial axis reversed, with the forward's dilations and
  pads ``d (k - 1) - p`` on each side (:func:`input_adjoint_pads`). Forward ``y[o] =
  sum_k x[o + k d - p] w[k]``, so ``dx[i] = sum_k dy[i - k d + p] w[k]``.
* **d/dw** (group 1): one batched product of patches, ``dw[o, c, k] = sum_{n, p} dy[n,
  o, p] x_pad[n, c, p s + k d]``; each kernel position ``k`` is a strided ``Slice`` of
  the padded input (:func:`patch_windows`), the K of them stacked ``[N, C K, P]``.

Measured with onnxruntime 1.19.2 on 2 CPU threads, batch 64, 3x3 kernels (us):

=================================  =========  ==========  ===============  ========
gradient                           this way   ConvGrad    ConvTranspose    Conv by dy
=================================  =========  ==========  ===============  ========
d/dw, 16x14x14 -> 32 channels      1868       2082        --               4948
d/dw, 1x28x28 -> 16 channels       378        802         --               1021
d/dx, 32x14x14 -> 16 channels      582        (1900)      1428             --
d/dx, 16x28x28 -> 1 channel        1173       --          393              --
=================================  =========  ==========  ===============  ========

(ConvGrad computes both of the first layer's gradients in 3972 us; "Conv by dy" is
onnx-ad's weight gradient, a convolution of the input by the incoming gradient.) Hence a
Conv for d/dx from :data:`CONV_INPUT_ADJOINT_FROM_CHANNELS` input channels, and patches
up to :data:`PATCHES_UP_TO` elements a sample (all the batch's patches are held at once).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

CONV_INPUT_ADJOINT_FROM_CHANNELS = 8
"""Input channels from which a stride-1 convolution's input gradient is a ``Conv``
rather than a ``ConvTranspose`` (the table above: 582 us against 1428 at 16 channels,
1173 against 393 at 1)."""

PATCHES_UP_TO = 1 << 16
"""Elements of one sample's patches (input channels x kernel positions x output
positions) up to which a weight gradient multiplies patches: 16 MB at batch 64."""

REVERSED_END = -(2**63)
"""A ``Slice`` end that, with step -1, runs to the start of the axis."""


def input_adjoint_pads(
    kernel: Sequence[int],
    group: int,
    strides: Sequence[int],
    dilations: Sequence[int],
    pads: Sequence[int],
) -> list[int] | None:
    """The pads of ``Conv(dy, w')`` that is d/dx of a Conv with weight shape ``kernel``
    ([O, C, k...]), or None where that form does not apply or is the slower: a group, a
    stride, fewer than :data:`CONV_INPUT_ADJOINT_FROM_CHANNELS` input channels, a pad
    wider than the dilated kernel."""
    spatial = len(kernel) - 2
    if group != 1 or any(s != 1 for s in strides):
        return None
    if kernel[1] < CONV_INPUT_ADJOINT_FROM_CHANNELS:
        return None
    flipped = [
        dilations[i] * (kernel[2 + i] - 1) - pads[side * spatial + i]
        for side in range(2)
        for i in range(spatial)
    ]
    return None if min(flipped) < 0 else flipped


def patches_fit(channels: int, kernel: Sequence[int], out: Sequence[int]) -> bool:
    """Whether one sample's patches (``channels`` x kernel positions x output positions;
    ``kernel`` and ``out`` spatial) are at most :data:`PATCHES_UP_TO` elements."""
    return channels * math.prod(kernel) * math.prod(out) <= PATCHES_UP_TO


def patch_windows(
    kernel: Sequence[int], out: Sequence[int], strides: Sequence[int], dilations: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """``(starts, ends)`` on the spatial axes of the padded input, one per kernel position
    (row-major, as the weight stores them); the slice's steps are ``strides``."""
    windows = []
    for offset in itertools.product(*(range(k) for k in kernel)):
        starts = [k * d for k, d in zip(offset, dilations)]
        ends = [a + (o - 1) * s + 1 for a, o, s in zip(starts, out, strides)]
        windows.append((starts, ends))
    return windows


__all__ = [
    "CONV_INPUT_ADJOINT_FROM_CHANNELS",
    "PATCHES_UP_TO",
    "REVERSED_END",
    "input_adjoint_pads",
    "patch_windows",
    "patches_fit",
]
