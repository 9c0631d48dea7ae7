"""The trainers follow scikit-learn's estimator protocol: its own check suite, the
conventions users rely on, early stopping and the per-epoch callback."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
from conftest import linear_regression_onnx
from onnx import TensorProto, helper, numpy_helper
from sklearn.base import clone, is_classifier, is_regressor
from sklearn.exceptions import NotFittedError
from sklearn.utils.estimator_checks import parametrize_with_checks

import graphkit as gk
from graphkit_train import (
    ForwardBackwardTrainer,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
    Trainer,
)


def any_width_model():
    """Y = mean(X, axis=1) a + b: a graph that takes any number of features, so that
    scikit-learn's checks (which use 1 to 30 features) can all run on one model."""
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["X", "axes"], ["m"], keepdims=1),
            helper.make_node("Gemm", ["m", "a", "b"], ["Y"]),
        ],
        "mean_model",
        [helper.make_tensor_value_info("X", TensorProto.DOUBLE, ["N", "F"])],
        [helper.make_tensor_value_info("Y", TensorProto.DOUBLE, ["N", 1])],
        [
            numpy_helper.from_array(np.ones((1, 1)), "a"),
            numpy_helper.from_array(np.zeros(1), "b"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


SETTINGS = dict(max_iter=5, learning_rate="adam", random_state=0)
OURS = dict(max_iter=5, optimizer="adam", random_state=0)  # graphkit's trainers' words
ESTIMATORS = [
    OrtGradientOptimizer(gk.add_loss_output(any_width_model(), weight_name="weight"), **SETTINGS),
    OrtGradientForwardBackwardOptimizer(any_width_model(), **SETTINGS),
    Trainer(gk.add_loss_output(any_width_model(), weight_name="weight"), **OURS),
    ForwardBackwardTrainer(any_width_model(), **OURS),
]

# Each reason says why a graph with fixed parameters cannot pass the check.
EXPECTED_FAILURES = {
    "check_regressors_train": "the check wants R^2 > 0.5 on data needing one weight per "
    "feature; this graph has two weights for any width (the zoo checks real models)",
    "check_sample_weight_equivalence_on_dense_data": "shuffled mini-batches see a repeated "
    "row in another batch than its weighted twin; equal only for full-batch training",
    "check_supervised_y_2d": "a (N, 1) target matches the graph's (N, 1) prediction: "
    "nothing is converted, so there is no DataConversionWarning to raise",
}


@parametrize_with_checks(ESTIMATORS, expected_failed_checks=lambda _: EXPECTED_FAILURES)
def test_scikit_learn_check_suite(estimator, check):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        check(estimator)


@pytest.fixture
def data(rng):
    X = rng.normal(size=(60, 3))
    return X, X @ np.array([1.0, -2.0, 0.5]) + 0.3


def linear(columns=1):
    return linear_regression_onnx(np.zeros((3, columns)), np.zeros(columns))


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_numpy_integers_strings_and_not_fitted(kind, data):
    X, y = data
    if kind == "full":
        trainer = OrtGradientOptimizer(gk.add_loss_output(linear()), weights_to_train="coef")
    else:
        trainer = OrtGradientForwardBackwardOptimizer(linear(), weights_to_train="coef")
    with pytest.raises(NotFittedError, match="not fitted yet"):
        trainer.predict(X)
    with pytest.raises(NotFittedError):
        trainer.score(X, y)
    grid = np.arange(1, 4)  # numpy integers, as grids built with numpy.arange give
    trainer.set_params(max_iter=grid[2], batch_size=grid[1] * 5).fit(X, y)
    assert trainer.weights_to_train_ == ["coef"] and len(trainer.train_losses_) == 3
    assert set(trainer.get_state()) == {"coef", "step"}
    intercept = gk.get_train_initializer(trainer.get_trained_onnx())["intercept"]
    np.testing.assert_array_equal(intercept, [0.0])  # not trained
    assert is_regressor(trainer) and not is_classifier(trainer)
    assert trainer.n_features_in_ == 3
    from scipy.sparse import csr_matrix

    with pytest.raises(TypeError, match=r"sparse matrix.*toarray\(\)"):
        trainer.fit(csr_matrix(X), y)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        clone(trainer).set_params(batch_size=2.5).fit(X, y)


def test_classifier_tags_classes_and_probabilities(rng):
    X = rng.normal(size=(90, 3))
    y = np.arange(90) % 3
    trainer = OrtGradientForwardBackwardOptimizer(linear(3), learning_loss="cross_entropy")
    assert is_classifier(trainer)
    assert not hasattr(OrtGradientForwardBackwardOptimizer(linear()), "predict_proba")
    trainer.set_params(max_iter=3).fit(X, y)
    np.testing.assert_array_equal(trainer.classes_, [0, 1, 2])
    proba = trainer.predict_proba(X)
    np.testing.assert_allclose(proba.sum(axis=1), 1, rtol=1e-12)
    np.testing.assert_array_equal(trainer.predict(X), proba.argmax(axis=1))
    assert trainer.score(X, y) == pytest.approx((trainer.predict(X) == y).mean())


def test_forward_backward_takes_sample_weights_in_fit(data):
    """fit(X, y, w) as in the seed API, no constructor flag: one full-batch SGD step
    equals the weighted-mean gradient written in numpy."""
    X, y = data
    w = np.linspace(0.1, 2, len(X))
    rate = 0.1
    trainer = OrtGradientForwardBackwardOptimizer(
        linear(),
        max_iter=1,
        batch_size=len(X),
        shuffle=False,
        learning_rate=gk.LearningRateSGD(eta0=rate, learning_rate="constant"),
    ).fit(X, y, w)
    # loss = sum w (X c + b - y)^2 / sum w; gradient 2 sum w r x / sum w
    residual = -y
    grad_coef = 2 * (w * residual) @ X / w.sum()
    grad_intercept = 2 * (w * residual).sum() / w.sum()
    state = trainer.get_state()
    np.testing.assert_allclose(state["coef"][:, 0], -rate * grad_coef, rtol=1e-12)
    np.testing.assert_allclose(state["intercept"], [-rate * grad_intercept], rtol=1e-12)


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_callback_can_stop_training(kind, data):
    X, y = data
    seen = []

    def stop_at_three(epoch, losses, trainer):
        seen.append((epoch, losses["train"], losses["validation"]))
        return epoch == 3

    if kind == "full":
        trainer = OrtGradientOptimizer(gk.add_loss_output(linear()), max_iter=50)
    else:
        trainer = OrtGradientForwardBackwardOptimizer(linear(), max_iter=50)
    trainer.set_params(validation_every=1).fit(
        X, y, X_val=X[:10], y_val=y[:10], callback=stop_at_three
    )
    assert [epoch for epoch, _, _ in seen] == [1, 2, 3]
    assert [loss for _, loss, _ in seen] == trainer.train_losses_
    assert [held for _, _, held in seen] == trainer.validation_losses_
    assert trainer.n_iter_ == 3


def test_early_stopping_restores_the_best_weights(rng):
    """A noisy problem trained far too long at a high rate: the held-out loss stops
    improving; training stops after n_iter_no_change epochs and keeps the best weights."""
    X = rng.normal(size=(200, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + rng.normal(scale=2.0, size=200)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(linear()),
        max_iter=300,
        batch_size=4,
        random_state=0,
        learning_rate=(gk.optimizers.get("sgd"), 0.05),
        early_stopping=True,
        validation_fraction=0.2,
        n_iter_no_change=5,
        tol=0.0,
    ).fit(X, y)
    assert trainer.n_iter_ < 300
    losses = trainer.validation_losses_
    best = int(np.argmin(losses))
    assert len(losses) == best + 1 + 5  # stopped 5 epochs after the best
    # the held-out rows: the first 40 of the seeded permutation
    held = np.random.default_rng(0).permutation(200)[:40]
    assert trainer.compute_loss(X[held], y[held]) == pytest.approx(losses[best], rel=1e-12)
    assert trainer.best_loss_ == losses[best]


def test_importing_the_runtime_loads_neither_scikit_learn_nor_torch():
    code = "import sys, graphkit_train; print('sklearn' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
