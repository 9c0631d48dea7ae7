"""Training steps that run anywhere ONNX runs.

:func:`export_training_step` writes a trainer's fused training step with every
onnxruntime-training operator lowered to standard ONNX (:mod:`graphkit.lowering`), so
that plain onnxruntime, ``onnx.reference`` or any other runtime can keep training the
model. Its contract::

    inputs : <features>, <label>[, <sample weight>]           (one mini-batch)
             <weights>, <optimizer state>, step, loss_sum       (resident: initializers
                                                                 hold their current values)
    outputs: loss, loss_sum.next, step.next, <weight>.next..., <state>.next...

A loop feeds a batch and the resident tensors, then feeds each ``<name>.next`` back as
``<name>``. ``step`` counts the updates applied (the schedule reads it); ``loss_sum``
accumulates the batch losses.
"""

from __future__ import annotations

import os
from typing import Any

import onnx

from graphkit.compat import finalize
from graphkit.lowering import lower_to_standard
from graphkit.rewrite import prune


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
    model.graph.initializer.extend(
        onnx.numpy_helper.from_array(value, name) for name, value in resident.items()
    )
    data = [step.features, step.label] + ([step.sample_weight] if step.sample_weight else [])
    model.doc_string = (
        f"graphkit training step in standard ONNX. Feed one batch ({', '.join(data)}); the "
        f"resident inputs ({', '.join(step.resident)}) default to the exported values. "
        "Feed each output '<name>.next' back as '<name>' for the next batch; "
        f"'{step.loss}' is the batch loss. {step.model.doc_string}"
    )
    finalize(model)
    if path is not None:
        onnx.save(model, os.fspath(path))
    return model
