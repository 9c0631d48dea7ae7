"""One name, one meaning: every entry point resolves every registered name (and alias)
to the same loss or optimizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import linear_regression_onnx

import graphkit as gk
from graphkit import losses, optimizers
from graphkit.rewrite import META_LOSS_FUNCTION, metadata
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer
from graphkit_train._base import select_learning_rate


def _description(loss: losses.Loss) -> tuple:
    return loss.name, loss.reduction, tuple(sorted(loss.params.items()))


def _prediction_model(loss: losses.Loss):
    """A graph whose output suits the loss: 3 columns for multiclass, else 1."""
    probe = loss.for_prediction(("N", 3))
    columns = 3 if probe.multiclass else 1
    return linear_regression_onnx(np.zeros((4, columns), np.float32), np.zeros(columns, np.float32))


LOSS_SPELLINGS = sorted(losses.LOSSES.spellings().items())


@pytest.mark.parametrize("spelling,name", LOSS_SPELLINGS, ids=[s for s, _ in LOSS_SPELLINGS])
def test_every_loss_name_means_one_loss_everywhere(spelling, name):
    reference = losses.LOSSES.get(name)
    onx = _prediction_model(reference)
    shape = tuple(
        d.dim_param or d.dim_value for d in onx.graph.output[0].type.tensor_type.shape.dim
    )
    expected = _description(reference.for_prediction(shape))
    assert _description(losses.get(spelling).for_prediction(shape)) == expected
    seed = gk.BaseLearningLoss.select(spelling).loss.for_prediction(shape)
    assert _description(seed) == expected
    recorded = json.loads(metadata(gk.add_loss_output(onx, spelling))[META_LOSS_FUNCTION])
    assert recorded["name"] == expected[0]
    trainer = OrtGradientForwardBackwardOptimizer(onx, learning_loss=spelling)
    trainer._build()
    assert _description(trainer.loss_) == expected


OPTIMIZER_SPELLINGS = sorted(optimizers.OPTIMIZERS.spellings().items())


@pytest.mark.parametrize(
    "spelling,name", OPTIMIZER_SPELLINGS, ids=[s for s, _ in OPTIMIZER_SPELLINGS]
)
def test_every_optimizer_name_means_one_update_everywhere(spelling, name):
    reference = optimizers.get(name)
    expected = (reference.name, reference.params)
    chosen = select_learning_rate(spelling)
    assert (chosen.name, chosen.params) == expected
    seed = gk.BaseLearningRate.select(spelling).to_transformation()
    assert (seed.name, seed.params) == expected
    onx = gk.add_loss_output(linear_regression_onnx(np.zeros((4, 1)), np.zeros(1)))
    trainer = OrtGradientOptimizer(onx, learning_rate=spelling)
    trainer._build()
    assert (trainer.learning_rate_.name, trainer.learning_rate_.params) == expected


def test_the_names_that_used_to_mean_two_things():
    assert losses.get("log").name == "log_loss"
    assert gk.BaseLearningLoss.select("log").loss.name == "log_loss"
    assert losses.get("binary_log_loss").params["binary"] is True
    assert gk.BaseLearningLoss.select("binary_log_loss").loss.params["binary"] is True
    momentum = select_learning_rate("momentum")
    assert momentum.params["convention"] == "torch" and momentum.params["nesterov"] is False
    # the seed's scikit-learn-convention Nesterov keeps its own, distinct name
    seed = select_learning_rate("SGDNesterov")
    assert seed.params["convention"] == "sklearn" and seed.params["nesterov"] is True
    with pytest.raises(gk.UnknownNameError):
        select_learning_rate("sgd_nesterov_sklearn")
