"""Forward and backward as two plain onnxruntime sessions: the native TrainingAgent.

:class:`SplitAgent` runs a vector-Jacobian graph (:func:`.split.forward_backward_graphs`)
cut in two (:func:`.split.cut`): the forward session returns the layer's outputs and keeps
what the backward reads; the backward session takes the gradients of the outputs and
returns the gradients. The functions below have the signatures of onnxruntime-training's
agent (:mod:`graphkit.backends.ort_training.agent`), so the forward/backward engine
(:class:`graphkit_train.engine.forward_backward.OrtGradientForwardBackward`) and the
trainers run either. Values are C OrtValues, as there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx

from graphkit.backends.native.split import cut
from graphkit.engine import ort_engine


class SplitAgent:
    """Two sessions: a forward that keeps activations, a backward that reads them."""

    def __init__(
        self,
        gradient: onnx.ModelProto,
        session: Any,
        feed_names: Sequence[str],
        fetch_names: Sequence[str],
        output_names: Sequence[str],
        seeds: Sequence[str],
    ) -> None:
        halves = cut(gradient, feed_names, output_names, seeds)
        self.feed_names = list(feed_names)
        self.n_outputs = len(output_names)
        self.recomputes = halves.recomputes
        self.forward_session = session(halves.forward)
        self.backward_session = session(halves.backward)
        self._forward_fetches = halves.forward_outputs
        # (backward input, position among the forward's outputs)
        self._kept = [(n, halves.forward_outputs.index(n)) for n in halves.kept]
        self._fed = [self.feed_names.index(n) for n in halves.fed]
        self._fed_names = halves.fed
        self._seeds = list(seeds)
        self._fetch_names = list(fetch_names)
        self._run_forward = self.forward_session._sess.run_with_ort_values
        self._run_backward = self.backward_session._sess.run_with_ort_values


class _Head:
    """The first ``n`` values of a C OrtValueVector, keeping the vector alive (indexing
    returns references into it)."""

    def __init__(self, vector: Any, n: int) -> None:
        self.vector, self.n = vector, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.vector[i]


def run_forward(agent: SplitAgent, feeds: Sequence[Any]) -> tuple[Any, Any, Any]:
    """``(outputs, state, feeds)``: the forward on C OrtValues in ``agent.feed_names``
    order; the state (what the backward reads) must live until the matching backward."""
    try:
        values = agent._run_forward(
            dict(zip(agent.feed_names, feeds)), agent._forward_fetches, None
        )
    except Exception as exc:
        message = ort_engine.short_message(exc)
        raise RuntimeError(f"forward failed in onnxruntime: {message}") from exc
    state = (values, [feeds[i] for i in agent._fed])
    return _Head(values, agent.n_outputs), state, feeds


def run_backward(agent: SplitAgent, grad_outputs: Sequence[Any], state: Any) -> Any:
    """The gradients (a C OrtValueVector in the gradient graph's output order) for the
    gradients of the outputs, after the forward that made ``state``."""
    values, fed = state
    inputs = dict(zip(agent._seeds, grad_outputs))
    inputs.update((name, values[i]) for name, i in agent._kept)
    inputs.update(zip(agent._fed_names, fed))
    try:
        return agent._run_backward(inputs, agent._fetch_names, None)
    except Exception as exc:
        message = ort_engine.short_message(exc)
        raise RuntimeError(f"backward failed in onnxruntime: {message}") from exc


def values_vector(values: Sequence[Any]) -> list[Any]:
    """The values as a list (the native agent takes plain sequences)."""
    return list(values)


__all__ = ["SplitAgent", "run_backward", "run_forward", "values_vector"]
