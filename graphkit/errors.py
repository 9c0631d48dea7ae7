"""The exceptions graphkit raises.

Each one says what is wrong and how to fix it. They derive from the builtin exception a
caller would catch anyway (``ValueError``, ``TypeError``...), so ``except ValueError``
keeps working.
"""

from __future__ import annotations


class GraphkitError(Exception):
    """Base class of every error graphkit raises on purpose."""


class UnknownNameError(GraphkitError, KeyError):
    """A loss, optimizer, schedule, weight or output name that does not exist.

    The message lists the valid names.
    """

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0]) if self.args else ""


class ShapeError(GraphkitError, ValueError):
    """Tensors whose shapes cannot go together (prediction vs label, X vs y...)."""


class DTypeError(GraphkitError, TypeError):
    """A tensor of the wrong element type (integer labels to a regression loss...)."""


class IncompatibleModelError(GraphkitError, ValueError):
    """A model onnxruntime-training 1.19.2 cannot load and graphkit cannot convert."""


class MissingGradientError(GraphkitError, ValueError):
    """onnxruntime-training has no gradient for an operator on the path to the loss."""


class ConvergenceError(GraphkitError, ArithmeticError):
    """The loss became NaN or infinite during training."""
