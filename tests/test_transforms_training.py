"""Transformations inside both trainers: the fused training step (full training) and
the update step after a TrainingAgent backward (forward/backward training) apply them
as the standalone transformation does on numpy gradients."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx, mlp_onnx
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import optimizers
from graphkit import transforms as tx
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

TRAINERS = ["full", "forward_backward"]


def make_trainer(kind, onx, learning_rate, **kwargs):
    kwargs.setdefault("shuffle", False)
    if kind == "full":
        return OrtGradientOptimizer(gk.add_loss_output(onx), learning_rate=learning_rate, **kwargs)
    return OrtGradientForwardBackwardOptimizer(onx, learning_rate=learning_rate, **kwargs)


def squared_error_grads(w, b, X, y):
    """d/dw, d/db of mean((X w + b - y)^2), in float64."""
    r = X @ w + b - y
    return {"coef": 2 * X.T @ r / len(X), "intercept": 2 * r.mean(0)}


def numpy_training(opt, X, y, batch_size, epochs, lr=None):
    """The transformation applied to numpy gradients, batch after batch."""
    X, y = X.astype(np.float64), y.reshape(-1, 1).astype(np.float64)
    params = {"coef": np.zeros((X.shape[1], 1)), "intercept": np.zeros(1)}
    state, step = opt.init(params), 0
    for _ in range(epochs):
        for i in range(0, len(X), batch_size):
            g = squared_error_grads(
                params["coef"], params["intercept"], X[i : i + batch_size], y[i : i + batch_size]
            )
            updates, state = opt.update(g, state, params, step, lr)
            params = tx.apply_updates(params, updates)
            step += 1
    return params, state


CHAINS = {
    "lion": lambda: optimizers.lion(weight_decay=0.01),
    "lamb": lambda: optimizers.lamb(weight_decay=0.01),
    "radam": lambda: optimizers.radam(),
    "adadelta": lambda: optimizers.adadelta(),
    "adafactor": lambda: optimizers.adafactor(),
    "clipped_adam": lambda: tx.chain(tx.clip_by_global_norm(0.5), optimizers.adam()),
    "adaptive_clip_sgd": lambda: tx.chain(tx.adaptive_clip(0.05), optimizers.sgd()),
    "lookahead": lambda: tx.lookahead(optimizers.momentum(momentum=0.9), sync_period=3),
    "accumulated": lambda: tx.multi_steps(optimizers.adam(), every_k=2),
    "skip_non_finite": lambda: tx.apply_if_finite(optimizers.rmsprop()),
    "ema": lambda: tx.chain(optimizers.adamw(), tx.ema(0.8)),
}


@pytest.mark.parametrize("kind", TRAINERS)
@pytest.mark.parametrize("name", sorted(CHAINS))
def test_trainers_apply_transformations_like_numpy_gradients(kind, name, regression_data):
    X, y = regression_data
    X64, y64 = X.astype(np.float64), y.astype(np.float64)
    onx = linear_regression_onnx(np.zeros((4, 1)), np.zeros(1))
    trainer = make_trainer(kind, onx, (CHAINS[name](), 0.05), batch_size=40, max_iter=3)
    trainer.fit(X64, y64)
    expected, expected_state = numpy_training(CHAINS[name](), X64, y64, 40, 3, lr=0.05)
    state = trainer.get_state()
    for w in expected:
        np.testing.assert_allclose(state[w], expected[w], rtol=1e-9, atol=1e-12)
    for s in expected_state:
        np.testing.assert_allclose(state[s], expected_state[s], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kind", TRAINERS)
def test_accumulating_k_batches_equals_one_batch_k_times_larger(kind, regression_data):
    X, y = regression_data
    X64, y64 = X.astype(np.float64), y.astype(np.float64)
    onx = linear_regression_onnx(np.zeros((4, 1)), np.zeros(1))
    accumulated = make_trainer(
        kind, onx, tx.multi_steps(optimizers.sgd(learning_rate=0.1), 4), batch_size=10, max_iter=3
    )
    big = make_trainer(kind, onx, optimizers.sgd(learning_rate=0.1), batch_size=40, max_iter=3)
    accumulated.fit(X64, y64)
    big.fit(X64, y64)
    for w in ("coef", "intercept"):
        np.testing.assert_allclose(accumulated.get_state()[w], big.get_state()[w], rtol=1e-12)


def two_layer_onnx(rng):
    """Y = relu(X W1 + b1) W2 + b2, float32."""
    return mlp_onnx(4, 5, 1, "Relu", np.float32, seed=int(rng.integers(1000)))


@pytest.mark.parametrize("kind", TRAINERS)
def test_a_frozen_layer_stays_bit_identical(kind, regression_data, rng):
    X, y = regression_data
    onx = two_layer_onnx(rng)
    opt = tx.chain(tx.freeze(lambda name: name.endswith("1")), optimizers.adam(learning_rate=0.01))
    trainer = make_trainer(kind, onx, opt, batch_size=20, max_iter=3)
    trainer.fit(X, y)
    state = trainer.get_state()
    start = {i.name: numpy_helper.to_array(i) for i in onx.graph.initializer}
    for w in ("W1", "b1"):
        np.testing.assert_array_equal(state[w], start[w])
    assert not np.array_equal(state["W2"], start["W2"])
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]


def sqrt_weight_onnx():
    """Y = X sqrt(W): the gradient at W = 0 is infinite while the loss stays finite."""
    W = np.array([[0.0], [1.0], [1.0], [1.0]], np.float32)
    graph = helper.make_graph(
        [helper.make_node("Sqrt", ["W"], ["s"]), helper.make_node("MatMul", ["X", "s"], ["Y"])],
        "sqrt_weight",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(W, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("kind", TRAINERS)
def test_non_finite_gradients_are_skipped_and_counted(kind, regression_data):
    X, y = regression_data
    onx = sqrt_weight_onnx()
    opt = tx.apply_if_finite(optimizers.adam(learning_rate=0.01))
    trainer = make_trainer(kind, onx, opt, batch_size=50, max_iter=2, weights_to_train=["W"])
    trainer.fit(X, y)
    state = trainer.get_state()
    np.testing.assert_array_equal(state["W"], numpy_helper.to_array(onx.graph.initializer[0]))
    assert int(state["apply_if_finite.skipped"]) == 8  # 2 epochs of 4 batches
    np.testing.assert_array_equal(state["W.adam.m"], 0)
    assert np.isfinite(trainer.train_losses_).all()


@pytest.mark.parametrize("kind", TRAINERS)
def test_the_moving_average_is_exported_as_the_trained_model(kind, regression_data):
    X, y = regression_data
    onx = linear_regression_onnx(np.zeros((4, 1), np.float32), np.zeros(1, np.float32))
    opt = tx.chain(optimizers.sgd(), tx.ema(0.9))
    trainer = make_trainer(kind, onx, (opt, 0.05), batch_size=20, max_iter=2)
    trainer.fit(X, y)
    average = tx.ema_weights(trainer.get_state())
    assert not np.allclose(average["coef"], trainer.get_state()["coef"])
    model = trainer.get_trained_onnx(ema=True)
    onnx.checker.check_model(model)
    predicted = gk.run(model, {"X": X[:5]})["Y"]
    np.testing.assert_allclose(predicted, X[:5] @ average["coef"] + average["intercept"], rtol=1e-5)
    with pytest.raises(gk.UnknownNameError, match="ema"):
        make_trainer(kind, onx, 0.05, max_iter=1).fit(X, y).get_trained_onnx(ema=True)


def test_update_step_takes_a_transformation_and_a_schedule(rng):
    from graphkit.engine.ort_engine import Runner
    from graphkit_train import build_update_step

    weights = {"w": rng.normal(size=(3,))}
    step = build_update_step(
        weights, optimizers.momentum(momentum=0.9), learning_rate=gk.schedules.invscaling(0.1, 0.5)
    )
    onnx.checker.check_model(step.model, full_check=True)
    runner = Runner(step.model)
    feeds = dict(step.initial)
    reference = optimizers.momentum(gk.schedules.invscaling(0.1, 0.5), momentum=0.9)
    params, state = {"w": weights["w"]}, reference.init(weights)
    for t in range(5):
        g = rng.normal(size=3)
        out = dict(
            zip(
                runner.output_names, runner({**feeds, "w_grad": g, "loss": np.array(0, np.float32)})
            )
        )
        feeds = {n: out.get(f"{n}.next", feeds[n]) for n in feeds}
        updates, state = reference.update({"w": g}, state, params, t)
        params = tx.apply_updates(params, updates)
    np.testing.assert_allclose(feeds["w"], params["w"], rtol=1e-12)
    with pytest.raises(ValueError, match="open learning rate"):
        build_update_step(weights, optimizers.adam())
    with pytest.raises(TypeError, match="gradient transformation"):
        build_update_step(weights, "adam")


def test_forward_backward_takes_dsl_losses_and_penalties(regression_data):
    """The runtime resolves graphkit objects itself; the seed classes are adapters."""
    X, y = regression_data
    onx = linear_regression_onnx(np.zeros((4, 1), np.float32), np.zeros(1, np.float32))
    results = []
    for loss, penalty in [
        (gk.losses.get("huber", delta=0.5), gk.penalties.get("l2", alpha=0.1)),
        (gk.HuberLearningLoss(delta=0.5), gk.penalties.get("l2", alpha=0.1)),
    ]:
        trainer = make_trainer(
            "forward_backward", onx, 0.05, max_iter=2, learning_loss=loss, learning_penalty=penalty
        )
        trainer.fit(X, y)
        assert isinstance(trainer.learning_loss_, gk.Loss)
        assert isinstance(trainer.learning_penalty_, gk.Penalty)
        results.append(trainer.get_state()["coef"])
    np.testing.assert_array_equal(results[0], results[1])
    with pytest.raises(TypeError, match="learning_loss must be"):
        make_trainer("forward_backward", onx, 0.05, learning_loss=3.0).fit(X, y)
    with pytest.raises(TypeError, match="learning_penalty must be"):
        make_trainer("forward_backward", onx, 0.05, learning_penalty=[1]).fit(X, y)
