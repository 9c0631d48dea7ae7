"""graphkit_train: the training runtime.

* :class:`Trainer`: full training; the loss is part of the graph and one fused ONNX
  graph per step does forward, gradient and update. ``optimizer=`` and ``schedule=``
  are graphkit's names (:mod:`graphkit.optimizers`, :mod:`graphkit.schedules`).
* :class:`ForwardBackwardTrainer`: forward/backward training of a prediction graph,
  with graphkit's ``loss=``, ``penalty=``, ``optimizer=`` and ``schedule=``.
* :class:`OrtGradientOptimizer` and :class:`OrtGradientForwardBackwardOptimizer`: the
  same two trainers with the seed library's API (``learning_rate``, ``learning_loss``,
  ``learning_penalty``; by default the seed's ``LearningRateSGD``, SGD with the
  invscaling schedule).
* :class:`OrtGradientForwardBackward`: forward and backward passes of an ONNX graph
  (the backend's forward/backward runner), for any training framework.
* :class:`OnnxModule` (needs torch; imported on first use): an ONNX graph as a
  ``torch.nn.Module``.
* :func:`export_web`: a folder that trains in a web page with onnxruntime-web.
* :mod:`graphkit_train.distributed`: data-parallel training on ``torch.distributed``
  (``distributed=True`` in both trainers, launched with ``torchrun``).

It logs under the ``graphkit_train`` logger (graph builds, epochs run, checkpoints
resumed), silent unless the application configures :mod:`logging`.
"""

import importlib
import logging
from typing import Any

from graphkit.training.step import TrainingStep, build_training_step, build_update_step
from graphkit.update_step import UpdateStep
from graphkit_train import checkpoint, distributed
from graphkit_train.checkpoint import CheckpointError, CheckpointWriteError
from graphkit_train.engine.forward_backward import OrtGradientForwardBackward
from graphkit_train.trainers.full import OrtGradientOptimizer, Trainer
from graphkit_train.trainers.partial import (
    ForwardBackwardTrainer,
    OrtGradientForwardBackwardOptimizer,
)

# silent until the application configures logging (see graphkit/__init__.py)
logging.getLogger(__name__).addHandler(logging.NullHandler())

# imported on first use: OnnxModule imports torch, which graphkit_train does not need
_LAZY = {"OnnxModule": "graphkit_train.torch_module", "export_web": "graphkit_train.web"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'graphkit_train' has no attribute {name!r}")


__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "checkpoint",
    "distributed",
    "ForwardBackwardTrainer",
    "OnnxModule",
    "OrtGradientForwardBackward",
    "OrtGradientForwardBackwardOptimizer",
    "OrtGradientOptimizer",
    "Trainer",
    "TrainingStep",
    "UpdateStep",
    "build_training_step",
    "build_update_step",
    "export_web",
]
