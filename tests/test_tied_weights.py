"""Initializers an exporter merged are trained apart, as torch trains them.

torch's TorchScript exporter merges initializers of equal value: the weights (ones) and
biases (zeros) of two fresh LayerNorms become one tensor each, read by both layers.
graphkit gives each parameter slot its own copy by default, so that training follows
torch; ``untie_shared_weights=False`` keeps weights tied on purpose.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from zoo.models import torch_export

import graphkit as gk

torch = pytest.importorskip("torch")


def _network():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.LayerNorm(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 1),
    )


def _torchscript_export(net) -> onnx.ModelProto:
    return torch_export(net, np.zeros((2, 4), np.float32), dynamo=False)


def _torch_sgd(net, X, y, epochs, batch_size, lr):
    sgd = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(X), batch_size):
            sgd.zero_grad()
            out = net(torch.from_numpy(X[start : start + batch_size]))
            target = torch.from_numpy(y[start : start + batch_size]).reshape(-1, 1)
            ((out - target) ** 2).sum(1).mean().backward()  # graphkit's squared error
            sgd.step()
    return {name: p.detach().numpy() for name, p in net.named_parameters()}


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(32, 4)).astype(np.float32)
    y = (X @ np.array([1.0, -1.0, 0.5, 2.0], np.float32)).astype(np.float32)
    onx = _torchscript_export(_network())
    # "4.weight" = Identity("1.weight"): one tensor read by both LayerNorms
    reads = sum(list(n.input).count("1.weight") for n in onx.graph.node)
    assert reads == 2, "the exporter no longer merges them: use another case"
    return onx, X, y


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_merged_layer_norm_weights_train_apart_like_torch(problem, kind):
    from graphkit_train import ForwardBackwardTrainer, Trainer

    onx, X, y = problem
    settings = dict(max_iter=3, batch_size=8, shuffle=False, optimizer="sgd")
    if kind == "full":
        trainer = Trainer(onx, loss="mse", **settings)
    else:
        trainer = ForwardBackwardTrainer(onx, **settings)
    state = trainer.fit(X, y).get_state()
    expected = _torch_sgd(_network(), X, y, 3, 8, 0.01)
    # the second LayerNorm (torch's "4.") reads the copies of the first one's tensors
    assert {"1.weight.1", "1.bias.1"} <= set(trainer.weights_to_train_)
    pairs = {"1.weight": "1.weight", "1.bias": "1.bias", "4.weight": "1.weight.1"}
    pairs.update({"4.bias": "1.bias.1", "0.weight": "0.weight", "5.bias": "5.bias"})
    for torch_name, name in pairs.items():
        np.testing.assert_allclose(
            state[name], expected[torch_name], rtol=1e-4, atol=1e-6, err_msg=torch_name
        )
    assert not np.allclose(state["1.weight"], state["1.weight.1"])
    # the trained model holds both, and predicts like the trained torch network
    trained = trainer.get_trained_onnx()
    onnx.checker.check_model(trained, full_check=True)
    net = _network()
    _torch_sgd(net, X, y, 3, 8, 0.01)
    with torch.no_grad():
        reference = net.eval()(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(gk.run(trained, {"X": X})["Y"], reference, rtol=1e-4, atol=1e-5)


def test_weights_tied_on_purpose_stay_tied(problem):
    from graphkit_train import Trainer

    onx, X, y = problem
    trainer = Trainer(onx, loss="mse", max_iter=1, untie_shared_weights=False).fit(X, y)
    assert "1.weight.1" not in trainer.weights_to_train_
    trained = trainer.get_trained_onnx()
    assert sum(list(n.input).count("1.weight") for n in trained.graph.node) == 2
