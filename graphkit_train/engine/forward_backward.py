"""Forward/backward through an ONNX graph: two calls, the backend's TrainingAgent.

:class:`OrtGradientForwardBackward` is the low-level piece of forward/backward (partial)
training: the ONNX graph is one layer of a larger model. ``forward`` computes the
outputs and keeps what ``backward`` needs; ``backward`` takes the gradient of the loss
with respect to the outputs and returns the gradients with respect to the weights (and
to the inputs that asked for one)::

    fb = OrtGradientForwardBackward(onx, ["coef", "intercept"])
    (y,) = fb.forward([X])                      # OrtValues
    grads = fb.backward([dloss_dy])             # {"coef": OrtValue, "intercept": ...}

The forward and gradient graphs come from the backend's gradient source
(:meth:`graphkit.backends.base.GradientSource.forward_backward_graphs`), in the model's
own names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from graphkit import backends, tensor_store
from graphkit.backends.base import Backend
from graphkit.compat import load_model
from graphkit.engine import ort_engine as engine
from graphkit.engine.ort_engine import Threads, binding_outputs  # noqa: F401 - re-exported
from graphkit.errors import DTypeError, ShapeError, UnknownNameError
from graphkit.gradient import check_reachable, reaching
from graphkit.prepare import prepare_for_training
from graphkit.rewrite import initializers_to_inputs, keep_outputs, set_weights, weight_values
from graphkit.shapes import shape_matches, static_shape
from graphkit.train_mode import TrainingForm, training_form
from graphkit.training.specialized import for_rows
from graphkit.update_step import STEP

_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)


@dataclass
class _Variant:
    """The graphs built for one set of inputs requiring gradients (and one number of
    rows, or any)."""

    gradient_model: onnx.ModelProto
    forward_model: onnx.ModelProto
    agent: Any
    session: Any  # what the agent runs, kept alive with it (None for the native agent)
    forward_session: Any  # inference only: the forward graph with weights as inputs (None
    # in a variant specialized to a number of rows)
    feed_names: list[str]
    fetch_names: list[str]
    grad_of: dict[str, str]  # fetch name -> original input or weight name
    n_outputs: int  # the forward's outputs
    seeds: dict[str, str]  # output -> the gradient graph's input for d loss / d output


@dataclass
class PendingForward:
    """What one training forward left for its backward."""

    variant: _Variant
    state: Any
    outputs: list[Any]
    keep_alive: list[Any] = field(repr=False)


class OrtGradientForwardBackward:
    """Forward and backward passes of an ONNX graph, for any training framework.

    Args:
        onnx_model: the graph (ModelProto, bytes or path).
        weights_to_train: float initializers to differentiate (None: the model's
            parameters, never its constants; see :mod:`graphkit.parameters`).
        input_names: the graph inputs fed to ``forward``, in order (None: all
            non-initializer inputs in graph order).
        output_names: the outputs ``forward`` returns, in order (None: the float outputs).
        providers: onnxruntime providers, names or ``(name, options)`` pairs (None: from
            ``device``; CUDA computes float32 in float32, see ``ort_engine.CUDA_OPTIONS``).
        threads: the sessions' thread settings (:class:`graphkit.engine.ort_engine.Threads`).
        backend: the gradient source and its runner (:func:`graphkit.backends.get`;
            None: the default).
        untie_shared_weights: give each parameter slot reading a shared initializer a
            weight of its own (see :func:`graphkit.parameters.untie_shared_parameters`).
        tie_weights: train weights torch ties as one (see :mod:`graphkit.tied_weights`).
        train_mode: which BatchNormalization and Dropout layers train in training mode
            (:mod:`graphkit.train_mode`): None, those exported so; True, all; False, none.
            A training ``forward`` then normalizes with the batch's statistics and updates
            :attr:`buffers`; ``forward(training=False)`` uses the running statistics.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        inputs_requiring_grad: inputs whose gradient ``backward`` returns by default.

    Attributes:
        weights: ``{name: OrtValue}``, the current weight values ``forward`` uses when it
            is given none.
        buffers: ``{name: OrtValue}``, the running statistics of the layers in training
            mode, the step counter and the seed of their Dropout masks (empty when none).
    """

    def __init__(
        self,
        onnx_model: Any,
        weights_to_train: Sequence[str] | None = None,
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        providers: Sequence[str | tuple[str, dict[str, str]]] | None = None,
        device: str = "cpu",
        inputs_requiring_grad: Iterable[str] = (),
        threads: Threads | None = None,
        backend: str | Backend | None = None,
        untie_shared_weights: bool = True,
        tie_weights: bool = True,
        train_mode: bool | None = None,
    ) -> None:
        self.backend = backends.get(backend)
        model, self.weight_names = prepare_for_training(
            load_model(onnx_model),
            weights_to_train,
            self.backend,
            untie_shared_weights,
            tie_weights=tie_weights,
            train_mode=train_mode,
        )
        initializers = {i.name for i in model.graph.initializer}
        graph_inputs = [i.name for i in model.graph.input if i.name not in initializers]
        self.input_names = list(graph_inputs if input_names is None else input_names)
        if sorted(self.input_names) != sorted(graph_inputs):
            raise UnknownNameError(
                f"input_names must list the graph inputs {graph_inputs} (in any order), "
                f"got {self.input_names}."
            )
        float_outputs = [
            o.name for o in model.graph.output if o.type.tensor_type.elem_type in _FLOATS
        ]
        self.output_names = list(float_outputs if output_names is None else output_names)
        unknown = [o for o in self.output_names if o not in [v.name for v in model.graph.output]]
        if unknown or not self.output_names:
            raise UnknownNameError(
                f"output_names {unknown or '[]'} are not outputs; outputs: "
                f"{[o.name for o in model.graph.output]}."
            )
        device_providers, self._ort_device, self._device_id = engine.providers_for(device)
        self.device = device
        self.providers = list(providers or device_providers)
        self.threads = threads
        self.inputs_requiring_grad = frozenset(inputs_requiring_grad)
        self._check_requiring(self.inputs_requiring_grad)
        self._model = self._prepare(model)
        if weights_to_train is None:  # the parameters of another output's head stay put
            self.weight_names = reaching(self._model, self.weight_names, self.output_names)
        self._input_values = {i.name: i for i in model.graph.input}
        self._variants: dict[tuple[frozenset[str], int | None], _Variant] = {}
        self._pending: list[PendingForward] = []
        values = weight_values(model, self.weight_names)
        self.weights = {w: self.to_ortvalue(values[w]) for w in self.weight_names}
        self._layers_in_training_mode(training_form(self._model, STEP))

    # -- training mode (graphkit.train_mode) --------------------------------------------

    def _layers_in_training_mode(self, form: TrainingForm) -> None:
        """Where BatchNormalization or Dropout layers train in training mode, the graphs
        the gradient source differentiates are ``form``'s (running statistics as inputs,
        their updates as outputs after ``output_names``), and :attr:`buffers` holds the
        running statistics, the step counter and the masks' seed; predictions run the
        inference form, the running statistics as inputs."""
        self.buffer_names: list[str] = list(form.buffers)
        self.buffer_outputs: list[str] = [form.buffers[b] for b in self.buffer_names]
        self.buffers: dict[str, Any] = {}
        self._training_model: onnx.ModelProto | None = None
        self._inference: Any = None
        if not form.buffers and form.seed is None:
            return
        self._training_model = initializers_to_inputs(form.model, self.buffer_names)
        values = weight_values(self._model, self.buffer_names)
        self.buffers = {b: self.to_ortvalue(np.array(values[b])) for b in self.buffer_names}
        if form.seed is not None:
            self.buffers[STEP] = self.to_ortvalue(np.array(0, np.int64))
            self.buffers[form.seed] = self.to_ortvalue(np.array(0, np.int64))

    @property
    def trains_layers_in_training_mode(self) -> bool:
        """Whether a BatchNormalization or a Dropout of the graph trains in training
        mode (:mod:`graphkit.train_mode`)."""
        return self._training_model is not None

    def inference_session(self) -> Any:
        """The inference form, its weights and running statistics as inputs (built once)."""
        if self._inference is None:
            model = initializers_to_inputs(self._model, [*self.weight_names, *self.buffer_names])
            self._inference = self.backend.inference_session(model, self.providers, self.threads)
        return self._inference

    # -- building ----------------------------------------------------------------------

    def _prepare(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """Outputs restricted to ``output_names``, and what they do not need dropped."""
        return keep_outputs(model, self.output_names)

    def _check_requiring(self, names: Iterable[str]) -> None:
        unknown = sorted(set(names) - set(self.input_names))
        if unknown:
            raise UnknownNameError(f"Inputs {unknown} do not exist; inputs: {self.input_names}.")

    def _variant(self, requiring: frozenset[str], rows: int | None = None) -> _Variant:
        """The graphs for the inputs in ``requiring``; with ``rows``, specialized to
        inputs of that many rows (see :func:`graphkit.training.specialized.for_rows`: the
        shape arithmetic folds away and bias gradients become MatMuls)."""
        key = (requiring, rows)
        if key not in self._variants:
            self._check_requiring(requiring)
            self._variants[key] = self._build_variant(requiring, rows)
        return self._variants[key]

    def _build_variant(self, requiring: frozenset[str], rows: int | None) -> _Variant:
        if rows is not None:  # the graphs for any number of rows, specialized
            base = self._variant(requiring)
            folds = self.backend.constant_folds
            gradient = for_rows(base.gradient_model, self.input_names, rows, folds)
            return self._with_agent(gradient, base.forward_model, None, base.grad_of, base.seeds)
        inputs = [n for n in self.input_names if n in requiring]
        model = self._model if self._training_model is None else self._training_model
        check_reachable(model, [*self.weight_names, *inputs], self.output_names)
        # mapped weights (graphkit.tensor_store) are read-only inputs to the gradient source
        lifted, stored = tensor_store.stored_as_inputs(model, self.weight_names)
        graphs = self.backend.forward_backward_graphs(lifted, self.weight_names, inputs)
        gradient = self.backend.prepare_gradient(
            tensor_store.stored_as_initializers(graphs.gradient, stored)
        )
        forward = tensor_store.stored_as_initializers(graphs.forward, stored)
        grad_of = {g: n for n, g in graphs.user_input_grad_names.items()}
        grad_of.update(
            zip(graphs.initializer_grad_names_to_train, graphs.initializer_names_to_train)
        )
        forward_session = self.backend.inference_session(forward, self.providers, self.threads)
        seeds = dict(graphs.output_grad_inputs)
        return self._with_agent(gradient, forward, forward_session, grad_of, seeds)

    def _with_agent(
        self,
        gradient: onnx.ModelProto,
        forward: onnx.ModelProto,
        forward_session: Any,
        grad_of: dict[str, str],
        seeds: dict[str, str],
    ) -> _Variant:
        """A variant whose TrainingAgent (the backend's runner) runs ``gradient``."""
        seed_inputs = set(seeds.values())
        feed_names = [i.name for i in gradient.graph.input if i.name not in seed_inputs]
        # the gradients (a native gradient graph also outputs the layer's outputs, and
        # the updated running statistics of layers in training mode)
        forward_outputs = [*self.output_names, *self.buffer_outputs]
        outputs = set(forward_outputs)
        fetch_names = [o.name for o in gradient.graph.output if o.name not in outputs]
        device = engine.ort_device(self._ort_device, self._device_id)
        agent, session = self.backend.training_agent(
            gradient,
            self.providers,
            self.threads,
            feed_names,
            fetch_names,
            forward_outputs,
            [seeds[o] for o in forward_outputs] if seeds else [],
            device,
        )
        n_outputs = len(self.output_names)
        return _Variant(
            gradient,
            forward,
            agent,
            session,
            forward_session,
            feed_names,
            fetch_names,
            grad_of,
            n_outputs,
            seeds,
        )

    # -- values ------------------------------------------------------------------------

    def to_ortvalue(self, value: Any) -> Any:
        """An ``onnxruntime.OrtValue`` on this device from a numpy array (or itself)."""
        if engine.is_ortvalue(value):
            return value
        return engine.ortvalue(np.asarray(value), self._ort_device, self._device_id)

    def _check_value(self, name: str, value: Any, expected: onnx.ValueInfoProto) -> None:
        elem = expected.type.tensor_type.elem_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem))
        got = np.dtype(value.dtype) if hasattr(value, "dtype") else None
        shape = (
            tuple(value.shape()) if callable(getattr(value, "shape", None)) else tuple(value.shape)
        )
        if got is None:  # an OrtValue: its element type is a string like 'tensor(float)'
            got_type = value.data_type()
            if got_type != f"tensor({_ORT_TYPE[dtype]})":
                raise DTypeError(f"{name!r} must be {dtype}, got {got_type}.")
        elif got != dtype:
            raise DTypeError(
                f"{name!r} must be {dtype}, got {got}; cast it with .astype(numpy.{dtype})."
            )
        dims = static_shape(expected)
        if not shape_matches(dims, shape):
            raise ShapeError(f"{name!r} has shape {shape}; the graph expects {dims}.")

    def _feeds(self, inputs: Any, weights: Mapping[str, Any] | None) -> dict[str, Any]:
        if isinstance(inputs, Mapping):
            missing = sorted(set(self.input_names) - set(inputs))
            extra = sorted(set(inputs) - set(self.input_names))
            if missing or extra:
                raise ValueError(
                    f"forward needs inputs {self.input_names}; missing {missing}, unknown {extra}."
                )
            named = dict(inputs)
        else:
            inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
            if len(inputs) != len(self.input_names):
                raise ValueError(
                    f"forward got {len(inputs)} inputs; the graph takes {len(self.input_names)}: "
                    f"{self.input_names}."
                )
            named = dict(zip(self.input_names, inputs))
        feeds = {}
        for name, value in named.items():
            self._check_value(name, value, self._input_values[name])
            feeds[name] = self.to_ortvalue(value)
        given = dict(self.weights)
        if weights is not None:
            unknown = sorted(set(weights) - set(self.weight_names))
            if unknown:
                raise UnknownNameError(
                    f"Weights {unknown} are not trained weights of the graph; they are "
                    f"{self.weight_names}."
                )
            given.update({k: self.to_ortvalue(v) for k, v in weights.items()})
        for name, value in given.items():
            feeds[name] = value
        feeds.update(self.buffers)  # running statistics, step counter, masks' seed
        return feeds

    # -- forward and backward ------------------------------------------------------------

    def forward(
        self,
        inputs: Any,
        training: bool = True,
        weights: Mapping[str, Any] | None = None,
        inputs_requiring_grad: Iterable[str] | None = None,
    ) -> list[Any]:
        """The outputs (OrtValues, in ``output_names`` order).

        Args:
            inputs: arrays or OrtValues, a list in ``input_names`` order or a dict.
            training: keep what ``backward`` needs (pushed on a stack, so several
                forwards may come before their backwards); False runs inference only.
            weights: values to use instead of :attr:`weights` for some weights.
            inputs_requiring_grad: override the constructor's choice for this call.
        """
        feeds = self._feeds(inputs, weights)
        requiring = (
            self.inputs_requiring_grad
            if inputs_requiring_grad is None
            else frozenset(inputs_requiring_grad)
        )
        if not training and self.trains_layers_in_training_mode:
            session = self.inference_session()
            wanted = {i.name for i in session.get_inputs()}
            return session.run_with_ort_values(
                self.output_names, {n: v for n, v in feeds.items() if n in wanted}
            )
        variant = self._variant(requiring)
        if not training:
            session = variant.forward_session
            names = [o.name for o in session.get_outputs()]
            return session.run_with_ort_values(names, feeds)
        pending = self.run_forward(variant, [feeds[n]._ortvalue for n in variant.feed_names])
        pending.keep_alive.append(feeds)
        self._pending.append(pending)
        # backward reuses the memory of the forward outputs: hand out copies
        copies = [self.to_ortvalue(np.array(o.numpy(), copy=True)) for o in pending.outputs]
        if self.trains_layers_in_training_mode:
            self.advance(copies[len(self.output_names) :])
        return copies[: len(self.output_names)]

    def advance(self, updated: Sequence[Any]) -> None:
        """After a training forward: the running statistics become ``updated`` (the
        forward's values of :attr:`buffer_outputs`, copied out of its memory), and the step
        counter the Dropout masks read moves on."""
        for name, value in zip(self.buffer_names, updated):
            self.buffers[name] = self.to_ortvalue(value)
        if STEP in self.buffers:
            step = int(self.buffers[STEP].numpy()) + 1
            self.buffers[STEP] = self.to_ortvalue(np.array(step, np.int64))

    def zeros_like(self, values: Sequence[Any]) -> list[Any]:
        """Zeros shaped as ``values`` (OrtValues): the gradients of the running
        statistics a training forward outputs beside ``output_names`` (nothing is
        differentiated through them)."""
        return [self.to_ortvalue(np.zeros(tuple(v.shape()), _NUMPY[v.data_type()])) for v in values]

    def run_forward(self, variant: _Variant, feeds: list[Any]) -> PendingForward:
        """Forward on C OrtValues in ``variant.feed_names`` order, returning the state
        explicitly (the trainer and the PyTorch bridge keep it themselves).

        The outputs live in memory the matching backward reuses: read or copy them first.
        """
        fetches, state, vector = self.backend.run_forward(variant.agent, feeds)
        outputs = engine.wrap(fetches)
        return PendingForward(variant, state, outputs, keep_alive=[feeds, vector])

    def backward(self, grad_outputs: Sequence[Any]) -> dict[str, Any]:
        """Gradients of the weights (and of the inputs requiring one) given the gradient
        of the loss with respect to each output; for the most recent pending forward.

        Returns:
            ``{input or weight name: OrtValue}``.
        """
        if not self._pending:
            raise RuntimeError(
                "backward() without a pending forward(): call forward(inputs, training=True) first."
            )
        pending = self._pending[-1]
        grads = self._check_grad_outputs(pending, grad_outputs)
        grads += self.zeros_like(pending.outputs[len(self.output_names) :])
        self._pending.pop()
        return self.run_backward(pending, [g._ortvalue for g in grads])

    def _check_grad_outputs(
        self, pending: PendingForward, grad_outputs: Sequence[Any]
    ) -> list[Any]:
        grad_outputs = (
            list(grad_outputs) if isinstance(grad_outputs, (list, tuple)) else [grad_outputs]
        )
        if len(grad_outputs) != len(self.output_names):
            raise ValueError(
                f"backward got {len(grad_outputs)} gradients for {len(self.output_names)} "
                f"outputs {self.output_names}."
            )
        values = []
        for name, grad, output in zip(self.output_names, grad_outputs, pending.outputs):
            value = self.to_ortvalue(grad)
            if tuple(value.shape()) != tuple(output.shape()):
                raise ShapeError(
                    f"The gradient of output {name!r} has shape {tuple(value.shape())}; the "
                    f"output has shape {tuple(output.shape())}."
                )
            if value.data_type() != output.data_type():
                raise DTypeError(
                    f"The gradient of output {name!r} is {value.data_type()}, the output "
                    f"{output.data_type()}."
                )
            values.append(value)
        return values

    def run_backward(self, pending: PendingForward, grad_outputs: list[Any]) -> dict[str, Any]:
        """Backward on C OrtValues for an explicit pending forward."""
        fetches = self.backend.run_backward(pending.variant.agent, grad_outputs, pending.state)
        names = pending.variant.fetch_names
        return {pending.variant.grad_of[n]: value for n, value in zip(names, engine.wrap(fetches))}

    def feed_sources(self, variant: _Variant) -> list[str]:
        """The input or weight name each feed of ``variant`` takes, in feed order."""
        return list(variant.feed_names)

    @property
    def pending(self) -> int:
        """Number of training forwards waiting for their backward."""
        return len(self._pending)

    def trained_model(self) -> onnx.ModelProto:
        """The original graph (restricted to ``output_names``) with the current weights."""
        values = {n: v.numpy() for n, v in self.weights.items()}
        values.update({b: self.buffers[b].numpy() for b in self.buffer_names})
        return set_weights(self._model, values)


_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
}

_ORT_TYPE = {
    np.dtype(np.float32): "float",
    np.dtype(np.float64): "double",
    np.dtype(np.float16): "float16",
    np.dtype(np.int64): "int64",
    np.dtype(np.int32): "int32",
    np.dtype(np.bool_): "bool",
}


__all__ = ["OrtGradientForwardBackward", "PendingForward", "binding_outputs"]
