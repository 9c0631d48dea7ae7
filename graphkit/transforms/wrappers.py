"""Wrappers: transformations that run an inner one on other terms: every k-th step on
accumulated updates (:func:`multi_steps`), only on finite updates
(:func:`apply_if_finite`), or with slow weights (:func:`lookahead`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import no_type_check

import numpy as np
from onnx import TensorProto

from graphkit.dsl import FLOAT, script
from graphkit.transforms.base import (
    Emitter,
    GradientTransformation,
    T,
    Tensors,
    _copy,
    factory,
)


class _Wrapper(GradientTransformation):
    inner: GradientTransformation

    def children(self) -> tuple[GradientTransformation, ...]:
        return (self.inner,)

    def _with_children(self: T, children: Sequence[GradientTransformation]) -> T:
        out = _copy(self)
        out.inner = children[0]  # type: ignore[attr-defined]
        return out

    def _rates_at(self, step: int) -> list[float]:
        return self.inner._rates_at(self._inner_step(step))

    def _inner_step(self, step: int) -> int:
        return step


def _where_all(g: Emitter, cond: str, new: Tensors, old: Tensors, base: str) -> Tensors:
    return {k: g.node("Where", [cond, new[k], old[k]], f"{base}/{k}") for k in new}


def _zero_like(g: Emitter, w: str, base: str) -> str:
    return g.constant(0.0, g.weights[w].dtype, f"{base}/zero")


class MultiSteps(_Wrapper):
    """Accumulate k mini-batches of updates; apply ``inner`` to their mean every k-th
    step (optax's MultiSteps). In between, the updates are 0 and ``inner``'s state
    does not move; ``inner`` sees step // k, the number of updates it has applied.

    acc <- acc + u;  every k-th step: u' = inner(acc / k), acc <- 0;  else u' = 0
    """

    name = "multi_steps"

    def __init__(self, inner: GradientTransformation, every_k: int) -> None:
        if isinstance(every_k, bool) or not isinstance(every_k, (int, np.integer)) or every_k < 1:
            raise ValueError(f"every_k must be an integer >= 1, got {every_k!r}.")
        self.inner, self.every_k = inner, int(every_k)
        self.params = {"every_k": self.every_k}

    def _inner_step(self, step: int) -> int:
        return step // self.every_k

    def acc_name(self, w: str) -> str:
        return f"{w}.{self.name}.acc"

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = {self.acc_name(w): np.zeros_like(np.asarray(v)) for w, v in params.items()}
        return {**state, **self.inner.init(params)}

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        k = g.constant(self.every_k, np.int64, "multi_steps/k")
        last = g.constant(self.every_k - 1, np.int64, "multi_steps/last")
        phase = g.node("Mod", [step, k], "multi_steps/phase")
        apply = g.node("Equal", [phase, last], "multi_steps/apply")
        inner_step = g.node("Div", [step, k], "multi_steps/inner_step")
        acc, mean = {}, {}
        for w in updates:
            acc[w] = g.node("Add", [state[self.acc_name(w)], updates[w]], f"multi_steps/{w}/acc")
            k_w = g.constant(self.every_k, g.weights[w].dtype, f"multi_steps/{w}/k")
            mean[w] = g.node("Div", [acc[w], k_w], f"multi_steps/{w}/mean")
        inner_updates, inner_state = self.inner.emit(g, mean, state, params, inner_step)
        zeros = {w: _zero_like(g, w, f"multi_steps/{w}") for w in updates}
        new_updates = _where_all(g, apply, inner_updates, zeros, "multi_steps/update")
        owned = _where_all(g, apply, inner_state, state, "multi_steps/state")
        for w in updates:
            owned[self.acc_name(w)] = g.node("Where", [apply, zeros[w], acc[w]], f"{w}/acc")
        return new_updates, owned


@factory
def multi_steps(inner: GradientTransformation, every_k: int) -> MultiSteps:
    """Gradient accumulation: ``inner`` on the mean update of every ``every_k`` steps."""
    return MultiSteps(inner, every_k)


class ApplyIfFinite(_Wrapper):
    """Skip a step whose updates are not all finite: the updates are 0, ``inner``'s state
    stays as it was, and ``"{name}.skipped"`` (int64) counts it. ``inner`` sees
    step - skipped, the number of updates it has applied.
    """

    name = "apply_if_finite"

    def __init__(self, inner: GradientTransformation) -> None:
        self.inner = inner
        self.params = {}

    @property
    def counter(self) -> str:
        return f"{self.name}.skipped"

    def _inner_step(self, step: int) -> int:
        return step  # the count of skipped steps lives in the state

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {self.counter: np.array(0, dtype=np.int64), **self.inner.init(params)}

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        # u * 0 is NaN exactly where u is NaN or infinite: one sum tells them all
        zeros = {w: _zero_like(g, w, f"apply_if_finite/{w}") for w in updates}
        parts = []
        for w in updates:
            probe = g.node("Mul", [updates[w], zeros[w]], f"apply_if_finite/{w}/probe")
            total = g.node("ReduceSum", [probe], f"apply_if_finite/{w}/sum", keepdims=0)
            parts.append(g.node("Cast", [total], "apply_if_finite/sum", to=TensorProto.DOUBLE))
        bad = g.node(
            "IsNaN", [g.node("Sum", parts, "apply_if_finite/total")], "apply_if_finite/bad"
        )
        finite = g.node("Not", [bad], "apply_if_finite/finite")
        skipped = state[self.counter]
        inner_step = g.node("Sub", [step, skipped], "apply_if_finite/inner_step")
        inner_updates, inner_state = self.inner.emit(g, updates, state, params, inner_step)
        new_updates = _where_all(g, finite, inner_updates, zeros, "apply_if_finite/update")
        owned = _where_all(g, finite, inner_state, state, "apply_if_finite/state")
        count = g.node("Cast", [bad], "apply_if_finite/bad_int", to=TensorProto.INT64)
        owned[self.counter] = g.node("Add", [skipped, count], "apply_if_finite/skipped")
        return new_updates, owned


@factory
def apply_if_finite(inner: GradientTransformation) -> ApplyIfFinite:
    """``inner``, except on steps whose updates hold a NaN or an infinity: those leave the
    weights and ``inner``'s state unchanged and are counted."""
    return ApplyIfFinite(inner)


class Lookahead(_Wrapper):
    """Lookahead (Zhang et al. 2019): ``inner`` moves fast weights; every k-th step the
    slow weights move a fraction ``alpha`` towards them and the fast weights restart
    from there::

        fast = p + inner(u)
        every k-th step: slow <- slow + alpha (fast - slow); p <- slow
    """

    name = "lookahead"

    def __init__(self, inner: GradientTransformation, sync_period: int, alpha: float) -> None:
        if isinstance(sync_period, bool) or int(sync_period) != sync_period or sync_period < 1:
            raise ValueError(f"sync_period must be an integer >= 1, got {sync_period!r}.")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}.")
        self.inner, self.sync_period, self.alpha = inner, int(sync_period), float(alpha)
        self.params = {"sync_period": self.sync_period, "alpha": self.alpha}

    def slow_name(self, w: str) -> str:
        return f"{w}.{self.name}.slow"

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = {self.slow_name(w): np.array(v) for w, v in params.items()}
        return {**state, **self.inner.init(params)}

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        inner_updates, owned = self.inner.emit(g, updates, state, params, step)
        one = g.constant(1, np.int64, "lookahead/one")
        k = g.constant(self.sync_period, np.int64, "lookahead/k")
        done = g.node("Add", [step, one], "lookahead/done")
        sync = g.node(
            "Equal",
            [g.node("Mod", [done, k], "lookahead/phase"), g.constant(0, np.int64, "lookahead/0")],
            "lookahead/sync",
        )
        owned = dict(owned)
        new_updates = {}
        for w in updates:
            (new_update, slow) = g.call(
                _lookahead_sync,
                g.weights[w].dtype,
                {
                    "param": params[w],
                    "update": inner_updates[w],
                    "slow": state[self.slow_name(w)],
                    "alpha": g.constant(self.alpha, g.weights[w].dtype, "lookahead/alpha"),
                },
                {
                    "param": g.weights[w].shape,
                    "update": g.weights[w].shape,
                    "slow": g.weights[w].shape,
                    "alpha": (),
                },
                [g.weights[w].shape, g.weights[w].shape],
                prefix=f"lookahead/{w}",
            )
            new_updates[w] = g.node("Where", [sync, new_update, inner_updates[w]], f"lookahead/{w}")
            owned[self.slow_name(w)] = g.node(
                "Where", [sync, slow, state[self.slow_name(w)]], f"lookahead/{w}/slow"
            )
        return new_updates, owned


@script()
@no_type_check
def _lookahead_sync(param: FLOAT, update: FLOAT, slow: FLOAT, alpha: FLOAT) -> tuple[FLOAT, FLOAT]:
    """slow' = slow + alpha (p + u - slow); the update that lands p on slow'"""
    synced = slow + alpha * (param + update - slow)
    return synced - param, synced


@factory
def lookahead(inner: GradientTransformation, sync_period: int = 6, alpha: float = 0.5) -> Lookahead:
    """Lookahead around ``inner``: slow weights synchronised every ``sync_period`` steps."""
    return Lookahead(inner, sync_period, alpha)


__all__ = [
    "ApplyIfFinite",
    "Lookahead",
    "MultiSteps",
    "apply_if_finite",
    "lookahead",
    "multi_steps",
]
