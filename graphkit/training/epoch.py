"""Many training steps in one ONNX graph: the step as the body of a ``Loop`` or a ``Scan``.

Running one onnxruntime call per mini-batch costs a call, a binding and a Python
iteration per batch. Both functions here wrap a training step (any graph with batch
inputs, resident inputs and their ``<name>.next`` outputs) into one graph whose carried
values are the resident tensors:

* :func:`loop_over_batches`, any runtime: a ``Loop`` over the whole data and a
  ``permutation`` of its rows, batch k taking ``permutation[k*b:(k+1)*b]`` (the last
  batch may be shorter). ``export_training_epoch`` writes it.
* :func:`scan_over_batches`, the trainers' fused epochs: a ``Scan`` over data laid out
  batch by batch, ``[batches, b, ...]``. Every batch has b rows, so the step inside can
  be specialized to that size (:func:`graphkit.static_shapes.specialize`), and
  onnxruntime hands each iteration a view of its batch: no gather, no copy (a ``Gather``
  of 1000 rows costs more than a whole linear-regression step). What the step computes
  from its step counter alone (bias corrections, a schedule's rate) runs once, on the
  vector of the epoch's step counts, before the Scan (:mod:`graphkit.training.counter`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
from onnx import TensorProto, helper

from graphkit._graph import (
    copy_model,
    fresh_name,
    graph_names,
    int_constant,
    namer,
    outer_reads,
    rename_tensors,
    renamed_value,
)
from graphkit.decay_factors import gather_decay
from graphkit.static_shapes import static_shapes
from graphkit.training.counter import (
    CounterValues,
    count_after,
    counted_outside,
    counter_values,
    epoch_nodes,
)
from graphkit.training.packed_carry import carry_packed, lay_and_split, packed_weights

make = helper.make_node
PERMUTATION, BATCH_SIZE, BATCH_LOSSES = "permutation", "batch_size", "batch_losses"
RESERVED = {PERMUTATION, BATCH_SIZE, BATCH_LOSSES}
PACKED_WEIGHTS = "graphkit.packed.weights"
"""The carried vector of a fused epoch whose packed update's weights stay laid end to
end through its Scan (:mod:`graphkit.training.packed_carry`)."""


def _scalar(name: str, elem: int, value: float) -> onnx.NodeProto:
    return make("Constant", [], [name], value=helper.make_tensor(name, elem, [], [value]))


class _Body:
    """The step's graph as a subgraph: its tensors renamed ``step/<name>`` (the names
    ``loop/...`` are the wrapper's), its inputs and outputs removed."""

    def __init__(
        self, step: onnx.ModelProto, data: Sequence[str], carried: Sequence[str], loss: str
    ) -> None:
        clash = sorted(RESERVED & {*data, *carried, *(f"{n}.next" for n in carried)})
        if clash:
            raise ValueError(
                f"The training step names tensors {clash}, which the epoch graph uses for "
                "its own inputs and outputs: rename them in the model."
            )
        self.inputs = {i.name: i for i in step.graph.input}
        self.outputs = {o.name: o for o in step.graph.output}
        self.loss_elem = self.outputs[loss].type.tensor_type.elem_type
        self.carried, self.loss = list(carried), loss
        self.graph = graph = onnx.GraphProto()
        graph.CopyFrom(step.graph)
        self.scoped = scoped = {n: f"step/{n}" for n in graph_names(graph)}
        rename_tensors(graph, lambda n: scoped.get(n, n))
        for node in graph.node:
            node.name = scoped.get(node.name, node.name)
        del graph.input[:]
        del graph.output[:]
        graph.name = "graphkit_training_step"

    def carried_inputs(self) -> list[onnx.ValueInfoProto]:
        return [renamed_value(self.inputs[n], self.scoped[n]) for n in self.carried]

    def carried_outputs(self, batch_losses: bool) -> list[onnx.ValueInfoProto]:
        names = [f"{n}.next" for n in self.carried] + ([self.loss] if batch_losses else [])
        return [renamed_value(self.outputs[n], self.scoped[n]) for n in names]

    def outer_outputs(self, batch_losses: bool) -> list[onnx.ValueInfoProto]:
        carried = [renamed_value(self.outputs[f"{n}.next"], f"{n}.next") for n in self.carried]
        losses = [helper.make_tensor_value_info(BATCH_LOSSES, self.loss_elem, ["batches"])]
        return carried + (losses if batch_losses else [])

    def data_input(self, name: str, leading: list[str | int]) -> onnx.ValueInfoProto:
        """The outer input of a batch input: its dims after ``leading`` ones."""
        value = self.inputs[name]
        dims = [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim][1:]
        return helper.make_tensor_value_info(
            name, value.type.tensor_type.elem_type, [*leading, *dims]
        )


def _model(graph: onnx.GraphProto, step: onnx.ModelProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=list(step.opset_import))
    model.ir_version = step.ir_version
    return model


def loop_over_batches(
    step: onnx.ModelProto,
    data: Sequence[str],
    carried: Sequence[str],
    loss: str,
    name: str = "graphkit_training_epoch",
) -> onnx.ModelProto:
    """``step`` as the body of a Loop over the batches of ``permutation``::

        inputs : <data> (all rows), permutation (int64 [rows]), batch_size (int64 scalar),
                 <carried>
        outputs: <name>.next for every carried name, batch_losses

    Args:
        step: the training step: inputs ``data`` (one batch each, rows first) and
            ``carried``; outputs ``<name>.next`` for each carried name, and ``loss``.
        data: the batch inputs (features, label, sample weights), gathered by rows.
        carried: the resident inputs, carried from one batch to the next.
        loss: the batch-loss output, stacked into ``batch_losses``.
    """
    body = _Body(step, data, carried, loss)
    start, stop, end = "loop/start", "loop/stop", "loop/end"
    rows = [
        make("Mul", ["loop/iteration", BATCH_SIZE], [start]),
        make("Add", [start, BATCH_SIZE], [stop]),
        make("Min", [stop, "graphkit.epoch/rows"], [end]),
        make("Reshape", [start, "graphkit.epoch/vector"], ["loop/start_1d"]),
        make("Reshape", [end, "graphkit.epoch/vector"], ["loop/end_1d"]),
        make("Slice", [PERMUTATION, "loop/start_1d", "loop/end_1d"], ["loop/rows"]),
    ]
    outer = [  # batches = ceil(rows / batch_size)
        make("Shape", [PERMUTATION], ["graphkit.epoch/rows_1d"]),
        int_constant("graphkit.epoch/vector", [1]),
        make("Squeeze", ["graphkit.epoch/rows_1d"], ["graphkit.epoch/rows"]),
        _scalar("graphkit.epoch/one", TensorProto.INT64, 1),
        make("Sub", [BATCH_SIZE, "graphkit.epoch/one"], ["graphkit.epoch/round_up"]),
        make("Add", ["graphkit.epoch/rows", "graphkit.epoch/round_up"], ["graphkit.epoch/padded"]),
        make("Div", ["graphkit.epoch/padded", BATCH_SIZE], ["graphkit.epoch/batches"]),
        _scalar("graphkit.epoch/true", TensorProto.BOOL, True),
    ]
    gather = [make("Gather", [d, "loop/rows"], [body.scoped[d]], axis=0) for d in data]
    nodes = [
        *rows,
        *gather,
        *body.graph.node,
        make("Identity", ["loop/cond_in"], ["loop/cond_out"]),
    ]
    del body.graph.node[:]
    body.graph.node.extend(nodes)
    body.graph.input.extend(
        [
            helper.make_tensor_value_info("loop/iteration", TensorProto.INT64, []),
            helper.make_tensor_value_info("loop/cond_in", TensorProto.BOOL, []),
            *body.carried_inputs(),
        ]
    )
    body.graph.output.extend(
        [
            helper.make_tensor_value_info("loop/cond_out", TensorProto.BOOL, []),
            *body.carried_outputs(batch_losses=True),
        ]
    )
    loop = make(
        "Loop",
        ["graphkit.epoch/batches", "graphkit.epoch/true", *carried],
        [o.name for o in body.outer_outputs(batch_losses=True)],
        body=body.graph,
    )
    graph = helper.make_graph(
        [*outer, loop],
        name,
        [
            *(body.data_input(d, ["rows"]) for d in data),
            helper.make_tensor_value_info(PERMUTATION, TensorProto.INT64, ["rows"]),
            helper.make_tensor_value_info(BATCH_SIZE, TensorProto.INT64, []),
            *(body.inputs[n] for n in carried),
        ],
        body.outer_outputs(batch_losses=True),
    )
    return _model(graph, step)


def scan_over_batches(
    step: onnx.ModelProto,
    data: Sequence[str],
    carried: Sequence[str],
    loss: str,
    batch_size: int,
    batch_losses: bool = False,
    name: str = "graphkit_training_epoch",
) -> onnx.ModelProto:
    """``step`` as the body of a Scan over batch-major data::

        inputs : <data> ([batches, batch_size, ...] each), <carried>
        outputs: <name>.next for every carried name[, batch_losses]

    Arguments as :func:`loop_over_batches`; ``batch_size`` is the rows of every batch,
    ``batch_losses`` whether to output the losses of the batches (a trainer reading only
    the carried loss sum leaves them out).
    """
    original, resident = step, list(carried)
    packed = packed_weights(step, carried) if data else None
    if packed is not None:  # the weights carried laid end to end (graphkit.training.packed_carry)
        vector = fresh_name(PACKED_WEIGHTS, {*graph_names(step.graph), *RESERVED, name})
        step = carry_packed(step, packed, vector)
        carried = [vector, *(c for c in carried if c not in packed.weights)]
    opset = next((o.version for o in step.opset_import if o.domain in ("", "ai.onnx")), 0)
    values = counter_values(step, carried) if data and opset >= 11 else None  # Range: 11
    if data:
        # a decoupled decay's factors gathered (graphkit.decay_factors): where the
        # weights are carried packed, the update now reads the weights it adds to; the
        # new kernels on scalars leave the Scan with the counter's arithmetic
        once = {o for n in values.nodes for o in n.output} if values else set()
        gathered = copy_model(step)  # the caller's step stays as it is
        if gather_decay(gathered, static_shapes(gathered), once):
            step = gathered
            values = counter_values(step, carried) if opset >= 11 else None
    counter = counted_outside(step, carried, values) if data else None
    if counter is not None:  # counted once, after the Scan
        carried = [c for c in carried if c != counter[0]]
    body = _Body(step, data, carried, loss)
    body.graph.input.extend(
        [
            *body.carried_inputs(),
            *(body.data_input(d, [batch_size]) for d in data),
        ]
    )
    for value, d in zip(body.graph.input[len(carried) :], data):
        value.name = body.scoped[d]
    body.graph.output.extend(body.carried_outputs(batch_losses))
    # the epoch graph's own names: beside its inputs and outputs, the body's are scoped
    outer = namer("epoch", {*data, *resident, *(f"{n}.next" for n in resident), BATCH_LOSSES})
    outer_nodes, outer_constants, scanned = _counter_values_before(values, body, data, outer)
    if counter is not None:
        _drop_increment(body, counter[0])
        counting, constants = count_after(*counter, data[0], outer)
        outer_nodes += counting
        outer_constants += constants
    scan = make(
        "Scan",
        [*carried, *data, *scanned],
        [o.name for o in body.outer_outputs(batch_losses)],
        body=body.graph,
        num_scan_inputs=len(data) + len(scanned),
    )
    after: list[onnx.NodeProto] = []
    if packed is not None:
        taken = {*graph_names(body.graph), *graph_names(original.graph), name}
        before, after, constants = lay_and_split(packed, vector, taken)
        outer_nodes = before + outer_nodes
        outer_constants = outer_constants + constants
    # the epoch's inputs and outputs: the step's own, whatever its Scan carries
    inputs = {i.name: i for i in original.graph.input}
    outputs = {o.name: o for o in original.graph.output}
    losses = body.outer_outputs(batch_losses)[len(carried) :]
    graph = helper.make_graph(
        [*outer_nodes, scan, *after],
        name,
        [
            *(body.data_input(d, ["batches", batch_size]) for d in data),
            *(inputs[n] for n in resident),
        ],
        [*(outputs[f"{n}.next"] for n in resident), *losses],
        outer_constants,
    )
    return _model(graph, step)


def _drop_increment(body: _Body, counter: str) -> None:
    """Removes the counter's increment from ``body`` (the epoch counts after its Scan)."""
    increment = body.scoped[f"{counter}.next"]
    kept = [n for n in body.graph.node if increment not in n.output]
    del body.graph.node[:]
    body.graph.node.extend(kept)
    read = {i for n in kept for i in outer_reads(n)}
    for tensor in [t for t in body.graph.initializer if t.name not in read]:
        body.graph.initializer.remove(tensor)


def _counter_values_before(
    values: CounterValues | None,
    body: _Body,
    data: Sequence[str],
    outer: Callable[[str], str],
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], list[str]]:
    """Moves the step's ``values`` that depend on its counter alone out of ``body``
    (:mod:`graphkit.training.counter`): ``(nodes, initializers)`` of the epoch graph
    that compute them for every step, and the names of the vectors the Scan hands out
    an element of at each step; ``([], [], [])`` where there are none."""
    if values is None:
        return [], [], []
    nodes, initializers, vectors = epoch_nodes(values, data[0], outer)
    moved = {body.scoped[o] for n in values.nodes for o in n.output}
    kept = [n for n in body.graph.node if not moved.intersection(n.output)]
    del body.graph.node[:]
    body.graph.node.extend(kept)
    for f in values.frontier:
        body.graph.input.append(renamed_value(values.values[f], body.scoped[f]))
    # constants only the moved nodes read
    read = {i for n in kept for i in outer_reads(n)} | {o.name for o in body.graph.output}
    unread = [t for t in body.graph.initializer if t.name not in read]
    for tensor in unread:
        body.graph.initializer.remove(tensor)
    constants = [n for n in kept if n.op_type == "Constant" and n.output[0] not in read]
    for node in constants:
        body.graph.node.remove(node)
    return nodes, initializers, [vectors[f] for f in values.frontier]


__all__ = ["loop_over_batches", "scan_over_batches"]
