"""Clipping: updates bounded entry by entry (:func:`clip`), by their norm over all the
weights (:func:`clip_by_global_norm`), or unit by unit relative to the weights
(:func:`adaptive_clip`)."""

from __future__ import annotations

from typing import no_type_check

import numpy as np

from graphkit.dsl import FLOAT, INT64, f64, op, script
from graphkit.transforms.base import Scripted, WeightInfo, factory
from graphkit.transforms.combine import Partition


@factory
def clip(max_delta: float) -> Scripted:
    """u -> min(max(u, -max_delta), max_delta), element by element"""
    if not max_delta > 0:
        raise ValueError(f"max_delta must be > 0, got {max_delta}.")
    d = f64(max_delta)

    @script()
    @no_type_check
    def clip_update(update: FLOAT, param: FLOAT, step: INT64) -> FLOAT:
        bound = op.CastLike(d, update)
        return op.Clip(update, op.Neg(bound), bound)

    return Scripted("clip", clip_update, params={"max_delta": max_delta}, elementwise=True)


@script()
@no_type_check
def _sum_of_squares(update: FLOAT, param: FLOAT) -> FLOAT:
    return op.ReduceSumSquare(update, keepdims=0)


@factory
def clip_by_global_norm(max_norm: float) -> Scripted:
    """u -> u min(1, max_norm / ||u||), ||u|| the norm of all the weights' updates
    together (optax's clip_by_global_norm)."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}.")
    m = f64(max_norm)

    @script()
    @no_type_check
    def clip_by_global_norm(update: FLOAT, param: FLOAT, step: INT64, total: FLOAT) -> FLOAT:
        norm = op.Sqrt(total)
        limit = op.CastLike(m, update)
        return op.Where(norm < limit, update, update * (limit / norm))

    return Scripted(
        "clip_by_global_norm",
        clip_by_global_norm,
        statistic=_sum_of_squares,
        params={"max_norm": max_norm},
        elementwise=True,
    )


@factory
def adaptive_clip(clipping: float = 0.01, eps: float = 1e-3) -> Partition:
    """Adaptive gradient clipping (Brock et al. 2021), unit by unit::

        u -> u                                   where ||u||_unit < c max(||p||_unit, eps)
        u -> u c max(||p||_unit, eps) / ||u||_unit  elsewhere

    A unit is the whole tensor for vectors and scalars, a column for matrices (the
    ``(in, out)`` layout of MatMul weights), and an output channel (axis 0) for
    convolution kernels of rank 3 and more.
    """
    if not clipping > 0:
        raise ValueError(f"clipping must be > 0, got {clipping}.")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}.")
    c, e, tiny = f64(clipping), f64(eps), f64(1e-6)

    @script()
    @no_type_check
    def whole_norm(x: FLOAT) -> FLOAT:
        return op.Expand(op.Sqrt(op.ReduceSumSquare(x, keepdims=1)), op.Shape(x))

    def build(axes: list[int] | None) -> Scripted:
        dims = np.array(axes or [0], dtype=np.int64)

        @script()
        @no_type_check
        def axes_norm(x: FLOAT) -> FLOAT:
            return op.Expand(op.Sqrt(op.ReduceSumSquare(x, dims, keepdims=1)), op.Shape(x))

        unit_norm = whole_norm if axes is None else axes_norm

        @script()
        @no_type_check
        def adaptive_clip_update(update: FLOAT, param: FLOAT, step: INT64) -> FLOAT:
            g_norm = unit_norm(update)
            limit = op.Max(unit_norm(param), op.CastLike(e, param)) * op.CastLike(c, param)
            clipped = update * (limit / op.Max(g_norm, op.CastLike(tiny, param)))
            return op.Where(g_norm < limit, update, clipped)

        return Scripted("adaptive_clip", adaptive_clip_update)

    def unit(name: str, info: WeightInfo) -> str:
        return str(info.ndim) if info.ndim >= 2 else "whole"

    groups = {"whole": build(None), "2": build([0])}
    groups.update({str(rank): build(list(range(1, rank))) for rank in range(3, 7)})
    out = Partition(groups, unit)
    out.name = "adaptive_clip"
    out.params = {"clipping": clipping, "eps": eps}
    return out


__all__ = [
    "adaptive_clip",
    "clip",
    "clip_by_global_norm",
]
