"""Reverse rules for ``LSTM`` and ``GRU`` whose products are batched over time.

onnx-ad expands a recurrent operator into a ``Scan`` over its equations before its rules
run, and the reverse of that ``Scan`` runs the adjoint of every product of a step at
every step, the weight gradients included (``dR += h^T dg``, a product on
``[batch, hidden]`` tensors where a kernel call costs more than its arithmetic).

These rules keep the primal operator, so that the forward is onnxruntime's fused kernel
(one call for the whole sequence), and write the reverse as cuDNN does, per direction:

1. the gates of every step at once, from the operator's output ``Y`` (the hidden state
   of every step, so the state before each step is known):
   ``G = X W^T + H_prev R^T + b``, two products over ``[T N]`` rows;
2. a ``Scan`` backwards through time that carries the state's gradient and does only
   what cannot be batched: the recurrent product ``dh_prev = dG_t R`` and the
   elementwise work of a step, every factor that does not depend on the carried
   gradient computed before it for all the steps at once;
3. the gradients of the weights and of the input as one product each over the
   ``[T N]`` rows: ``dW = dG^T X``, ``dR = dG_h^T H_prev``, ``dB = sum dG``,
   ``dX = dG W``.

LSTM (gates ``i, o, f, c`` as the spec orders them)::

    i, o, f = sigmoid(G[:3H]),  z = tanh(G[3H:]),  c_t = f c_{t-1} + i z,  h_t = o tanh(c_t)
    dh = dY_t + dh_next,  dc = dc_next + dh o (1 - tanh^2 c_t)
    dG_t = [dc z i(1-i), dh tanh(c_t) o(1-o), dc c_{t-1} f(1-f), dc i (1-z^2)]
    dh_next <- dG_t R,  dc_next <- dc f

The cell state of every step comes from an elementwise ``Scan`` of
``c_t = f_t c_{t-1} + i_t z_t`` (the fused kernel returns only the last one).

GRU (gates ``z, r, h``; ``linear_before_reset=1``, as torch exports it)::

    z, r = sigmoid(XW[:2H] + HR[:2H]),  n = tanh(XW[2H:] + r HR[2H:]),
    h_t = (1 - z) n + z h_{t-1}       (XW = X W^T + Wb, HR = H_prev R^T + Rb)
    every gate gradient is dh times a factor known before the loop:
    dG_h = dh [(h_{t-1} - n) z(1-z), (1-z)(1-n^2) HR_n r(1-r), (1-z)(1-n^2) r]
    dG_x = dG_h with its last block (1-z)(1-n^2);  dh_next <- dh z + dG_h R

With ``sequence_lens``, the steps beyond a row's length pass the state's gradient through
(the factors masked, ``f`` or ``z`` taken as 1 there), and the reverse direction, which
walks each row from its own last step, is the forward one on the sequences reversed
within their lengths (``ReverseSequence``).

Taken: ``forward``, ``reverse`` and ``bidirectional`` (each direction on its own),
``layout`` 0, the default activations, no ``clip``; LSTM without peepholes nor
``input_forget``, GRU with ``linear_before_reset=1``. onnx-ad expands any
other recurrent node as before (:func:`expanding_the_others`).

The rules read the derivatives with a seed axis of one (graphkit differentiates one
scalar loss, or one vector-Jacobian product), as :meth:`Context.full` writes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx
from onnx import TensorProto, helper

_LSTM_ACTIVATIONS = ("Sigmoid", "Tanh", "Tanh")
_GRU_ACTIVATIONS = ("Sigmoid", "Tanh")
_HELD = "GraphkitHeld"  # a taken node's op_type prefix while onnx-ad expands the others


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def takes(node: onnx.NodeProto) -> bool:
    """Whether the rules of this module differentiate ``node`` (see the module)."""
    if node.op_type not in ("LSTM", "GRU") or node.domain not in ("", "ai.onnx"):
        return False
    attrs = _attributes(node)
    defaults = _LSTM_ACTIVATIONS if node.op_type == "LSTM" else _GRU_ACTIVATIONS
    directions = 2 if attrs.get("direction", b"forward") == b"bidirectional" else 1
    activations = tuple(a.decode() for a in attrs.get("activations", []))
    inputs = list(node.input) + [""] * (8 - len(node.input))
    common = (
        "hidden_size" in attrs
        and attrs.get("layout", 0) == 0
        and "clip" not in attrs
        and activations in ((), defaults * directions)
        and not attrs.get("activation_alpha")
        and not attrs.get("activation_beta")
    )
    if node.op_type == "LSTM":
        return common and attrs.get("input_forget", 0) == 0 and not inputs[7]
    return common and attrs.get("linear_before_reset", 0) == 1


def expanding_the_others(expand: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """onnx-ad's ``expand_recurrent``, leaving the nodes :func:`takes` accepts as they
    are (their op_type is held under another name while it runs)."""

    def expand_others(model: Any) -> Any:
        if not any(takes(n) for n in model.graph.node):
            return expand(model)
        held = type(model)()
        held.CopyFrom(model)
        for node in held.graph.node:
            if takes(node):
                node.op_type = _HELD + node.op_type
        expanded = expand(held)
        for node in expanded.graph.node:
            if node.op_type.startswith(_HELD):
                node.op_type = node.op_type[len(_HELD) :]
        return expanded

    return expand_others


class _Direction:
    """What a direction's reverse reads: its weights, initial states and outputs, each
    with the direction axis dropped, and the builders of its ``Scan``s."""

    def __init__(self, ctx: Any, node: onnx.NodeProto, index: int, y: str) -> None:
        self.ctx, self.b = ctx, ctx.b
        attrs = _attributes(node)
        self.hidden = int(attrs["hidden_size"])
        direction = attrs.get("direction", b"forward")
        self.backwards = direction == b"reverse" or (direction == b"bidirectional" and index == 1)
        self.dtype = ctx.dtype(node.input[0], node.input[1])
        inputs = list(node.input) + [""] * (8 - len(node.input))
        self.x = inputs[0]
        at = self.b.constant(index, TensorProto.INT64, ())
        self.w, self.r = (self.b.op("Gather", [inputs[k], at], axis=0) for k in (1, 2))
        self.bias = self.b.op("Gather", [inputs[3], at], axis=0) if inputs[3] else ""
        self.h0, self.c0 = (
            self.b.op("Gather", [inputs[k], at], axis=0) if inputs[k] else self.zeros()
            for k in (5, 6)
        )
        self.y = self.b.op("Gather", [y, at], axis=1)  # [T, N, H]
        self.valid: str | None = None  # [T, N, 1]: 1 where a step is within its row's length
        self.reversed = False
        if inputs[4]:
            self._lengths(inputs[4])

    def _lengths(self, sequence_lens: str) -> None:
        """With ``sequence_lens``: the mask of the steps within each row's length, and for
        the reverse direction (which walks each row from its own last step) every
        sequence reversed within its length, so that it reads as the forward direction
        (``ReverseSequence``; the input's gradient is reversed back)."""
        b = self.b
        lengths = b.op("Cast", [sequence_lens], to=TensorProto.INT64)
        steps = b.op("Slice", [b.op("Shape", [self.x]), b.ints([0]), b.ints([1])])
        count = b.op("Squeeze", [steps, b.ints([0])])
        zero, one = (b.constant(v, TensorProto.INT64, ()) for v in (0, 1))
        times = b.op("Unsqueeze", [b.op("Range", [zero, count, one]), b.ints([1])])  # [T, 1]
        within = b.op("Less", [times, b.op("Unsqueeze", [lengths, b.ints([0])])])  # [T, N]
        mask = b.op("Cast", [within], to=self.dtype)
        self.valid = b.op("Unsqueeze", [mask, b.ints([2])])
        if self.backwards:
            self.lengths = lengths
            self.x, self.y = (self.reverse_within_lengths(v) for v in (self.x, self.y))
            self.backwards, self.reversed = False, True

    def reverse_within_lengths(self, sequence: str) -> str:
        """``sequence`` [T, N, ...] with each row's first ``length`` steps reversed."""
        return self.b.op("ReverseSequence", [sequence, self.lengths], time_axis=0, batch_axis=1)

    def masked(self, value: str) -> str:
        """``value`` [T, N, ...] zero at the steps beyond each row's length."""
        return value if self.valid is None else self.b.op("Mul", [value, self.valid])

    def passing(self, factor: str) -> str:
        """``factor`` [T, N, H] within each row's length, 1 beyond it (where the state
        passes through the step unchanged)."""
        if self.valid is None:
            return factor
        return self.one_minus(self.b.op("Mul", [self.valid, self.one_minus(factor)]))

    def zeros(self) -> str:
        """A zero state ``[N, H]``, the batch read off ``X``."""
        b = self.b
        batch = b.op("Slice", [b.op("Shape", [self.x]), b.ints([1]), b.ints([2])])
        shape = b.op("Concat", [batch, b.ints([self.hidden])], axis=0)
        zero = helper.make_tensor("zero", self.dtype, [1], [0])
        return b.op("ConstantOfShape", [shape], value=zero)

    def previous(self, sequence: str, initial: str) -> str:
        """``sequence`` [T, N, H] one step late in this direction's order: the initial
        state at the first step processed."""
        b = self.b
        first = b.op("Unsqueeze", [initial, b.ints([0])])
        if self.backwards:
            rest = b.op("Slice", [sequence, b.ints([1]), b.ints([2**62]), b.ints([0])])
            return b.op("Concat", [rest, first], axis=0)
        rest = b.op("Slice", [sequence, b.ints([0]), b.ints([-1]), b.ints([0])])
        return b.op("Concat", [first, rest], axis=0)

    def product(self, rows: str, weight: str, bias: str | None) -> str:
        """``rows weight^T + bias`` over ``[T N]`` rows: one ``Gemm`` (``rows`` is
        ``[T, N, k]``; the result ``[T N, gates H]``)."""
        b = self.b
        flat = b.op("Flatten", [rows], axis=2)
        return b.op("Gemm", [flat, weight] + ([bias] if bias else []), transB=1)

    def biases(self, gates: int) -> tuple[str | None, str | None]:
        """``(Wb, Rb)``, ``[gates H]`` each, None without a bias."""
        if not self.bias:
            return None, None
        size = gates * self.hidden
        return tuple(self.b.op("Split", [self.bias, self.b.ints([size, size])], outputs=2, axis=0))

    def as_steps(self, rows: str) -> str:
        """``[T N, k]`` rows as ``[T, N, k]``."""
        b = self.b
        steps = b.op("Slice", [b.op("Shape", [self.y]), b.ints([0]), b.ints([2])])
        return b.op("Reshape", [rows, b.op("Concat", [steps, b.ints([-1])], axis=0)])

    def incoming(self, d_y: str | None, d_last_h: str | None) -> tuple[str, str | None]:
        """``(dh, dY_next)``: the gradient reaching the hidden state of the step the
        reverse starts with (the last processed: ``dY_h`` and that step's ``dY``), and
        ``dY`` one step late in the reverse's order (zeros at the first step processed),
        which each reverse step adds to the gradient it sends back; None without ``dY``.
        """
        if d_y is None:
            return (d_last_h if d_last_h is not None else self.zeros()), None
        b = self.b
        d_y = self.masked(d_y)  # beyond a row's length, Y is zeros: constant
        if self.reversed:
            d_y = self.reverse_within_lengths(d_y)
        last = b.constant(0 if self.backwards else -1, TensorProto.INT64, ())
        start = b.op("Gather", [d_y, last], axis=0)
        if d_last_h is not None:
            start = b.op("Add", [start, d_last_h])
        return start, self.previous(d_y, self.zeros())

    def one_minus(self, value: str) -> str:
        return self.b.op("Sub", [self.ctx.constant(1.0, self.dtype), value])

    def value(self, name: str, width: int) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, self.dtype, [None, width])

    def scan(
        self,
        body: onnx.GraphProto,
        carried: list[str],
        scanned: list[str],
        outputs: int,
        *,
        backwards: bool,
    ) -> list[str]:
        """A ``Scan`` through time (last step first when ``backwards``; its stacked
        outputs in the time order of its inputs either way): its final carried values,
        then its stacked outputs."""
        n_out = len(body.output) - len(carried)
        return self.b.op(
            "Scan",
            [*carried, *scanned],
            outputs=outputs,
            body=body,
            num_scan_inputs=len(scanned),
            scan_input_directions=[int(backwards)] * len(scanned),
            scan_output_directions=[int(backwards)] * n_out,
        )

    def cells(self, f: str, iz: str) -> str:
        """The cell state of every step, ``c_t = f_t c_{t-1} + i_t z_t``."""
        b, H = self.b, self.hidden
        c, f_t, iz_t = b.name("c"), b.name("f_t"), b.name("iz_t")
        fc, c_new, c_out = b.name("fc"), b.name("c_new"), b.name("c_out")
        body = helper.make_graph(
            [
                helper.make_node("Mul", [f_t, c], [fc]),
                helper.make_node("Add", [fc, iz_t], [c_new]),
                helper.make_node("Identity", [c_new], [c_out]),
            ],
            b.name("lstm_cells"),
            [self.value(c, H), self.value(f_t, H), self.value(iz_t, H)],
            [self.value(c_new, H), self.value(c_out, H)],
        )
        return self.scan(body, [self.c0], [f, iz], 2, backwards=self.backwards)[1]

    def weight_gradients(
        self, dgx: str, dgh: str, h_prev: str, gates: int, wanted: set[str]
    ) -> dict[str, str]:
        """Those of ``dX, dW, dR, dB`` in ``wanted``, from the gate gradients of every step:
        ``dgx`` those of ``X W^T + Wb``, ``dgh`` those of ``H_prev R^T + Rb``
        (``[T, N, gates H]``; the same tensor for an LSTM)."""
        b, width = self.b, gates * self.hidden
        rows = b.ints([-1, width])
        grads: dict[str, str] = {}
        if "X" in wanted:
            grads["X"] = b.op("MatMul", [dgx, self.w])
            if self.reversed:
                grads["X"] = self.reverse_within_lengths(grads["X"])
        if "W" in wanted:
            features = b.op("Slice", [b.op("Shape", [self.x]), b.ints([2]), b.ints([3])])
            flat_x = b.op("Reshape", [self.x, b.op("Concat", [b.ints([-1]), features], axis=0)])
            grads["W"] = b.op("Gemm", [b.op("Reshape", [dgx, rows]), flat_x], transA=1)
        if "R" in wanted:
            flat_h = b.op("Reshape", [h_prev, b.ints([-1, self.hidden])])
            grads["R"] = b.op("Gemm", [b.op("Reshape", [dgh, rows]), flat_h], transA=1)
        if "B" in wanted:
            time_and_batch = b.ints([0, 1])
            db_x = b.op("ReduceSum", [dgx, time_and_batch], keepdims=0)
            db_h = db_x if dgh == dgx else b.op("ReduceSum", [dgh, time_and_batch], keepdims=0)
            grads["B"] = b.op("Concat", [db_x, db_h], axis=0)
        return grads


def _without_seed(ctx: Any, grad: str | None, primal: str) -> str | None:
    """A derivative of ``primal`` materialized to its shape, the seed axis (of one)
    dropped; ``None`` when none reaches it."""
    if grad is None or not primal:
        return None
    return ctx.b.op("Squeeze", [ctx.full(grad, primal), ctx.b.ints([-1])])


def _with_y(ctx: Any, node: onnx.NodeProto) -> str:
    """The name of ``node``'s ``Y`` output, given one (the primal node replaced) when it
    had none: the reverse reads every step's hidden state."""
    if node.output[0]:
        return node.output[0]
    y = ctx.b.name(f"{node.name or node.op_type}_Y")
    taped = onnx.NodeProto()
    taped.CopyFrom(node)
    taped.output[0] = y
    ctx.replace_primal(node, taped)
    return y


_KEYS = ("X", "W", "R", "B", "", "initial_h", "initial_c", "")
"""The name of each input's gradient in what a direction's reverse returns."""


def _per_direction(
    ctx: Any, node: onnx.NodeProto, grads: list, reverse_one: Callable[..., dict[str, str]]
) -> list:
    """The contributions to ``node``'s inputs: ``reverse_one`` run for each direction on
    its slice of the output gradients, and the results stacked back along the direction
    axis (the input's gradient summed)."""
    attrs = _attributes(node)
    directions = 2 if attrs.get("direction", b"forward") == b"bidirectional" else 1
    outputs = list(node.output) + [""] * (3 - len(node.output))
    grads = list(grads) + [None] * (3 - len(grads))
    d_y, d_last_h, d_last_c = (_without_seed(ctx, g, o) for g, o in zip(grads, outputs))
    y = _with_y(ctx, node)
    b = ctx.b
    wanted = {k for k, name in zip(_KEYS, node.input) if k and name and ctx.asked_for(name)}
    parts: list[dict[str, str]] = []
    for index in range(directions):
        at = b.constant(index, TensorProto.INT64, ())
        d_y_at, d_h_at, d_c_at = (
            None if value is None else b.op("Gather", [value, at], axis=axis)
            for value, axis in ((d_y, 1), (d_last_h, 0), (d_last_c, 0))
        )
        direction = _Direction(ctx, node, index, y)
        parts.append(reverse_one(direction, d_y_at, d_h_at, d_c_at, wanted))
    contributions: list = []
    for key in _KEYS[: len(node.input)]:
        if key not in wanted:
            contributions.append(None)
            continue
        if key == "X":
            total = parts[0]["X"]
            for part in parts[1:]:
                total = b.op("Add", [total, part["X"]])
        else:
            stacked = [b.op("Unsqueeze", [p[key], b.ints([0])]) for p in parts]
            total = stacked[0] if len(stacked) == 1 else b.op("Concat", stacked, axis=0)
        contributions.append(b.op("Unsqueeze", [total, b.ints([-1])]))
    return contributions


def _lstm_one(
    d: _Direction, d_y: str | None, d_last_h: str | None, d_last_c: str | None, wanted: set
) -> dict[str, str]:
    """One direction of an LSTM's reverse (see the module)."""
    b, H = d.b, d.hidden
    h_prev = d.previous(d.y, d.h0)
    # the gates of every step, with the cell gate's rows of W, R and the biases doubled,
    # so that one Sigmoid gives all four: tanh(g) = 2 sigmoid(2 g) - 1
    doubled = b.constant([1.0] * 3 * H + [2.0] * H, d.dtype, (4 * H,))
    column = b.op("Unsqueeze", [doubled, b.ints([1])])
    w, r = b.op("Mul", [d.w, column]), b.op("Mul", [d.r, column])
    wb, rb = d.biases(4)
    bias = None if wb is None else b.op("Mul", [b.op("Add", [wb, rb]), doubled])
    gates = b.op("Gemm", [b.op("Flatten", [h_prev], axis=2), r, d.product(d.x, w, bias)], transB=1)
    sig = d.as_steps(b.op("Sigmoid", [gates]))  # i, o, f, (z + 1) / 2
    i, o, f, s = b.op("Split", [sig, b.ints([H] * 4)], outputs=4, axis=-1)
    z = b.op("Sub", [b.op("Mul", [s, d.ctx.constant(2.0, d.dtype)]), d.ctx.constant(1.0, d.dtype)])
    cells = d.cells(f, b.op("Mul", [i, z]))
    c_prev = d.previous(cells, d.c0)
    tc = b.op("Tanh", [cells])
    # every factor of the step's reverse that does not depend on the carried gradient:
    # sig (1 - sig) times [z, tanh c, c_prev, 4 i] (dz/dg = 1 - z^2 = 4 s (1 - s))
    slopes = b.op("Mul", [sig, d.one_minus(sig)])
    four_i = b.op("Mul", [i, d.ctx.constant(4.0, d.dtype)])
    factors = b.op("Mul", [slopes, b.op("Concat", [z, tc, c_prev, four_i], axis=-1)])
    from_h = b.op("Mul", [o, d.one_minus(b.op("Mul", [tc, tc]))])
    # beyond a row's length the state passes through: no gate gradient, dc unchanged,
    # and dh sent back as it came (``keep``, added to the product's addend)
    factors, from_h, forget = d.masked(factors), d.masked(from_h), d.passing(f)
    start_h, dy_next = d.incoming(d_y, d_last_h)
    n = {k: b.name(k) for k in ("dh", "dc_in", "a_t", "k_t", "f_t", "dy_next_t", "dha", "dc")}
    n.update({k: b.name(k) for k in ("sel", "dg", "dc_prev", "dh_prev", "keep_t", "kept")})
    n["addend"] = b.name("addend")
    nodes = [
        helper.make_node("Mul", [n["dh"], n["a_t"]], [n["dha"]]),
        helper.make_node("Add", [n["dc_in"], n["dha"]], [n["dc"]]),
        helper.make_node("Concat", [n["dc"], n["dh"], n["dc"], n["dc"]], [n["sel"]], axis=-1),
        helper.make_node("Mul", [n["sel"], n["k_t"]], [n["dg"]]),
        helper.make_node("Mul", [n["dc"], n["f_t"]], [n["dc_prev"]]),
    ]
    addend = n["dy_next_t"] if dy_next else None  # the next step's dY
    if d.valid is not None:
        nodes.append(helper.make_node("Mul", [n["dh"], n["keep_t"]], [n["kept"]]))
        addend = n["kept"]
        if dy_next:
            nodes.append(helper.make_node("Add", [n["kept"], n["dy_next_t"]], [n["addend"]]))
            addend = n["addend"]
    nodes.append(helper.make_node("Gemm", [n["dg"], d.r] + [addend] * bool(addend), [n["dh_prev"]]))
    optional = [("dy_next_t", H, dy_next)]
    keep = None if d.valid is None else d.one_minus(d.valid)
    optional.append(("keep_t", 1, keep))
    body = helper.make_graph(
        nodes,
        b.name("lstm_reverse_step"),
        [d.value(n[k], 4 * H if k == "k_t" else H) for k in ("dh", "dc_in", "a_t", "k_t", "f_t")]
        + [d.value(n[k], width) for k, width, value in optional if value],
        [d.value(n["dh_prev"], H), d.value(n["dc_prev"], H), d.value(n["dg"], 4 * H)],
    )
    start_c = d_last_c if d_last_c is not None else d.zeros()
    scanned = [from_h, factors, forget] + [v for _, _, v in optional if v]
    # the reverse walks the steps in the other order than the forward did
    dh0, dc0, dg = d.scan(body, [start_h, start_c], scanned, 3, backwards=not d.backwards)
    grads = d.weight_gradients(dg, dg, h_prev, 4, wanted)
    grads.update(initial_h=dh0, initial_c=dc0)
    return grads


def _gru_one(
    d: _Direction, d_y: str | None, d_last_h: str | None, _: str | None, wanted: set
) -> dict[str, str]:
    """One direction of a GRU's reverse (see the module; it has no cell state)."""
    b, H = d.b, d.hidden
    h_prev = d.previous(d.y, d.h0)
    wb, rb = d.biases(3)
    xw, hr = d.as_steps(d.product(d.x, d.w, wb)), d.as_steps(d.product(h_prev, d.r, rb))
    xw_zr, xw_n = b.op("Split", [xw, b.ints([2 * H, H])], outputs=2, axis=-1)
    hr_zr, hr_n = b.op("Split", [hr, b.ints([2 * H, H])], outputs=2, axis=-1)
    zr = b.op("Sigmoid", [b.op("Add", [xw_zr, hr_zr])])
    z, r = b.op("Split", [zr, b.ints([H, H])], outputs=2, axis=-1)
    n = b.op("Tanh", [b.op("Add", [xw_n, b.op("Mul", [r, hr_n])])])
    # every factor of the step's reverse, all linear in the step's dh
    dn = b.op("Mul", [d.one_minus(z), d.one_minus(b.op("Mul", [n, n]))])
    dz = b.op("Mul", [b.op("Sub", [h_prev, n]), b.op("Mul", [z, d.one_minus(z)])])
    dr = b.op("Mul", [b.op("Mul", [dn, hr_n]), b.op("Mul", [r, d.one_minus(r)])])
    from_h = b.op("Concat", [dz, dr, b.op("Mul", [dn, r])], axis=-1)
    from_x = b.op("Concat", [dz, dr, dn], axis=-1)
    # beyond a row's length the state passes through: no gate gradient, dh sent back
    from_h, from_x, z = d.masked(from_h), d.masked(from_x), d.passing(z)
    start_h, dy_next = d.incoming(d_y, d_last_h)
    m = {k: b.name(k) for k in ("dh", "k_t", "z_t", "dy_next_t", "sel", "dgh", "direct")}
    m.update({k: b.name(k) for k in ("addend", "dh_prev")})
    nodes = [
        helper.make_node("Concat", [m["dh"]] * 3, [m["sel"]], axis=-1),
        helper.make_node("Mul", [m["sel"], m["k_t"]], [m["dgh"]]),
        helper.make_node("Mul", [m["dh"], m["z_t"]], [m["direct"]]),
    ]
    addend = m["direct"]
    if dy_next:  # the next step's dY added
        nodes.append(helper.make_node("Add", [m["direct"], m["dy_next_t"]], [m["addend"]]))
        addend = m["addend"]
    nodes.append(helper.make_node("Gemm", [m["dgh"], d.r, addend], [m["dh_prev"]]))
    body = helper.make_graph(
        nodes,
        b.name("gru_reverse_step"),
        [d.value(m[k], 3 * H if k == "k_t" else H) for k in ("dh", "k_t", "z_t")]
        + ([d.value(m["dy_next_t"], H)] if dy_next else []),
        [d.value(m["dh_prev"], H), d.value(m["dgh"], 3 * H), d.value(m["sel"], 3 * H)],
    )
    scanned = [from_h, z] + ([dy_next] if dy_next else [])
    dh0, dgh, sel = d.scan(body, [start_h], scanned, 3, backwards=not d.backwards)
    dgx = b.op("Mul", [sel, from_x])
    grads = d.weight_gradients(dgx, dgh, h_prev, 3, wanted)
    grads.update(initial_h=dh0)
    return grads


def lstm_reverse(ctx: Any, node: onnx.NodeProto, grads: list) -> list:
    """An ``LSTM`` :func:`takes`: see the module."""
    return _per_direction(ctx, node, grads, _lstm_one)


def gru_reverse(ctx: Any, node: onnx.NodeProto, grads: list) -> list:
    """A ``GRU`` :func:`takes`: see the module."""
    return _per_direction(ctx, node, grads, _gru_one)


__all__ = ["expanding_the_others", "gru_reverse", "lstm_reverse", "takes"]
