"""Normalization scales written as a ``Mul`` after the normalization's arithmetic are
trained, as torch trains them.

torch's ``nn.RMSNorm`` exported by dynamo, and the RMSNorms of Llama and T5 (written
by hand in their modelling code) by both exporters, become ``x * rsqrt(mean(x^2) +
eps)`` then a ``Mul`` by the scale: no normalization operator the rule of
:mod:`graphkit.parameters` could see. The scale must be a parameter (else it is never
trained), the TorchScript exporter's merge of two fresh scales (both ones) must be
untied, and a scalar factor after the same arithmetic must stay a constant.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import requires_torch
from onnx import TensorProto, helper, numpy_helper

from graphkit.parameters import explain

pytestmark = requires_torch


def _modules():
    import torch

    class LlamaRMSNorm(torch.nn.Module):
        """transformers' LlamaRMSNorm (and T5LayerNorm): the statistics in float32,
        the scale multiplied after the cast back."""

        def __init__(self, size: int, eps: float = 1e-6) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(size))
            self.eps = eps

        def forward(self, x):
            dtype = x.dtype
            x = x.to(torch.float32)
            variance = x.pow(2).mean(-1, keepdim=True)
            x = x * torch.rsqrt(variance + self.eps)
            return self.weight * x.to(dtype)

    return torch, LlamaRMSNorm


def network(kind: str):
    """Linear, RMSNorm, Linear, RMSNorm, Linear: two norms of one size with fresh (ones)
    scales, which the TorchScript exporter merges into one tensor."""
    torch, LlamaRMSNorm = _modules()
    torch.manual_seed(0)
    norm = torch.nn.RMSNorm if kind == "torch" else LlamaRMSNorm
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        norm(8),
        torch.nn.Linear(8, 8),
        norm(8),
        torch.nn.Linear(8, 1),
    )


def torch_sgd(net, X, y, epochs: int, batch: int, lr: float) -> dict[str, np.ndarray]:
    import torch

    sgd = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(X), batch):
            sgd.zero_grad()
            out = net(torch.from_numpy(X[start : start + batch]))
            target = torch.from_numpy(y[start : start + batch])
            torch.nn.functional.mse_loss(out, target).backward()
            sgd.step()
    return {name: p.detach().numpy() for name, p in net.named_parameters()}


CASES = [("torch", True), ("llama", True), ("llama", False)]
"""(norm, dynamo): torch's TorchScript exporter has no rms_norm at opset 18."""


@pytest.mark.parametrize(
    "kind,dynamo", CASES, ids=["nn.RMSNorm-dynamo", "llama-dynamo", "llama-torchscript"]
)
@pytest.mark.parametrize("trainer_kind", ["full", "forward_backward"])
def test_rms_norm_scales_train_like_torch(kind, dynamo, trainer_kind):
    from zoo.models import torch_export

    from graphkit_train import ForwardBackwardTrainer, Trainer

    rng = np.random.default_rng(0)
    X = rng.normal(size=(32, 4)).astype(np.float32)
    y = (X @ np.array([[1.0], [-1.0], [0.5], [2.0]], np.float32)).astype(np.float32)
    onx = torch_export(network(kind), X, dynamo)
    roles = explain(onx)
    scales = [name for name, role in roles.items() if "Mul" in role and "Gemm" not in role]
    assert scales and all(roles[s].startswith("parameter") for s in scales), roles

    settings = dict(max_iter=3, batch_size=8, shuffle=False, optimizer="sgd", schedule=0.05)
    if trainer_kind == "full":
        trainer = Trainer(onx, loss="squared_error", **settings)
    else:
        trainer = ForwardBackwardTrainer(onx, loss="squared_error", **settings)
    state = trainer.fit(X, y).get_state()
    expected = torch_sgd(network(kind), X, y, 3, 8, 0.05)
    # both exporters write the two fresh scales (ones) as one tensor: the second norm
    # (torch's "3.weight") reads its own copy, trained apart
    assert sorted(trainer.weights_to_train_) == sorted(
        n.replace("3.weight", "1.weight.1") for n in expected
    )
    for torch_name, value in expected.items():
        name = torch_name.replace("3.weight", "1.weight.1")
        np.testing.assert_allclose(state[name], value, rtol=1e-4, atol=1e-6, err_msg=torch_name)
    # the scales moved away from ones, as torch's did, and apart from each other
    assert not np.allclose(expected["1.weight"], 1.0)
    assert not np.allclose(expected["1.weight"], expected["3.weight"])


def _scaled_rms(scale: np.ndarray) -> onnx.ModelProto:
    """Y = (X * rsqrt(mean(X^2) + eps)) * scale, built by hand."""
    nodes = [
        helper.make_node("Mul", ["X", "X"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["ms"], keepdims=1),
        helper.make_node("Add", ["ms", "eps"], ["var"]),
        helper.make_node("Sqrt", ["var"], ["rms"]),
        helper.make_node("Div", ["X", "rms"], ["normed"]),
        helper.make_node("Mul", ["normed", "scale"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "scaled_rms",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 3])],
        [
            numpy_helper.from_array(np.array([-1], np.int64), "axes"),
            numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
            numpy_helper.from_array(scale.astype(np.float32), "scale"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_scale_after_the_arithmetic_is_a_parameter_a_scalar_factor_is_not():
    roles = explain(_scaled_rms(np.array([1.0, 2.0, 3.0])))
    assert roles["scale"].startswith("parameter")
    assert roles["eps"].startswith("constant")
    # a single fixed factor after the same arithmetic (sqrt(d), say) stays a constant
    assert explain(_scaled_rms(np.array(1.7)))["scale"].startswith("constant")


def test_a_product_without_the_mean_of_its_input_is_no_normalization():
    """x * rsqrt(mean(z^2)) with z another tensor: the Mul's operand is not a scale."""
    model = _scaled_rms(np.array([1.0, 2.0, 3.0]))
    model.graph.input.append(helper.make_tensor_value_info("Z", TensorProto.FLOAT, ["N", 3]))
    model.graph.node[0].input[:] = ["Z", "Z"]
    assert explain(model)["scale"].startswith("constant")
