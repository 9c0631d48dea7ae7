"""A loss per output: ``add_loss_output(onx, {output: loss}, loss_weights={...})``.

The reference is torch: a network with a regression head (2 values per sample) and a
3-class classification head, exported by both exporters, trained by torch's SGD on
``0.7 * MSELoss + 0.3 * CrossEntropyLoss`` from the same initial weights over the same
batches (the same shuffling permutations, a shorter last batch, sample weights), and by
graphkit on the graph ``add_loss_output`` builds. The loss of one batch is checked
against numpy's formula; bad inputs are refused naming what to pass.
"""

from __future__ import annotations

import functools
import pickle

import numpy as np
import onnx
import pytest

import graphkit as gk
from graphkit import DTypeError, ShapeError, UnknownNameError

torch = pytest.importorskip("torch")
nn = torch.nn

N, BATCH, EPOCHS, LR, SEED = 38, 8, 3, 0.01, 5
WEIGHTS = (0.7, 0.3)


class TwoHeads(nn.Module):
    """A shared tanh layer, a regression head (2 values) and a 3-class head (logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.reg = nn.Linear(8, 2)
        self.cls = nn.Linear(8, 3)

    def forward(self, x):  # noqa: ANN001, ANN201
        hidden = torch.tanh(self.body(x))
        return self.reg(hidden), self.cls(hidden)


def _network() -> nn.Module:
    torch.manual_seed(0)
    return TwoHeads()


def _data(n: int = N) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    price = np.stack([x @ [1.0, -1.0, 0.5, 2.0], np.sin(x[:, 0])], axis=1).astype(np.float32)
    kind = (np.digitize(x[:, 1] + x[:, 2], [-0.5, 0.5])).astype(np.int64)
    w = rng.uniform(0.2, 2.0, size=n).astype(np.float32)
    return x, price, kind, w


@functools.cache
def _exported(dynamo: bool) -> tuple[onnx.ModelProto, str, str]:
    """The prediction graph and its two outputs' names (the exporters name the second
    themselves: '10' or 'linear_2')."""
    from tests.zoo.models import torch_export

    onx = torch_export(_network(), _data()[0], dynamo)
    reg, cls = (o.name for o in onx.graph.output)
    return onx, reg, cls


def _training_graph(dynamo: bool = False, **kwargs) -> tuple[onnx.ModelProto, str, str]:
    onx, reg, cls = _exported(dynamo)
    settings = {"loss_weights": dict(zip((reg, cls), WEIGHTS)), "weight_name": "weight"}
    train = gk.add_loss_output(
        onx, {reg: "squared_error", cls: "cross_entropy"}, **{**settings, **kwargs}
    )
    return train, reg, cls


def _torch_sgd(x, price, kind, w, epochs=EPOCHS, random_state=SEED):
    """torch's SGD on 0.7 MSE + 0.3 CE (each a weighted mean over the batch) over the
    batches graphkit draws: each epoch's numpy permutation, batches of BATCH rows."""
    net = _network()
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    rng = np.random.default_rng(random_state)
    X, P, K, W = map(torch.from_numpy, (x, price, kind, w))
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(x)))
        for start in range(0, len(x), BATCH):
            rows = order[start : start + BATCH]
            sgd.zero_grad()
            reg, cls = net(X[rows])
            wb = W[rows]
            mse = (wb[:, None] * (reg - P[rows]) ** 2).sum() / (2 * wb.sum())
            ce = (wb * nn.functional.cross_entropy(cls, K[rows], reduction="none")).sum() / wb.sum()
            (WEIGHTS[0] * mse + WEIGHTS[1] * ce).backward()
            sgd.step()
    return net


def _max_difference(state: dict[str, np.ndarray], net: nn.Module) -> float:
    gaps = []
    for name, param in net.named_parameters():
        assert name in state, (name, sorted(state))
        gaps.append(float(np.abs(state[name] - param.detach().numpy()).max()))
    return max(gaps)


def _full(train: onnx.ModelProto, **settings):
    from graphkit_train import Trainer

    defaults = dict(max_iter=EPOCHS, batch_size=BATCH, random_state=SEED)
    return Trainer(train, **{**defaults, **settings})


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_two_heads_train_like_torch_sgd(dynamo):
    """Shuffled epochs (every head's labels permuted alike), a shorter last batch, sample
    weights on both heads: the weights follow torch's SGD to ~1e-5; predict returns each
    head's prediction, the classification head's as class labels."""
    x, price, kind, w = _data()
    train, reg, cls = _training_graph(dynamo)
    fitted = _full(train).fit(x, {reg: price, cls: kind}, sample_weight=w)
    net = _torch_sgd(x, price, kind, w)
    assert _max_difference(fitted.get_state(), net) < 1e-5
    with torch.no_grad():
        expected_reg, expected_cls = (t.numpy() for t in net(torch.from_numpy(x)))
    predicted = fitted.predict(x)
    assert sorted(predicted) == sorted([reg, cls])
    np.testing.assert_allclose(predicted[reg], expected_reg, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(predicted[cls], expected_cls.argmax(axis=1))
    softmax = np.exp(expected_cls) / np.exp(expected_cls).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(fitted.predict_proba(x)[cls], softmax, rtol=1e-5, atol=1e-6)
    assert fitted.losses_[cls].name == "cross_entropy"
    assert fitted.loss_weights_ == {reg: 0.7, cls: 0.3}


@pytest.mark.parametrize("steps_per_run,static", [(1, False), (3, True)])
def test_every_way_of_running_batches_and_the_seed_api(steps_per_run, static):
    """One run per batch (the step for any batch size), a Scan over 3 batches a run, and
    OrtGradientOptimizer (the seed's API) on the same graph: the same weights as torch."""
    from graphkit_train import OrtGradientOptimizer

    x, price, kind, w = _data()
    train, reg, cls = _training_graph()
    y = {reg: price, cls: kind}
    net = _torch_sgd(x, price, kind, w)
    fitted = _full(train, steps_per_run=steps_per_run, static_shapes=static)
    assert _max_difference(fitted.fit(x, y, sample_weight=w).get_state(), net) < 1e-5
    seed = OrtGradientOptimizer(
        train, max_iter=EPOCHS, batch_size=BATCH, learning_rate=LR, random_state=SEED
    )
    assert _max_difference(seed.fit(x, y, sample_weight=w).get_state(), net) < 1e-5


def test_trainer_takes_a_dict_of_losses_as_keras_does():
    """Trainer(prediction graph, loss={output: loss}, loss_weights={...}) appends the
    losses itself: the same training as the graph add_loss_output builds."""
    x, price, kind, w = _data()
    onx, reg, cls = _exported(False)
    fitted = _full(
        onx, loss={reg: "mse", cls: "cross_entropy"}, loss_weights={reg: 0.7, cls: 0.3}
    ).fit(x, {reg: price, cls: kind})
    net = _torch_sgd(x, price, kind, np.ones(N, np.float32))
    assert _max_difference(fitted.get_state(), net) < 1e-5
    assert fitted._estimator_type == "regressor"  # neither: never a classifier


def test_the_loss_of_one_batch_is_the_formula():
    """Each head reduced as its own loss says (here the regression head's 'sum'), each
    weighted, the sample weights on both, the penalty added once; a label_name dict
    names the label inputs."""
    x, price, kind, w = _data()
    onx, reg, cls = _exported(False)
    train = gk.add_loss_output(
        onx,
        {reg: gk.losses.get("squared_error", reduction="sum"), cls: "cross_entropy"},
        loss_weights={reg: 0.25},  # the other head weighs 1
        label_name={cls: "label"},  # the name one loss's label has by default
        weight_name="w",
        penalty={"body.weight": 0.01},
    )
    inputs = [i.name for i in train.graph.input]
    assert inputs[:4] == ["X", f"label_{reg}", "label", "w"]
    heads = gk.rewrite.loss_heads(train)
    assert [(h.output, h.label, h.loss["name"], h.loss["reduction"], h.weight) for h in heads] == [
        (reg, f"label_{reg}", "squared_error", "sum", 0.25),
        (cls, "label", "cross_entropy", "mean", 1.0),
    ]
    assert _full(train)._estimator_type == "regressor"  # neither: never a classifier
    out = gk.run(train, {"X": x, f"label_{reg}": price, "label": kind, "w": w})
    net = _network()
    with torch.no_grad():
        p, logits = (t.numpy().astype(np.float64) for t in net(torch.from_numpy(x)))
    body = net.body.weight.detach().numpy().astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    ce = -log_softmax[np.arange(N), kind]
    expected = (
        0.25 * (w[:, None] * (p - price) ** 2).sum()
        + (w * ce).sum() / w.sum()
        + 0.01 * (body**2).sum()
    )
    assert float(out["loss"]) == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(out[reg], p, rtol=1e-5, atol=1e-6)


def test_validation_early_stopping_checkpoints_pickling_and_exports(tmp_path):
    from graphkit.portable_trainer import PortableTrainer
    from graphkit.training.epoch import PERMUTATION

    x, price, kind, w = _data(60)
    train, reg, cls = _training_graph()
    y = {reg: price, cls: kind}
    fitted = _full(
        train, max_iter=30, early_stopping=True, n_iter_no_change=3, validation_fraction=0.2
    ).fit(x, y, sample_weight=w)
    assert fitted.best_loss_ == min(fitted.validation_losses_)
    held = {reg: price[45:], cls: kind[45:]}
    fitted.set_params(early_stopping=False, max_iter=4, validation_every=1)
    fitted.fit(x[:45], {reg: price[:45], cls: kind[:45]}, X_val=x[45:], y_val=held)
    assert len(fitted.validation_losses_) == 4
    assert fitted.validation_losses_[-1] == pytest.approx(fitted.compute_loss(x[45:], held))
    with pytest.raises(ValueError, match=r"one loss.*per output.*r2_score.*compute_loss"):
        fitted.score(x[45:], held)

    prediction = fitted.predict(x)
    path = tmp_path / "run.ckpt"
    fitted.save_checkpoint(path)
    resumed = _full(train).load_checkpoint(path)
    for restored in (resumed, pickle.loads(pickle.dumps(fitted))):
        for output, value in restored.predict(x).items():
            np.testing.assert_array_equal(value, prediction[output])
    graphs = fitted.save_onnx_graph(bytes)
    trained = onnx.load_from_string(graphs["trained"])
    assert [o.name for o in trained.graph.output] == [reg, cls]
    np.testing.assert_allclose(gk.run(trained, {"X": x})[reg], prediction[reg], rtol=1e-6)

    # the exported step names both labels; it trains on onnx.reference as the trainer does
    step = _full(train, max_iter=1).export_training_step()
    assert {f"label_{reg}", f"label_{cls}", "weight"} <= {i.name for i in step.graph.input}
    ours = PortableTrainer(step, batch_size=BATCH, random_state=SEED, runtime="reference")
    ours.fit(x, y, w, epochs=2)
    theirs = _full(train, max_iter=2).fit(x, y, sample_weight=w)
    for name, value in theirs.get_state().items():
        np.testing.assert_allclose(ours.state()[name], value, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"loss per output.*dict"):
        PortableTrainer(step).fit(x, price)
    epoch = theirs.export_training_epoch()
    assert {f"label_{reg}", f"label_{cls}", PERMUTATION} <= {i.name for i in epoch.graph.input}
    info = theirs.export_training_info()
    onnx.checker.check_model(info, full_check=True)


def test_bad_inputs_are_refused_clearly():
    x, price, kind, w = _data()
    onx, reg, cls = _exported(False)
    heads = {reg: "squared_error", cls: "cross_entropy"}
    outputs = rf"\[{reg!r}, {cls!r}\]"
    with pytest.raises(UnknownNameError, match=rf"\['price'\].*not an output.*{outputs}"):
        gk.add_loss_output(onx, {"price": "squared_error", cls: "cross_entropy"})
    with pytest.raises(UnknownNameError, match=rf"loss_weights names \['kind'\].*{outputs}"):
        gk.add_loss_output(onx, heads, loss_weights={reg: 0.5, "kind": 0.5})
    with pytest.raises(UnknownNameError, match=rf"\[{cls!r}\] have no loss"):
        gk.add_loss_output(onx, {reg: "squared_error"}, loss_weights={cls: 0.5})
    with pytest.raises(ValueError, match=r"finite and >= 0"):
        gk.add_loss_output(onx, heads, loss_weights={reg: -1.0})
    with pytest.raises(TypeError, match=r"every output's loss.*losses.get\('huber'"):
        gk.add_loss_output(onx, heads, delta=2.0)
    with pytest.raises(ValueError, match=r"leave output_index out"):
        gk.add_loss_output(onx, heads, output_index=0)
    with pytest.raises(TypeError, match=r"label_name='y' is one name.*dict"):
        gk.add_loss_output(onx, heads, label_name="y")
    with pytest.raises(ValueError, match=r"score_name as a dict"):
        gk.add_loss_output(onx, output_index=reg, loss_weights={reg: 0.5})
    with pytest.raises(ShapeError, match=rf"'sigmoid_log_loss'.*one score.*{cls!r}"):
        gk.add_loss_output(onx, {reg: "squared_error", cls: "sigmoid_log_loss"})
    from graphkit_train import ForwardBackwardTrainer

    with pytest.raises(TypeError, match=r"one loss to one output.*add_loss_output.*Trainer"):
        ForwardBackwardTrainer(onx, loss=heads).fit(x, {reg: price, cls: kind})

    train, reg, cls = _training_graph()
    fitted = _full(train, max_iter=1).fit(x, {reg: price, cls: kind})
    before = fitted.get_state()
    fitted.set_params(warm_start=True)
    with pytest.raises(UnknownNameError, match=rf"no labels for \[{cls!r}\].*{outputs}"):
        fitted.fit(x, {reg: price})
    with pytest.raises(UnknownNameError, match=r"\['kind'\] is no output with a loss"):
        fitted.fit(x, {reg: price, cls: kind, "kind": kind})
    with pytest.raises(ShapeError, match=r"one array of shape \(38, 2\).*loss per output.*dict"):
        fitted.fit(x, price)
    with pytest.raises(ValueError, match=rf"y\[{cls!r}\] holds class labels from 1 to 3.*\[0, 2\]"):
        fitted.fit(x, {reg: price, cls: kind + 1})
    with pytest.raises(DTypeError, match=rf"y\[{cls!r}\] is float.*int64"):
        fitted.fit(x, {reg: price, cls: kind.astype(np.float32)})
    with pytest.raises(ShapeError, match=rf"y\[{reg!r}\] has shape \(38, 3\).*\(38, 2\)"):
        fitted.fit(x, {reg: np.c_[price, price[:, :1]], cls: kind})
    with pytest.raises(ShapeError, match=rf"X has 38 rows but y\[{reg!r}\] has 37"):
        fitted.fit(x, {reg: price[:37], cls: kind})
    with pytest.raises(ValueError, match=rf"y_val\[{cls!r}\] holds class labels"):
        fitted.fit(x, {reg: price, cls: kind}, X_val=x, y_val={reg: price, cls: kind - 1})
    for name, value in fitted.get_state().items():
        np.testing.assert_array_equal(value, before[name])


def test_a_dict_with_one_loss_is_a_graph_with_heads():
    """{output: loss} for one output of two: the graph is trained and checked as a
    graph with heads (y a dict, its labels checked, predict a dict), never as a one-loss
    graph of the first output; the weights follow torch's SGD of that head's loss."""
    x, price, kind, _ = _data()
    onx, reg, cls = _exported(False)
    train = gk.add_loss_output(onx, {cls: "cross_entropy"})
    fitted = _full(train, shuffle=False, optimizer="sgd").fit(x, {cls: kind})
    net = _network()
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    X, K = torch.from_numpy(x), torch.from_numpy(kind)
    for _ in range(EPOCHS):
        for start in range(0, N, BATCH):
            sgd.zero_grad()
            logits = net(X[start : start + BATCH])[1]
            nn.functional.cross_entropy(logits, K[start : start + BATCH]).backward()
            sgd.step()
    state = fitted.get_state()
    assert not any(name.startswith("reg.") for name in state)  # no loss reads that head
    for name, param in net.named_parameters():
        if not name.startswith("reg."):
            np.testing.assert_allclose(state[name], param.detach().numpy(), atol=1e-5)
    predicted = fitted.predict(x)
    assert list(predicted) == [cls]
    with pytest.raises(ValueError, match=rf"y\[{cls!r}\] holds class labels from 3 to 3"):
        _full(train, max_iter=1).fit(x, {cls: np.full(N, 3)})
    with pytest.raises(ShapeError, match="loss per output"):
        _full(train, max_iter=1).fit(x, kind)


def test_the_command_line_refuses_a_loss_per_output(tmp_path, capsys):
    """graphkit-train reads one --label column: a graph with a loss per output is one
    line on stderr and exit code 2, naming the heads and the Python API."""
    from graphkit_train.cli import main

    x, price, kind, _ = _data()
    train, reg, cls = _training_graph()
    onnx.save(train, tmp_path / "two_heads.onnx")
    np.savez(tmp_path / "data.npz", X=x, y=price[:, 0])
    argv = [str(tmp_path / "two_heads.onnx"), "--data", str(tmp_path / "data.npz"), "--quiet"]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1, error
    assert f"a loss per output [{reg!r}, {cls!r}]" in error and "Trainer(model).fit" in error
