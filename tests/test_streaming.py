"""Training from an iterable of batches, ``fit(batches)``: data that does not fit in memory.

Checked against independent references: ``fit(X, y)`` on the same rows in memory (no
shuffling, the same batch size) in both trainers, numpy's SGD written from the formula
for a linear model (batches of many sizes, more than get a specialized graph), torch's
DataLoader over a TensorDataset, a numpy memmap read in pieces by a generator factory,
sample weights, a model with two inputs (``X`` a dict), held-out batches against the loss
of all their rows; and the refusals (a one-shot generator for several epochs, a batch of
the wrong width or without labels), each naming what to pass or the batch at fault.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx, mlp_onnx
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import ShapeError
from graphkit_train import ForwardBackwardTrainer, Trainer
from graphkit_train.progress import EpochProgress
from graphkit_train.trainers.streaming import SPECIALIZED_SIZES, as_array

TRAINERS = ["full", "forward_backward"]


def make_trainer(kind: str, model: onnx.ModelProto, weighted: bool = False, **kwargs):
    """A trainer of ``model`` (a prediction graph) with the squared error."""
    kwargs.setdefault("optimizer", "sgd")
    if kind == "full":
        weight = "weight" if weighted else None
        return Trainer(gk.add_loss_output(model, "squared_error", weight_name=weight), **kwargs)
    return ForwardBackwardTrainer(model, loss="squared_error", **kwargs)


def batches_of(X, y, w=None, size=10):
    """Rows in order, cut into ``size`` rows (a shorter last batch)."""
    cuts = range(0, len(y), size)
    if w is None:
        return [(_rows(X, slice(i, i + size)), y[i : i + size]) for i in cuts]
    return [(_rows(X, slice(i, i + size)), y[i : i + size], w[i : i + size]) for i in cuts]


def _rows(X, rows):
    return {k: v[rows] for k, v in X.items()} if isinstance(X, dict) else X[rows]


def assert_same_state(a, b, tol=1e-6):
    sa, sb = a.get_state(), b.get_state()
    assert sa.keys() == sb.keys()
    for name in sa:
        np.testing.assert_allclose(sa[name], sb[name], rtol=tol, atol=tol, err_msg=name)


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(103, 4)).astype(np.float32)
    y = (np.tanh(X @ rng.normal(size=(4, 1))) + 0.1).astype(np.float32)
    return X, y


def zero_linear(n=3):
    return linear_regression_onnx(np.zeros((n, 1)), np.zeros(1))


# -- the same result as in-memory data --------------------------------------------------


@pytest.mark.parametrize("kind", TRAINERS)
def test_same_weights_and_losses_as_in_memory(kind, data):
    """An MLP (float32, Adam) over 103 rows in batches of 10, a last batch of 3: the
    same weights and epoch losses as fit(X, y) without shuffling (whose full batches run
    as one Scan per epoch in full training)."""
    X, y = data
    settings = dict(max_iter=3, batch_size=10, optimizer="adam", schedule=0.01)
    memory = make_trainer(kind, mlp_onnx(4, 8, 1), shuffle=False, **settings).fit(X, y)
    streamed = make_trainer(kind, mlp_onnx(4, 8, 1), **settings).fit(batches_of(X, y))
    assert_same_state(memory, streamed)
    np.testing.assert_allclose(streamed.train_losses_, memory.train_losses_, rtol=1e-6)
    assert streamed.get_state()["step"] == 3 * 11
    np.testing.assert_allclose(streamed.predict(X), memory.predict(X), rtol=1e-6, atol=1e-6)
    assert streamed.n_features_in_ == 4


@pytest.mark.parametrize("kind", TRAINERS)
def test_batches_of_many_sizes_follow_numpy_sgd(kind):
    """Linear regression, float64, batches of 17 sizes between 1 and 24: every update is
    numpy's w -= lr 2 X^T (X w + b - y) / n, the epoch loss is the mean of the batch
    losses before their updates, and only SPECIALIZED_SIZES sizes get their own graph."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(200, 3))
    y = X @ np.array([1.5, -2.0, 0.5]) + 0.3 + rng.normal(scale=0.1, size=200)
    cuts = np.cumsum(rng.permutation(np.arange(1, 25))[:17])
    batches = [(X[p], y[p]) for p in np.split(np.arange(200), cuts[cuts < 200]) if len(p)]
    assert len({len(b[1]) for b in batches}) > SPECIALIZED_SIZES
    lr, coef, intercept, losses = 0.05, np.zeros(3), 0.0, []
    for _ in range(2):
        epoch = []
        for Xb, yb in batches:
            d = Xb @ coef + intercept - yb
            epoch.append(np.mean(d * d))
            coef, intercept = coef - lr * 2 * Xb.T @ d / len(d), intercept - lr * 2 * d.mean()
        losses.append(np.mean(epoch))
    trainer = make_trainer(kind, zero_linear(), max_iter=2, schedule=lr).fit(batches)
    state = trainer.get_state()
    np.testing.assert_allclose(state["coef"][:, 0], coef, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(state["intercept"], [intercept], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(trainer.train_losses_, losses, rtol=1e-10)
    assert len(trainer._streamed_sizes) == SPECIALIZED_SIZES
    if kind == "full":
        built = {size for size, _, looped in trainer._fused_runners if not looped}
    else:  # the fused two-call batches, or the four-call ones (the native backend)
        variants = trainer.forward_backward_._variants
        built = {rows for _, rows in [*trainer._agent_runs, *variants] if rows is not None}
    assert built == trainer._streamed_sizes


def test_torch_dataloader_over_a_tensor_dataset(data):
    """A DataLoader of a TensorDataset (float64 tensors: cast to the model's float32),
    shuffling with a seeded generator: numpy's SGD over the batches a twin loader
    yields; len(loader) is the bar's total."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    X, y = data
    dataset = TensorDataset(torch.tensor(X, dtype=torch.float64), torch.tensor(y[:, 0]))

    def loader():
        generator = torch.Generator().manual_seed(3)
        return DataLoader(dataset, batch_size=16, shuffle=True, generator=generator)

    twin = loader()  # the same permutations, epoch after epoch
    lr, coef, intercept = 0.1, np.zeros(4), 0.0
    for _ in range(2):
        for Xb, yb in twin:
            Xb, yb = Xb.numpy().astype(np.float32), yb.numpy().astype(np.float32)
            d = Xb @ coef + intercept - yb
            coef, intercept = coef - lr * 2 * Xb.T @ d / len(d), intercept - lr * 2 * d.mean()
    model = linear_regression_onnx(np.zeros((4, 1), np.float32), np.zeros(1, np.float32))
    trainer = make_trainer("full", model, max_iter=2, schedule=lr).fit(loader())
    state = trainer.get_state()
    np.testing.assert_allclose(state["coef"][:, 0], coef, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["intercept"], [intercept], rtol=1e-5, atol=1e-6)
    tensor = torch.ones(3, 2)
    assert np.shares_memory(as_array(tensor), tensor.numpy())  # CPU tensors: no copy


def test_memmap_read_in_pieces_by_a_generator_factory(data, tmp_path):
    """Rows on disk (np.memmap), read 32 at a time by a function returning a fresh
    generator each epoch: the weights of fit(X, y) in memory."""
    X, y = data
    shape = {"X": X.shape, "y": y.shape}
    for name, array in (("X", X), ("y", y)):
        disk = np.memmap(tmp_path / f"{name}.dat", np.float32, "w+", shape=array.shape)
        disk[:] = array
        disk.flush()
        del disk

    def pieces():
        Xm = np.memmap(tmp_path / "X.dat", np.float32, "r", shape=shape["X"])
        ym = np.memmap(tmp_path / "y.dat", np.float32, "r", shape=shape["y"])
        for start in range(0, len(Xm), 32):
            yield Xm[start : start + 32], ym[start : start + 32]

    settings = dict(max_iter=2, batch_size=32, optimizer="momentum", schedule=0.05)
    memory = make_trainer("full", mlp_onnx(4, 8, 1), shuffle=False, **settings).fit(X, y)
    streamed = make_trainer("full", mlp_onnx(4, 8, 1), **settings).fit(pieces)
    assert_same_state(memory, streamed)


@pytest.mark.parametrize("kind", TRAINERS)
def test_sample_weights_in_the_batches(kind, data):
    X, y = data
    w = np.random.default_rng(2).uniform(0.1, 2, size=len(y)).astype(np.float32)
    settings = dict(max_iter=2, batch_size=20, schedule=0.05)
    model = mlp_onnx(4, 8, 1)
    memory = make_trainer(kind, model, True, shuffle=False, **settings).fit(X, y, w)
    streamed = make_trainer(kind, model, True, **settings).fit(batches_of(X, y, w, 20))
    assert_same_state(memory, streamed)
    unweighted = make_trainer(kind, model, True, **settings).fit(batches_of(X, y, None, 20))
    assert not np.allclose(unweighted.get_state()["W1"], streamed.get_state()["W1"])


def two_inputs(dtype=np.float32) -> onnx.ModelProto:
    """Y = tanh(X W1 + Z W2 + b) V: inputs X (N, 4) and Z (N, 3)."""
    rng = np.random.default_rng(0)
    weights = {
        "W1": rng.normal(size=(4, 6)).astype(dtype),
        "W2": rng.normal(size=(3, 6)).astype(dtype),
        "b": np.zeros(6, dtype),
        "V": rng.normal(size=(6, 1)).astype(dtype),
    }
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["a"]),
        helper.make_node("MatMul", ["Z", "W2"], ["c"]),
        helper.make_node("Add", ["a", "c"], ["s"]),
        helper.make_node("Add", ["s", "b"], ["t"]),
        helper.make_node("Tanh", ["t"], ["h"]),
        helper.make_node("MatMul", ["h", "V"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "two_inputs",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4]),
            helper.make_tensor_value_info("Z", TensorProto.FLOAT, ["N", 3]),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("kind", TRAINERS)
def test_two_inputs_as_a_dict(kind, data):
    X, y = data
    Z = np.random.default_rng(3).normal(size=(len(X), 3)).astype(np.float32)
    inputs = {"X": X, "Z": Z}
    settings = dict(max_iter=2, batch_size=25, schedule=0.05)
    memory = make_trainer(kind, two_inputs(), shuffle=False, **settings).fit(inputs, y)
    streamed = make_trainer(kind, two_inputs(), **settings).fit(batches_of(inputs, y, size=25))
    assert_same_state(memory, streamed)
    with pytest.raises(gk.UnknownNameError, match="training batch 0 .*no array for \\['Z'\\]"):
        make_trainer(kind, two_inputs(), max_iter=1).fit([({"X": X[:5]}, y[:5])])


def two_heads() -> onnx.ModelProto:
    """price = X A + a, (N, 2) values; kind = X B, (N, 3) logits."""
    rng = np.random.default_rng(1)
    weights = {
        "A": rng.normal(size=(4, 2)).astype(np.float32),
        "a": np.zeros(2, np.float32),
        "B": rng.normal(size=(4, 3)).astype(np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["X", "A"], ["XA"]),
        helper.make_node("Add", ["XA", "a"], ["price"]),
        helper.make_node("MatMul", ["X", "B"], ["kind"]),
    ]
    graph = helper.make_graph(
        nodes,
        "two_heads",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 4])],
        [
            helper.make_tensor_value_info("price", TensorProto.FLOAT, ["N", 2]),
            helper.make_tensor_value_info("kind", TensorProto.FLOAT, ["N", 3]),
        ],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_several_targets_and_a_loss_per_output(data):
    """Labels of shape (N, 2) for one output, and y = {output: labels} for a loss per
    output, inside the batches: the weights of fit(X, y) in memory."""
    X, y = data
    rng = np.random.default_rng(8)
    price = np.hstack([y, -y]).astype(np.float32)
    settings = dict(max_iter=2, batch_size=16, schedule=0.05)
    one = linear_regression_onnx(np.zeros((4, 2), np.float32), np.zeros(2, np.float32))
    memory = make_trainer("forward_backward", one, shuffle=False, **settings).fit(X, price)
    streamed = make_trainer("forward_backward", one, **settings).fit(batches_of(X, price, None, 16))
    assert_same_state(memory, streamed)
    kind = rng.integers(0, 3, size=len(X))
    labels = {"price": price, "kind": kind}
    losses = {"price": "squared_error", "kind": "cross_entropy"}
    graph = gk.add_loss_output(two_heads(), losses, loss_weights={"price": 0.7, "kind": 0.3})
    memory = Trainer(graph, shuffle=False, **settings).fit(X, labels)
    batches = [
        (X[i : i + 16], {"price": price[i : i + 16], "kind": kind[i : i + 16]})
        for i in range(0, len(X), 16)
    ]
    streamed = Trainer(graph, **settings).fit(batches)
    assert_same_state(memory, streamed)
    np.testing.assert_allclose(streamed.train_losses_, memory.train_losses_, rtol=1e-6)


# -- held-out data -------------------------------------------------------------------------


def test_held_out_batches_and_early_stopping(data):
    """The loss of held-out batches (of unequal sizes) is the loss of all their rows;
    early stopping takes them, or arrays; without either it is refused."""
    X, y = data
    train, held = batches_of(X[:80], y[:80], size=16), batches_of(X[80:], y[80:], size=10)
    trainer = make_trainer("full", mlp_onnx(4, 8, 1), max_iter=3, validation_every=1)
    trainer.fit(train, X_val=held)
    assert len(trainer.validation_losses_) == 3
    np.testing.assert_allclose(
        trainer.validation_losses_[-1], trainer.compute_loss(X[80:], y[80:]), rtol=1e-6
    )
    settings = dict(max_iter=30, schedule=0.05, early_stopping=True, n_iter_no_change=2)
    stopped = make_trainer("forward_backward", mlp_onnx(4, 8, 1), **settings)
    stopped.fit(lambda: iter(train), X_val=X[80:], y_val=y[80:])
    assert stopped.best_loss_ == min(stopped.validation_losses_)
    np.testing.assert_allclose(stopped.compute_loss(X[80:], y[80:]), stopped.best_loss_)
    with pytest.raises(ValueError, match="early_stopping=True on streamed batches needs"):
        make_trainer("full", zero_linear(4), early_stopping=True).fit(train)
    with pytest.raises(ValueError, match="X_val is a one-shot iterator .* validating every 1"):
        make_trainer("full", zero_linear(4), max_iter=2, early_stopping=True).fit(
            train, X_val=iter(held)
        )


def test_held_out_batches_of_several_summed_losses_add_up(data):
    """Several heads, each reduction="sum": the streamed held-out loss is the sum over
    every held-out row, as in memory (it was averaged by rows)."""
    X, y = data
    rng = np.random.default_rng(9)
    price, kind = np.hstack([y, -y]).astype(np.float32), rng.integers(0, 3, size=len(X))
    losses = {
        "price": gk.losses.get("squared_error", reduction="sum"),
        "kind": gk.losses.get("cross_entropy", reduction="sum"),
    }
    graph = gk.add_loss_output(two_heads(), losses)
    trainer = Trainer(graph, max_iter=1, schedule=1e-4, validation_every=1)
    held = [
        (X[i : i + 16], {"price": price[i : i + 16], "kind": kind[i : i + 16]})
        for i in range(80, len(X), 16)
    ]
    trainer.fit(X[:80], {"price": price[:80], "kind": kind[:80]}, X_val=held)
    expected = trainer.compute_loss(X[80:], {"price": price[80:], "kind": kind[80:]})
    np.testing.assert_allclose(trainer.validation_losses_[-1], expected, rtol=1e-5)


def test_a_bad_held_out_batch_keeps_the_last_complete_epoch():
    rng = np.random.default_rng(6)
    good = batches_of(rng.normal(size=(30, 3)), rng.normal(size=30))
    trainer = make_trainer("full", zero_linear(), max_iter=1)
    trainer.fit(good)
    before, losses = trainer.get_state(), list(trainer.train_losses_)
    trainer.set_params(warm_start=True, validation_every=1)
    bad = [(np.ones((5, 2)), np.ones(5))]  # 2 features for 3
    with pytest.raises(ShapeError, match="held-out batch 0 .*after epoch 2"):
        trainer.fit(good, X_val=bad)
    assert trainer.train_losses_ == losses
    for name, value in trainer.get_state().items():
        np.testing.assert_array_equal(value, before[name])


# -- refusals and errors -------------------------------------------------------------------


@pytest.fixture(scope="module")
def linear_trainer():
    """A built trainer for 3 features, fitted again by each test."""
    return make_trainer("full", zero_linear(), max_iter=1)


def test_one_shot_generator_for_several_epochs_is_refused(linear_trainer):
    X, y = np.ones((20, 3)), np.ones(20)
    generator = (b for b in batches_of(X, y))
    trainer = make_trainer("full", zero_linear(), max_iter=3)
    with pytest.raises(ValueError, match="one-shot iterator .* max_iter=3 reads it 3 times"):
        trainer.fit(generator)
    with pytest.raises(ValueError, match="a function returning a fresh iterator"):
        trainer.fit(generator)
    assert not trainer.__sklearn_is_fitted__()
    linear_trainer.fit(generator)  # one epoch reads it once
    assert linear_trainer.get_state()["step"] == 2


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ((np.ones((5, 2)), np.ones(5)), ShapeError, "training batch 3 .*epoch 1: X has 2 feat"),
        (np.ones((5, 3)), ValueError, "training batch 3 .* has no y: .* this batch is one ndarray"),
        ((np.ones((5, 3)),), ValueError, "training batch 3 .* has no y: .* is a tuple of 1 elem"),
        ((np.ones((5, 3)), None), ValueError, "training batch 3 .* has no y \\(it is None\\)"),
        ((np.ones((5, 3)), np.ones(4)), ShapeError, "training batch 3 .*X has 5 rows but y"),
        ({"X": np.ones((5, 3))}, TypeError, "training batch 3 .* is a dict"),
        ((np.ones((5, 3)), np.ones(5), np.ones(5), 1), ValueError, "has 4 elements"),
        ((np.nan * np.ones((5, 3)), np.ones(5)), ValueError, "batch 3 .*NaN or infinity"),
    ],
)
def test_a_bad_batch_is_named_and_the_epoch_rolled_back(linear_trainer, batch, error, match):
    """The error names the batch (from 0) and the epoch; the weights are those of the
    last complete epoch."""
    rng = np.random.default_rng(4)
    good = batches_of(rng.normal(size=(30, 3)), rng.normal(size=30))
    trainer = linear_trainer.set_params(max_iter=1, warm_start=False)
    trainer.fit(good)
    before = trainer.get_state()
    trainer.set_params(warm_start=True)
    with pytest.raises(error, match=match):
        trainer.fit([*good, batch])
    after = trainer.get_state()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name])


def test_an_error_of_the_iterable_restores_the_last_complete_epoch():
    rng = np.random.default_rng(5)
    good = batches_of(rng.normal(size=(40, 3)), rng.normal(size=40))
    calls = []

    def flaky():
        calls.append(1)
        for index, batch in enumerate(good):
            if len(calls) == 2 and index == 2:
                raise OSError("disk read failed")
            yield batch

    trainer = make_trainer("forward_backward", zero_linear(), max_iter=3, schedule=0.05)
    with pytest.raises(OSError, match="disk read failed"):
        trainer.fit(flaky)
    one_epoch = make_trainer("forward_backward", zero_linear(), max_iter=1, schedule=0.05)
    assert_same_state(trainer, one_epoch.fit(good), tol=0)
    assert len(trainer.train_losses_) == 1


def test_what_streaming_does_not_take(linear_trainer):
    X, y = np.ones((20, 3)), np.ones(20)
    batches = batches_of(X, y)
    with pytest.raises(ValueError, match="iterable of batches \\(generator\\), which hold"):
        linear_trainer.fit((b for b in batches), y)
    with pytest.raises(ValueError, match="sample_weight= is for in-memory data"):
        linear_trainer.fit(batches, None, np.ones(20))
    with pytest.raises(ValueError, match="yielded no batch in epoch 1"):
        linear_trainer.fit(lambda: iter([]))
    with pytest.raises(TypeError, match="must return an iterable of \\(X, y\\) batches"):
        linear_trainer.fit(lambda: 3)
    with pytest.raises(ValueError, match="This estimator requires y"):
        linear_trainer.fit(X)  # arrays without labels stay arrays
    with pytest.raises(ValueError, match="batch 0 .*starts with a scalar"):
        linear_trainer.fit([[1.0, 2.0, 3.0]])  # rows, not batches
    torch = pytest.importorskip("torch")
    from torch.utils.data import TensorDataset

    with pytest.raises(TypeError, match="pass a torch.utils.data.DataLoader"):
        linear_trainer.fit(TensorDataset(torch.ones(4, 3), torch.ones(4)))


def test_shuffle_true_warns_the_default_does_not(linear_trainer):
    batches = batches_of(np.ones((20, 3)), np.ones(20))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        linear_trainer.set_params(shuffle=None, warm_start=False).fit(batches)
        linear_trainer.set_params(shuffle=False).fit(batches)
    with pytest.warns(UserWarning, match="shuffle=True does not apply to streamed batches"):
        linear_trainer.set_params(shuffle=True).fit(batches)
    linear_trainer.set_params(shuffle=None)


# -- progress and checkpoints -------------------------------------------------------------


def test_progress_counts_the_batches(linear_trainer, capsys):
    rng = np.random.default_rng(6)
    batches = batches_of(rng.normal(size=(25, 3)), rng.normal(size=25))
    linear_trainer.set_params(max_iter=2, verbose=1, warm_start=False).fit(batches)
    linear_trainer.set_params(max_iter=1, verbose=0)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all("  3 batches  " in line for line in lines)
    stream = io.StringIO()
    progress = EpochProgress(2, stream=stream, bar=True)
    for epoch in (1, 2):
        progress.start_epoch(3)  # len(batches), as for a list or a DataLoader
        for _ in range(3):
            progress.batch()
        progress.update(epoch, 0.5, None, 0.01, 3)
    progress.close()
    shown = stream.getvalue()
    assert "batches:   0%|          | 0/3" in shown  # the total, from len()
    assert "2/2" in shown and "batches=3" in shown


def test_checkpoint_resumes_a_streamed_run(tmp_path):
    """Two epochs with a checkpoint, then the same call for four: the weights of four
    uninterrupted epochs; one epoch is left, so a generator is accepted."""
    rng = np.random.default_rng(7)
    batches = batches_of(rng.normal(size=(30, 3)), rng.normal(size=30))
    path = tmp_path / "run.ckpt"
    make_trainer("full", zero_linear(), max_iter=2, optimizer="adam").fit(batches, checkpoint=path)
    resumed = make_trainer("full", zero_linear(), max_iter=3, optimizer="adam")
    resumed.fit(batches, checkpoint=path)
    resumed.set_params(max_iter=4).fit(iter(batches), checkpoint=path)
    straight = make_trainer("full", zero_linear(), max_iter=4, optimizer="adam").fit(batches)
    assert_same_state(resumed, straight, tol=1e-12)
    assert len(resumed.train_losses_) == 4
