"""The ``ort_training`` backend: gradients from onnxruntime-training 1.19.2's builders.

Everything graphkit knows about onnxruntime-training lives in this package:

* :mod:`.builders`: ``GradientGraphBuilder`` (one gradient graph) and
  ``OrtModuleGraphBuilder`` (a forward and a gradient graph), with the workarounds their
  quirks need;
* :mod:`.agent`: the TrainingAgent, which runs a gradient graph as a forward call and a
  backward call;
* :mod:`.agent_step`: the loss and the update spliced around the agent's ``YieldOp``
  (a forward/backward batch in two calls);
* :mod:`.rewrites`: forward operators its builders cannot differentiate as they are
  (LayerNorm's optional outputs, inference BatchNorm, AveragePool, CastLike, CumSum,
  and the activations Elu, Selu, PRelu, HardSigmoid, HardSwish, Softplus, Mish),
  rewritten;
* :mod:`.folding`: its ``BroadcastGradientArgs`` folded once shapes are static;
* :mod:`.lowering`: its ``com.microsoft`` gradient operators in standard ONNX, for the
  exports (all of them) and for CPU sessions (those whose kernels are slow).

Sessions, values and bindings are onnxruntime's shared engine
(:mod:`graphkit.engine.ort_engine`). Choose the backend with ``backend="ort_training"``
or :func:`graphkit.backends.get`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import onnx

from graphkit.backends.base import Backend
from graphkit.backends.onnxruntime_backend import OnnxruntimeBackend
from graphkit.backends.ort_training import (
    agent,
    agent_step,
    builders,
    folding,
    lowering,
    rewrites,
)
from graphkit.backends.ort_training.builders import ModuleGraphs
from graphkit.compat import PORTABLE
from graphkit.engine import ort_engine


class OrtTrainingBackend(OnnxruntimeBackend):
    """The gradient source and engine of onnxruntime-training 1.19.2.

    Implements :class:`graphkit.backends.base.Backend`: sessions are the shared
    engine's (:mod:`graphkit.engine.ort_engine`), forward/backward runs the TrainingAgent.
    """

    name = "ort_training"
    description = "gradients from onnxruntime-training 1.19.2's builders, run by its TrainingAgent"
    builds_for = PORTABLE  # what its builders and the TrainingAgent load

    # -- gradient source --------------------------------------------------------------

    def prepare(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return rewrites.prepare(model)

    def gradient_graph(
        self, model: onnx.ModelProto, output: str, wrt: Sequence[str]
    ) -> onnx.ModelProto:
        # the rewrites first, so that a custom loss using Softplus has its gradient too
        # (on a prepared model they find nothing left to rewrite)
        return builders.gradient_graph(rewrites.prepare(model), output, wrt)

    def forward_backward_graphs(
        self, model: onnx.ModelProto, weights: Sequence[str], inputs: Sequence[str]
    ) -> ModuleGraphs:
        return builders.module_graphs(model, weights, inputs)

    # its shape operator, evaluated by graphkit.static_shapes.specialize on static shapes
    constant_folds = (folding.fold_broadcast_gradient_args,)

    def to_standard(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return lowering.lower_to_standard(model)

    def prepare_gradient(self, gradient: onnx.ModelProto) -> onnx.ModelProto:
        """A forward/backward gradient graph made runnable: float64 graphs get the
        operators this build implements for float32 only rewritten."""
        if ort_engine.is_float64(gradient):
            lowering.lower_float32_only_ops(gradient)
        return gradient

    # -- engine -------------------------------------------------------------------------

    def inference_session(
        self,
        model: onnx.ModelProto | bytes,
        providers: Sequence[ort_engine.Provider] = ort_engine.CPU,
        threads: ort_engine.Threads | None = None,
    ) -> Any:
        """An engine session; on the CPU, a ModelProto runs with the gradient operators
        whose CPU kernels are slow lowered (:func:`.lowering.lower_slow_cpu_ops`)."""
        if isinstance(model, onnx.ModelProto) and tuple(providers) == ort_engine.CPU:
            model = lowering.lower_slow_cpu_ops(model)
        return ort_engine.inference_session(model, providers, threads)

    # -- the TrainingAgent ----------------------------------------------------------------

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
        """``(agent, session)``: a TrainingAgent over a session of a
        :func:`.builders.module_graphs` gradient graph (the gradients of the outputs come
        in at its YieldOp: ``seeds`` is empty); keep the session alive with the agent."""
        session = self.inference_session(gradient, providers, threads)
        made = agent.training_agent(session, feed_names, fetch_names, len(output_names), device)
        return made, session

    run_forward = staticmethod(agent.run_forward)
    run_backward = staticmethod(agent.run_backward)
    values_vector = staticmethod(agent.values_vector)

    # the loss and the update spliced around the agent's yield: a forward/backward batch
    # in two calls (see :mod:`.agent_step`)
    AgentRun = agent_step.AgentRun
    agent_step = staticmethod(agent_step.agent_step)  # (last: it shadows the module here)


BACKEND: Backend = OrtTrainingBackend()

__all__ = ["BACKEND", "ModuleGraphs", "OrtTrainingBackend"]
