"""Optimizers for 50 steps on fixed gradients against torch.optim, and against
scikit-learn's own optimizer classes where its update rule differs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphkit import ShapeError, UnknownNameError, optimizers, schedules

torch = pytest.importorskip("torch")

STEPS = 50

# (graphkit optimizer, torch optimizer factory) on the same hyper-parameters
TORCH_CASES = {
    "sgd": (lambda: optimizers.sgd(), lambda p, lr: torch.optim.SGD(p, lr=lr)),
    "sgd_wd": (
        lambda: optimizers.sgd(weight_decay=0.1),
        lambda p, lr: torch.optim.SGD(p, lr=lr, weight_decay=0.1),
    ),
    "momentum": (
        lambda: optimizers.momentum(0.9),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
    ),
    "momentum_dampening": (
        lambda: optimizers.momentum(0.8, dampening=0.3),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.8, dampening=0.3),
    ),
    "nesterov": (
        lambda: optimizers.momentum(0.9, nesterov=True, weight_decay=0.01),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True, weight_decay=0.01),
    ),
    "adam": (lambda: optimizers.adam(), lambda p, lr: torch.optim.Adam(p, lr=lr)),
    "adam_l2": (
        lambda: optimizers.adam(b1=0.8, b2=0.99, eps=1e-6, weight_decay=0.1),
        lambda p, lr: torch.optim.Adam(p, lr=lr, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
    ),
    "adamw": (
        lambda: optimizers.adamw(weight_decay=0.05),
        lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.05),
    ),
    "adagrad": (
        lambda: optimizers.adagrad(lr_decay=0.01, initial_accumulator_value=0.1),
        lambda p, lr: torch.optim.Adagrad(p, lr=lr, lr_decay=0.01, initial_accumulator_value=0.1),
    ),
    "rmsprop": (
        lambda: optimizers.rmsprop(alpha=0.9, eps=1e-6),
        lambda p, lr: torch.optim.RMSprop(p, lr=lr, alpha=0.9, eps=1e-6),
    ),
}


def fixed_gradients(rng, shape):
    return [rng.normal(size=shape) for _ in range(STEPS)]


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_optimizer_matches_torch(case, dtype, rng):
    make_ours, make_torch = TORCH_CASES[case]
    lr = 0.05
    w0 = {"coef": rng.normal(size=(3, 2)), "0.bias": rng.normal(size=(2,))}
    grads = {name: fixed_gradients(rng, w.shape) for name, w in w0.items()}

    tensors = {
        n: torch.tensor(w, dtype=getattr(torch, np.dtype(dtype).name)) for n, w in w0.items()
    }
    for t in tensors.values():
        t.requires_grad_(True)
    reference = make_torch(list(tensors.values()), lr)

    opt = make_ours()
    params = {n: w.astype(dtype) for n, w in w0.items()}
    state = opt.init(params)
    assert set(state) == {s for n in params for s in opt.state_names(n)}
    for step in range(STEPS):
        for name, t in tensors.items():
            t.grad = torch.tensor(grads[name][step], dtype=t.dtype)
        reference.step()
        params, state = opt.update(
            params, {n: g[step].astype(dtype) for n, g in grads.items()}, state, lr, step
        )
    tol = 1e-12 if dtype == np.float64 else 2e-5
    for name, t in tensors.items():
        assert params[name].dtype == dtype
        np.testing.assert_allclose(params[name], t.detach().numpy(), rtol=tol, atol=tol)


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_sklearn_convention_matches_sklearn(nesterov, rng):
    """scikit-learn keeps the learning rate inside the velocity: compare with its own
    SGDOptimizer, with a learning rate that changes every step."""
    from sklearn.neural_network._stochastic_optimizers import SGDOptimizer

    w = rng.normal(size=(4, 3))
    ref_params = [w.copy()]
    reference = SGDOptimizer(ref_params, learning_rate_init=0.1, momentum=0.9, nesterov=nesterov)
    opt = optimizers.momentum(0.9, nesterov=nesterov, convention="sklearn")
    params = {"w": w.copy()}
    state = opt.init(params)
    for step, g in enumerate(fixed_gradients(rng, w.shape)):
        reference.learning_rate = 0.1 / (step + 1)
        reference.update_params(ref_params, [g])
        params, state = opt.update(params, {"w": g}, state, 0.1 / (step + 1), step)
    np.testing.assert_allclose(params["w"], ref_params[0], rtol=1e-12)


def test_adam_uncorrected_eps_matches_sklearn(rng):
    from sklearn.neural_network._stochastic_optimizers import AdamOptimizer

    w = rng.normal(size=(5,))
    ref_params = [w.copy()]
    reference = AdamOptimizer(ref_params, learning_rate_init=0.01, epsilon=1e-4)
    opt = optimizers.adam(eps=1e-4, eps_mode="uncorrected")
    params = {"w": w.copy()}
    state = opt.init(params)
    for step, g in enumerate(fixed_gradients(rng, w.shape)):
        reference.update_params(ref_params, [g])
        params, state = opt.update(params, {"w": g}, state, 0.01, step)
    np.testing.assert_allclose(params["w"], ref_params[0], rtol=1e-12)


def test_adam_eps_modes_differ(rng):
    """The documented choice matters: with a large eps the two placements disagree."""
    w, g = {"w": np.ones(3)}, {"w": np.full(3, 1e-3)}
    a, b = optimizers.adam(eps=1e-2), optimizers.adam(eps=1e-2, eps_mode="uncorrected")
    pa, _ = a.update(w, g, a.init(w), 0.1, 0)
    pb, _ = b.update(w, g, b.init(w), 0.1, 0)
    # step 0: corrected  -> lr g / (|g| + eps); uncorrected -> lr g / (|g| + eps / sqrt(1 - b2))
    np.testing.assert_allclose(1 - pa["w"], 0.1 * 1e-3 / (1e-3 + 1e-2), rtol=1e-12)
    np.testing.assert_allclose(1 - pb["w"], 0.1 * 1e-3 / (1e-3 + 1e-2 / np.sqrt(1e-3)), rtol=1e-12)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw", "adagrad", "rmsprop"])
def test_update_eager_equals_formula_and_model_passes_checker(name, rng):
    """The scripted update run eagerly (onnxscript) gives the same numbers as the
    compiled graph, and that graph passes the checker with named state."""
    opt = optimizers.get(name)
    w, g = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
    state = opt.init({"layer.w": w})
    lr, step = np.array(0.1), np.array(4, dtype=np.int64)
    eager = opt.update_fn(w, g, *(state[n] for n in opt.state_names("layer.w")), lr, step)
    eager = eager if isinstance(eager, tuple) else (eager,)
    compiled_params, compiled_state = opt.update({"layer.w": w}, {"layer.w": g}, state, 0.1, 4)
    np.testing.assert_allclose(eager[0], compiled_params["layer.w"], rtol=1e-14)
    model = opt.update_model("layer.w", np.float32, (2, 3))
    onnx.checker.check_model(model, full_check=True)
    names = [i.name for i in model.graph.input]
    assert names == ["param", "grad", *opt.state_names("layer.w"), "lr", "step"]
    assert all(n.startswith(f"layer.w.{opt.name}.") for n in opt.state_names("layer.w"))


@settings(max_examples=15, deadline=None)
@given(
    momentum=st.floats(0, 0.99),
    lr=st.floats(1e-4, 1.0),
    nesterov=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_momentum_hypothesis_against_torch(momentum, lr, nesterov, seed):
    rng = np.random.default_rng(seed)
    if nesterov and momentum == 0:
        momentum = 0.5
    w = rng.normal(size=(3,))
    t = torch.tensor(w.copy(), requires_grad=True)
    reference = torch.optim.SGD([t], lr=lr, momentum=momentum, nesterov=nesterov)
    opt = optimizers.momentum(momentum, nesterov=nesterov)
    params = {"w": w}
    state = opt.init(params)
    for step in range(5):
        g = rng.normal(size=3)
        t.grad = torch.tensor(g)
        reference.step()
        params, state = opt.update(params, {"w": g}, state, lr, step)
    np.testing.assert_allclose(params["w"], t.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_scheduled_update_computes_lr_in_graph():
    from graphkit._ort import Runner

    opt, sched = optimizers.sgd(), schedules.invscaling(0.1, 0.5)
    model = optimizers.scheduled_update_model(opt, sched, "w", np.float64, (2,))
    onnx.checker.check_model(model)
    out = Runner(model)({"param": np.ones(2), "grad": np.ones(2), "step": np.array(3)})
    np.testing.assert_allclose(out[0], 1 - 0.1 / np.sqrt(4), rtol=1e-12)


def test_bad_optimizer_input():
    with pytest.raises(UnknownNameError, match="Valid names.*adam"):
        optimizers.get("adamm")
    with pytest.raises(ValueError, match="momentum"):
        optimizers.momentum(1.5)
    with pytest.raises(ValueError, match="eps_mode"):
        optimizers.adam(eps_mode="inside")
    with pytest.raises(ValueError, match="convention"):
        optimizers.momentum(convention="keras")
    opt = optimizers.adam()
    w = {"w": np.zeros(3)}
    with pytest.raises(ShapeError, match="Gradient of 'w'"):
        opt.update(w, {"w": np.zeros(4)}, opt.init(w), 0.1, 0)
    with pytest.raises(UnknownNameError, match="No gradient"):
        opt.update(w, {}, opt.init(w), 0.1, 0)
    with pytest.raises(UnknownNameError, match="init"):
        opt.update(w, w, {}, 0.1, 0)
