"""Regressors with k outputs: labels shaped like the prediction, (N, k).

A regression loss's ``"mean"`` is the mean over all N k predicted values, as
``torch.nn.MSELoss()``; ``"sum"`` their sum. Checked against torch (the losses, and
torch's SGD of the same 2-output network from the same initial weights, in both
trainers), numpy written from the formula (weighted means, the elastic loss) and
scikit-learn (a 2-target ``MLPRegressor`` converted by skl2onnx, ``r2_score``).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from zoo.models import torch_export

import graphkit as gk
from graphkit import ShapeError, losses

torch = pytest.importorskip("torch")

# -- the losses ---------------------------------------------------------------------------

TORCH_LOSSES = {
    "squared_error": lambda reduction: torch.nn.MSELoss(reduction=reduction),
    "absolute_error": lambda reduction: torch.nn.L1Loss(reduction=reduction),
    "huber": lambda reduction: torch.nn.HuberLoss(reduction=reduction, delta=0.6),
}
PARAMS = {"huber": {"delta": 0.6}}


@pytest.mark.parametrize("name", sorted(TORCH_LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_loss_value_and_gradient_match_torch(name, reduction, k, rng):
    p = rng.normal(scale=1.5, size=(9, k))
    y = rng.normal(size=(9, k))
    pt = torch.tensor(p, requires_grad=True)
    expected = TORCH_LOSSES[name](reduction)(pt, torch.tensor(y))
    expected.backward()
    loss = losses.get(name, reduction=reduction, **PARAMS.get(name, {}))
    value, grad = loss.value_and_grad(p, y)
    np.testing.assert_allclose(value, expected.item(), rtol=1e-12)
    np.testing.assert_allclose(grad, pt.grad.numpy(), rtol=1e-12, atol=1e-15)
    # the graph add_loss_output splices in, compiled for the declared (N, k)
    model = loss.value_model(np.float64, prediction_shape=("N", k))
    np.testing.assert_allclose(
        gk.run(model, {"prediction": p, "label": y})["loss"], expected.item(), rtol=1e-12
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_weighted_means_and_elastic_match_the_formula(dtype, rng):
    """mean = sum_i w_i sum_j f(d_ij) / (k sum_i w_i), gradient w_i f'(d_ij) / (k sum w)."""
    p, y = rng.normal(size=(8, 3)).astype(dtype), rng.normal(size=(8, 3)).astype(dtype)
    w = rng.uniform(0.2, 2.0, size=8).astype(dtype)
    d = p.astype(np.float64) - y
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    formulas = {
        "squared_error": ({}, d**2, 2 * d),
        "elastic": (
            {"l1_weight": 0.3, "l2_weight": 0.7},
            0.3 * np.abs(d) + 0.7 * d**2,
            0.3 * np.sign(d) + 1.4 * d,
        ),
    }
    for name, (params, f, df) in formulas.items():
        loss = losses.get(name, **params)
        value, grad = loss.value_and_grad(p, y, w)
        assert value.dtype == dtype and grad.shape == p.shape
        np.testing.assert_allclose(value, (w * f.sum(1)).sum() / (3 * w.sum()), rtol=rtol)
        np.testing.assert_allclose(grad, w[:, None] * df / (3 * w.sum()), rtol=rtol, atol=1e-7)
        # "none": each sample's sum over its values
        per_sample = losses.get(name, reduction="none", **params)(p, y, w)
        np.testing.assert_allclose(per_sample, w * f.sum(1), rtol=rtol)


def test_a_width_only_known_at_run_time(rng):
    """A prediction declared (N, K): the mean reads k from the prediction."""
    p, y = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
    model = losses.get("squared_error").gradient_model(np.float64, prediction_shape=("N", "K"))
    out = gk.run(model, {"prediction": p, "label": y})
    np.testing.assert_allclose(out["loss"], np.mean((p - y) ** 2), rtol=1e-12)
    np.testing.assert_allclose(out["prediction_grad"], 2 * (p - y) / p.size, rtol=1e-12)


# -- both trainers against torch's SGD of the same network --------------------------------


def _network():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


@pytest.fixture(scope="module")
def two_targets():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 4)).astype(np.float32)
    Y = np.stack([X @ [1.0, -1.0, 0.5, 2.0], np.tanh(X[:, 0] - X[:, 3])], 1).astype(np.float32)
    w = rng.uniform(0.2, 2.0, size=40).astype(np.float32)
    return X, Y, w


def _torch_sgd(X, Y, w, epochs, batch_size, lr, loss):
    net = _network()
    sgd = torch.optim.SGD(net.parameters(), lr=lr)
    losses_ = []
    for _ in range(epochs):
        total = 0.0
        for start in range(0, len(X), batch_size):
            sgd.zero_grad()
            rows = slice(start, start + batch_size)
            out, target = net(torch.from_numpy(X[rows])), torch.from_numpy(Y[rows])
            if w is None:
                value = loss(out, target)
            else:  # the weighted mean over every value: sum_i w_i sum_j l_ij / (k sum w)
                wb = torch.from_numpy(w[rows])
                value = (wb[:, None] * (out - target) ** 2).sum() / (2 * wb.sum())
            value.backward()
            sgd.step()
            total += value.item()
        losses_.append(total / -(-len(X) // batch_size))
    return net, losses_


def _trainer(kind, onx, weighted=False, loss="squared_error", **settings):
    from graphkit_train import ForwardBackwardTrainer, Trainer

    settings = dict(max_iter=3, batch_size=8, shuffle=False, optimizer="sgd", **settings)
    if kind == "forward_backward":
        return ForwardBackwardTrainer(onx, loss=loss, **settings)
    train = gk.add_loss_output(onx, loss, weight_name="weight" if weighted else None)
    return Trainer(train, **settings)


def _compare(state, net, rtol=1e-4):
    for name, param in net.named_parameters():
        expected = param.detach().numpy()
        np.testing.assert_allclose(
            state[name], expected.reshape(state[name].shape), rtol=rtol, atol=1e-6, err_msg=name
        )


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
@pytest.mark.parametrize("dynamo", [False, True])
def test_two_outputs_train_like_torch_sgd(two_targets, kind, dynamo):
    X, Y, _ = two_targets
    onx = torch_export(_network(), X, dynamo)
    trainer = _trainer(kind, onx).fit(X, Y)
    net, expected_losses = _torch_sgd(X, Y, None, 3, 8, 0.01, torch.nn.MSELoss())
    _compare(trainer.get_state(), net)
    np.testing.assert_allclose(trainer.train_losses_, expected_losses, rtol=1e-5)
    assert trainer.predict(X).shape == (40, 2)
    with torch.no_grad():
        np.testing.assert_allclose(
            trainer.predict(X), net(torch.from_numpy(X)).numpy(), rtol=1e-4, atol=1e-5
        )


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_sample_weights_and_huber_like_torch(two_targets, kind):
    X, Y, w = two_targets
    onx = torch_export(_network(), X, False)
    trainer = _trainer(kind, onx, weighted=True).fit(X, Y, sample_weight=w)
    net, expected_losses = _torch_sgd(X, Y, w, 3, 8, 0.01, None)
    _compare(trainer.get_state(), net)
    np.testing.assert_allclose(trainer.train_losses_, expected_losses, rtol=1e-5)

    trainer = _trainer(kind, onx, loss=losses.get("huber", delta=0.6)).fit(X, 3 * Y)
    net, _ = _torch_sgd(X, 3 * Y, None, 3, 8, 0.01, torch.nn.HuberLoss(delta=0.6))
    _compare(trainer.get_state(), net)


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_validation_early_stopping_score_and_checkpoints(two_targets, kind, tmp_path):
    from sklearn.metrics import r2_score

    X, Y, w = two_targets
    onx = torch_export(_network(), X, False)
    trainer = _trainer(kind, onx, early_stopping=True, n_iter_no_change=2, validation_fraction=0.25)
    trainer.set_params(max_iter=40, shuffle=True, random_state=0).fit(X, Y)
    assert trainer.validation_losses_ and trainer.best_loss_ == min(trainer.validation_losses_)
    trainer.set_params(early_stopping=False, max_iter=5, validation_every=1)
    trainer.fit(X[:30], Y[:30], X_val=X[30:], y_val=Y[30:])
    assert len(trainer.validation_losses_) == 5
    # held-out loss: the mean over every value of the held-out rows
    np.testing.assert_allclose(
        trainer.compute_loss(X[30:], Y[30:]),
        np.mean((trainer.predict(X[30:]) - Y[30:]) ** 2),
        rtol=1e-5,
    )
    # score: scikit-learn's R^2 averaged over the outputs, as its regressors do
    prediction = trainer.predict(X)
    assert trainer.score(X, Y) == pytest.approx(r2_score(Y, prediction), rel=1e-6)
    assert trainer.score(X, Y, w) == pytest.approx(
        r2_score(Y, prediction, sample_weight=w, multioutput="uniform_average"), rel=1e-6
    )
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    again = _trainer(kind, onx, early_stopping=True).load_checkpoint(path)
    np.testing.assert_array_equal(again.predict(X), prediction)


def test_one_value_per_sample_still_takes_both_label_shapes(rng):
    from graphkit_train import Trainer

    X = rng.normal(size=(30, 3)).astype(np.float32)
    y = (X @ [1.0, 2.0, -1.0]).astype(np.float32)
    onx = gk.add_loss_output(_linear(3, 1))
    states = [
        Trainer(onx, max_iter=2, random_state=0).fit(X, labels).get_state()["coef"]
        for labels in (y, y[:, None])
    ]
    np.testing.assert_array_equal(states[0], states[1])


# -- a two-target scikit-learn MLP converted by skl2onnx ----------------------------------


@pytest.fixture(scope="module")
def diabetes_two_targets():
    from sklearn.datasets import load_diabetes

    X, y = load_diabetes(return_X_y=True)
    X = (X - X.mean(0)) / X.std(0)
    y = (y - y.mean()) / y.std()
    Y = np.stack([y, 0.5 * y + 0.5 * X[:, 8] * X[:, 2]], axis=1)  # y and a second column
    order = np.random.default_rng(0).permutation(len(X))
    train, test = order[:330], order[330:]
    return X[train].astype(np.float32), Y[train], X[test].astype(np.float32), Y[test]


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_skl2onnx_two_target_mlp_regressor_trains_like_sklearn(diabetes_two_targets, kind):
    from skl2onnx import to_onnx
    from sklearn.metrics import r2_score
    from sklearn.neural_network import MLPRegressor

    X, Y, X_test, Y_test = diabetes_two_targets
    settings = dict(hidden_layer_sizes=(16,), random_state=0, learning_rate_init=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = MLPRegressor(max_iter=1, **settings).fit(X, Y)  # barely trained
        baseline = MLPRegressor(max_iter=300, **settings).fit(X, Y)
    onx = to_onnx(start, X[:1])
    from graphkit_train import ForwardBackwardTrainer, Trainer

    settings = dict(optimizer="adam", schedule=0.01, batch_size=32, max_iter=60, random_state=0)
    if kind == "full":
        trainer = Trainer(onx, loss="squared_error", warm_start=True, **settings)
    else:
        trainer = ForwardBackwardTrainer(onx, warm_start=True, **settings)
    # skl2onnx 1.20 flattens the two targets into (2N, 1) rows: graphkit predicts (N, 2),
    # as scikit-learn does
    trainer.set_state(gk.get_train_initializer(onx))  # the weights scikit-learn left
    np.testing.assert_allclose(trainer.predict(X_test), start.predict(X_test), rtol=1e-4, atol=1e-5)
    trainer.fit(X, Y)
    ours = r2_score(Y_test, trainer.predict(X_test))
    theirs = r2_score(Y_test, baseline.predict(X_test))
    assert ours > 0.3 and ours > theirs - 0.1, (ours, theirs)
    trained = trainer.get_trained_onnx()
    assert gk.run(trained, {"X": X_test})[trained.graph.output[0].name].shape == (len(X_test), 2)


# -- refusals ------------------------------------------------------------------------------


def _linear(n_in, n_out, width=None):
    rng = np.random.default_rng(0)
    coef = rng.normal(size=(n_in, n_out)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "coef"], ["XW"]),
            helper.make_node("Add", ["XW", "intercept"], ["Y"]),
        ],
        "linear",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n_in])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", width or n_out])],
        [
            numpy_helper.from_array(coef, "coef"),
            numpy_helper.from_array(np.zeros(n_out, np.float32), "intercept"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
@pytest.mark.parametrize("declared", ["static", "unknown"])
def test_labels_of_another_width_are_refused(kind, declared, rng):
    """Refused before any training, naming both shapes; the weights stay as they were."""
    onx = _linear(3, 2, width=None if declared == "static" else "K")
    X = rng.normal(size=(20, 3)).astype(np.float32)
    trainer = _trainer(kind, onx).fit(X, rng.normal(size=(20, 2)).astype(np.float32))
    before = trainer.get_state()
    trainer.set_params(warm_start=True)
    for y in (rng.normal(size=(20, 3)), rng.normal(size=20)):
        with pytest.raises(ShapeError) as error:
            trainer.fit(X, y.astype(np.float32))
        message = str(error.value)
        assert (f"(20, {y.shape[1]})" if y.ndim == 2 else "(20,") in message, message
        assert "(20, 2)" in message, message  # the shape the model predicts
        for name, value in trainer.get_state().items():
            np.testing.assert_array_equal(value, before[name])


def test_loss_refuses_a_label_of_another_width(rng):
    with pytest.raises(ShapeError, match=r"Label shape \(4, 3\).*prediction shape \(4, 2\)"):
        losses.get("squared_error")(rng.normal(size=(4, 2)), rng.normal(size=(4, 3)))
    onnx.checker.check_model(gk.add_loss_output(_linear(3, 2)), full_check=True)
