"""A training step's values that depend on its step counter alone, computed for a whole
epoch at once before the epoch's Scan.

An optimizer's bias corrections (Adam's ``1 - beta1 ** t`` and the rest) and a
schedule's learning rate are scalar arithmetic on the step counter and constants. In the
Scan that runs an epoch each is a kernel call at every step (about 0.3 us on the CPU, 11
of the 56 kernels of a packed Adam step of an MLP 10-10-1). On the vector of the
epoch's step counts, ``t0, t0 + 1, ..., t0 + batches - 1``, each runs once per epoch, and
the Scan hands every step its element of the results as it hands it its batch.

A node moves out of the step when it is elementwise and reads only scalars: the counter,
scalar constants, and what moved nodes compute; or when it reshapes such a scalar to a
shape of ones (``[1]``, the rank a packed update reads its scalars at). The moved nodes
compute the same values, to the bit, one step's per element (see :data:`ELEMENTWISE`
and :data:`EXACT_IN_FLOAT64`). AdamW on the MLP 10-10-1 at batch 10 (ort_training):
the square root and its readers moving too took the step from 47 to 42 kernels, 15.4 to
13.8 us.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import constant_tensors, outer_reads
from graphkit.tensor_store import tensor_value

ELEMENTWISE = frozenset(
    {
        "Abs",
        "Add",
        "And",
        "Cast",
        "CastLike",
        "Ceil",
        "Div",
        "Equal",
        "Floor",
        "Greater",
        "GreaterOrEqual",
        "Identity",
        "Less",
        "LessOrEqual",
        "Max",
        "Min",
        "Mod",
        "Mul",
        "Neg",
        "Not",
        "Or",
        "Pow",
        "Reciprocal",
        "Sign",
        "Sub",
        "Where",
    }
)
"""Operators computing each element of their result from the elements at the same
position of their inputs, rounded alike on a vector and on one element: run on vectors of
scalars, each element is one step's value, to the bit. Not the transcendental functions:
onnxruntime computes some of them on vectors by another path than on one element
(measured on 2000 elements against 2000 one-element calls: float32 ``Sqrt`` differed in
the last bit at 758, float64 ``Exp`` at 238, ``Log``, float32 ``Sin`` and ``Cos`` too),
and a fused epoch must train as one run per batch does; they stay in the step, but for
``Sqrt`` (:data:`EXACT_IN_FLOAT64`)."""

EXACT_IN_FLOAT64 = frozenset({"Sqrt"})
"""Operators whose float64 kernel is correctly rounded on vectors and on one element
alike, and whose float32 kernel on one element is too (0 differences from numpy in
20,000 one-element calls): moved, a float32 one runs in float64 on the epoch's vector,
``Cast(Sqrt(Cast(x, double)), float)``, which rounds to the correctly rounded float32
square root (double rounding is harmless for a square root; 0 differences in 1,100,000
values), so each element is one step's value to the bit. Adam's ``sqrt(1 - beta2 **
t)``: 5 kernels of a packed Adam step (the square root and what reads it)."""


@dataclass
class CounterValues:
    """What moves out of a step: ``nodes`` (in the step's order) read ``counter`` (a
    carried scalar of type ``counter_elem`` the step increments by one), scalar
    ``constants`` and the shapes of ones in ``targets`` (a Reshape's output -> its
    shape); the step still reads ``frontier`` of their results, one value a step, of the
    type and shape ``values`` gives. The ``widened`` nodes run in float64 (see
    :data:`EXACT_IN_FLOAT64`)."""

    counter: str
    counter_elem: int
    nodes: list[onnx.NodeProto]
    constants: dict[str, onnx.TensorProto]
    targets: dict[str, list[int]]
    frontier: list[str]
    values: dict[str, onnx.ValueInfoProto]
    widened: dict[str, int]  # a moved float32 Sqrt's output -> its element type


def _step_counter(step: onnx.ModelProto, carried: Sequence[str]) -> tuple[str, int] | None:
    """The carried integer scalar whose ``<name>.next`` is ``<name> + 1``, and its
    element type, if there is one."""
    constants = dict(constant_tensors(step.graph))
    producer = {o: n for n in step.graph.node for o in n.output}
    inputs = {i.name: i for i in step.graph.input}
    for name in carried:
        value = inputs.get(name)
        node = producer.get(f"{name}.next")
        if value is None or node is None or node.op_type != "Add":
            continue
        tensor = value.type.tensor_type
        integer = tensor.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
        if not integer or not tensor.HasField("shape") or len(tensor.shape.dim) != 0:
            continue
        others = [i for i in node.input if i != name]
        if len(others) == 1 and others[0] in constants:
            one = tensor_value(constants[others[0]])
            if one.ndim == 0 and one.item() == 1:
                return name, tensor.elem_type
    return None


def counter_values(step: onnx.ModelProto, carried: Sequence[str]) -> CounterValues | None:
    """The nodes of ``step`` (a training step, ``carried`` its resident inputs) that
    read only its step counter and scalar constants, or None where there are none."""
    found = _step_counter(step, carried)
    if found is None:
        return None
    counter, counter_elem = found
    graph = onnx.shape_inference.infer_shapes(step).graph
    values = {v.name: v for v in [*graph.input, *graph.value_info, *graph.output]}

    def rank(name: str) -> int | None:
        value = values.get(name)
        if value is None or not value.type.tensor_type.HasField("shape"):
            return None
        return len(value.type.tensor_type.shape.dim)

    constants = dict(constant_tensors(graph))
    outputs = {o.name for o in graph.output}
    scalar = {counter}  # values that are one scalar a step
    moved: list[int] = []
    read: dict[str, onnx.TensorProto] = {}
    targets: dict[str, list[int]] = {}
    widened: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            continue
        if node.output[0] in outputs:
            continue
        inputs = [i for i in node.input if i]
        elem = values[inputs[0]].type.tensor_type.elem_type if inputs[0] in values else 0
        if node.op_type in ELEMENTWISE:
            data, ok = inputs, rank(node.output[0]) == 0
        elif node.op_type in EXACT_IN_FLOAT64:
            float_kind = elem in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
            data, ok = inputs, rank(node.output[0]) == 0 and float_kind
        elif node.op_type == "Reshape" and len(inputs) == 2 and inputs[1] in constants:
            target = tensor_value(constants[inputs[1]])
            data = inputs[:1]
            ok = bool(np.all(target == 1)) and rank(node.output[0]) == target.size
        else:
            continue
        if not ok or not any(i in scalar for i in data):
            continue
        fixed = [i for i in data if i not in scalar]
        if not all(i in constants and not constants[i].dims for i in fixed):
            continue
        moved.append(index)
        read.update({i: constants[i] for i in fixed})
        if node.op_type in EXACT_IN_FLOAT64 and elem == onnx.TensorProto.FLOAT:
            widened[node.output[0]] = elem
        if node.op_type == "Reshape":
            targets[node.output[0]] = [1] * target.size
        else:
            scalar.add(node.output[0])
    if not moved:
        return None
    stay = set(range(len(graph.node))) - set(moved)
    kept = [graph.node[k] for k in sorted(stay)]
    still_read = set().union(*(outer_reads(n) for n in kept)) | outputs
    frontier = [o for k in moved for o in graph.node[k].output if o in still_read]
    return CounterValues(
        counter,
        counter_elem,
        [step.graph.node[k] for k in moved],  # the step's own nodes, not inferred copies
        read,
        targets,
        frontier,
        {f: values[f] for f in frontier},
        widened,
    )


def counted_outside(
    step: onnx.ModelProto, carried: Sequence[str], values: CounterValues | None
) -> tuple[str, int] | None:
    """The step counter and its element type where nothing in the step reads it but its
    increment and ``values``' moved nodes (SGD at a fixed rate): an epoch then needs it
    only once, after its last step, ``counter + batches`` (:func:`count_after`), and
    its Scan neither carries nor increments it (a kernel and a carried value a step)."""
    found = _step_counter(step, carried)
    if found is None:
        return None
    counter = found[0]
    moved = {id(n) for n in values.nodes} if values is not None else set()
    readers = [n for n in step.graph.node if counter in outer_reads(n) and id(n) not in moved]
    increment = [n for n in readers if f"{counter}.next" in n.output]
    outputs = {o.name for o in step.graph.output}
    return found if readers == increment and counter not in outputs else None


def count_after(
    counter: str, counter_elem: int, first_data: str, outer: Callable[[str], str]
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes and initializers of an epoch graph computing ``<counter>.next``, the
    counter after the epoch: ``counter + batches``, the batches those of ``first_data``
    (``[batches, ...]``)."""
    shape, batches, zero = outer("count/shape"), outer("count/batches"), outer("count/zero")
    nodes = [
        helper.make_node("Shape", [first_data], [shape]),
        helper.make_node("Gather", [shape, zero], [batches], axis=0),
    ]
    if counter_elem != onnx.TensorProto.INT64:
        cast = outer("count/batches_cast")
        nodes.append(helper.make_node("Cast", [batches], [cast], to=counter_elem))
        batches = cast
    nodes.append(helper.make_node("Add", [counter, batches], [f"{counter}.next"]))
    return nodes, [numpy_helper.from_array(np.array(0, np.int64), zero)]


def epoch_nodes(
    values: CounterValues, first_data: str, outer: Callable[[str], str]
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], dict[str, str]]:
    """The nodes and initializers that compute ``values.nodes`` for every step of an
    epoch, from the counter's value before the epoch and the batches of ``first_data``
    (``[batches, ...]``), and the name of each frontier value's vector among them.

    ``outer`` names a tensor of the step (the counter excepted: the epoch graph reads it
    by its own name) or one of this function's in the epoch graph."""
    counts, limit = outer("counts"), outer("limit")
    shape, batches, zero, delta = outer("shape"), outer("batches"), outer("zero"), outer("delta")
    nodes = [
        helper.make_node("Shape", [first_data], [shape]),
        helper.make_node("Gather", [shape, zero], [batches], axis=0),
    ]
    if values.counter_elem != onnx.TensorProto.INT64:
        nodes.append(
            helper.make_node("Cast", [batches], [outer("batches_cast")], to=values.counter_elem)
        )
        batches = nodes[-1].output[0]
    nodes += [
        helper.make_node("Add", [values.counter, batches], [limit]),
        helper.make_node("Range", [values.counter, limit, delta], [counts]),
    ]
    dtype = helper.tensor_dtype_to_np_dtype(values.counter_elem)
    initializers = [
        numpy_helper.from_array(np.array(0, np.int64), zero),
        numpy_helper.from_array(np.array(1, dtype), delta),
    ]
    names = {values.counter: counts}
    for name, tensor in values.constants.items():
        copy = onnx.TensorProto()
        copy.CopyFrom(tensor)
        copy.name = names[name] = outer(name)
        initializers.append(copy)
    for node in values.nodes:
        moved = onnx.NodeProto()
        moved.CopyFrom(node)
        moved.name = ""
        for k, name in enumerate(node.input):
            if name in names:
                moved.input[k] = names[name]
        names[node.output[0]] = moved.output[0] = outer(node.output[0])
        if node.output[0] in values.widened:  # in float64, see EXACT_IN_FLOAT64
            wide = [outer(f"{node.output[0]}/{part}") for part in ("x64", "y64")]
            nodes.append(
                helper.make_node("Cast", [moved.input[0]], [wide[0]], to=onnx.TensorProto.DOUBLE)
            )
            moved.input[0], moved.output[0] = wide[0], wide[1]
            nodes.append(moved)
            to = values.widened[node.output[0]]
            moved = helper.make_node("Cast", [wide[1]], [names[node.output[0]]], to=to)
        elif node.op_type == "Reshape":  # one scalar a step: [batches, 1, ...] for them all
            target = outer(f"{node.output[0]}/shape")
            ones = values.targets[node.output[0]]
            initializers.append(numpy_helper.from_array(np.array([-1, *ones], np.int64), target))
            moved.input[1] = target
        nodes.append(moved)
    return nodes, initializers, {f: names[f] for f in values.frontier}


__all__ = ["CounterValues", "count_after", "counted_outside", "counter_values", "epoch_nodes"]
