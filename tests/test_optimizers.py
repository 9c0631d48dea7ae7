"""Optimizers for 50 steps on fixed gradients against torch.optim, and against
scikit-learn's own optimizer classes where its update rule differs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphkit import ShapeError, UnknownNameError, optimizers, schedules
from graphkit.seed import resolve
from graphkit.transforms import apply_updates

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
        lambda: optimizers.momentum(momentum=0.9),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9),
    ),
    "momentum_dampening": (
        lambda: optimizers.momentum(momentum=0.8, dampening=0.3),
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.8, dampening=0.3),
    ),
    "nesterov": (
        lambda: optimizers.momentum(momentum=0.9, nesterov=True, weight_decay=0.01),
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
    assert all(s.split(".")[0] in {"coef", "0"} for s in state)
    for step in range(STEPS):
        for name, t in tensors.items():
            t.grad = torch.tensor(grads[name][step], dtype=t.dtype)
        reference.step()
        updates, state = opt.update(
            {n: g[step].astype(dtype) for n, g in grads.items()}, state, params, step, lr
        )
        params = apply_updates(params, updates)
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
    opt = optimizers.momentum(momentum=0.9, nesterov=nesterov, convention="sklearn")
    params = {"w": w.copy()}
    state = opt.init(params)
    for step, g in enumerate(fixed_gradients(rng, w.shape)):
        reference.learning_rate = 0.1 / (step + 1)
        reference.update_params(ref_params, [g])
        updates, state = opt.update({"w": g}, state, params, step, 0.1 / (step + 1))
        params = apply_updates(params, updates)
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
        updates, state = opt.update({"w": g}, state, params, step, 0.01)
        params = apply_updates(params, updates)
    np.testing.assert_allclose(params["w"], ref_params[0], rtol=1e-12)


def test_adam_eps_modes_differ(rng):
    """The documented choice matters: with a large eps the two placements disagree."""
    w, g = {"w": np.ones(3)}, {"w": np.full(3, 1e-3)}
    a, b = optimizers.adam(eps=1e-2), optimizers.adam(eps=1e-2, eps_mode="uncorrected")
    pa = apply_updates(w, a.update(g, a.init(w), w, 0, 0.1)[0])
    pb = apply_updates(w, b.update(g, b.init(w), w, 0, 0.1)[0])
    # step 0: corrected  -> lr g / (|g| + eps); uncorrected -> lr g / (|g| + eps / sqrt(1 - b2))
    np.testing.assert_allclose(1 - pa["w"], 0.1 * 1e-3 / (1e-3 + 1e-2), rtol=1e-12)
    np.testing.assert_allclose(1 - pb["w"], 0.1 * 1e-3 / (1e-3 + 1e-2 / np.sqrt(1e-3)), rtol=1e-12)


RULES = {
    "trace": lambda: optimizers.trace(0.9, nesterov=True),
    "trace_sklearn": lambda: optimizers.trace(0.9, convention="sklearn"),
    "adam": lambda: optimizers.scale_by_adam(),
    "adam_uncorrected": lambda: optimizers.scale_by_adam(eps_mode="uncorrected"),
    "adagrad": lambda: optimizers.scale_by_adagrad(lr_decay=0.1),
    "rms": lambda: optimizers.scale_by_rms(),
    "lion": lambda: optimizers.scale_by_lion(),
    "radam": lambda: optimizers.scale_by_radam(),
    "adadelta": lambda: optimizers.scale_by_adadelta(),
    "trust_ratio": lambda: optimizers.scale_by_trust_ratio(),
}


@pytest.mark.parametrize("name", sorted(RULES))
def test_rule_eager_equals_compiled_and_state_is_named_after_the_weight(name, rng):
    """A rule's scripted function run eagerly (onnxscript's evaluator) gives the
    compiled graph's numbers, and its state is named "{weight}.{rule}.{field}"."""
    rule = RULES[name]()
    w, g = rng.normal(size=(2, 3)), rng.normal(size=(2, 3))
    state = {k: v + 0.5 for k, v in rule.init({"layer.w": w}).items()}
    assert list(state) == [rule.state_name("layer.w", f.name) for f in rule.fields]
    updates, new_state = rule.update({"layer.w": g}, state, {"layer.w": w}, 4)
    eager = rule.update_fn(g, w, *state.values(), np.array(4, dtype=np.int64))
    eager = eager if isinstance(eager, tuple) else (eager,)
    np.testing.assert_allclose(eager[0], updates["layer.w"], rtol=1e-12)
    for value, name_ in zip(eager[1:], state):
        np.testing.assert_allclose(value, new_state[name_], rtol=1e-12)


def test_update_model_takes_the_seed_names():
    from graphkit.engine.ort_engine import Runner

    opt = optimizers.sgd(learning_rate=schedules.invscaling(0.1, 0.5))
    model = optimizers.update_model(opt, "w", np.float64, (2,))
    onnx.checker.check_model(model)
    assert [i.name for i in model.graph.input] == ["param", "grad", "step"]
    out = Runner(model)({"param": np.ones(2), "grad": np.ones(2), "step": np.array(3)})
    np.testing.assert_allclose(out[0], 1 - 0.1 / np.sqrt(4), rtol=1e-12)


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
    opt = optimizers.momentum(momentum=momentum, nesterov=nesterov)
    params = {"w": w}
    state = opt.init(params)
    for step in range(5):
        g = rng.normal(size=3)
        t.grad = torch.tensor(g)
        reference.step()
        updates, state = opt.update({"w": g}, state, params, step, lr)
        params = apply_updates(params, updates)
    np.testing.assert_allclose(params["w"], t.detach().numpy(), rtol=1e-12, atol=1e-12)


def test_bad_optimizer_input():
    with pytest.raises(UnknownNameError, match="Valid names.*adam"):
        optimizers.get("adamm")
    with pytest.raises(ValueError, match="momentum"):
        optimizers.momentum(momentum=1.5)
    with pytest.raises(ValueError, match="eps_mode"):
        optimizers.adam(eps_mode="inside")
    with pytest.raises(ValueError, match="convention"):
        optimizers.momentum(convention="keras")
    opt = optimizers.adam()
    w = {"w": np.zeros(3)}
    with pytest.raises(ShapeError, match="Gradient of 'w'"):
        opt.update({"w": np.zeros(4)}, opt.init(w), w, 0, 0.1)
    with pytest.raises(UnknownNameError, match="No gradient"):
        opt.update({}, opt.init(w), w, 0, 0.1)
    with pytest.raises(UnknownNameError, match="init"):
        opt.update(w, {}, w, 0, 0.1)
    with pytest.raises(ValueError, match="open learning rate"):
        opt.update(w, opt.init(w), w, 0)


# -- the learning rate is the first argument (optax's and torch's order) -----------------

RATE = 1e-3


def _lion_numpy(w, grads, lr, b1=0.9, b2=0.99):
    """Lion from the paper (Chen et al. 2023, Algorithm 2), no decay."""
    m = np.zeros_like(w)
    for g in grads:
        w = w - lr * np.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
    return w


def _lamb_numpy(w, grads, lr, b1=0.9, b2=0.999, eps=1e-6):
    """LAMB from the paper (You et al. 2020, Algorithm 2), no decay, phi = identity."""
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        w = w - lr * np.linalg.norm(w) / np.linalg.norm(r) * r
    return w


def _torch_reference(make):
    def reference(w, grads, lr):
        t = torch.tensor(w.copy(), requires_grad=True)
        opt = make([t], lr)
        for g in grads:
            t.grad = torch.tensor(g)
            opt.step()
        return t.detach().numpy()

    return reference


# every optimizer factory, at its defaults, with the reference for those defaults
RATE_FIRST = {
    "sgd": _torch_reference(lambda p, lr: torch.optim.SGD(p, lr=lr)),
    "momentum": _torch_reference(lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9)),
    "nesterov": _torch_reference(
        lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True)
    ),
    "adam": _torch_reference(lambda p, lr: torch.optim.Adam(p, lr=lr)),
    "adamw": _torch_reference(lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=1e-2)),
    "adagrad": _torch_reference(lambda p, lr: torch.optim.Adagrad(p, lr=lr)),
    "rmsprop": _torch_reference(lambda p, lr: torch.optim.RMSprop(p, lr=lr)),
    "radam": _torch_reference(lambda p, lr: torch.optim.RAdam(p, lr=lr)),
    "adadelta": _torch_reference(lambda p, lr: torch.optim.Adadelta(p, lr=lr)),
    "adafactor": _torch_reference(lambda p, lr: torch.optim.Adafactor(p, lr=lr)),
    "lion": _lion_numpy,
    "lamb": _lamb_numpy,
}


def test_every_registered_optimizer_is_checked_for_its_argument_order():
    assert sorted(RATE_FIRST) == optimizers.OPTIMIZERS.names()


@pytest.mark.parametrize("name", sorted(RATE_FIRST))
def test_learning_rate_is_the_first_argument(name, rng):
    """``adam(1e-3)`` is Adam at rate 0.001 (it once set b1 = 0.001 silently): three
    steps on fixed gradients against torch.optim at lr=1e-3 (numpy from the paper for
    Lion and LAMB), the rate a number, a schedule object, or filled from ``get``."""
    factory = getattr(optimizers, name)
    w = rng.normal(size=(3, 4))
    grads = [rng.normal(size=w.shape) for _ in range(3)]
    expected = RATE_FIRST[name](w, grads, RATE)
    for opt in (
        factory(RATE),
        factory(schedules.constant(RATE)),
        optimizers.get(name, learning_rate=RATE),
        factory().with_learning_rate(RATE),
    ):
        assert not opt.has_open_learning_rate
        params = {"w": w}
        state = opt.init(params)
        for step, g in enumerate(grads):
            updates, state = opt.update({"w": g}, state, params, step)
            params = apply_updates(params, updates)
        np.testing.assert_allclose(params["w"], expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(RATE_FIRST))
def test_a_second_positional_number_is_a_type_error(name):
    factory = getattr(optimizers, name)
    with pytest.raises(TypeError):
        factory(RATE, 0.9)
    # left open, as before: the trainers fill it (DEFAULT_LEARNING_RATE when given none)
    assert factory().has_open_learning_rate
    filled = resolve(factory())
    assert {float(s(0)) for s in filled.schedules()} == {optimizers.DEFAULT_LEARNING_RATE}


def test_seed_learning_rates_keep_their_hyper_parameters(rng):
    """The seed classes pass their hyper-parameters by name: LearningRateAdam(b1=0.8)
    is torch's Adam with betas (0.8, 0.99) at eta0, not a rate of 0.8."""
    from graphkit import seed

    w = rng.normal(size=(5,))
    grads = [rng.normal(size=w.shape) for _ in range(4)]
    cases = [
        (
            seed.LearningRateAdam(eta0=0.01, b1=0.8, b2=0.99, eps=1e-6),
            lambda p: torch.optim.Adam(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6),
        ),
        (
            seed.LearningRateAdamW(eta0=0.01, weight_decay=0.1),
            lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
        ),
        (
            seed.LearningRateAdagrad(eta0=0.05, lr_decay=0.1, initial_accumulator_value=0.2),
            lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.1, initial_accumulator_value=0.2),
        ),
        (
            seed.LearningRateRMSProp(eta0=0.01, alpha=0.9, eps=1e-6),
            lambda p: torch.optim.RMSprop(p, lr=0.01, alpha=0.9, eps=1e-6),
        ),
    ]
    for rate, make in cases:
        expected = _torch_reference(lambda p, lr, make=make: make(p))(w, grads, None)
        opt = rate.to_transformation()
        params = {"w": w}
        state = opt.init(params)
        for step, g in enumerate(grads):
            updates, state = opt.update({"w": g}, state, params, step)
            params = apply_updates(params, updates)
        np.testing.assert_allclose(params["w"], expected, rtol=1e-12)
    nesterov = seed.LearningRateSGDNesterov(momentum=0.7).to_transformation()
    assert nesterov.params["momentum"] == 0.7 and nesterov.params["nesterov"]


def test_the_repr_shows_a_given_learning_rate():
    """adam(1e-3) and adam() must not read alike: the rate given is shown, an open one
    (filled by the trainers) is not."""
    assert "learning_rate=Schedule('constant', eta0=0.001)" in repr(optimizers.adam(1e-3))
    assert "learning_rate" not in repr(optimizers.adam())
    filled = optimizers.sgd().with_learning_rate(0.5)
    assert repr(filled).startswith("sgd(learning_rate=Schedule('constant', eta0=0.5)")
