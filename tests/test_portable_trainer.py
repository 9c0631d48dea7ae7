"""PortableTrainer: an exported step keeps training, epoch after epoch, on onnx.reference
or onnxruntime, as graphkit's own trainer (same batches, same permutations)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import linear_regression_onnx, mlp_onnx

import graphkit as gk
from graphkit.portable_trainer import PortableTrainer
from graphkit.training_info import initial_state
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
    ours = PortableTrainer(step, batch_size=10, random_state=3, runtime=runtime).fit(X, y, epochs=3)
    theirs = make(model, max_iter=3, random_state=3).fit(X, y)
    np.testing.assert_allclose(ours.train_losses_, theirs.train_losses_, rtol=1e-5)
    for name, value in theirs.get_state().items():
        np.testing.assert_allclose(ours.state()[name], value, rtol=1e-5, atol=1e-6)
    again = PortableTrainer(ours.to_model(), batch_size=10, shuffle=False, runtime=runtime)
    np.testing.assert_array_equal(again.state()["W1"], ours.state()["W1"])


def test_sample_weights_and_bad_input(rng):
    X = rng.normal(size=(40, 2)).astype(np.float32)
    y = (X @ np.array([1.0, -1.0])).astype(np.float32)
    onx = linear_regression_onnx(np.zeros((2, 1), np.float32), np.zeros(1, np.float32))
    step = make(onx, weight_name="weight", max_iter=1).export_training_step()
    with pytest.raises(ValueError, match="takes no sample weights"):
        PortableTrainer(make(onx, max_iter=1).export_training_step()).fit(X, y, np.ones(40))
    w = rng.uniform(0.5, 2.0, size=40).astype(np.float32)
    ours = PortableTrainer(step, batch_size=8, shuffle=False).fit(X, y, w, epochs=2)
    theirs = make(onx, "squared_error", "weight", max_iter=2, batch_size=8, shuffle=False)
    theirs.fit(X, y, w)
    np.testing.assert_allclose(ours.state()["coef"], theirs.get_state()["coef"], rtol=1e-5)
    with pytest.raises(ValueError, match="not a graphkit training step"):
        PortableTrainer(onx)
    with pytest.raises(ValueError, match="batch_size"):
        PortableTrainer(step, batch_size=0)
    with pytest.raises(ValueError, match="runtime must be"):
        PortableTrainer(step, runtime="tvm")


def test_opening_an_exported_step_or_epoch_prints_no_warning(tmp_path):
    """The resident inputs have no initializer (whose default onnxruntime reports one
    warning each for, "Initializer X appears in graph inputs..."): their initial values
    are TrainingInfoProto 0's initialization outputs. A default InferenceSession of plain
    onnxruntime (GRAPHKIT_PLAIN_ORT_PYTHON, else this interpreter) in a process of its
    own opens both silently, and the step still trains from that state."""
    import os
    import subprocess
    import sys

    trainer = make(mlp_onnx(4, 6, 3, "Tanh"), max_iter=1)
    step, epoch = tmp_path / "step.onnx", tmp_path / "epoch.onnx"
    exported = trainer.export_training_step(step)
    trainer.export_training_epoch(epoch)
    state = initial_state(exported)
    assert set(state) == set(
        json.loads({p.key: p.value for p in exported.metadata_props}["graphkit.training_step"])[
            "resident"
        ]
    )
    assert not {t.name for t in exported.graph.initializer} & set(state)
    script = (
        "import sys, onnxruntime\n"
        "for path in sys.argv[1:]:\n"
        "    onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])\n"
        "print('opened', file=sys.stderr)\n"
    )
    python = os.environ.get("GRAPHKIT_PLAIN_ORT_PYTHON") or sys.executable
    done = subprocess.run(
        [python, "-c", script, str(step), str(epoch)], capture_output=True, text=True, check=True
    )
    assert "opened" in done.stderr
    assert "appears in graph inputs" not in done.stderr + done.stdout
