"""Scalings: the updates multiplied, entry by entry, by the learning rate
(:func:`scale_by_learning_rate`, left open for the runtime to fill) or a constant
(:func:`scale`), and weight decay added to them (:func:`add_decayed_weights`)."""

from __future__ import annotations

from typing import Any, no_type_check

from graphkit.dsl import FLOAT, INT64, f64, op, script
from graphkit.transforms.base import OPEN, Scripted, factory


def check_learning_rate(learning_rate: Any) -> Any:
    """``OPEN``, or a schedule resolved from a schedule, a name or a number."""
    if learning_rate is OPEN or learning_rate is None:
        return OPEN
    from graphkit import schedules

    return schedules.get(learning_rate)


@factory
def scale_by_learning_rate(learning_rate: Any = None) -> Scripted:
    """u -> -lr u, with lr = schedule(step); left open (None) the runtime fills it."""

    @script()
    @no_type_check
    def scale_by_learning_rate(update: FLOAT, param: FLOAT, step: INT64, lr: FLOAT) -> FLOAT:
        return update * op.Neg(lr)

    return Scripted(
        "learning_rate",
        scale_by_learning_rate,
        learning_rate=check_learning_rate(learning_rate),
        elementwise=True,
    )


@factory
def scale(factor: float) -> Scripted:
    """u -> factor u"""
    f = f64(factor)

    @script()
    @no_type_check
    def scale_update(update: FLOAT, param: FLOAT, step: INT64) -> FLOAT:
        return update * op.CastLike(f, update)

    return Scripted("scale", scale_update, params={"factor": factor}, elementwise=True)


@factory
def add_decayed_weights(weight_decay: float) -> Scripted:
    """u -> u + weight_decay p

    Its place in a chain decides the kind of decay: before a rescaling (Adam's moments)
    it is coupled L2 (torch's ``Adam(weight_decay=)``); after it, right before the
    learning rate, it is decoupled (AdamW: p <- p - lr (adam(u) + weight_decay p)).
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
    wd = f64(weight_decay)

    @script()
    @no_type_check
    def add_decayed_weights(update: FLOAT, param: FLOAT, step: INT64) -> FLOAT:
        return update + op.CastLike(wd, param) * param

    return Scripted(
        "weight_decay",
        add_decayed_weights,
        params={"weight_decay": weight_decay},
        elementwise=True,
    )


__all__ = [
    "add_decayed_weights",
    "check_learning_rate",
    "scale",
    "scale_by_learning_rate",
]
