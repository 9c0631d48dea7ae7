"""OnnxModule's autograd contract against torch's own: gradients of the layer compared with
torch autograd on the torch module it was exported from, and the errors torch raises for a
second backward, a second derivative and an input modified in place."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import HAS_TORCH, INSTALLED_BACKENDS, export_torch

if not HAS_TORCH:
    pytest.skip("torch is not installed", allow_module_level=True)

import torch

from graphkit_train.torch_module import OnnxModule


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A float64 torch MLP and its ONNX export."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)
    ).double()
    return net, export_torch(net, tmp_path_factory.mktemp("tm") / "net.onnx", 3, torch.float64)


@pytest.fixture(scope="module", params=INSTALLED_BACKENDS)
def layer_and_twin(request, exported):
    """The ONNX layer on each installed backend, and the torch module it came from."""
    net, onx = exported
    return OnnxModule(onx, backend=request.param), net


def zero_grads(*modules: torch.nn.Module) -> None:
    for module in modules:
        for parameter in module.parameters():
            parameter.grad = None


def assert_grads_match(layer: OnnxModule, twin: torch.nn.Module, scale: float = 1.0) -> None:
    """Each parameter gradient of ``layer`` equals ``scale`` times its twin's."""
    twins = dict(twin.named_parameters())
    for attribute, name in layer.parameter_names.items():
        np.testing.assert_allclose(
            getattr(layer, attribute).grad.numpy(),
            scale * twins[name].grad.numpy(),
            rtol=1e-10,
            atol=1e-12,
            err_msg=name,
        )


def test_gradients_match_torch_autograd(layer_and_twin):
    layer, twin = layer_and_twin
    zero_grads(layer, twin)
    X = torch.randn(7, 3, dtype=torch.float64)
    dY = torch.randn(7, 2, dtype=torch.float64)
    x_layer, x_twin = X.clone().requires_grad_(), X.clone().requires_grad_()
    out = layer(x_layer)
    expected = twin(x_twin)
    np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), rtol=1e-12)
    out.backward(dY)
    expected.backward(dY)
    np.testing.assert_allclose(x_layer.grad.numpy(), x_twin.grad.numpy(), rtol=1e-10, atol=1e-12)
    assert_grads_match(layer, twin)


def test_each_batch_size_runs_graphs_of_its_own_up_to_a_bound(exported):
    """The first SPECIALIZED_SIZES batch sizes get graphs specialized to them, the others
    the graphs of any size: every size's outputs and gradients equal torch's."""
    from graphkit_train.torch_module import SPECIALIZED_SIZES

    net, onx = exported
    layer = OnnxModule(onx)
    for rows in range(1, SPECIALIZED_SIZES + 3):
        zero_grads(layer, net)
        X = torch.randn(rows, 3, dtype=torch.float64)
        dY = torch.randn(rows, 2, dtype=torch.float64)
        out, expected = layer(X), net(X)
        np.testing.assert_allclose(out.detach().numpy(), expected.detach().numpy(), rtol=1e-12)
        out.backward(dY)
        expected.backward(dY)
        assert_grads_match(layer, net)
    assert layer._specialized == set(range(1, SPECIALIZED_SIZES + 1))


def test_retain_graph_second_backward_accumulates_again(layer_and_twin):
    layer, twin = layer_and_twin
    zero_grads(layer, twin)
    X = torch.randn(6, 3, dtype=torch.float64)
    dY = torch.randn(6, 2, dtype=torch.float64)
    x_layer, x_twin = X.clone().requires_grad_(), X.clone().requires_grad_()
    out = layer(x_layer)
    out.backward(dY, retain_graph=True)
    twin(x_twin).backward(dY)
    assert_grads_match(layer, twin)
    out.backward(dY)  # torch semantics: the same gradients accumulate a second time
    assert_grads_match(layer, twin, scale=2.0)
    np.testing.assert_allclose(
        x_layer.grad.numpy(), 2 * x_twin.grad.numpy(), rtol=1e-10, atol=1e-12
    )


def test_second_backward_without_retain_graph_raises(layer_and_twin):
    layer, _ = layer_and_twin
    out = layer(torch.randn(4, 3, dtype=torch.float64))
    dY = torch.ones(4, 2, dtype=torch.float64)
    out.backward(dY)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward(dY)


@pytest.mark.parametrize("before", [torch.tanh, torch.nn.Identity()], ids=["tanh", "none"])
def test_double_backward_raises_and_first_order_matches(layer_and_twin, before):
    layer, twin = layer_and_twin
    zero_grads(layer, twin)
    X = torch.randn(5, 3, dtype=torch.float64)
    grads = []
    for model in (layer, twin):
        x = X.clone().requires_grad_()
        # with a torch op before the layer, the first derivative requires grad through it
        # alone: a layer whose second derivative vanished would go unnoticed
        (gx,) = torch.autograd.grad(model(before(x)).pow(2).sum(), x, create_graph=True)
        grads.append((x, gx))
    (x, gx), (x_twin, gx_twin) = grads
    np.testing.assert_allclose(
        gx.detach().numpy(), gx_twin.detach().numpy(), rtol=1e-10, atol=1e-12
    )
    assert torch.autograd.grad(gx_twin.sum(), x_twin)[0].abs().sum() > 0
    with pytest.raises(RuntimeError, match="OnnxModule has no second derivative"):
        torch.autograd.grad(gx.sum(), x, retain_graph=True)
    with pytest.raises(RuntimeError, match="OnnxModule has no second derivative"):
        gx.sum().backward()
    # first order with create_graph=True: the weight gradients still match torch's
    names = list(layer.parameter_names.values())
    weights = [getattr(layer, a) for a in layer.parameter_names]
    got = torch.autograd.grad(layer(before(X)).pow(2).sum(), weights, create_graph=True)
    twins = dict(twin.named_parameters())
    expected = torch.autograd.grad(twin(before(X)).pow(2).sum(), [twins[n] for n in names])
    for name, a, b in zip(names, got, expected):
        np.testing.assert_allclose(
            a.detach().numpy(), b.numpy(), rtol=1e-10, atol=1e-12, err_msg=name
        )


def test_input_modified_in_place_raises(layer_and_twin):
    layer, _ = layer_and_twin
    x = torch.randn(4, 3, dtype=torch.float64)
    out = layer(x)  # the weight gradients read x
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_weight_modified_in_place_raises(layer_and_twin):
    layer, _ = layer_and_twin
    out = layer(torch.randn(4, 3, dtype=torch.float64, requires_grad=True))
    weight = next(iter(layer.parameters()))
    saved = weight.detach().clone()
    with torch.no_grad():  # what an optimizer step between forward and backward does
        weight.mul_(2)
    try:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    finally:
        with torch.no_grad():
            weight.copy_(saved)
