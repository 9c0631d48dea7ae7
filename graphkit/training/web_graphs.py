"""The graphs a web page trains with, built from a training problem.

:func:`web_graphs` gives what :func:`graphkit_train.web.export_web` writes into a folder
for onnxruntime-web: the portable training step and epoch
(:func:`graphkit.training.export.export_step`, :func:`~graphkit.training.export.export_epoch`),
the evaluation and prediction graphs reading the weights as inputs (the weights the page
holds), and the prediction model without its weights (the template the page appends the
trained weights to, so that it exports the trained model without an ONNX library).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from graphkit._graph import copy_model
from graphkit.backends.base import Backend
from graphkit.compat import finalize
from graphkit.errors import IncompatibleModelError
from graphkit.rewrite import (
    META_PREDICTION,
    initializers_to_inputs,
    metadata,
    prune,
    strip_loss_output,
)
from graphkit.training.export import State, export_epoch, export_step
from graphkit.training.problem import TrainingProblem
from graphkit.training.trained import trained_weights, with_weights
from graphkit.training_info import initial_state


@dataclass
class WebGraphs:
    """What a web page trains with (see the module docstring)."""

    step: onnx.ModelProto
    epoch: onnx.ModelProto
    evaluate: onnx.ModelProto
    """The training graph reduced to its loss, the weights as inputs."""
    predict: onnx.ModelProto
    """The prediction graph reduced to ``prediction_output``, the weights as inputs."""
    template: onnx.ModelProto
    """The prediction model without the initializers of ``weights``."""
    trained: onnx.ModelProto
    """The prediction model with the current weights: the template plus them."""
    roles: dict[str, Any]
    """The step's roles (its ``graphkit.training_step`` metadata)."""
    resident: dict[str, np.ndarray]
    """The step's resident values (weights, optimizer state, counters), in its order."""
    weights: list[str]
    prediction_output: str


def web_graphs(
    problem: TrainingProblem,
    prediction: onnx.ModelProto,
    backend: Backend,
    state: State | None = None,
) -> WebGraphs:
    """The graphs a page trains ``problem`` with, from ``state`` (None: the initial one);
    ``prediction`` is the prediction graph with its weights as initializers, ``backend``
    lowers its operators to standard ONNX.

    Raises:
        IncompatibleModelError: a weight that is not an initializer of ``prediction``, or a
            step the lowering to standard ONNX cannot write.
    """
    step = export_step(problem, backend, state)
    epoch = export_epoch(problem, backend, state)
    roles = json.loads(metadata(step)["graphkit.training_step"])
    initial = initial_state(step)
    resident = {name: initial[name] for name in roles["resident"]}
    training_step = problem.step()
    weights = [w for w in training_step.model_state if w in resident]

    # the training graph and the prediction graph, reading the weights as inputs (those
    # the trainer evaluates and predicts with)
    evaluation = initializers_to_inputs(problem.model, training_step.model_state)
    prediction_graph = strip_loss_output(evaluation)
    evaluate = _forward(backend, evaluation, [roles["loss"]])
    prediction_output = metadata(problem.model).get(META_PREDICTION) or next(
        o.name for o in prediction_graph.graph.output
    )
    predict = _forward(backend, prediction_graph, [prediction_output])
    trained = (
        copy_model(prediction)
        if state is None
        else with_weights(prediction, trained_weights(state, training_step.model_state))
    )
    template, trained = _template(trained, weights, resident)
    return WebGraphs(
        step,
        epoch,
        evaluate,
        predict,
        template,
        trained,
        roles,
        resident,
        weights,
        prediction_output,
    )


def _forward(backend: Backend, model: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    """``model`` reduced to ``outputs`` (a ZipMap after the probabilities goes: no web
    runtime returns maps), its operators lowered to standard ONNX, checked."""
    model = copy_model(model)
    kept = [o for o in model.graph.output if o.name in outputs]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    model = backend.to_standard(prune(model))
    del model.metadata_props[:]
    return finalize(model, full_check=True)


def _template(
    trained: onnx.ModelProto, weights: list[str], state: dict[str, np.ndarray]
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The prediction model without the initializers of ``weights``, and the model with
    the current weights (what the template plus them must give); ``trained``, the
    prediction model with its trained weights, is changed in place."""
    present = {t.name for t in trained.graph.initializer}
    missing = [w for w in weights if w not in present]
    if missing:
        raise IncompatibleModelError(
            f"Weights {missing} are not initializers of the prediction model, so the page "
            "could not write the trained model; train a model whose weights are initializers."
        )
    for tensor in trained.graph.initializer:
        if tensor.name in state:
            tensor.CopyFrom(numpy_helper.from_array(state[tensor.name], tensor.name))
    template = copy_model(trained)
    kept = [t for t in template.graph.initializer if t.name not in set(weights)]
    del template.graph.initializer[:]
    template.graph.initializer.extend(kept)
    return template, trained


__all__ = ["WebGraphs", "web_graphs"]
