"""The ``native`` backend: standard-ONNX gradients, run by any onnxruntime.

Its gradient graphs hold ``ai.onnx`` operators only, so they run on the plain
onnxruntime wheels (every Python onnxruntime supports, CPU and CUDA), on
``onnx.reference`` and on any other ONNX runtime; onnxruntime-training is not needed.

* the gradients come from onnx-ad's reverse-mode rules, behind one adapter
  (:mod:`.adapter`);
* forward/backward training splits the gradient graph in two (:mod:`.split`): a forward
  graph that also outputs what the backward reads, and a backward graph that takes them,
  run by :mod:`.agent` with two plain sessions;
* sessions, values and bindings are onnxruntime's shared engine
  (:mod:`graphkit.engine.ort_engine`).

Choose it with ``backend="native"`` or :func:`graphkit.backends.get`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx

from graphkit.backends import activations
from graphkit.backends.base import Backend, ForwardBackwardGraphs
from graphkit.backends.native import adapter, agent, fused_step, simplify, split
from graphkit.backends.onnxruntime_backend import OnnxruntimeBackend
from graphkit.engine import ort_engine


class NativeBackend(OnnxruntimeBackend):
    """Standard-ONNX gradients (onnx-ad) run by onnxruntime's shared engine.

    Implements :class:`graphkit.backends.base.Backend`: sessions, standard graphs and
    the gradient graphs run as they are come from :class:`OnnxruntimeBackend`;
    forward/backward runs two sessions.
    """

    name = "native"
    description = "standard-ONNX gradients (onnx-ad rules), run by plain onnxruntime"

    # -- gradient source --------------------------------------------------------------

    def prepare(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model``, and for a float64 model on an onnxruntime older than 1.30, with its
        activations without a float64 kernel there written out
        (:mod:`graphkit.backends.activations`)."""
        if ort_engine.is_float64(model) and ort_engine.lacks_float64_kernels():
            present = {n.op_type for n in model.graph.node}
            if present & set(activations.ACTIVATIONS):
                return activations.activations_as_standard_ops(model)
        return model

    def gradient_graph(
        self, model: onnx.ModelProto, output: str, wrt: Sequence[str]
    ) -> onnx.ModelProto:
        return adapter.gradient_graph(model, output, wrt)

    def forward_backward_graphs(
        self, model: onnx.ModelProto, weights: Sequence[str], inputs: Sequence[str]
    ) -> ForwardBackwardGraphs:
        return split.forward_backward_graphs(model, weights, inputs)

    # its layout plumbing (the seed axis), removed once shapes are static
    constant_folds = (simplify.simplify,)

    # -- forward/backward: two sessions (see :mod:`.agent`) -------------------------------

    def training_agent(
        self,
        gradient: onnx.ModelProto,
        providers: Sequence[ort_engine.Provider],
        threads: ort_engine.Threads | None,
        feed_names: Sequence[str],
        fetch_names: Sequence[str],
        output_names: Sequence[str],
        seeds: Sequence[str],
        device: Any,
    ) -> tuple[Any, Any]:
        """``(agent, None)``: the vector-Jacobian graph ``gradient`` cut into a forward
        and a backward session."""

        # the forward and the backward are two sessions with a pool each: a pool that
        # spins after its run takes the cores the other session's kernels need (MLP
        # 784-512-512-10 at batch 128 on 2 cores: 7.9 ms a batch spinning, 3.x without)
        quiet = ort_engine.Threads(
            threads.intra_op if threads else None,
            threads.mode if threads else "sequential",
            spinning=False,
        )

        def session(model: onnx.ModelProto) -> Any:
            return self.inference_session(model, providers, quiet)

        made = agent.SplitAgent(gradient, session, feed_names, fetch_names, output_names, seeds)
        return made, None

    run_forward = staticmethod(agent.run_forward)
    run_backward = staticmethod(agent.run_backward)
    values_vector = staticmethod(agent.values_vector)

    # a forward/backward trainer's batch with the loss and the update fused in: one
    # session call (see :mod:`.fused_step`)
    AgentRun = fused_step.FusedRun
    agent_step = staticmethod(fused_step.fused_step)


BACKEND: Backend = NativeBackend()

__all__ = ["BACKEND", "NativeBackend"]
