"""Weights trained apart or as one, as torch trains them.

torch's TorchScript exporter merges initializers of equal value: the weights (ones) and
biases (zeros) of two fresh LayerNorms become one tensor each, read by both layers.
graphkit gives each parameter slot its own copy by default, so that training follows
torch; ``untie_shared_weights=False`` keeps weights tied on purpose.

The other way round, one torch parameter may come out of an exporter as two tensors: a
GPT-2's output projection is its token embedding, whose transpose the exporters fold into
an initializer of its own. ``tie_weights=True`` (the default) trains them as one.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS
from onnx import TensorProto, helper, numpy_helper
from zoo.models import torch_export

import graphkit as gk
from graphkit.prepare import prepare_for_training
from graphkit.tied_weights import tie_transposed_copies

torch = pytest.importorskip("torch")


def _network():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.LayerNorm(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 8),
        torch.nn.LayerNorm(8),
        torch.nn.Linear(8, 1),
    )


def _torchscript_export(net) -> onnx.ModelProto:
    return torch_export(net, np.zeros((2, 4), np.float32), dynamo=False)


def _torch_sgd(net, X, y, epochs, batch_size, lr):
    sgd = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for start in range(0, len(X), batch_size):
            sgd.zero_grad()
            out = net(torch.from_numpy(X[start : start + batch_size]))
            target = torch.from_numpy(y[start : start + batch_size]).reshape(-1, 1)
            ((out - target) ** 2).sum(1).mean().backward()  # graphkit's squared error
            sgd.step()
    return {name: p.detach().numpy() for name, p in net.named_parameters()}


@pytest.fixture(scope="module")
def problem():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(32, 4)).astype(np.float32)
    y = (X @ np.array([1.0, -1.0, 0.5, 2.0], np.float32)).astype(np.float32)
    onx = _torchscript_export(_network())
    # "4.weight" = Identity("1.weight"): one tensor read by both LayerNorms
    reads = sum(list(n.input).count("1.weight") for n in onx.graph.node)
    assert reads == 2, "the exporter no longer merges them: use another case"
    return onx, X, y


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_merged_layer_norm_weights_train_apart_like_torch(problem, kind):
    from graphkit_train import ForwardBackwardTrainer, Trainer

    onx, X, y = problem
    settings = dict(max_iter=3, batch_size=8, shuffle=False, optimizer="sgd")
    if kind == "full":
        trainer = Trainer(onx, loss="mse", **settings)
    else:
        trainer = ForwardBackwardTrainer(onx, **settings)
    state = trainer.fit(X, y).get_state()
    expected = _torch_sgd(_network(), X, y, 3, 8, 0.01)
    # the second LayerNorm (torch's "4.") reads the copies of the first one's tensors
    assert {"1.weight.1", "1.bias.1"} <= set(trainer.weights_to_train_)
    pairs = {"1.weight": "1.weight", "1.bias": "1.bias", "4.weight": "1.weight.1"}
    pairs.update({"4.bias": "1.bias.1", "0.weight": "0.weight", "5.bias": "5.bias"})
    for torch_name, name in pairs.items():
        np.testing.assert_allclose(
            state[name], expected[torch_name], rtol=1e-4, atol=1e-6, err_msg=torch_name
        )
    assert not np.allclose(state["1.weight"], state["1.weight.1"])
    # the trained model holds both, and predicts like the trained torch network
    trained = trainer.get_trained_onnx()
    onnx.checker.check_model(trained, full_check=True)
    net = _network()
    _torch_sgd(net, X, y, 3, 8, 0.01)
    with torch.no_grad():
        reference = net.eval()(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(gk.run(trained, {"X": X})["Y"], reference, rtol=1e-4, atol=1e-5)


def test_weights_tied_on_purpose_stay_tied(problem):
    from graphkit_train import Trainer

    onx, X, y = problem
    trainer = Trainer(onx, loss="mse", max_iter=1, untie_shared_weights=False).fit(X, y)
    assert "1.weight.1" not in trainer.weights_to_train_
    trained = trainer.get_trained_onnx()
    assert sum(list(n.input).count("1.weight") for n in trained.graph.node) == 2


# -- weights torch ties: GPT-2's embedding and output projection ------------------------

V, D, T = 50, 16, 8  # vocabulary, width, tokens per row
ROWS, BATCH, LR = 6, 2, 0.5  # three SGD steps


def _gpt2(untied: bool = False):
    """A one-layer GPT-2 (random init, its lm_head the embedding) returning the logits as
    [N, T * V]; with ``untied``, the lm_head a parameter of its own with the same value."""
    transformers = pytest.importorskip("transformers")

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            config = transformers.GPT2Config(
                n_layer=1, n_head=2, n_embd=D, vocab_size=V, n_positions=16
            )
            torch.manual_seed(0)
            self.m = transformers.GPT2LMHeadModel(config)

        def forward(self, ids):
            # a causal mask of the trace's own: transformers' (vmap) does not trace
            t = ids.shape[1]
            mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
            logits = self.m(input_ids=ids, attention_mask=mask, use_cache=False).logits
            return logits.reshape(logits.shape[0], -1)

    net = Logits().eval()
    assert net.m.lm_head.weight is net.m.transformer.wte.weight
    with torch.no_grad():  # dynamo's optimizer drops a zero bias: it would not train
        for name, p in net.named_parameters():
            if name.endswith(".bias") and ".ln_" not in name:
                p.normal_(0.0, 0.02)
    if untied:
        net.m.lm_head.weight = torch.nn.Parameter(net.m.lm_head.weight.detach().clone())
    return net


def _export(net, ids: np.ndarray, exporter: str) -> onnx.ModelProto:
    """``torchscript`` and ``dynamo`` fold lm_head's transpose into an initializer of its
    own; ``torchscript-unfolded`` and ``dynamo-unoptimized`` read the embedding through
    a Transpose node."""
    if exporter == "torchscript":
        return torch_export(net, ids, dynamo=False)
    if exporter == "torchscript-unfolded":
        buffer = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                net,
                (torch.from_numpy(ids[:2]),),
                buffer,
                input_names=["X"],
                output_names=["Y"],
                dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}},
                opset_version=18,
                dynamo=False,
                do_constant_folding=False,
            )
        return onnx.load_from_string(buffer.getvalue())
    rows, tokens = torch.export.Dim("N", min=1), torch.export.Dim("T", min=2, max=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # T dynamic: with T fixed, dynamo folds the learned positions into a constant
        program = torch.onnx.export(
            net,
            (torch.from_numpy(ids[:2]),),
            dynamo=True,
            input_names=["X"],
            output_names=["Y"],
            dynamic_shapes=({0: rows, 1: tokens},),
            opset_version=18,
            optimize=exporter == "dynamo",
            verbose=False,
        )
    return program.model_proto


def _torch_steps(net, X, y):
    """graphkit's squared error (the mean over every value, as MSELoss), SGD at LR."""
    sgd = torch.optim.SGD(net.parameters(), lr=LR)
    for start in range(0, len(X), BATCH):
        sgd.zero_grad()
        out = net(torch.from_numpy(X[start : start + BATCH]))
        ((out - torch.from_numpy(y[start : start + BATCH])) ** 2).mean().backward()
        sgd.step()
    return net


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(0)
    X = rng.integers(0, V, (ROWS, T)).astype(np.int64)
    y = rng.normal(size=(ROWS, T * V)).astype(np.float32)
    initial = _gpt2().m.transformer.wte.weight.detach().numpy().copy()
    trained = _torch_steps(_gpt2(), X, y)
    return X, y, initial, trained


_exports: dict[str, onnx.ModelProto] = {}


def _gpt2_onnx(exporter: str, X: np.ndarray) -> onnx.ModelProto:
    if exporter not in _exports:
        _exports[exporter] = _export(_gpt2(), X, exporter)
    return _exports[exporter]


def _train(onx, X, y, backend=None, **params):
    from graphkit_train import Trainer

    settings = dict(max_iter=1, batch_size=BATCH, shuffle=False, optimizer="sgd", schedule=LR)
    return Trainer(onx, loss="squared_error", backend=backend, **settings, **params).fit(X, y)


def _shaped(model: onnx.ModelProto, dims: list[int]) -> list[str]:
    return [t.name for t in model.graph.initializer if list(t.dims) == dims]


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("exporter", ["torchscript", "torchscript-unfolded", "dynamo"])
def test_gpt2_embedding_and_output_projection_train_as_one_like_torch(tokens, exporter, backend):
    X, y, initial, expected = tokens
    onx = _gpt2_onnx(exporter, X)
    (embedding,) = _shaped(onx, [V, D])
    transposed = _shaped(onx, [D, V])
    if exporter == "torchscript-unfolded":  # one initializer, read by a Transpose too
        assert transposed == []
        assert any(n.op_type == "Transpose" and n.input[0] == embedding for n in onx.graph.node)
    else:  # the transpose folded into a second initializer
        assert len(transposed) == 1
    trainer = _train(onx, X, y, backend)
    # one weight trained: the embedding, read through a Transpose by the projection
    assert embedding in trainer.weights_to_train_
    assert not [w for w in trainer.weights_to_train_ if w.startswith(embedding + ".")]
    assert not set(transposed) & set(trainer.weights_to_train_)
    assert _shaped(trainer.train_onnx_, [D, V]) == []
    state = trainer.get_state()
    wte = expected.m.transformer.wte.weight.detach().numpy()
    np.testing.assert_allclose(state[embedding], wte, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(state[embedding] - initial, wte - initial, rtol=1e-3, atol=1e-7)
    # the trained model reads the trained embedding in both places, and predicts as torch
    trained = trainer.get_trained_onnx()
    assert _shaped(trained, [D, V]) == []
    np.testing.assert_array_equal(
        numpy_helper.to_array(next(t for t in trained.graph.initializer if t.name == embedding)),
        state[embedding],
    )
    with torch.no_grad():
        reference = expected(torch.from_numpy(X)).numpy()
    np.testing.assert_allclose(gk.run(trained, {"X": X})["Y"], reference, rtol=1e-4, atol=1e-5)
    # the exported model given (the one exported by torch), and the saved one
    from_original = trainer.get_trained_onnx(onx)
    saved = onnx.load_from_string(trainer.save_onnx_graph(bytes)["trained"])
    for model in (from_original, saved):
        assert _shaped(model, [D, V]) == []
        np.testing.assert_allclose(gk.run(model, {"X": X})["Y"], reference, rtol=1e-4, atol=1e-5)


def test_gpt2_forward_backward_trainer_trains_the_tied_embedding_as_one(tokens):
    from graphkit_train import ForwardBackwardTrainer

    X, y, _, expected = tokens
    onx = _gpt2_onnx("torchscript", X)
    (embedding,) = _shaped(onx, [V, D])
    settings = dict(max_iter=1, batch_size=BATCH, shuffle=False, optimizer="sgd", schedule=LR)
    trainer = ForwardBackwardTrainer(onx, loss="squared_error", **settings).fit(X, y)
    assert _shaped(onx, [D, V])[0] not in trainer.weights_to_train_
    wte = expected.m.transformer.wte.weight.detach().numpy()
    np.testing.assert_allclose(trainer.get_state()[embedding], wte, rtol=1e-5, atol=1e-8)
    with torch.no_grad():
        reference = expected(torch.from_numpy(X)).numpy()
    predicted = gk.run(trainer.get_trained_onnx(), {"X": X})["Y"]
    np.testing.assert_allclose(predicted, reference, rtol=1e-4, atol=1e-5)


def test_dynamo_unoptimized_gpt2_keeps_one_embedding(tokens):
    """dynamo with optimize=False reads the embedding through a Transpose node, as
    TorchScript without constant folding does; its graph (SplitToSequence, SequenceAt)
    has no gradient in either backend, so only the choice of weights is checked."""
    X = tokens[0]
    onx = _gpt2_onnx("dynamo-unoptimized", X)
    (embedding,) = _shaped(onx, [V, D])
    assert _shaped(onx, [D, V]) == []
    weights = prepare_for_training(onx, None)[1]
    assert embedding in weights and f"{embedding}.1" not in weights
    assert f"{embedding}.1" in prepare_for_training(onx, None, tie_weights=False)[1]


def test_gpt2_untied_with_tie_weights_false_trains_the_copy_apart(tokens):
    """Today's behaviour on request: two weights, as an untied torch model trains them."""
    X, y, initial, tied = tokens
    onx = _gpt2_onnx("torchscript", X)
    (embedding,) = _shaped(onx, [V, D])
    (copy,) = _shaped(onx, [D, V])
    trainer = _train(onx, X, y, tie_weights=False)
    assert {embedding, copy} <= set(trainer.weights_to_train_)
    state = trainer.get_state()
    untied = _torch_steps(_gpt2(untied=True), X, y)
    wte, lm_head = (
        p.detach().numpy() for p in (untied.m.transformer.wte.weight, untied.m.lm_head.weight)
    )
    np.testing.assert_allclose(state[embedding], wte, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(state[copy], lm_head.T, rtol=1e-5, atol=1e-8)
    tied_wte = tied.m.transformer.wte.weight.detach().numpy()
    assert not np.allclose(state[embedding] - initial, tied_wte - initial, rtol=0.1, atol=0)
    with torch.no_grad():
        reference = untied(torch.from_numpy(X)).numpy()
    trained = trainer.get_trained_onnx()
    np.testing.assert_allclose(gk.run(trained, {"X": X})["Y"], reference, rtol=1e-4, atol=1e-5)


# -- which tensors are tied: hand-built graphs ----------------------------------------


def _two_layers(a: np.ndarray, b: np.ndarray) -> onnx.ModelProto:
    """Y = (X A) B, A and B initializers."""
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "A"], ["H"]),
            helper.make_node("MatMul", ["H", "B"], ["Y"]),
        ],
        "two_layers",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, a.shape[0]])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, b.shape[1]])],
        [numpy_helper.from_array(a, "A"), numpy_helper.from_array(b, "B")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _matrix(rows: int = 10, columns: int = 12) -> np.ndarray:
    return np.random.default_rng(1).normal(size=(rows, columns)).astype(np.float32)


def test_an_exact_transposed_copy_is_tied_a_near_one_is_not():
    a = _matrix()
    prepared, weights = prepare_for_training(_two_layers(a, a.T.copy()), None)
    assert weights == ["A"] and _shaped(prepared, [12, 10]) == []
    assert [n.input[0] for n in prepared.graph.node if n.op_type == "Transpose"] == ["A"]
    X = np.random.default_rng(2).normal(size=(3, 10)).astype(np.float32)
    np.testing.assert_allclose(gk.run(prepared, {"X": X})["Y"], X @ a @ a.T, rtol=1e-5)
    # a copy named in weights_to_train stands for the weight
    assert prepare_for_training(_two_layers(a, a.T.copy()), ["B"])[1] == ["A"]
    near = a.T.copy()
    near[5, 6] += np.float32(1e-7)  # inside: its corners, which are compared first, agree
    assert near[5, 6] != a[6, 5]
    assert prepare_for_training(_two_layers(a, near), None)[1] == ["A", "B"]
    assert prepare_for_training(_two_layers(a, a.T.copy()), None, tie_weights=False)[1] == [
        "A",
        "B",
    ]


@pytest.mark.parametrize("kind", ["all-equal", "symmetric", "equal copy", "vector", "dtypes"])
def test_tensors_that_may_be_distinct_parameters_are_not_tied(kind):
    """Equal values by construction, not one torch parameter: all-equal tensors (fresh
    ones and zeros, which exporters merge between distinct parameters), a symmetric
    matrix (an identity init: its equal copy looks transposed), an equal copy (deep-copied
    layers, such as torch.nn.TransformerEncoder's), vectors, different dtypes."""
    a = _matrix()
    b = a.T.copy()
    if kind == "all-equal":
        a, b = np.ones((3, 4), np.float32), np.ones((4, 3), np.float32)
    elif kind == "symmetric":
        a = np.eye(4, dtype=np.float32) + np.float32(0.5)
        b = a.copy()
    elif kind == "equal copy":
        a, b = _matrix(4, 4), _matrix(4, 4)
    onx = _two_layers(a, b)
    if kind == "vector":
        onx.graph.initializer[0].CopyFrom(numpy_helper.from_array(a[0], "A"))
        onx.graph.initializer[1].CopyFrom(numpy_helper.from_array(a[0].copy(), "B"))
    elif kind == "dtypes":
        onx.graph.initializer[1].CopyFrom(numpy_helper.from_array(b.astype(np.float64), "B"))
    assert tie_transposed_copies(onx) == (onx, {})
    if kind not in ("vector", "dtypes"):  # a valid graph: both trained
        assert prepare_for_training(onx, None)[1] == ["A", "B"]


def test_a_weight_read_directly_and_through_a_transpose_stays_one():
    """The graph of an export that did not fold the transpose (dynamo, optimize=False):
    the embedding read by a Gather and by Transpose -> MatMul is one weight, where the
    untying of merged tensors would otherwise make two."""
    table = _matrix(12, 10)
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["E", "X"], ["H"]),
            helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
            helper.make_node("MatMul", ["H", "Et"], ["Y"]),
        ],
        "tied",
        [helper.make_tensor_value_info("X", TensorProto.INT64, [None])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 12])],
        [numpy_helper.from_array(table, "E")],
    )
    onx = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    assert prepare_for_training(onx, None)[1] == ["E"]
    assert prepare_for_training(onx, None, tie_weights=False)[1] == ["E", "E.1"]
    assert prepare_for_training(onx, None, untie_shared_weights=False)[1] == ["E"]
