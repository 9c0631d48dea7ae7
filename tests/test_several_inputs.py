"""Models with several inputs: ``fit(X={input name: array}, y)``, as onnxruntime's feeds.

Two torch networks, each exported by both exporters: numeric features beside a second
float tensor, and float features beside int64 ids read through ``nn.Embedding`` (fed,
never differentiated). Both trainers follow torch's SGD of the same network from the
same initial weights over the same batches (the same shuffling permutations, a shorter
last batch, sample weights); predict, score, early stopping, checkpoints and the
portable exports take the same dict.
"""

from __future__ import annotations

import io
import pickle
import warnings

import numpy as np
import onnx
import pytest

import graphkit as gk
from graphkit import DTypeError, ShapeError, UnknownNameError

torch = pytest.importorskip("torch")
nn = torch.nn


class TwoTensors(nn.Module):
    """Y = W3 tanh(W1 x + b1 + W2 z + b2): numeric features and a second float tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(4, 8)
        self.other = nn.Linear(3, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x, z):  # noqa: ANN001, ANN201
        return self.head(torch.tanh(self.features(x) + self.other(z)))


class WithIds(nn.Module):
    """Y = W2 tanh(W1 x + b + mean_t E[ids_t]): float features and int64 ids."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(4, 8)
        self.embedding = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x, ids):  # noqa: ANN001, ANN201
        return self.head(torch.tanh(self.features(x) + self.embedding(ids).mean(dim=1)))


NETWORKS = {"two_tensors": (TwoTensors, "Z"), "ids": (WithIds, "ids")}


def _network(kind: str) -> nn.Module:
    torch.manual_seed(0)
    return NETWORKS[kind][0]()


def _export(net: nn.Module, examples: dict[str, np.ndarray], dynamo: bool) -> onnx.ModelProto:
    """As tests/zoo/models.py's torch_export, for several inputs (batch N on each)."""
    net.eval()
    names = list(examples)
    args = tuple(torch.as_tensor(a[:2]) for a in examples.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("N", min=1)
            program = torch.onnx.export(
                net,
                args,
                dynamo=True,
                input_names=names,
                output_names=["Y"],
                dynamic_shapes=tuple({0: batch} for _ in names),
                opset_version=18,
                verbose=False,
            )
            return program.model_proto
        buffer = io.BytesIO()
        torch.onnx.export(
            net,
            args,
            buffer,
            input_names=names,
            output_names=["Y"],
            dynamic_axes={**{n: {0: "N"} for n in names}, "Y": {0: "N"}},
            opset_version=18,
            dynamo=False,
        )
    return onnx.load_from_string(buffer.getvalue())


def _data(kind: str, n: int = 38) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    if kind == "two_tensors":
        second = rng.normal(size=(n, 3)).astype(np.float32)
        y = x @ [1.0, -1.0, 0.5, 2.0] + np.sin(second).sum(1)
    else:
        second = rng.integers(0, 10, size=(n, 5)).astype(np.int64)
        y = x @ [1.0, -1.0, 0.5, 2.0] + (second % 3).mean(1)
    w = rng.uniform(0.2, 2.0, size=n).astype(np.float32)
    return {"X": x, NETWORKS[kind][1]: second}, y.astype(np.float32), w


def _torch_sgd(kind, X, y, w, epochs, batch_size, lr, random_state):
    """torch's SGD of the same network over the batches graphkit draws: each epoch's
    numpy permutation (default_rng(random_state)), batches of batch_size rows."""
    net = _network(kind)
    sgd = torch.optim.SGD(net.parameters(), lr=lr)
    rng = np.random.default_rng(random_state)
    tensors = [torch.from_numpy(a) for a in X.values()]
    target, weights = torch.from_numpy(y).reshape(-1, 1), torch.from_numpy(w)
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(y)))
        for start in range(0, len(y), batch_size):
            rows = order[start : start + batch_size]
            sgd.zero_grad()
            out = net(*(t[rows] for t in tensors))
            wb = weights[rows]
            loss = (wb[:, None] * (out - target[rows]) ** 2).sum() / wb.sum()
            loss.backward()
            sgd.step()
    return net


def _trainer(kind: str, onx: onnx.ModelProto, **settings):
    from graphkit_train import ForwardBackwardTrainer, Trainer

    defaults = dict(max_iter=3, batch_size=8, optimizer="sgd", shuffle=True, random_state=5)
    settings = {**defaults, **settings}
    if kind == "forward_backward":
        return ForwardBackwardTrainer(onx, **settings)
    return Trainer(gk.add_loss_output(onx, weight_name="weight"), **settings)


def _max_difference(state: dict[str, np.ndarray], net: nn.Module) -> float:
    initial = {}
    for name, param in net.named_parameters():
        assert name in state, (name, sorted(state))
        initial[name] = np.abs(state[name] - param.detach().numpy().reshape(state[name].shape))
    return max(float(d.max()) for d in initial.values())


@pytest.mark.parametrize("trainer", ["full", "forward_backward"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("kind", sorted(NETWORKS))
def test_two_inputs_train_like_torch_sgd(kind, dynamo, trainer):
    """Shuffled epochs (every input permuted alike), a shorter last batch, sample
    weights: the weights follow torch's SGD to ~1e-5."""
    X, y, w = _data(kind)
    onx = _export(_network(kind), X, dynamo)
    assert len([i for i in onx.graph.input if i.name in X]) == 2
    fitted = _trainer(trainer, onx).fit(X, y, sample_weight=w)
    net = _torch_sgd(kind, X, y, w, 3, 8, 0.01, random_state=5)
    assert _max_difference(fitted.get_state(), net) < 1e-5
    # the ids are fed, never differentiated: the embedding table is trained, not them
    assert not any("ids" == name for name in fitted.weights_to_train_)
    with torch.no_grad():
        expected = net(*(torch.from_numpy(a) for a in X.values())).numpy()[:, 0]
    np.testing.assert_allclose(fitted.predict(X), expected, rtol=1e-5, atol=1e-6)
    if trainer == "forward_backward" and fitted._backend.name == "ort_training":
        # both inputs go through onnxruntime-training's fused two-call batch
        assert fitted._fuses and fitted._agent_runs


@pytest.mark.parametrize("steps_per_run,static", [(1, False), (3, True)])
def test_every_way_full_training_runs_batches_slices_every_input(steps_per_run, static):
    """One run per batch (the step for any batch size) and a Scan over 3 batches a run."""
    X, y, w = _data("ids")
    onx = _export(_network("ids"), X, False)
    settings = dict(steps_per_run=steps_per_run, static_shapes=static)
    fitted = _trainer("full", onx, **settings).fit(X, y, sample_weight=w)
    net = _torch_sgd("ids", X, y, w, 3, 8, 0.01, random_state=5)
    assert _max_difference(fitted.get_state(), net) < 1e-5


@pytest.mark.parametrize("trainer", ["full", "forward_backward"])
def test_validation_early_stopping_score_checkpoints_and_pickling(trainer, tmp_path):
    from sklearn.metrics import r2_score

    X, y, w = _data("ids", n=60)
    onx = _export(_network("ids"), X, False)
    fitted = _trainer(
        trainer, onx, max_iter=30, early_stopping=True, n_iter_no_change=3, validation_fraction=0.2
    ).fit(X, y)
    assert fitted.best_loss_ == min(fitted.validation_losses_)
    train = {n: a[:45] for n, a in X.items()}
    held_out = {n: a[45:] for n, a in X.items()}
    fitted.set_params(early_stopping=False, max_iter=4, validation_every=1)
    fitted.fit(train, y[:45], sample_weight=w[:45], X_val=held_out, y_val=y[45:])
    assert len(fitted.validation_losses_) == 4
    prediction = fitted.predict(held_out)
    assert fitted.score(held_out, y[45:]) == pytest.approx(r2_score(y[45:], prediction), rel=1e-6)
    assert fitted.compute_loss(held_out, y[45:]) == pytest.approx(
        np.mean((prediction - y[45:]) ** 2), rel=1e-5
    )
    path = tmp_path / "run.ckpt"
    fitted.save_checkpoint(path)
    resumed = _trainer(trainer, onx).load_checkpoint(path)
    np.testing.assert_array_equal(resumed.predict(held_out), prediction)
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(fitted)).predict(X), fitted.predict(X))
    graphs = fitted.save_onnx_graph(bytes)
    trained = onnx.load_from_string(graphs["trained"])
    assert {i.name for i in trained.graph.input} >= set(X)
    np.testing.assert_allclose(gk.run(trained, X)["Y"][:, 0], fitted.predict(X), rtol=1e-6)


def test_portable_step_epoch_and_training_info_take_every_input(tmp_path):
    """The exports name both inputs; the exported step trains on onnx.reference as the
    trainer does (PortableTrainer with the same dict)."""
    from graphkit.portable_trainer import PortableTrainer
    from graphkit.training.epoch import PERMUTATION

    X, y, w = _data("two_tensors")
    onx = _export(_network("two_tensors"), X, False)
    step_trainer = _trainer("full", onx, max_iter=1)
    step = step_trainer.export_training_step()
    assert {"X", "Z", "label", "weight"} <= {i.name for i in step.graph.input}
    ours = PortableTrainer(step, batch_size=8, random_state=5, runtime="reference")
    ours.fit(X, y, w, epochs=2)
    theirs = _trainer("full", onx, max_iter=2).fit(X, y, sample_weight=w)
    for name, value in theirs.get_state().items():
        np.testing.assert_allclose(ours.state()[name], value, rtol=1e-5, atol=1e-6)
    epoch = theirs.export_training_epoch()
    assert {"X", "Z", "label", "weight", PERMUTATION} <= {i.name for i in epoch.graph.input}
    info = theirs.export_training_info(tmp_path / "model.trainable.onnx")
    onnx.checker.check_model(info, full_check=True)
    with pytest.raises(ValueError, match=r"2 feature inputs \['X', 'Z'\].*dict"):
        PortableTrainer(step).fit(X["X"], y)


def test_add_loss_output_on_two_inputs(rng):
    X, y, w = _data("two_tensors")
    net = _network("two_tensors")
    train = gk.add_loss_output(_export(net, X, True), "huber", weight_name="weight")
    assert [i.name for i in train.graph.input][:4] == ["X", "Z", "label", "weight"]
    with torch.no_grad():
        p = net(*(torch.from_numpy(a) for a in X.values())).numpy()
    d = p[:, 0].astype(np.float64) - y
    huber = np.where(np.abs(d) <= 1, d**2 / 2, np.abs(d) - 0.5)
    loss = gk.run(train, {**X, "label": y[:, None], "weight": w})["loss"]
    assert loss == pytest.approx((w * huber).sum() / w.sum(), rel=1e-5)


@pytest.mark.parametrize("trainer", ["full", "forward_backward"])
def test_inputs_that_do_not_fit_are_refused(trainer):
    """Refused before any training, naming the inputs and the fix; the weights stay."""
    X, y, _ = _data("ids")
    onx = _export(_network("ids"), X, False)
    fitted = _trainer(trainer, onx, max_iter=1).fit(X, y)
    before = fitted.get_state()
    fitted.set_params(warm_start=True)
    with pytest.raises(ShapeError, match=r"one array.*2 inputs \['X', 'ids'\].*pass a dict"):
        fitted.fit(X["X"], y)
    with pytest.raises(ShapeError, match=r"one array.*pass a dict"):
        fitted.predict(X["X"])
    with pytest.raises(
        UnknownNameError, match=r"no array for \['ids'\].*inputs are \['X', 'ids'\]"
    ):
        fitted.fit({"X": X["X"]}, y)
    with pytest.raises(UnknownNameError, match=r"\['token_ids'\] is no input"):
        fitted.fit({**X, "token_ids": X["ids"]}, y)
    with pytest.raises(ShapeError, match=r"one row per sample.*'X': 38.*'ids': 37"):
        fitted.fit({"X": X["X"], "ids": X["ids"][:37]}, y)
    with pytest.raises(DTypeError, match=r"X\['ids'\] holds non-integer values.*int64"):
        fitted.fit({**X, "ids": X["ids"] + 0.5}, y)
    with pytest.raises(ShapeError, match=r"X\['X'\] has 3 features"):
        fitted.fit({**X, "X": X["X"][:, :3]}, y)
    for name, value in fitted.get_state().items():
        np.testing.assert_array_equal(value, before[name])
    # integral floats for the ids are fine (a CSV's numbers): cast to int64
    fitted.set_params(warm_start=False).fit({**X, "ids": X["ids"].astype(np.float64)}, y)
