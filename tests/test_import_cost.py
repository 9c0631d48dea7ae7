"""graphkit does not pay for torch when torch is not used."""

from __future__ import annotations

import subprocess
import sys

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
