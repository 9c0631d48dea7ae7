"""The backend protocol is the contract: a fake backend with exactly its members trains.

:class:`graphkit.backends.base.Backend` declares everything the runtime asks of a
backend. ``FakeBackend`` below has those members and nothing else (``__slots__`` and no
``__getattr__``), answers each from graphkit's standard pieces, and records which it was
asked for; registered under a name of its own, it trains a linear regression with both
trainers to the weights numpy's SGD reaches. A member the runtime used without the
protocol declaring it would raise AttributeError here, whatever the two real backends
happen to have.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import pytest

from graphkit import backends
from graphkit.backends.base import Backend
from graphkit.backends.native import adapter, agent, fused_step, split
from graphkit.compat import PORTABLE
from graphkit.engine import ort_engine

ROOT = Path(__file__).resolve().parents[1]
# what the protocol declares: its methods, properties and attributes, the bases' included
DECLARED = {
    name
    for cls in Backend.__mro__
    if cls.__module__ == "graphkit.backends.base"
    for name in [*vars(cls), *getattr(cls, "__annotations__", {})]
    if not name.startswith("_")
}


class FakeBackend:
    """A backend with the protocol's members only, each recorded when used."""

    __slots__ = ("asked",)
    name = "fake"
    description = "the protocol's members, answered by standard ONNX pieces"

    def __init__(self) -> None:
        self.asked: set[str] = set()

    def _ask(self, member: str) -> None:
        self.asked.add(member)

    @property
    def ceiling(self):
        self._ask("ceiling")
        return PORTABLE

    # -- gradient source
    @property
    def constant_folds(self):
        self._ask("constant_folds")
        return ()

    def prepare(self, model: onnx.ModelProto) -> onnx.ModelProto:
        self._ask("prepare")
        return model

    def gradient_graph(self, model, output, wrt):
        self._ask("gradient_graph")
        return adapter.gradient_graph(model, output, wrt)

    def forward_backward_graphs(self, model, weights, inputs):
        self._ask("forward_backward_graphs")
        return split.forward_backward_graphs(model, weights, inputs)

    def prepare_gradient(self, gradient):
        self._ask("prepare_gradient")
        return gradient

    def to_standard(self, model):
        self._ask("to_standard")
        return model

    # -- engine
    def inference_session(self, model, providers=ort_engine.CPU, threads=None):
        self._ask("inference_session")
        return ort_engine.inference_session(model, providers, threads)

    # -- forward/backward runner
    def training_agent(self, gradient, providers, threads, feeds, fetches, outputs, seeds, device):
        self._ask("training_agent")

        def session(model):
            return ort_engine.inference_session(model, providers, threads)

        return agent.SplitAgent(gradient, session, feeds, fetches, outputs, seeds), None

    def run_forward(self, agent_, feeds):
        self._ask("run_forward")
        return agent.run_forward(agent_, feeds)

    def run_backward(self, agent_, grad_outputs, state):
        self._ask("run_backward")
        return agent.run_backward(agent_, grad_outputs, state)

    def values_vector(self, values):
        self._ask("values_vector")
        return agent.values_vector(values)

    def agent_step(self, gradient, loss, update, internal, gradient_of, features, seeds):
        self._ask("agent_step")
        return fused_step.fused_step(gradient, loss, update, internal, gradient_of, features, seeds)

    @property
    def AgentRun(self):  # noqa: N802 - the protocol's name
        self._ask("AgentRun")
        return fused_step.FusedRun


@pytest.fixture
def fake(monkeypatch):
    """``FakeBackend`` registered as ``"fake"`` for one test."""
    made = FakeBackend()
    module = types.ModuleType("graphkit_fake_backend")
    module.BACKEND = made  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(backends, "_BACKENDS", dict(backends._BACKENDS))
    backends.register("fake", module.__name__, lambda: True, "", made.description, 10, 21)
    return made


def _regression():
    from conftest import linear_regression_onnx

    rng = np.random.default_rng(3)
    X = rng.normal(size=(20, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
    return linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32)), X, y


def _numpy_sgd(X: np.ndarray, y: np.ndarray, epochs: int, batch: int, lr: float):
    """SGD on mean squared error, from the formula: d mean((xW + b - y)^2) = 2 mean(r x)."""
    W, b = np.zeros((3, 1)), np.zeros(1)
    for _ in range(epochs):
        for start in range(0, len(X), batch):
            xb, yb = X[start : start + batch].astype(np.float64), y[start : start + batch, None]
            residual = xb @ W + b - yb
            W -= lr * 2 * xb.T @ residual / len(xb)
            b -= lr * 2 * residual.mean(axis=0)
    return W, b


def test_the_fake_backend_satisfies_the_protocol(fake):
    assert isinstance(fake, Backend)
    assert backends.get("fake") is fake
    assert set(dir(FakeBackend)) >= DECLARED
    with pytest.raises(AttributeError):
        fake.fusable  # noqa: B018 - a member the protocol does not declare


@pytest.mark.parametrize("trainer", ["Trainer", "ForwardBackwardTrainer"])
def test_both_trainers_train_on_a_backend_that_has_only_the_protocol(fake, trainer):
    import graphkit_train

    onx, X, y = _regression()
    from graphkit import optimizers

    kwargs = dict(max_iter=3, batch_size=5, shuffle=False, backend="fake")
    kwargs.update(loss="mse", optimizer=optimizers.sgd(0.01))
    fitted = getattr(graphkit_train, trainer)(onx, **kwargs).fit(X, y)
    W, b = _numpy_sgd(X, y, epochs=3, batch=5, lr=0.01)
    state = fitted.get_state()
    np.testing.assert_allclose(state["coef"], W, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["intercept"], b, rtol=1e-5, atol=1e-6)
    assert {"ceiling", "prepare", "inference_session"} <= fake.asked
    if trainer == "ForwardBackwardTrainer":  # its batches: the runner's fused step
        assert {"forward_backward_graphs", "agent_step", "AgentRun"} <= fake.asked
    else:
        assert "gradient_graph" in fake.asked


def test_the_forward_backward_runner_of_the_fake_backend(fake):
    """The two calls of forward/backward training (the ONNX graph as a layer): the
    gradient of sum(prediction) by the weights is sum over rows of x (and 1)."""
    from graphkit_train import OrtGradientForwardBackward

    onx, X, _ = _regression()
    layer = OrtGradientForwardBackward(onx, backend="fake")
    (prediction,) = layer.forward([X])
    np.testing.assert_array_equal(prediction.numpy(), np.zeros((20, 1), np.float32))
    grads = layer.backward([np.ones((20, 1), np.float32)])
    assert {"training_agent", "run_forward", "run_backward"} <= fake.asked
    np.testing.assert_allclose(grads["coef"].numpy().ravel(), X.sum(axis=0), rtol=1e-5)
    np.testing.assert_allclose(grads["intercept"].numpy(), [20.0], rtol=1e-6)


def _backend_members_used(path: Path) -> set[str]:
    """Attributes read on a backend object in ``path``: ``backend.x``, ``self.backend.x``,
    ``self._backend.x``, ``gradient_source.x`` (:func:`graphkit.gradient_model`'s)."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
        if name in ("backend", "_backend", "gradient_source"):
            used.add(node.attr)
    return used


def test_the_runtime_uses_only_what_the_protocol_declares():
    """Outside the backends, every member read on a backend object is declared (a static
    check beside the fake backend's: it sees paths the tests above do not take)."""
    sources = [
        p
        for package in ("graphkit", "graphkit_train")
        for p in (ROOT / package).rglob("*.py")
        if (ROOT / "graphkit" / "backends") not in p.parents
    ]
    undeclared = {
        f"{p.relative_to(ROOT)}: {member}"
        for p in sources
        for member in _backend_members_used(p) - DECLARED
    }
    assert not undeclared, "\n".join(sorted(undeclared))


@pytest.mark.parametrize("trainer", ["Trainer", "ForwardBackwardTrainer"])
def test_a_build_resolves_the_backend_and_converts_the_model_once(trainer, monkeypatch):
    """One trainer build: the backend's name is resolved once (the object is passed
    down), and the user's model is converted and checked once (compat.make_compatible:
    a copy and onnx.checker), whichever module asks."""
    import graphkit_train
    from graphkit import compat, ml_ops, prepare, rewrite

    calls = {"canonical": 0, "make_compatible": 0}

    def counted(name, function):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return function(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(backends, "canonical", counted("canonical", backends.canonical))
    converting = counted("make_compatible", compat.make_compatible)
    for module in (compat, ml_ops, prepare, rewrite):
        monkeypatch.setattr(module, "make_compatible", converting)
    onx, X, y = _regression()
    getattr(graphkit_train, trainer)(onx, loss="mse", max_iter=1, batch_size=5).fit(X, y)
    assert calls == {"canonical": 1, "make_compatible": 1}
