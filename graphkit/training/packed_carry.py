"""The weights of a packed update carried laid end to end through an epoch's Scan.

A packed optimizer (Adam on every weight at once, :func:`graphkit.training.step.
build_update_step`) lays the weights end to end at every step (a ``Reshape`` per matrix
and a ``Concat``, for weight decay), runs its update on the one vector, splits the
update (a ``Split``, a ``Reshape`` per matrix) and adds each piece to its weight (an
``Add`` per weight). In an epoch's Scan the weights can stay laid end to end from one
step to the next instead: the step splits them once for the layers to read (a ``Split``
and a ``Reshape`` per matrix) and adds the whole update with one ``Add``; the epoch lays
them end to end before its Scan and splits them after it, once per epoch. The MLP
10-10-1's AdamW step: 6 kernels fewer (the weights' ``Concat`` and its ``Reshape``\\ s, and
three of the four ``Add``\\ s).

The same additions on the same values, element by element: the epoch computes what its
step computes batch by batch, to the bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import constant_tensors, fresh_name, graph_names, outer_reads
from graphkit.tensor_store import tensor_value


@dataclass
class PackedWeights:
    """What :func:`packed_weights` found: the ``Split`` of ``update`` (the packed update)
    into ``weights`` (carried, in order, each of ``shapes``), the nodes that apply it
    (``applying``: the Split, the Reshapes and Adds, the Identities to ``<w>.next``) and
    the ``Concat`` laying the weights end to end, if the step has one (``laid``, with the
    ``Reshape``\\ s only it reads)."""

    update: str
    weights: list[str]
    shapes: list[tuple[int, ...]]
    applying: list[onnx.NodeProto]
    laid: list[onnx.NodeProto]

    @property
    def sizes(self) -> list[int]:
        return [math.prod(s) for s in self.shapes]


def packed_weights(step: onnx.ModelProto, carried: Sequence[str]) -> PackedWeights | None:
    """The packed update of ``step`` (``carried`` its resident inputs) whose pieces are
    added to carried weights of static shapes, or None where there is none."""
    graph = step.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in outer_reads(node):
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    constants = {k: tensor_value(v) for k, v in constant_tensors(graph)}
    shapes = {}
    for value in graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in carried and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = tuple(d.dim_value for d in dims)

    def only_reader(name: str) -> onnx.NodeProto | None:
        found = readers.get(name, [])
        return found[0] if len(found) == 1 and name not in outputs else None

    def applied(piece: str) -> tuple[str, list[onnx.NodeProto]] | None:
        """The weight ``piece`` is added to, and the nodes on the way."""
        nodes = []
        node = only_reader(piece)
        if node is not None and node.op_type == "Reshape":
            nodes.append(node)
            node = only_reader(node.output[0])
        if node is None or node.op_type != "Add":
            return None
        nodes.append(node)
        weight = next((i for i in node.input if i in shapes), None)
        result = node.output[0]
        if weight is None or list(node.input).count(weight) != 1:
            return None
        # the piece in the weight's own layout: the whole update adds element by element
        if nodes[0].op_type == "Reshape":
            target = constants.get(nodes[0].input[1])
            if target is None or tuple(target.tolist()) != shapes[weight]:
                return None
        elif len(shapes[weight]) != 1:
            return None
        if result != f"{weight}.next":
            last = only_reader(result)
            if last is None or last.op_type != "Identity" or last.output[0] != f"{weight}.next":
                return None
            nodes.append(last)
        return weight, nodes

    for split in graph.node:
        if split.op_type != "Split" or split.domain not in ("", "ai.onnx"):
            continue
        if any(a.name == "axis" and a.i != 0 for a in split.attribute):
            continue
        found = [applied(piece) for piece in split.output]
        if not found or None in found:
            continue
        weights = [w for w, _ in found]  # type: ignore[misc]
        if len(set(weights)) != len(weights):
            continue
        sizes = [math.prod(shapes[w]) for w in weights]
        given = constants.get(split.input[1]) if len(split.input) > 1 else None
        if given is None or list(given) != sizes:
            continue
        applying = [split] + [n for _, nodes in found for n in nodes]  # type: ignore[misc]
        packed = PackedWeights(split.input[0], weights, [shapes[w] for w in weights], applying, [])
        packed.laid = _laid_end_to_end(graph, producer, only_reader, packed)
        return packed
    return None


def _laid_end_to_end(
    graph: onnx.GraphProto,
    producer: dict[str, onnx.NodeProto],
    only_reader: Callable[[str], onnx.NodeProto | None],
    packed: PackedWeights,
) -> list[onnx.NodeProto]:
    """The step's ``Concat`` of exactly ``packed.weights`` in their order (each flattened
    by a ``Reshape`` only the Concat reads, or as it is if it is a vector), and those
    Reshapes; [] where there is none."""
    for node in graph.node:
        if node.op_type != "Concat" or len(node.input) != len(packed.weights):
            continue
        if any(a.name == "axis" and a.i not in (0, -1) for a in node.attribute):
            continue
        views = []
        for name, weight, shape in zip(node.input, packed.weights, packed.shapes):
            if name == weight and len(shape) == 1:
                continue
            view = producer.get(name)
            if view is None or view.op_type != "Reshape" or view.input[0] != weight:
                break
            if only_reader(name) is not node:
                break
            views.append(view)
        else:
            return [node, *views]
    return []


def carry_packed(step: onnx.ModelProto, packed: PackedWeights, name: str) -> onnx.ModelProto:
    """``step`` carrying the weights laid end to end as ``name`` (``<name>.next``) instead
    of ``packed.weights``: at its start a ``Split`` (and a ``Reshape`` per matrix) gives
    each weight its old name; the update is added to ``name`` at once."""
    out = onnx.ModelProto()
    out.CopyFrom(step)
    graph = out.graph
    taken = graph_names(graph)
    dropped = {id(n) for n in packed.applying + packed.laid}  # nodes of ``step``
    kept = [n for n, mine in zip(graph.node, step.graph.node) if id(mine) not in dropped]
    elem = next(i for i in graph.input if i.name == packed.weights[0]).type.tensor_type.elem_type
    sizes = fresh_name(f"{name}/sizes", taken)
    graph.initializer.append(numpy_helper.from_array(np.array(packed.sizes, np.int64), sizes))
    pieces, unpack = [], []
    for weight, shape in zip(packed.weights, packed.shapes):
        if len(shape) == 1:
            pieces.append(weight)
            continue
        piece = fresh_name(f"{name}/{weight}", taken)
        target = fresh_name(f"{name}/{weight}/shape", taken)
        graph.initializer.append(numpy_helper.from_array(np.array(shape, np.int64), target))
        pieces.append(piece)
        unpack.append(helper.make_node("Reshape", [piece, target], [weight]))
    nodes = [helper.make_node("Split", [name, sizes], pieces, axis=0), *unpack]
    if packed.laid:  # its readers read the carried vector
        laid = packed.laid[0].output[0]
        for node in kept:
            node.input[:] = [name if i == laid else i for i in node.input]
    nodes += kept
    nodes.append(helper.make_node("Add", [name, packed.update], [f"{name}.next"]))
    del graph.node[:]
    graph.node.extend(nodes)
    vector = helper.make_tensor_value_info(name, elem, [sum(packed.sizes)])
    inputs = [i for i in graph.input if i.name not in packed.weights]
    del graph.input[:]
    graph.input.extend([vector, *inputs])
    outputs = [o for o in graph.output if o.name not in {f"{w}.next" for w in packed.weights}]
    del graph.output[:]
    graph.output.extend(
        [helper.make_tensor_value_info(f"{name}.next", elem, [sum(packed.sizes)]), *outputs]
    )
    return out


def lay_and_split(
    packed: PackedWeights, name: str, taken: set[str]
) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The epoch graph's nodes laying ``packed.weights`` end to end as ``name`` before
    its Scan, and splitting ``<name>.next`` into ``<w>.next`` after it; and their
    constants."""
    flat = fresh_name(f"{name}/flat", taken)
    sizes = fresh_name(f"{name}/sizes", taken)
    constants = [
        numpy_helper.from_array(np.array([-1], np.int64), flat),
        numpy_helper.from_array(np.array(packed.sizes, np.int64), sizes),
    ]
    before, parts, pieces, after = [], [], [], []
    for weight, shape in zip(packed.weights, packed.shapes):
        if len(shape) == 1:
            parts.append(weight)
            pieces.append(f"{weight}.next")
            continue
        part = fresh_name(f"{name}/{weight}/flat", taken)
        before.append(helper.make_node("Reshape", [weight, flat], [part]))
        parts.append(part)
        piece = fresh_name(f"{name}/{weight}/piece", taken)
        pieces.append(piece)
        target = fresh_name(f"{name}/{weight}/shape", taken)
        constants.append(numpy_helper.from_array(np.array(shape, np.int64), target))
        after.append(helper.make_node("Reshape", [piece, target], [f"{weight}.next"]))
    before.append(helper.make_node("Concat", parts, [name], axis=0))
    after.insert(0, helper.make_node("Split", [f"{name}.next", sizes], pieces, axis=0))
    return before, after, constants


__all__ = ["PackedWeights", "carry_packed", "lay_and_split", "packed_weights"]
