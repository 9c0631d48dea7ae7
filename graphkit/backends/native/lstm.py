"""An ``LSTM`` written as a ``Scan`` whose step computes its four gates in one product.

onnx-ad expands every recurrent operator into a ``Scan`` (its ``recurrent.py``): the
input projections of all the time steps at once, outside the loop, then a loop body with
one ``MatMul`` of the hidden state per gate. Its reverse runs that body's adjoint a step
at a time, so each of those products is a kernel call per step forward and more in
reverse, on ``[batch, hidden]`` tensors where a call costs more than its arithmetic.

This module writes the common ``LSTM`` (one direction, the default activations) with the
gates kept together, ``[batch, 4 * hidden]``, as the ONNX weights already hold them::

    g = x_t W^T + (Wb + Rb) + h R^T          (x W^T + biases: all steps, before the loop)
    i, o, f = sigmoid(g[:, :3H]) split in 3;  z = tanh(g[:, 3H:])
    c' = f c + i z;  h' = o tanh(c')

one ``MatMul`` a step instead of four, one ``Sigmoid`` instead of three. The spec's
equations, gates in its ``i, o, f, c`` order; ``Y``, ``Y_h`` and ``Y_c`` as the operator
returns them.

Written so: direction ``forward`` or ``reverse``, ``layout`` 0, no ``clip``,
``input_forget`` 0, the default activations, no peepholes and no ``sequence_lens`` (nor
inputs named for them). Any other ``LSTM`` is left to onnx-ad's expansion.
"""

from __future__ import annotations

import onnx
from onnx import helper

from graphkit._graph import NodeWriter, copy_model, graph_names, int_constant, namer
from graphkit.compat import opset_of

_DEFAULT_ACTIVATIONS = (b"Sigmoid", b"Tanh", b"Tanh")


def lstms_as_scans(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ``LSTM`` of the main graph that :func:`_written` accepts as the
    fused-gate ``Scan`` of the module docstring (a copy; ``model`` itself when none)."""
    if (opset_of(model) or 0) < 13 or not any(_written(n) for n in model.graph.node):
        return model  # before opset 13, Split and Squeeze took attributes
    rewritten = copy_model(model)
    graph = rewritten.graph
    name = namer("lstm", graph_names(graph))
    types = _element_types(rewritten)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        written = _written(node) and types.get(node.input[1]) is not None
        nodes.extend(_as_scan(node, name, types[node.input[1]]) if written else [node])
    del graph.node[:]
    graph.node.extend(nodes)
    return rewritten


def _element_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of each tensor onnx's shape inference knows."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # inference is a help here: an LSTM of unknown type stays
        inferred = model.graph
    types = {t.name: t.data_type for t in inferred.initializer}
    for value in (*inferred.input, *inferred.value_info, *inferred.output):
        if value.type.tensor_type.elem_type:
            types[value.name] = value.type.tensor_type.elem_type
    return types


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _written(node: onnx.NodeProto) -> bool:
    """Whether this module writes ``node`` (see the module docstring)."""
    if node.op_type != "LSTM" or node.domain not in ("", "ai.onnx"):
        return False
    attrs = _attributes(node)
    activations = tuple(attrs.get("activations", _DEFAULT_ACTIVATIONS))
    inputs = list(node.input) + [""] * (8 - len(node.input))
    return (
        attrs.get("direction", b"forward") in (b"forward", b"reverse")
        and attrs.get("layout", 0) == 0
        and "clip" not in attrs
        and attrs.get("input_forget", 0) == 0
        and activations == _DEFAULT_ACTIVATIONS
        and not attrs.get("activation_alpha")
        and not attrs.get("activation_beta")
        and "hidden_size" in attrs
        and not inputs[4]  # sequence_lens
        and not inputs[7]  # peepholes
    )


def _as_scan(node: onnx.NodeProto, fresh, elem: int) -> list[onnx.NodeProto]:
    """The nodes that compute ``node``'s outputs (see the module docstring)."""
    attrs = _attributes(node)
    hidden = int(attrs["hidden_size"])
    reverse = attrs.get("direction", b"forward") == b"reverse"
    inputs = list(node.input) + [""] * (8 - len(node.input))
    x, w, r, bias, _, h0, c0, _ = inputs
    outputs = list(node.output) + [""] * (3 - len(node.output))

    writer = NodeWriter(fresh)
    op, ints, nodes = writer.op, writer.ints, writer.nodes
    zero_axis = ints([0])
    w_t = op("Transpose", [op("Squeeze", [w, zero_axis])])  # [I, 4H]
    r_t = op("Transpose", [op("Squeeze", [r, zero_axis])])  # [H, 4H], read inside the loop
    projected = op("MatMul", [x, w_t])  # [T, B, 4H]
    if bias:
        halves = op("Squeeze", [bias, zero_axis])  # [8H]: Wb then Rb
        wb, rb = fresh("wb"), fresh("rb")
        sizes = ints([4 * hidden, 4 * hidden])
        nodes.append(helper.make_node("Split", [halves, sizes], [wb, rb], axis=0))
        projected = op("Add", [projected, op("Add", [wb, rb])])
    states = []
    for initial in (h0, c0):
        if initial:
            states.append(op("Squeeze", [initial, zero_axis]))
        else:  # zeros [B, H], the batch read off X
            batch = op("Slice", [op("Shape", [x]), ints([1]), ints([2])])
            shape = op("Concat", [batch, ints([hidden])], axis=0)
            zero = helper.make_tensor("zero", elem, [1], [0])
            states.append(op("ConstantOfShape", [shape], value=zero))
    last_h, last_c, sequence = fresh("h_last"), fresh("c_last"), fresh("h_all")
    nodes.append(
        helper.make_node(
            "Scan",
            [*states, projected],
            [last_h, last_c, sequence],
            body=_step(hidden, r_t, fresh, elem),
            num_scan_inputs=1,
            scan_input_directions=[int(reverse)],
            scan_output_directions=[int(reverse)],
        )
    )
    for out, value, axis in zip(outputs, (sequence, last_h, last_c), (1, 0, 0)):
        if out:
            nodes.append(helper.make_node("Unsqueeze", [value, ints([axis])], [out]))
    return nodes


def _step(hidden: int, r_t: str, fresh, elem: int) -> onnx.GraphProto:
    """The loop body: ``(h, c, x_t W^T + biases) -> (h', c', h')`` (``elem``: their
    element type)."""
    h, c, xw = fresh("h"), fresh("c"), fresh("xw")
    keys = ("g", "rh", "sig_in", "tanh_in", "sig", "z", "i", "o", "f", "fc", "iz")
    n = {k: fresh(k) for k in (*keys, "c_new", "tc", "h_new", "h_out", "sizes", "thirds")}
    nodes = [
        helper.make_node("MatMul", [h, r_t], [n["rh"]]),
        helper.make_node("Add", [xw, n["rh"]], [n["g"]]),
        int_constant(n["sizes"], [3 * hidden, hidden]),
        int_constant(n["thirds"], [hidden] * 3),
        helper.make_node("Split", [n["g"], n["sizes"]], [n["sig_in"], n["tanh_in"]], axis=1),
        helper.make_node("Sigmoid", [n["sig_in"]], [n["sig"]]),
        helper.make_node("Tanh", [n["tanh_in"]], [n["z"]]),
        helper.make_node("Split", [n["sig"], n["thirds"]], [n["i"], n["o"], n["f"]], axis=1),
        helper.make_node("Mul", [n["f"], c], [n["fc"]]),
        helper.make_node("Mul", [n["i"], n["z"]], [n["iz"]]),
        helper.make_node("Add", [n["fc"], n["iz"]], [n["c_new"]]),
        helper.make_node("Tanh", [n["c_new"]], [n["tc"]]),
        helper.make_node("Mul", [n["o"], n["tc"]], [n["h_new"]]),
        helper.make_node("Identity", [n["h_new"]], [n["h_out"]]),
    ]

    def value(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, [None, hidden])

    return helper.make_graph(
        nodes,
        fresh("lstm_step"),
        [value(h), value(c), helper.make_tensor_value_info(xw, elem, [None, 4 * hidden])],
        [value(n["h_new"]), value(n["c_new"]), value(n["h_out"])],
    )


__all__ = ["lstms_as_scans"]
