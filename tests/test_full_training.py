"""Full training (OrtGradientOptimizer) against independent references: scikit-learn's
SGDRegressor and MLPRegressor update rules, PyTorch's optimizers on the same network,
and the held-out scores of reference estimators."""

from __future__ import annotations

import pickle
import re
import warnings

import numpy as np
import onnx
import pytest
from conftest import (
    append_no_gradient_node,
    export_torch,
    linear_regression_onnx,
    names_operator,
)
from sklearn.base import clone

import graphkit as gk
from graphkit import optimizers
from graphkit.dsl import FLOAT, op, script
from graphkit_train import OrtGradientOptimizer


@script()
def half_mse(prediction: FLOAT, label: FLOAT) -> FLOAT:
    """scikit-learn's squared loss: mean (p - y)^2 / 2."""
    d = prediction - label
    return op.CastLike(0.5, d) * op.ReduceMean(d * d, keepdims=0)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(120, 3))
    y = X @ np.array([1.5, -2.0, 0.5]) + 0.3 + rng.normal(scale=0.2, size=120)
    return X, y


def zero_linear(dtype=np.float64, n=3):
    return linear_regression_onnx(np.zeros((n, 1), dtype), np.zeros(1, dtype))


# -- parity with scikit-learn's update rules -----------------------------------------------


def test_sgd_regressor_same_coefficients(data):
    """Batch size 1, constant rate, no penalty, no shuffle: the same updates as
    SGDRegressor (whose loss is (p - y)^2 / 2: half our rate)."""
    from sklearn.linear_model import SGDRegressor

    X, y = data
    sk = SGDRegressor(
        learning_rate="constant", eta0=0.01, penalty=None, max_iter=5, shuffle=False, tol=None
    ).fit(X, y)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(zero_linear()),
        max_iter=5,
        batch_size=1,
        learning_rate=0.005,
        shuffle=False,
    ).fit(X, y)
    state = trainer.get_state()
    np.testing.assert_allclose(state["coef"][:, 0], sk.coef_, rtol=1e-10)
    np.testing.assert_allclose(state["intercept"], sk.intercept_, rtol=1e-10)
    assert state["step"] == 5 * len(X)


@pytest.mark.parametrize("solver", ["sgd", "adam"])
def test_mlp_regressor_same_weights(solver, data):
    from skl2onnx import to_onnx
    from sklearn.neural_network import MLPRegressor

    X, y = data
    mlp = MLPRegressor(
        hidden_layer_sizes=(5,),
        solver=solver,
        learning_rate_init=0.01,
        batch_size=10,
        shuffle=False,
        alpha=0.0,
        momentum=0.9,
        nesterovs_momentum=True,
        max_iter=1,
        random_state=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mlp.fit(X, y)  # initializes the weights (and trains one epoch)
    onx = to_onnx(mlp, X[:1])  # float64, from those weights
    del mlp._optimizer  # the next partial_fit starts a fresh optimizer, as graphkit does
    if solver == "sgd":
        rule = optimizers.momentum(momentum=0.9, nesterov=True, convention="sklearn")
    else:
        rule = optimizers.adam(eps=1e-8, eps_mode="uncorrected")
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(onx, half_mse),
        max_iter=3,
        batch_size=10,
        shuffle=False,
        learning_rate=(rule, 0.01),
    ).fit(X, y)
    for _ in range(3):
        mlp.partial_fit(X, y)
    state = trainer.get_state()
    np.testing.assert_allclose(state["coefficient"], mlp.coefs_[0], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(state["coefficient1"], mlp.coefs_[1], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(state["intercepts1"][0], mlp.intercepts_[1], rtol=1e-9)


# -- parity with PyTorch ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["momentum", "adam"])
def test_same_loss_as_torch_at_every_step(name, data, tmp_path):
    torch = pytest.importorskip("torch")
    X, y = data
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()
    if name == "momentum":
        ours = (optimizers.momentum(momentum=0.9), 0.05)
        theirs = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    else:
        ours = (optimizers.adam(), 0.05)
        theirs = torch.optim.Adam(net.parameters(), lr=0.05)
    # full batch: one step per epoch, so train_losses_ holds the loss of every step
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(export_torch(net, tmp_path / "net.onnx", 3, torch.float64)),
        max_iter=15,
        batch_size=len(X),
        shuffle=False,
        learning_rate=ours,
    ).fit(X, y)
    Xt, yt = torch.tensor(X), torch.tensor(y).reshape(-1, 1)
    expected = []
    for _ in range(15):
        theirs.zero_grad()
        loss = torch.nn.functional.mse_loss(net(Xt), yt)
        loss.backward()
        theirs.step()
        expected.append(loss.item())
    np.testing.assert_allclose(trainer.train_losses_, expected, rtol=1e-5)
    np.testing.assert_allclose(
        trainer.get_state()["2.weight"], net[2].weight.detach().numpy(), rtol=1e-5
    )


# -- convergence on real models -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_regression_reaches_sklearn(dtype):
    from sklearn.datasets import load_diabetes
    from sklearn.linear_model import LinearRegression
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    X, y = load_diabetes(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(dtype)
    X_train, X_test, y_train, y_test = train_test_split(X, y.astype(dtype), random_state=0)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(zero_linear(dtype, 10)),
        max_iter=60,
        batch_size=16,
        learning_rate=gk.LearningRateAdam(eta0=1.0),
        random_state=0,
    ).fit(X_train, y_train)
    reference = LinearRegression().fit(X_train, y_train).score(X_test, y_test)
    ours = (
        1 - ((trainer.predict(X_test) - y_test) ** 2).sum() / ((y_test - y_test.mean()) ** 2).sum()
    )
    assert ours == pytest.approx(reference, abs=0.02)
    assert trainer.get_trained_onnx().graph.initializer[0].data_type == gk._graph.elem_type(dtype)


def test_mlp_classifier_probabilities_log_loss(mlp_classifier, classification_data):
    sk, onx = mlp_classifier
    X, y = classification_data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_onx = gk.add_loss_output(onx, "log", output_index="probabilities")
    before = (sk.predict(X) == y).mean()
    trainer = OrtGradientOptimizer(
        train_onx,
        max_iter=40,
        batch_size=20,
        learning_rate=gk.LearningRateAdam(eta0=0.01),
        random_state=0,
    ).fit(X, y)
    assert trainer.train_losses_[-1] < trainer.train_losses_[0]
    accuracy = (trainer.predict(X) == y).mean()
    assert accuracy >= before
    np.testing.assert_array_equal(trainer.classes_, np.arange(3))
    assert trainer.predict_proba(X).shape == (len(X), 3)
    from sklearn.linear_model import LogisticRegression

    assert accuracy >= LogisticRegression().fit(X, y).score(X, y) - 0.05


def test_binary_logistic_on_raw_scores():
    from sklearn.datasets import load_breast_cancer
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)
    onx = gk.add_loss_output(zero_linear(np.float32, X.shape[1]), "sigmoid_log_loss")
    trainer = OrtGradientOptimizer(
        onx,
        max_iter=30,
        batch_size=32,
        learning_rate=gk.LearningRateAdam(eta0=0.05),
        random_state=0,
    ).fit(X, y)
    accuracy = (trainer.predict(X) == y).mean()
    assert accuracy >= LogisticRegression().fit(X, y).score(X, y) - 0.02
    state = trainer.get_state()  # P(y = 1) = sigmoid(X coef + intercept), by hand
    p = 1 / (1 + np.exp(-(X @ state["coef"][:, 0] + state["intercept"][0])))
    np.testing.assert_allclose(trainer.predict_proba(X), np.stack([1 - p, p], 1), atol=1e-6)


def test_softmax_classifier_cross_entropy():
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    X, y = load_iris(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    onx = gk.add_loss_output(linear_regression_onnx(np.zeros((4, 3)), np.zeros(3)), "cross_entropy")
    trainer = OrtGradientOptimizer(
        onx,
        max_iter=100,
        batch_size=16,
        learning_rate=gk.LearningRateAdam(eta0=0.05),
        random_state=0,
    ).fit(X, y)
    accuracy = (trainer.predict(X) == y).mean()
    assert accuracy >= LogisticRegression().fit(X, y).score(X, y) - 0.03
    state = trainer.get_state()  # softmax of the logits, by hand
    logits = X @ state["coef"] + state["intercept"]
    expected = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(trainer.predict_proba(X), expected, rtol=1e-9)
    assert not hasattr(OrtGradientOptimizer(gk.add_loss_output(zero_linear())), "predict_proba")


def test_torch_exported_model_trains(torch_mlp, regression_data):
    X, y = regression_data
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(torch_mlp[1]),
        max_iter=30,
        batch_size=20,
        learning_rate=gk.LearningRateAdam(eta0=0.01),
        random_state=0,
    ).fit(X, y)
    from sklearn.linear_model import LinearRegression

    mse = np.mean((trainer.predict(X) - y) ** 2)
    reference = np.mean((LinearRegression().fit(X, y).predict(X) - y) ** 2)
    assert mse < 2 * reference + 1e-2  # a near-linear target: close to the linear optimum
    assert set(trainer.get_state()) >= {"0.weight", "0.bias", "2.weight", "2.bias"}


# -- state, warm start, export ------------------------------------------------------------


def shuffled_trainer(**kwargs):
    return OrtGradientOptimizer(
        gk.add_loss_output(zero_linear()),
        batch_size=8,
        random_state=3,
        learning_rate=gk.LearningRateAdam(eta0=0.05),
        **kwargs,
    )


def test_warm_start_continues_exactly(data):
    X, y = data
    five = shuffled_trainer(max_iter=5).fit(X, y)
    split = shuffled_trainer(max_iter=2, warm_start=True).fit(X, y)
    split.set_params(max_iter=3)
    split.fit(X, y)
    for name, value in five.get_state().items():
        np.testing.assert_array_equal(split.get_state()[name], value)
    assert split.train_losses_ == five.train_losses_


@pytest.mark.parametrize("changed", ["schedule", "optimizer"])
def test_warm_start_continues_after_a_parameter_that_rebuilds(data, changed):
    """A new learning rate (or optimizer) between fits rebuilds the step; warm_start=True
    still continues from the weights of the last fit (numpy's SGD), never from the
    initial ones."""
    X, y = data
    trainer = gk_trainer = OrtGradientOptimizer(
        gk.add_loss_output(zero_linear()), max_iter=2, batch_size=len(X), learning_rate=0.01,
        shuffle=False,
    ).fit(X, y)  # fmt: skip
    before = gk_trainer.get_state()
    if changed == "schedule":
        trainer.set_params(learning_rate=0.05, warm_start=True, max_iter=1)
    else:  # momentum: new state, which starts at zero (its first step is SGD's)
        trainer.set_params(
            learning_rate=(optimizers.get("momentum", momentum=0.9), 0.05),
            warm_start=True,
            max_iter=1,
        )
    trainer.fit(X, y)
    residual = X @ before["coef"] + before["intercept"] - y[:, None]
    np.testing.assert_allclose(
        trainer.get_state()["coef"], before["coef"] - 0.05 * 2 * X.T @ residual / len(X),
        rtol=1e-12,
    )  # fmt: skip
    assert len(trainer.train_losses_) == 3 and trainer.get_state()["step"] == 3


def test_without_warm_start_fit_restarts(data):
    X, y = data
    trainer = shuffled_trainer(max_iter=2).fit(X, y)
    first = trainer.get_state()
    trainer.fit(X, y)
    for name, value in first.items():
        np.testing.assert_array_equal(trainer.get_state()[name], value)


def test_get_state_set_state_round_trip(data):
    X, y = data
    trainer = shuffled_trainer(max_iter=3).fit(X, y)
    state = trainer.get_state()
    assert set(state) == {
        "coef",
        "intercept",
        "coef.adam.m",
        "coef.adam.v",
        "intercept.adam.m",
        "intercept.adam.v",
        "step",
    }
    other = shuffled_trainer(max_iter=3).set_state(state)
    for name, value in state.items():
        np.testing.assert_array_equal(other.get_state()[name], value)
    np.testing.assert_array_equal(other.predict(X), trainer.predict(X))


def test_pickle_round_trip(data):
    X, y = data
    trainer = shuffled_trainer(max_iter=2, warm_start=True).fit(X, y)
    clone = pickle.loads(pickle.dumps(trainer))
    np.testing.assert_array_equal(clone.predict(X), trainer.predict(X))
    trainer.fit(X, y)
    clone.fit(X, y)  # same state, same random sequence: same next epochs
    np.testing.assert_array_equal(clone.get_state()["coef"], trainer.get_state()["coef"])


def test_save_onnx_graph_files_load_and_rerun(data, tmp_path):
    X, y = data
    trainer = shuffled_trainer(max_iter=2).fit(X, y)
    paths = trainer.save_onnx_graph(str(tmp_path))
    assert set(paths) == {"training_step", "evaluation", "prediction", "trained"}
    trained = onnx.load(paths["trained"])
    onnx.checker.check_model(trained)
    out = gk.run(trained, {"X": X})["Y"][:, 0]
    np.testing.assert_allclose(out, trainer.predict(X), rtol=1e-12)
    in_memory = trainer.save_onnx_graph(bytes)
    assert onnx.load_from_string(in_memory["trained"]).graph.initializer[0].name == "coef"


def test_exported_step_graph_run_by_hand(data, tmp_path):
    """One run of the saved training-step graph = one update, checked against numpy SGD."""
    X, y = data
    trainer = OrtGradientOptimizer(gk.add_loss_output(zero_linear()), learning_rate=0.1)
    step = onnx.load(trainer.save_onnx_graph(str(tmp_path))["training_step"])
    coef, intercept = np.full((3, 1), 0.5), np.array([0.1])
    out = gk.run(
        step,
        {
            "X": X[:10],
            "label": y[:10, None],
            "coef": coef,
            "intercept": intercept,
            "step": np.array(0),
            "loss_sum": np.array(0.0),
        },
    )
    residual = X[:10] @ coef + intercept - y[:10, None]
    np.testing.assert_allclose(
        out["coef.next"], coef - 0.1 * 2 * X[:10].T @ residual / 10, rtol=1e-12
    )
    np.testing.assert_allclose(
        out["intercept.next"], intercept - 0.1 * 2 * residual.mean(), rtol=1e-12
    )
    assert out["step.next"] == 1 and out["loss"] == pytest.approx((residual**2).mean())


def test_sample_weights_change_the_fit(data):
    X, y = data
    onx = gk.add_loss_output(zero_linear(), weight_name="weight")
    w = np.where(np.arange(len(X)) < 60, 1.0, 0.0)
    trainer = OrtGradientOptimizer(
        onx,
        max_iter=400,
        batch_size=120,
        learning_rate=gk.LearningRateAdam(eta0=0.05),
        shuffle=False,
    )
    trainer.fit(X, y, sample_weight=w)
    from sklearn.linear_model import LinearRegression

    expected = LinearRegression().fit(X, y, sample_weight=w).coef_
    unweighted = LinearRegression().fit(X, y).coef_
    np.testing.assert_allclose(trainer.get_state()["coef"][:, 0], expected, atol=1e-3)
    assert np.abs(expected - unweighted).max() > 0.05  # the weights matter


def test_validation_losses(data):
    X, y = data
    trainer = shuffled_trainer(max_iter=10, validation_every=0.2).fit(
        X[:80], y[:80], X_val=X[80:], y_val=y[80:]
    )
    assert len(trainer.validation_losses_) == 5
    assert trainer.validation_losses_[-1] == pytest.approx(trainer.compute_loss(X[80:], y[80:]))


# -- bad input ----------------------------------------------------------------------------


@pytest.fixture
def trainer():
    return OrtGradientOptimizer(gk.add_loss_output(zero_linear()), max_iter=1)


def test_rows_of_x_and_y_differ(trainer, data):
    with pytest.raises(gk.ShapeError, match="X has 120 rows but y has 119"):
        trainer.fit(data[0], data[1][:-1])


def test_wrong_feature_count(trainer, data):
    with pytest.raises(
        gk.ShapeError, match="X has 2 features, but OrtGradientOptimizer is expecting 3 features"
    ):
        trainer.fit(data[0][:, :2], data[1])


def test_integer_targets_for_regression(trainer, data):
    """scikit-learn's convention: integer regression targets are cast to float."""
    X, y = data
    y_int = np.round(y * 10).astype(np.int64)
    as_float = clone(trainer).set_params(random_state=0).fit(X, y_int.astype(float)).get_state()
    as_int = clone(trainer).set_params(random_state=0).fit(X, y_int).get_state()
    for name, value in as_float.items():
        np.testing.assert_array_equal(as_int[name], value)


def test_float32_features_are_cast(trainer, data):
    """Documented: features of another numeric dtype are cast to the input's dtype."""
    trainer.fit(data[0].astype(np.float32), data[1])
    assert trainer.get_state()["coef"].dtype == np.float64


@pytest.mark.parametrize("where", ["X", "y"])
def test_nan_in_data(trainer, data, where):
    X, y = data[0].copy(), data[1].copy()
    (X if where == "X" else y)[5] = np.nan
    with pytest.raises(ValueError, match=f"{where} contains NaN"):
        trainer.fit(X, y)


def test_unknown_weight_lists_trainable():
    with pytest.raises(
        gk.UnknownNameError, match=r"\['bias'\].*Trainable weights.*\['coef', 'intercept'\]"
    ):
        OrtGradientOptimizer(gk.add_loss_output(zero_linear()), ["coef", "bias"]).fit(
            np.zeros((2, 3)), np.zeros(2)
        )


def test_non_float_weight(mlp_regressor, regression_data):
    onx = gk.add_loss_output(mlp_regressor[1])
    with pytest.raises(gk.UnknownNameError, match=r"\['shape_tensor'\] are not float"):
        OrtGradientOptimizer(onx, ["shape_tensor"]).fit(*regression_data)


def test_graph_without_loss_output(data):
    with pytest.raises(gk.UnknownNameError, match="no output 'loss'.*add_loss_output"):
        OrtGradientOptimizer(zero_linear()).fit(*data)


def test_op_without_gradient_named(data):
    """An operator the backend has no gradient for (conftest.NO_GRADIENT: Cosh for
    onnxruntime-training 1.19.2): the error names it and its node."""
    onx = zero_linear()
    op_type = append_no_gradient_node(onx, "Y", "Z", "smooth")
    onx.graph.output[0].name = "Z"
    with pytest.raises(gk.MissingGradientError, match=names_operator(op_type, "smooth")):
        OrtGradientOptimizer(gk.add_loss_output(onx)).fit(*data)


def test_divergence_keeps_last_good_epoch(data):
    X, y = data
    X = X * 1e3
    kwargs = dict(batch_size=120, shuffle=False, learning_rate=10.0)
    trainer = OrtGradientOptimizer(gk.add_loss_output(zero_linear()), max_iter=50, **kwargs)
    with pytest.raises(gk.ConvergenceError, match=r"during epoch (\d+)") as info:
        trainer.fit(X, y)
    epoch = int(re.search(r"during epoch (\d+)", str(info.value)).group(1))
    assert epoch > 1
    good = OrtGradientOptimizer(
        gk.add_loss_output(zero_linear()), max_iter=epoch - 1, **kwargs
    ).fit(X, y)
    state = trainer.get_state()
    for name, value in good.get_state().items():
        np.testing.assert_array_equal(state[name], value)
    assert len(trainer.train_losses_) == epoch - 1


def test_sample_weight_without_weight_input(trainer, data):
    with pytest.raises(ValueError, match="no sample-weight input.*weight_name"):
        trainer.fit(*data, sample_weight=np.ones(120))


def test_devices(data):
    with pytest.raises(ValueError, match="Unknown device 'tpu'"):
        OrtGradientOptimizer(gk.add_loss_output(zero_linear()), device="tpu").fit(*data)
    import onnxruntime

    if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        with pytest.raises(RuntimeError, match="pip install onnxruntime-training==1.19.2"):
            OrtGradientOptimizer(gk.add_loss_output(zero_linear()), device="cuda").fit(*data)


def test_bad_learning_rate():
    with pytest.raises(gk.UnknownNameError, match="Unknown optimizer 'adamax'. Valid names"):
        OrtGradientOptimizer(gk.add_loss_output(zero_linear()), learning_rate="adamax").fit(
            np.zeros((1, 3)), np.zeros(1)
        )
    with pytest.raises(TypeError, match="learning_rate must be"):
        OrtGradientOptimizer(gk.add_loss_output(zero_linear()), learning_rate=[0.1]).fit(
            np.zeros((1, 3)), np.zeros(1)
        )


def test_verbose_writes_one_line_per_epoch_to_a_log(data, capsys):
    """Not a terminal (CI, a pipe): one readable line per epoch, no carriage returns."""
    X, y = data
    OrtGradientOptimizer(gk.add_loss_output(zero_linear()), max_iter=3, verbose=1).fit(X, y)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "\r" not in err and len(lines) == 3
    assert lines[0].startswith("epoch 1/3  train loss") and lines[2].startswith("epoch 3/3")
    assert all(" lr " in line and "/epoch" in line for line in lines)


def test_verbose_shows_a_bar_in_a_terminal(data):
    import io

    from graphkit_train.progress import EpochProgress

    stream = io.StringIO()
    progress = EpochProgress(3, stream=stream, bar=True)
    for epoch in (1, 2, 3):
        progress.update(epoch, 1.0 / epoch, None, 0.01)
    progress.close()
    assert "3/3" in stream.getvalue() and "loss=" in stream.getvalue()
