"""The models the web tests and the web benchmark export (graphkit_train.web).

Four kinds of model a page trains: the demo job (an MLP regressor, via the command line),
a skl2onnx classifier with sample weights and a decaying rate, a small CNN, and a small
CNN whose BatchNormalization and Dropout train in training mode.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit_train import Trainer
from graphkit_train.web import export_web


def regressor(folder: Path) -> None:
    """The demo job (diabetes, an MLP, Adam), exported by the command line, untrained."""
    from graphkit_train.cli import main

    code = main(
        ["export", "--web", str(folder), "--epochs", "0", "--quiet"]
        + ["--output", str(folder.parent / "cli-report")]
    )
    if code:
        raise RuntimeError(f"graphkit-train export --web failed (exit code {code})")


def iris_classifier() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """skl2onnx's LogisticRegression on iris (its ZipMap kept) with a log loss reading
    sample weights ``weight``, and the data."""
    from skl2onnx import to_onnx
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    X, y = load_iris(return_X_y=True)
    X = X.astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fitted = LogisticRegression(max_iter=5).fit(X, y)
    return gk.add_loss_output(to_onnx(fitted, X[:1]), "log", weight_name="weight"), X, y


def classifier(folder: Path) -> None:
    """skl2onnx's LogisticRegression on iris (ZipMap kept: the export drops it), log loss
    with sample weights, SGD with an exponentially decaying rate."""
    model, X, y = iris_classifier()
    # the step counter drives the schedule: the page must carry it as Python does
    schedule = gk.schedules.SCHEDULES.factory("exponential")(eta0=0.1, gamma=0.97)
    trainer = Trainer(model, optimizer="sgd", schedule=schedule, batch_size=16)
    order = np.random.default_rng(0).permutation(len(X))
    train, held = order[:120], order[120:]
    export_web(
        trainer, folder, data={"train": (X[train], y[train]), "held_out": (X[held], y[held])}
    )


def cnn(folder: Path) -> None:
    """A small CNN on scikit-learn's 8x8 digits: Conv + Relu + MaxPool + Gemm, cross
    entropy on the logits, AdamW."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = (X / 16).astype(np.float32).reshape(-1, 1, 8, 8)
    rng = np.random.default_rng(0)
    init = {
        "K": rng.normal(0, 0.3, (4, 1, 3, 3)).astype(np.float32),
        "c": np.zeros(4, np.float32),
        "W": rng.normal(0, 0.1, (64, 10)).astype(np.float32),
        "b": np.zeros(10, np.float32),
        "flat": np.array([-1, 64], np.int64),
    }
    nodes = [
        helper.make_node("Conv", ["X", "K", "c"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("MaxPool", ["relu"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Reshape", ["pool", "flat"], ["flat_pool"]),
        helper.make_node("Gemm", ["flat_pool", "W", "b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model = gk.add_loss_output(model, "cross_entropy")
    trainer = Trainer(model, ["K", "c", "W", "b"], optimizer="adamw", schedule=0.01, batch_size=64)
    train, held = slice(0, 600), slice(600, 760)
    export_web(
        trainer, folder, data={"train": (X[train], y[train]), "held_out": (X[held], y[held])}
    )


def cnn_train_mode(folder: Path) -> None:
    """A small CNN on scikit-learn's 8x8 digits whose layers train in training mode: Conv
    (no bias) + BatchNormalization (batch statistics, running averages) + Relu + MaxPool
    + Dropout (masks of graphkit's stream) + Gemm, cross entropy, AdamW."""
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    X = (X / 16).astype(np.float32).reshape(-1, 1, 8, 8)
    rng = np.random.default_rng(0)
    init = {
        "K": rng.normal(0, 0.3, (4, 1, 3, 3)).astype(np.float32),
        "W": rng.normal(0, 0.1, (64, 10)).astype(np.float32),
        "b": np.zeros(10, np.float32),
        "flat": np.array([-1, 64], np.int64),
        "bn_scale": np.ones(4, np.float32),
        "bn_bias": np.zeros(4, np.float32),
        "bn_mean": np.zeros(4, np.float32),
        "bn_var": np.ones(4, np.float32),
        "ratio": np.array(0.2, np.float32),
        "training": np.array(True),
    }
    statistics = ["conv", "bn_scale", "bn_bias", "bn_mean", "bn_var"]
    nodes = [
        # no Conv bias before a BatchNorm: its gradient is zero up to rounding, which
        # AdamW would turn into full-size updates, different in every runtime
        helper.make_node("Conv", ["X", "K"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", statistics, ["normalized"], training_mode=1),
        helper.make_node("Relu", ["normalized"], ["relu"]),
        helper.make_node("MaxPool", ["relu"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Reshape", ["pool", "flat"], ["flat_pool"]),
        helper.make_node("Dropout", ["flat_pool", "ratio", "training"], ["dropped"]),
        helper.make_node("Gemm", ["dropped", "W", "b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "cnn_train_mode",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model = gk.add_loss_output(model, "cross_entropy")
    trainer = Trainer(model, optimizer="adamw", schedule=0.01, batch_size=64, random_state=0)
    train, held = slice(0, 600), slice(600, 760)
    export_web(
        trainer, folder, data={"train": (X[train], y[train]), "held_out": (X[held], y[held])}
    )


MODELS = {
    "regressor": regressor,
    "classifier": classifier,
    "cnn": cnn,
    "cnn_train_mode": cnn_train_mode,
}
BENCHMARKED = ("regressor", "classifier", "cnn")
"""The models ``benchmarks/web.py`` times."""
