"""An ONNX graph as a ``torch.nn.Module`` (needs the ``torch`` extra).

Forward and backward run through the backend's forward/backward runner (the
TrainingAgent of ``ort_training``) inside a
``torch.autograd.Function``; tensors cross through DLPack, without copies on CPU. The
graph's weights are ``torch.nn.Parameter``s, so ``torch.optim`` updates them::

    layer = OnnxModule(onx)                       # any ONNX graph with float weights
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), layer)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss = torch.nn.functional.mse_loss(model(X), y)
    loss.backward()
    optimizer.step()
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from graphkit.backends.base import Backend
from graphkit.engine import ort_engine as engine
from graphkit.errors import DTypeError, IncompatibleModelError, ShapeError
from graphkit.rewrite import set_weights
from graphkit.shapes import shape_matches, static_shape
from graphkit_train.engine.forward_backward import OrtGradientForwardBackward, PendingForward

_TORCH_TO_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}


def _to_ortvalue(tensor: torch.Tensor) -> Any:
    """A C OrtValue sharing ``tensor``'s memory (DLPack, no copy)."""
    return engine.from_dlpack(to_dlpack(tensor.detach().contiguous()), tensor.dtype == torch.bool)


def _to_tensor(value: Any) -> torch.Tensor:
    return from_dlpack(
        value._ortvalue.to_dlpack() if hasattr(value, "_ortvalue") else value.to_dlpack()
    )


class OnnxModule(torch.nn.Module):
    """An ONNX graph as a differentiable PyTorch layer.

    Args:
        onnx_model: the graph (ModelProto, bytes or path).
        weights_to_train: float initializers exposed as parameters (None: all).
        device: ``"cpu"`` or ``"cuda[:N]"`` (a CUDA build of onnxruntime).
        output_names: the outputs returned (None: the float outputs).
        backend: the gradient source (:func:`graphkit.backends.get`; None: the default).
        untie_shared_weights: one parameter per slot reading a shared initializer (see
            :func:`graphkit.parameters.untie_shared_parameters`).
        tie_weights: one parameter for weights torch ties (see
            :mod:`graphkit.tied_weights`).
        train_mode: False runs every BatchNormalization and Dropout in inference mode; a
            graph with layers in training mode (:mod:`graphkit.train_mode`) is refused.

    Parameter names are the weight names with characters PyTorch does not accept in
    attribute names replaced by ``_`` (``0.weight`` becomes ``0_weight``);
    :attr:`parameter_names` maps them back.
    """

    def __init__(
        self,
        onnx_model: Any,
        weights_to_train: Sequence[str] | None = None,
        device: str = "cpu",
        output_names: Sequence[str] | None = None,
        backend: str | Backend | None = None,
        untie_shared_weights: bool = True,
        tie_weights: bool = True,
        train_mode: bool | None = None,
    ) -> None:
        super().__init__()
        self.forward_backward = OrtGradientForwardBackward(
            onnx_model,
            weights_to_train,
            output_names=output_names,
            device=device,
            backend=backend,
            untie_shared_weights=untie_shared_weights,
            tie_weights=tie_weights,
            train_mode=train_mode,
        )
        fb = self.forward_backward
        if fb.trains_layers_in_training_mode:
            raise IncompatibleModelError(
                "OnnxModule does not run BatchNormalization or Dropout in training mode yet "
                "(graphkit.train_mode): pass train_mode=False to run every layer in inference "
                "mode, or train the graph with graphkit_train.Trainer or "
                "ForwardBackwardTrainer."
            )
        self._torch_device = torch.device(device)
        self.parameter_names: dict[str, str] = {}
        for name in fb.weight_names:
            attribute = re.sub(r"\W", "_", name)
            while attribute in self.parameter_names or hasattr(self, attribute):
                attribute = f"w_{attribute}"
            self.parameter_names[attribute] = name
            value = torch.from_numpy(fb.weights[name].numpy().copy()).to(self._torch_device)
            self.register_parameter(attribute, torch.nn.Parameter(value))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        fb = self.forward_backward
        if len(inputs) != len(fb.input_names):
            raise ValueError(
                f"The ONNX layer takes {len(fb.input_names)} inputs {fb.input_names}, "
                f"got {len(inputs)}."
            )
        for name, tensor in zip(fb.input_names, inputs):
            self._check(name, tensor, fb._input_values[name])
        params = [getattr(self, a) for a in self.parameter_names]
        outputs = _OnnxFunction.apply(self, len(inputs), *inputs, *params)
        return outputs[0] if len(outputs) == 1 else outputs

    def _check(self, name: str, tensor: torch.Tensor, expected: onnx.ValueInfoProto) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Input {name!r} must be a torch.Tensor, got {type(tensor).__name__}.")
        if tensor.device != self._torch_device:
            raise ValueError(
                f"Input {name!r} is on {tensor.device}, the ONNX layer runs on "
                f"{self._torch_device}: move it with .to({str(self._torch_device)!r})."
            )
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(expected.type.tensor_type.elem_type))
        if np.dtype(_TORCH_TO_NUMPY.get(tensor.dtype, object)) != dtype:
            raise DTypeError(f"Input {name!r} must be {dtype}, got {tensor.dtype}.")
        dims = static_shape(expected)
        if not shape_matches(dims, tuple(tensor.shape)):
            raise ShapeError(
                f"Input {name!r} has shape {tuple(tensor.shape)}; the graph expects {dims}."
            )

    def trained_model(self) -> onnx.ModelProto:
        """The ONNX graph with the current parameter values."""
        weights = {
            w: getattr(self, a).detach().cpu().numpy() for a, w in self.parameter_names.items()
        }
        return set_weights(self.forward_backward.trained_model(), weights)


class _OnnxFunction(torch.autograd.Function):
    """Forward and backward of an :class:`OnnxModule` through the TrainingAgent.

    The inputs and weights go through ``ctx.save_for_backward``: the backend's state reads
    their memory (DLPack shares it), so torch's version check must refuse a backward after
    one of them was modified in place, and torch's freeing of saved tensors is what makes a
    second backward without ``retain_graph`` raise its usual error.
    """

    @staticmethod
    def forward(
        ctx: Any, module: OnnxModule, n_inputs: int, *tensors: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        fb = module.forward_backward
        requiring = frozenset(
            name for i, name in enumerate(fb.input_names) if ctx.needs_input_grad[2 + i]
        )
        variant = fb._variant(requiring)
        pending = _run_forward(module, variant, n_inputs, tensors)
        ctx.save_for_backward(*tensors)
        ctx.pending, ctx.variant, ctx.module, ctx.n_inputs = pending, variant, module, n_inputs
        # backward reuses the memory of the forward outputs: clone them (on their device)
        return tuple(_to_tensor(o).clone() for o in pending.outputs)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        # first: raises if a saved tensor was freed (a second backward without
        # retain_graph) or modified in place since the forward
        tensors = ctx.saved_tensors
        if not torch.is_grad_enabled():  # the usual backward, without create_graph
            return (None, None, *_layer_gradients(ctx, grad_outputs, tensors))
        # create_graph: the gradients come out of a node of their own whose backward
        # refuses, linked to everything they depend on. (once_differentiable links its
        # error node to fresh leaves only, so autograd.grad(..., inputs=x) never reaches
        # it and silently drops this layer's second derivative.)
        n_grads = len(grad_outputs)
        return (None, None, *_NoSecondDerivative.apply(ctx, n_grads, *grad_outputs, *tensors))


class _NoSecondDerivative(torch.autograd.Function):
    """The gradients of an :class:`OnnxModule`, differentiable only into an error: the
    backend's gradient graph has no gradient of its own here."""

    @staticmethod
    def forward(
        ctx: Any, layer_ctx: Any, n_grads: int, *values: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        return tuple(_layer_gradients(layer_ctx, values[:n_grads], values[n_grads:]))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        raise RuntimeError(
            "OnnxModule has no second derivative: its gradients come from an ONNX gradient "
            "graph that is not differentiated again (create_graph=True reached the ONNX "
            "layer's backward, then a derivative of its result was requested)."
        )


def _layer_gradients(
    ctx: Any, grad_outputs: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]
) -> list[torch.Tensor | None]:
    """The gradients of the layer's inputs then weights (None for an input that asked for
    none), given those of its outputs and the saved inputs and weights."""
    module, pending = ctx.module, ctx.pending
    fb = module.forward_backward
    ctx.pending = None  # release the execution state: one backward consumes it
    if pending is None:
        # a second backward through a retained graph: onnxruntime-training's state
        # served the first one and cannot serve another, so run the forward again
        # (the graph is deterministic: a Dropout in training mode is refused)
        pending = _run_forward(module, ctx.variant, ctx.n_inputs, tensors)
    grads = fb.run_backward(pending, [_to_ortvalue(g) for g in grad_outputs])
    result: list[torch.Tensor | None] = []
    result += [_to_tensor(grads[n]) if n in grads else None for n in fb.input_names]
    result += [_to_tensor(grads[w]) for w in module.parameter_names.values()]
    return result


def _run_forward(
    module: OnnxModule, variant: Any, n_inputs: int, tensors: Sequence[torch.Tensor]
) -> PendingForward:
    """The training forward of ``variant`` on the layer's inputs then its weights."""
    fb = module.forward_backward
    by_name = dict(zip(fb.input_names, tensors[:n_inputs]))
    by_name.update(zip(module.parameter_names.values(), tensors[n_inputs:]))
    ordered = [by_name[n] for n in fb.feed_sources(variant)]
    pending = fb.run_forward(variant, [_to_ortvalue(t) for t in ordered])
    pending.keep_alive.append(ordered)  # the feeds share these tensors' memory
    return pending


__all__ = ["OnnxModule"]
