"""A decoupled weight decay's update with its scalar factors gathered
(graphkit.decay_factors): ``p + lr (d + wd p)`` as ``p (1 + lr wd) + ((lr s) m) / r``.

References: numpy's float64 evaluation of the formula as the optimizer chain writes it,
and torch.optim.AdamW trained on the same network and batches.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS, export_torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from zoo.models import torch_export

import graphkit as gk
from graphkit import optimizers, schedules
from graphkit.decay_factors import GATHER_FROM, gather_decay
from graphkit.engine.ort_engine import inference_session
from graphkit.static_shapes import static_shapes
from graphkit.training import step as step_module
from graphkit_train import OrtGradientOptimizer

ELEM = {np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE}


def decay_update(
    shape: tuple[int, ...],
    dtype: type,
    lr_computed: bool,
    s_computed: bool | None,
    read_elsewhere: str | None = None,
    wd_computed: bool = False,
) -> onnx.ModelProto:
    """``out = p + lr (d + wd p)`` as an optimizer chain writes it, ``d = (s m) / r``
    (``s_computed`` None: ``d = m``). A computed scalar is a rank-0 input reshaped to a
    shape of ones, as a step's counter arithmetic gives it; ``read_elsewhere`` names a
    tensor of the pattern also returned as an output."""
    elem, ones = ELEM[dtype], np.ones(len(shape), np.int64)
    constants = {"wd": np.array([0.01], dtype), "ones": ones}
    inputs = [helper.make_tensor_value_info(n, elem, list(shape)) for n in ("p", "m", "r")]
    nodes = []
    for name, value, computed in (("lr", -0.05, lr_computed), ("s", 1.7, s_computed)):
        if computed is None:
            continue
        if computed:
            inputs.append(helper.make_tensor_value_info(f"{name}0", elem, []))
            nodes.append(helper.make_node("Reshape", [f"{name}0", "ones"], [name]))
        else:
            constants[name] = np.full([1] * len(shape), value, dtype)
    if wd_computed:
        del constants["wd"]
        inputs.append(helper.make_tensor_value_info("wd", elem, [1]))
    d = "m"
    if s_computed is not None:
        nodes += [helper.make_node("Mul", ["s", "m"], ["top"])]
        nodes += [helper.make_node("Div", ["top", "r"], ["d"])]
        d = "d"
    nodes += [
        helper.make_node("Mul", ["wd", "p"], ["decay"]),
        helper.make_node("Add", [d, "decay"], ["total"]),
        helper.make_node("Mul", ["total", "lr"], ["u"]),
        helper.make_node("Add", ["p", "u"], ["out"]),
    ]
    outputs = [helper.make_tensor_value_info("out", elem, list(shape))]
    if read_elsewhere:
        outputs.append(helper.make_tensor_value_info(read_elsewhere, elem, None))
    graph = helper.make_graph(
        nodes,
        "decay",
        inputs,
        outputs,
        [numpy_helper.from_array(v, k) for k, v in constants.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def passes(model: onnx.ModelProto, shape: tuple[int, ...]) -> int:
    """Nodes whose result has the weight's shape: each a pass over the weights."""
    shapes = static_shapes(model)
    return sum(shapes.get(n.output[0]) == shape for n in model.graph.node)


@settings(max_examples=40, deadline=None)
@given(
    shape=st.sampled_from([(7,), (64, 65), (2, 3, 5)]),
    dtype=st.sampled_from([np.float32, np.float64]),
    lr_computed=st.booleans(),
    s_computed=st.sampled_from([None, False, True]),
    in_an_epoch=st.booleans(),
)
def test_gathered_update_is_the_chains_formula(shape, dtype, lr_computed, s_computed, in_an_epoch):
    """Fewer passes over the weights, the value of the formula as written (numpy in
    float64), on onnxruntime; the rewritten graph passes the full checker. Small
    weights whose factors the step computes are left alone, but in a fused epoch (the
    factors computed before its Scan)."""
    model = decay_update(shape, dtype, lr_computed, s_computed)
    before = passes(model, shape)
    once = {"lr0", "lr", "s0", "s"} if in_an_epoch else set()
    rewritten = gather_decay(model, static_shapes(model), once)
    computed = lr_computed or bool(s_computed)
    if computed and not in_an_epoch and np.prod(shape) < GATHER_FROM:
        assert rewritten == 0
        return
    assert rewritten == 1
    onnx.checker.check_model(model, full_check=True)
    assert passes(model, shape) == before - (2 if s_computed is not None else 1)
    rng = np.random.default_rng(0)
    feeds = {n: rng.normal(size=shape).astype(dtype) for n in ("p", "m")}
    feeds["r"] = rng.uniform(0.5, 2.0, size=shape).astype(dtype)
    if lr_computed:
        feeds["lr0"] = np.array(-0.05, dtype)
    if s_computed:
        feeds["s0"] = np.array(1.7, dtype)
    p, m, r = (feeds[n].astype(np.float64) for n in ("p", "m", "r"))
    d = m if s_computed is None else 1.7 * m / r
    expected = p + -0.05 * (d + 0.01 * p)
    (out,) = inference_session(model).run(["out"], feeds)
    tol = 1e-6 if dtype == np.float32 else 1e-14
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("read_elsewhere", ["u", "total", "decay", "top"])
def test_left_alone_where_a_piece_is_read_elsewhere(read_elsewhere):
    model = decay_update((64, 65), np.float32, False, True, read_elsewhere=read_elsewhere)
    kinds = [n.op_type for n in model.graph.node]
    if read_elsewhere == "top":  # the decay still gathers; Adam's factor stays apart
        assert gather_decay(model, static_shapes(model)) == 1
        assert [n.op_type for n in model.graph.node].count("Div") == 1
        assert "top" in {o for n in model.graph.node for o in n.output}
    else:
        assert gather_decay(model, static_shapes(model)) == 0
        assert [n.op_type for n in model.graph.node] == kinds


def test_left_alone_where_the_decay_is_computed():
    model = decay_update((64, 65), np.float32, False, True, wd_computed=True)
    assert gather_decay(model, static_shapes(model)) == 0


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize(
    "packed, rate, dynamo",
    [
        (True, "constant", False),
        (True, "exponential", False),
        (False, "constant", False),
        (False, "exponential", False),
        (True, "exponential", True),
        (False, "constant", True),
    ],
)
def test_adamw_epoch_matches_torch(backend, packed, rate, dynamo, monkeypatch, tmp_path):
    """AdamW trained a fused epoch at a time (its weights carried laid end to end or one
    tensor each, its learning rate fixed or a schedule; the network exported by either
    torch exporter) against torch.optim.AdamW on the same network and batches; the
    epoch's step gathered its decay."""
    torch = pytest.importorskip("torch")
    if not packed:
        monkeypatch.setattr(step_module, "PACK_UP_TO_BYTES", 0)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    if dynamo:
        onx = torch_export(net, np.zeros((2, 4), np.float32), dynamo=True)
    else:
        onx = export_torch(net, tmp_path / "net.onnx", 4)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(64, 4)).astype(np.float32)
    y = rng.normal(size=64).astype(np.float32)
    lr, gamma, wd, epochs, batch = 0.01, 0.97, 0.1, 3, 16
    learning_rate = lr if rate == "constant" else schedules.exponential(lr, gamma)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(onx),
        max_iter=epochs,
        batch_size=batch,
        learning_rate=optimizers.adamw(weight_decay=wd, learning_rate=learning_rate),
        shuffle=False,
        steps_per_run="epoch",
        backend=backend,
    ).fit(X, y)
    (runner,) = trainer._fused_runners.values()
    scan = next(n for n in runner.scan_model.graph.node if n.op_type == "Scan")
    body = next(a.g for a in scan.attribute if a.name == "body")
    assert any(o.endswith("/decayed") for n in body.node for o in n.output)

    theirs = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=wd)
    Xt, yt = torch.tensor(X), torch.tensor(y).reshape(-1, 1)
    t = 0
    for _ in range(epochs):
        for start in range(0, len(X), batch):
            for group in theirs.param_groups:
                group["lr"] = lr if rate == "constant" else lr * gamma**t
            theirs.zero_grad()
            rows = slice(start, start + batch)
            torch.nn.functional.mse_loss(net(Xt[rows]), yt[rows]).backward()
            theirs.step()
            t += 1
    state = trainer.get_state()
    for name, value in net.state_dict().items():
        np.testing.assert_allclose(state[name], value.numpy(), rtol=2e-5, atol=2e-6)
