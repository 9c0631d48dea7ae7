"""The README's "Exporting a model for training" recipes, each against torch's training.

torch's exporters fold what a user may want to train: TorchScript's default export
(``TrainingMode.EVAL`` with constant folding) and the dynamo exporter's default
``optimize=True`` merge an eval-mode BatchNorm into the Conv before it, so BatchNorm's
scale and shift are no longer weights (and nothing in the graph says so). Each recipe
keeps them; graphkit then trains the network as torch trains it in eval mode. A model
exported in training mode trains as torch's train() (tests/test_train_mode.py).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest

import graphkit as gk
from graphkit.prepare import prepare_for_training
from graphkit.train_mode import BATCH_STATISTICS, is_marked

torch = pytest.importorskip("torch")

from graphkit_train import ForwardBackwardTrainer, Trainer  # noqa: E402

ROWS, BATCH, EPOCHS, LR = 24, 8, 2, 0.01


class _Net(torch.nn.Module):
    """Conv -> BatchNorm -> ReLU (+ a learned positional map) -> Dropout -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.pos = torch.nn.Parameter(torch.randn(1, 4, 6, 6) * 0.1)
        self.drop = torch.nn.Dropout(0.3)
        self.fc = torch.nn.Linear(144, 3)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x))) + self.pos
        return self.fc(self.drop(h).flatten(1))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    net = _Net()
    with torch.no_grad():  # a trained BatchNorm: statistics of its own
        net.bn.running_mean.copy_(torch.randn(4) * 0.2)
        net.bn.running_var.copy_(torch.rand(4) + 0.5)
        net.bn.weight.copy_(torch.rand(4) + 0.5)
        net.bn.bias.copy_(torch.randn(4) * 0.1)
    return net.eval()


def _export(net, recipe: str):
    x = torch.randn(2, 1, 8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if recipe.startswith("dynamo"):
            program = torch.onnx.export(
                net,
                (x,),
                dynamo=True,
                input_names=["X"],
                output_names=["Y"],
                dynamic_shapes=({0: torch.export.Dim("N", min=1)},),
                opset_version=18,
                optimize=recipe == "dynamo default",
                verbose=False,
            )
            return program.model_proto
        options = {
            "torchscript default": {},
            "torchscript PRESERVE": {"training": torch.onnx.TrainingMode.PRESERVE},
            "torchscript do_constant_folding=False": {"do_constant_folding": False},
            "torchscript TRAINING": {"training": torch.onnx.TrainingMode.TRAINING},
        }[recipe]
        buffer = io.BytesIO()
        torch.onnx.export(
            net,
            (x,),
            buffer,
            dynamo=False,
            input_names=["X"],
            output_names=["Y"],
            dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}},
            opset_version=18,
            **options,
        )
    import onnx

    return onnx.load_from_string(buffer.getvalue())


def _data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(ROWS, 1, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=ROWS).astype(np.int64)
    return X, y


def _torch_sgd(net) -> dict[str, np.ndarray]:
    """torch's SGD of the eval-mode network: BatchNorm's running statistics fixed, its
    scale and shift trained, dropout off (what the exported inference graph computes)."""
    X, y = _data()
    optimizer = torch.optim.SGD(net.parameters(), lr=LR)
    for _ in range(EPOCHS):
        for start in range(0, ROWS, BATCH):
            optimizer.zero_grad()
            logits = net(torch.from_numpy(X[start : start + BATCH]))
            loss = torch.nn.functional.cross_entropy(
                logits, torch.from_numpy(y[start : start + BATCH])
            )
            loss.backward()
            optimizer.step()
    return {name: p.detach().numpy() for name, p in net.named_parameters()}


RECIPES = ["torchscript PRESERVE", "torchscript do_constant_folding=False", "dynamo optimize=False"]


@pytest.mark.parametrize("trainer", ["full", "forward_backward"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_keeps_batch_norm_trainable_and_trains_like_torch(recipe, trainer):
    onx = _export(_net(), recipe)
    assert any(n.op_type == "BatchNormalization" for n in onx.graph.node), recipe
    # 'pos' is added to activations, which graphkit's rule calls a constant (only a bias
    # after a linear operator is a parameter): a learned positional map is named
    weights = [n for n, _ in _net().named_parameters()]
    settings = dict(
        max_iter=EPOCHS, batch_size=BATCH, shuffle=False, optimizer="sgd", weights_to_train=weights
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if trainer == "full":
            model = Trainer(onx, loss="cross_entropy", **settings)
        else:
            model = ForwardBackwardTrainer(onx, loss="cross_entropy", **settings)
        model.fit(*_data())
    state = model.get_state()
    expected = _torch_sgd(_net())
    for name in weights:
        assert name in state, (name, sorted(state))
        np.testing.assert_allclose(state[name], expected[name], rtol=1e-4, atol=2e-5, err_msg=name)


@pytest.mark.parametrize("recipe", ["torchscript default", "dynamo default"])
def test_the_default_exports_fold_batch_norm_into_the_conv(recipe):
    """What the README warns about and no check can see: the folded graph is a valid
    model whose Conv weights are BatchNorm's product; its scale and shift are gone."""
    onx = _export(_net(), recipe)
    assert not any(n.op_type == "BatchNormalization" for n in onx.graph.node)
    assert not any("bn." in i.name for i in onx.graph.initializer)


def _in_training_mode(layer, opset: int):
    """A small MLP with ``layer`` in its middle, exported by TorchScript in training mode."""
    import onnx

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), layer, torch.nn.Linear(8, 1))
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (torch.randn(4, 4),),
            buffer,
            dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING,
            input_names=["X"],
            output_names=["Y"],
            opset_version=opset,
        )
    return onnx.load_from_string(buffer.getvalue())


def test_a_training_mode_export_at_opset_13_trains_with_batch_statistics():
    """Before opset 14, training mode is a BatchNormalization with its running
    statistics as outputs (no training_mode attribute): graphkit reads it so."""
    onx = _in_training_mode(torch.nn.BatchNorm1d(8), 13)
    assert all(a.name != "training_mode" for n in onx.graph.node for a in n.attribute), (
        "the export is expected to say training mode by its outputs only"
    )
    prepared, _ = prepare_for_training(onx, None)
    (node,) = [n for n in prepared.graph.node if n.op_type == "BatchNormalization"]
    assert is_marked(node, BATCH_STATISTICS) and list(node.output) == [node.output[0]]


def _dynamo_in_train_mode(optimize: bool):
    """Linear -> BatchNorm1d -> ReLU -> Linear left in train() (no Dropout), by dynamo."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 1)
    ).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            net,
            (torch.randn(4, 4),),
            dynamo=True,
            input_names=["X"],
            output_names=["Y"],
            dynamic_shapes=({0: torch.export.Dim("N", min=1)},),
            opset_version=18,
            optimize=optimize,
            verbose=False,
        )
    return program.model_proto


def test_a_dynamo_export_in_train_mode_trains_with_batch_statistics():
    """dynamo writes a train()-mode BatchNorm as an inference BatchNormalization; the
    aten operator it records for the node gives it away (optimize=True, which folds it
    into the Gemm, is refused: tests/test_train_mode.py)."""
    onx = _dynamo_in_train_mode(optimize=False)
    assert not any(a.name == "training_mode" for n in onx.graph.node for a in n.attribute)
    prepared, _ = prepare_for_training(onx, None)
    assert [is_marked(n) for n in prepared.graph.node if n.op_type == "BatchNormalization"] == [
        True
    ]


def test_a_dynamo_export_in_eval_mode_is_not_refused():
    net = _net()
    onx = _export(net, "dynamo optimize=False")
    assert any("no_training" in n.name for n in onx.graph.node)
    Trainer(onx, loss="cross_entropy", max_iter=1).fit(*_data())


def test_running_statistics_read_as_graph_outputs_are_refused():
    import onnx
    from onnx import TensorProto, helper

    onx = _in_training_mode(torch.nn.BatchNorm1d(8), 18)
    # an export that returns the updated buffers, as a functionalized graph does
    node = next(n for n in onx.graph.node if n.op_type == "BatchNormalization")
    onx.graph.output.append(helper.make_tensor_value_info(node.output[1], TensorProto.FLOAT, [8]))
    onx.graph.output[-1].name = "bn.running_mean"
    node.output[1] = "bn.running_mean"
    assert isinstance(onx, onnx.ModelProto)
    with pytest.raises(gk.IncompatibleModelError, match="outputs its updated running statistics"):
        Trainer(onx, max_iter=1).fit(np.ones((4, 4), np.float32), np.ones(4, np.float32))
