"""graphkit_train: the training runtime.

* :class:`OrtGradientOptimizer`: full training; the loss is part of the graph and one
  fused ONNX graph per step does forward, gradient and update.
"""

from graphkit_train.full import OrtGradientOptimizer
from graphkit_train.step import TrainingStep, build_training_step

__all__ = ["OrtGradientOptimizer", "TrainingStep", "build_training_step"]
