"""graphkit: train the weights of any ONNX graph.

Losses, penalties, optimizers and learning-rate schedules are onnxscript functions
(:mod:`graphkit.losses`, :mod:`graphkit.penalties`, :mod:`graphkit.optimizers`,
:mod:`graphkit.schedules`); :mod:`graphkit.rewrite` turns a prediction graph into a
training graph. The training runtime lives in ``graphkit_train``.
"""

from graphkit import (
    compat,
    dsl,
    losses,
    optimizers,
    parameters,
    penalties,
    schedules,
    transforms,
)
from graphkit._ort import run
from graphkit.errors import (
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
from graphkit.learning import (
    AbsoluteLearningLoss,
    BaseLearningLoss,
    BaseLearningOnnx,
    BaseLearningPenalty,
    BaseLearningRate,
    ElasticLearningLoss,
    ElasticLearningPenalty,
    HuberLearningLoss,
    LearningRateAdagrad,
    LearningRateAdam,
    LearningRateAdamW,
    LearningRateRMSProp,
    LearningRateSGD,
    LearningRateSGDNesterov,
    NegLogLearningLoss,
    NoLearningPenalty,
    SoftmaxCrossEntropyLearningLoss,
    SquareLearningLoss,
)
from graphkit.losses import Loss, custom_loss
from graphkit.optimizers import Optimizer
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

__version__ = "0.1.0"

__all__ = [
    "AbsoluteLearningLoss",
    "BaseLearningLoss",
    "BaseLearningOnnx",
    "BaseLearningPenalty",
    "BaseLearningRate",
    "ConvergenceError",
    "DTypeError",
    "ElasticLearningLoss",
    "ElasticLearningPenalty",
    "GraphkitError",
    "HuberLearningLoss",
    "IncompatibleModelError",
    "LearningRateAdagrad",
    "LearningRateAdam",
    "LearningRateAdamW",
    "LearningRateRMSProp",
    "LearningRateSGD",
    "LearningRateSGDNesterov",
    "Loss",
    "MissingGradientError",
    "NegLogLearningLoss",
    "NoLearningPenalty",
    "NotFittedError",
    "GradientTransformation",
    "Optimizer",
    "Penalty",
    "Schedule",
    "ShapeError",
    "SoftmaxCrossEntropyLearningLoss",
    "SquareLearningLoss",
    "UnknownNameError",
    "add_loss_output",
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
