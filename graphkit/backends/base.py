"""What a backend is: a gradient source, an engine and a forward/backward runner.

A **gradient source** turns a prediction graph with a loss into gradient graphs:

* :meth:`GradientSource.prepare`: the rewrites it needs before differentiating;
* :meth:`GradientSource.gradient_graph`: the gradient of one output with respect to
  weights and inputs, as one graph (full training, :func:`graphkit.gradient_model`);
* :meth:`GradientSource.forward_backward_graphs`: a forward graph and a gradient graph
  (the ONNX graph as one layer of a larger model, :class:`ForwardBackwardGraphs`); the
  runner (:class:`ForwardBackwardRunner`) runs them;
* :meth:`GradientSource.to_standard`: its graphs in standard ONNX (``ai.onnx`` only),
  for the exports that run anywhere.

An **engine** makes sessions on a device (values, bindings and DLPack are shared by every
onnxruntime build: :mod:`graphkit.engine.ort_engine`).

A **forward/backward runner** runs a forward/backward gradient graph as two calls, or one
batch with the loss and the update fused in (:class:`ForwardBackwardRunner`).

A :class:`Backend` is the three under a name, with its :attr:`Backend.ceiling` (the
newest IR version and opset it trains and writes); :func:`graphkit.backends.get`
chooses one.
The trainers, :class:`graphkit_train.torch_module.OnnxModule` and the exports use no
member of a backend that :class:`Backend` does not declare (``tests/test_backend.py``
trains with a fake backend that has exactly these members).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import onnx

from graphkit.compat import Ceiling


@dataclass
class ForwardBackwardGraphs:
    """A forward graph and the gradient graph that continues it, in the model's names.

    The gradient graph's inputs are the forward's feeds (and the inputs named in
    ``output_grad_inputs``); its outputs are the gradients named in
    ``user_input_grad_names`` (graph input -> its gradient) and
    ``initializer_grad_names_to_train`` (in the order of
    ``initializer_names_to_train``, the weights).
    """

    forward: onnx.ModelProto
    gradient: onnx.ModelProto
    user_output_names: list[str]
    user_input_grad_names: dict[str, str]
    initializer_names_to_train: list[str]
    initializer_grad_names_to_train: list[str]
    output_grad_inputs: dict[str, str] = field(default_factory=dict)
    """output -> the gradient graph's input that takes d loss / d output (the native
    backend's); empty where the runner takes them otherwise (onnxruntime-training's
    TrainingAgent, at its YieldOp)."""


@runtime_checkable
class GradientSource(Protocol):
    """Where gradient graphs come from."""

    @property
    def constant_folds(self) -> Sequence[Callable[[onnx.ModelProto], bool]]:
        """Folds of its own operators on constant inputs, for
        :func:`graphkit.static_shapes.specialize` (each changes the model in place and
        says whether it changed anything)."""
        ...

    def prepare(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` rewritten into the same function in operators this source
        differentiates (run once on a user's model, before any gradient)."""
        ...

    def gradient_graph(
        self, model: onnx.ModelProto, output: str, wrt: Sequence[str]
    ) -> onnx.ModelProto:
        """``model`` with ``<name>_grad`` = d ``output`` / d ``name`` added for ``wrt``.

        Raises:
            MissingGradientError: an operator on the path has no gradient rule.
        """
        ...

    def forward_backward_graphs(
        self, model: onnx.ModelProto, weights: Sequence[str], inputs: Sequence[str]
    ) -> ForwardBackwardGraphs:
        """The forward and gradient graphs of ``model`` for ``weights`` and ``inputs``."""
        ...

    def prepare_gradient(self, gradient: onnx.ModelProto) -> onnx.ModelProto:
        """A :meth:`forward_backward_graphs` gradient graph made runnable on this
        source's runtime (the same graph where nothing is needed)."""
        ...

    def to_standard(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` with every operator this source emits rewritten in ``ai.onnx``."""
        ...


@runtime_checkable
class Engine(Protocol):
    """Sessions on a device.

    Providers, values, bindings and DLPack are the same for every onnxruntime build
    (:mod:`graphkit.engine.ort_engine`); a backend's session is where it rewrites its
    graphs for a device (ort_training lowers its slow CPU gradient kernels there).
    """

    def inference_session(
        self, model: onnx.ModelProto | bytes, providers: Sequence[Any], threads: Any = None
    ) -> Any:
        """An onnxruntime session running ``model`` (bound with IOBinding by the runtime)."""
        ...


class FusedBatch(Protocol):
    """What :meth:`ForwardBackwardRunner.agent_step` returns: the gradient graph with the
    loss and the update spliced in."""

    model: onnx.ModelProto
    data: list[str]
    """Its inputs fed per batch: the features, the label[, the sample weight]."""


class FusedRun(Protocol):
    """One batch size's :class:`FusedBatch` on a session: a call trains on one batch."""

    def __call__(
        self,
        features: Sequence[np.ndarray],
        y: np.ndarray,
        w: np.ndarray | None,
        resident: list[Any],
        new: Any,
    ) -> None:
        """The features, labels (and sample weights) and the resident values (C
        OrtValues, in ``UpdateStep.resident`` order) in, the new resident values written
        into ``new`` (what :meth:`ForwardBackwardRunner.values_vector` made of the other
        buffer set)."""
        ...


@runtime_checkable
class ForwardBackwardRunner(Protocol):
    """Runs a :class:`ForwardBackwardGraphs` gradient graph as two calls (the ONNX graph
    as one layer of a larger model), or as one batch with the loss and update fused in."""

    def training_agent(
        self,
        gradient: onnx.ModelProto,
        providers: Sequence[Any],
        threads: Any,
        feed_names: Sequence[str],
        fetch_names: Sequence[str],
        output_names: Sequence[str],
        seeds: Sequence[str],
        device: Any,
    ) -> tuple[Any, Any]:
        """``(agent, what keeps it alive)`` running ``gradient`` on ``providers``:
        ``seeds`` are the gradient graph's inputs taking d loss / d output (empty where
        the agent takes them otherwise)."""
        ...

    def run_forward(self, agent: Any, feeds: Sequence[Any]) -> tuple[Any, Any, Any]:
        """``(outputs, state for the backward, what keeps the feeds alive)``."""
        ...

    def run_backward(self, agent: Any, grad_outputs: Sequence[Any], state: Any) -> Any:
        """The gradients of the weights and inputs, given d loss / d outputs."""
        ...

    def values_vector(self, values: Sequence[Any]) -> Any:
        """C OrtValues as the vector the agent and :class:`FusedRun` write into."""
        ...

    def agent_step(
        self,
        gradient: onnx.ModelProto,
        loss: onnx.ModelProto,
        update: Any,
        internal: dict[str, str],
        gradient_of: dict[str, str],
        features: Sequence[str],
        seeds: Mapping[str, str],
    ) -> FusedBatch:
        """The agent's ``gradient`` graph with ``loss`` and ``update`` (an
        :class:`graphkit.update_step.UpdateStep`) spliced in, for any number of rows."""
        ...

    @property
    def AgentRun(self) -> Callable[[onnx.ModelProto, Any, Any, np.dtype, Any], FusedRun]:  # noqa: N802 - a class in both backends
        """``AgentRun(model, session, fused batch, dtype, device)``: a :class:`FusedRun`."""
        ...


@runtime_checkable
class Backend(GradientSource, Engine, ForwardBackwardRunner, Protocol):
    """Everything the runtime asks of a backend: :func:`graphkit.backends.get` returns
    one, and every entry point takes one (or its name) as ``backend=``."""

    name: str
    description: str

    @property
    def ceiling(self) -> Ceiling:
        """The newest IR version and ``ai.onnx`` opset this backend trains and writes: a
        model given newer is converted down to it, one given older keeps its own
        (:func:`graphkit.compat.make_compatible`)."""
        ...


@dataclass(frozen=True)
class BackendInfo:
    """What :func:`graphkit.backends.available` reports for a registered backend."""

    name: str
    installed: bool
    install: str
    """the command that installs what the backend needs"""
    description: str
