"""BatchNormalization and Dropout in training mode (graphkit.train_mode), against torch.

References: ``torch.nn.functional.batch_norm`` in training mode (outputs and running
statistics), the Dropout stream's formula written again here in numpy from its
docstring, and torch's own ``model.train()`` training of a ResNet-style network, with
graphkit's Dropout masks fed to torch (torch's generator cannot be fed to an ONNX graph;
the masks' law is checked on its own: keep rate, scaling, independence).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit.prepare import prepare_for_training
from graphkit.train_mode import (
    DROPOUT_SEED,
    is_marked,
    marked_for_training,
    training_form,
    uniform_stream,
)
from graphkit.update_step import STEP

torch = pytest.importorskip("torch")

from conftest import dropout_uniform, export_dynamo  # noqa: E402

from graphkit_train import ForwardBackwardTrainer, Trainer  # noqa: E402

BACKENDS = ["native", "ort_training"]


# -- the Dropout stream, against its docstring's formula (conftest.dropout_uniform) --------


def _dropout_graph(shape, ratio: float) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Constant", [], ["r"], value=numpy_helper.from_array(np.float32(ratio))),
        helper.make_node("Constant", [], ["t"], value=numpy_helper.from_array(np.bool_(True))),
        helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape)),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, list(shape)),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


_SESSIONS: dict[int, tuple[onnx.ModelProto, ort.InferenceSession]] = {}
"""One session per dropout graph, keyed by the graph's id (the graph is held too, so
that its id is not reused by another)."""


def _train_dropout(model, x, step, seed):
    """The training form of ``model`` on ``x`` at ``step``."""
    if id(model) not in _SESSIONS:
        form = training_form(marked_for_training(model))
        _SESSIONS[id(model)] = (model, ort.InferenceSession(form.model.SerializeToString()))
    feeds = {"x": x, "step": np.array(step, np.int64), DROPOUT_SEED: np.array(seed, np.int64)}
    return _SESSIONS[id(model)][1].run(["y", "mask"], feeds)


def test_the_dropout_masks_follow_the_documented_stream():
    x = np.random.default_rng(0).normal(size=(3, 5, 7)).astype(np.float32)
    y, mask = _train_dropout(_dropout_graph(x.shape, 0.25), x, 11, 12345)
    keep = (dropout_uniform(12345, 11, 0, x.size) >= 0.25).reshape(x.shape)
    np.testing.assert_array_equal(mask, keep)
    np.testing.assert_allclose(y, x * keep / 0.75, rtol=1e-6)
    np.testing.assert_array_equal(
        uniform_stream(12345, 11, 0, x.size), dropout_uniform(12345, 11, 0, x.size)
    )


def test_the_dropout_masks_keep_1_minus_p_and_change_every_step():
    """The keep rate within 5 standard deviations of 1 - p; masks of two steps, and of
    two seeds, agree as often as independent draws do; E[y] = x over many steps."""
    p, n = 0.3, 200_000
    x = np.ones((n,), np.float32)
    model = _dropout_graph(x.shape, p)
    masks = [_train_dropout(model, x, step, 7)[1] for step in range(3)]
    sigma = np.sqrt(p * (1 - p) / n)
    for mask in masks:
        assert abs(mask.mean() - (1 - p)) < 5 * sigma
    both = (1 - p) ** 2
    assert abs((masks[0] & masks[1]).mean() - both) < 5 * np.sqrt(both * (1 - both) / n)
    other_seed = _train_dropout(model, x, 0, 8)[1]
    assert abs((masks[0] & other_seed).mean() - both) < 5 * np.sqrt(both * (1 - both) / n)
    # neighbours are independent too (no stripes): P(keep_i and keep_i+1) = (1 - p)^2
    pairs = (masks[0][1:] & masks[0][:-1]).mean()
    assert abs(pairs - both) < 5 * np.sqrt(both * (1 - both) / n)
    # the same seed and step: the same mask
    np.testing.assert_array_equal(masks[0], _train_dropout(model, x, 0, 7)[1])
    # expectation: kept units scaled by 1 / (1 - p)
    small, graph = np.full((64,), 2.0, np.float32), _dropout_graph((64,), p)
    mean = np.mean([_train_dropout(graph, small, s, 1)[0] for s in range(400)], 0)
    assert abs(mean.mean() - 2.0) < 5 * 2.0 * np.sqrt(p / (1 - p) / (64 * 400))


# -- BatchNormalization's training form, against torch ------------------------------------


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((6, 3), np.float32),
        ((5, 3, 7), np.float32),
        ((4, 3, 5, 6), np.float32),
        ((4, 3, 5), np.float64),
    ],
)
def test_batch_statistics_and_running_averages_equal_torch(shape, dtype):
    rng = np.random.default_rng(1)
    x = rng.normal(2.0, 3.0, size=shape).astype(dtype)
    scale, bias = rng.normal(size=3).astype(dtype), rng.normal(size=3).astype(dtype)
    mean, var = rng.normal(size=3).astype(dtype), rng.random(3).astype(dtype) + 0.5
    node = helper.make_node(
        "BatchNormalization",
        ["x", "s", "b", "m", "v"],
        ["y", "m_out", "v_out"],
        training_mode=1,
        momentum=0.8,
        epsilon=1e-3,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(
                "x", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), ["N", *shape[1:]]
            )
        ],
        [
            helper.make_tensor_value_info(
                "y", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), None
            )
        ],
        [numpy_helper.from_array(a, n) for a, n in zip((scale, bias, mean, var), "sbmv")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    marked = marked_for_training(model)
    assert is_marked(marked.graph.node[0]) and len(marked.graph.node[0].output) == 1
    form = training_form(marked)
    session = ort.InferenceSession(form.model.SerializeToString())
    y, m_next, v_next = session.run(["y", form.buffers["m"], form.buffers["v"]], {"x": x})

    running_mean, running_var = torch.from_numpy(mean.copy()), torch.from_numpy(var.copy())
    expected = torch.nn.functional.batch_norm(
        torch.from_numpy(x),
        running_mean,
        running_var,
        torch.from_numpy(scale),
        torch.from_numpy(bias),
        training=True,
        momentum=0.2,  # torch's momentum is 1 - ONNX's
        eps=1e-3,
    )
    np.testing.assert_allclose(y, expected.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m_next, running_mean.numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(v_next, running_var.numpy(), rtol=1e-5, atol=1e-6)
    # the inference form reads the running statistics
    inference = ort.InferenceSession(marked.SerializeToString()).run(None, {"x": x})[0]
    eval_mode = torch.nn.functional.batch_norm(
        torch.from_numpy(x), torch.from_numpy(mean), torch.from_numpy(var),
        torch.from_numpy(scale), torch.from_numpy(bias), training=False, eps=1e-3,
    )  # fmt: skip
    np.testing.assert_allclose(inference, eval_mode.numpy(), rtol=1e-5, atol=1e-5)


# -- a ResNet-style network trained as torch's train() trains it ---------------------------

ROWS, BATCH, EPOCHS, LR, P = 32, 8, 5, 0.05, 0.25  # 20 steps


class _FedDropout(torch.nn.Module):
    """torch's Dropout with graphkit's masks: layer ``layer`` of the stream, at the
    step the owner counts."""

    def __init__(self, p: float, layer: int, owner) -> None:
        super().__init__()
        self.p, self.layer = p, layer
        self.owner = lambda: owner  # not a submodule: the owner holds this one

    def forward(self, x):
        if not self.training:
            return x
        owner = self.owner()
        u = dropout_uniform(owner.seed, owner.step, self.layer, x.numel())
        keep = torch.from_numpy((u >= self.p).reshape(tuple(x.shape)))
        return x * keep / (1 - self.p)


class _ResNet(torch.nn.Module):
    """Conv-BN-ReLU, a residual block (Conv-BN-ReLU-Conv-BN + skip), Dropout, Linear."""

    def __init__(self, p: float = P) -> None:
        super().__init__()
        self.stem = torch.nn.Conv2d(2, 4, 3, padding=1)
        self.bn0 = torch.nn.BatchNorm2d(4)
        self.conv1 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(4)
        self.conv2 = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(4, momentum=0.3)
        self.drop = torch.nn.Dropout(p)
        self.head = torch.nn.Linear(4 * 6 * 6, 3)
        self.seed, self.step = 0, 0

    def forward(self, x):
        h = torch.relu(self.bn0(self.stem(x)))
        r = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(h)))))
        return self.head(self.drop(torch.relu(h + r)).flatten(1))


def _resnet(p: float = P) -> _ResNet:
    torch.manual_seed(0)
    net = _ResNet(p)
    with torch.no_grad():  # statistics of its own, not zeros and ones
        for bn in (net.bn0, net.bn1, net.bn2):
            bn.running_mean.copy_(torch.randn(4) * 0.2)
            bn.running_var.copy_(torch.rand(4) + 0.5)
            bn.weight.copy_(torch.rand(4) + 0.5)  # apart: an exporter merges equal ones
            bn.bias.copy_(torch.randn(4) * 0.1)
    return net


def _data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(ROWS, 2, 6, 6)).astype(np.float32)
    return X, rng.integers(0, 3, size=ROWS).astype(np.int64)


def _export(net, exporter: str, mode: str = "train") -> onnx.ModelProto:
    net = net.train() if mode == "train" else net.eval()
    X, _ = _data()
    if exporter == "dynamo":
        return export_dynamo(net, X)
    buffer = io.BytesIO()
    training = (
        torch.onnx.TrainingMode.TRAINING if mode == "train" else torch.onnx.TrainingMode.PRESERVE
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (torch.from_numpy(X[:2]),),
            buffer,
            dynamo=False,
            training=training,
            do_constant_folding=False,
            input_names=["X"],
            output_names=["Y"],
            dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}},
            opset_version=18,
        )
    return onnx.load_from_string(buffer.getvalue())


def _torch_train(net: _ResNet, seed: int, fed: bool = True) -> dict[str, np.ndarray]:
    """torch's SGD of the network in train(), its Dropout fed graphkit's masks."""
    if fed:
        net.drop = _FedDropout(net.drop.p, 0, net)
    net.seed, net.step = seed, 0
    net.train()
    _sgd_epochs(net, net.parameters(), after_step=lambda: setattr(net, "step", net.step + 1))
    return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}


def _sgd_epochs(forward, parameters, after_step=None) -> None:
    """torch's SGD of the cross entropy of ``forward`` for EPOCHS epochs, the trainers'
    batches in order."""
    X, y = _data()
    optimizer = torch.optim.SGD(parameters, lr=LR)
    for _ in range(EPOCHS):
        for start in range(0, ROWS, BATCH):
            optimizer.zero_grad()
            logits = forward(torch.from_numpy(X[start : start + BATCH]))
            loss = torch.nn.functional.cross_entropy(
                logits, torch.from_numpy(y[start : start + BATCH])
            )
            loss.backward()
            optimizer.step()
            if after_step is not None:
                after_step()


def _torch_eval_sgd(net: _ResNet) -> None:
    """torch's SGD of the network in eval() (what train_mode=False trains)."""
    _sgd_epochs(net.eval(), net.parameters())


def _trainer(kind: str, onx, backend: str, **options):
    common = dict(max_iter=EPOCHS, batch_size=BATCH, shuffle=False, backend=backend)
    common.update(options)
    if kind == "full":
        return Trainer(onx, loss="cross_entropy", optimizer="sgd", schedule=LR, **common)
    return ForwardBackwardTrainer(onx, loss="cross_entropy", optimizer="sgd", schedule=LR, **common)


def _assert_state_equals(state, expected):
    for name, value in expected.items():
        if name.endswith("num_batches_tracked"):
            continue
        value = value.detach().numpy() if isinstance(value, torch.Tensor) else value
        np.testing.assert_allclose(
            state[name], value, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(value).max())),
            err_msg=name,
        )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_a_resnet_trains_as_torch_train_mode_trains_it(kind, exporter, backend):
    """20 SGD steps: every weight and running statistic within 1e-5 of torch's; then
    predictions equal torch's eval() (running statistics, no Dropout)."""
    net = _resnet()
    onx = _export(net, exporter)  # tracing in train() updates the running statistics
    trainer = _trainer(kind, onx, backend, random_state=3).fit(*_data())
    state = trainer.get_state()
    exported = {k: v.clone() for k, v in net.state_dict().items()}
    expected = _torch_train(net, int(state[DROPOUT_SEED]))
    _assert_state_equals(state, expected)
    net = _resnet()
    net.load_state_dict({k: torch.from_numpy(v) for k, v in expected.items()})
    assert not torch.equal(exported["bn0.running_mean"], net.bn0.running_mean)
    X, _ = _data()
    with torch.no_grad():
        logits = net.eval()(torch.from_numpy(X)).numpy()
    probabilities = torch.softmax(torch.from_numpy(logits), 1).numpy()
    np.testing.assert_allclose(trainer.predict_proba(X), probabilities, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_train_mode_true_trains_an_eval_export_with_batch_statistics(kind):
    """An eval() export (inference BatchNorm, no Dropout node left) with train_mode=True
    trains as torch's train() of the network without Dropout."""
    net = _resnet(0.0)
    onx = _export(net, "torchscript", mode="eval")
    assert not any(is_marked(n) for n in prepare_for_training(onx, None)[0].graph.node)
    trainer = _trainer(kind, onx, "native", train_mode=True).fit(*_data())
    _assert_state_equals(trainer.get_state(), _torch_train(net, 0, fed=False))


def test_train_mode_false_trains_a_train_export_in_inference_mode():
    """train_mode=False: the running statistics stay, Dropout is off: torch's training
    of the network in eval()."""
    net = _resnet()
    onx = _export(net, "torchscript")
    trainer = _trainer("full", onx, "native", train_mode=False).fit(*_data())
    _torch_eval_sgd(net)
    _assert_state_equals(trainer.get_state(), dict(net.named_parameters()))
    assert DROPOUT_SEED not in trainer.get_state()
    trained = {
        t.name: numpy_helper.to_array(t) for t in trainer.get_trained_onnx().graph.initializer
    }
    np.testing.assert_array_equal(trained["bn0.running_var"], net.bn0.running_var.numpy())


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_the_same_random_state_gives_the_same_run_and_a_checkpoint_resumes_it(kind, tmp_path):
    onx = _export(_resnet(), "torchscript")
    X, y = _data()
    first = _trainer(kind, onx, "native", random_state=5, max_iter=2).fit(X, y).get_state()
    again = _trainer(kind, onx, "native", random_state=5, max_iter=2).fit(X, y).get_state()
    other = _trainer(kind, onx, "native", random_state=6, max_iter=2).fit(X, y).get_state()
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])
    assert not np.array_equal(first["head.weight"], other["head.weight"])
    path = tmp_path / "run.ckpt"
    _trainer(kind, onx, "native", random_state=5, max_iter=1).fit(X, y, checkpoint=path)
    resumed = _trainer(kind, onx, "native", random_state=5, max_iter=2)
    resumed.fit(X, y, checkpoint=path)
    for name, value in first.items():
        np.testing.assert_array_equal(resumed.get_state()[name], value, err_msg=name)


def test_the_trained_model_and_the_exported_step_keep_running_statistics_and_dropout():
    """The trained inference model holds the running statistics (plain onnxruntime
    predicts as torch's eval()); the exported step, on plain onnxruntime, updates them
    and drops units as the trainer's step does."""
    onx = _export(_resnet(), "torchscript")
    X, y = _data()
    trainer = _trainer("full", onx, "native", random_state=3).fit(X, y)
    state = trainer.get_state()
    trained = trainer.get_trained_onnx()
    onnx.checker.check_model(trained, full_check=True)
    assert not any(n.op_type == "Dropout" and len(n.input) > 2 for n in trained.graph.node)
    logits = ort.InferenceSession(trained.SerializeToString()).run(None, {"X": X})[0]
    probabilities = torch.softmax(torch.from_numpy(logits), 1).numpy()
    np.testing.assert_allclose(probabilities, trainer.predict_proba(X), rtol=1e-5, atol=1e-6)

    step = trainer.export_training_step()
    onnx.checker.check_model(step, full_check=True)
    names = [i.name for i in step.graph.input]
    feeds = {n: state[n] for n in names if n in state}
    feeds.update({"X": X[:BATCH], "label": y[:BATCH]})
    for value in step.graph.input:
        if value.name not in feeds:  # loss_sum, the sample weights
            shape = [BATCH] if value.name == "weight" else []
            feeds[value.name] = np.ones(shape, np.float32) if shape else np.array(0, np.float32)
    outputs = dict(zip([o.name for o in step.graph.output], ort.InferenceSession(
        step.SerializeToString()).run(None, feeds)))  # fmt: skip
    net = _resnet()
    net.load_state_dict(
        {k: torch.from_numpy(v) for k, v in state.items() if k in net.state_dict()}, strict=False
    )
    net.drop = _FedDropout(P, 0, net)
    net.seed, net.step = int(state[DROPOUT_SEED]), int(state["step"])
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    loss = torch.nn.functional.cross_entropy(
        net.train()(torch.from_numpy(X[:BATCH])), torch.from_numpy(y[:BATCH])
    )
    loss.backward()
    optimizer.step()
    for name, value in net.state_dict().items():
        if not name.endswith("num_batches_tracked"):
            np.testing.assert_allclose(outputs[f"{name}.next"], value.numpy(), rtol=1e-5, atol=1e-6)


def test_a_batch_norm_dynamo_folded_in_train_mode_is_refused():
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    ).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onx = torch.onnx.export(
            net,
            (torch.randn(4, 4),),
            dynamo=True,
            dynamic_shapes=({0: torch.export.Dim("N", min=1)},),
            optimize=True,
            verbose=False,
        ).model_proto
    with pytest.raises(gk.IncompatibleModelError, match="folded into it .*optimize=False"):
        Trainer(onx, loss="squared_error", max_iter=1).fit(
            np.ones((4, 4), np.float32), np.ones((4, 1), np.float32)
        )


def _module_state(layer) -> dict[str, np.ndarray]:
    """An OnnxModule's parameters and buffers by their graph names."""
    state = {n: getattr(layer, a).detach().numpy() for a, n in layer.parameter_names.items()}
    state.update({n: b.numpy() for n, b in layer.buffer_values().items()})
    return state


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_onnx_module_trains_as_torch_train_mode_trains_it(exporter):
    """The ResNet as a torch layer, trained by torch.optim in train(): 20 SGD steps
    equal torch's own train() fed the same masks (weights and running statistics); in
    eval() it predicts as torch's eval(), and refuses a gradient there, naming the ways."""
    from graphkit_train import OnnxModule

    net = _resnet()
    onx = _export(net, exporter)
    layer = OnnxModule(onx)
    assert layer.training  # torch's default, as for any module
    seed = int(layer.buffer_values()[DROPOUT_SEED])
    _sgd_epochs(layer, layer.parameters())
    expected = _torch_train(net, seed)
    _assert_state_equals(_module_state(layer), expected)
    assert int(layer.buffer_values()[STEP]) == EPOCHS * ROWS // BATCH

    X, _ = _data()
    layer.eval(), net.eval()
    with torch.no_grad():
        got, want = layer(torch.from_numpy(X)), net(torch.from_numpy(X))
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="train_mode=False"):
        layer(torch.from_numpy(X))
    statistics = {k: v for k, v in expected.items() if "running" in k}
    trained = {t.name: numpy_helper.to_array(t) for t in layer.trained_model().graph.initializer}
    _assert_state_equals(trained, statistics)


def test_onnx_module_backward_twice_through_a_retained_graph_sees_the_same_batch():
    """A second backward reruns the forward on the buffers the first one read: the
    gradients double, as torch's do, and the running statistics moved once."""
    from graphkit_train import OnnxModule

    net = _resnet()
    layer = OnnxModule(_export(net, "torchscript"))
    net.drop = _FedDropout(net.drop.p, 0, net)
    net.seed, net.step = int(layer.buffer_values()[DROPOUT_SEED]), 0
    net.train()
    X, y = (torch.from_numpy(a[:BATCH]) for a in _data())
    for model in (layer, net):
        loss = torch.nn.functional.cross_entropy(model(X), y)
        loss.backward(retain_graph=True)
        loss.backward()
    grads = {layer.parameter_names[n]: p.grad.numpy() for n, p in layer.named_parameters()}
    expected = {n: p.grad for n, p in net.named_parameters()}
    _assert_state_equals(grads, expected)
    statistics = {k: v for k, v in net.state_dict().items() if "running" in k}
    _assert_state_equals(_module_state(layer), statistics)


def test_onnx_module_with_train_mode_false_trains_as_torch_eval():
    from graphkit_train import OnnxModule

    net = _resnet()
    onx = _export(net, "torchscript")
    layer = OnnxModule(onx, train_mode=False)
    assert not layer.buffer_names
    _sgd_epochs(layer, layer.parameters())
    _torch_eval_sgd(net)
    trained = {name: p.detach().numpy() for name, p in layer.named_parameters()}
    expected = {n.replace(".", "_"): p for n, p in net.named_parameters()}
    _assert_state_equals(trained, expected)


@pytest.mark.parametrize("runtime", ["onnxruntime", "reference"])
def test_the_exported_step_continues_the_training_on_any_runtime(runtime):
    """The exported step (running statistics, the masks' seed and step counter carried
    as resident state) continues an epoch on PortableTrainer as the trainer continues it."""
    from graphkit.portable_trainer import PortableTrainer

    onx = _export(_resnet(), "torchscript")
    X, y = _data()
    trainer = _trainer("full", onx, "native", random_state=3, max_iter=1, warm_start=True)
    step = trainer.fit(X, y).export_training_step()
    expected = trainer.fit(X, y).get_state()
    portable = PortableTrainer(step, batch_size=BATCH, shuffle=False, runtime=runtime)
    state = portable.fit(X, y, epochs=1).state()
    for name, value in expected.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
