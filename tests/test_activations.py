"""The activations onnxruntime-training 1.19.2 cannot differentiate (Elu, Selu, PRelu,
HardSigmoid, HardSwish, Softplus, Mish), written in standard operators
(graphkit/backends/activations.py): the ort_training backend rewrites them for its
builders, the native backend in float64 graphs on an onnxruntime without their float64
kernels.

The references are never the rewrite: the forward is onnxruntime's own kernel for the
original node, the gradient is torch's autograd (kinks included) through every installed
backend, and MLPs with each activation, exported by torch, train on the default backend to
the weights torch's SGD reaches."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from conftest import (
    HAS_TORCH,
    INSTALLED_BACKENDS,
    export_torch,
    requires_ort_training,
    requires_torch,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit.backends.activations import ACTIVATIONS, activations_as_standard_ops
from graphkit.engine.ort_engine import inference_session
from graphkit_train import ForwardBackwardTrainer, Trainer

if HAS_TORCH:  # the reference of the gradients and of training; the forwards need none
    import torch

    F = torch.nn.functional

ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float64): TensorProto.DOUBLE}
DTYPES = [np.float32, np.float64]
OPS = ["Elu", "Selu", "PRelu", "HardSigmoid", "HardSwish", "Softplus", "Mish"]

# kinks (0, +-3 for the hard ones, +-2.5 for HardSigmoid's defaults, -3 and 1 for its
# alpha=0.25, beta=0.75), tiny values on both sides, large magnitudes
SPECIAL = [0.0, -0.0, 1e-3, -1e-3, 1.0, -1.0, 2.5, -2.5, 3.0, -3.0, 30.0, -30.0, 0.5, -7.0]

# attributes as ONNX stores them (float32), a non-default set for each operator with some
NON_DEFAULT = {
    "Elu": {"alpha": 0.25},
    "Selu": {"alpha": 1.5, "gamma": 0.75},
    "HardSigmoid": {"alpha": 0.25, "beta": 0.75},
}
DEFAULTS = {
    "Elu": {"alpha": 1.0},
    "Selu": {"alpha": 1.67326319217681884765625, "gamma": 1.05070102214813232421875},
    "HardSigmoid": {"alpha": float(np.float32(0.2)), "beta": 0.5},
}


def torch_activation(op_type, x, attrs, slope=None):
    """The activation in torch, whose autograd is the gradient reference."""
    a = {**DEFAULTS.get(op_type, {}), **attrs}
    if op_type == "Elu":
        return F.elu(x, a["alpha"])
    if op_type == "Selu":
        if not attrs:
            return F.selu(x)
        return a["gamma"] * F.elu(x, a["alpha"])
    if op_type == "PRelu":
        return F.prelu(x, slope)
    if op_type == "HardSigmoid":  # torch's is max(0, min(1, u/6 + 1/2)): u = 6 z - 3
        return F.hardsigmoid(6 * (a["alpha"] * x + a["beta"]) - 3)
    if op_type == "HardSwish":
        return F.hardswish(x)
    if op_type == "Softplus":
        return F.softplus(x)
    return F.mish(x)


def make_model(op_type, dtype, attrs, x_shape, slope=None, matmul=None, summed=True):
    """Y = op(X), or op(X @ W) when ``matmul`` is W (then summed into Y_sum unless not
    ``summed``), opset 18."""
    elem = ELEM[np.dtype(dtype)]
    inits, nodes, h = [], [], "X"
    if matmul is not None:
        inits.append(numpy_helper.from_array(matmul.astype(dtype), "W"))
        nodes.append(helper.make_node("MatMul", ["X", "W"], ["H"]))
        h = "H"
    inputs = [h]
    if op_type == "PRelu":
        inits.append(numpy_helper.from_array(np.asarray(slope, dtype), "slope"))
        inputs.append("slope")
    nodes.append(helper.make_node(op_type, inputs, ["Y"], name="act", **attrs))
    outputs = [helper.make_tensor_value_info("Y", elem, x_shape)]
    if matmul is not None and summed:
        nodes.append(helper.make_node("ReduceSum", ["Y"], ["Y_sum"], keepdims=0))
        outputs = [helper.make_tensor_value_info("Y_sum", elem, [])]
    graph = helper.make_graph(
        nodes, op_type, [helper.make_tensor_value_info("X", elem, x_shape)], outputs, inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def rewritten(model):
    """What training runs: the activations written in standard operators."""
    out = activations_as_standard_ops(model)
    left = [n.op_type for n in out.graph.node if n.op_type in ACTIVATIONS]
    assert not left, left
    onnx.checker.check_model(out, full_check=True)
    return out


def run(model, x):
    return inference_session(model).run(None, {"X": x})[0]


def tolerance(dtype):
    """A few ulps. The absolute part is for onnxruntime's float64 Softplus and Mish
    kernels, which compute log(1 + exp(x)) and so are off by up to an ulp of 1 (times
    |x| for Mish) where the value is tiny; the rewrite keeps those values' relative
    precision (test_softplus_keeps_small_values_against_torch)."""
    if np.dtype(dtype) == np.float32:
        return {"rtol": 1e-6, "atol": 1e-12}
    return {"rtol": 1e-12, "atol": 1e-14}


def test_the_table_is_the_issue():
    """The seven operators the builders refused, each with its replacement."""
    assert sorted(ACTIVATIONS) == sorted(OPS)


@requires_ort_training
@pytest.mark.parametrize("op_type", OPS)
def test_builders_refuse_the_originals_and_differentiate_the_rewrites(op_type):
    """onnxruntime-training's two builders: GradientGraphBuilder (gradient_model) and
    OrtModuleGraphBuilder (forward/backward training); the backend applies the rewrites
    itself, the raw builder refuses the original operator."""
    from graphkit.backends.ort_training import builders

    w = np.eye(3, dtype=np.float32)
    model = make_model(op_type, np.float32, {}, ["N", 3], np.float32(0.25), matmul=w)
    with pytest.raises(gk.MissingGradientError, match=f"'{op_type}'"):
        builders.gradient_graph(model, "Y_sum", ["W"])
    grad = gk.gradient_model(model, "Y_sum", ["W"], backend="ort_training")
    assert "W_grad" in [o.name for o in grad.graph.output]
    grad = gk.gradient_model(rewritten(model), "Y_sum", ["W"], backend="ort_training")
    assert "W_grad" in [o.name for o in grad.graph.output]
    prediction = make_model(op_type, np.float32, {}, ["N", 3], 0.25, matmul=w, summed=False)
    X = np.linspace(-3, 3, 24, dtype=np.float32).reshape(8, 3)
    trainer = ForwardBackwardTrainer(
        prediction, ["W"], max_iter=1, batch_size=4, shuffle=False, backend="ort_training"
    )
    trainer.fit(X, np.zeros((8, 3), np.float32))
    assert not np.array_equal(trainer.get_state()["W"], w)


# -- forward: onnxruntime's kernel for the original node -----------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op_type", OPS)
def test_forward_at_kinks_and_extremes(op_type, dtype):
    x = np.array(SPECIAL + [-40.0, 40.0, 88.0, -88.0], dtype).reshape(2, 9)
    slope = np.linspace(-0.5, 1.5, 9).astype(dtype)
    for attrs in ({}, NON_DEFAULT.get(op_type, {})):
        model = make_model(op_type, dtype, attrs, [2, 9], slope)
        got, expected = run(rewritten(model), x), run(model, x)
        assert got.dtype == dtype
        np.testing.assert_allclose(got, expected, **tolerance(dtype))


def shapes_and_slopes():
    """A shape of rank 1-4 and a shape unidirectionally broadcastable to it."""

    def slope_shape(shape):
        return st.integers(0, len(shape)).flatmap(
            lambda k: st.tuples(*[st.sampled_from([d, 1]) for d in shape[len(shape) - k :]])
        )

    return hnp.array_shapes(min_dims=1, max_dims=4, max_side=4).flatmap(
        lambda shape: st.tuples(st.just(shape), slope_shape(shape))
    )


ATTRIBUTES = {
    "Elu": st.fixed_dictionaries({"alpha": st.floats(0.01, 4.0)}),
    "Selu": st.fixed_dictionaries({"alpha": st.floats(0.01, 4.0), "gamma": st.floats(0.01, 4.0)}),
    "HardSigmoid": st.fixed_dictionaries(
        {"alpha": st.floats(-3.0, 3.0), "beta": st.floats(-2.0, 2.0)}
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op_type", OPS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_forward_matches_onnxruntime_kernel(op_type, dtype, data):
    shape, slope_shape = data.draw(shapes_and_slopes())
    attrs = data.draw(ATTRIBUTES.get(op_type, st.just({})))
    attrs = {k: float(np.float32(v)) for k, v in attrs.items()}
    width = 32 if dtype == np.float32 else 64
    values = st.one_of(st.sampled_from(SPECIAL), st.floats(-40, 40, width=width))
    x = data.draw(hnp.arrays(dtype, shape, elements=values))
    slope = data.draw(hnp.arrays(dtype, slope_shape, elements=st.floats(-3, 3, width=width)))
    model = make_model(op_type, dtype, attrs, list(shape), slope)
    np.testing.assert_allclose(run(rewritten(model), x), run(model, x), **tolerance(dtype))


@requires_torch
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op_type", ["Softplus", "Mish"])
def test_softplus_keeps_small_values_against_torch(op_type, dtype):
    """log(1 + u) for small u = exp(-|x|) is corrected for the rounding of 1 + u: the
    tiny values of softplus(x << 0) keep their relative precision (torch's log1p, in
    float64, is the reference; float32 down to -80, where exp(x) is still normal)."""
    low = -80.0 if dtype == np.float32 else -700.0
    x = np.concatenate([np.linspace(low, -1, 200), np.linspace(-1, 1, 41)]).astype(dtype)
    model = make_model(op_type, dtype, {}, [len(x)])
    expected = torch_activation(op_type, torch.tensor(x, dtype=torch.float64), {}).numpy()
    rtol = 4e-7 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(run(rewritten(model), x), expected, rtol=rtol, atol=0)


# -- gradient: torch's autograd --------------------------------------------------------------


@requires_torch
@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "op_type, attrs",
    [(op, {}) for op in OPS] + [(op, attrs) for op, attrs in NON_DEFAULT.items()],
    ids=[*OPS, *(f"{op}-attributes" for op in NON_DEFAULT)],
)
def test_gradient_matches_torch_autograd(op_type, attrs, dtype, backend):
    """d sum(op(X @ W)) / d X, W (and PRelu's slope) of the rewrite, from each backend's
    gradient source: W is the identity, so X @ W is X exactly and the kinks of SPECIAL
    are hit, then a random W."""
    rng = np.random.default_rng(0)
    x = np.array(SPECIAL, dtype).reshape(-1, 1) * np.ones((1, 3), dtype)
    x[:, 1] *= -1
    x = np.concatenate([x, rng.normal(scale=3, size=(6, 3)).astype(dtype)])
    slope = np.array([0.25, -0.5, 2.0], dtype)
    for w in (np.eye(3), rng.normal(size=(3, 3))):
        model = make_model(op_type, dtype, attrs, ["N", 3], slope, matmul=w.astype(dtype))
        wrt = ["X", "W"] + (["slope"] if op_type == "PRelu" else [])
        grad = gk.gradient_model(rewritten(model), "Y_sum", wrt, backend=backend)
        names = [f"{n}_grad" for n in wrt]
        got = dict(zip(names, inference_session(grad).run(names, {"X": x}), strict=True))

        tx, tw = (
            torch.tensor(x, requires_grad=True),
            torch.tensor(w.astype(dtype), requires_grad=True),
        )
        tslope = torch.tensor(slope, requires_grad=True)
        torch_activation(op_type, tx @ tw, attrs, tslope).sum().backward()
        expected = {"X_grad": tx.grad, "W_grad": tw.grad, "slope_grad": tslope.grad}
        for name in names:
            assert got[name].dtype == dtype
            if dtype == np.float64:
                np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=0)
            else:
                np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-5)


# -- end to end: torch-exported MLPs train as torch trains them ------------------------------


TORCH_ACTIVATIONS = {
    "Elu": lambda: torch.nn.ELU(alpha=0.5),
    "Selu": lambda: torch.nn.SELU(),
    "PRelu": lambda: torch.nn.PReLU(6, init=0.2),
    "HardSigmoid": lambda: torch.nn.Hardsigmoid(),
    "HardSwish": lambda: torch.nn.Hardswish(),
    "Softplus": lambda: torch.nn.Softplus(),
    "Mish": lambda: torch.nn.Mish(),
}


def export(net, path, dynamo):
    if not dynamo:
        return export_torch(net, path, 3, torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            net,
            (torch.zeros(4, 3, dtype=torch.float64),),
            input_names=["X"],
            output_names=["Y"],
            dynamic_shapes=({0: torch.export.Dim("N")},),
            dynamo=True,
            verbose=False,
        )
    return program.model_proto


@requires_torch
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("op_type", OPS)
def test_mlp_trains_like_torch_sgd(op_type, dynamo, tmp_path):
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(3, 6), TORCH_ACTIVATIONS[op_type](), torch.nn.Linear(6, 1)
    ).double()
    rng = np.random.default_rng(0)
    X = rng.normal(scale=3, size=(32, 3))
    y = np.sin(X).sum(axis=1, keepdims=True) * 2
    model = export(net, tmp_path / "net.onnx", dynamo)
    # (TorchScript writes Mish as Softplus, Tanh and Mul)
    assert {n.op_type for n in model.graph.node} & set(ACTIVATIONS)

    trainer = Trainer(
        model, loss="mse", optimizer="sgd", max_iter=3, shuffle=False, batch_size=8
    ).fit(X, y)

    theirs = torch.optim.SGD(net.parameters(), lr=0.01)
    Xt, yt = torch.tensor(X), torch.tensor(y)
    for _ in range(3):
        for start in range(0, len(X), 8):
            theirs.zero_grad()
            F.mse_loss(net(Xt[start : start + 8]), yt[start : start + 8]).backward()
            theirs.step()

    state, initial = trainer.get_state(), gk.get_train_initializer(model)
    # PReLU's slope: "1.weight" (C,) from TorchScript, a (1, C) initializer from dynamo
    slope = next((n.input[1] for n in model.graph.node if n.op_type == "PRelu"), None)
    for torch_name, param in net.named_parameters():
        name = slope if torch_name == "1.weight" else torch_name
        assert name in initial, (name, list(initial))  # trained by default
        value = state[name]
        expected = param.detach().numpy().reshape(value.shape)
        np.testing.assert_allclose(value, expected, rtol=1e-4, atol=1e-7, err_msg=name)
        moved = np.abs(value - initial[name].reshape(value.shape)).max()
        assert moved > 1e-5, (name, moved)  # every weight was trained, the slope too
