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
    """A model the runtime cannot load and graphkit cannot convert."""


class MissingGradientError(GraphkitError, ValueError):
    """The backend has no gradient for an operator on the path to the loss."""


class BackendNotInstalledError(GraphkitError, ImportError):
    """The chosen backend's runtime is not installed; the message says what to install."""


class ConvergenceError(GraphkitError, ArithmeticError):
    """The loss became NaN or infinite during training."""


class InsufficientMemoryError(GraphkitError, MemoryError):
    """Training would need more memory than the machine has available: refused before
    allocating, with the estimate and what is available in the message."""


class NotFittedError(GraphkitError, ValueError, AttributeError):
    """A trainer used before ``fit`` (or ``set_state``).

    Raised through :func:`not_fitted`, which makes it a subclass of scikit-learn's
    ``NotFittedError`` too when scikit-learn is installed.
    """


def not_fitted(message: str) -> NotFittedError:
    """A :class:`NotFittedError` that ``except sklearn.exceptions.NotFittedError`` catches."""
    return _not_fitted_class()(message)


def _not_fitted_class() -> type[NotFittedError]:
    global _NOT_FITTED
    if _NOT_FITTED is None:
        try:  # imported on the error path only: graphkit does not need scikit-learn
            from sklearn.exceptions import NotFittedError as SklearnNotFitted
        except ImportError:
            _NOT_FITTED = NotFittedError
        else:
            _NOT_FITTED = type("NotFittedError", (NotFittedError, SklearnNotFitted), {})
            _NOT_FITTED.__module__ = __name__
    return _NOT_FITTED


_NOT_FITTED: type[NotFittedError] | None = None
