"""onnxruntime-training's TrainingAgent: a forward and its backward as two calls.

The agent runs a gradient graph from :func:`.builders.module_graphs` (or the fused one
of :mod:`.agent_step`) in two halves around its ``YieldOp``: the forward returns the
yielded values and keeps an execution state, the backward takes the gradients of those
values and the state. It works on C OrtValues and C vectors of them
(:func:`values_vector`), which is what makes a batch cost two calls and no allocation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from graphkit.engine.ort_engine import _capi, short_message


def training_agent(
    session: Any,
    feed_names: Sequence[str],
    fetch_names: Sequence[str],
    n_outputs: int,
    device: Any,
) -> Any:
    """A TrainingAgent over an InferenceSession of a :class:`ModuleGraphs` gradient graph."""
    return _capi().TrainingAgent(
        session._sess,
        list(feed_names),
        [device] * n_outputs,
        list(fetch_names),
        [device] * len(fetch_names),
        0,
    )


def run_forward(agent: Any, feeds: Sequence[Any]) -> tuple[Any, Any, Any]:
    """``(fetches vector, execution state, feeds vector)``: the forward on C OrtValues.

    The state and the feeds vector must live until the matching backward.
    """
    C = _capi()
    vector = values_vector(feeds)
    fetches, state = C.OrtValueVector(), C.PartialGraphExecutionState()
    _forward(agent, vector, fetches, state)
    return fetches, state, vector


def run_backward(agent: Any, grad_outputs: Sequence[Any], state: Any) -> Any:
    """The fetches vector of the backward matching the forward that made ``state``."""
    fetches = _capi().OrtValueVector()
    _backward(agent, values_vector(grad_outputs), fetches, state)
    return fetches


def train_batch(
    agent: Any,
    arrays: Sequence[np.ndarray],
    device: Any,
    carried: Sequence[Any],
    grads: Any,
    new: Any,
) -> None:
    """A forward on ``arrays`` (C-contiguous, borrowed until the call returns) followed by
    the C OrtValues ``carried``, then its backward fed the C vector ``grads``, writing its
    outputs into ``new`` (a C vector of allocated OrtValues): a forward/backward training
    batch, with its lookups hoisted (it is the hot loop)."""
    C = _capi()
    from_numpy = C.OrtValue.ortvalue_from_numpy
    feeds = C.OrtValueVector()
    push = feeds.push_back
    for array in arrays:
        push(from_numpy(array, device))
    for value in carried:
        push(value)
    outputs, state = C.OrtValueVector(), C.PartialGraphExecutionState()  # live until backward
    _forward(agent, feeds, outputs, state)
    _backward(agent, grads, new, state)


def values_vector(values: Sequence[Any]) -> Any:
    """A C vector of C OrtValues (the TrainingAgent's argument type)."""
    vector = _capi().OrtValueVector()
    vector.reserve(len(values))
    for value in values:
        vector.push_back(value)
    return vector


def _forward(agent: Any, feeds: Any, fetches: Any, state: Any) -> None:
    try:
        agent.run_forward(feeds, fetches, state, _capi().OrtValueCache())
    except Exception as exc:
        raise RuntimeError(f"forward failed in onnxruntime: {short_message(exc)}") from exc


def _backward(agent: Any, grads: Any, fetches: Any, state: Any) -> None:
    try:
        agent.run_backward(grads, fetches, state)
    except Exception as exc:
        raise RuntimeError(f"backward failed in onnxruntime: {short_message(exc)}") from exc
