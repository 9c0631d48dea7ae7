"""The two protocols a backend implements: a gradient source and an engine.

A **gradient source** turns a prediction graph with a loss into gradient graphs:

* :meth:`GradientSource.prepare`: the rewrites it needs before differentiating;
* :meth:`GradientSource.gradient_graph`: the gradient of one output with respect to
  weights and inputs, as one graph (full training, :func:`graphkit.gradient_model`);
* :meth:`GradientSource.forward_backward_graphs`: a forward graph and a gradient graph
  (the ONNX graph as one layer of a larger model, :class:`ForwardBackwardGraphs`); the
  ``ort_training`` backend runs them with onnxruntime-training's TrainingAgent
  (``training_agent``, ``run_forward``, ``run_backward``, ``train_batch``);
* :meth:`GradientSource.to_standard`: its graphs in standard ONNX (``ai.onnx`` only),
  for the exports that run anywhere.

An **engine** runs graphs: sessions on a device, values on a device, bindings, DLPack.
Every onnxruntime build shares one engine (:mod:`graphkit.engine.ort_engine`).

A :class:`Backend` pairs the two under a name; :func:`graphkit.backends.get` chooses one.
The trainers, :class:`graphkit_train.torch_module.OnnxModule` and the exports talk to
these protocols only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import onnx


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

    def to_standard(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` with every operator this source emits rewritten in ``ai.onnx``."""
        ...

    constant_folds: Sequence[Callable[[onnx.ModelProto], bool]]
    """Folds of its own operators on constant inputs, for
    :func:`graphkit.static_shapes.specialize` (each changes the model in place and says
    whether it changed anything)."""


@runtime_checkable
class Engine(Protocol):
    """Sessions and values on a device."""

    def providers_for(self, device: str) -> tuple[list[Any], str, int]:
        """``(providers, device kind, device id)`` for ``"cpu"``, ``"cuda"``, ``"cuda:N"``."""
        ...

    def inference_session(
        self, model: onnx.ModelProto | bytes, providers: Sequence[Any], threads: Any = None
    ) -> Any:
        """A session running ``model`` (bound with IOBinding by the runtime)."""
        ...

    def ortvalue(self, array: np.ndarray, kind: str = "cpu", device_id: int = 0) -> Any:
        """A value holding ``array`` on the device."""
        ...


@dataclass(frozen=True)
class BackendInfo:
    """What :func:`graphkit.backends.available` reports for a registered backend."""

    name: str
    installed: bool
    install: str
    """the command that installs what the backend needs"""
    description: str
