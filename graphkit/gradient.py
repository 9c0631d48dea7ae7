"""Gradient graphs of a loss, from the chosen backend's gradient source.

The gradient source differentiates an output with respect to initializers *or graph
inputs*; the graph keeps the forward outputs and adds ``<name>_grad`` for each requested
name (:meth:`graphkit.backends.base.GradientSource.gradient_graph`).
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from graphkit import backends
from graphkit.compat import finalize
from graphkit.errors import UnknownNameError


def gradient_model(
    model: onnx.ModelProto, output: str, wrt: Iterable[str], backend: str | None = None
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
    return finalize(backends.get(backend).gradient_graph(model, output, wrt))
