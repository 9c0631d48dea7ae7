"""graphkit_train: the training runtime.

* :class:`OrtGradientOptimizer`: full training; the loss is part of the graph and one
  fused ONNX graph per step does forward, gradient and update.
* :class:`OrtGradientForwardBackward`: forward and backward passes of an ONNX graph
  (onnxruntime-training's TrainingAgent), for any training framework.
* :class:`OrtGradientForwardBackwardOptimizer`: forward/backward training with the
  seed's ``learning_loss``, ``learning_rate`` and ``learning_penalty``.
* :mod:`graphkit_train.torch_module` (needs torch): an ONNX graph as a ``torch.nn.Module``.
* :mod:`graphkit_train.distributed`: data-parallel training on ``torch.distributed``
  (``distributed=True`` in both trainers, launched with ``torchrun``).
"""

from graphkit_train import checkpoint, distributed
from graphkit_train.checkpoint import CheckpointError
from graphkit_train.forward_backward import OrtGradientForwardBackward
from graphkit_train.full import OrtGradientOptimizer
from graphkit_train.partial import OrtGradientForwardBackwardOptimizer
from graphkit_train.step import TrainingStep, UpdateStep, build_training_step, build_update_step

__all__ = [
    "CheckpointError",
    "checkpoint",
    "distributed",
    "OrtGradientForwardBackward",
    "OrtGradientForwardBackwardOptimizer",
    "OrtGradientOptimizer",
    "TrainingStep",
    "UpdateStep",
    "build_training_step",
    "build_update_step",
]
