"""onnxruntime-training's shape operator, folded once shapes are static.

``BroadcastGradientArgs(shape_a, shape_b)`` tells a gradient which axes of a broadcast
result to sum for each operand. Its gradient graphs compute it from ``Shape`` nodes at
every step; once :func:`graphkit.static_shapes.specialize` has made those shapes
constants, :func:`fold_broadcast_gradient_args` replaces it by its value (the backend
hands it to ``specialize`` as one of its ``folds``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from graphkit.tensor_store import tensor_value

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


def fold_broadcast_gradient_args(model: onnx.ModelProto) -> bool:
    """Replace each BroadcastGradientArgs whose two inputs are constant by initializers."""
    constants = {t.name: t for t in model.graph.initializer}
    kept, folded = [], False
    for node in model.graph.node:
        if (
            node.op_type == "BroadcastGradientArgs"
            and node.domain == _MS
            and all(name in constants for name in node.input)
        ):
            shapes = [tensor_value(constants[name]).tolist() for name in node.input]
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
