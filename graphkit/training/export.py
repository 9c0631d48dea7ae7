"""Training that runs anywhere ONNX runs.

* :func:`export_training_step` writes a trainer's fused training step with every
  operator of the trainer's gradient source lowered to standard ONNX
  (:meth:`graphkit.backends.base.GradientSource.to_standard`), so that plain
  onnxruntime, ``onnx.reference`` or any other runtime can keep training::

      inputs : <features>..., <label>... (one per loss head)[, <sample weight>]
                                                                (one mini-batch)
               <weights>, <optimizer state>, step, loss_sum     (resident: their current
                 values are the outputs of TrainingInfoProto 0's initialization graph,
                 ``graphkit.training_info.initial_state``)
      outputs: loss, loss_sum.next, step.next, <weight>.next..., <state>.next...

  A loop feeds a batch and the resident tensors, then feeds each ``<name>.next`` back as
  ``<name>``; the first run feeds :func:`graphkit.training_info.initial_state`. The
  resident inputs have no initializer (an initializer named like an input would be its
  default, which onnxruntime reports with one warning each, and IR version 3 makes them
  constants). ``step`` counts the updates applied (the schedule reads it); ``loss_sum``
  accumulates the batch losses.
* :func:`export_training_info` writes the trained prediction model with the same step
  inside it as an ONNX ``TrainingInfoProto``: a model that carries its own way to keep
  training, run by :func:`graphkit.training_info.run_training_info`.

Each is written from a :class:`~graphkit.training.problem.TrainingProblem`, the backend
that lowers its operators and the training state (``get_state()``'s arrays; None for the
initial values): :func:`export_step`, :func:`export_epoch`, :func:`export_info` (which
also takes the prediction graph the trained weights go into). The functions named
``export_training_*`` take a fitted full trainer instead (its ``problem_``,
``backend_``, ``fitted_state()`` and ``prediction_template()``), as
``OrtGradientOptimizer.export_training_step`` and the other methods do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit import backends, tensor_store
from graphkit._graph import fresh_name, graph_names, rename_tensors
from graphkit.backends.base import Backend
from graphkit.compat import finalize
from graphkit.errors import IncompatibleModelError
from graphkit.portable_trainer import META
from graphkit.rewrite import META_HEADS, loss_heads, metadata, prune
from graphkit.training.epoch import loop_over_batches
from graphkit.training.problem import TrainingProblem
from graphkit.training.step import TrainingStep
from graphkit.training.trained import trained_weights, with_weights
from graphkit.training_info import check_training_info, set_initial_state

State = Mapping[str, np.ndarray]
"""A training state as ``get_state()`` gives it: the weights, the optimizer state (per
weight) and ``step``."""


def _portable_step(
    problem: TrainingProblem, backend: Backend | None, state: State | None
) -> tuple[TrainingStep, onnx.ModelProto, dict[str, Any]]:
    """``(step, lowered step model, {resident input: current value})``."""
    # other runtimes get the state named per weight, as get_state() names it
    step = problem.step(pack=False)
    backend = backends.get(problem.backend) if backend is None else backend
    # nodes no output needs (a ZipMap after the probabilities) are dropped first
    model = backend.to_standard(prune(step.model))
    values = {} if state is None else state
    inputs = {i.name for i in model.graph.input}
    resident = {n: values.get(n, step.initial[n]) for n in step.resident if n in inputs}
    return step, model, resident


def _heads(model: onnx.ModelProto) -> dict[str, str]:
    """``{output: its label input}`` of a graph with a loss per output (else empty)."""
    if not metadata(model).get(META_HEADS):
        return {}
    return {h.output: h.label for h in loss_heads(model)}


def _from_trainer(trainer: Any) -> tuple[TrainingProblem, Backend, State | None]:
    """What the exporters take from a full trainer (built here): its problem, its
    backend and its state (None before ``fit``)."""
    backend = trainer.backend_  # builds
    problem = getattr(trainer, "problem_", None)
    if problem is None:
        raise TypeError(
            f"{type(trainer).__name__} has no fused training step to export; "
            "OrtGradientOptimizer has one."
        )
    return problem, backend, trainer.fitted_state()


def export_training_step(
    trainer: Any, path: str | os.PathLike[str] | None = None
) -> onnx.ModelProto:
    """The trainer's training step in standard ONNX; its resident inputs' current values
    (the initial ones before ``fit``) are the outputs of TrainingInfoProto 0's
    initialization graph (:func:`graphkit.training_info.initial_state`). See
    :func:`export_step`.

    Args:
        trainer: an :class:`~graphkit_train.OrtGradientOptimizer`.
        path: where to save it (optional).

    Raises:
        IncompatibleModelError: the step holds an operator the lowering does not know
            (the message lists them).
        TypeError: the trainer has no fused training step (forward/backward training
            takes its gradients from the TrainingAgent at run time).
    """
    problem, backend, state = _from_trainer(trainer)
    return export_step(problem, backend, state, path)


def export_step(
    problem: TrainingProblem,
    backend: Backend | None = None,
    state: State | None = None,
    path: str | os.PathLike[str] | None = None,
) -> onnx.ModelProto:
    """The training step of ``problem`` in standard ONNX.

    Args:
        problem: what to train and how.
        backend: lowers the backend's operators to standard ONNX (None: the problem's).
        state: the training state its resident inputs start from (``get_state()``'s
            arrays; None, or an entry left out: the initial value); they are the outputs
            of TrainingInfoProto 0's initialization graph
            (:func:`graphkit.training_info.initial_state`).
        path: where to save it (optional).

    Raises:
        IncompatibleModelError: the step holds an operator the lowering does not know
            (the message lists them).
    """
    step, model, resident = _portable_step(problem, backend, state)
    set_initial_state(model, resident)
    data = step.data
    model.doc_string = (
        f"graphkit training step in standard ONNX. Feed one batch ({', '.join(data)}); the "
        f"resident inputs ({', '.join(resident)}) start from the outputs of TrainingInfoProto "
        "0's initialization graph (graphkit.training_info.initial_state). "
        "Feed each output '<name>.next' back as '<name>' for the next batch; "
        f"'{step.loss}' is the batch loss. {step.model.doc_string}"
    )
    inputs = {i.name for i in model.graph.input}
    roles = {
        "features": step.features,  # the first feature input (graphkit < several inputs)
        "inputs": list(step.feature_inputs),
        "label": step.label,
        "labels": list(step.labels),  # one per loss head (a loss per output)
        "heads": _heads(problem.model),
        "sample_weight": step.sample_weight if step.sample_weight in inputs else None,
        "loss": step.loss,
        "resident": list(resident),
    }
    model.metadata_props.add(key=META, value=json.dumps(roles))  # for PortableTrainer
    return _finish(model, path)


def export_training_info(
    trainer: Any, path: str | os.PathLike[str] | None = None
) -> onnx.ModelProto:
    """The trainer's prediction model with its current weights, carrying the training
    step as a ``TrainingInfoProto``; see :func:`export_info`.

    Raises:
        IncompatibleModelError: a weight of the step is not an initializer of the
            prediction graph, or the lowering does not know an operator.
        TypeError: the trainer has no fused training step.
    """
    problem, backend, state = _from_trainer(trainer)
    return export_info(problem, trainer.prediction_template(), backend, state, path)


def export_info(
    problem: TrainingProblem,
    prediction: onnx.ModelProto,
    backend: Backend | None = None,
    state: State | None = None,
    path: str | os.PathLike[str] | None = None,
) -> onnx.ModelProto:
    """The prediction graph ``prediction`` (weights as initializers: the trained ones
    are written into it) with the weights of ``state`` (None: its own), carrying the
    training step of ``problem`` as a ``TrainingInfoProto`` (``backend``, ``state``,
    ``path``: as in :func:`export_step`):

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
    step, algorithm, resident = _portable_step(problem, backend, state)
    inference = (
        prediction
        if state is None
        else with_weights(prediction, trained_weights(state, step.model_state))
    )
    main = inference.graph
    weights = {t.name for t in main.initializer}
    missing = [w for w in step.model_state if w in resident and w not in weights]
    if missing:
        raise IncompatibleModelError(
            f"Weights {missing} of the training step are not initializers of the prediction "
            "graph, so a TrainingInfoProto could not update them; export_training_step "
            "exports the step alone."
        )
    shared_inputs = {i.name for i in main.input}
    taken = graph_names(main)
    keep = set(step.model_state) | (shared_inputs & {i.name for i in algorithm.graph.input})
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
    own = {n: v for n, v in resident.items() if n not in step.model_state}
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
    """One epoch of the trainer's training as one standard-ONNX model; see
    :func:`export_epoch`.

    Raises:
        IncompatibleModelError: the lowering does not know an operator of the step.
        TypeError: the trainer has no fused training step.
    """
    problem, backend, state = _from_trainer(trainer)
    return export_epoch(problem, backend, state, path)


def export_epoch(
    problem: TrainingProblem,
    backend: Backend | None = None,
    state: State | None = None,
    path: str | os.PathLike[str] | None = None,
) -> onnx.ModelProto:
    """One epoch of training ``problem`` as one standard-ONNX model: the lowered step as
    the body of a ``Loop`` over the batches (``backend``, ``state``, ``path``: as in
    :func:`export_step`).

    ::

        inputs : <features>... (all rows, every feature input), <label>... (all rows,
                 one per loss head)
                 [, <sample weight>],
                 permutation (int64, the row order: numpy's permutation for shuffling,
                 arange(n) without), batch_size (int64 scalar),
                 <weights>, <optimizer state>, step, loss_sum   (current values: the
                 outputs of TrainingInfoProto 0's initialization graph,
                 ``graphkit.training_info.initial_state``)
        outputs: <name>.next for every resident tensor (after the epoch), batch_losses

    Batch k takes rows ``permutation[k * batch_size : (k + 1) * batch_size]`` (the last
    one may be shorter), as graphkit's trainers do.
    """
    step, body_model, resident = _portable_step(problem, backend, state)
    present = {i.name for i in body_model.graph.input}
    data = step.data
    model = loop_over_batches(
        body_model, [d for d in data if d in present], list(resident), step.loss
    )
    set_initial_state(model, resident)
    model.doc_string = (
        f"graphkit training epoch in standard ONNX: the step of {step.model.doc_string!r} "
        "as the body of a Loop over the batches permutation[k*batch_size:(k+1)*batch_size]. "
        "The resident inputs start from the outputs of TrainingInfoProto 0's initialization "
        "graph (graphkit.training_info.initial_state)."
    )
    return _finish(model, path)


def _finish(model: onnx.ModelProto, path: str | os.PathLike[str] | None) -> onnx.ModelProto:
    """Check ``model``, save it to ``path`` when given (its weights as external data
    beside it when they came so, :func:`graphkit.tensor_store.save_model`), and return
    it self-contained."""
    finalize(model, full_check=True)
    if path is not None:
        tensor_store.save_model(model, os.fspath(path))
    return tensor_store.inline(model)


__all__ = [
    "export_epoch",
    "export_info",
    "export_step",
    "export_training_epoch",
    "export_training_info",
    "export_training_step",
]
