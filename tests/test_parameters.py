"""The default choice of weights: a model's parameters are trained, its constants never.

References are independent: the trained weights are put back into scikit-learn's or
torch's own model, whose outputs must match graphkit's.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from zoo.models import torch_export

import graphkit as gk
from graphkit.parameters import (
    explain,
    parameter_names,
    untie_constants,
    untie_shared_parameters,
)
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer


def _model(nodes, inits, inputs=(("X", [None, 3]),), output=("Y", [None, 2])):
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])],
        [numpy_helper.from_array(np.asarray(v, np.float32), k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_rule_on_hand_built_roles():
    ones = np.ones
    onx = _model(
        [
            helper.make_node("Div", ["X", "scale"], ["Xs"]),  # a scaling constant
            helper.make_node("Transpose", ["W_t"], ["W"]),  # a weight read through a layout op
            helper.make_node("MatMul", ["Xs", "W"], ["XW"]),
            helper.make_node("Reshape", ["XW", "shape"], ["XW2"]),
            helper.make_node("Add", ["XW2", "b"], ["Z"]),  # a bias (Add after MatMul)
            helper.make_node("Mul", ["Z", "half"], ["Y"]),  # a constant factor
        ],
        {"scale": ones(3), "W_t": ones((2, 3)), "b": ones(2), "half": 0.5},
    )
    onx.graph.initializer.append(numpy_helper.from_array(np.array([-1, 2], np.int64), "shape"))
    assert parameter_names(onx) == ["W_t", "b"]
    assert list(gk.get_train_initializer(onx)) == ["W_t", "b"]
    roles = explain(onx)
    assert roles["half"].startswith("constant (read by Mul")
    assert roles["b"].startswith("parameter (read by Add")
    assert "shape" not in roles  # integer initializers are never weights


def test_batch_norm_statistics_and_embedding_table_roles():
    onx = _model(
        [
            helper.make_node("Gather", ["table", "ids"], ["E"]),
            helper.make_node("ReduceMean", ["E", "axes"], ["M"], keepdims=0),
            helper.make_node("BatchNormalization", ["M", "g", "beta", "mean", "var"], ["Y"]),
        ],
        {"table": np.ones((5, 2)), "g": np.ones(2), "beta": np.zeros(2), "mean": np.zeros(2)},
        inputs=(),
    )
    onx.graph.input.append(helper.make_tensor_value_info("ids", TensorProto.INT64, [None, 4]))
    onx.graph.initializer.append(numpy_helper.from_array(np.ones(2, np.float32), "var"))
    onx.graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "axes"))
    assert parameter_names(onx) == ["table", "g", "beta"]


def test_no_parameter_is_explained():
    onx = _model(
        [helper.make_node("Mul", ["X", "w"], ["Y"])], {"w": np.ones(3)}, output=("Y", [None, 3])
    )
    with pytest.raises(ValueError, match=r"w: constant \(read by Mul input 1\).*weights_to_train"):
        OrtGradientOptimizer(gk.add_loss_output(onx)).fit(np.ones((4, 3)), np.ones((4, 3)))
    # a constant can still be trained when named
    trainer = OrtGradientOptimizer(gk.add_loss_output(onx), weights_to_train="w", max_iter=2)
    trainer.fit(np.ones((4, 3), np.float32), 2 * np.ones((4, 3), np.float32))
    assert trainer.weights_to_train_ == ["w"]


@pytest.fixture(scope="module")
def binary_mlp():
    from skl2onnx import to_onnx
    from sklearn.datasets import load_breast_cancer
    from sklearn.neural_network import MLPClassifier
    from sklearn.preprocessing import StandardScaler

    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clf = MLPClassifier((8,), max_iter=2, random_state=0).fit(X, y)
    return clf, to_onnx(clf, X[:1], options={"zipmap": False}), X, y


@pytest.mark.parametrize(
    "trainer_class", [OrtGradientOptimizer, OrtGradientForwardBackwardOptimizer]
)
def test_skl2onnx_binary_classifier_keeps_unity_constant(binary_mlp, trainer_class):
    """Before the rule, `unity` was trained: probabilities above 1, a negative log loss."""
    clf, onx, X, y = binary_mlp
    assert "unity" in {i.name for i in onx.graph.initializer}
    assert "unity" not in gk.get_train_initializer(onx)
    settings = dict(max_iter=20, batch_size=16, learning_rate=gk.LearningRateAdam(eta0=0.01))
    if trainer_class is OrtGradientOptimizer:
        trainer = trainer_class(gk.add_loss_output(onx, "log", label_name="y"), **settings)
    else:
        trainer = trainer_class(onx, learning_loss="log", **settings)
    trainer.fit(X, y)
    assert "unity" not in trainer.weights_to_train_
    assert min(trainer.train_losses_) > 0
    # the trained weights in scikit-learn's own model give graphkit's probabilities
    state = trainer.get_state()
    clf.coefs_ = [state["coefficient"], state["coefficient1"]]
    clf.intercepts_ = [state["intercepts"][0], state["intercepts1"][0]]
    np.testing.assert_allclose(trainer.predict_proba(X), clf.predict_proba(X), atol=1e-5)
    assert clf.score(X, y) > 0.95


def _torch_model(kind, dynamo):
    torch = pytest.importorskip("torch")
    from torch import nn

    torch.manual_seed(0)
    if kind == "gelu":
        net = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    else:
        net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    return net.eval(), torch_export(net, np.zeros((2, 4), np.float32), dynamo)


@pytest.mark.parametrize(
    "kind,dynamo", [("gelu", True), ("batchnorm", False)], ids=["dynamo-gelu", "script-batchnorm"]
)
def test_torch_constants_stay_constants(kind, dynamo, tmp_path, rng):
    """dynamo's GELU writes its 0.5 and sqrt(2) as initializers; the TorchScript exporter
    merges a fresh BatchNorm's running_var with its weight (both ones). Training must
    leave both alone: torch, given the trained parameters, computes graphkit's outputs."""
    torch = pytest.importorskip("torch")
    net, onx = _torch_model(kind, dynamo)
    X = rng.normal(size=(200, 4)).astype(np.float32)
    y = (X[:, 0] > 0).astype(np.int64) + (X[:, 1] > 0)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(onx, "cross_entropy"),
        max_iter=5,
        learning_rate=(gk.optimizers.get("adam"), 0.05),
        random_state=0,
    ).fit(X, y)
    expected = {name for name, _ in net.named_parameters()}
    assert set(trainer.weights_to_train_) == expected
    with torch.no_grad():
        for name, value in trainer.get_state().items():
            if name in expected:
                net.get_parameter(name).copy_(torch.from_numpy(value))
        logits = net(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(trainer._predict_outputs(X), logits, rtol=1e-4, atol=1e-5)
    exported = gk.run(trainer.get_trained_onnx(onx), {"X": X})["Y"]
    np.testing.assert_allclose(exported, logits, rtol=1e-4, atol=1e-5)


def test_untie_keeps_tied_parameters_tied():
    """Two parameter roles (a tied embedding and output layer) stay one weight."""
    onx = _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["H"]),
            helper.make_node("Transpose", ["W"], ["Wt"]),
            helper.make_node("MatMul", ["H", "Wt"], ["Y"]),
        ],
        {"W": np.ones((3, 2))},
        output=("Y", [None, 3]),
    )
    assert untie_constants(onx, ["W"]).SerializeToString() == onx.SerializeToString()


def _sliced_weight(bounds: list[tuple[int, int]]) -> onnx.ModelProto:
    """W [6, 3] read in parts by Slices along axis 0, put back together by a Concat
    (torch's export of an LSTM or GRU reorders its gates so), then a product."""
    nodes, parts, inits = [], [], {"W": np.arange(18.0).reshape(6, 3)}
    for k in range(len(bounds)):
        nodes.append(helper.make_node("Slice", ["W", f"s{k}", f"e{k}", "axis"], [f"W{k}"]))
        parts.append(f"W{k}")
    nodes += [
        helper.make_node("Concat", parts, ["Wc"], axis=0),
        helper.make_node("Transpose", ["Wc"], ["Wt"]),
        helper.make_node("MatMul", ["X", "Wt"], ["Y"]),
    ]
    width = sum(end - start for start, end in bounds)
    onx = _model(nodes, inits, output=("Y", [None, width]))
    ints = {"axis": [0]}
    for k, (start, end) in enumerate(bounds):
        ints.update({f"s{k}": [start], f"e{k}": [end]})
    for name, value in ints.items():
        onx.graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
    return onx


def test_the_parts_of_one_weight_stay_one_weight():
    """Disjoint Slices of a weight are its parts: untying them would train each in a
    copy, and the weight's own name would keep one part trained."""
    onx = _sliced_weight([(2, 4), (0, 2), (4, 6)])
    untied, weights = untie_shared_parameters(onx, ["W"])
    assert weights == ["W"]
    assert untied.SerializeToString() == onx.SerializeToString()


def test_overlapping_slices_and_merged_copies_are_untied():
    """Slices that overlap read one value twice (nothing says it is one parameter), and
    two products of an exporter's merged initializer are two parameters: untied."""
    _, weights = untie_shared_parameters(_sliced_weight([(0, 4), (2, 6)]), ["W"])
    assert weights == ["W", "W.1"]
    merged = _model(
        [
            helper.make_node("MatMul", ["X", "W"], ["H"]),
            helper.make_node("MatMul", ["H", "W"], ["Y"]),
        ],
        {"W": np.ones((3, 3))},
        output=("Y", [None, 3]),
    )
    assert untie_shared_parameters(merged, ["W"])[1] == ["W", "W.1"]


def test_negative_log_loss_stops_training_and_restores_the_weights(binary_mlp):
    """Training the constant on purpose: the loss goes below zero, a clear error, the
    weights of the last good epoch."""
    _, onx, X, y = binary_mlp
    train = gk.add_loss_output(onx, "log", label_name="y")
    trainer = OrtGradientOptimizer(
        train,
        weights_to_train=["unity", "coefficient1"],
        max_iter=50,
        batch_size=569,
        learning_rate=(gk.optimizers.get("sgd"), 5.0),
        random_state=0,
    )
    with pytest.raises(gk.ConvergenceError, match="below zero.*probabilities outside"):
        trainer.fit(X, y)
    good_epochs = len(trainer.train_losses_)
    assert good_epochs and min(trainer.train_losses_) >= 0
    # the state is exactly that of a run stopped after the last good epoch
    stopped = OrtGradientOptimizer(**{**trainer.get_params(), "max_iter": good_epochs}).fit(X, y)
    for name, value in stopped.get_state().items():
        np.testing.assert_array_equal(trainer.get_state()[name], value)


def test_log_loss_refuses_outputs_that_are_not_probabilities(rng):
    from conftest import linear_regression_onnx

    onx = linear_regression_onnx(
        rng.normal(size=(3, 2)).astype(np.float32), np.zeros(2, np.float32)
    )
    with pytest.raises(ValueError, match="takes probabilities.*'cross_entropy'"):
        OrtGradientOptimizer(gk.add_loss_output(onx, "log")).fit(
            rng.normal(size=(10, 3)).astype(np.float32), np.zeros(10, np.int64)
        )


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_a_scalar_weight_named_explicitly_trains(kind, rng):
    """A 0-d initializer used to reach the update graph as shape (1,) in forward/backward
    mode (a raw onnxruntime rank error). One full-batch SGD step against numpy."""
    onx = _model(
        [helper.make_node("MatMul", ["X", "W"], ["H"]), helper.make_node("Mul", ["H", "s"], ["Y"])],
        {"W": np.full((3, 1), 0.3), "s": np.array(0.5)},
        output=("Y", [None, 1]),
    )
    X = rng.normal(size=(40, 3)).astype(np.float32)
    y = X.sum(axis=1).astype(np.float32)
    settings = dict(
        weights_to_train=["W", "s"],
        max_iter=1,
        batch_size=40,
        shuffle=False,
        learning_rate=gk.LearningRateSGD(eta0=0.1, learning_rate="constant"),
    )
    if kind == "full":
        trainer = OrtGradientOptimizer(gk.add_loss_output(onx), **settings)
    else:
        trainer = OrtGradientForwardBackwardOptimizer(onx, **settings)
    state = trainer.fit(X, y).get_state()
    h = X.astype(np.float64) @ np.full(3, 0.3)
    residual = 0.5 * h - y  # loss = mean (s X W - y)^2
    grad_s = 2 * np.mean(residual * h)
    grad_w = 2 * X.T.astype(np.float64) @ residual * 0.5 / len(X)
    assert state["s"].shape == ()
    np.testing.assert_allclose(state["s"], 0.5 - 0.1 * grad_s, rtol=1e-5)
    np.testing.assert_allclose(state["W"][:, 0], 0.3 - 0.1 * grad_w, rtol=1e-5)


def _torch_sgd(net, X: np.ndarray, y: np.ndarray, epochs: int = 2, batch: int = 8) -> None:
    """torch's SGD (lr 0.01, cross entropy) over the rows in order: the reference that
    graphkit's ``Trainer(optimizer="sgd", shuffle=False)`` must match."""
    import torch

    sgd = torch.optim.SGD(net.parameters(), lr=0.01)
    for _ in range(epochs):
        for start in range(0, len(X), batch):
            sgd.zero_grad()
            logits = net(torch.from_numpy(X[start : start + batch]))
            torch.nn.functional.cross_entropy(
                logits, torch.from_numpy(y[start : start + batch])
            ).backward()
            sgd.step()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_group_norm_trains_its_weight_and_bias_like_torch(dynamo):
    """Both exporters write nn.GroupNorm as InstanceNormalization over the groups (its
    scale and bias fixed ones and zeros), then Mul and Add by GroupNorm's weight and
    bias: those two are the parameters, the group statistics' ones and zeros are not."""
    torch = pytest.importorskip("torch")
    from graphkit_train import Trainer
    from tests.zoo.models import torch_export

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3), torch.nn.GroupNorm(2, 4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(64, 3),
    )  # fmt: skip
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(24, 1, 6, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=24)
    onx = torch_export(net, X, dynamo)
    initial = [p.detach().numpy().copy() for p in net.parameters()]
    roles = gk.parameters.explain(onx)
    trained = gk.get_train_initializer(onx)
    assert len(trained) == len(list(net.parameters())), (sorted(trained), roles)
    # onnxruntime-training has no gradient for InstanceNormalization: the native backend
    settings = dict(optimizer="sgd", max_iter=2, batch_size=8, shuffle=False, backend="native")
    fitted = Trainer(onx, loss="cross_entropy", **settings).fit(X, y)
    _torch_sgd(net, X, y)
    # each exported weight is the torch parameter it started equal to
    state = fitted.get_state()
    for name, start in trained.items():
        match = [
            i
            for i, p in enumerate(initial)
            if p.size == start.size and np.allclose(p.ravel(), start.ravel())
        ]
        assert len(match) == 1, (name, match)
        trained_torch = list(net.parameters())[match[0]].detach().numpy()
        np.testing.assert_allclose(
            state[name], trained_torch.reshape(start.shape), rtol=1e-4, atol=1e-5, err_msg=name
        )


@pytest.mark.parametrize("fold", [False, True], ids=["no-folding", "folding"])
def test_lstm_and_learned_positions_train_like_torch(fold):
    """torch's TorchScript exporter without constant folding (the README's recipe for a
    BatchNorm) reorders an LSTM's gate weights with Slice and Concat before the LSTM
    reads them, and a transformer-style learned position is added to a projection plus
    its bias: the default rule must call all of them parameters (it called them
    constants, and the LSTM trained only its head), and training must match torch's."""
    torch = pytest.importorskip("torch")
    from graphkit_train import Trainer

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)
            self.pos = torch.nn.Parameter(torch.randn(1, 5, 4) * 0.1)
            self.lstm = torch.nn.LSTM(4, 6, batch_first=True)
            self.head = torch.nn.Linear(6, 3)

        def forward(self, x):
            out, _ = self.lstm(self.proj(x) + self.pos)
            return self.head(out[:, -1])

    torch.manual_seed(0)
    net = Net()
    rng = np.random.default_rng(0)
    X = rng.normal(size=(24, 5, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=24)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net, (torch.from_numpy(X[:2]),), buffer, input_names=["X"], output_names=["Y"],
            dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}}, do_constant_folding=fold,
            dynamo=False,
        )  # fmt: skip
    onx = onnx.load_from_string(buffer.getvalue())
    initial = [p.detach().numpy().copy() for p in net.parameters()]
    trained = gk.get_train_initializer(onx)
    roles = gk.parameters.explain(onx)
    assert len(trained) == len(initial) - fold, roles  # folding merges the LSTM's biases
    settings = dict(optimizer="sgd", max_iter=2, batch_size=8, shuffle=False, backend="native")
    fitted = Trainer(onx, loss="cross_entropy", **settings).fit(X, y)
    _torch_sgd(net, X, y)
    with torch.no_grad():
        expected = net(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(fitted._predict_outputs(X), expected, rtol=1e-4, atol=1e-5)
