"""StepTrainer: an exported step keeps training, epoch after epoch, on onnx.reference
or onnxruntime, as graphkit's own trainer (same batches, same permutations)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import linear_regression_onnx, mlp_onnx

import graphkit as gk
from graphkit.step_trainer import StepTrainer
from graphkit_train import OrtGradientOptimizer


def make(model, loss="squared_error", weight_name=None, **kwargs):
    kwargs.setdefault("batch_size", 10)
    return OrtGradientOptimizer(
        gk.add_loss_output(model, loss, weight_name=weight_name),
        learning_rate=(gk.optimizers.adam(), gk.schedules.cosine(0.01, 200)),
        **kwargs,
    )


@pytest.mark.parametrize("runtime", ["reference", "onnxruntime"])
def test_shuffled_epochs_match_graphkit(runtime, rng):
    X = rng.normal(size=(95, 4)).astype(np.float32)  # a short last batch
    y = np.tanh(X[:, :3]).astype(np.float32)
    model = mlp_onnx(4, 6, 3, "Tanh")
    step = make(model, max_iter=1).export_training_step()  # before any training
    ours = StepTrainer(step, batch_size=10, random_state=3, runtime=runtime).fit(X, y, epochs=3)
    theirs = make(model, max_iter=3, random_state=3).fit(X, y)
    np.testing.assert_allclose(ours.train_losses_, theirs.train_losses_, rtol=1e-5)
    for name, value in theirs.get_state().items():
        np.testing.assert_allclose(ours.state()[name], value, rtol=1e-5, atol=1e-6)
    again = StepTrainer(ours.to_model(), batch_size=10, shuffle=False, runtime=runtime)
    np.testing.assert_array_equal(again.state()["W1"], ours.state()["W1"])


def test_sample_weights_and_bad_input(rng):
    X = rng.normal(size=(40, 2)).astype(np.float32)
    y = (X @ np.array([1.0, -1.0])).astype(np.float32)
    onx = linear_regression_onnx(np.zeros((2, 1), np.float32), np.zeros(1, np.float32))
    step = make(onx, weight_name="weight", max_iter=1).export_training_step()
    with pytest.raises(ValueError, match="takes no sample weights"):
        StepTrainer(make(onx, max_iter=1).export_training_step()).fit(X, y, np.ones(40))
    w = rng.uniform(0.5, 2.0, size=40).astype(np.float32)
    ours = StepTrainer(step, batch_size=8, shuffle=False).fit(X, y, w, epochs=2)
    theirs = make(onx, "squared_error", "weight", max_iter=2, batch_size=8, shuffle=False)
    theirs.fit(X, y, w)
    np.testing.assert_allclose(ours.state()["coef"], theirs.get_state()["coef"], rtol=1e-5)
    with pytest.raises(ValueError, match="not a graphkit training step"):
        StepTrainer(onx)
    with pytest.raises(ValueError, match="batch_size"):
        StepTrainer(step, batch_size=0)
    with pytest.raises(ValueError, match="runtime must be"):
        StepTrainer(step, runtime="tvm")


def test_opening_an_exported_step_logs_no_warning_per_default(tmp_path):
    """The resident inputs' defaults are initializers (ONNX's default values), which
    onnxruntime reports one warning each for; StepTrainer's sessions log errors only.
    In a process of its own: graphkit quiets onnxruntime's default logger when it
    imports it."""
    import subprocess
    import sys

    path = tmp_path / "step.onnx"
    make(mlp_onnx(4, 6, 3, "Tanh"), max_iter=1).export_training_step(path)
    script = (
        "import sys, onnxruntime\n"
        "onnxruntime.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n"
        "print('---', file=sys.stderr, flush=True)\n"
        "from graphkit.step_trainer import StepTrainer\n"
        "StepTrainer(sys.argv[1], runtime='onnxruntime')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True
    )
    default, ours = done.stderr.split("---")
    assert "appears in graph inputs" in default  # what a default session says
    assert "appears in graph inputs" not in ours
