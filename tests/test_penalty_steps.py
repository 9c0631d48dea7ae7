"""Every way a penalty reaches a training step, against numpy's one-step formula.

A penalty ``P(w) = l1 sum|w| + l2 sum w^2`` adds ``l1 sign(w) + 2 l2 w`` to the gradient
of the weights it applies to, and ``P(w)`` to the reported loss. A dropped penalty hides
behind a falling loss (a ridge regression trained without it converges to plain least
squares), so each case checks the weights after whole epochs of SGD, batch by batch, and
the reported losses, on every installed backend:

* in the training graph (``add_loss_output(..., penalty=...)``), full training: one run
  per batch, the whole-epoch Scan, the step for any batch size, and the portable exports;
* ``penalty=`` on :class:`~graphkit_train.ForwardBackwardTrainer`, the seed's
  ``learning_penalty`` on :class:`~graphkit_train.OrtGradientForwardBackwardOptimizer`.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS, linear_regression_onnx, on_both_runtimes

import graphkit as gk
from graphkit import penalties
from graphkit.seed import ElasticLearningPenalty
from graphkit.training.export import export_training_epoch, export_training_step
from graphkit_train import (
    ForwardBackwardTrainer,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
)

LR = 0.05
ROWS, BATCH, EPOCHS = 24, 8, 2


# -- numpy's reference -------------------------------------------------------------------


def loss_and_grad(name: str, p: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """The mean loss of a batch and its gradient with respect to the prediction."""
    if name == "cross_entropy":
        z = p - p.max(axis=1, keepdims=True)
        softmax = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        onehot = np.eye(p.shape[1])[y]
        loss = -np.log(softmax[np.arange(len(y)), y]).mean()
        return loss, (softmax - onehot) / len(y)
    r = p - y
    if name == "squared_error":
        return (r**2).mean(), 2 * r / r.size
    if name == "absolute_error":
        return np.abs(r).mean(), np.sign(r) / r.size
    assert name == "huber"  # delta 0.5, torch's HuberLoss
    delta = 0.5
    inside = np.abs(r) <= delta
    values = np.where(inside, r**2 / 2, delta * (np.abs(r) - delta / 2))
    return values.mean(), np.clip(r, -delta, delta) / r.size


def numpy_sgd(
    loss: str,
    coefficients: dict[str, tuple[float, float]],
    W: np.ndarray,
    b: np.ndarray,
    X: np.ndarray,
    y: np.ndarray,
    batch: int = BATCH,
    epochs: int = EPOCHS,
) -> tuple[dict[str, np.ndarray], list[float]]:
    """``epochs`` epochs of SGD at LR over batches of ``batch`` rows in order: the
    weights and the mean batch loss (data loss + penalty) of each epoch."""
    w = {"coef": W.copy(), "intercept": b.copy()}
    epoch_losses = []
    for _ in range(epochs):
        batch_losses = []
        for start in range(0, len(X), batch):
            xb, yb = X[start : start + batch], y[start : start + batch]
            value, dp = loss_and_grad(loss, xb @ w["coef"] + w["intercept"], yb)
            grads = {"coef": xb.T @ dp, "intercept": dp.sum(axis=0)}
            for name, (l1, l2) in coefficients.items():
                value += l1 * np.abs(w[name]).sum() + l2 * (w[name] ** 2).sum()
                grads[name] = grads[name] + l1 * np.sign(w[name]) + 2 * l2 * w[name]
            w = {name: w[name] - LR * grads[name] for name in w}
            batch_losses.append(value)
        epoch_losses.append(float(np.mean(batch_losses)))
    return w, epoch_losses


# -- the problems ------------------------------------------------------------------------

LOSSES = {  # loss name -> outputs of the linear model
    "squared_error": 2,
    "absolute_error": 1,
    "huber": 1,
    "cross_entropy": 3,
}


def problem(loss: str, seed: int = 0):
    """A float64 linear model with nonzero weights (l1's sign is defined) and its data."""
    rng = np.random.default_rng(seed)
    k = LOSSES[loss]
    W = rng.normal(size=(3, k)) + 0.1
    b = rng.normal(size=k) + 0.1
    X = rng.normal(size=(ROWS, 3))
    if loss == "cross_entropy":
        y = rng.integers(0, k, size=ROWS).astype(np.int64)
    else:
        y = X @ rng.normal(size=(3, k)) + rng.normal(scale=0.3, size=(ROWS, k))
    return linear_regression_onnx(W, b), W, b, X, y


def graph_penalty(spec):
    """``add_loss_output``'s penalty argument and its ``{weight: (l1, l2)}``."""
    return {
        "seed": ({"coef": {"l1": 0.05, "l2": 0.3}}, {"coef": (0.05, 0.3)}),
        "number": ({"coef": 0.4}, {"coef": (0.0, 0.4)}),
        "all": (penalties.l2(0.2), {"coef": (0.0, 0.2), "intercept": (0.0, 0.2)}),
        "intercept": (
            penalties.elastic(0.1, 0.2, weights=["intercept"]),
            {"intercept": (0.1, 0.2)},
        ),
    }[spec]


def training_graph(loss: str, spec, model: onnx.ModelProto) -> onnx.ModelProto:
    kwargs = {"delta": 0.5} if loss == "huber" else {}
    return gk.add_loss_output(model, loss, penalty=spec, **kwargs)


def check(trainer, expected: dict[str, np.ndarray], losses: list[float]) -> None:
    state = trainer.get_state()
    for name, value in expected.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-9, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(trainer.train_losses_, losses, rtol=1e-9)


# -- full training: the penalty in the graph -------------------------------------------


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("spec", ["seed", "number", "all", "intercept"])
def test_penalty_in_the_graph_is_trained(backend, loss, spec):
    model, W, b, X, y = problem(loss)
    given, coefficients = graph_penalty(spec)
    expected, losses = numpy_sgd(loss, coefficients, W, b, X, y)
    trainer = OrtGradientOptimizer(
        training_graph(loss, given, model),
        learning_rate=LR,
        max_iter=EPOCHS,
        batch_size=BATCH,
        shuffle=False,
        backend=backend,
    ).fit(X, y)
    check(trainer, expected, losses)
    # the penalty changed the step: the same training without it ends elsewhere
    plain, _ = numpy_sgd(loss, {}, W, b, X, y)
    penalized = next(iter(coefficients))
    assert not np.allclose(plain[penalized], expected[penalized], rtol=1e-6)


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize(
    "how",
    [
        {"steps_per_run": 1},
        {"steps_per_run": 2},
        {"steps_per_run": 1, "static_shapes": False},
        {"batch_size": 10},  # a last, shorter batch through the step for any size
    ],
    ids=["per-batch", "two-per-run", "any-batch-size", "shorter-last-batch"],
)
def test_penalty_in_every_way_a_step_runs(backend, how):
    model, W, b, X, y = problem("squared_error")
    given, coefficients = graph_penalty("seed")
    batch = how.get("batch_size", BATCH)
    kwargs = {k: v for k, v in how.items() if k != "batch_size"}
    trainer = OrtGradientOptimizer(
        training_graph("squared_error", given, model),
        learning_rate=LR,
        max_iter=EPOCHS,
        batch_size=batch,
        shuffle=False,
        backend=backend,
        **kwargs,
    ).fit(X, y)
    expected, losses = numpy_sgd("squared_error", coefficients, W, b, X, y, batch)
    check(trainer, expected, losses)


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_penalty_in_the_exported_step_and_epoch(backend):
    """The portable step and epoch, run on onnxruntime and onnx.reference, apply the
    penalty: one step equals numpy's, and one epoch equals numpy's epoch."""
    model, W, b, X, y = problem("squared_error")
    given, coefficients = graph_penalty("seed")
    trainer = OrtGradientOptimizer(
        training_graph("squared_error", given, model),
        learning_rate=LR,
        max_iter=1,
        batch_size=BATCH,
        shuffle=False,
        backend=backend,
    )
    step = export_training_step(trainer)
    feeds = {
        "X": X[:BATCH],
        "label": y[:BATCH],
        "coef": W,
        "intercept": b,
        "step": np.array(0, dtype=np.int64),
        "loss_sum": np.array(0.0),
    }
    feeds = {i.name: feeds[i.name] for i in step.graph.input}
    names = [o.name for o in step.graph.output]
    one_batch, batch_loss = numpy_sgd(
        "squared_error", coefficients, W, b, X[:BATCH], y[:BATCH], epochs=1
    )
    one_epoch, epoch_loss = numpy_sgd("squared_error", coefficients, W, b, X, y, epochs=1)
    for outputs in on_both_runtimes(step, feeds):
        out = dict(zip(names, outputs))
        np.testing.assert_allclose(out["coef.next"], one_batch["coef"], rtol=1e-9)
        np.testing.assert_allclose(out["intercept.next"], one_batch["intercept"], rtol=1e-9)
        assert float(out["loss"]) == pytest.approx(batch_loss[0], rel=1e-9)

    epoch = export_training_epoch(trainer)
    feeds = {
        "X": X,
        "label": y,
        "permutation": np.arange(ROWS, dtype=np.int64),
        "batch_size": np.array(BATCH, dtype=np.int64),
        "coef": W,
        "intercept": b,
        "step": np.array(0, dtype=np.int64),
        "loss_sum": np.array(0.0),
    }
    feeds = {i.name: feeds[i.name] for i in epoch.graph.input}
    names = [o.name for o in epoch.graph.output]
    for outputs in on_both_runtimes(epoch, feeds):
        out = dict(zip(names, outputs))
        np.testing.assert_allclose(out["coef.next"], one_epoch["coef"], rtol=1e-9)
        np.testing.assert_allclose(out["intercept.next"], one_epoch["intercept"], rtol=1e-9)
        assert float(np.mean(out["batch_losses"])) == pytest.approx(epoch_loss[0], rel=1e-9)


def test_ridge_by_add_loss_output_reaches_sklearn_ridge():
    """Trained to convergence, the penalized graph is scikit-learn's Ridge, not plain
    least squares: mean (p - y)^2 + a |w|^2 is Ridge(alpha = n a) on the sum of squares."""
    from sklearn.linear_model import LinearRegression, Ridge

    rng = np.random.default_rng(3)
    X = rng.normal(size=(60, 3))
    y = X @ np.array([2.0, -1.0, 0.5]) + 1.0 + rng.normal(scale=0.1, size=60)
    a = 0.5
    model = linear_regression_onnx(np.zeros((3, 1)), np.zeros(1))
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model, penalty={"coef": a}),
        learning_rate=0.1,
        max_iter=300,
        batch_size=60,
        shuffle=False,
    ).fit(X, y)
    ridge = Ridge(alpha=len(X) * a).fit(X, y)
    np.testing.assert_allclose(trainer.get_state()["coef"][:, 0], ridge.coef_, rtol=1e-6)
    plain = LinearRegression().fit(X, y)
    assert not np.allclose(trainer.get_state()["coef"][:, 0], plain.coef_, rtol=1e-2)


# -- forward/backward training: penalty= and the seed's learning_penalty ----------------


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("loss", ["squared_error", "cross_entropy"])
@pytest.mark.parametrize("api", ["graphkit", "seed"])
def test_penalty_of_forward_backward_training(backend, loss, api):
    model, W, b, X, y = problem(loss)
    coefficients = {"coef": (0.05, 0.3), "intercept": (0.05, 0.3)}
    common = dict(max_iter=EPOCHS, batch_size=BATCH, shuffle=False, backend=backend)
    if api == "graphkit":
        trainer = ForwardBackwardTrainer(
            model,
            loss=loss,
            penalty=penalties.elastic(0.05, 0.3),
            optimizer="sgd",
            schedule=LR,
            **common,
        )
    else:
        trainer = OrtGradientForwardBackwardOptimizer(
            model,
            learning_loss=loss,
            learning_penalty=ElasticLearningPenalty(l1=0.05, l2=0.3),
            learning_rate=LR,
            **common,
        )
    trainer.fit(X, y)
    expected, losses = numpy_sgd(loss, coefficients, W, b, X, y)
    check(trainer, expected, losses)
