"""Learning-rate schedules: onnxscript functions of an int64 ``step``.

``step`` counts the updates already applied (0 for the first update), as in optax. A
schedule returns a float64 scalar; the training step casts it to the weights' dtype.
A :class:`Schedule` is a plain callable too::

    lr = graphkit.schedules.invscaling(eta0=0.01, power_t=0.25)
    lr(0), lr(99)              # computed by the compiled ONNX graph
    lr.model()                 # step -> learning_rate, an ONNX model

Factories validate their arguments and raise ``ValueError`` at construction.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any, no_type_check

import numpy as np
import onnx
import onnxscript

from graphkit._graph import compile_function
from graphkit.dsl import DOUBLE, INT64, f64, op, script
from graphkit.engine.ort_engine import Runner
from graphkit.registry import Registry


class Schedule:
    """A learning rate as a function of the step, compiled to ONNX.

    Attributes:
        name: registered name.
        function: the scripted ``step: INT64 -> learning_rate: DOUBLE``.
        params: the hyper-parameters it was built with.
    """

    def __init__(self, name: str, function: onnxscript.OnnxFunction, **params: Any) -> None:
        self.name = name
        self.function = _unique(function)
        self.params = params
        self._runner: Runner | None = None

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Schedule({self.name!r}, {args})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as "rebuild from the registry" (scripted closures do not pickle)."""
        return (_rebuild, (self.name, self.params))

    def model(self) -> onnx.ModelProto:
        """``step (int64 scalar) -> learning_rate (float64 scalar)`` as an ONNX model."""
        return compile_function(
            self.function,
            np.float64,
            {"step": (), "learning_rate": ()},
            int64=["step"],
            outputs=["learning_rate"],
        )

    def __call__(self, step: int | np.integer) -> float:
        """The learning rate at ``step`` (0-based), computed by the ONNX graph."""
        if int(step) < 0:
            raise ValueError(f"step must be >= 0, got {step}.")
        if self._runner is None:
            self._runner = Runner(self.model())
        return float(self._runner({"step": np.array(step, dtype=np.int64)})[0])


SCHEDULES: Registry[Schedule] = Registry("schedule")
_count = itertools.count()


def _unique(function: onnxscript.OnnxFunction) -> onnxscript.OnnxFunction:
    """Give a scripted schedule a name of its own: a schedule built on others (join,
    warmup) calls them by name, and two constants would otherwise share one."""
    ir = function.function_ir
    if not ir.name.endswith("_unique"):
        ir.name = f"{ir.name}_{next(_count)}_unique"
        function._name = ir.name  # the name a caller's node is given
    return function


def _rebuild(name: str, params: dict[str, Any]) -> Schedule:
    return SCHEDULES.get(name, **params)


ONE = f64(1.0)
HALF = f64(0.5)
# a float64 tensor to CastLike constants against where no float64 tensor exists yet
lr_type = np.array(0.0, dtype=np.float64)
ZERO_STEP = np.array(0, dtype=np.int64)


def _positive(**values: float) -> None:
    for key, value in values.items():
        if not value > 0:
            raise ValueError(f"{key} must be > 0, got {value}.")


@SCHEDULES.register("constant", "fixed")
def constant(eta0: float = 0.01) -> Schedule:
    """eta(t) = eta0"""
    _positive(eta0=eta0)
    value = f64(eta0)

    @script()
    @no_type_check
    def constant_schedule(step: INT64) -> DOUBLE:
        return op.CastLike(value, lr_type)

    return Schedule("constant", constant_schedule, eta0=eta0)


@SCHEDULES.register("invscaling")
def invscaling(eta0: float = 0.01, power_t: float = 0.25) -> Schedule:
    """eta(t) = eta0 / (t + 1)^power_t  (scikit-learn's SGD, whose t starts at 1)"""
    _positive(eta0=eta0)
    if power_t < 0:
        raise ValueError(f"power_t must be >= 0, got {power_t}.")
    e, p = f64(eta0), f64(power_t)

    @script()
    @no_type_check
    def invscaling_schedule(step: INT64) -> DOUBLE:
        t = op.Cast(step, to=onnx.TensorProto.DOUBLE) + op.CastLike(ONE, lr_type)
        return op.CastLike(e, t) / op.Pow(t, op.CastLike(p, t))

    return Schedule("invscaling", invscaling_schedule, eta0=eta0, power_t=power_t)


@SCHEDULES.register("optimal")
def optimal(alpha: float = 1e-4) -> Schedule:
    """eta(t) = 1 / (alpha (t0 + t))  (scikit-learn SGD's 'optimal')

    t0 = 1 / (alpha typw) with typw = sqrt(1 / sqrt(alpha)): scikit-learn's heuristic,
    exact for its regression and classification losses (whose ``dloss(-typw, 1) < 1``).
    """
    _positive(alpha=alpha)
    typw = math.sqrt(1.0 / math.sqrt(alpha))
    t0 = 1.0 / (alpha * typw)
    a, t0_ = f64(alpha), f64(t0)

    @script()
    @no_type_check
    def optimal_schedule(step: INT64) -> DOUBLE:
        t = op.Cast(step, to=onnx.TensorProto.DOUBLE)
        return op.Reciprocal(op.CastLike(a, t) * (op.CastLike(t0_, t) + t))

    return Schedule("optimal", optimal_schedule, alpha=alpha)


@SCHEDULES.register("step", "step_decay")
def step_decay(eta0: float = 0.01, step_size: int = 100, gamma: float = 0.1) -> Schedule:
    """eta(t) = eta0 gamma^floor(t / step_size)  (torch's StepLR)"""
    _positive(eta0=eta0, step_size=step_size, gamma=gamma)
    e, g = f64(eta0), f64(gamma)
    size = np.array(int(step_size), dtype=np.int64)

    @script()
    @no_type_check
    def step_schedule(step: INT64) -> DOUBLE:
        k = op.Cast(op.Div(step, op.CastLike(size, step)), to=onnx.TensorProto.DOUBLE)
        return op.CastLike(e, k) * op.Pow(op.CastLike(g, k), k)  # k: integer division

    return Schedule("step", step_schedule, eta0=eta0, step_size=step_size, gamma=gamma)


@SCHEDULES.register("exponential", "exponential_decay")
def exponential(eta0: float = 0.01, gamma: float = 0.99) -> Schedule:
    """eta(t) = eta0 gamma^t  (torch's ExponentialLR)"""
    _positive(eta0=eta0, gamma=gamma)
    e, g = f64(eta0), f64(gamma)

    @script()
    @no_type_check
    def exponential_schedule(step: INT64) -> DOUBLE:
        t = op.Cast(step, to=onnx.TensorProto.DOUBLE)
        return op.CastLike(e, t) * op.Pow(op.CastLike(g, t), t)

    return Schedule("exponential", exponential_schedule, eta0=eta0, gamma=gamma)


@SCHEDULES.register("cosine", "cosine_decay")
def cosine(eta0: float = 0.01, decay_steps: int = 1000, alpha: float = 0.0) -> Schedule:
    """eta(t) = eta0 ((1 - alpha) (1 + cos(pi min(t, T) / T)) / 2 + alpha), T = decay_steps

    (optax's cosine_decay_schedule; ``alpha`` is the final fraction of eta0.) The cosine
    is evaluated in float32 (onnxruntime has no float64 Cos): relative error about 1e-7.
    """
    _positive(eta0=eta0, decay_steps=decay_steps)
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}.")
    e, a = f64(eta0), f64(alpha)
    T = f64(decay_steps)
    pi_over_T = f64(math.pi / decay_steps)
    half_span = f64((1.0 - alpha) / 2.0)

    @script()
    @no_type_check
    def cosine_schedule(step: INT64) -> DOUBLE:
        t = op.Min(op.Cast(step, to=onnx.TensorProto.DOUBLE), op.CastLike(T, lr_type))
        # onnxruntime has no float64 Cos: the cosine itself is computed in float32.
        angle = op.Cast(op.CastLike(pi_over_T, t) * t, to=onnx.TensorProto.FLOAT)
        cos = op.Cast(op.Cos(angle), to=onnx.TensorProto.DOUBLE)
        span = op.CastLike(half_span, t) * (op.CastLike(ONE, t) + cos)
        return op.CastLike(e, t) * (span + op.CastLike(a, t))

    return Schedule("cosine", cosine_schedule, eta0=eta0, decay_steps=decay_steps, alpha=alpha)


@SCHEDULES.register("warmup", "linear_warmup")
def warmup(
    schedule: Schedule | str = "constant",
    warmup_steps: int = 100,
    init_value: float = 0.0,
    **kwargs: Any,
) -> Schedule:
    """Linear warm-up, then ``schedule`` restarted at step 0.

    eta(t) = init + (schedule(0) - init) t / W   for t < W = warmup_steps
    eta(t) = schedule(t - W)                     afterwards
    (optax's join_schedules of a linear schedule and ``schedule``.)
    """
    _positive(warmup_steps=warmup_steps)
    base = get(schedule, **kwargs)
    inner = base.function
    W = np.array(int(warmup_steps), dtype=np.int64)
    init, w_f = f64(init_value), f64(warmup_steps)

    @script()
    @no_type_check
    def warmup_schedule(step: INT64) -> DOUBLE:
        t = op.Cast(step, to=onnx.TensorProto.DOUBLE)
        zero = op.CastLike(ZERO_STEP, step)
        start = op.CastLike(init, t)
        peak = inner(zero)
        ramp = start + (peak - start) * t / op.CastLike(w_f, t)
        end = op.CastLike(W, step)
        after = inner(op.Max(step - end, zero))
        return op.Where(step < end, ramp, after)

    return Schedule(
        "warmup", warmup_schedule, schedule=base, warmup_steps=warmup_steps, init_value=init_value
    )


def _join2(first: Schedule, second: Schedule, boundary: int) -> onnxscript.OnnxFunction:
    before, after = first.function, second.function
    b = np.array(int(boundary), dtype=np.int64)

    @script()
    @no_type_check
    def joined_schedule(step: INT64) -> DOUBLE:
        end = op.CastLike(b, step)
        later = after(op.Max(step - end, op.CastLike(ZERO_STEP, step)))
        return op.Where(step < end, before(step), later)

    return joined_schedule


@SCHEDULES.register("join", "join_schedules")
def join(schedules: Sequence[Schedule | str | float], boundaries: Sequence[int]) -> Schedule:
    """``schedules[i](t - boundaries[i-1])`` for ``boundaries[i-1] <= t < boundaries[i]``

    Each schedule restarts at step 0 at its boundary (optax's join_schedules); there is
    one boundary fewer than schedules, increasing.
    """
    parts = [get(x) for x in schedules]
    marks = [int(b) for b in boundaries]
    if len(parts) != len(marks) + 1:
        raise ValueError(
            f"join needs one boundary fewer than schedules: {len(parts)} schedules, "
            f"{len(marks)} boundaries."
        )
    if any(b <= 0 for b in marks) or any(b >= c for b, c in zip(marks, marks[1:])):
        raise ValueError(f"boundaries must be positive and increasing, got {marks}.")
    # fold from the right: join(s0, join(s1, s2 at b2 - b1) at b1)
    tail = parts[-1]
    for i in range(len(marks) - 1, -1, -1):
        offset = marks[i] - (marks[i - 1] if i else 0)
        tail = Schedule("join", _join2(parts[i], tail, offset))
    return Schedule("join", tail.function, schedules=parts, boundaries=marks)


@SCHEDULES.register("piecewise_constant")
def piecewise_constant(eta0: float, boundaries_and_scales: Mapping[int, float]) -> Schedule:
    """eta(t) = eta0 times every scale whose boundary is <= t  (optax's
    piecewise_constant_schedule)"""
    _positive(eta0=eta0)
    marks = sorted(int(b) for b in boundaries_and_scales)
    values, value = [eta0], eta0
    for b in marks:
        value *= float(boundaries_and_scales[b])
        _positive(scale=value)
        values.append(value)
    if not marks:
        return constant(eta0)
    joined = join([constant(v) for v in values], marks)
    return Schedule(
        "piecewise_constant",
        joined.function,
        eta0=eta0,
        boundaries_and_scales=dict(boundaries_and_scales),
    )


@SCHEDULES.register("one_cycle", "onecycle")
def one_cycle(
    max_lr: float,
    total_steps: int,
    pct_start: float = 0.3,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    anneal: str = "cos",
) -> Schedule:
    """The 1cycle policy (Smith 2018), torch's ``OneCycleLR`` (two phases)::

        initial = max_lr / div_factor;  final = initial / final_div_factor
        E = pct_start total_steps - 1
        t <= E: anneal(initial -> max_lr, t / E)
        t > E:  anneal(max_lr -> final, (t - E) / (total_steps - 1 - E))

    ``anneal`` is ``"cos"`` (end + (start - end) (1 + cos(pi pct)) / 2, the cosine in
    float32) or ``"linear"``. Past ``total_steps`` the rate stays at ``final``.
    """
    _positive(max_lr=max_lr, total_steps=total_steps, div_factor=div_factor)
    _positive(final_div_factor=final_div_factor)
    if anneal not in ("cos", "linear"):
        raise ValueError(f"anneal must be 'cos' or 'linear', got {anneal!r}.")
    first_end = float(pct_start * total_steps) - 1
    if not 0 < first_end < total_steps - 1:
        raise ValueError(
            f"pct_start * total_steps - 1 = {first_end} must lie in (0, total_steps - 1): "
            "raise total_steps or change pct_start."
        )
    start, peak = f64(max_lr / div_factor), f64(max_lr)
    end = f64(max_lr / div_factor / final_div_factor)
    e1, last = f64(first_end), f64(total_steps - 1)
    pi = f64(math.pi)
    cosine = anneal == "cos"

    @script()
    @no_type_check
    def cos_anneal(a: DOUBLE, b: DOUBLE, pct: DOUBLE) -> DOUBLE:
        angle = op.Cast(op.CastLike(pi, pct) * pct, to=onnx.TensorProto.FLOAT)
        c = op.Cast(op.Cos(angle), to=onnx.TensorProto.DOUBLE) + op.CastLike(ONE, pct)
        return b + (a - b) * op.CastLike(HALF, pct) * c

    @script()
    @no_type_check
    def linear_anneal(a: DOUBLE, b: DOUBLE, pct: DOUBLE) -> DOUBLE:
        return (b - a) * pct + a

    anneal_fn = cos_anneal if cosine else linear_anneal

    @script()
    @no_type_check
    def one_cycle_schedule(step: INT64) -> DOUBLE:
        t = op.Min(op.Cast(step, to=onnx.TensorProto.DOUBLE), op.CastLike(last, lr_type))
        e = op.CastLike(e1, t)
        rising = anneal_fn(op.CastLike(start, t), op.CastLike(peak, t), t / e)
        pct = (t - e) / (op.CastLike(last, t) - e)
        falling = anneal_fn(op.CastLike(peak, t), op.CastLike(end, t), pct)
        return op.Where(t <= e, rising, falling)

    return Schedule(
        "one_cycle",
        one_cycle_schedule,
        max_lr=max_lr,
        total_steps=total_steps,
        pct_start=pct_start,
        div_factor=div_factor,
        final_div_factor=final_div_factor,
        anneal=anneal,
    )


@SCHEDULES.register("sgdr", "cosine_restarts")
def sgdr(eta0: float = 0.01, t_0: int = 100, t_mult: int = 1, eta_min: float = 0.0) -> Schedule:
    """Cosine annealing with warm restarts (Loshchilov & Hutter 2017), torch's
    ``CosineAnnealingWarmRestarts``: cycle i lasts T_i = t_0 t_mult^i steps and

        eta(t) = eta_min + (eta0 - eta_min) (1 + cos(pi T_cur / T_i)) / 2

    with T_cur the steps since the last restart (the cosine in float32).
    """
    _positive(eta0=eta0, t_0=t_0)
    if int(t_mult) != t_mult or t_mult < 1:
        raise ValueError(f"t_mult must be an integer >= 1, got {t_mult}.")
    if not 0 <= eta_min < eta0:
        raise ValueError(f"eta_min must lie in [0, eta0), got {eta_min}.")
    e, lo, T0, M = f64(eta0), f64(eta_min), f64(int(t_0)), f64(int(t_mult))
    pi, half = f64(math.pi), f64(0.5)
    geometric = int(t_mult) > 1

    @script()
    @no_type_check
    def cycle_start(n: DOUBLE) -> DOUBLE:
        """the step at which cycle n begins: t_0 (M^n - 1) / (M - 1)"""
        m = op.CastLike(M, n)
        return op.CastLike(T0, n) * (op.Pow(m, n) - op.CastLike(ONE, n)) / (m - op.CastLike(ONE, n))

    @script()
    @no_type_check
    def position(t: DOUBLE) -> tuple[DOUBLE, DOUBLE]:
        """(T_cur, T_i)"""
        if geometric:
            m = op.CastLike(M, t)
            guess = op.Floor(
                op.Log(t / op.CastLike(T0, t) * (m - op.CastLike(ONE, t)) + op.CastLike(ONE, t))
                / op.Log(m)
            )
            # the logarithm may land a hair below an integer at a restart: correct by one
            n = op.Where(
                cycle_start(guess + op.CastLike(ONE, t)) <= t, guess + op.CastLike(ONE, t), guess
            )
            n = op.Where(cycle_start(n) > t, n - op.CastLike(ONE, t), n)
            current = t - cycle_start(n)
            length = op.CastLike(T0, t) * op.Pow(m, n)
        else:
            length = op.CastLike(T0, t)
            current = t - op.Floor(t / length) * length
        return current, length

    @script()
    @no_type_check
    def sgdr_schedule(step: INT64) -> DOUBLE:
        t = op.Cast(step, to=onnx.TensorProto.DOUBLE)
        current, length = position(t)
        angle = op.Cast(op.CastLike(pi, t) * current / length, to=onnx.TensorProto.FLOAT)
        c = op.Cast(op.Cos(angle), to=onnx.TensorProto.DOUBLE)
        low = op.CastLike(lo, t)
        return low + (op.CastLike(e, t) - low) * (op.CastLike(ONE, t) + c) * op.CastLike(half, t)

    return Schedule("sgdr", sgdr_schedule, eta0=eta0, t_0=t_0, t_mult=t_mult, eta_min=eta_min)


def get(name: str | float | Schedule, **kwargs: Any) -> Schedule:
    """A schedule by name, a constant from a number, or ``name`` itself if a Schedule."""
    if isinstance(name, Schedule):
        return name
    if isinstance(name, (int, float)) and not isinstance(name, bool):
        return constant(float(name))
    if not isinstance(name, str):
        raise TypeError(
            f"A learning rate is a graphkit Schedule, a schedule's name or a positive number, "
            f"not {type(name).__name__} {name!r}."
        )
    return SCHEDULES.get(name, **kwargs)


__all__ = [
    "SCHEDULES",
    "Schedule",
    "constant",
    "cosine",
    "exponential",
    "get",
    "invscaling",
    "join",
    "one_cycle",
    "optimal",
    "piecewise_constant",
    "sgdr",
    "step_decay",
    "warmup",
]
