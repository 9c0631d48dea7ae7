"""Rewrites that make a converted graph differentiable by onnxruntime-training 1.19.2.

Each computes the same function as the node it replaces:

* ``LayerNormalization`` declares its optional ``Mean`` and ``InvStdDev`` outputs, which
  the gradient builders need (without them: ``node_->OutputDefs().size() was false``);
* an inference ``BatchNormalization`` becomes ``X * a + b`` with
  ``a = scale / sqrt(var + epsilon)`` and ``b = bias - mean * a`` (the full-training
  gradient builder has no gradient for it);
* ``AveragePool`` becomes a convolution with a constant ``1 / prod(kernel)`` kernel over
  ``(N * C, 1, ...)``: onnxruntime's ``AveragePoolGrad`` reads shapes from static
  dimensions and divides by zero (SIGFPE, the process dies) on a symbolic batch;
* the activations its builders have no gradient for (``Elu``, ``Selu``, ``PRelu``,
  ``HardSigmoid``, ``HardSwish``, ``Softplus``, ``Mish``) become the standard operators
  of their definitions (:data:`ACTIVATIONS`: one function each, its formula and its
  gradient at the kinks in its docstring). Their gradients equal torch's autograd,
  kinks included.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import GraphInfo, copy_model, fresh_name, graph_names, int_constant, namer
from graphkit.errors import MissingGradientError

REWRITTEN = frozenset({"LayerNormalization", "BatchNormalization", "AveragePool"})
"""The operators :func:`prepare` rewrites besides :data:`ACTIVATIONS`."""


def prepare(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the rewrites above applied (``model`` itself when none applies: the
    backend runs this on every graph it differentiates, prepared ones included)."""
    if not any(
        n.op_type in REWRITTEN or n.op_type in ACTIVATIONS for n in model.graph.node
    ):
        return model
    model = average_pool_as_conv(unfold_batch_norm(declare_layer_norm_outputs(model)))
    return activations_as_standard_ops(model)


def declare_layer_norm_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every LayerNormalization has its three outputs."""
    out = copy_model(model)
    taken = graph_names(out.graph)
    for node in out.graph.node:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx"):
            while len(node.output) < 3:
                node.output.append("")
            for i, role in ((1, "mean"), (2, "inv_std_dev")):
                if not node.output[i]:
                    node.output[i] = fresh_name(f"{node.output[0]}/{role}", taken)
    return out


def unfold_batch_norm(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every inference BatchNormalization is ``X * a + b`` (see module)."""
    return _rewrite(model, "BatchNormalization", _unfold_one_batch_norm)


def average_pool_as_conv(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every AveragePool is a convolution (see the module docstring).

    Raises:
        MissingGradientError: an AveragePool with ``ceil_mode=1`` (a convolution has no
            such option), naming the node.
    """
    return _rewrite(model, "AveragePool", _one_average_pool_as_conv)


def activations_as_standard_ops(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy where every activation of :data:`ACTIVATIONS` is written with standard
    operators the builders differentiate (an input of unknown or non-float element type
    keeps its node, and the builder's error names it)."""
    return _rewrite_all(model, ACTIVATIONS)


Replacement = Callable[[onnx.NodeProto, dict, GraphInfo], list[onnx.NodeProto] | None]


def _rewrite(model: onnx.ModelProto, op_type: str, replace: Replacement) -> onnx.ModelProto:
    """A copy where each standard ``op_type`` node becomes ``replace(node, attributes,
    info)``'s nodes (None keeps the node as it is)."""
    return _rewrite_all(model, {op_type: replace})


def _rewrite_all(
    model: onnx.ModelProto, replacements: Mapping[str, Replacement]
) -> onnx.ModelProto:
    """:func:`_rewrite` for several operators at once (``{op_type: replace}``), in one
    copy of the model and one shape inference."""
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


def _unfold_one_batch_norm(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo
) -> list[onnx.NodeProto] | None:
    rank = info.rank.get(node.input[0])
    if attrs.get("training_mode", 0) or len([o for o in node.output if o]) != 1 or rank is None:
        return None
    x, scale, bias, mean, var = node.input
    name = namer(f"{node.name or node.output[0]}/unfolded", info.taken)
    eps, std, a, shift, b = (name(s) for s in ("epsilon", "std", "a", "shift", "b"))
    epsilon = np.array(attrs.get("epsilon", 1e-5), dtype=info.dtype(scale))
    # a = scale / sqrt(var + epsilon); b = bias - mean a
    nodes = [
        helper.make_node("Constant", [], [eps], value=numpy_helper.from_array(epsilon)),
        helper.make_node("Add", [var, eps], [f"{std}/sq"]),
        helper.make_node("Sqrt", [f"{std}/sq"], [std]),
        helper.make_node("Div", [scale, std], [a]),
        helper.make_node("Mul", [mean, a], [shift]),
        helper.make_node("Sub", [bias, shift], [b]),
    ]
    if rank > 2:  # (C,) -> (C, 1, ..., 1) to broadcast over the spatial axes
        axes, a_bc, b_bc = name("axes"), name("a_bc"), name("b_bc")
        nodes += [
            int_constant(axes, list(range(1, rank - 1))),
            helper.make_node("Unsqueeze", [a, axes], [a_bc]),
            helper.make_node("Unsqueeze", [b, axes], [b_bc]),
        ]
        a, b = a_bc, b_bc
    scaled = name("scaled")
    nodes.append(helper.make_node("Mul", [x, a], [scaled]))
    nodes.append(helper.make_node("Add", [scaled, b], [node.output[0]]))
    return nodes


def _one_average_pool_as_conv(
    node: onnx.NodeProto, attrs: dict, info: GraphInfo
) -> list[onnx.NodeProto]:
    if attrs.get("ceil_mode", 0):
        raise MissingGradientError(
            f"AveragePool node {node.name!r} uses ceil_mode=1, whose gradient kernel in "
            "onnxruntime-training 1.19.2 crashes on a dynamic batch and which graphkit "
            "cannot rewrite. Export the pooling with ceil_mode=False."
        )
    kernel = list(attrs["kernel_shape"])
    dtype = info.dtype(node.input[0])
    name = namer(f"{node.name or node.output[0]}/as_conv", info.taken)
    x = node.input[0]
    lead, rest, flat_shape, flat = (name(s) for s in ("lead", "rest", "flat_shape", "flat"))
    weight, summed, averaged = name("weight"), name("summed"), name("averaged")
    conv = {k: v for k, v in attrs.items() if k in ("auto_pad", "pads", "strides", "dilations")}
    ones = numpy_helper.from_array(np.ones([1, 1, *kernel], dtype=dtype))
    # (N, C, ...) -> (N * C, 1, ...), a sum over each window by a kernel of ones
    nodes = [
        int_constant(lead, [-1, 1]),
        helper.make_node("Shape", [x], [rest], start=2),
        helper.make_node("Concat", [lead, rest], [flat_shape], axis=0),
        helper.make_node("Reshape", [x, flat_shape], [flat]),
        helper.make_node("Constant", [], [weight], value=ones),
        helper.make_node("Conv", [flat, weight], [summed], kernel_shape=kernel, **conv),
    ]
    padded = any(attrs.get("pads", [])) or attrs.get("auto_pad", "NOTSET") not in (
        "NOTSET",
        "VALID",
    )
    divisor = name("divisor")
    if attrs.get("count_include_pad", 0) or not padded:
        count = numpy_helper.from_array(np.array(np.prod(kernel), dtype=dtype))
        nodes.append(helper.make_node("Constant", [], [divisor], value=count))
    else:  # divide by the number of real (non-padding) cells under each window
        ones_lead, ones_shape, plane = name("ones_lead"), name("ones_shape"), name("plane")
        one = numpy_helper.from_array(np.ones(1, dtype=dtype))
        nodes += [
            int_constant(ones_lead, [1, 1]),
            helper.make_node("Concat", [ones_lead, rest], [ones_shape], axis=0),
            helper.make_node("ConstantOfShape", [ones_shape], [plane], value=one),
            helper.make_node("Conv", [plane, weight], [divisor], kernel_shape=kernel, **conv),
        ]
    spatial, channels, out_shape = name("spatial"), name("channels"), name("out_shape")
    nodes += [
        helper.make_node("Div", [summed, divisor], [averaged]),
        helper.make_node("Shape", [averaged], [spatial], start=2),
        helper.make_node("Shape", [x], [channels], start=0, end=2),
        helper.make_node("Concat", [channels, spatial], [out_shape], axis=0),
        helper.make_node("Reshape", [averaged, out_shape], [node.output[0]]),
    ]
    return nodes


# -- activations ---------------------------------------------------------------------------
#
# Each replacement uses operators both builders differentiate (Greater, Less, Where, Exp,
# Log, Tanh, Neg, Mul, Add, Sub) and never Relu, Max, Min, Abs or Clip, whose gradients at
# a tie or a bound are the builder's choice: every kink is a Where, whose gradient goes to
# the branch it takes, so the docstrings say exactly what the gradient is there.

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
"""The activations onnxruntime-training 1.19.2's builders (both) have no gradient for,
and the function writing each in standard operators (``prepare`` walks this table)."""
