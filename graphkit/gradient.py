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

from graphkit._graph import fresh_name, graph_names
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
    model = _isolate(model, wrt)
    model, target = _float32_target(model, output)
    builder_cls = onnxruntime().capi._pybind_state.GradientGraphBuilder
    try:
        with _quiet_native_stderr(), tempfile.TemporaryDirectory() as folder:
            builder = builder_cls(model.SerializeToString(), {target}, set(wrt), target)
            builder.build()
            path = os.path.join(folder, "gradient.onnx")
            builder.save(path)
            grad = onnx.load(path)
    except RuntimeError as exc:
        raise explain_builder_failure(exc) from exc
    if target != output:
        extra = next(o for o in grad.graph.output if o.name == target)
        grad.graph.output.remove(extra)
        lower_float32_only_ops(grad)
    return finalize(grad)


def lower_float32_only_ops(model: onnx.ModelProto) -> None:
    """Rewrite gradient operators onnxruntime implements for float32 only (in place).

    Used on float64 gradient graphs, each with its closed form in standard operators:

    * FusedMatMul(A, B) = alpha op(A) @ op(B), op a transpose of the last two axes (Einsum)
    * ReluGrad(dY, Y) = dY * (Y > 0); LeakyReluGrad(dY, Y) = dY * (Y > 0 ? 1 : alpha)
    * SoftmaxGrad_13(dY, Y) = Y * (dY - sum(dY * Y, axis))
    * LogSoftmaxGrad_13(dY, Y) = dY - exp(Y) * sum(dY, axis)
    * Scale(X, s) = X * s or X / s (its kernel computes the factor in float32)
    """
    nodes: list[onnx.NodeProto] = []
    for node in model.graph.node:
        lower = _LOWERINGS.get(node.op_type) if node.domain == "com.microsoft" else None
        replacement = lower(node) if lower else None
        nodes.extend(replacement if replacement is not None else [node])
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def _constant_like(name: str, value: float, like: str) -> list[onnx.NodeProto]:
    make = onnx.helper.make_node
    return [
        make("Constant", [], [f"{name}/value"], value_float=float(value)),
        make("CastLike", [f"{name}/value", like], [name]),
    ]


def _fused_matmul(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
    attrs = _attrs(node)
    if attrs.get("transBatchA") or attrs.get("transBatchB"):
        return None
    a = "...ji" if attrs.get("transA") else "...ij"
    b = "...kj" if attrs.get("transB") else "...jk"
    alpha = float(attrs.get("alpha", 1.0))  # type: ignore[arg-type]
    out, base = node.output[0], f"{node.name or node.output[0]}/lowered"
    product = out if alpha == 1.0 else f"{base}/product"
    nodes = [
        onnx.helper.make_node("Einsum", list(node.input), [product], equation=f"{a},{b}->...ik")
    ]
    if alpha != 1.0:
        nodes += _constant_like(f"{base}/alpha", alpha, product)
        nodes.append(onnx.helper.make_node("Mul", [product, f"{base}/alpha"], [out]))
    return nodes


def _relu_grad(node: onnx.NodeProto, slope: float = 0.0) -> list[onnx.NodeProto]:
    make = onnx.helper.make_node
    dy, y = node.input[0], node.input[1]
    base = f"{node.name or node.output[0]}/lowered"
    nodes = _constant_like(f"{base}/zero", 0.0, y) + _constant_like(f"{base}/slope", slope, y)
    nodes += _constant_like(f"{base}/one", 1.0, y)
    nodes.append(make("Greater", [y, f"{base}/zero"], [f"{base}/positive"]))
    nodes.append(
        make("Where", [f"{base}/positive", f"{base}/one", f"{base}/slope"], [f"{base}/gate"])
    )
    nodes.append(make("Mul", [dy, f"{base}/gate"], [node.output[0]]))
    return nodes


def _softmax_grad(node: onnx.NodeProto, log: bool) -> list[onnx.NodeProto]:
    make = onnx.helper.make_node
    dy, y = node.input[0], node.input[1]
    axis = int(_attrs(node).get("axis", -1))  # type: ignore[arg-type]
    base = f"{node.name or node.output[0]}/lowered"
    nodes = [make("Constant", [], [f"{base}/axes"], value_ints=[axis])]
    if log:  # dX = dY - exp(Y) sum(dY)
        nodes.append(make("ReduceSum", [dy, f"{base}/axes"], [f"{base}/sum"], keepdims=1))
        nodes.append(make("Exp", [y], [f"{base}/p"]))
        nodes.append(make("Mul", [f"{base}/p", f"{base}/sum"], [f"{base}/scaled"]))
        nodes.append(make("Sub", [dy, f"{base}/scaled"], [node.output[0]]))
    else:  # dX = Y (dY - sum(dY Y))
        nodes.append(make("Mul", [dy, y], [f"{base}/dyy"]))
        nodes.append(
            make("ReduceSum", [f"{base}/dyy", f"{base}/axes"], [f"{base}/sum"], keepdims=1)
        )
        nodes.append(make("Sub", [dy, f"{base}/sum"], [f"{base}/centered"]))
        nodes.append(make("Mul", [y, f"{base}/centered"], [node.output[0]]))
    return nodes


def _scale(node: onnx.NodeProto) -> list[onnx.NodeProto]:
    make = onnx.helper.make_node
    x, factor = node.input[0], node.input[1]
    base = f"{node.name or node.output[0]}/lowered"
    binary = "Div" if _attrs(node).get("scale_down") else "Mul"
    return [
        make("CastLike", [factor, x], [f"{base}/factor"]),
        make(binary, [x, f"{base}/factor"], [node.output[0]]),
    ]


_LOWERINGS = {
    "FusedMatMul": _fused_matmul,
    "Scale": _scale,
    "ReluGrad": _relu_grad,
    "LeakyReluGrad": lambda n: _relu_grad(n, float(_attrs(n).get("alpha", 0.01))),  # type: ignore[arg-type]
    "SoftmaxGrad_13": lambda n: _softmax_grad(n, log=False),
    "LogSoftmaxGrad_13": lambda n: _softmax_grad(n, log=True),
}


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


def explain_builder_failure(exc: BaseException) -> MissingGradientError:
    """The error to raise when onnxruntime-training's gradient builders fail."""
    found = _NO_BUILDER.search(str(exc))
    if found:
        op_type, node = found.groups()
        return MissingGradientError(
            f"onnxruntime-training 1.19.2 has no gradient for operator {op_type!r} "
            f"(node {node!r}). Rewrite that part with differentiable operators "
            "(e.g. Softplus(x) as Log(1 + Exp(x)), Atan with a series or a lookup) or "
            "keep it off the path between the weights and the loss."
        )
    return MissingGradientError(f"Building the gradient graph failed: {_short(exc)}")


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


@contextlib.contextmanager
def _quiet_native_stderr() -> Iterator[None]:
    """Silence the builder's C++ logging, which ignores onnxruntime's logger severity.

    Failures still surface: the builder raises a Python exception, and the message is
    rewritten above.
    """
    fd = 2  # the C++ side writes to fd 2 even where sys.stderr is no file (notebooks)
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
