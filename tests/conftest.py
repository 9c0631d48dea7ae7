"""Shared fixtures: small real models from scikit-learn (skl2onnx) and PyTorch."""

from __future__ import annotations

import importlib.util
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphkit import backends


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def linear_regression_onnx(coef: np.ndarray, intercept: np.ndarray) -> onnx.ModelProto:
    """Y = X coef + intercept, built by hand with onnx.helper (opset 18, IR 10)."""
    dtype = TensorProto.FLOAT if coef.dtype == np.float32 else TensorProto.DOUBLE
    n_features, n_targets = coef.shape
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "coef"], ["XW"]),
            helper.make_node("Add", ["XW", "intercept"], ["Y"]),
        ],
        "linear_regression",
        [helper.make_tensor_value_info("X", dtype, ["N", n_features])],
        [helper.make_tensor_value_info("Y", dtype, ["N", n_targets])],
        [numpy_helper.from_array(coef, "coef"), numpy_helper.from_array(intercept, "intercept")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def mlp_onnx(
    n_in: int,
    hidden: int,
    n_out: int,
    activation: str = "Relu",
    dtype: type = np.float32,
    scale: float = 1.0,
    seed: int = 0,
) -> onnx.ModelProto:
    """Y = act(X W1 + b1) W2 + b2, built by hand (opset 18, IR 10); weights N(0, scale^2)."""
    rng = np.random.default_rng(seed)
    elem = TensorProto.FLOAT if np.dtype(dtype) == np.float32 else TensorProto.DOUBLE
    inits = {
        "W1": (rng.normal(size=(n_in, hidden)) * scale).astype(dtype),
        "b1": np.zeros(hidden, dtype),
        "W2": (rng.normal(size=(hidden, n_out)) * scale).astype(dtype),
        "b2": np.zeros(n_out, dtype),
    }
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node(activation, ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "W2"], ["o0"]),
        helper.make_node("Add", ["o0", "b2"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("X", elem, ["N", n_in])],
        [helper.make_tensor_value_info("Y", elem, ["N", n_out])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.fixture(scope="session")
def regression_data() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import make_regression

    X, y = make_regression(200, 4, noise=0.5, random_state=0)
    return X.astype(np.float32), (y / 100).astype(np.float32)


@pytest.fixture(scope="session")
def classification_data() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import make_classification

    X, y = make_classification(200, 4, n_classes=3, n_informative=3, n_redundant=0, random_state=0)
    return X.astype(np.float32), y.astype(np.int64)


@pytest.fixture(scope="session")
def mlp_regressor(regression_data):
    from skl2onnx import to_onnx
    from sklearn.neural_network import MLPRegressor

    X, y = regression_data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MLPRegressor(hidden_layer_sizes=(6,), max_iter=30, random_state=0).fit(X, y)
    return model, to_onnx(model, X[:1])


@pytest.fixture(scope="session")
def mlp_classifier(classification_data):
    from skl2onnx import to_onnx
    from sklearn.neural_network import MLPClassifier

    X, y = classification_data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MLPClassifier(hidden_layer_sizes=(6,), max_iter=30, random_state=0).fit(X, y)
    return model, to_onnx(model, X[:1], options={"zipmap": False})


def export_torch(net, path, n_features: int, dtype=None) -> onnx.ModelProto:
    """torch.onnx.export (TorchScript exporter) with input X and output Y, batch dim N."""
    import torch

    example = torch.zeros(2, n_features, dtype=dtype or torch.float32)
    torch.onnx.export(
        net,
        (example,),
        str(path),
        input_names=["X"],
        output_names=["Y"],
        dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}},
        dynamo=False,
    )
    return onnx.load(str(path))


@pytest.fixture(scope="session")
def torch_mlp(tmp_path_factory):
    """A torch MLP and its torch.onnx.export (dotted weight names, Gemm)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
    return net, export_torch(net, tmp_path_factory.mktemp("torch") / "mlp.onnx", 4)


# -- backends ----------------------------------------------------------------------------------
# The suite runs on the default backend (the first installed one, or the one GRAPHKIT_BACKEND
# names). A test of onnxruntime-training's own behaviour (its fused agent step, its kernels
# and lowerings, its refusals) names backend="ort_training" and carries
# @requires_ort_training; a test of graphkit's behaviour runs on the default backend, or on
# every installed one (INSTALLED_BACKENDS); an expectation that depends on the backend reads
# default_backend().

INSTALLED_BACKENDS = [b.name for b in backends.available() if b.installed]
"""The installed backends, in the registry's order of preference."""

requires_ort_training = pytest.mark.skipif(
    "ort_training" not in INSTALLED_BACKENDS,
    reason="onnxruntime-training is not installed (CPython <= 3.12 only)",
)


def four_calls_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every installed backend's forward/backward trainer run a batch as four
    session calls (forward, loss, backward, update), as distributed training does, instead
    of its fused step (:func:`graphkit.update_step.fuses_into`)."""
    from graphkit_train.trainers import partial

    monkeypatch.setattr(partial, "fuses_into", lambda *graphs: False)


def default_backend() -> str:
    """The name of the backend ``backend=None`` means here."""
    return backends.canonical(None)


NO_GRADIENT = {"ort_training": ("", "Cosh"), "native": ("com.microsoft", "FastGelu")}
"""``(domain, operator)``: an elementwise operator each backend has no gradient for.
onnxruntime-training 1.19.2 has none for Cosh; onnx-ad has a rule for every float
operator of ai.onnx a model brings, so the native backend is shown one of onnxruntime's
own (contrib) operators, which a model optimized by onnxruntime holds."""


def append_no_gradient_node(
    model: onnx.ModelProto, x: str, y: str, name: str, backend: str | None = None
) -> str:
    """Appends ``y = op(x)`` (node ``name``) with the operator of :data:`NO_GRADIENT` of
    ``backend`` (None: the default) to ``model``; returns the operator's name."""
    domain, op_type = NO_GRADIENT[backends.canonical(backend)]
    model.graph.node.append(helper.make_node(op_type, [x], [y], name=name, domain=domain))
    if domain and domain not in {o.domain for o in model.opset_import}:
        model.opset_import.append(helper.make_opsetid(domain, 1))
    return op_type


def names_operator(op_type: str, node: str | None = None) -> str:
    """A regex for a refusal that names ``op_type`` (and its node ``node``): each backend
    writes it its own way ("operator 'Cosh' (node 'smooth')", "no reverse rule for FastGelu
    (node 'smooth')")."""
    pattern = rf"\b{op_type}\b"
    return pattern if node is None else pattern + rf"'? \(node '{node}'\)"


HAS_TORCH = importlib.util.find_spec("torch") is not None
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
"""For a module whose other tests run without torch (Python 3.13 has no torch here)."""


def on_both_runtimes(model: onnx.ModelProto, feeds: dict) -> list[list[np.ndarray]]:
    """``model``'s outputs on onnxruntime and on ``onnx.reference`` (a graph graphkit
    writes must run on both: the second is the portable exports' reference)."""
    import onnx.reference

    from graphkit.engine.ort_engine import inference_session

    return [
        inference_session(model).run(None, feeds),
        onnx.reference.ReferenceEvaluator(model).run(None, feeds),
    ]


def assert_sgd_epoch_equals_torch(onx, net, X, y, backend, batch_size=8, lr=0.1):
    """One epoch of graphkit's full training (the squared error, SGD at ``lr``, the
    batches in order) of ``onx``, an export of the torch module ``net``, against torch's
    SGD of ``net`` on the same batches: every parameter within 1e-5. ``net`` is trained;
    returns graphkit's trainer."""
    import torch

    from graphkit import add_loss_output
    from graphkit_train import OrtGradientOptimizer

    trainer = OrtGradientOptimizer(
        add_loss_output(onx, "squared_error"),
        list(net.state_dict()),
        max_iter=1,
        batch_size=batch_size,
        learning_rate=lr,
        shuffle=False,
        backend=backend,
    ).fit(X, y)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for start in range(0, len(X), batch_size):
        optimizer.zero_grad()
        out = net(torch.from_numpy(X[start : start + batch_size]))
        torch.nn.functional.mse_loss(
            out, torch.from_numpy(y[start : start + batch_size])
        ).backward()
        optimizer.step()
    state = trainer.get_state()
    for name, value in net.state_dict().items():
        expected = value.numpy()
        np.testing.assert_allclose(
            state[name], expected, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max())
        )
    return trainer


def export_dynamo(net, example: np.ndarray) -> onnx.ModelProto:
    """``net`` exported by the README's dynamo recipe (``optimize=False``), its first
    input's batch symbolic (``N``), quietly; ``example``: rows of that input."""
    import contextlib
    import io
    import warnings

    import torch

    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            net,
            (torch.from_numpy(example[:2]),),
            dynamo=True,
            optimize=False,
            input_names=["X"],
            dynamic_shapes=({0: torch.export.Dim("N", min=1)},),
        )
    return program.model_proto


_M = 2**31


def _mix(x):
    """graphkit.train_mode's mixing function, written again from its docstring."""
    x = np.asarray(x, dtype=np.int64) % _M
    for a, k in ((0x7FEB352D, 16), (0x4C6CA68B, 15), (0x27D4EB2D, 16)):
        x = ((x ^ (x >> k)) * a) % _M
    return x ^ (x >> 16)


def dropout_uniform(seed: int, step: int, layer: int, size: int) -> np.ndarray:
    """The uniform numbers the ``layer``-th Dropout in training mode draws at ``step``
    (graphkit.train_mode's stream, from its docstring's formula): a unit is kept where
    they are >= p, so torch fed these masks trains as graphkit does."""
    key = _mix((_mix((_mix(seed) + step % _M) % _M) + layer + 1) % _M)
    return (_mix((_mix(np.arange(size)) + key) % _M) // 2**7).astype(np.float32) * 2.0**-24
