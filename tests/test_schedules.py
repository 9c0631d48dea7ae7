"""Schedules against their closed forms over a range of steps."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest

from graphkit import UnknownNameError, schedules

STEPS = [0, 1, 2, 3, 7, 10, 99, 100, 101, 1000, 12345]


def sklearn_optimal(alpha, t):
    # sklearn/linear_model/_sgd_fast.pyx: typw, initial_eta0 = typw / max(1, dloss(-typw, 1)),
    # optimal_init = 1 / (initial_eta0 * alpha), eta = 1 / (alpha * (optimal_init + t - 1))
    typw = math.sqrt(1.0 / math.sqrt(alpha))
    optimal_init = 1.0 / (typw * alpha)
    return 1.0 / (alpha * (optimal_init + (t + 1) - 1))


CASES = [
    (schedules.constant(0.05), lambda t: 0.05),
    (schedules.invscaling(0.01, 0.25), lambda t: 0.01 / (t + 1) ** 0.25),
    (schedules.optimal(1e-3), lambda t: sklearn_optimal(1e-3, t)),
    (schedules.step_decay(0.1, 10, 0.5), lambda t: 0.1 * 0.5 ** (t // 10)),
    (schedules.exponential(0.1, 0.999), lambda t: 0.1 * 0.999**t),
    (
        schedules.cosine(0.1, 1000, 0.01),
        lambda t: 0.1 * (0.99 * 0.5 * (1 + math.cos(math.pi * min(t, 1000) / 1000)) + 0.01),
    ),
    (
        schedules.warmup(schedules.exponential(0.1, 0.99), 100, 0.001),
        lambda t: 0.001 + (0.1 - 0.001) * t / 100 if t < 100 else 0.1 * 0.99 ** (t - 100),
    ),
]


@pytest.mark.parametrize("schedule,closed_form", CASES, ids=[c[0].name for c in CASES])
def test_schedule_matches_closed_form(schedule, closed_form):
    rtol = 1e-6 if schedule.name == "cosine" else 1e-13  # cosine is evaluated in float32
    for t in STEPS:
        assert schedule(t) == pytest.approx(closed_form(t), rel=rtol, abs=1e-12), t
    onnx.checker.check_model(schedule.model(), full_check=True)


@pytest.mark.parametrize("schedule,closed_form", CASES, ids=[c[0].name for c in CASES])
def test_schedule_eager_mode(schedule, closed_form):
    value = schedule.function(np.array(7, dtype=np.int64))
    assert float(value) == pytest.approx(closed_form(7), rel=1e-6)


def test_invscaling_matches_sklearn_sgd_regressor():
    """SGDRegressor's eta = eta0 / t^power_t with t counting samples from 1."""
    from sklearn.linear_model import SGDRegressor

    X = np.array([[1.0], [2.0], [3.0]])
    y = np.array([1.0, 2.0, 3.0])
    reg = SGDRegressor(eta0=0.01, power_t=0.25, alpha=0, max_iter=1, tol=None, shuffle=False)
    reg.partial_fit(X, y)
    # replay the updates with our schedule: w += -eta (w x + b - y) x (loss 1/2 (p - y)^2)
    w = b = 0.0
    sched = schedules.invscaling(0.01, 0.25)
    for step, (x, target) in enumerate(zip(X[:, 0], y)):
        eta = sched(step)
        g = w * x + b - target
        w, b = w - eta * g * x, b - eta * g
    np.testing.assert_allclose([w, b], [reg.coef_[0], reg.intercept_[0]], rtol=1e-10)


def test_get_accepts_number_and_name():
    assert schedules.get(0.3)(10) == pytest.approx(0.3)
    assert schedules.get("invscaling", eta0=1.0, power_t=1.0)(1) == pytest.approx(0.5)


def test_bad_schedule_arguments():
    with pytest.raises(ValueError, match="eta0"):
        schedules.constant(0)
    with pytest.raises(ValueError, match="alpha"):
        schedules.cosine(alpha=2)
    with pytest.raises(ValueError, match="step"):
        schedules.constant(0.1)(-1)
    with pytest.raises(UnknownNameError, match="Valid names.*cosine"):
        schedules.get("cosinus")
