"""Gradient graphs of a loss, from the chosen backend's gradient source.

The gradient source differentiates an output with respect to initializers *or graph
inputs*; the graph keeps the forward outputs and adds ``<name>_grad`` for each requested
name (:meth:`graphkit.backends.base.GradientSource.gradient_graph`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import onnx

from graphkit import backends, tensor_store
from graphkit._graph import ancestors
from graphkit.backends.base import Backend
from graphkit.compat import finalize
from graphkit.errors import MissingGradientError, UnknownNameError

logger = logging.getLogger(__name__)


def gradient_model(
    model: onnx.ModelProto, output: str, wrt: Iterable[str], backend: str | Backend | None = None
) -> onnx.ModelProto:
    """The model extended with ``<name>_grad`` = d ``output`` / d ``name`` for ``wrt``.

    Args:
        model: a model whose ``output`` is the value to differentiate (a non-scalar output
            is summed first).
        output: name of that output.
        wrt: graph inputs or float initializers to differentiate with respect to.
        backend: the gradient source (:func:`graphkit.backends.get`; None: the default).

    Raises:
        MissingGradientError: an operator on the path has no gradient in the backend;
            the message names the operator and the node.
        MissingGradientError: ``output`` does not depend on a name of ``wrt``.
        BackendNotInstalledError: ``backend`` is not installed.
        UnknownNameError: ``output`` or a name of ``wrt`` is not in the graph.
    """
    wrt = list(wrt)
    outputs = [o.name for o in model.graph.output]
    if output not in outputs:
        raise UnknownNameError(f"{output!r} is not an output of the graph; outputs: {outputs}.")
    known = [i.name for i in model.graph.input] + [i.name for i in model.graph.initializer]
    unknown = [n for n in wrt if n not in known]
    if unknown:
        raise UnknownNameError(
            f"Cannot differentiate with respect to {unknown}: not an input or initializer. "
            f"Candidates: {known}."
        )
    check_reachable(model, wrt, [output])
    gradient_source = backends.get(backend)
    logger.debug(
        "gradient of %r with respect to %s from the %s backend", output, wrt, gradient_source.name
    )
    # mapped weights (graphkit.tensor_store) are read-only inputs to the gradient source
    lifted, stored = tensor_store.stored_as_inputs(model, wrt)
    gradient = gradient_source.gradient_graph(lifted, output, wrt)
    return finalize(tensor_store.stored_as_initializers(gradient, stored))


def reaching(model: onnx.ModelProto, weights: Iterable[str], outputs: Iterable[str]) -> list[str]:
    """The names of ``weights`` that ``outputs`` depend on, in order (the default choice
    of weights keeps those: a parameter of another output's head is not trained).

    Raises:
        ValueError: none of them does.
    """
    weights, outputs = list(weights), list(outputs)
    if not set(outputs) <= {o.name for o in model.graph.output}:
        return weights  # what builds the gradient says which output is missing
    needed = ancestors(model.graph, outputs)
    kept = [name for name in weights if name in needed]
    if weights and not kept:
        raise ValueError(
            f"None of the model's parameters {weights} is read on the way to {outputs}: "
            "there is nothing to train for this output. Choose another output, or name "
            "the initializers to train with weights_to_train."
        )
    return kept


def check_reachable(model: onnx.ModelProto, wrt: Iterable[str], outputs: Iterable[str]) -> None:
    """Raise :class:`MissingGradientError` naming every name of ``wrt`` that ``outputs``
    do not depend on: its gradient would be zero for any data (a weight of a branch the
    loss never reads, a KNN's training set...), which is never what training wants."""
    outputs = list(outputs)
    needed = ancestors(model.graph, outputs)
    unreachable = [name for name in wrt if name not in needed]
    if unreachable:
        reached = [name for name in wrt if name in needed]
        raise MissingGradientError(
            f"{', '.join(map(repr, outputs))} does not depend on {unreachable}: no path "
            "leads from them to it, so they cannot be trained. Leave them out of "
            f"weights_to_train (of those named, {reached or 'none'} can be trained)."
        )
