"""The seed-compatible classes: selection, and the graphs they build against numpy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import graphkit as gk
from graphkit.engine.ort_engine import Runner


@pytest.mark.parametrize(
    "base,choice,expected",
    [
        (gk.BaseLearningLoss, "square_error", gk.SquareLearningLoss),
        (gk.BaseLearningLoss, "SquareLearningLoss", gk.SquareLearningLoss),
        (gk.BaseLearningLoss, "elastic", gk.ElasticLearningLoss),
        (gk.BaseLearningLoss, "NegLogLearningLoss", gk.NegLogLearningLoss),
        (gk.BaseLearningLoss, "cross_entropy", gk.SoftmaxCrossEntropyLearningLoss),
        (gk.BaseLearningRate, "LearningRateSGD", gk.LearningRateSGD),
        (gk.BaseLearningRate, None, gk.LearningRateSGD),
        (gk.BaseLearningRate, "LearningRateSGDNesterov", gk.LearningRateSGDNesterov),
        (gk.BaseLearningRate, "learningratermsprop", gk.LearningRateRMSProp),
        # graphkit's names mean graphkit's optimizers (at a constant 0.01), not the seed's
        (gk.BaseLearningRate, "adam", gk.BaseLearningRate),
        (gk.BaseLearningRate, "SGD", gk.BaseLearningRate),
        (gk.BaseLearningPenalty, "ElasticLearningPenalty", gk.ElasticLearningPenalty),
        (gk.BaseLearningPenalty, None, gk.NoLearningPenalty),
    ],
)
def test_select_by_alias_or_class_name(base, choice, expected):
    assert type(base.select(choice)) is expected


def test_select_instance_and_kwargs():
    loss = gk.ElasticLearningLoss(l1_weight=0.2, l2_weight=0.8)
    assert gk.BaseLearningLoss.select(loss) is loss
    assert gk.BaseLearningLoss.select("elastic", l1_weight=0.3).loss.params["l1_weight"] == 0.3
    with pytest.raises(gk.UnknownNameError, match="Valid choices.*LearningRateAdam"):
        gk.BaseLearningRate.select("adamax")
    with pytest.raises(ValueError, match="Cannot apply"):
        gk.BaseLearningLoss.select(loss, l1_weight=0.1)


def test_elastic_loss_gradient_sign_is_with_respect_to_prediction(rng):
    """The seed had d/d label; graphkit returns d/d prediction."""
    p, y = rng.normal(size=(5, 1)), rng.normal(size=(5, 1))
    _, grad = gk.ElasticLearningLoss(0.3, 0.7).loss_gradient(p, y)
    d = p - y
    np.testing.assert_allclose(grad, (0.3 * np.sign(d) + 1.4 * d) / 5, rtol=1e-12)
    model = gk.ElasticLearningLoss(0.3, 0.7).build_onnx_function(np.float64)
    assert [o.name for o in model.graph.output] == ["loss", "prediction_grad"]


def test_nesterov_follows_the_seed_formula(rng):
    """V = momentum V - lr G; W += momentum V - lr G, with lr from sklearn's invscaling."""
    rate = gk.LearningRateSGDNesterov(eta0=0.1, power_t=0.5, momentum=0.8)
    model = rate.build_onnx_function("coef", np.float64, (3,))
    onnx.checker.check_model(model)
    runner = Runner(model)
    w, v = rng.normal(size=3), np.zeros(3)
    ours_w, ours_v = w.copy(), v.copy()
    for step in range(10):
        g = rng.normal(size=3)
        lr = 0.1 / (step + 1) ** 0.5
        v = 0.8 * v - lr * g
        w = w + 0.8 * v - lr * g
        ours_w, ours_v = runner(
            {"param": ours_w, "grad": g, "coef.momentum.velocity": ours_v, "step": np.array(step)}
        )
    np.testing.assert_allclose(ours_w, w, rtol=1e-12)
    np.testing.assert_allclose(ours_v, v, rtol=1e-12)


def test_sgd_learning_rates_follow_sklearn():
    assert gk.LearningRateSGD(eta0=0.1, power_t=0.5).value(3) == pytest.approx(0.05)
    assert gk.LearningRateSGD(eta0=0.1, learning_rate="constant").value(9) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="invscaling"):
        gk.LearningRateSGD(learning_rate="adaptive")


def test_penalty_build_onnx_function(rng):
    w = rng.normal(size=(2, 2))
    model = gk.ElasticLearningPenalty(l1=0.1, l2=0.2).build_onnx_function(
        "coef", np.float64, (2, 2)
    )
    value, grad = Runner(model)({"weight": w})
    assert value == pytest.approx(0.1 * np.abs(w).sum() + 0.2 * (w**2).sum())
    np.testing.assert_allclose(grad, 0.1 * np.sign(w) + 0.4 * w)
    none = gk.NoLearningPenalty().build_onnx_function("coef", np.float64, (2, 2))
    assert Runner(none)({"weight": w})[0] == 0
