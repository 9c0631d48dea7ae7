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
    """(nodes of the body giving ``body/rows``, nodes of the outer graph giving
    ``epoch/batches``, the trip count)."""
    if batch_size is not None:
        body = [make("Gather", [BATCHES, "body/iteration"], ["body/rows"], axis=0)]
        outer = [
            make("Shape", [BATCHES], ["epoch/shape"]),
            int_constant("epoch/first", [0]),
            make("Gather", ["epoch/shape", "epoch/first"], ["epoch/batches_1d"], axis=0),
            make("Squeeze", ["epoch/batches_1d"], ["epoch/batches"]),
        ]
        return body, outer
    start, stop, end = "body/start", "body/stop", "body/end"
    body = [
        make("Mul", ["body/iteration", BATCH_SIZE], [start]),
        make("Add", [start, BATCH_SIZE], [stop]),
        make("Min", [stop, "epoch/rows"], [end]),
        make("Reshape", [start, "epoch/vector"], ["body/start_1d"]),
        make("Reshape", [end, "epoch/vector"], ["body/end_1d"]),
        make("Slice", [PERMUTATION, "body/start_1d", "body/end_1d"], ["body/rows"]),
    ]
    outer = [  # batches = ceil(rows / batch_size)
        make("Shape", [PERMUTATION], ["epoch/rows_1d"]),
        int_constant("epoch/vector", [1]),
        make("Squeeze", ["epoch/rows_1d"], ["epoch/rows"]),
        _scalar("epoch/one", TensorProto.INT64, 1),
        make("Sub", [BATCH_SIZE, "epoch/one"], ["epoch/round_up"]),
        make("Add", ["epoch/rows", "epoch/round_up"], ["epoch/padded"]),
        make("Div", ["epoch/padded", BATCH_SIZE], ["epoch/batches"]),
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
    inputs = {i.name: i for i in step.graph.input}
    outputs = {o.name: o for o in step.graph.output}
    loss_elem = outputs[loss].type.tensor_type.elem_type

    body = onnx.GraphProto()
    body.CopyFrom(step.graph)
    scoped = {n: f"body/{n}" for n in graph_names(body)}
    rename_tensors(body, lambda n: scoped.get(n, n))
    for node in body.node:
        node.name = scoped.get(node.name, node.name)
    del body.input[:]
    del body.output[:]
    rows, outer = _batch_rows(batch_size)
    gather = [make("Gather", [d, "body/rows"], [scoped[d]], axis=0) for d in data]
    nodes = [*rows, *gather, *body.node, make("Identity", ["body/cond_in"], ["body/cond_out"])]
    del body.node[:]
    body.node.extend(nodes)
    body.input.extend(
        [
            helper.make_tensor_value_info("body/iteration", TensorProto.INT64, []),
            helper.make_tensor_value_info("body/cond_in", TensorProto.BOOL, []),
            *(_renamed(inputs[n], scoped[n]) for n in carried),
        ]
    )
    body.output.extend(
        [
            helper.make_tensor_value_info("body/cond_out", TensorProto.BOOL, []),
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
        ["epoch/batches", "epoch/true", *carried],
        [*(f"{n}.next" for n in carried), *([BATCH_LOSSES] if batch_losses else [])],
        body=body,
    )
    graph = helper.make_graph(
        [*outer, _scalar("epoch/true", TensorProto.BOOL, True), loop],
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
