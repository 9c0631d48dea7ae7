"""The backend seam: onnxruntime-training's private API is reached from one module."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphkit import MissingGradientError, backend

ROOT = Path(__file__).resolve().parents[1]
PRIVATE = re.compile(
    r"capi|_pybind_state|GradientGraphBuilder|OrtModuleGraphBuilder\(|TrainingAgent\(|OrtValueVector"
)


def test_only_the_backend_reaches_onnxruntime_training_internals():
    offenders = []
    for package in ("graphkit", "graphkit_train"):
        for path in sorted((ROOT / package).glob("*.py")):
            if path.name == "backend.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#")[0]
                if PRIVATE.search(code) and not code.strip().startswith(('"', "'", "*", "``")):
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_gradient_graph_and_its_errors():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [])
    w = onnx.numpy_helper.from_array(np.ones(3, np.float32), "w")

    def model(op):
        nodes = [
            helper.make_node("Mul", ["x", "w"], ["t"]),
            helper.make_node(op, ["t"], ["u"]),
            helper.make_node("ReduceSum", ["u"], ["y"], keepdims=0),
        ]
        graph = helper.make_graph(nodes, "g", [x], [y], [w])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)

    grad = backend.gradient_graph(model("Tanh"), "y", ["w"])
    assert "w_grad" in [o.name for o in grad.graph.output]
    with pytest.raises(MissingGradientError, match="no gradient for operator 'Cosh'"):
        backend.gradient_graph(model("Cosh"), "y", ["w"])
    with pytest.raises(ValueError, match="Unknown device"):
        backend.providers_for("tpu")
