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

import math
from typing import Any

import numpy as np
import onnx
import onnxscript

from graphkit._graph import compile_function
from graphkit._ort import Runner
from graphkit.dsl import DOUBLE, INT64, op, script
from graphkit.registry import Registry


def _f64(value: float) -> np.ndarray:
    return np.array(value, dtype=np.float64)


class Schedule:
    """A learning rate as a function of the step, compiled to ONNX.

    Attributes:
        name: registered name.
        function: the scripted ``step: INT64 -> learning_rate: DOUBLE``.
        params: the hyper-parameters it was built with.
    """

    def __init__(self, name: str, function: onnxscript.OnnxFunction, **params: Any) -> None:
        self.name = name
        self.function = function
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


def _rebuild(name: str, params: dict[str, Any]) -> Schedule:
    return SCHEDULES.get(name, **params)


ONE = _f64(1.0)
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
    value = _f64(eta0)

    @script()
    def constant_schedule(step: INT64) -> DOUBLE:
        return op.CastLike(value, lr_type)

    return Schedule("constant", constant_schedule, eta0=eta0)


@SCHEDULES.register("invscaling")
def invscaling(eta0: float = 0.01, power_t: float = 0.25) -> Schedule:
    """eta(t) = eta0 / (t + 1)^power_t  (scikit-learn's SGD, whose t starts at 1)"""
    _positive(eta0=eta0)
    if power_t < 0:
        raise ValueError(f"power_t must be >= 0, got {power_t}.")
    e, p = _f64(eta0), _f64(power_t)

    @script()
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
    a, t0_ = _f64(alpha), _f64(t0)

    @script()
    def optimal_schedule(step: INT64) -> DOUBLE:
        t = op.Cast(step, to=onnx.TensorProto.DOUBLE)
        return op.Reciprocal(op.CastLike(a, t) * (op.CastLike(t0_, t) + t))

    return Schedule("optimal", optimal_schedule, alpha=alpha)


@SCHEDULES.register("step", "step_decay")
def step_decay(eta0: float = 0.01, step_size: int = 100, gamma: float = 0.1) -> Schedule:
    """eta(t) = eta0 gamma^floor(t / step_size)  (torch's StepLR)"""
    _positive(eta0=eta0, step_size=step_size, gamma=gamma)
    e, g = _f64(eta0), _f64(gamma)
    size = np.array(int(step_size), dtype=np.int64)

    @script()
    def step_schedule(step: INT64) -> DOUBLE:
        k = op.Cast(op.Div(step, op.CastLike(size, step)), to=onnx.TensorProto.DOUBLE)
        return op.CastLike(e, k) * op.Pow(op.CastLike(g, k), k)  # k: integer division

    return Schedule("step", step_schedule, eta0=eta0, step_size=step_size, gamma=gamma)


@SCHEDULES.register("exponential", "exponential_decay")
def exponential(eta0: float = 0.01, gamma: float = 0.99) -> Schedule:
    """eta(t) = eta0 gamma^t  (torch's ExponentialLR)"""
    _positive(eta0=eta0, gamma=gamma)
    e, g = _f64(eta0), _f64(gamma)

    @script()
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
    e, a = _f64(eta0), _f64(alpha)
    T = _f64(decay_steps)
    pi_over_T = _f64(math.pi / decay_steps)
    half_span = _f64((1.0 - alpha) / 2.0)

    @script()
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
    init, w_f = _f64(init_value), _f64(warmup_steps)

    @script()
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


def get(name: str | float | Schedule, **kwargs: Any) -> Schedule:
    """A schedule by name, a constant from a number, or ``name`` itself if a Schedule."""
    if isinstance(name, Schedule):
        return name
    if isinstance(name, (int, float)) and not isinstance(name, bool):
        return constant(float(name))
    return SCHEDULES.get(name, **kwargs)


__all__ = [
    "SCHEDULES",
    "Schedule",
    "constant",
    "cosine",
    "exponential",
    "get",
    "invscaling",
    "optimal",
    "step_decay",
    "warmup",
]
