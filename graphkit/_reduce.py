"""Reductions shared by losses: per-sample values -> the reported loss, and the matching
scaling of per-sample gradients. ``weight`` is a vector of sample weights (ones when the
caller gave none)."""

from __future__ import annotations

from typing import no_type_check

from graphkit.dsl import FLOAT, op, script


@script()
@no_type_check
def ones_like(per_sample: FLOAT) -> FLOAT:
    """1 for every sample: the weights of an unweighted loss."""
    return op.Expand(op.CastLike(1.0, per_sample), op.Shape(per_sample))


@script()
@no_type_check
def reduce_none(per_sample: FLOAT, weight: FLOAT) -> FLOAT:
    """loss_i = w_i l_i"""
    return per_sample * weight


@script()
@no_type_check
def reduce_sum(per_sample: FLOAT, weight: FLOAT) -> FLOAT:
    """loss = sum_i w_i l_i"""
    return op.ReduceSum(per_sample * weight, keepdims=0)


@script()
@no_type_check
def total_weight(weight: FLOAT) -> FLOAT:
    """max(sum_i w_i, tiny): a batch whose weights are all zero adds loss 0 and no update
    instead of 0 / 0 (tiny is float32's smallest normal number, 2^-126)."""
    return op.Max(op.ReduceSum(weight, keepdims=0), op.CastLike(1.1754943508222875e-38, weight))


@script()
@no_type_check
def reduce_mean(per_sample: FLOAT, weight: FLOAT) -> FLOAT:
    """loss = sum_i w_i l_i / sum_i w_i"""
    return op.ReduceSum(per_sample * weight, keepdims=0) / total_weight(weight)


@script()
@no_type_check
def scale_rows(grad: FLOAT, weight: FLOAT) -> FLOAT:
    """g_i * w_i for each row i of g (any rank)."""
    rows = op.Reshape(grad, op.Constant(value_ints=[0, -1])) * op.Unsqueeze(
        weight, op.Constant(value_ints=[1])
    )
    return op.Reshape(rows, op.Shape(grad))


@script()
@no_type_check
def scale_rows_mean(grad: FLOAT, weight: FLOAT) -> FLOAT:
    """g_i * w_i / sum_j w_j for each row i of g."""
    return scale_rows(grad, weight) / total_weight(weight)


REDUCTIONS = {
    "none": (reduce_none, scale_rows),
    "sum": (reduce_sum, scale_rows),
    "mean": (reduce_mean, scale_rows_mean),
}
