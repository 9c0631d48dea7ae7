"""Training that runs anywhere ONNX runs.

* :func:`export_training_step` writes a trainer's fused training step with every
  onnxruntime-training operator lowered to standard ONNX (:mod:`graphkit.lowering`), so
  that plain onnxruntime, ``onnx.reference`` or any other runtime can keep training::

      inputs : <features>, <label>[, <sample weight>]         (one mini-batch)
               <weights>, <optimizer state>, step, loss_sum     (resident: initializers
                                                                 hold their current values)
      outputs: loss, loss_sum.next, step.next, <weight>.next..., <state>.next...

  A loop feeds a batch and the resident tensors, then feeds each ``<name>.next`` back as
  ``<name>``. ``step`` counts the updates applied (the schedule reads it); ``loss_sum``
  accumulates the batch losses.
* :func:`export_training_info` writes the trained prediction model with the same step
  inside it as an ONNX ``TrainingInfoProto``: a model that carries its own way to keep
  training, run by :func:`graphkit.training_info.run_training_info`.
"""

from __future__ import annotations

import json
import os
from typing import Any

import onnx
from onnx import helper, numpy_helper

from graphkit._graph import fresh_name, graph_names, rename_tensors
from graphkit.compat import finalize
from graphkit.errors import IncompatibleModelError
from graphkit.lowering import lower_to_standard
from graphkit.rewrite import prune
from graphkit.step_trainer import META
from graphkit.training_info import check_training_info


def _portable_step(trainer: Any) -> tuple[Any, onnx.ModelProto, dict[str, Any]]:
    """``(step, lowered step model, {resident input: current value})``."""
    trainer._build()
    step = getattr(trainer, "training_step_", None)
    if step is None:
        raise TypeError(
            f"{type(trainer).__name__} has no fused training step to export; "
            "OrtGradientOptimizer has one."
        )
    # nodes no output needs (a ZipMap after the probabilities) are dropped first
    model = lower_to_standard(prune(step.model))
    values = trainer.get_state() if trainer._fitted else {}
    inputs = {i.name for i in model.graph.input}
    resident = {n: values.get(n, step.initial[n]) for n in step.resident if n in inputs}
    return step, model, resident


def export_training_step(
    trainer: Any, path: str | os.PathLike[str] | None = None
) -> onnx.ModelProto:
    """The trainer's training step in standard ONNX, its resident inputs defaulting to
    their current values (the initial ones before ``fit``).

    Args:
        trainer: an :class:`~graphkit_train.OrtGradientOptimizer`.
        path: where to save it (optional).

    Raises:
        IncompatibleModelError: the step holds an operator the lowering does not know
            (the message lists them).
        TypeError: the trainer has no fused training step (forward/backward training
            takes its gradients from the TrainingAgent at run time).
    """
    step, model, resident = _portable_step(trainer)
    model.graph.initializer.extend(
        numpy_helper.from_array(value, name) for name, value in resident.items()
    )
    data = [step.features, step.label] + ([step.sample_weight] if step.sample_weight else [])
    model.doc_string = (
        f"graphkit training step in standard ONNX. Feed one batch ({', '.join(data)}); the "
        f"resident inputs ({', '.join(resident)}) default to the exported values. "
        "Feed each output '<name>.next' back as '<name>' for the next batch; "
        f"'{step.loss}' is the batch loss. {step.model.doc_string}"
    )
    inputs = {i.name for i in model.graph.input}
    roles = {
        "features": step.features,
        "label": step.label,
        "sample_weight": step.sample_weight if step.sample_weight in inputs else None,
        "loss": step.loss,
        "resident": list(resident),
    }
    model.metadata_props.add(key=META, value=json.dumps(roles))  # for StepTrainer
    return _finish(model, path)


def export_training_info(
    trainer: Any, path: str | os.PathLike[str] | None = None
) -> onnx.ModelProto:
    """The prediction model with the trained weights, carrying the training step as a
    ``TrainingInfoProto``:

    * ``algorithm``: the lowered step; it reads the weights from the prediction graph's
      initializers and keeps the optimizer state, ``step`` and ``loss_sum`` as its own;
      its inputs are the label (and sample weights) beside the prediction graph's
      features; its outputs the batch loss and the ``.next`` values;
    * ``update_binding``: each weight and state tensor <- its ``.next`` output;
    * ``initialization``: resets the optimizer state, ``step`` and ``loss_sum`` (not the
      weights).

    Raises:
        IncompatibleModelError: a weight of the step is not an initializer of the
            prediction graph, or the lowering does not know an operator.
    """
    step, algorithm, resident = _portable_step(trainer)
    inference = trainer.get_trained_onnx() if trainer._fitted else trainer._prediction_model()
    main = inference.graph
    weights = {t.name for t in main.initializer}
    missing = [w for w in step.weights if w in resident and w not in weights]
    if missing:
        raise IncompatibleModelError(
            f"Weights {missing} of the training step are not initializers of the prediction "
            "graph, so a TrainingInfoProto could not update them; export_training_step "
            "exports the step alone."
        )
    shared_inputs = {i.name for i in main.input}
    taken = graph_names(main)
    keep = set(step.weights) | (shared_inputs & {i.name for i in algorithm.graph.input})
    own_names = graph_names(algorithm.graph)
    avoid = taken | own_names  # fresh_name adds each new name to it
    renamed: dict[str, str] = {}
    for name in sorted(own_names):
        if name in taken and name not in keep:
            renamed[name] = fresh_name(f"training/{name}", avoid)
    rename_tensors(algorithm.graph, lambda n: renamed.get(n, n))
    for node in algorithm.graph.node:
        node.name = renamed.get(node.name, node.name)

    graph = algorithm.graph
    own = {n: v for n, v in resident.items() if n not in step.weights}
    inputs = [i for i in graph.input if i.name not in keep and i.name not in own]
    del graph.input[:]
    graph.input.extend(inputs)
    graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in own.items())
    graph.name = "graphkit_training_step"
    outputs = {o.name for o in graph.output}

    info = onnx.TrainingInfoProto()
    info.algorithm.CopyFrom(graph)
    for name in resident:
        target = renamed.get(f"{name}.next", f"{name}.next")
        if target not in outputs:
            raise IncompatibleModelError(f"The training step has no output {target!r}.")
        info.update_binding.add(key=name, value=target)
    init_nodes, init_outputs = [], []
    for name, value in own.items():
        out = f"initial/{name}"
        init_nodes.append(
            helper.make_node(
                "Constant", [], [out], value=numpy_helper.from_array(step.initial[name], out)
            )
        )
        init_outputs.append(
            helper.make_tensor_value_info(
                out, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)
            )
        )
        info.initialization_binding.add(key=name, value=out)
    info.initialization.CopyFrom(
        helper.make_graph(init_nodes, "graphkit_reset_optimizer", [], init_outputs)
    )
    model = onnx.ModelProto()
    model.CopyFrom(inference)
    model.training_info.append(info)
    present = {o.domain for o in model.opset_import}
    for entry in algorithm.opset_import:
        if entry.domain not in present:
            model.opset_import.append(entry)
    model.doc_string = (
        (model.doc_string + "\n" if model.doc_string else "")
        + "Carries its training step (graphkit) as TrainingInfoProto 0: feed "
        f"{', '.join(i.name for i in [*main.input, *inputs])} to its algorithm; "
        "graphkit.training_info.run_training_info runs it."
    )
    check_training_info(model)
    return _finish(model, path)


def export_training_epoch(
    trainer: Any, path: str | os.PathLike[str] | None = None
) -> onnx.ModelProto:
    """One epoch of training as one standard-ONNX model: the lowered step as the body of
    a ``Loop`` over the batches.

    ::

        inputs : <features> (all rows), <label> (all rows)[, <sample weight>],
                 permutation (int64, the row order: numpy's permutation for shuffling,
                 arange(n) without), batch_size (int64 scalar),
                 <weights>, <optimizer state>, step, loss_sum   (default: current values)
        outputs: <name>.next for every resident tensor (after the epoch), batch_losses

    Batch k takes rows ``permutation[k * batch_size : (k + 1) * batch_size]`` (the last
    one may be shorter), as graphkit's trainers do.
    """
    step, body_model, resident = _portable_step(trainer)
    data = [step.features, step.label] + ([step.sample_weight] if step.sample_weight else [])
    data = [d for d in data if d in {i.name for i in body_model.graph.input}]
    inputs = {i.name: i for i in body_model.graph.input}
    carried = list(resident)

    # the body: the step with its names in a scope of their own
    body = onnx.GraphProto()
    body.CopyFrom(body_model.graph)
    scoped = {n: f"body/{n}" for n in graph_names(body)}
    rename_tensors(body, lambda n: scoped.get(n, n))
    for node in body.node:
        node.name = scoped.get(node.name, node.name)
    del body.input[:]
    del body.output[:]
    make = helper.make_node
    rows, start, end, stop = "body/rows", "body/start", "body/end", "body/stop"
    gather = [
        make("Mul", ["body/iteration", "batch_size"], [start]),
        make("Add", [start, "batch_size"], [stop]),
        make("Min", [stop, "epoch/rows"], [end]),
        make("Reshape", [start, "epoch/vector"], ["body/start_1d"]),
        make("Reshape", [end, "epoch/vector"], ["body/end_1d"]),
        make("Slice", ["permutation", "body/start_1d", "body/end_1d"], [rows]),
    ]
    gather += [make("Gather", [name, rows], [scoped[name]], axis=0) for name in data]
    step_nodes = list(body.node)
    del body.node[:]
    body.node.extend([*gather, *step_nodes])
    body.input.extend(
        [
            helper.make_tensor_value_info("body/iteration", onnx.TensorProto.INT64, []),
            helper.make_tensor_value_info("body/cond_in", onnx.TensorProto.BOOL, []),
        ]
    )
    for name in carried:
        value = onnx.ValueInfoProto()
        value.CopyFrom(inputs[name])
        value.name = scoped[name]
        body.input.append(value)
    body.node.append(make("Identity", ["body/cond_in"], ["body/cond_out"]))
    body.output.append(helper.make_tensor_value_info("body/cond_out", onnx.TensorProto.BOOL, []))
    outputs = {o.name: o for o in body_model.graph.output}
    for name in carried:
        value = onnx.ValueInfoProto()
        value.CopyFrom(outputs[f"{name}.next"])
        value.name = scoped[f"{name}.next"]
        body.output.append(value)
    loss = onnx.ValueInfoProto()
    loss.CopyFrom(outputs[step.loss])
    loss.name = scoped[step.loss]
    body.output.append(loss)
    body.name = "graphkit_training_step"

    # the epoch: count the batches, loop, hand out the final values
    graph = helper.make_graph(
        [
            make("Shape", ["permutation"], ["epoch/rows_1d"]),
            helper.make_node("Constant", [], ["epoch/vector"], value_ints=[1]),
            make("Squeeze", ["epoch/rows_1d"], ["epoch/rows"]),
            helper.make_node(
                "Constant",
                [],
                ["epoch/one"],
                value=helper.make_tensor("one", onnx.TensorProto.INT64, [], [1]),
            ),
            make("Sub", ["batch_size", "epoch/one"], ["epoch/round_up"]),
            make("Add", ["epoch/rows", "epoch/round_up"], ["epoch/padded"]),
            make("Div", ["epoch/padded", "batch_size"], ["epoch/batches"]),
            helper.make_node(
                "Constant",
                [],
                ["epoch/true"],
                value=helper.make_tensor("true", onnx.TensorProto.BOOL, [], [True]),
            ),
            make(
                "Loop",
                ["epoch/batches", "epoch/true", *carried],
                [*(f"{n}.next" for n in carried), "batch_losses"],
                body=body,
            ),
        ],
        "graphkit_training_epoch",
        [
            *(inputs[d] for d in data),
            helper.make_tensor_value_info("permutation", onnx.TensorProto.INT64, ["rows"]),
            helper.make_tensor_value_info("batch_size", onnx.TensorProto.INT64, []),
            *(inputs[n] for n in carried),
        ],
        [
            *(_renamed(outputs[f"{n}.next"], f"{n}.next") for n in carried),
            helper.make_tensor_value_info(
                "batch_losses", outputs[step.loss].type.tensor_type.elem_type, ["batches"]
            ),
        ],
        [numpy_helper.from_array(v, n) for n, v in resident.items()],
    )
    model = helper.make_model(graph, opset_imports=list(body_model.opset_import))
    model.ir_version = body_model.ir_version
    model.doc_string = (
        f"graphkit training epoch in standard ONNX: the step of {step.model.doc_string!r} "
        "as the body of a Loop over the batches permutation[k*batch_size:(k+1)*batch_size]."
    )
    return _finish(model, path)


def _finish(model: onnx.ModelProto, path: str | os.PathLike[str] | None) -> onnx.ModelProto:
    """Check ``model``, save it to ``path`` when given, and return it."""
    finalize(model)
    if path is not None:
        onnx.save(model, os.fspath(path))
    return model


def _renamed(value: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(value)
    out.name = name
    return out
