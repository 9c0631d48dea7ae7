"""graphkit: train the weights of any ONNX graph.

Losses, penalties, optimizers and learning-rate schedules are onnxscript functions
(:mod:`graphkit.losses`, :mod:`graphkit.penalties`, :mod:`graphkit.optimizers`,
:mod:`graphkit.schedules`); :mod:`graphkit.rewrite` turns a prediction graph into a
training graph. The training runtime lives in ``graphkit_train``.

The seed library's classes (``LearningRateSGD``, ``SquareLearningLoss``...) live in
:mod:`graphkit.seed`; ``graphkit.LearningRateSGD`` still finds them, but they are not
part of graphkit's own names (``__all__``).

graphkit logs through :mod:`logging`, under the ``graphkit`` logger (``graphkit_train``
under its own): silent unless the application configures logging, e.g.
``logging.basicConfig(level=logging.INFO)``. What onnxruntime logs from C++ is set apart:
``GRAPHKIT_ORT_LOG_SEVERITY`` (:mod:`graphkit.engine.ort_engine`).
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from graphkit import (
    backends,
    compat,
    dsl,
    losses,
    optimizers,
    parameters,
    penalties,
    runtime_check,
    schedules,
    transforms,
)
from graphkit.engine.ort_engine import run
from graphkit.errors import (
    BackendNotInstalledError,
    ConvergenceError,
    DTypeError,
    GraphkitError,
    IncompatibleModelError,
    MissingGradientError,
    NotFittedError,
    ShapeError,
    UnknownNameError,
)
from graphkit.gradient import gradient_model
from graphkit.losses import Loss, custom_loss
from graphkit.penalties import Penalty, custom_penalty
from graphkit.rewrite import (
    add_loss_output,
    get_train_initializer,
    initializers_to_inputs,
    inputs_to_initializers,
    rename_weights,
    set_weights,
)
from graphkit.schedules import Schedule
from graphkit.transforms import GradientTransformation, chain

# the PyPI project `graphkit` (another library) installs this import package too: its
# modules written into this folder are refused here, naming the repair
runtime_check.check_namesake(__path__[0])

# a library's loggers stay silent until the application configures logging: without a
# handler here, Python's last resort would print graphkit's warnings-level records
logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "BackendNotInstalledError",
    "ConvergenceError",
    "DTypeError",
    "GraphkitError",
    "IncompatibleModelError",
    "Loss",
    "MissingGradientError",
    "NotFittedError",
    "GradientTransformation",
    "Penalty",
    "Schedule",
    "ShapeError",
    "UnknownNameError",
    "add_loss_output",
    "backends",
    "chain",
    "compat",
    "custom_loss",
    "custom_penalty",
    "dsl",
    "get_train_initializer",
    "gradient_model",
    "initializers_to_inputs",
    "inputs_to_initializers",
    "losses",
    "optimizers",
    "parameters",
    "penalties",
    "rename_weights",
    "run",
    "schedules",
    "transforms",
    "set_weights",
]


def __getattr__(name: str) -> Any:
    """The seed's classes, kept importable as ``graphkit.LearningRateSGD`` for existing
    code: loaded from :mod:`graphkit.seed` when first asked for."""
    seed = importlib.import_module("graphkit.seed")
    if name == "seed":
        return seed
    if name in seed.__all__:
        return getattr(seed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
