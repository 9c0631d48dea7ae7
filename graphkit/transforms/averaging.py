"""Averaging: an exponential moving average of the weights kept in the state
(:func:`ema`), and the averaged weights read back from it (:func:`ema_weights`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import no_type_check

import numpy as np

from graphkit.dsl import FLOAT, INT64, f64, op, script
from graphkit.errors import UnknownNameError
from graphkit.transforms.base import Field, Scripted, factory


@factory
def ema(decay: float = 0.999) -> Scripted:
    """An exponential moving average of the weights, kept in the state (put it last).

    avg <- p + u at the first update, then decay avg + (1 - decay) (p + u): torch's
    ``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))`` updated after each step.
    The updates pass unchanged; :func:`ema_weights` reads the average.
    """
    if not 0 <= decay < 1:
        raise ValueError(f"decay must lie in [0, 1), got {decay}.")
    d = f64(decay)

    @script()
    @no_type_check
    def ema_update(update: FLOAT, param: FLOAT, average: FLOAT, step: INT64) -> tuple[FLOAT, FLOAT]:
        new = param + update
        mixed = (
            op.CastLike(d, param) * average
            + (op.CastLike(1.0, param) - op.CastLike(d, param)) * new
        )
        return update, op.Where(step == op.CastLike(0, step), new, mixed)

    return Scripted(
        "ema",
        ema_update,
        (Field("average", np.copy),),
        params={"decay": decay},
        elementwise=True,
    )


def ema_weights(state: Mapping[str, np.ndarray], name: str = "ema") -> dict[str, np.ndarray]:
    """``{weight: its moving average}`` from a state holding an :func:`ema`."""
    suffix = f".{name}.average"
    found = {k.removesuffix(suffix): v for k, v in state.items() if k.endswith(suffix)}
    if not found:
        raise UnknownNameError(
            f"The state holds no {name!r} average: add graphkit.transforms.ema() at the end "
            "of the optimizer's chain."
        )
    return found


__all__ = [
    "ema",
    "ema_weights",
]
