"""A nearest-neighbour ``Resize`` by whole factors written as a broadcast, a linear one
as products by interpolation matrices.

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
attribute, the default aspect-ratio policy.

A **linear** ``Resize`` (``nn.Upsample(mode="bilinear")``, ``F.interpolate``) whose
scaled axes are among the last two and have static extents is a product by a constant
interpolation matrix per scaled axis: ``A`` of shape ``(m, n)`` maps an axis of ``n``
elements to ``m``, each output ``i`` reading its two nearest inputs at the source
coordinate ``c(i)`` (clamped to ``[0, n - 1]``) with weights ``1 - frac(c)`` and
``frac(c)``::

    Resize(x, scales=[1, 1, s, t], mode="linear")  ==>  MatMul(A_h, MatMul(x, A_w^T))

with ``c(i) = (i + 1/2) / s - 1/2`` (``half_pixel``; ``pytorch_half_pixel`` the same
but 0 for an output of one element), ``i (n - 1) / (m - 1)`` (``align_corners``), or
``i / s`` (``asymmetric``). Any other ``Resize`` is left as it is.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper

from graphkit._graph import constant_tensors, copy_model, graph_names, inferred_dims, namer
from graphkit.compat import opset_of
from graphkit.tensor_store import tensor_value

_ROUNDING = (b"round_prefer_floor", b"round_prefer_ceil")


def resizes_as_broadcasts_or_products(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ``Resize`` of its main graph the module docstring takes written
    as a broadcast (nearest) or as products (linear): a copy; ``model`` itself when there
    is none."""
    if not any(n.op_type == "Resize" for n in model.graph.node) or (opset_of(model) or 0) < 13:
        return model  # before opset 13, Unsqueeze took its axes as an attribute
    constants = _scales_and_sizes(model)
    shapes = inferred_dims(model)
    dtypes = _elem_types(model)
    replaced = {}  # by position: a protobuf node's Python object is not kept
    for index, node in enumerate(model.graph.node):
        found = _factors(node, constants, shapes)
        if found is not None:
            replaced[index] = functools.partial(_broadcast, factors=found)
            continue
        matrices = _interpolations(node, constants, shapes, dtypes)
        if matrices is not None:
            rank = len(shapes[node.input[0]])
            replaced[index] = functools.partial(_products, matrices=matrices, rank=rank)
    if not replaced:
        return model
    rewritten = copy_model(model)
    fresh = namer("resize", graph_names(rewritten.graph))
    nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(rewritten.graph.node):
        write = replaced.get(index)
        nodes.extend([node] if write is None else write(node, fresh=fresh))
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


def _elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every typed tensor of the main graph (inputs, initializers,
    inferred values)."""
    try:
        graph = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # inference is a help: an untyped input is left alone
        graph = model.graph
    types = {t.name: t.data_type for t in model.graph.initializer}
    for value in [*graph.input, *graph.value_info]:
        if value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    return types


_COORDINATES = (b"half_pixel", b"pytorch_half_pixel", b"align_corners", b"asymmetric")


def _interpolations(
    node: onnx.NodeProto, constants: dict[str, np.ndarray], shapes: dict, dtypes: dict
) -> dict[int, np.ndarray] | None:
    """``{axis: A}`` (the module docstring's interpolation matrices, for the axes it
    scales) when the linear rule takes ``node``."""
    if node.op_type != "Resize" or node.domain not in ("", "ai.onnx") or len(node.input) < 3:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    coordinates = attrs.get("coordinate_transformation_mode", b"half_pixel")
    if (
        attrs.get("mode") != b"linear"
        or coordinates not in _COORDINATES
        or "axes" in attrs
        or attrs.get("keep_aspect_ratio_policy", b"stretch") != b"stretch"
        or attrs.get("antialias", 0)
    ):
        return None
    shape = shapes.get(node.input[0])
    elem = dtypes.get(node.input[0])
    if shape is None or len(shape) < 2 or elem not in (TensorProto.FLOAT, TensorProto.DOUBLE):
        return None
    inputs = list(node.input) + [""] * 4
    if inputs[2] and inputs[2] in constants and constants[inputs[2]].size:
        scales = constants[inputs[2]].astype(np.float64).reshape(-1)
        sizes = None
    elif inputs[3] in constants:
        sizes = constants[inputs[3]].astype(np.int64).reshape(-1)
        scales = None
    else:
        return None
    rank = len(shape)
    count = len(scales if scales is not None else sizes)  # type: ignore[arg-type]
    if count != rank:
        return None
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    matrices = {}
    for axis in range(rank):
        n = shape[axis]
        scale: float | None
        if scales is not None:
            scale = float(scales[axis])
            m = None if n is None else int(np.floor(n * scale))
        else:
            m = int(sizes[axis])  # type: ignore[index]
            scale = None if n is None else m / n
        if (scales is not None and scale == 1.0) or (n is not None and m == n):
            continue
        if axis < rank - 2 or n is None or m is None or m < 1 or scale is None:
            return None  # a batch or channel axis, or an unknown extent
        matrices[axis] = _interpolation(n, m, scale, coordinates).astype(dtype)
    return matrices or None


def _interpolation(n: int, m: int, scale: float, coordinates: bytes) -> np.ndarray:
    """The ``(m, n)`` matrix of linear interpolation (module docstring)."""
    i = np.arange(m, dtype=np.float64)
    if coordinates == b"align_corners":
        source = i * (n - 1) / (m - 1) if m > 1 else np.zeros(m)
    elif coordinates == b"asymmetric":
        source = i / scale
    else:
        source = (i + 0.5) / scale - 0.5
        if coordinates == b"pytorch_half_pixel" and m == 1:
            source = np.zeros(m)
    source = np.clip(source, 0, n - 1)
    low = np.floor(source).astype(np.int64)
    high = np.minimum(low + 1, n - 1)
    weight = source - low
    matrix = np.zeros((m, n))
    np.add.at(matrix, (np.arange(m), low), 1 - weight)
    np.add.at(matrix, (np.arange(m), high), weight)
    return matrix


def _products(
    node: onnx.NodeProto, matrices: dict[int, np.ndarray], rank: int, fresh
) -> list[onnx.NodeProto]:
    """``node``'s output as products by the interpolation matrices: the last axis by
    ``x A^T``, the one before by ``A x`` (MatMul broadcasts over the leading axes)."""
    current, nodes = node.input[0], []
    for axis, matrix in sorted(matrices.items(), reverse=True):
        last = axis == rank - 1
        name, out = fresh("interpolation"), fresh("interpolated")
        tensor = onnx.numpy_helper.from_array(np.ascontiguousarray(matrix.T if last else matrix))
        nodes.append(helper.make_node("Constant", [], [name], value=tensor))
        nodes.append(
            helper.make_node("MatMul", [current, name] if last else [name, current], [out])
        )
        current = out
    nodes.append(helper.make_node("Identity", [current], [node.output[0]]))
    return nodes


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


__all__ = ["resizes_as_broadcasts_or_products"]
