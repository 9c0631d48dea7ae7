"""The training graphs specialized to a batch size: what the trainers run for batches
of a size they see often (every full batch of an epoch, the first few sizes of streamed
batches).

A graph built for any number of rows spends kernels on shape arithmetic that is constant
once the rows are known: :func:`for_rows` fixes them and folds it away
(:func:`graphkit.static_shapes.specialize`, with a backend's folds of its own operators);
:func:`fused_step` does so for full training's fused step and lays it, for several
batches per run, in a ``Scan`` over batch-major data
(:func:`graphkit.training.epoch.scan_over_batches`); :func:`folded` folds a graph whose
inputs have no batch dimension (the update step of forward/backward training).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import onnx

from graphkit.static_shapes import Fold, specialize
from graphkit.training.epoch import scan_over_batches
from graphkit.training.step import TrainingStep


def for_rows(
    model: onnx.ModelProto, inputs: Iterable[str], rows: int, folds: Sequence[Fold] = ()
) -> onnx.ModelProto:
    """``model`` for batches of ``rows`` rows: the first dimension of each of ``inputs``
    fixed to ``rows``, and what became constant folded away (``folds``: a backend's,
    for its own operators). It computes what ``model`` computes on such batches; its
    inputs and outputs keep their names."""
    return specialize(model, dict.fromkeys(inputs, rows), folds)


def folded(model: onnx.ModelProto, folds: Sequence[Fold] = ()) -> onnx.ModelProto:
    """``model`` with every computation on constants folded away (no input fixed)."""
    return specialize(model, {}, folds)


def fused_step(
    step: TrainingStep,
    batch_size: int,
    static: bool,
    looped: bool,
    folds: Sequence[Fold] = (),
) -> tuple[onnx.ModelProto, onnx.ModelProto | None]:
    """``(step model, scan model)`` for full batches of ``batch_size`` rows: the fused
    step, specialized to that size when ``static`` (:func:`for_rows` of its data
    inputs), and when ``looped`` that step as the body of a ``Scan`` over batch-major
    data, run once per several batches (else None)."""
    model = for_rows(step.model, step.data, batch_size, folds) if static else step.model
    if not looped:
        return model, None
    return model, scan_over_batches(model, step.data, step.resident, step.loss, batch_size)


__all__ = ["Fold", "folded", "for_rows", "fused_step"]
