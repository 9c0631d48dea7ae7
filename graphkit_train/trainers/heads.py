"""A loss per output: the heads of a training graph, as the trainers use them.

A graph built by ``graphkit.add_loss_output(onx, {output: loss, ...}, loss_weights=...)``
has one label input per head and one loss, the weighted sum of the heads' losses. The
trainers take its labels as ``y = {output name: labels}`` (checked per head here, into
one :class:`~graphkit.training.batches.NamedRows` keyed by the label inputs, so that
batches, shuffling and held-out splits cut every head's labels at the same rows), and
``predict`` returns ``{output name: prediction}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from graphkit import losses
from graphkit.errors import ShapeError, UnknownNameError
from graphkit.losses import CLASSIFICATION, LOSSES, Loss
from graphkit.rewrite import META_HEADS, loss_heads, metadata
from graphkit.shapes import named_shape
from graphkit.training.batches import NamedRows
from graphkit_train.trainers.params import check_labels, input_value


@dataclass
class Head:
    """One loss of a training graph with a loss per output."""

    output: str
    """The prediction output the loss reads."""
    label: str
    """The label input."""
    loss: Loss | None
    """The loss, resolved for the output's shape (None: a custom loss)."""
    weight: float
    """Its weight in the total loss."""
    label_value: onnx.ValueInfoProto
    prediction_shape: tuple[int | str, ...]

    @property
    def classifies(self) -> bool:
        return self.loss is not None and self.loss.task == CLASSIFICATION

    def prediction(self, output: np.ndarray) -> np.ndarray:
        """What ``predict`` returns for this head: class labels for a classification
        loss, the output itself otherwise (1-D for one column)."""
        if self.classifies:
            return self.loss.labels(output)  # type: ignore[union-attr]
        return output[:, 0] if output.ndim == 2 and output.shape[1] == 1 else output


def recorded_loss(description: Mapping[str, Any]) -> Loss | None:
    """The loss ``add_loss_output`` recorded (None for a custom loss, or one recorded by
    another graphkit version)."""
    description = dict(description)
    name = description.pop("name", None)
    if name not in LOSSES:
        return None
    try:
        return losses.get(name, **description)
    except (TypeError, ValueError):
        return None


def heads_of(train_onnx: onnx.ModelProto) -> list[Head] | None:
    """The heads of a graph built with a dict of losses (one entry included: such a graph
    records no one-loss metadata); None for a graph with one loss."""
    if not metadata(train_onnx).get(META_HEADS):
        return None
    recorded = loss_heads(train_onnx)
    outputs = {o.name: o for o in train_onnx.graph.output}
    heads = []
    for head in recorded:
        shape = named_shape(outputs[head.output]) if head.output in outputs else ()
        loss = recorded_loss(head.loss)
        heads.append(
            Head(
                head.output,
                head.label,
                None if loss is None else loss.for_prediction(shape),
                head.weight,
                input_value(train_onnx, head.label),
                shape,
            )
        )
    return heads


def check_head_labels(
    y: Any,
    heads: list[Head],
    n: int,
    what: str,
    n_classes: Callable[[Head], int],
) -> NamedRows:
    """``y = {output name: labels}`` checked head by head (each as ``fit`` checks one
    loss's labels: shapes, dtypes, class labels in range), as :class:`NamedRows` keyed by
    the label inputs, in the heads' order.

    Raises:
        ShapeError: ``y`` is one array (the message names the heads and says to pass a
            dict), or a head's labels do not fit its output.
        UnknownNameError: ``y`` misses a head or names an output without a loss.
        ValueError: class labels outside a classification head's classes.
    """
    outputs = [h.output for h in heads]
    if isinstance(y, NamedRows):  # checked already (compute_loss checks twice)
        by_label = {h.label: h.output for h in heads}
        y = {by_label.get(name, name): a for name, a in y.arrays.items()}
    if not isinstance(y, Mapping):
        shape = getattr(y, "shape", None)
        raise ShapeError(
            f"{what} is one array{f' of shape {shape}' if shape is not None else ''}, but the "
            f"model has a loss per output {outputs}: pass a dict {{output name: labels}}, e.g. "
            f"{what}={{" + ", ".join(f"{o!r}: ..." for o in outputs) + "}."
        )
    missing = [o for o in outputs if o not in y]
    unknown = [k for k in y if k not in outputs]
    if missing or unknown:
        problems = []
        if missing:
            problems.append(f"it has no labels for {missing}")
        if unknown:
            verb = "is" if len(unknown) == 1 else "are"
            problems.append(f"{unknown} {verb} no output with a loss")
        raise UnknownNameError(
            f"{what} names {list(y)}: {' and '.join(problems)}. The outputs with a loss are "
            f"{outputs}; pass the labels of each."
        )
    arrays = {}
    for head in heads:
        name = f"{what}[{head.output!r}]"
        labels = check_labels(y[head.output], head.label_value, n, name)
        if head.classifies:
            head.loss.check_classes(labels, n_classes(head), name)  # type: ignore[union-attr]
        arrays[head.label] = labels
    return NamedRows(arrays)


__all__ = ["Head", "check_head_labels", "heads_of", "recorded_loss"]
