"""graphkit's exported training runs on the latest plain onnxruntime from PyPI, in a
separate environment (plain onnxruntime and onnxruntime-training share an import name
and must never share one): ``make test`` creates ``.venv-plain-ort`` once and reuses it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from test_lowering import cnn, mlp

import graphkit as gk
from graphkit_train import OrtGradientOptimizer

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("plain_onnxruntime_worker.py")


def plain_python() -> str:
    given = os.environ.get("GRAPHKIT_PLAIN_ORT_PYTHON")
    path = Path(given) if given else ROOT / ".venv-plain-ort" / "bin" / "python"
    if not path.exists():
        if given:  # make test asked for it: a missing environment is a failure
            pytest.fail(f"GRAPHKIT_PLAIN_ORT_PYTHON={given} does not exist")
        pytest.skip("no plain-onnxruntime environment (make test creates .venv-plain-ort)")
    return str(path)


def cases(rng):
    X = rng.normal(size=(60, 4)).astype(np.float32)
    images = rng.normal(size=(40, 1, 6, 6)).astype(np.float32)
    yield "mlp_regression", mlp("Tanh", 3, np.float32), "squared_error", X, np.tanh(X[:, :3])
    yield "mlp_classifier", mlp("Relu", 3, np.float32), "cross_entropy", X, (X[:, 0] > 0) * 2
    yield "cnn", cnn(), "cross_entropy", images, rng.integers(0, 3, size=40)


def test_exported_training_runs_on_the_latest_plain_onnxruntime(rng, tmp_path):
    python = plain_python()
    expected = {}
    for name, model, loss, X, y in cases(rng):
        y = y.astype(np.float32) if loss == "squared_error" else y.astype(np.int64)
        trainer = OrtGradientOptimizer(
            gk.add_loss_output(model, loss),
            learning_rate=(gk.optimizers.adam(), gk.schedules.cosine(0.01, 100)),
            max_iter=1,
            batch_size=10,
            shuffle=False,
        )
        trainer.fit(X, y)
        trainer.export_training_step(tmp_path / f"{name}.step.onnx")
        trainer.export_training_info(tmp_path / f"{name}.info.onnx")
        trainer.export_training_epoch(tmp_path / f"{name}.epoch.onnx")
        label = trainer.training_step_.label
        batches = {}
        for i, start in enumerate(range(0, len(X), 10)):
            batches[f"{i}/X"] = X[start : start + 10]
            batches[f"{i}/{label}"] = y[start : start + 10]
        np.savez(tmp_path / f"{name}.batches.npz", **batches)
        np.savez(tmp_path / f"{name}.rows.npz", X=X, y=y)
        np.savez(
            tmp_path / f"{name}.epoch_feeds.npz",
            X=X,
            **{label: y},
            permutation=np.random.default_rng(0).permutation(len(X)),
            batch_size=np.array(10, np.int64),
        )
        shuffled = OrtGradientOptimizer(
            gk.add_loss_output(model, loss),
            learning_rate=(gk.optimizers.adam(), gk.schedules.cosine(0.01, 100)),
            max_iter=1,
            batch_size=10,
            random_state=0,
        )
        shuffled.set_state(trainer.get_state())
        shuffled.set_params(warm_start=True).fit(X, y)  # 1 shuffled epoch, by graphkit
        after_one = shuffled.get_state()
        shuffled.fit(X, y)  # and a second one
        trainer.set_params(warm_start=True).fit(X, y)  # the same epoch, by graphkit
        expected[name] = (trainer.get_state(), trainer.training_step_.weights, shuffled, after_one)

    subprocess.run([python, str(WORKER), str(tmp_path)], check=True)
    for name, (state, weights, shuffled, after_one) in expected.items():
        result = np.load(tmp_path / f"{name}.result.npz")
        version = tuple(int(p) for p in str(result["version"]).split(".")[:2])
        assert version >= (1, 20), result["version"]  # newer than the frozen training build
        for key, value in state.items():
            np.testing.assert_allclose(result[f"step/{key}"], value, rtol=1e-5, atol=1e-6)
        for key in weights:
            np.testing.assert_allclose(result[f"info/{key}"], state[key], rtol=1e-5, atol=1e-6)
        for key, value in shuffled.get_state().items():
            np.testing.assert_allclose(result[f"trainer/{key}"], value, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(result["trainer_losses"], shuffled.train_losses_, rtol=1e-5)
        for key, value in after_one.items():  # the exported epoch: one Loop, same epoch
            np.testing.assert_allclose(result[f"epoch/{key}.next"], value, rtol=1e-5, atol=1e-6)
    assert onnx.load(tmp_path / "cnn.step.onnx").opset_import[0].domain in ("", "ai.onnx")
