"""What a graphkit function is written with: ``script``, the opset ``op`` and the types.

A user-written loss looks like the built-in ones::

    from graphkit.dsl import FLOAT, op, script

    @script()
    def log_cosh(prediction: FLOAT, label: FLOAT) -> FLOAT:
        d = prediction - label
        return op.ReduceMean(op.Log(op.Cosh(d)), keepdims=0)

Write constants with ``op.CastLike(value, x)`` so one body serves float32 and float64;
a hyper-parameter captured from Python goes in as :func:`f64` (a float64 0-d array,
which onnxscript keeps exact in eager mode, where a Python float becomes float32).

graphkit's own functions put ``@typing.no_type_check`` under ``@script()``: their
bodies are ONNX, typed with onnxscript's tensor types, so mypy skips them (pyproject's
``[tool.mypy]``) and checks everything around them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnxscript
from onnxscript import BOOL, DOUBLE, FLOAT, INT64
from onnxscript import opset18 as op

__all__ = ["BOOL", "DOUBLE", "FLOAT", "INT64", "f64", "op", "script"]


def script(**kwargs: Any) -> Callable[[Callable[..., Any]], onnxscript.OnnxFunction]:
    """``onnxscript.script`` with ``ai.onnx`` opset 18 as the default opset.

    The default opset lets a function use Python operators (``a * b``) without calling
    any ``op.*`` itself.
    """
    kwargs.setdefault("default_opset", op)
    return onnxscript.script(**kwargs)


def f64(value: float | np.floating) -> np.ndarray:
    """``value`` as a float64 0-d array: a constant captured by a scripted function."""
    return np.array(value, dtype=np.float64)
