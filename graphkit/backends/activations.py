"""Activations written with the standard operators of their definitions.

``Elu``, ``Selu``, ``PRelu``, ``HardSigmoid``, ``HardSwish``, ``Softplus`` and ``Mish``
become ``Exp``, ``Log``, ``Tanh``, ``Where``, ``Max``/``Min``... (:data:`ACTIVATIONS`: one
function each, its formula and its gradient at the kinks in its docstring; the gradients
equal torch's autograd, kinks included). Two backends need them:

* onnxruntime-training 1.19.2's gradient builders have no gradient for any of the seven
  (:mod:`graphkit.backends.ort_training.rewrites`);
* onnxruntime 1.19.2 has no float64 kernel for most of them, so the native backend writes
  them out in float64 graphs (:mod:`graphkit.backends.native`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import GraphInfo, copy_model, namer

# Each replacement uses operators both of onnxruntime-training's builders differentiate
# (Greater, Less, Where, Exp, Log, Tanh, Neg, Mul, Add, Sub) and never Relu, Max, Min, Abs
# or Clip, whose gradients at a tie or a bound are the builder's choice: every kink is a
# Where, whose gradient goes to the branch it takes, so the docstrings say exactly what
# the gradient is there.

Replacement = Callable[[onnx.NodeProto, dict, GraphInfo], list[onnx.NodeProto] | None]


def activations_as_standard_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every activation of :data:`ACTIVATIONS` is written with standard
    operators (an input of unknown or non-float element type keeps its node)."""
    return rewrite_all(model, ACTIVATIONS)


def rewrite_all(model: onnx.ModelProto, replacements: Mapping[str, Replacement]) -> onnx.ModelProto:
    """A copy where each standard node whose operator is in ``replacements`` becomes
    ``replacements[op_type](node, attributes, info)``'s nodes (None keeps the node), in
    one copy of the model and one shape inference."""
    out = copy_model(model)
    if not any(n.op_type in replacements for n in out.graph.node):
        return out
    info = GraphInfo(out)
    nodes: list[onnx.NodeProto] = []
    for node in out.graph.node:
        replacement = None
        if node.op_type in replacements and node.domain in ("", "ai.onnx"):
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            replacement = replacements[node.op_type](node, attrs, info)
        nodes.extend([node] if replacement is None else replacement)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)


class _Nodes:
    """The nodes replacing one node: fresh names under its name, and constants in the
    element type of its input (None from :meth:`start` when that type is not known to
    be float32 or float64, the types tested: the node is then kept)."""

    def __init__(self, node: onnx.NodeProto, info: GraphInfo, dtype: np.dtype) -> None:
        self.name = namer(f"{node.name or node.output[0]}/{node.op_type.lower()}", info.taken)
        self.dtype = dtype
        self.nodes: list[onnx.NodeProto] = []

    @classmethod
    def start(cls, node: onnx.NodeProto, info: GraphInfo) -> _Nodes | None:
        if info.elem.get(node.input[0]) not in _FLOATS:
            return None
        return cls(node, info, info.dtype(node.input[0]))

    def const(self, value: float) -> str:
        """A scalar Constant of the input's element type."""
        out = self.name("const")
        tensor = numpy_helper.from_array(np.array(value, dtype=self.dtype))
        self.nodes.append(helper.make_node("Constant", [], [out], value=tensor))
        return out

    def op(self, op_type: str, *inputs: str, out: str | None = None) -> str:
        """One node; returns its output (``out``, or a fresh name)."""
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, list(inputs), [out]))
        return out

    def elu(self, x: str, alpha: float, out: str | None = None) -> str:
        """Where(x > 0, x, alpha (Exp(Where(x > 0, 0, x)) - 1)): the exponential reads
        0 where x > 0, so it never overflows (and the gradient it sends to the branch
        not taken, 0 * exp(x), is never 0 * inf)."""
        zero, one = self.const(0.0), self.const(1.0)
        positive = self.op("Greater", x, zero)
        exp = self.op("Exp", self.op("Where", positive, zero, x))
        negative = self.op("Mul", self.op("Sub", exp, one), self.const(alpha))
        return self.op("Where", positive, x, negative, out=out)

    def softplus(self, x: str, out: str | None = None) -> str:
        """Where(x > 0, x, 0) + log1p(Exp(Where(x > 0, -x, x))), i.e.
        max(x, 0) + log(1 + exp(-|x|)), both kinks taken on the same side of 0.

        ONNX has no Log1p: log(1 + u) is Log(v) - ((v - 1) - u) / v with v = 1 + u
        rounded, the rounding of ``1 + u`` corrected to first order (the correction is
        exact: ``v - 1`` and its difference with u are exact in floating point), so a
        small result keeps its relative precision (a plain Log(1 + u) is 0 below half an
        ulp of 1). Its gradient is 1 / v up to a relative ulp (the correction's own
        gradient is (1 - 1) / v minus a term of the order of an ulp)."""
        zero, one = self.const(0.0), self.const(1.0)
        positive = self.op("Greater", x, zero)
        relu = self.op("Where", positive, x, zero)
        u = self.op("Exp", self.op("Where", positive, self.op("Neg", x), x))
        v = self.op("Add", u, one)
        rounding = self.op("Sub", self.op("Sub", v, one), u)
        log1p = self.op("Sub", self.op("Log", v), self.op("Div", rounding, v))
        return self.op("Add", relu, log1p, out=out)

    def hard_sigmoid(self, x: str, alpha: float, beta: float, out: str | None = None) -> str:
        """Where(z < 1, Where(z > 0, z, 0), 1) with z = alpha x + beta."""
        zero, one = self.const(0.0), self.const(1.0)
        z = self.op("Add", self.op("Mul", x, self.const(alpha)), self.const(beta))
        inside = self.op("Where", self.op("Greater", z, zero), z, zero)
        return self.op("Where", self.op("Less", z, one), inside, one, out=out)


SELU_ALPHA = 1.67326319217681884765625
SELU_GAMMA = 1.05070102214813232421875
"""Selu's default attributes (ONNX's float32 values)."""
HARD_SWISH_ALPHA = float(np.float32(1 / 6))
"""HardSwish's 1/6, a float32 HardSigmoid attribute in ONNX's definition."""


def _attribute(attrs: dict, name: str, default: float) -> float:
    """A float attribute, or its default as the float32 value that ONNX stores (what
    onnxruntime's kernels compute with, in float64 too)."""
    return float(np.float32(attrs.get(name, default)))


def _elu(node: onnx.NodeProto, attrs: dict, info: GraphInfo) -> list[onnx.NodeProto] | None:
    """Elu(x) = x if x > 0 else alpha (exp(x) - 1), alpha = 1.0 by default.

    Gradient: 1 for x > 0, alpha exp(x) for x <= 0: alpha at 0, as torch's ``elu`` and
    ``jax.nn.elu``.
    """
    nodes = _Nodes.start(node, info)
    if nodes is None:
        return None
    nodes.elu(node.input[0], _attribute(attrs, "alpha", 1.0), out=node.output[0])
    return nodes.nodes


def _selu(node: onnx.NodeProto, attrs: dict, info: GraphInfo) -> list[onnx.NodeProto] | None:
    """Selu(x) = gamma x if x > 0 else gamma alpha (exp(x) - 1), i.e. gamma Elu(x; alpha),
    alpha = 1.67326319..., gamma = 1.05070102... by default.

    Gradient: gamma for x > 0, gamma alpha exp(x) for x <= 0: gamma alpha at 0, as
    torch's ``selu``.
    """
    nodes = _Nodes.start(node, info)
    if nodes is None:
        return None
    elu = nodes.elu(node.input[0], _attribute(attrs, "alpha", SELU_ALPHA))
    gamma = nodes.const(_attribute(attrs, "gamma", SELU_GAMMA))
    nodes.op("Mul", elu, gamma, out=node.output[0])
    return nodes.nodes


def _prelu(node: onnx.NodeProto, attrs: dict, info: GraphInfo) -> list[onnx.NodeProto] | None:
    """PRelu(x, slope) = x if x >= 0 else slope x, as Where(x > 0, x, slope x): ``slope``
    broadcasts unidirectionally to x, so ``slope x`` has the shape of x; it stays the
    node's input (an initializer stays a trained parameter).

    Gradient: d/dx = 1 for x > 0, slope for x <= 0; d/dslope = 0 for x > 0, x for x <= 0:
    slope and 0 at x = 0, as torch's ``prelu``.
    """
    nodes = _Nodes.start(node, info)
    if nodes is None:
        return None
    x, slope = node.input[0], node.input[1]
    positive = nodes.op("Greater", x, nodes.const(0.0))
    scaled = nodes.op("Mul", x, slope)
    nodes.op("Where", positive, x, scaled, out=node.output[0])
    return nodes.nodes


def _hard_sigmoid(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo
) -> list[onnx.NodeProto] | None:
    """HardSigmoid(x) = max(0, min(1, alpha x + beta)), alpha = 0.2, beta = 0.5 by default.

    Gradient: alpha where 0 < alpha x + beta < 1, else 0: 0 at both kinks, as torch's
    ``hardsigmoid`` (0 at x = -3 and 3).
    """
    nodes = _Nodes.start(node, info)
    if nodes is None:
        return None
    alpha, beta = _attribute(attrs, "alpha", 0.2), _attribute(attrs, "beta", 0.5)
    nodes.hard_sigmoid(node.input[0], alpha, beta, out=node.output[0])
    return nodes.nodes


def _hard_swish(node: onnx.NodeProto, attrs: dict, info: GraphInfo) -> list[onnx.NodeProto] | None:
    """HardSwish(x) = x HardSigmoid(x; alpha = 1/6, beta = 0.5) = x max(0, min(1, x/6 + 1/2)),
    1/6 rounded to float32 as in ONNX's definition (a HardSigmoid attribute).

    Gradient: 0 for x <= -3, x/3 + 1/2 for -3 < x < 3, 1 for x >= 3 (the product rule with
    HardSigmoid's gradient, 0 at its kinks): 0 at -3 and 1 at 3, as torch's ``hardswish``.
    """
    nodes = _Nodes.start(node, info)
    if nodes is None:
        return None
    x = node.input[0]
    sigmoid = nodes.hard_sigmoid(x, HARD_SWISH_ALPHA, 0.5)
    nodes.op("Mul", x, sigmoid, out=node.output[0])
    return nodes.nodes


def _softplus(node: onnx.NodeProto, attrs: dict, info: GraphInfo) -> list[onnx.NodeProto] | None:
    """Softplus(x) = log(1 + exp(x)), computed as max(x, 0) + log(1 + exp(-|x|)), which
    never overflows (exp reads -|x| <= 0); the log(1 + .) keeps the relative precision
    of small values (see ``_Nodes.softplus``).

    Gradient: sigmoid(x) everywhere, 1/2 at 0 (max and |.| take their kinks on the same
    side, so their one-sided slopes sum to the smooth value), as torch's ``softplus``.
    """
    nodes = _Nodes.start(node, info)
    if nodes is None:
        return None
    nodes.softplus(node.input[0], out=node.output[0])
    return nodes.nodes


def _mish(node: onnx.NodeProto, attrs: dict, info: GraphInfo) -> list[onnx.NodeProto] | None:
    """Mish(x) = x tanh(softplus(x)), softplus as in :func:`_softplus`.

    Gradient: tanh(softplus(x)) + x sigmoid(x) (1 - tanh(softplus(x))^2), smooth (0.6 at
    0), as torch's ``mish``.
    """
    nodes = _Nodes.start(node, info)
    if nodes is None:
        return None
    x = node.input[0]
    tanh = nodes.op("Tanh", nodes.softplus(x))
    nodes.op("Mul", x, tanh, out=node.output[0])
    return nodes.nodes


ACTIVATIONS: dict[str, Replacement] = {
    "Elu": _elu,
    "Selu": _selu,
    "PRelu": _prelu,
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": _hard_swish,
    "Softplus": _softplus,
    "Mish": _mish,
}
"""The activations written out, by operator: those onnxruntime-training 1.19.2's
builders (both) have no gradient for, and onnxruntime 1.19.2 no float64 kernel."""


__all__ = ["ACTIVATIONS", "Replacement", "activations_as_standard_ops", "rewrite_all"]
