"""Gradient graphs from onnxruntime-training's ``GradientGraphBuilder``.

The builder differentiates a scalar output with respect to initializers *or graph
inputs*; the saved graph keeps the forward outputs and adds ``<name>_grad`` for each
requested name. Gradient graphs use ``com.microsoft`` operators (``ReluGrad``,
``SigmoidGrad``...), so they run on onnxruntime-training only.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Iterator

import onnx

from graphkit._ort import _short, onnxruntime
from graphkit.compat import finalize
from graphkit.errors import MissingGradientError, UnknownNameError

_NO_BUILDER = re.compile(r"gradient builder has not been registered: (\S+) for node (\S*)")


def gradient_model(model: onnx.ModelProto, output: str, wrt: Iterable[str]) -> onnx.ModelProto:
    """The model extended with ``<name>_grad`` = d ``output`` / d ``name`` for ``wrt``.

    Args:
        model: a model whose ``output`` is the value to differentiate (a non-scalar output
            is summed first).
        output: name of that output.
        wrt: graph inputs or float initializers to differentiate with respect to.

    Raises:
        MissingGradientError: an operator on the path has no gradient in
            onnxruntime-training 1.19.2; the message names the operator and the node.
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
    builder_cls = onnxruntime().capi._pybind_state.GradientGraphBuilder
    try:
        with _quiet_native_stderr(), tempfile.TemporaryDirectory() as folder:
            builder = builder_cls(model.SerializeToString(), {output}, set(wrt), output)
            builder.build()
            path = os.path.join(folder, "gradient.onnx")
            builder.save(path)
            grad = onnx.load(path)
    except RuntimeError as exc:
        found = _NO_BUILDER.search(str(exc))
        if found:
            op_type, node = found.groups()
            raise MissingGradientError(
                f"onnxruntime-training 1.19.2 has no gradient for operator {op_type!r} "
                f"(node {node!r}). Rewrite that part with differentiable operators "
                "(e.g. Softplus(x) as Log(1 + Exp(x)), Atan with a series or a lookup) or "
                "keep it off the path between the weights and the loss."
            ) from exc
        raise MissingGradientError(f"Building the gradient graph failed: {_short(exc)}") from exc
    return finalize(grad, check=False)


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Silence the builder's C++ logging, which ignores onnxruntime's logger severity.

    Failures still surface: the builder raises a Python exception, and the message is
    rewritten above.
    """
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a notebook's stderr has no fd
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
