"""A nearest-neighbour ``Resize`` by whole factors written as a broadcast.

Upsampling by a whole factor ``s`` with the nearest neighbour repeats every element ``s``
times along each scaled axis (a U-Net decoder's ``nn.Upsample(scale_factor=2)``)::

    Resize(x, scales=[1, 1, s, t], mode="nearest")
    ==>  Reshape(Expand(Unsqueeze(x, [3, 5]), [1, 1, 1, s, 1, t]), Shape(x) * [1, 1, s, t])

Neither gradient source differentiates ``Resize`` on a graph whose batch is symbolic:
onnx-ad needs the input's whole shape, and onnxruntime-training 1.19.2 has no CPU
kernel for its ``ResizeGrad``. The broadcast computes the same tensor, and both
differentiate ``Unsqueeze``, ``Expand`` and ``Reshape`` (the gradient sums each block).

Written so: ``mode="nearest"`` with integer scales (a constant ``scales`` input, or a
constant ``sizes`` that are whole multiples of the input's static extents), where the
nearest input of output ``i`` is ``i // s``: the ``asymmetric`` coordinates with
``nearest_mode="floor"``, or ``half_pixel`` / ``pytorch_half_pixel`` with a rounding
mode (``(i + 1/2) / s - 1/2`` then lies within half a step of ``i // s``); no ``axes``
attribute, the default aspect-ratio policy. Any other ``Resize`` is left as it is.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from graphkit._graph import constant_tensors, copy_model, graph_names, inferred_dims, namer
from graphkit.compat import opset_of
from graphkit.tensor_store import tensor_value

_ROUNDING = (b"round_prefer_floor", b"round_prefer_ceil")


def nearest_resizes_as_broadcasts(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ``Resize`` of its main graph the module docstring takes written
    as a broadcast (a copy; ``model`` itself when there is none)."""
    if not any(n.op_type == "Resize" for n in model.graph.node) or (opset_of(model) or 0) < 13:
        return model  # before opset 13, Unsqueeze took its axes as an attribute
    constants = _scales_and_sizes(model)
    shapes = inferred_dims(model)
    factors = {}  # by position: a protobuf node's Python object is not kept
    for index, node in enumerate(model.graph.node):
        found = _factors(node, constants, shapes)
        if found is not None:
            factors[index] = found
    if not factors:
        return model
    rewritten = copy_model(model)
    fresh = namer("resize", graph_names(rewritten.graph))
    nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(rewritten.graph.node):
        found = factors.get(index)
        nodes.extend([node] if found is None else _broadcast(node, found, fresh))
    del rewritten.graph.node[:]
    rewritten.graph.node.extend(nodes)
    return rewritten


_FOLDED = frozenset({"Concat", "Cast", "Identity", "Reshape", "Unsqueeze", "Squeeze"})
"""What a ``scales`` or ``sizes`` input is computed with from constants: TorchScript
writes ``Concat(Constant, Constant)``."""


def _scales_and_sizes(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The value of each ``scales`` or ``sizes`` input of a ``Resize`` that is constant:
    an initializer or a ``Constant``, or computed from ``Constant`` nodes only by the
    operators of :data:`_FOLDED` (never from an initializer: a weight stays a weight)."""
    from onnx.reference import ReferenceEvaluator

    graph = model.graph
    values = {
        name: tensor_value(t)
        for name, t in constant_tensors(graph)
        if np.prod(t.dims, dtype=np.int64) <= 8
    }
    produced = {name for node in graph.node for name in node.output}
    opsets = {o.domain or "": o.version for o in model.opset_import}
    producers = {out: node for node in graph.node for out in node.output}

    def value(name: str, depth: int = 3) -> np.ndarray | None:
        if name in values and (name in produced or depth == 3):
            return values[name]
        node = producers.get(name)
        if node is None or depth == 0 or node.op_type not in _FOLDED:
            return None
        inputs = [i for i in node.input if i]
        found = [value(i, depth - 1) for i in inputs]
        if any(v is None or (i not in produced) for i, v in zip(inputs, found)):
            return None
        try:
            (result,) = ReferenceEvaluator(node, opsets=opsets).run(None, dict(zip(inputs, found)))
        except Exception:  # what the reference cannot evaluate stays computed
            return None
        return np.asarray(result)

    wanted = {
        name
        for node in graph.node
        if node.op_type == "Resize"
        for name in list(node.input)[1:]
        if name
    }
    return {name: v for name in wanted if (v := value(name)) is not None}


def _factors(
    node: onnx.NodeProto, constants: dict[str, np.ndarray], shapes: dict
) -> list[int] | None:
    """The whole factor of each axis when the module docstring's rule takes ``node``."""
    if node.op_type != "Resize" or node.domain not in ("", "ai.onnx"):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    coordinates = attrs.get("coordinate_transformation_mode", b"half_pixel")
    rounding = attrs.get("nearest_mode", b"round_prefer_floor")
    if (
        attrs.get("mode", b"nearest") != b"nearest"
        or "axes" in attrs
        or attrs.get("keep_aspect_ratio_policy", b"stretch") != b"stretch"
    ):
        return None
    exact = (coordinates == b"asymmetric" and rounding == b"floor") or (
        coordinates in (b"half_pixel", b"pytorch_half_pixel") and rounding in _ROUNDING
    )
    inputs = list(node.input) + [""] * 4
    if len(node.input) == 2:  # opset 10: X, scales; the asymmetric floor
        inputs = [node.input[0], "", node.input[1], ""]
        exact = True
    if not exact:
        return None
    shape = shapes.get(inputs[0])
    if inputs[2] and inputs[2] in constants and constants[inputs[2]].size:
        scales = constants[inputs[2]].astype(np.float64).reshape(-1)
    elif inputs[3] in constants and shape is not None:
        sizes = constants[inputs[3]].reshape(-1)
        if len(sizes) != len(shape) or any(s is None for s in shape):
            return None
        scales = sizes / np.array(shape, np.float64)
    else:
        return None
    whole = np.round(scales)
    if np.any(whole < 1) or not np.array_equal(whole, scales):
        return None
    if shape is not None and len(shape) != len(scales):
        return None
    return [int(s) for s in whole]


def _broadcast(node: onnx.NodeProto, factors: list[int], fresh) -> list[onnx.NodeProto]:
    """The nodes of the module docstring's broadcast computing ``node``'s output."""
    x, (y,) = node.input[0], node.output
    scaled = [axis for axis, f in enumerate(factors) if f > 1]
    if not scaled:
        return [helper.make_node("Identity", [x], [y])]
    # after each scaled axis, a new one of the factor's size
    new_axes = [axis + k + 1 for k, axis in enumerate(scaled)]
    repeats: list[int] = []
    for f in factors:
        repeats += [1, f] if f > 1 else [1]

    def constant(stem: str, values: list[int]) -> tuple[str, onnx.NodeProto]:
        name = fresh(stem)
        tensor = onnx.numpy_helper.from_array(np.array(values, np.int64))
        return name, helper.make_node("Constant", [], [name], value=tensor)

    axes, axes_node = constant("axes", new_axes)
    target, target_node = constant("repeats", repeats)
    scale, scale_node = constant("factors", factors)
    lifted, spread, shape, size = (fresh(s) for s in ("lifted", "spread", "shape", "size"))
    return [
        axes_node,
        target_node,
        scale_node,
        helper.make_node("Unsqueeze", [x, axes], [lifted]),
        helper.make_node("Expand", [lifted, target], [spread]),
        helper.make_node("Shape", [x], [shape]),
        helper.make_node("Mul", [shape, scale], [size]),
        helper.make_node("Reshape", [spread, size], [y]),
    ]


__all__ = ["nearest_resizes_as_broadcasts"]
