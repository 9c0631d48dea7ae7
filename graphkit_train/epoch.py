"""Many training steps in one ONNX graph: the step as the body of a ``Loop`` over batches.

Running one onnxruntime call per mini-batch costs a call, a binding and a Python
iteration per batch. :func:`loop_over_batches` wraps a training step (any graph with
batch inputs, resident inputs and their ``<name>.next`` outputs) into a ``Loop`` whose
carried values are the resident tensors; every iteration gathers its batch from the
whole data, bound once::

    inputs : <data> (all rows), <batch rows>, <resident tensors>
    outputs: <name>.next for every resident tensor, batch_losses

Two forms of ``<batch rows>``:

* ``batch_size=None``: ``permutation`` (int64 [rows], the order of the rows) and
  ``batch_size`` (int64 scalar); batch k takes ``permutation[k*b:(k+1)*b]``, the last one
  may be shorter. Any step, any runtime: :func:`graphkit_train.export.export_training_epoch`.
* ``batch_size=b``: ``batches`` (int64 [n, b]), one row of indices per batch. Every batch
  has b rows, so the step inside can be specialized to that size
  (:func:`graphkit.static_shapes.specialize`): the trainers' fused epochs.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx
from onnx import TensorProto, helper

from graphkit._graph import graph_names, int_constant, rename_tensors

make = helper.make_node
PERMUTATION, BATCH_SIZE, BATCHES, BATCH_LOSSES = (
    "permutation",
    "batch_size",
    "batches",
    "batch_losses",
)


def _renamed(value: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(value)
    out.name = name
    return out


def _scalar(name: str, elem: int, value: object) -> onnx.NodeProto:
    return make("Constant", [], [name], value=helper.make_tensor(name, elem, [], [value]))


def _batch_rows(batch_size: int | None) -> tuple[list[onnx.NodeProto], list[onnx.NodeProto]]:
    """(nodes of the body giving ``loop/rows``, the rows of the iteration's batch;
    nodes of the outer graph giving ``graphkit.epoch/batches``, the trip count)."""
    if batch_size is not None:
        body = [make("Gather", [BATCHES, "loop/iteration"], ["loop/rows"], axis=0)]
        outer = [
            make("Shape", [BATCHES], ["graphkit.epoch/shape"]),
            int_constant("graphkit.epoch/first", [0]),
            make(
                "Gather",
                ["graphkit.epoch/shape", "graphkit.epoch/first"],
                ["graphkit.epoch/batches_1d"],
                axis=0,
            ),
            make("Squeeze", ["graphkit.epoch/batches_1d"], ["graphkit.epoch/batches"]),
        ]
        return body, outer
    start, stop, end = "loop/start", "loop/stop", "loop/end"
    body = [
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
    ]
    return body, outer


def loop_over_batches(
    step: onnx.ModelProto,
    data: Sequence[str],
    carried: Sequence[str],
    loss: str,
    batch_size: int | None = None,
    batch_losses: bool = True,
    name: str = "graphkit_training_epoch",
) -> onnx.ModelProto:
    """``step`` as the body of a Loop over batches (see the module docstring).

    Args:
        step: the training step: inputs ``data`` (one batch each, rows first) and
            ``carried``; outputs ``<name>.next`` for each carried name, and ``loss``.
        data: the batch inputs (features, label, sample weights), gathered by rows.
        carried: the resident inputs, carried from one batch to the next.
        loss: the batch-loss output, stacked into ``batch_losses``.
        batch_size: None for the ``permutation`` form, an int for the ``batches`` form.
        batch_losses: output the losses of the batches (a trainer that reads only the
            carried ``loss_sum`` leaves them out).
    """
    reserved = {PERMUTATION, BATCH_SIZE, BATCHES, BATCH_LOSSES}
    clash = sorted(reserved & {*data, *carried, *(f"{n}.next" for n in carried)})
    if clash:
        raise ValueError(
            f"The training step names tensors {clash}, which the epoch graph uses for its "
            "own inputs and outputs: rename them in the model."
        )
    inputs = {i.name: i for i in step.graph.input}
    outputs = {o.name: o for o in step.graph.output}
    loss_elem = outputs[loss].type.tensor_type.elem_type

    body = onnx.GraphProto()
    body.CopyFrom(step.graph)
    scoped = {n: f"step/{n}" for n in graph_names(body)}  # "loop/" names are ours
    rename_tensors(body, lambda n: scoped.get(n, n))
    for node in body.node:
        node.name = scoped.get(node.name, node.name)
    del body.input[:]
    del body.output[:]
    rows, outer = _batch_rows(batch_size)
    gather = [make("Gather", [d, "loop/rows"], [scoped[d]], axis=0) for d in data]
    nodes = [*rows, *gather, *body.node, make("Identity", ["loop/cond_in"], ["loop/cond_out"])]
    del body.node[:]
    body.node.extend(nodes)
    body.input.extend(
        [
            helper.make_tensor_value_info("loop/iteration", TensorProto.INT64, []),
            helper.make_tensor_value_info("loop/cond_in", TensorProto.BOOL, []),
            *(_renamed(inputs[n], scoped[n]) for n in carried),
        ]
    )
    body.output.extend(
        [
            helper.make_tensor_value_info("loop/cond_out", TensorProto.BOOL, []),
            *(_renamed(outputs[f"{n}.next"], scoped[f"{n}.next"]) for n in carried),
            *([_renamed(outputs[loss], scoped[loss])] if batch_losses else []),
        ]
    )
    body.name = "graphkit_training_step"

    if batch_size is None:
        rows_inputs = [
            helper.make_tensor_value_info(PERMUTATION, TensorProto.INT64, ["rows"]),
            helper.make_tensor_value_info(BATCH_SIZE, TensorProto.INT64, []),
        ]
    else:
        rows_inputs = [
            helper.make_tensor_value_info(BATCHES, TensorProto.INT64, ["batches", batch_size])
        ]
    # whole-data inputs: the step's batch inputs with a free number of rows
    data_inputs = []
    for d in data:
        value = _renamed(inputs[d], d)
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_param = "rows"
        data_inputs.append(value)
    loop = make(
        "Loop",
        ["graphkit.epoch/batches", "graphkit.epoch/true", *carried],
        [*(f"{n}.next" for n in carried), *([BATCH_LOSSES] if batch_losses else [])],
        body=body,
    )
    graph = helper.make_graph(
        [*outer, _scalar("graphkit.epoch/true", TensorProto.BOOL, True), loop],
        name,
        [*data_inputs, *rows_inputs, *(inputs[n] for n in carried)],
        [
            *(_renamed(outputs[f"{n}.next"], f"{n}.next") for n in carried),
            *(
                [helper.make_tensor_value_info(BATCH_LOSSES, loss_elem, ["batches"])]
                if batch_losses
                else []
            ),
        ],
    )
    model = helper.make_model(graph, opset_imports=list(step.opset_import))
    model.ir_version = step.ir_version
    return model


__all__ = ["loop_over_batches"]
