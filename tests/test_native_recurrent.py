"""The native backend's LSTM and GRU gradients (graphkit/backends/native/recurrent.py):
against onnx-ad's own expansion of the operators into a Scan, finite differences, and
torch's autograd and optimizers over 20 steps of both trainers."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS, export_dynamo, requires_torch
from onnx import TensorProto, helper, numpy_helper
from test_native import native_gradient

import graphkit as gk
from graphkit.backends import native
from graphkit.backends.native import recurrent
from graphkit.engine.ort_engine import Runner
from graphkit.errors import MissingGradientError
from graphkit.static_shapes import specialize
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

F32 = TensorProto.FLOAT
T, N, H, I = 5, 3, 4, 3
STATES = ("W", "R", "B", "h0", "c0")


def recurrent_model(op: str, inputs: list[str], outputs: list[str], seed: int = 0, **attrs):
    """One ``op`` over X [T, N, I] (W, R, B, h0, c0 initializers where ``inputs`` names
    them), and the loss ``sum_k <output_k, C_k>`` with fixed random ``C_k``."""
    rng = np.random.default_rng(seed)
    directions = 2 if attrs.get("direction") == "bidirectional" else 1
    gates = 4 if op == "LSTM" else 3
    shapes = {
        "W": (directions, gates * H, I),
        "R": (directions, gates * H, H),
        "B": (directions, 2 * gates * H),
        "h0": (directions, N, H),
        "c0": (directions, N, H),
        "P": (directions, 3 * H),
    }
    scale = {"R": 0.5}
    inits = [
        numpy_helper.from_array(
            (rng.normal(size=shapes[n]) * scale.get(n, 1)).astype(np.float32), n
        )
        for n in inputs
        if n in shapes
    ]
    nodes = [helper.make_node(op, inputs, outputs, hidden_size=H, **attrs)]
    terms = []
    for output in filter(None, outputs):
        shape = (T, directions, N, H) if output == "Y" else (directions, N, H)
        inits.append(
            numpy_helper.from_array(rng.normal(size=shape).astype(np.float32), f"{output}_weight")
        )
        nodes += [
            helper.make_node("Mul", [output, f"{output}_weight"], [f"{output}_m"]),
            helper.make_node("ReduceSum", [f"{output}_m"], [f"{output}_s"], keepdims=0),
        ]
        terms.append(f"{output}_s")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    graph_inputs = [helper.make_tensor_value_info("X", F32, [T, "N", I])]
    if "lens" in inputs:
        graph_inputs.append(helper.make_tensor_value_info("lens", TensorProto.INT32, ["N"]))
    graph = helper.make_graph(
        nodes, "rnn", graph_inputs, [helper.make_tensor_value_info("loss", F32, [])], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def expanded_by_onnx_ad(model: onnx.ModelProto, wrt: list[str]) -> onnx.ModelProto:
    """The gradient graph as it was before these rules: onnx-ad's Scan of the equations."""
    taken = recurrent.takes
    recurrent.takes = lambda node: False
    try:
        return native_gradient(model, "loss", wrt)
    finally:
        recurrent.takes = taken


def inputs_of(op: str, full: bool) -> list[str]:
    if not full:
        return ["X", "W", "R"]
    return ["X", "W", "R", "B", "", "h0"] + (["c0"] if op == "LSTM" else [])


def outputs_of(op: str) -> list[tuple[str, ...]]:
    every = ("Y", "Y_h", "Y_c") if op == "LSTM" else ("Y", "Y_h")
    return [every, ("", "Y_h"), ("Y",)]


CASES = [
    pytest.param(op, direction, full, outputs, id=f"{op}-{direction}-{full}-{'+'.join(outputs)}")
    for op in ("LSTM", "GRU")
    for direction in ("forward", "reverse", "bidirectional")
    for full in (True, False)
    for outputs in outputs_of(op)
]


@pytest.mark.parametrize("op, direction, full, outputs", CASES)
def test_gradients_equal_onnx_ads_expansion(op, direction, full, outputs, rng):
    """Every gradient (weights, biases, initial states and the input X) against onnx-ad's
    Scan of the operator's equations, which these rules replace; a GRU without bias
    against finite differences instead (onnx-ad 0.3.0 expands it wrongly: see below)."""
    attrs = {"direction": direction}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    model = recurrent_model(op, inputs_of(op, full), list(outputs), **attrs)
    wrt = [n for n in STATES if n in inputs_of(op, full)] + ["X"]
    gradient = native_gradient(model, "loss", wrt)
    kinds = {n.op_type for n in gradient.graph.node}
    assert op in kinds  # the forward stays onnxruntime's kernel
    onnx.checker.check_model(gradient, full_check=True)
    X = rng.normal(size=(T, N, I)).astype(np.float32)
    got = Runner(gradient)({"X": X})
    if op == "GRU" and not full:
        expected = finite_differences(model, wrt, X)
        for value, reference in zip(got[1:], expected):
            np.testing.assert_allclose(value, reference, rtol=2e-3, atol=2e-3)
        return
    expected = Runner(expanded_by_onnx_ad(model, wrt))({"X": X})
    for value, reference in zip(got, expected):
        np.testing.assert_allclose(value, reference, rtol=1e-5, atol=1e-5)


def finite_differences(
    model: onnx.ModelProto, wrt: list[str], X: np.ndarray, extra: dict | None = None
) -> list:
    """Central differences of the loss in float64 arithmetic over float32 runs
    (``extra``: other feeds, the sequence lengths)."""
    extra = extra or {}
    inits = {i.name: numpy_helper.to_array(i).astype(np.float64) for i in model.graph.initializer}
    values = {**{n: inits[n] for n in wrt if n != "X"}, "X": X.astype(np.float64)}
    names = [n for n in wrt if n != "X"]

    def loss(changed: dict) -> float:
        trial = onnx.ModelProto()
        trial.CopyFrom(model)
        for init in trial.graph.initializer:
            if init.name in changed:
                init.CopyFrom(
                    numpy_helper.from_array(changed[init.name].astype(np.float32), init.name)
                )
        feed = changed.get("X", values["X"]).astype(np.float32)
        return float(Runner(trial)({"X": feed, **extra})[0])

    grads = []
    for name in [*names, "X"]:
        grad = np.zeros_like(values[name])
        for index in np.ndindex(grad.shape):
            for sign in (1, -1):
                moved = values[name].copy()
                moved[index] += sign * 1e-2
                grad[index] += sign * loss({name: moved}) / 2e-2
        grads.append(grad)
    return grads


def test_onnx_ad_expands_a_gru_without_bias_wrongly(rng):
    """Why the GRU without bias above is checked by finite differences: onnx-ad 0.3.0's
    Scan of a ``linear_before_reset=1`` GRU without ``B`` computes another function than
    onnxruntime's kernel (and torch's ``nn.GRU(bias=False)``)."""
    model = recurrent_model("GRU", ["X", "W", "R"], ["Y"], linear_before_reset=1)
    X = rng.normal(size=(T, N, I)).astype(np.float32)
    kernel = Runner(model)({"X": X})[0]
    expanded = Runner(expanded_by_onnx_ad(model, ["W"]))({"X": X})[0]
    assert abs(kernel - expanded) > 1e-3 * abs(kernel)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_sequence_lengths_equal_finite_differences(op, direction, rng):
    """Rows of lengths 5, 3 and 1 (of 5 steps): beyond its length a row's state passes
    through and its outputs are zeros; the reverse direction starts at each row's own
    last step. onnx-ad cannot take lengths that differ, so finite differences judge."""
    attrs = {"direction": direction}
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    inputs = ["X", "W", "R", "B", "lens", "h0"] + (["c0"] if op == "LSTM" else [])
    outputs = list(outputs_of(op)[0])
    model = recurrent_model(op, inputs, outputs, **attrs)
    assert recurrent.takes(model.graph.node[0])
    wrt = [n for n in STATES if n in inputs] + ["X"]
    gradient = native_gradient(model, "loss", wrt)
    assert op in {n.op_type for n in gradient.graph.node}
    X = rng.normal(size=(T, N, I)).astype(np.float32)
    lengths = {"lens": np.array([5, 3, 1], np.int32)}
    got = Runner(gradient)({"X": X, **lengths})
    for value, reference in zip(got[1:], finite_differences(model, wrt, X, lengths)):
        np.testing.assert_allclose(value, reference, rtol=2e-3, atol=2e-3)


LEFT = {
    "peepholes": ("LSTM", ["X", "W", "R", "B", "", "", "", "P"], {}),
    "clip": ("LSTM", ["X", "W", "R"], {"clip": 2.0}),
    "input_forget": ("LSTM", ["X", "W", "R"], {"input_forget": 1}),
    "activations": ("LSTM", ["X", "W", "R"], {"activations": ["Sigmoid", "Relu", "Tanh"]}),
    "layout 1": ("LSTM", ["X", "W", "R"], {"layout": 1}),
    "GRU linear_before_reset=0": ("GRU", ["X", "W", "R", "B"], {}),
}
"""Left to onnx-ad's expansion (sequence lengths are taken: see above)."""


@pytest.mark.parametrize("case", sorted(LEFT))
def test_other_recurrent_nodes_are_left_to_onnx_ad(case):
    op, inputs, attrs = LEFT[case]
    node = helper.make_node(op, inputs, ["Y"], hidden_size=H, **attrs)
    assert not recurrent.takes(node)
    taken = helper.make_node(op, inputs[:3], ["Y"], hidden_size=H, linear_before_reset=1)
    assert recurrent.takes(taken)


def test_a_gru_left_to_onnx_ad_still_differentiates(rng):
    model = recurrent_model("GRU", ["X", "W", "R", "B"], ["Y"])  # linear_before_reset=0
    gradient = native_gradient(model, "loss", ["W", "R", "B"])
    assert "GRU" not in {n.op_type for n in gradient.graph.node}
    X = rng.normal(size=(T, N, I)).astype(np.float32)
    got = Runner(gradient)({"X": X})[1:]
    for value, reference in zip(got, finite_differences(model, ["W", "R", "B"], X)):
        np.testing.assert_allclose(value, reference, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_specialized_the_reverse_step_is_a_few_kernels(op):
    """As the trainers run it (specialized to a batch size), the reverse's loop body is
    the recurrent product and a handful of elementwise kernels: 6 for an LSTM, 5 for a
    GRU (onnx-ad's Scan of an LSTM had 143 before specialization)."""
    attrs = {"linear_before_reset": 1} if op == "GRU" else {}
    model = recurrent_model(op, inputs_of(op, True), list(outputs_of(op)[0]), **attrs)
    gradient = native_gradient(model, "loss", ["W", "R", "B"])
    static = specialize(gradient, {"X": N}, native.BACKEND.constant_folds)
    scans = [n for n in static.graph.node if n.op_type == "Scan"]
    bodies = [a.g for n in scans for a in n.attribute if a.name == "body"]
    kinds = sorted(len(b.node) for b in bodies)
    # an LSTM's cell states (3 nodes) and its reverse; a GRU's reverse
    assert kinds == ([3, 6] if op == "LSTM" else [5]), kinds


# -- torch: 20 steps of both trainers -----------------------------------------------------


def torch_network(kind: str):
    import torch
    from torch import nn

    class Network(nn.Module):
        """A GRU classifier (last hidden state) or a bidirectional LSTM tagger."""

        def __init__(self) -> None:
            super().__init__()
            if kind == "gru":
                self.rnn = nn.GRU(4, 6, batch_first=True)
                self.head = nn.Linear(6, 3)
            else:
                self.rnn = nn.LSTM(4, 5, batch_first=True, bidirectional=True)
                self.head = nn.Linear(10, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.rnn(x)
            return self.head(out[:, -1] if kind == "gru" else out)

    torch.manual_seed(0)
    return Network()


def exported(net, X: np.ndarray, path, exporter: str = "torchscript") -> onnx.ModelProto:
    import torch

    if exporter == "dynamo":  # the README's recipe: gate slices bounded by shapes
        return export_dynamo(net, X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (torch.from_numpy(X[:2]),),
            str(path),
            dynamo=False,
            opset_version=17,
            do_constant_folding=False,  # the initializers keep their state_dict names
            input_names=["X"],
            output_names=["Y"],
            dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}},
        )
    return onnx.load(str(path))


def torch_steps(net, X, y, optimizer: str, batch: int, steps: int, token: bool) -> dict:
    import torch

    params = list(net.parameters())
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=0.1)
    else:
        opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.01)
    for step in range(steps):
        rows = slice(step * batch, (step + 1) * batch)
        opt.zero_grad()
        out = net(torch.from_numpy(X[rows]))
        target = torch.from_numpy(y[rows])
        if token:
            out, target = out.reshape(-1, out.shape[-1]), target.reshape(-1)
        torch.nn.functional.cross_entropy(out, target).backward()
        opt.step()
    return {k: v.detach().numpy() for k, v in net.state_dict().items()}


TWENTY_STEPS = [
    pytest.param(kind, optimizer, trainer, "torchscript", id=f"{kind}-{optimizer}-{trainer}")
    for kind in ("gru", "bilstm_tagger")
    for optimizer in ("sgd", "adamw")
    for trainer in ("full", "forward_backward")
] + [
    pytest.param(kind, "sgd", trainer, "dynamo", id=f"{kind}-sgd-{trainer}-dynamo")
    for kind in ("gru", "bilstm_tagger")
    for trainer in ("full", "forward_backward")
]


@requires_torch
@pytest.mark.parametrize("kind, optimizer, trainer, exporter", TWENTY_STEPS)
def test_twenty_steps_equal_torch(kind, optimizer, trainer, exporter, tmp_path):
    """A GRU classifier and a bidirectional LSTM tagger (TorchScript export, and the
    README's dynamo recipe, whose gate slices end at a shape's static axis), 20 batches
    of SGD or AdamW on the native backend: every weight within 1e-5 of torch's."""
    from graphkit import optimizers

    rng = np.random.default_rng(7)
    batch, steps = 8, 20
    X = rng.normal(size=(batch * steps, 6, 4)).astype(np.float32)
    token = kind == "bilstm_tagger"
    y = rng.integers(0, 3, size=(batch * steps, 6) if token else batch * steps).astype(np.int64)
    net = torch_network(kind)
    model = exported(net, X, tmp_path / "net.onnx", exporter)
    names = list(net.state_dict())
    expected = torch_steps(net, X, y, optimizer, batch, steps, token)
    if optimizer == "sgd":
        rate = optimizers.sgd(learning_rate=0.1)
    else:
        rate = optimizers.adamw(learning_rate=0.01, weight_decay=0.01)
    loss = "token_cross_entropy" if token else "cross_entropy"
    common = dict(max_iter=1, batch_size=batch, learning_rate=rate, shuffle=False, backend="native")
    if trainer == "full":
        fitted = OrtGradientOptimizer(gk.add_loss_output(model, loss), names, **common)
    else:
        fitted = OrtGradientForwardBackwardOptimizer(model, names, learning_loss=loss, **common)
    state = fitted.fit(X, y).get_state()
    for name in names:
        scale = max(float(np.abs(expected[name]).max()), 1e-3)
        difference = float(np.abs(state[name] - expected[name]).max())
        assert difference <= 1e-5 * scale, (name, difference)


@pytest.mark.skipif(
    "ort_training" not in INSTALLED_BACKENDS, reason="onnxruntime-training is not installed"
)
@pytest.mark.parametrize("direction", ["bidirectional", "reverse"])
def test_ort_training_refuses_what_its_kernels_cannot_naming_native(direction, rng):
    """onnxruntime-training's LSTMGrad runs the forward direction only: forward/backward
    training there is refused before onnxruntime fails to load the session, naming the
    node and the native backend (which trains it: test_twenty_steps_equal_torch)."""
    directions = 2 if direction == "bidirectional" else 1
    weights = {
        "W": rng.normal(size=(directions, 4 * H, I)),
        "R": rng.normal(size=(directions, 4 * H, H)),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["X"], ["steps"], perm=[1, 0, 2]),
            helper.make_node(
                "LSTM", ["steps", "W", "R"], ["Y"], hidden_size=H, direction=direction
            ),
            helper.make_node("Transpose", ["Y"], ["out"], perm=[2, 0, 1, 3]),
        ],
        "tagger",
        [helper.make_tensor_value_info("X", F32, ["N", T, I])],
        [helper.make_tensor_value_info("out", F32, ["N", T, directions, H])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    X = rng.normal(size=(4, T, I)).astype(np.float32)
    y = rng.normal(size=(4, T, directions, H)).astype(np.float32)
    trainer = OrtGradientForwardBackwardOptimizer(
        model, ["W", "R"], learning_loss="squared_error", backend="ort_training"
    )
    with pytest.raises(MissingGradientError, match=r"forward direction only.*backend='native'"):
        trainer.fit(X, y)
