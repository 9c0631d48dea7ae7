"""The token cross-entropy (language-model logits (N, T, V), labels (N, T)) and custom
losses with token labels, against independent references: torch's
``F.cross_entropy`` and autograd, numpy written from the formulas, the same SGD steps
done in torch."""

from __future__ import annotations

import pickle

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import DTypeError, ShapeError, losses
from graphkit.dsl import FLOAT, INT64, op, script
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

torch = pytest.importorskip("torch")
F = torch.nn.functional

IGNORE = -100
TOLERANCES = {np.float32: {"rtol": 1e-5, "atol": 1e-6}, np.float64: {"rtol": 1e-10, "atol": 1e-12}}


def token_data(rng, shape, vocabulary, dtype=np.float64, ignored=0.2):
    """Logits ``shape + (vocabulary,)`` and labels ``shape``, some labelled -100."""
    logits = rng.normal(scale=2.0, size=(*shape, vocabulary)).astype(dtype)
    labels = rng.integers(0, vocabulary, shape)
    labels[rng.random(shape) < ignored] = IGNORE
    labels.reshape(len(labels), -1)[0, 0] = IGNORE  # at least one
    return logits, labels


def torch_token_losses(logits, labels, eps):
    """torch's loss of every token (0 for an ignored one), shaped like the labels, and the
    logits tensor it is a function of."""
    z = torch.tensor(logits, requires_grad=True)
    y = torch.tensor(labels)
    per_token = F.cross_entropy(
        z.reshape(-1, z.shape[-1]),
        y.reshape(-1),
        ignore_index=IGNORE,
        label_smoothing=eps,
        reduction="none",
    )
    return per_token.reshape(y.shape), z


def numpy_token_losses(logits, labels, eps):
    """l_t = (1 - eps)(-log p_{t,y_t}) + eps mean_k(-log p_tk), 0 where y_t = -100."""
    z = logits.astype(np.float64)
    shifted = z - z.max(axis=-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    safe = np.where(labels == IGNORE, 0, labels)
    nll = -np.take_along_axis(log_p, safe[..., None], axis=-1)[..., 0]
    smooth = -log_p.mean(axis=-1)
    return np.where(labels == IGNORE, 0.0, (1 - eps) * nll + eps * smooth)


# -- the loss and its gradient -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_value_and_gradient_match_torch(dtype, eps, reduction, rng):
    logits, labels = token_data(rng, (3, 5), 7, dtype)
    loss = losses.get("token_cross_entropy", label_smoothing=eps, reduction=reduction)
    value, grad = loss.value_and_grad(logits, labels)
    per_token, z = torch_token_losses(logits, labels, eps)
    if reduction == "none":  # one value per sample: the sum of its tokens; gradient of the sum
        expected = per_token.sum(dim=1)
        expected.sum().backward()
    else:
        expected = F.cross_entropy(
            z.reshape(-1, 7),
            torch.tensor(labels).reshape(-1),
            ignore_index=IGNORE,
            label_smoothing=eps,
            reduction=reduction,
        )
        expected.backward()
    assert value.dtype == grad.dtype == dtype
    assert value.shape == ((3,) if reduction == "none" else ())
    np.testing.assert_allclose(value, expected.detach().numpy(), **TOLERANCES[dtype])
    np.testing.assert_allclose(grad, z.grad.numpy(), **TOLERANCES[dtype])
    np.testing.assert_allclose(loss(logits, labels), value, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rank_4_logits_and_rank_2_logits_match_torch(dtype, rng):
    """Classes on the last axis, any rank: (N, d1, d2, V) with (N, d1, d2) labels, and
    (N, V) with (N,) labels (torch's (N, V) cross-entropy)."""
    loss = losses.get("lm_cross_entropy", label_smoothing=0.1)
    for shape in [(2, 3, 4), (6,)]:
        logits, labels = token_data(rng, shape, 5, dtype)
        value, grad = loss.value_and_grad(logits, labels)
        per_token, z = torch_token_losses(logits, labels, 0.1)
        expected = per_token.sum() / (labels != IGNORE).sum()  # torch's mean
        expected.backward()
        np.testing.assert_allclose(value, expected.detach().numpy(), **TOLERANCES[dtype])
        np.testing.assert_allclose(grad, z.grad.numpy(), **TOLERANCES[dtype])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_sample_weights_match_the_formula(reduction, rng):
    """mean: sum_i w_i sum_t l_it / sum_i w_i c_i; sum: sum_i w_i sum_t l_it; none: w_i
    sum_t l_it. The value against numpy, the gradient against torch autograd."""
    logits, labels = token_data(rng, (4, 6), 5)
    w = rng.uniform(0.2, 2.0, 4)
    loss = losses.get("causal_lm", label_smoothing=0.1, reduction=reduction)
    value, grad = loss.value_and_grad(logits, labels, w)
    rows = numpy_token_losses(logits, labels, 0.1).sum(axis=1)
    counted = (labels != IGNORE).sum(axis=1)
    expected = {
        "mean": (w * rows).sum() / (w * counted).sum(),
        "sum": (w * rows).sum(),
        "none": w * rows,
    }[reduction]
    np.testing.assert_allclose(value, expected, rtol=1e-10)
    per_token, z = torch_token_losses(logits, labels, 0.1)
    weighted = (torch.tensor(w) * per_token.sum(dim=1)).sum()
    if reduction == "mean":
        weighted = weighted / (torch.tensor(w) * torch.tensor(counted)).sum()
    weighted.backward()
    np.testing.assert_allclose(grad, z.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("weighted", [False, True])
def test_a_batch_with_every_label_ignored_gives_zero(weighted, rng):
    logits, _ = token_data(rng, (2, 3), 4, np.float32)
    labels = np.full((2, 3), IGNORE)
    w = np.ones(2) if weighted else None
    for reduction in ("mean", "sum", "none"):
        loss = losses.get("token_cross_entropy", reduction=reduction)
        value, grad = loss.value_and_grad(logits, labels, w)
        assert np.isfinite(value).all() and not np.any(value)
        assert np.isfinite(grad).all() and not np.any(grad)


def test_another_ignore_index_and_stability(rng):
    """ignore_index=3 ignores the tokens labelled 3 (-100 is then out of range); logits
    of 1e4 give finite values."""
    logits, labels = token_data(rng, (2, 4), 5)
    labels[labels == IGNORE] = 3
    logits[0, 0, 1] = 1e4
    loss = losses.get("token_cross_entropy", ignore_index=3)
    value, grad = loss.value_and_grad(logits, labels)
    z = torch.tensor(logits, requires_grad=True)
    expected = F.cross_entropy(z.reshape(-1, 5), torch.tensor(labels).reshape(-1), ignore_index=3)
    expected.backward()
    assert np.isfinite(value) and np.isfinite(grad).all()
    np.testing.assert_allclose(value, expected.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(grad, z.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_labels_probabilities_and_pickling(rng):
    logits, _ = token_data(rng, (2, 3), 4)
    loss = losses.get("causal_lm", ignore_index=-1, label_smoothing=0.2, reduction="sum")
    np.testing.assert_array_equal(loss.labels(logits), logits.argmax(axis=-1))
    p = loss.probabilities(logits)
    np.testing.assert_allclose(p, torch.softmax(torch.tensor(logits), dim=-1).numpy(), rtol=1e-12)
    copy = pickle.loads(pickle.dumps(loss))
    assert (
        repr(copy)
        == repr(loss)
        == ("Loss('token_cross_entropy', ignore_index=-1, label_smoothing=0.2, reduction='sum')")
    )
    assert loss.label_shape(("N", "T", 9)) == ("N", "T")


# -- refusals ------------------------------------------------------------------------------


def test_labels_out_of_range_are_refused_naming_the_range_and_ignore_index(rng):
    logits, labels = token_data(rng, (2, 3), 4)
    labels[1, 2] = 4
    with pytest.raises(ValueError, match=r"in \[0, 3\], or -100 \(ignore_index\)"):
        losses.get("token_cross_entropy")(logits, labels)
    labels[1, 2] = -5
    with pytest.raises(ValueError, match="from -5 to"):
        losses.get("token_cross_entropy")(logits, labels)


def test_labels_of_another_shape_or_dtype_are_refused(rng):
    logits, labels = token_data(rng, (2, 3), 4)
    loss = losses.get("token_cross_entropy")
    with pytest.raises(ShapeError, match=r"Label shape \(6,\).*\(2, 3, 4\).*\(2, 3\)"):
        loss(logits, labels.reshape(-1))
    with pytest.raises(DTypeError, match=r"y.astype\(numpy.int64\)"):
        loss(logits, labels.astype(np.float64))


# -- training: a tiny language model, the same SGD steps in torch ----------------------------

V, D, N, T = 7, 4, 6, 5


def token_model(embedding: np.ndarray, head: np.ndarray) -> onnx.ModelProto:
    """ids int64 (N, T) -> Gather(embedding (V, D)) -> MatMul(head (D, V)) -> logits (N, T, V)."""
    elem = helper.np_dtype_to_tensor_dtype(embedding.dtype)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["embedding", "ids"], ["hidden"]),
            helper.make_node("MatMul", ["hidden", "head"], ["logits"]),
        ],
        "tiny_lm",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", "T"])],
        [helper.make_tensor_value_info("logits", elem, ["N", "T", V])],
        [numpy_helper.from_array(embedding, "embedding"), numpy_helper.from_array(head, "head")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.fixture
def lm(rng):
    """Weights (float64), token ids and labels (some -100) of the tiny model."""
    embedding, head = rng.normal(size=(V, D)), rng.normal(size=(D, V))
    X, y = rng.integers(0, V, (N, T)), rng.integers(0, V, (N, T))
    y[0, :2] = y[3, 4] = IGNORE
    return embedding, head, X, y


def torch_sgd(embedding, head, X, y, batch_size, lr=0.1, w=None):
    """SGD in torch over the batches of ``batch_size`` rows in order: the weights after."""
    e = torch.tensor(embedding, requires_grad=True)
    h = torch.tensor(head, requires_grad=True)
    optimizer = torch.optim.SGD([e, h], lr=lr)
    for start in range(0, len(X), batch_size):
        rows = slice(start, start + batch_size)
        optimizer.zero_grad()
        logits = e[torch.tensor(X[rows])] @ h
        labels = torch.tensor(y[rows])
        if w is None:
            loss = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE)
        else:  # sum_i w_i sum_t l_it / sum_i w_i c_i
            per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            weights = torch.tensor(w[rows])
            counted = (labels != IGNORE).sum(dim=1)
            loss = (weights * per_token.sum(dim=1)).sum() / (weights * counted).sum()
        loss.backward()
        optimizer.step()
    return e.detach().numpy(), h.detach().numpy()


def fit(kind, model, loss, backend, batch_size, X, y, w=None, weight_name=None):
    """One epoch of SGD at 0.1 over the batches in order: full training of the model with
    the loss appended, or forward/backward training of the prediction model."""
    common = dict(max_iter=1, batch_size=batch_size, learning_rate=0.1, shuffle=False)
    if kind == "full":
        train = gk.add_loss_output(model, loss, weight_name=weight_name)
        trainer = OrtGradientOptimizer(train, backend=backend, **common)
    else:
        trainer = OrtGradientForwardBackwardOptimizer(
            model, learning_loss=loss, backend=backend, **common
        )
    return trainer.fit(X, y, w)


def assert_same_weights(trainer, expected, rtol=1e-5):
    state = trainer.get_state()
    np.testing.assert_allclose(state["embedding"], expected[0], rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(state["head"], expected[1], rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("kind", ["full", "forward_backward"])
@pytest.mark.parametrize("steps", [1, 3])
def test_sgd_steps_match_torch(backend, kind, steps, lm):
    embedding, head, X, y = lm
    batch_size = N // steps
    trainer = fit(
        kind, token_model(embedding, head), "token_cross_entropy", backend, batch_size, X, y
    )
    assert_same_weights(trainer, torch_sgd(embedding, head, X, y, batch_size))


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_weighted_float32_step_matches_torch(kind, lm, rng):
    embedding, head, X, y = lm
    w = rng.uniform(0.5, 2.0, N)
    model = token_model(embedding.astype(np.float32), head.astype(np.float32))
    trainer = fit(kind, model, "token_cross_entropy", None, N, X, y, w, "weight")
    assert trainer.get_state()["head"].dtype == np.float32
    assert_same_weights(trainer, torch_sgd(embedding, head, X, y, N, w=w), rtol=1e-5)


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_predict_score_and_classes(kind, lm):
    embedding, head, X, y = lm
    trainer = fit(kind, token_model(embedding, head), "causal_lm", None, N, X, y)
    state = trainer.get_state()
    logits = state["embedding"][X] @ state["head"]
    predicted = trainer.predict(X)
    np.testing.assert_array_equal(predicted, logits.argmax(axis=-1))
    counted = y != IGNORE
    assert trainer.score(X, y) == pytest.approx((predicted == y)[counted].mean(), rel=1e-12)
    np.testing.assert_array_equal(trainer.classes_, np.arange(V))
    assert trainer.predict_proba(X).shape == (N, T, V)


def test_the_label_input_is_declared_per_token(lm):
    train = gk.add_loss_output(token_model(*lm[:2]), "token_cross_entropy")
    label = next(i for i in train.graph.input if i.name == "label")
    assert label.type.tensor_type.elem_type == TensorProto.INT64
    assert [d.dim_param or d.dim_value for d in label.type.tensor_type.shape.dim] == ["N", "T"]


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_trainers_refuse_bad_token_labels_naming_the_fix(kind, lm):
    embedding, head, X, y = lm
    model = token_model(embedding, head)
    bad = y.copy()
    bad[2, 2] = V
    with pytest.raises(ValueError, match=rf"in \[0, {V - 1}\], or -100 \(ignore_index\)"):
        fit(kind, model, "token_cross_entropy", None, N, X, bad)
    with pytest.raises(
        ShapeError, match=rf"y has shape \({N}, {T}, 1\).*pass y of shape \({N}, T\)"
    ):
        fit(kind, model, "token_cross_entropy", None, N, X, y[..., None])
    with pytest.raises(ShapeError, match=rf"y has shape \({N}, 3\).*pass y of shape \({N}, {T}\)"):
        fit(kind, model, "token_cross_entropy", None, N, X, y[:, :3])
    with pytest.raises(DTypeError, match=r"Pass y.astype\(numpy.int64\)"):
        fit(kind, model, "token_cross_entropy", None, N, X, y.astype(np.float64))


# -- a custom loss with token labels ---------------------------------------------------------


@script()
def masked_token_nll(prediction: FLOAT, label: INT64["N", "T"]) -> FLOAT:  # noqa: UP037
    """-sum_t log softmax(z_t)_{y_t} / count(y_t != -100), written by hand."""
    log_p = op.LogSoftmax(prediction, axis=-1)
    classes = op.Range(
        op.Constant(value_int=0),
        op.Squeeze(op.Shape(prediction, start=-1)),
        op.Constant(value_int=1),
    )
    onehot = op.CastLike(
        op.Equal(op.Unsqueeze(label, op.Constant(value_ints=[-1])), classes), prediction
    )
    counted = op.CastLike(op.Not(op.Equal(label, op.Constant(value_int=-100))), prediction)
    return op.Neg(op.ReduceSum(onehot * log_p, keepdims=0)) / op.ReduceSum(counted, keepdims=0)


@script()
def undeclared_labels(prediction: FLOAT, label: INT64) -> FLOAT:
    return op.ReduceSum(prediction, keepdims=0)


def test_a_custom_loss_gets_token_labels_with_their_shape(lm):
    """Declared INT64["N", "T"]: (N, T) labels; undeclared: the prediction's shape
    without its last axis, (N,) for (N, K) as before, (N, T) for (N, T, V)."""
    loss = losses.custom_loss(masked_token_nll)
    assert loss.label_shape(("N", "T", V)) == ("N", "T")
    assert loss.label_shape(("N", 9, 4, V)) == ("N", "label_1")  # a rank of its own
    undeclared = losses.custom_loss(undeclared_labels)
    assert undeclared.label_shape(("N", "T", V)) == ("N", "T")
    assert undeclared.label_shape(("N", 3)) == ("N",)
    train = gk.add_loss_output(token_model(*lm[:2]), masked_token_nll)
    label = next(i for i in train.graph.input if i.name == "label")
    assert len(label.type.tensor_type.shape.dim) == 2
    logits, labels = token_data(np.random.default_rng(1), (3, 4), 5)
    value, grad = loss.value_and_grad(logits, labels)
    per_token, z = torch_token_losses(logits, labels, 0.0)
    expected = per_token.sum() / (labels != IGNORE).sum()
    expected.backward()
    np.testing.assert_allclose(value, expected.detach().numpy(), rtol=1e-10)
    np.testing.assert_allclose(grad, z.grad.numpy(), rtol=1e-10, atol=1e-12)
    with pytest.raises(ShapeError, match=r"Label shape \(12,\)"):
        loss(logits, labels.reshape(-1))


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_a_custom_token_loss_trains_as_torch(backend, kind, lm):
    embedding, head, X, y = lm
    loss = losses.custom_loss(masked_token_nll)
    trainer = fit(kind, token_model(embedding, head), loss, backend, N, X, y)
    assert_same_weights(trainer, torch_sgd(embedding, head, X, y, N))
