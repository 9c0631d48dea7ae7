"""A forward/backward training batch in one session call: the native backend's fused step.

The forward/backward trainer runs a batch as forward, the loss and its gradient,
backward and the update of every weight: four sessions on the native backend
(:mod:`.agent`). When nothing has to happen between them (everywhere but distributed
training, which all-reduces the gradients before the update), they are one graph. The
native vector-Jacobian graph takes the gradient of its output as an input (the seed), so
with the loss spliced in before it and the update after::

    prediction, gradients = vjp(X, weights, seed)
    loss, prediction_grad = loss_graph(prediction, label[, weight])   # the seed
    weights, state, step, loss_sum = update(weights, gradients, state, loss)

one ``run_with_iobinding`` trains on a batch: it reads the trainer's current buffer set
and writes the other (bound once per set), so a batch that fails leaves the current set
as the last good batch left it. The loss and the update are the graphs the four-call
design runs (graphkit's own), so both compute the same values. onnxruntime-training's
runner does the same in two calls around its ``YieldOp``
(:mod:`graphkit.backends.ort_training.agent_step`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper

from graphkit._graph import (
    copy_model,
    fresh_name,
    graph_names,
    outer_reads,
    rename_reads,
    renamed_value,
)
from graphkit.engine import ort_engine
from graphkit.update_step import UpdateStep, next_name, splice_loss, splice_update


@dataclass
class FusedStep:
    """A vector-Jacobian graph with the loss (its seed) and the update fused in.

    Its inputs are ``data`` (features, label[, sample weight]) then the resident values
    in ``resident`` order; its outputs, ``outputs``, are the new resident values in the
    same order.
    """

    model: onnx.ModelProto
    data: list[str]
    resident: list[str]  # the update step's resident names (weights by their public name)
    inputs: list[str]  # the graph input of each resident value, in ``resident`` order
    outputs: list[str]


def fused_step(
    gradient: onnx.ModelProto,
    loss: onnx.ModelProto,
    update: UpdateStep,
    internal: Mapping[str, str],
    gradient_of: Mapping[str, str],
    features: Sequence[str],
    seeds: Mapping[str, str],
) -> FusedStep:
    """The training step of a forward/backward trainer as one graph.

    Args:
        gradient: the vector-Jacobian graph (inputs: the features, the weights and, for
            its one output, the seed ``seeds[output]``; outputs: the output, then the
            gradients).
        loss: inputs ``prediction``, ``label`` [, ``weight``]; outputs ``loss``,
            ``prediction_grad`` (:meth:`graphkit.losses.Loss.gradient_model`).
        update: the update step (:func:`graphkit.training.step.build_update_step`).
        internal: public weight name -> its name in ``gradient``.
        gradient_of: gradient output of ``gradient`` -> public weight name.
        features: the feature inputs of ``gradient``, in the order :class:`FusedRun` is
            given their arrays.
        seeds: output of ``gradient`` -> the input taking d loss / d output.
    """
    if len(seeds) != 1:
        raise ValueError(f"fused_step: one output to seed, got {sorted(seeds)}")
    ((prediction, seed),) = seeds.items()
    model = copy_model(gradient)
    graph = model.graph

    # the loss and its gradient, which seeds the vector-Jacobian product
    produced, label, weight = splice_loss(model, loss, prediction)
    loss_value = produced["loss"]
    rename_reads(graph, seed, produced["prediction_grad"])

    # the update, from the gradients
    resident = update.resident
    data = [*features, label, *([weight] if weight is not None else [])]
    carried, updated = splice_update(model, loss, update, internal, gradient_of, loss_value, data)
    declared = {o.name: o for o in update.model.graph.output}
    taken = graph_names(graph)
    fetched = []
    for r in resident:
        name = updated[next_name(r)]
        if name in carried.values() or name in (label, weight, *features):
            # an update that passes a value through: the output is a copy of its own
            copied = fresh_name(f"{name}/next", taken)
            graph.node.append(helper.make_node("Identity", [name], [copied]))
            name = copied
        fetched.append(name)
    del graph.output[:]
    graph.output.extend(
        renamed_value(declared[next_name(r)], name) for r, name in zip(resident, fetched)
    )
    _sort_topologically(graph)
    return FusedStep(
        model=model,
        data=data,
        resident=list(resident),
        inputs=[carried[r] for r in resident],
        outputs=fetched,
    )


def _sort_topologically(graph: onnx.GraphProto) -> None:
    """Order ``graph``'s nodes so that each comes after what it reads (the spliced loss
    was appended after the nodes that read its gradient)."""
    ready = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    waiting = [(node, outer_reads(node)) for node in graph.node]
    ordered: list[onnx.NodeProto] = []
    while waiting:
        placed = [node for node, reads in waiting if reads <= ready]
        if not placed:
            raise ValueError("fused_step: the graph has a cycle or reads an unknown tensor")
        waiting = [(node, reads) for node, reads in waiting if not reads <= ready]
        for node in placed:
            ordered.append(node)
            ready.update(node.output)
    del graph.node[:]
    graph.node.extend(ordered)


class FusedRun:
    """A :class:`FusedStep` specialized to one batch size, and its session.

    A call trains on one batch: the features, labels (and sample weights) and the
    resident values (C OrtValues) in, the new resident values written into ``new`` (C
    OrtValues of the trainer's other buffer set). Each buffer set's binding is made once.
    """

    def __init__(
        self, model: onnx.ModelProto, session: Any, step: FusedStep, dtype: np.dtype, device: Any
    ) -> None:
        self.model = model
        self.session = session
        self._step = step
        self._device = device
        self._bindings: list[tuple[list[Any], list[Any], Any]] = []
        self._run = session._sess.run_with_iobinding
        self._from_numpy = ort_engine._capi().OrtValue.ortvalue_from_numpy

    def _binding(self, resident: list[Any], new: list[Any]) -> Any:
        for held, written, binding in self._bindings:
            if held is resident and written is new:
                return binding
        if len(self._bindings) >= 2:  # the buffers were reallocated: the old sets go
            self._bindings.clear()
        binding = ort_engine._capi().SessionIOBinding(self.session._sess)
        for name, value in zip(self._step.inputs, resident):
            binding.bind_ortvalue_input(name, value)
        for name, value in zip(self._step.outputs, new):
            binding.bind_ortvalue_output(name, value)
        self._bindings.append((resident, new, binding))
        return binding

    def __call__(
        self,
        features: Sequence[np.ndarray],
        y: np.ndarray,
        w: np.ndarray | None,
        resident: list[Any],
        new: list[Any],
    ) -> None:
        binding = self._binding(resident, new)
        arrays = [
            np.ascontiguousarray(a) for a in ((*features, y) if w is None else (*features, y, w))
        ]
        from_numpy = self._from_numpy
        for name, array in zip(self._step.data, arrays):  # borrowed until the run returns
            binding.bind_ortvalue_input(name, from_numpy(array, self._device))
        try:
            self._run(binding, None)
        except Exception as exc:
            message = ort_engine.short_message(exc)
            raise RuntimeError(f"training step failed in onnxruntime: {message}") from exc


__all__ = ["FusedRun", "FusedStep", "fused_step"]
