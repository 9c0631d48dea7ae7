"""What every rule reads of a graph: static shapes, a Transpose's ``perm``, the axes of a
reduction."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx

STANDARD = ("", "ai.onnx")
"""The domains of ONNX's own operators (the only ones the rules rewrite)."""


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every tensor whose shape onnx's inference (or the graph's value_info) fixes."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    shapes = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            shapes[value.name] = tuple(d.dim_value for d in tensor.shape.dim)
    for init in graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def last_two_swapped(rank: int) -> list[int]:
    """The ``perm`` of a Transpose that swaps a tensor's last two axes (a matrix's)."""
    return [*range(rank - 2), rank - 1, rank - 2]


def transpose_perm(node: onnx.NodeProto, rank: int) -> list[int]:
    """A Transpose's ``perm``: its attribute, else the axes reversed."""
    for attribute in node.attribute:
        if attribute.name == "perm":
            return list(attribute.ints)
    return list(range(rank))[::-1]


def reduce_axes(node: onnx.NodeProto, constants: Mapping[str, np.ndarray]) -> list[int] | None:
    """The axes a reduction reduces ([] for all of them), None when not constant."""
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in constants:
            return None
        return [int(a) for a in constants[node.input[1]].ravel()]
    for attr in node.attribute:  # opset < 13
        if attr.name == "axes":
            return list(attr.ints)
    return []


__all__ = ["STANDARD", "last_two_swapped", "reduce_axes", "static_shapes", "transpose_perm"]
