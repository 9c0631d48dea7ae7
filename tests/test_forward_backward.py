"""Forward/backward training against independent references: finite differences, torch
autograd, full training on the same batches, numpy loops written from the formulas,
scikit-learn."""

from __future__ import annotations

import pickle

import numpy as np
import onnx
import pytest
from conftest import (
    HAS_TORCH,
    INSTALLED_BACKENDS,
    append_no_gradient_node,
    export_torch,
    four_calls_a_batch,
    linear_regression_onnx,
    mlp_onnx,
    names_operator,
    requires_ort_training,
    requires_torch,
)
from onnx import numpy_helper
from onnxscript import FLOAT, script
from onnxscript import opset18 as op
from sklearn.base import clone

import graphkit as gk
from graphkit import backends
from graphkit_train import (
    OrtGradientForwardBackward,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
)
from graphkit_train.trainers.partial import BindingCache

if HAS_TORCH:  # the reference of some tests, and OnnxModule's; the others need none
    import torch


@pytest.fixture(scope="module")
def torch_net(tmp_path_factory):
    """A float64 torch MLP and its ONNX export."""
    if not HAS_TORCH:
        pytest.skip("torch is not installed")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)
    ).double()
    return net, export_torch(net, tmp_path_factory.mktemp("fb") / "net.onnx", 3, torch.float64)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(90, 3))
    return X, X @ np.array([1.5, -2.0, 0.5]) + 0.3 + rng.normal(scale=0.1, size=90)


def zero_linear():
    return linear_regression_onnx(np.zeros((3, 1)), np.zeros(1))


# -- OrtGradientForwardBackward ------------------------------------------------------------


def test_gradients_match_torch_autograd(torch_net, rng):
    net, onx = torch_net
    fb = OrtGradientForwardBackward(onx, inputs_requiring_grad=["X"])
    X = rng.normal(size=(7, 3))
    dY = rng.normal(size=(7, 2))
    (Y,) = fb.forward([X])
    grads = fb.backward([dY])
    Xt = torch.tensor(X, requires_grad=True)
    net.zero_grad()
    out = net(Xt)
    out.backward(torch.tensor(dY))
    np.testing.assert_allclose(Y.numpy(), out.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(grads["X"].numpy(), Xt.grad.numpy(), rtol=1e-5, atol=1e-12)
    for name, parameter in net.named_parameters():
        np.testing.assert_allclose(
            grads[name].numpy(), parameter.grad.numpy(), rtol=1e-5, atol=1e-12
        )


def test_gradients_match_finite_differences(torch_net, rng):
    _, onx = torch_net
    fb = OrtGradientForwardBackward(onx, ["2.weight", "0.bias"])  # any order, any names
    X, dY = rng.normal(size=(5, 3)), rng.normal(size=(5, 2))
    fb.forward([X])
    grads = fb.backward([dY])
    assert "X" not in grads  # input gradients only when asked for
    base = {w: fb.weights[w].numpy() for w in fb.weight_names}
    eps = 1e-6
    for name in ("2.weight", "0.bias"):
        expected = np.zeros_like(base[name])
        for index in np.ndindex(base[name].shape):
            values = []
            for sign in (1, -1):
                shifted = base[name].copy()
                shifted[index] += sign * eps
                (Y,) = fb.forward([X], training=False, weights={name: shifted})
                values.append(float((Y.numpy() * dY).sum()))
            expected[index] = (values[0] - values[1]) / (2 * eps)
        np.testing.assert_allclose(grads[name].numpy(), expected, rtol=1e-6, atol=1e-9)


def test_several_forwards_before_backwards(torch_net, rng):
    _, onx = torch_net
    fb = OrtGradientForwardBackward(onx)
    X1, X2, dY = rng.normal(size=(4, 3)), rng.normal(size=(6, 3)), rng.normal(size=(4, 2))
    fb.forward([X1])
    alone = {k: v.numpy() for k, v in fb.backward([dY]).items()}
    fb.forward([X1])
    fb.forward([X2])
    assert fb.pending == 2
    fb.backward([rng.normal(size=(6, 2))])  # the most recent forward first
    first = fb.backward([dY])
    assert fb.pending == 0
    for name, value in alone.items():
        np.testing.assert_allclose(first[name].numpy(), value, rtol=1e-12)
    fb.forward([X1], training=False)
    assert fb.pending == 0  # inference keeps nothing


def test_forward_backward_bad_input(torch_net, rng):
    _, onx = torch_net
    fb = OrtGradientForwardBackward(onx)
    with pytest.raises(ValueError, match="forward got 2 inputs; the graph takes 1"):
        fb.forward([np.zeros((2, 3)), np.zeros((2, 3))])
    with pytest.raises(gk.ShapeError, match="'X' has shape \\(2, 4\\)"):
        fb.forward([np.zeros((2, 4))])
    with pytest.raises(gk.DTypeError, match="float64"):
        fb.forward([np.zeros((2, 3), np.float32)])
    with pytest.raises(RuntimeError, match="without a pending forward"):
        fb.backward([np.zeros((2, 2))])
    fb.forward([np.zeros((2, 3))])
    with pytest.raises(gk.ShapeError, match="gradient of output 'Y' has shape \\(3, 2\\)"):
        fb.backward([np.zeros((3, 2))])
    with pytest.raises(gk.UnknownNameError, match="not trained weights"):
        fb.forward([np.zeros((2, 3))], weights={"W": np.zeros(2)})
    with pytest.raises(gk.UnknownNameError, match="Trainable weights"):
        OrtGradientForwardBackward(onx, ["1.weight"])
    with pytest.raises(ValueError, match="Unknown device 'gpu'"):
        OrtGradientForwardBackward(onx, device="gpu")


def test_binding_cache_skips_unchanged_pointers():
    import onnxruntime

    session = onnxruntime.InferenceSession(zero_linear().SerializeToString())
    cache = BindingCache(session.io_binding())
    value = onnxruntime.OrtValue.ortvalue_from_numpy(np.zeros((2, 3)))
    cache.bind("X", value)
    cache.bind("X", value)
    assert (cache.binds, cache.hits) == (1, 1)
    cache.bind("X", onnxruntime.OrtValue.ortvalue_from_numpy(np.ones((2, 3))))
    assert cache.binds == 2


# -- OrtGradientForwardBackwardOptimizer -----------------------------------------------------


@pytest.mark.parametrize("rate", ["sgd", "adam"])
def test_same_weights_as_full_training(rate, data):
    X, y = data
    make = {
        "sgd": lambda: gk.LearningRateSGD(eta0=0.05, learning_rate="constant"),
        "adam": lambda: gk.LearningRateAdam(eta0=0.05),
    }[rate]
    partial = OrtGradientForwardBackwardOptimizer(
        zero_linear(), max_iter=4, batch_size=8, learning_rate=make(), random_state=1
    ).fit(X, y)
    full = OrtGradientOptimizer(
        gk.add_loss_output(zero_linear()),
        max_iter=4,
        batch_size=8,
        learning_rate=make(),
        random_state=1,
    ).fit(X, y)
    for name, value in full.get_state().items():
        np.testing.assert_allclose(partial.get_state()[name], value, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(partial.train_losses_, full.train_losses_, rtol=1e-12)


def test_nesterov_with_elastic_penalty_matches_numpy(data):
    """v <- mu v - lr (g + l1 sign(w) + 2 l2 w); w <- w + mu v - lr (...), g the gradient of
    the mean squared error, lr = eta0 / (t + 1)^power_t."""
    X, y = data
    trainer = OrtGradientForwardBackwardOptimizer(
        zero_linear(),
        max_iter=3,
        batch_size=10,
        shuffle=False,
        learning_rate=gk.LearningRateSGDNesterov(eta0=0.02, power_t=0.5, momentum=0.8),
        learning_loss=gk.ElasticLearningLoss(l1_weight=0.2, l2_weight=0.8),
        learning_penalty=gk.ElasticLearningPenalty(l1=0.01, l2=0.05),
    ).fit(X, y)
    w, b = np.zeros((3, 1)), np.zeros(1)
    vw, vb = np.zeros_like(w), np.zeros_like(b)
    t = 0
    for _ in range(3):
        for start in range(0, len(X), 10):
            x, target = X[start : start + 10], y[start : start + 10, None]
            d = x @ w + b - target
            dloss = (0.2 * np.sign(d) + 1.6 * d) / len(x)  # elastic loss, mean
            gw = x.T @ dloss + 0.01 * np.sign(w) + 0.1 * w
            gb = dloss.sum(axis=0) + 0.01 * np.sign(b) + 0.1 * b
            lr = 0.02 / (t + 1) ** 0.5
            vw, vb = 0.8 * vw - lr * gw, 0.8 * vb - lr * gb
            w, b = w + 0.8 * vw - lr * gw, b + 0.8 * vb - lr * gb
            t += 1
    state = trainer.get_state()
    np.testing.assert_allclose(state["coef"], w, rtol=1e-10)
    np.testing.assert_allclose(state["intercept"], b, rtol=1e-10)
    np.testing.assert_allclose(state["coef.momentum.velocity"], vw, rtol=1e-10)


@pytest.mark.parametrize(
    "rate",
    [
        gk.LearningRateSGD(),
        gk.LearningRateSGDNesterov(),
        gk.LearningRateAdam(eta0=0.05),
        gk.LearningRateAdamW(eta0=0.05),
        gk.LearningRateAdagrad(eta0=0.5),
        gk.LearningRateRMSProp(eta0=0.02),
        (gk.optimizers.adam(), gk.schedules.warmup(gk.schedules.cosine(0.05, 100), 10)),
    ],
    ids=["sgd", "nesterov", "adam", "adamw", "adagrad", "rmsprop", "adam-warmup-cosine"],
)
def test_every_optimizer_trains(rate, data):
    X, y = data
    trainer = OrtGradientForwardBackwardOptimizer(
        zero_linear(), max_iter=15, learning_rate=rate, random_state=0
    )
    trainer.fit(X, y)
    assert trainer.train_losses_[-1] < 0.5 * trainer.train_losses_[0]


def test_binary_classification_on_raw_scores():
    from sklearn.datasets import load_breast_cancer
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    trainer = OrtGradientForwardBackwardOptimizer(
        linear_regression_onnx(np.zeros((30, 1)), np.zeros(1)),
        max_iter=30,
        batch_size=32,
        learning_rate=gk.LearningRateAdam(eta0=0.05),
        learning_loss=gk.NegLogLearningLoss(),
        random_state=0,
    ).fit(X, y)
    accuracy = (trainer.predict(X) == y).mean()
    assert accuracy >= LogisticRegression().fit(X, y).score(X, y) - 0.02
    state = trainer.get_state()
    p = 1 / (1 + np.exp(-(X @ state["coef"][:, 0] + state["intercept"][0])))
    np.testing.assert_allclose(trainer.predict_proba(X)[:, 1], p, rtol=1e-9)
    np.testing.assert_allclose(
        trainer.losses(X, y), -(y * np.log(p) + (1 - y) * np.log(1 - p)), rtol=1e-6, atol=1e-9
    )


def test_multiclass_softmax_cross_entropy():
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    X, y = load_iris(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    trainer = OrtGradientForwardBackwardOptimizer(
        linear_regression_onnx(np.zeros((4, 3)), np.zeros(3)),
        max_iter=100,
        batch_size=16,
        learning_rate=gk.LearningRateAdam(eta0=0.05),
        learning_loss="cross_entropy",
        random_state=0,
    ).fit(X, y)
    assert (trainer.predict(X) == y).mean() >= LogisticRegression().fit(X, y).score(X, y) - 0.03


def test_grid_search_and_cross_val_score(data):
    from sklearn.model_selection import GridSearchCV, cross_val_score

    X, y = data
    estimator = OrtGradientForwardBackwardOptimizer(zero_linear(), max_iter=5, random_state=0)
    search = GridSearchCV(estimator, {"learning_rate": [1e-4, 0.05]}, cv=3).fit(X, y)
    assert search.best_params_ == {"learning_rate": 0.05}
    assert search.best_estimator_.get_state()["coef"].shape == (3, 1)
    scores = cross_val_score(estimator, X, y, cv=3)
    from sklearn.metrics import r2_score
    from sklearn.model_selection import KFold

    expected = []
    for train, test in KFold(3).split(X):  # the default score is scikit-learn's R^2
        fitted = clone(estimator).fit(X[train], y[train])
        expected.append(r2_score(y[test], fitted.predict(X[test])))
    np.testing.assert_allclose(scores, expected, rtol=1e-10)


def test_state_pickle_warm_start_and_exports(data, tmp_path):
    X, y = data
    kwargs = dict(batch_size=8, learning_rate="adam", random_state=2)
    five = OrtGradientForwardBackwardOptimizer(zero_linear(), max_iter=5, **kwargs).fit(X, y)
    split = OrtGradientForwardBackwardOptimizer(
        zero_linear(), max_iter=2, warm_start=True, **kwargs
    ).fit(X, y)
    split = pickle.loads(pickle.dumps(split))
    split.set_params(max_iter=3)
    split.fit(X, y)
    for name, value in five.get_state().items():
        np.testing.assert_array_equal(split.get_state()[name], value)
    paths = five.save_onnx_graph(str(tmp_path))
    assert set(paths) == {"forward", "gradient", "loss", "update", "trained"}
    trained = onnx.load(paths["trained"])
    np.testing.assert_allclose(gk.run(trained, {"X": X})["Y"][:, 0], five.predict(X), rtol=1e-12)
    assert set(five.save_onnx_graph(bytes)) == set(paths)
    w = np.linspace(0, 1, len(X))
    d = five.predict(X) - y
    np.testing.assert_allclose(five.losses(X, y, w), w * d**2, rtol=1e-10)
    assert five.compute_loss(X, y, w) == pytest.approx((w * d**2).sum() / w.sum())
    from sklearn.metrics import r2_score

    assert five.score(X, y, w) == pytest.approx(r2_score(y, five.predict(X), sample_weight=w))


# two calls per batch: the loss and the update fused into onnxruntime-training's
# TrainingAgent (its agent step); four: forward, loss, backward, update (every backend,
# when it does not fuse: four_calls_a_batch)
FUSED = pytest.param(2, marks=requires_ort_training)


def fused_backend(calls: int) -> str | None:
    """The backend of a test of ``calls`` calls per batch (ort_training's fused step,
    or the default backend's four calls)."""
    return "ort_training" if calls == 2 else None


@pytest.mark.parametrize("calls", [FUSED, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sample_weighted_mlp_with_a_short_last_batch_matches_numpy(dtype, calls, monkeypatch):
    """Each training batch size gets graphs specialized to it (here 16 and the last 5
    rows); the weights follow SGD on the weighted mean squared error written in numpy:
    g_pred = 2 w (pred - y) / sum(w), backpropagated through tanh; with the loss and
    update fused into the TrainingAgent's calls (2, ort_training) and as separate sessions
    (4, the default backend)."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(37, 4)).astype(dtype)
    y = (X @ rng.normal(size=4) + 0.5).astype(dtype)
    weights = rng.uniform(0.5, 2, size=37).astype(dtype)
    model = mlp_onnx(4, 6, 1, activation="Tanh", dtype=dtype, scale=0.5)
    if calls == 4:
        four_calls_a_batch(monkeypatch)
    lr = 0.05
    trainer = OrtGradientForwardBackwardOptimizer(
        model,
        max_iter=3,
        batch_size=16,
        shuffle=False,
        learning_rate=gk.LearningRateSGD(eta0=lr, learning_rate="constant"),
        backend=fused_backend(calls),
    ).fit(X, y, sample_weight=weights)
    p = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    losses = []
    for _ in range(3):
        epoch = []
        for start in range(0, 37, 16):
            x = X[start : start + 16].astype(np.float64)
            t, w = y[start : start + 16, None], weights[start : start + 16, None]
            h = np.tanh(x @ p["W1"] + p["b1"])
            d = h @ p["W2"] + p["b2"] - t
            epoch.append(float((w * d**2).sum() / w.sum()))
            g = 2 * w * d / w.sum()
            gh = (g @ p["W2"].T) * (1 - h**2)
            grads = {"W2": h.T @ g, "b2": g.sum(0), "W1": x.T @ gh, "b1": gh.sum(0)}
            p = {k: v - lr * grads[k] for k, v in p.items()}
        losses.append(np.mean(epoch))
    tol = dict(rtol=2e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-10)
    state = trainer.get_state()
    for name, value in p.items():
        np.testing.assert_allclose(state[name], value, **tol)
    np.testing.assert_allclose(trainer.train_losses_, losses, **tol)
    if calls == 4:
        assert not trainer._agent_runs
        graphs = {
            rows: v.gradient_model.graph
            for (_, rows), v in trainer.forward_backward_._variants.items()
        }
        assert set(graphs) == {None, 16, 5}
        any_rows = graphs[None]
    else:  # one fused forward/backward graph per batch size, for weighted batches
        graphs = {rows: run.model.graph for (weighted, rows), run in trainer._agent_runs.items()}
        assert set(graphs) == {16, 5}
        assert all(weighted for weighted, _ in trainer._agent_runs)
        any_rows = trainer._agent_step(weighted=True).model.graph

    def reductions(graph):
        return sum(n.op_type == "ReduceSum" for n in graph.node)

    for rows in (16, 5):  # fixed batch dimension; the bias gradient of b1 is a MatMul
        assert graphs[rows].input[0].type.tensor_type.shape.dim[0].dim_value == rows
        assert reductions(graphs[rows]) < reductions(any_rows)


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_a_failed_batch_keeps_the_weights_of_the_last_good_one(backend, data, monkeypatch):
    """An error in the third batch's onnxruntime calls (ort_training's fused agent step;
    the backward call, after the forward and the loss ran, where nothing is fused): the
    weights are those after two batches of SGD on the mean squared error (numpy), not the
    epoch's start or garbage."""
    X, y = data
    calls = []

    def failing(real):
        def call(*args):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("a batch failed in onnxruntime: injected")
            return real(*args)

        return call

    run = backends.get(backend).AgentRun  # the fused batch (its own class per backend)
    monkeypatch.setattr(run, "__call__", failing(run.__call__))
    trainer = OrtGradientForwardBackwardOptimizer(
        zero_linear(),
        max_iter=1,
        batch_size=10,
        shuffle=False,
        learning_rate=0.1,
        backend=backend,
    )
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(X, y)
    w, b = np.zeros((3, 1)), np.zeros(1)
    for start in (0, 10):
        x, t = X[start : start + 10], y[start : start + 10, None]
        d = 2 * (x @ w + b - t) / len(x)
        w, b = w - 0.1 * x.T @ d, b - 0.1 * d.sum(0)
    state = trainer.get_state()
    np.testing.assert_allclose(state["coef"], w, rtol=1e-12)
    np.testing.assert_allclose(state["intercept"], b, rtol=1e-12)
    assert state["step"] == 2


def test_nan_loss_with_and_without_exc(data):
    X, y = data
    X = X * 1e4
    kwargs = dict(max_iter=20, batch_size=90, learning_rate=10.0, shuffle=False)
    with pytest.raises(gk.ConvergenceError, match="epoch"):
        OrtGradientForwardBackwardOptimizer(zero_linear(), **kwargs).fit(X, y)
    trainer = OrtGradientForwardBackwardOptimizer(zero_linear(), exc=False, **kwargs)
    with pytest.warns(RuntimeWarning, match="The loss became"):
        trainer.fit(X, y)
    assert np.isfinite(trainer.get_state()["coef"]).all()
    assert len(trainer.train_losses_) < 20


# -- PyTorch integration ---------------------------------------------------------------------


def hybrid_and_twin(tmp_path):
    from graphkit_train.torch_module import OnnxModule

    torch.manual_seed(0)
    tail = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    head = torch.nn.Linear(3, 4)
    layer = OnnxModule(export_torch(tail, tmp_path / "tail.onnx", 4))
    hybrid = torch.nn.Sequential(head, torch.nn.ReLU(), layer)
    twin = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), tail)
    twin[0].load_state_dict(head.state_dict())
    return hybrid, twin, layer


@requires_torch
def test_hybrid_gradients_match_pure_torch(tmp_path):
    hybrid, twin, _ = hybrid_and_twin(tmp_path)
    X, y = torch.randn(16, 3), torch.randn(16, 1)
    for model in (hybrid, twin):
        torch.nn.functional.mse_loss(model(X), y).backward()
    for (name, a), b in zip(hybrid.named_parameters(), twin.parameters()):
        np.testing.assert_allclose(
            a.grad.numpy(), b.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=name
        )


@requires_torch
def test_hybrid_trains_with_torch_optim(tmp_path):
    hybrid, _, layer = hybrid_and_twin(tmp_path)
    X = torch.randn(64, 3)
    y = (X[:, :1] * 2 - X[:, 1:2]).detach()
    optimizer = torch.optim.Adam(hybrid.parameters(), lr=0.02)
    losses = []
    for _ in range(150):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(hybrid(X), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
    trained = layer.trained_model()  # the ONNX layer with the parameters torch trained
    np.testing.assert_allclose(
        gk.run(trained, {"X": hybrid[1](hybrid[0](X)).detach().numpy()})["Y"],
        hybrid(X).detach().numpy(),
        rtol=1e-5,
        atol=1e-6,
    )


@requires_torch
def test_hybrid_bad_input(tmp_path):
    hybrid, _, layer = hybrid_and_twin(tmp_path)
    with pytest.raises(ValueError, match="on meta.*runs on cpu"):
        layer(torch.empty(2, 4, device="meta"))
    with pytest.raises(gk.ShapeError, match="shape \\(2, 5\\)"):
        layer(torch.zeros(2, 5))
    with pytest.raises(gk.DTypeError, match="float32"):
        layer(torch.zeros(2, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="takes 1 inputs"):
        layer(torch.zeros(2, 4), torch.zeros(2, 4))


def test_verbose_progress_bar(data, capsys):
    X, y = data
    OrtGradientForwardBackwardOptimizer(zero_linear(), max_iter=2, verbose=1).fit(X, y)
    assert "2/2" in capsys.readouterr().err


def test_op_without_gradient_in_forward_backward(rng):
    """The gradient source's refusal is named, as in full training (the operator is one
    the default backend has no gradient for: conftest.NO_GRADIENT)."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["X", "W"], ["h"])],
        "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(rng.normal(size=(2, 1)).astype(np.float32), "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    op_type = append_no_gradient_node(model, "h", "Y", "smooth")
    fb = OrtGradientForwardBackward(model)
    with pytest.raises(gk.MissingGradientError, match=names_operator(op_type, "smooth")):
        fb.forward([np.zeros((3, 2), np.float32)])


def test_every_exported_graph_passes_the_checker(torch_net, data):
    """Both trainers, on an MLP in float64 (with the lowered gradient operators)."""
    from graphkit.compat import MAX_IR_VERSION, MAX_OPSET, opset_of

    _, onx = torch_net
    X, y = data
    Y = np.column_stack([y, -y])
    partial = OrtGradientForwardBackwardOptimizer(onx, max_iter=1).fit(X, Y)
    full = OrtGradientOptimizer(gk.add_loss_output(onx), max_iter=1).fit(X, Y)
    for trainer in (partial, full):
        for name, data_ in trainer.save_onnx_graph(bytes).items():
            model = onnx.load_from_string(data_)
            onnx.checker.check_model(model)
            assert model.ir_version <= MAX_IR_VERSION and opset_of(model) <= MAX_OPSET, name


@pytest.mark.parametrize(
    "hidden, threads, serial", [(4, None, True), (520, None, False), (4, 2, False)]
)
def test_small_loss_and_update_sessions_run_serially(hidden, threads, serial, monkeypatch):
    """Each session owns a thread pool; small ones run on the calling thread so that only
    the TrainingAgent's pool competes for the cores (see partial.SERIAL_BELOW), unless
    the user chose the threads."""
    four_calls_a_batch(monkeypatch)  # the loss runs separately
    trainer = OrtGradientForwardBackwardOptimizer(
        mlp_onnx(480, hidden, 1),
        batch_size=8,
        max_iter=1,
        intra_op_num_threads=threads,
    )
    rng = np.random.default_rng(0)
    trainer.fit(rng.normal(size=(16, 480)).astype(np.float32), np.zeros((16, 1), np.float32))
    # the loss runs specialized to the training batch size (None: validation, any size)
    runs = [r.session for (_, rows), r in trainer._loss_runs.items() if rows is not None]
    sessions = [trainer._resident_session, *runs]
    got = [s.get_session_options().intra_op_num_threads for s in sessions]
    if serial:
        assert got == [1] * len(got)
    else:
        assert got[0] == (threads or 0)  # 0: onnxruntime's default, a thread per core


@script()
def log_cosh(prediction: FLOAT, label: FLOAT) -> FLOAT:
    """mean log(cosh(p - y)), cosh written with Exp (Cosh has no gradient)."""
    d = prediction - label
    half = op.CastLike(0.5, d)
    return op.ReduceMean(op.Log((op.Exp(d) + op.Exp(op.Neg(d))) * half), keepdims=0)


@pytest.mark.parametrize("calls", [FUSED, 4])
def test_custom_loss_matches_numpy(calls, monkeypatch):
    """A custom loss (its gradient built by the backend's gradient source) spliced into
    onnxruntime-training's agent graph (2 calls), or run as its own session (4, the
    default backend): SGD on mean log cosh, whose gradient is tanh(d) / n."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.3
    model = zero_linear()
    if calls == 4:
        four_calls_a_batch(monkeypatch)
    trainer = OrtGradientForwardBackwardOptimizer(
        model,
        max_iter=2,
        batch_size=8,
        shuffle=False,
        learning_rate=gk.LearningRateSGD(eta0=0.1, learning_rate="constant"),
        learning_loss=gk.losses.custom_loss(log_cosh),
        backend=fused_backend(calls),
    ).fit(X, y)
    assert bool(trainer._agent_runs) == (calls == 2)
    w, b, losses = np.zeros((3, 1)), np.zeros(1), []
    for _ in range(2):
        epoch = []
        for start in range(0, 40, 8):
            x, t = X[start : start + 8], y[start : start + 8, None]
            d = x @ w + b - t
            epoch.append(np.mean(np.log(np.cosh(d))))
            g = np.tanh(d) / len(x)
            w, b = w - 0.1 * x.T @ g, b - 0.1 * g.sum(0)
        losses.append(np.mean(epoch))
    np.testing.assert_allclose(trainer.get_state()["coef"], w, rtol=1e-10)
    np.testing.assert_allclose(trainer.get_state()["intercept"], b, rtol=1e-10)
    np.testing.assert_allclose(trainer.train_losses_, losses, rtol=1e-10)
