"""The dtypes graphkit computes in and the shapes its graphs declare.

Public: the runtime (:mod:`graphkit_train`) reads a graph's declared shapes with these
to check what a user feeds (:func:`shape_matches`) and to compile graphkit's pieces for
them (:func:`named_shape`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto

from graphkit.errors import DTypeError

FLOAT_TYPES: dict[np.dtype, int] = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float64): TensorProto.DOUBLE,
}
ELEM_TO_DTYPE: dict[int, np.dtype] = {v: k for k, v in FLOAT_TYPES.items()} | {
    TensorProto.FLOAT16: np.dtype(np.float16),
    TensorProto.INT64: np.dtype(np.int64),
    TensorProto.INT32: np.dtype(np.int32),
}


def float_dtype(dtype: object) -> np.dtype:
    """Validate that ``dtype`` is float32 or float64 and return it as a numpy dtype."""
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError as exc:
        raise DTypeError(f"{dtype!r} is not a dtype; use numpy.float32 or numpy.float64.") from exc
    if dt not in FLOAT_TYPES:
        raise DTypeError(
            f"graphkit computes in float32 or float64, not {dt}; cast with .astype(numpy.float32)."
        )
    return dt


def elem_type(dtype: object) -> int:
    return FLOAT_TYPES[float_dtype(dtype)]


Dim = int | str | None
Shape = tuple[Dim, ...]


def shape_matches(dims: Sequence[Dim] | None, shape: Sequence[int]) -> bool:
    """Whether an array of ``shape`` fits the declared ``dims``.

    An unknown rank (None) or an unknown dim matches anything."""
    if dims is None:
        return True
    return len(dims) == len(shape) and all(
        not isinstance(d, int) or d == s for d, s in zip(dims, shape)
    )


def named_shape(value: onnx.ValueInfoProto) -> tuple[int | str, ...]:
    """Declared dims with every unknown one named (``N`` for the batch): the shape a
    graphkit piece fed by ``value`` is compiled with. Unknown rank means 2-D."""
    dims = static_shape(value)
    if dims is None:
        return ("N", "K")
    return tuple(
        d if isinstance(d, int) or d else ("N" if i == 0 else f"{value.name}_dim{i}")
        for i, d in enumerate(dims)
    )


def static_shape(value: onnx.ValueInfoProto) -> list[int | str | None] | None:
    """Dims of a tensor value (int, symbolic name or None), or None when the rank is unknown."""
    ttype = value.type.tensor_type
    if not ttype.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for dim in ttype.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param"):
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return dims


__all__ = [
    "ELEM_TO_DTYPE",
    "FLOAT_TYPES",
    "Dim",
    "Shape",
    "elem_type",
    "float_dtype",
    "named_shape",
    "shape_matches",
    "static_shape",
]
