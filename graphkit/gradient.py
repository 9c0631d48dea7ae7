"""Gradient graphs of a loss (onnxruntime-training's ``GradientGraphBuilder``, through
:mod:`graphkit.backend`).

The builder differentiates a scalar output with respect to initializers *or graph
inputs*; the saved graph keeps the forward outputs and adds ``<name>_grad`` for each
requested name. Gradient graphs use ``com.microsoft`` operators (``ReluGrad``,
``SigmoidGrad``...): they run on onnxruntime-training, and :mod:`graphkit.lowering`
rewrites them in standard ONNX for any other runtime.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx

from graphkit import backend
from graphkit._graph import fresh_name, graph_names
from graphkit.compat import finalize
from graphkit.errors import UnknownNameError
from graphkit.lowering import lower_float32_only_ops


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
    model = _isolate(model, wrt)
    model, target = _float32_target(model, output)
    grad = backend.gradient_graph(model, target, wrt)
    if target != output:
        extra = next(o for o in grad.graph.output if o.name == target)
        grad.graph.output.remove(extra)
        lower_float32_only_ops(grad)
    return finalize(grad)


def _isolate(model: onnx.ModelProto, wrt: list[str]) -> onnx.ModelProto:
    """Route each name of ``wrt`` through an Identity before its consumers.

    onnxruntime-training 1.19.2 emits ``<name>_grad`` twice (an invalid graph) when one
    node reads a differentiated input twice, as ``Mul(w, w)`` does.
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    taken = graph_names(copy.graph)
    mapping = {name: fresh_name(f"{name}__read", taken) for name in wrt}
    for node in copy.graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
    nodes = [onnx.helper.make_node("Identity", [n], [m]) for n, m in mapping.items()]
    nodes.extend(copy.graph.node)
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    return copy


def _float32_target(model: onnx.ModelProto, output: str) -> tuple[onnx.ModelProto, str]:
    """The model and the name of a float32 version of ``output`` to differentiate.

    onnxruntime-training 1.19.2 seeds the gradient of the differentiated output with a
    float32 tensor, so a float64 loss fails to build. Differentiating ``Cast(loss, float)``
    instead is exact: the seed is 1 and Cast's gradient casts it back to float64.
    """
    value = next(o for o in model.graph.output if o.name == output)
    if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
        return model, output
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    target = f"{output}__float32"
    copy.graph.node.append(
        onnx.helper.make_node("Cast", [output], [target], to=onnx.TensorProto.FLOAT)
    )
    shape = value.type.tensor_type.shape
    copy.graph.output.append(
        onnx.helper.make_tensor_value_info(
            target, onnx.TensorProto.FLOAT, [d.dim_value or d.dim_param or None for d in shape.dim]
        )
    )
    return copy, target
