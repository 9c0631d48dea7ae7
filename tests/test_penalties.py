"""Penalties against numpy; custom penalties' automatic gradients against finite
differences."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphkit import UnknownNameError, penalties
from graphkit.dsl import FLOAT, op, script


@settings(max_examples=20, deadline=None)
@given(
    l1=st.floats(0, 1),
    l2=st.floats(0, 1),
    shape=st.sampled_from([(3,), (2, 4), (1, 1)]),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 1000),
)
def test_elastic_penalty_matches_numpy(l1, l2, shape, dtype, seed):
    rng = np.random.default_rng(seed)
    w = {
        "coef": rng.normal(size=shape).astype(dtype),
        "intercept": rng.normal(size=2).astype(dtype),
    }
    penalty = penalties.elastic(l1, l2, weights=["coef"])
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    c = w["coef"].astype(np.float64)
    assert penalty.value(w) == pytest.approx(
        l1 * np.abs(c).sum() + l2 * (c**2).sum(), rel=rtol, abs=rtol
    )
    grads = penalty.gradient(w)
    assert set(grads) == {"coef"}
    np.testing.assert_allclose(grads["coef"], l1 * np.sign(c) + 2 * l2 * c, rtol=rtol, atol=rtol)


def test_penalty_on_all_weights_and_seed_syntax(rng):
    w = {"a": rng.normal(size=3), "b": rng.normal(size=(2, 2))}
    assert penalties.l2(0.1).value(w) == pytest.approx(0.1 * sum((v**2).sum() for v in w.values()))
    assert penalties.l1(0.1).value(w) == pytest.approx(
        0.1 * sum(np.abs(v).sum() for v in w.values())
    )
    spec = penalties.from_spec({"a": {"l1": 0.2, "l2": 0.3}, "b": 0.5})
    expected = 0.2 * np.abs(w["a"]).sum() + 0.3 * (w["a"] ** 2).sum() + 0.5 * (w["b"] ** 2).sum()
    assert spec.value(w) == pytest.approx(expected, rel=1e-12)
    assert penalties.get(None).value(w) == 0.0


def test_penalty_models_pass_checker():
    penalty = penalties.elastic(0.1, 0.2)
    for dtype in (np.float32, np.float64):
        onnx.checker.check_model(penalty.gradient_model("w", dtype, (3, 2)), full_check=True)


@script()
def log_barrier(weight: FLOAT) -> FLOAT:
    """sum log(1 + w^2)"""
    one = op.CastLike(1.0, weight)
    return op.ReduceSum(op.Log(one + weight * weight), keepdims=0)


def test_custom_penalty_gradient_matches_finite_differences(rng):
    penalty = penalties.custom_penalty(log_barrier, weights=["w"])
    w = rng.normal(size=(3, 2))
    eps = 1e-6
    expected = np.zeros_like(w)
    for index in np.ndindex(w.shape):
        up, down = w.copy(), w.copy()
        up[index] += eps
        down[index] -= eps
        expected[index] = (penalty.value({"w": up}) - penalty.value({"w": down})) / (2 * eps)
    np.testing.assert_allclose(penalty.gradient({"w": w})["w"], expected, rtol=1e-6)
    assert penalty.value({"w": w}) == pytest.approx(np.log1p(w**2).sum(), rel=1e-12)


def test_penalty_on_unknown_weight():
    with pytest.raises(UnknownNameError, match=r"\['coeff'\].*Trainable weights: \['coef'\]"):
        penalties.elastic(0.1, 0.1, ["coeff"]).value({"coef": np.ones(2)})


def test_bad_penalty_spec():
    with pytest.raises(ValueError, match="unknown keys"):
        penalties.from_spec({"coef": {"l3": 1.0}})
    with pytest.raises(ValueError, match=">= 0"):
        penalties.elastic(-1, 0)
