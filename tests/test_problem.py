"""A full-training problem is described once and each of its graphs is built once."""

from __future__ import annotations

import numpy as np
from conftest import linear_regression_onnx

import graphkit as gk
from graphkit.training import problem as problem_module
from graphkit_train import Trainer


def test_each_step_is_built_once_for_training_and_every_export(monkeypatch, tmp_path):
    built = []
    original = problem_module.build_training_step

    def counting(*args, **kwargs):
        built.append(kwargs["pack"])
        return original(*args, **kwargs)

    monkeypatch.setattr(problem_module, "build_training_step", counting)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(30, 3)).astype(np.float32)
    y = X @ np.array([0.5, -1.0, 2.0], np.float32)
    onx = linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32))
    trainer = Trainer(onx, loss="mse", optimizer="adam", max_iter=2).fit(X, y)
    trainer.export_training_step(tmp_path / "step.onnx")
    trainer.export_training_epoch(tmp_path / "epoch.onnx")
    trainer.export_training_info(tmp_path / "info.onnx")
    assert built == [True, False]  # the packed step to train, the named one to export
    assert trainer.problem_.weights == trainer.weights_to_train_ == ["coef", "intercept"]


def test_the_weights_are_chosen_in_one_place():
    """None trains the parameters and never a constant (a scale multiplying the output)."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "b"], ["Z"]),
            helper.make_node("Mul", ["Z", "scale"], ["Y"]),
        ],
        "scaled",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [
            numpy_helper.from_array(np.ones((2, 1), np.float32), "W"),
            numpy_helper.from_array(np.zeros(1, np.float32), "b"),
            numpy_helper.from_array(np.full(1, 3.0, np.float32), "scale"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onx = gk.add_loss_output(model)
    sgd = gk.optimizers.get("sgd")
    assert problem_module.TrainingProblem.from_model(onx, None, sgd).weights == ["W", "b"]
    named = problem_module.TrainingProblem.from_model(onx, ["W", "scale"], sgd)
    assert named.weights == ["W", "scale"]
