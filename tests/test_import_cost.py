"""graphkit does not pay for torch when torch is not used."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import INSTALLED_BACKENDS

CODE = """
import sys
import numpy as np
import graphkit as gk
loss = gk.losses.get("squared_error")
assert abs(loss(np.ones((2, 1)), np.zeros(2)) - 1.0) < 1e-12
from graphkit.engine.ort_engine import onnxruntime
onnxruntime()
print("torch" in sys.modules)
"""

TRAINING_BUILD = """
onnxruntime().capi._pybind_state.TrainingAgent  # the training bindings are there
import onnxruntime.training  # still importable afterwards (it imports torch itself)
print("torch" in sys.modules)
"""


def test_onnxruntime_is_imported_without_torch():
    code, expected = CODE, ["False"]
    if "ort_training" in INSTALLED_BACKENDS:  # onnxruntime is the training build
        code, expected = code + TRAINING_BUILD, ["False", "True"]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == expected


LAZY = """
import sys
import graphkit_train
print("torch" in sys.modules)
assert graphkit_train.export_web.__module__ == "graphkit_train.web.export"
print("torch" in sys.modules)
import graphkit_train.torch_module
assert graphkit_train.OnnxModule is graphkit_train.torch_module.OnnxModule
assert {"OnnxModule", "export_web"} <= set(graphkit_train.__all__)
"""


def test_the_runtime_names_onnx_module_without_importing_torch_until_used():
    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", LAZY], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
