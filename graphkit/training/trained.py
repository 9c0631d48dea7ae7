"""The prediction graph with trained weights.

Training may untie the weights an exporter merged (``untie_shared_weights``: one weight
per parameter slot, see :func:`graphkit.parameters.untie_shared_parameters`): the
prediction graph the trained weights are written into is untied the same way
(:func:`untied_prediction`), then :func:`with_weights` writes them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from graphkit.parameters import untie_constants, untie_shared_parameters
from graphkit.rewrite import set_weights
from graphkit.transforms import ema_weights


def untied_prediction(model: onnx.ModelProto, weights: Sequence[str]) -> onnx.ModelProto:
    """``model`` with the copies of shared weights that training made, so that every
    trained weight among ``weights`` is one of its initializers."""
    present = {i.name for i in model.graph.initializer}
    trained = [w for w in weights if w in present]
    return untie_shared_parameters(model, trained)[0]


def trained_weights(
    state: Mapping[str, np.ndarray], weights: Sequence[str], ema: bool = False
) -> dict[str, np.ndarray]:
    """The values of ``weights`` (the weights and buffers, such as running statistics)
    in a training state (``get_state()``: weights, optimizer state, ``step``), the
    weights' moving averages instead when ``ema`` (the optimizer's chain must end with
    :func:`graphkit.transforms.ema`)."""
    values = {n: v for n, v in state.items() if n in weights}
    if ema:
        averages = ema_weights(state)
        values = {n: v for n, v in values.items() if n not in averages} | averages
    return values


def with_weights(model: onnx.ModelProto, weights: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` with ``weights`` as the values of its initializers."""
    # a constant the exporter merged with a weight must keep its value
    return set_weights(untie_constants(model, weights), weights)


__all__ = ["trained_weights", "untied_prediction", "with_weights"]
