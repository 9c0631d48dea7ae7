"""A model that carries its own training step (ONNX TrainingInfoProto): exported by
graphkit, run by graphkit.training_info on onnx.reference and onnxruntime, with the
same weights as graphkit's own training; onnx tools that drop the field, and broken
bindings."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from test_lowering import cnn, mlp

import graphkit as gk
from graphkit.compat import make_compatible
from graphkit.training_info import (
    TrainingInfoError,
    check_training_info,
    initialize,
    reattach,
    run_training_info,
)
from graphkit_train import OrtGradientOptimizer


def trained(model, X, y, loss="squared_error", epochs=1):
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model, loss),
        learning_rate=(gk.optimizers.adam(), gk.schedules.cosine(0.01, 200)),
        max_iter=epochs,
        batch_size=10,
        shuffle=False,
    )
    return trainer.fit(X, y)


def weights_of(model):
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.fixture()
def regression(rng):
    X = rng.normal(size=(100, 4)).astype(np.float32)
    return X, np.tanh(X[:, :3]).astype(np.float32)


@pytest.mark.parametrize("runtime", ["reference", "onnxruntime"])
def test_the_model_keeps_training_itself(runtime, regression, tmp_path):
    X, y = regression
    trainer = trained(mlp("Tanh", 3, np.float32), X, y)
    path = tmp_path / "model.onnx"
    trainer.export_training_info(path)
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    assert len(model.training_info) == 1
    # the inference graph is untouched: it predicts with the trained weights
    np.testing.assert_allclose(
        gk.run(model, {"X": X[:5]})["Y"], trainer.predict(X[:5]).reshape(5, -1), rtol=1e-6
    )
    label = trainer.training_step_.label
    batches = [{"X": X[i : i + 10], label: y[i : i + 10]} for i in range(0, 100, 10)]
    model, history = run_training_info(model, batches, runtime=runtime)
    trainer.set_params(warm_start=True).fit(X, y)  # the same epoch, by graphkit
    assert len(history) == 10 and set(history[0]) == {"loss"}
    state = trainer.get_state()
    for name, value in weights_of(model).items():
        if name in state:
            np.testing.assert_allclose(value, state[name], rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(
        np.mean([float(h["loss"]) for h in history]), trainer.train_losses_[-1], rtol=1e-5
    )


def test_a_cnn_classifier_too(rng):
    X = rng.normal(size=(40, 1, 6, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    trainer = trained(cnn(), X, y, "cross_entropy")
    model = trainer.export_training_info()
    label = trainer.training_step_.label
    batches = [{"X": X[i : i + 10], label: y[i : i + 10]} for i in range(0, 40, 10)]
    model, _ = run_training_info(model, batches, runtime="reference")
    trainer.set_params(warm_start=True).fit(X, y)
    state = trainer.get_state()
    for name in trainer.training_step_.weights:
        np.testing.assert_allclose(weights_of(model)[name], state[name], rtol=1e-5, atol=1e-6)


def test_initialization_resets_the_optimizer_not_the_weights(regression):
    X, y = regression
    model = trained(mlp("Tanh", 3, np.float32), X, y).export_training_info()
    algorithm = model.training_info[0].algorithm
    before = {t.name: numpy_helper.to_array(t) for t in algorithm.initializer}
    assert int(before["step"]) == 10 and np.abs(before["W1.adam.m"]).max() > 0
    reset = initialize(model)
    after = {t.name: numpy_helper.to_array(t) for t in reset.training_info[0].algorithm.initializer}
    assert int(after["step"]) == 0 and not after["W1.adam.m"].any() and not after["loss_sum"]
    for name, value in weights_of(model).items():
        np.testing.assert_array_equal(weights_of(reset)[name], value)


def test_what_onnx_tools_drop_and_what_graphkit_keeps(regression):
    """onnx's version converter, onnx_ir and onnxscript's optimizer drop training_info;
    graphkit's own conversion keeps it, and ``reattach`` puts it back."""
    import onnx_ir

    X, y = regression
    model = trained(mlp("Tanh", 3, np.float32), X, y).export_training_info()
    assert len(onnx.version_converter.convert_version(model, 20).training_info) == 0
    roundtrip = onnx_ir.serde.serialize_model(onnx_ir.serde.deserialize_model(model))
    assert len(roundtrip.training_info) == 0
    restored = reattach(model, roundtrip)
    check_training_info(restored)
    assert len(onnx.shape_inference.infer_shapes(model).training_info) == 1
    # graphkit's compatibility pass converts opsets and keeps the field
    older = onnx.ModelProto()
    older.CopyFrom(model)
    next(o for o in older.opset_import if o.domain in ("", "ai.onnx")).version = 17
    assert len(make_compatible(older, 18).training_info) == 1


def test_bindings_naming_missing_tensors_are_refused(regression):
    X, y = regression
    model = trained(mlp("Tanh", 3, np.float32), X, y).export_training_info()
    broken = onnx.ModelProto()
    broken.CopyFrom(model)
    broken.training_info[0].update_binding[0].key = "W9"
    broken.training_info[0].update_binding[1].value = "nowhere.next"
    onnx.checker.check_model(broken)  # the checker does not look at bindings
    with pytest.raises(TrainingInfoError, match=r"key 'W9' is not an initializer.*'nowhere.next'"):
        run_training_info(broken, [])
    with pytest.raises(TrainingInfoError, match="index 0 does not exist"):
        check_training_info(mlp("Tanh", 3, np.float32))
    with pytest.raises(ValueError, match="runtime must be"):
        run_training_info(model, [], runtime="tvm")
