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
from graphkit.errors import DTypeError, ShapeError
from graphkit.rewrite import set_weights
from graphkit.shapes import shape_matches, static_shape
from graphkit.train_mode import DROPOUT_SEED
from graphkit.update_step import STEP
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


SPECIALIZED_SIZES = 4
"""How many batch sizes an :class:`OnnxModule` compiles graphs of their own for (a
training run's batch and its last, shorter one); other sizes run the graphs of any size."""


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
        train_mode: which BatchNormalization and Dropout layers run as torch's
            ``train()`` runs them (:mod:`graphkit.train_mode`): None, those the graph was
            exported so; True, all; False, none.

    Parameter names are the weight names with characters PyTorch does not accept in
    attribute names replaced by ``_`` (``0.weight`` becomes ``0_weight``);
    :attr:`parameter_names` maps them back.

    Layers in training mode follow the module's own ``train()`` / ``eval()``, as torch's
    do. In ``train()`` a forward normalizes with the batch's statistics, updates the
    running statistics (torch buffers under the graph's names, :attr:`buffer_names`, in
    ``state_dict``) and draws Dropout masks from graphkit's stream
    (:func:`graphkit.train_mode.uniform_stream`: the seed is drawn from torch's generator
    when the module is made, the step counts training forwards; both are buffers too). In
    ``eval()`` it uses the running statistics and no Dropout; gradients are not taken
    there (make the module with ``train_mode=False`` to train in the inference form).
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
        self._torch_device = torch.device(device)
        self.parameter_names: dict[str, str] = {}
        for name in fb.weight_names:
            attribute = self._attribute(name)
            self.parameter_names[attribute] = name
            value = torch.from_numpy(fb.weights[name].numpy().copy()).to(self._torch_device)
            self.register_parameter(attribute, torch.nn.Parameter(value))
        self._specialized: set[int] = set()  # the row counts with graphs of their own
        self._batched = all(_symbolic_batch(fb._input_values[n]) for n in fb.input_names)
        # layers in training mode: running statistics, step counter, the masks' seed
        self.buffer_names: dict[str, str] = {}
        for name, ortvalue in fb.buffers.items():
            attribute = self._attribute(name)
            self.buffer_names[attribute] = name
            value = torch.from_numpy(np.array(ortvalue.numpy(), copy=True))
            if name == DROPOUT_SEED:  # torch.manual_seed makes the masks reproducible
                value = torch.randint(0, 2**31 - 1, (), dtype=torch.int64)
            self.register_buffer(attribute, value.to(self._torch_device))

    def _attribute(self, name: str) -> str:
        """``name`` as an attribute torch accepts, unused so far."""
        attribute = re.sub(r"\W", "_", name)
        while attribute in self.parameter_names or hasattr(self, attribute):
            attribute = f"w_{attribute}"
        return attribute

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
        if fb.trains_layers_in_training_mode and not self.training:
            outputs = self._inference(inputs, params)
        else:
            outputs = _OnnxFunction.apply(self, len(inputs), *inputs, *params)
        return outputs[0] if len(outputs) == 1 else outputs

    def _rows(self, inputs: Sequence[torch.Tensor]) -> int | None:
        """The batch's row count, to run graphs specialized to it (as the trainers run
        their batches: the shape arithmetic folds away, a 28x28 CNN in training mode
        steps in half the time), or None for the graphs of any size: where an input's
        first dimension is not a symbolic batch, the inputs' row counts differ, or
        :data:`SPECIALIZED_SIZES` sizes have graphs already."""
        rows = {int(t.shape[0]) if t.dim() else -1 for t in inputs}
        if not self._batched or len(rows) != 1 or -1 in rows:
            return None
        (count,) = rows
        if count not in self._specialized and len(self._specialized) >= SPECIALIZED_SIZES:
            return None
        self._specialized.add(count)
        return count

    def buffer_values(self) -> dict[str, torch.Tensor]:
        """The layers' buffers by their graph names (running statistics, the step
        counter and the masks' seed)."""
        return {name: getattr(self, a) for a, name in self.buffer_names.items()}

    def _inference(
        self, inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, ...]:
        """``eval()`` of a graph with layers in training mode: the inference form, on the
        running statistics, without gradients."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*inputs, *params)):
            raise RuntimeError(
                "OnnxModule in eval() takes no gradient through its BatchNormalization and "
                "Dropout layers in training mode: call .train() to train them as torch's "
                "train() does, run eval() under torch.no_grad(), or make the module with "
                "train_mode=False to train it in inference mode."
            )
        fb = self.forward_backward
        session = fb.inference_session()
        by_name = dict(zip(fb.input_names, inputs))
        by_name.update(zip(self.parameter_names.values(), params))
        by_name.update(self.buffer_values())
        wanted = [i.name for i in session.get_inputs()]
        feeds = engine.wrap([_to_ortvalue(by_name[n]) for n in wanted])
        results = session.run_with_ort_values(fb.output_names, dict(zip(wanted, feeds)))
        return tuple(_to_tensor(r).clone() for r in results)

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
        """The ONNX graph with the current parameter values (and running statistics)."""
        values = {
            w: getattr(self, a).detach().cpu().numpy() for a, w in self.parameter_names.items()
        }
        statistics = self.forward_backward.buffer_names
        values.update({n: getattr(self, a).cpu().numpy() for a, n in self.buffer_names.items()
                       if n in statistics})  # fmt: skip
        return set_weights(self.forward_backward.trained_model(), values)


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
        variant = fb._variant(requiring, module._rows(tensors[:n_inputs]))
        # the buffers as this forward read them, for a second backward's forward
        buffers = {n: b.clone() for n, b in module.buffer_values().items()}
        pending = _run_forward(module, variant, n_inputs, tensors, buffers)
        ctx.save_for_backward(*tensors)
        ctx.pending, ctx.variant, ctx.module, ctx.n_inputs = pending, variant, module, n_inputs
        ctx.buffers = buffers
        # backward reuses the memory of the forward outputs: clone them (on their device)
        outputs = [_to_tensor(o).clone() for o in pending.outputs]
        n_outputs = len(fb.output_names)
        if buffers:  # the running statistics move on, and the masks' step
            _advance(module, outputs[n_outputs:])
        return tuple(outputs[:n_outputs])

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
        # served the first one and cannot serve another, so run the forward again on
        # the buffers the first one read (the same batch statistics and masks)
        pending = _run_forward(module, ctx.variant, ctx.n_inputs, tensors, ctx.buffers)
    seeds = [_to_ortvalue(g) for g in grad_outputs]
    # the running statistics' updates are outputs too: nothing is differentiated through
    seeds += [o._ortvalue for o in fb.zeros_like(pending.outputs[len(grad_outputs) :])]
    grads = fb.run_backward(pending, seeds)
    result: list[torch.Tensor | None] = []
    result += [_to_tensor(grads[n]) if n in grads else None for n in fb.input_names]
    result += [_to_tensor(grads[w]) for w in module.parameter_names.values()]
    return result


def _run_forward(
    module: OnnxModule,
    variant: Any,
    n_inputs: int,
    tensors: Sequence[torch.Tensor],
    buffers: dict[str, torch.Tensor],
) -> PendingForward:
    """The training forward of ``variant`` on the layer's inputs then its weights, and
    the buffers of its layers in training mode."""
    fb = module.forward_backward
    by_name = dict(zip(fb.input_names, tensors[:n_inputs]))
    by_name.update(zip(module.parameter_names.values(), tensors[n_inputs:]))
    by_name.update(buffers)
    ordered = [by_name[n] for n in fb.feed_sources(variant)]
    pending = fb.run_forward(variant, [_to_ortvalue(t) for t in ordered])
    pending.keep_alive.append(ordered)  # the feeds share these tensors' memory
    return pending


def _symbolic_batch(value: onnx.ValueInfoProto) -> bool:
    """Whether the first dimension of ``value`` is a named (symbolic) one."""
    dims = static_shape(value)
    return dims is not None and len(dims) > 0 and isinstance(dims[0], str)


def _advance(module: OnnxModule, updated: Sequence[torch.Tensor]) -> None:
    """After a training forward: the running statistics become ``updated``, in place (as
    torch's BatchNorm updates its buffers), and the masks' step counter moves on."""
    buffers = module.buffer_values()
    with torch.no_grad():
        for name, value in zip(module.forward_backward.buffer_names, updated):
            buffers[name].copy_(value)
        if STEP in buffers:
            buffers[STEP].add_(1)


__all__ = ["SPECIALIZED_SIZES", "OnnxModule"]
