"""A forward/backward training batch in two TrainingAgent calls instead of four.

The forward/backward trainer runs a batch as forward (TrainingAgent), the loss and its
gradient (a session), backward (TrainingAgent) and the update of every weight (a
session). When nothing has to happen between backward and update (everywhere but
distributed training, which all-reduces the gradients there), the loss and the update
can live in the agent's own graph::

    forward:   prediction = model(X, weights)
               loss, prediction_grad = loss_graph(prediction, label[, weight])
               yield loss                              -> the forward returns the loss
    backward:  dprediction = prediction_grad * dloss    (dloss: the fed 1)
               gradients = the model's backward(dprediction)
               weights, state, step, loss_sum = update(weights, gradients, state, loss)

The backward writes the new resident values into the trainer's other buffer set (its
fetches are given allocated, as an IOBinding's outputs are), which the next forward
reads: one batch is two onnxruntime calls and one thread pool, with no allocation. The
loss gradient is graphkit's own (the same graph as the separate loss session), so the two
designs run the same kernels on the same values. ``dloss`` makes the backward depend on
what it is fed, which keeps every node after the yield in the backward call.
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
    int_constant,
    renamed_value,
    static_shape,
)
from graphkit.backends.ort_training.agent import train_batch, training_agent, values_vector
from graphkit.engine.ort_engine import c_ortvalue
from graphkit.update_step import UpdateStep, next_name, splice_loss, splice_update

YIELD = "YieldOp"


@dataclass
class AgentStep:
    """A gradient graph extended with the loss (before its yield) and the update (after).

    Its inputs are ``data`` (features, label[, sample weight]) then the resident values
    in ``resident`` order; its outputs are the new resident values in the same order, so
    that one list of buffers serves as the forward's feeds of one batch and the
    backward's fetches of the batch before.
    """

    model: onnx.ModelProto
    data: list[str]
    resident: list[str]  # the update step's resident names (weights by their public name)
    outputs: list[str]
    dloss_shape: tuple[int, ...]  # the yielded loss's: ones of the prediction's rank


def agent_step(
    gradient: onnx.ModelProto,
    loss: onnx.ModelProto,
    update: UpdateStep,
    internal: dict[str, str],
    gradient_of: dict[str, str],
    features: Sequence[str],
    seeds: Mapping[str, str] | None = None,
) -> AgentStep:
    """The gradient graph of a ``TrainingAgent`` with the loss and the update fused in.

    Args:
        gradient: the agent's gradient graph (one ``YieldOp`` yielding the prediction).
        loss: inputs ``prediction``, ``label`` [, ``weight``]; outputs ``loss``,
            ``prediction_grad`` (:meth:`graphkit.losses.Loss.gradient_model`).
        update: the update step (:func:`graphkit.training.step.build_update_step`).
        internal: public weight name -> its name in ``gradient``.
        gradient_of: gradient output of ``gradient`` -> public weight name.
        features: the feature inputs of ``gradient`` (the model's inputs, in the order
            :class:`AgentRun` is given their arrays).
        seeds: unused (the agent's output gradient comes in at its ``YieldOp``); the
            native backend's fused step takes the same arguments and needs them.
    """
    model = copy_model(gradient)
    graph = model.graph
    nodes = list(graph.node)
    yields = [i for i, n in enumerate(nodes) if n.op_type == YIELD]
    if len(yields) != 1 or len(nodes[yields[0]].input) != 1:
        raise ValueError("agent_step: the gradient graph must yield exactly one prediction")
    at = yields[0]
    old_yield = nodes[at]
    prediction, prediction_grad = old_yield.input[0], old_yield.output[0]
    before, after = nodes[:at], nodes[at + 1 :]
    # the loss and its gradient, computed by the forward before it yields the loss
    count = len(graph.node)
    produced, label, weight = splice_loss(model, loss, prediction)
    loss_nodes = list(graph.node[count:])
    loss_value, loss_grad = produced["loss"], produced["prediction_grad"]
    # the loss is yielded with the prediction's rank (all ones): onnxruntime multiplies
    # an (n, 1) tensor by a lower-rank scalar one element at a time, 5x slower at n=1000
    dims = static_shape(next(i for i in loss.graph.input if i.name == "prediction"))
    dloss_shape = (1,) * len(dims or ())
    taken = graph_names(graph)
    yielded, dloss = loss_value, fresh_name(f"{loss_value}_grad", taken)
    reshape = []
    if dloss_shape:
        yielded = fresh_name(f"{loss_value}/yielded", taken)
        reshape = _reshape(loss_value, dloss_shape, yielded, taken)
    new_yield = onnx.NodeProto()
    new_yield.CopyFrom(old_yield)
    new_yield.input[:] = [yielded]
    new_yield.output[:] = [dloss]
    chain = helper.make_node("Mul", [loss_grad, dloss], [prediction_grad], name=f"{dloss}/chain")
    del graph.node[:]
    graph.node.extend([*before, *loss_nodes, *reshape, new_yield, chain, *after])

    # the update, computed by the backward from the gradients
    resident = update.resident
    data = [*features, label, *([weight] if weight is not None else [])]
    _, produced = splice_update(model, loss, update, internal, gradient_of, loss_value, data)
    outputs = {o.name: o for o in update.model.graph.output}
    fetched = _after_yield(graph, dloss, [produced[next_name(r)] for r in resident])
    del graph.output[:]
    graph.output.extend(
        renamed_value(outputs[next_name(r)], name) for r, name in zip(resident, fetched)
    )
    return AgentStep(
        model=model,
        data=data,
        resident=list(resident),
        outputs=[o.name for o in graph.output],
        dloss_shape=dloss_shape,
    )


class AgentRun:
    """An :class:`AgentStep` specialized to one batch size, and its TrainingAgent.

    A call trains on one batch: the forward (features, labels, the resident values in
    :attr:`AgentStep.resident` order) and the backward (fed ``dloss = 1``), which writes
    the new resident values into the given vector of allocated OrtValues.
    """

    def __init__(
        self, model: onnx.ModelProto, session: Any, step: AgentStep, dtype: np.dtype, device: Any
    ) -> None:
        self.model = model
        self.session = session
        self.agent = training_agent(
            session, [i.name for i in session.get_inputs()], step.outputs, 1, device
        )
        self._device = device
        self._dloss = np.ones(step.dloss_shape, dtype)  # the C value below borrows it
        self._grads = values_vector([c_ortvalue(self._dloss, device)])

    def __call__(
        self,
        features: Sequence[np.ndarray],
        y: np.ndarray,
        w: np.ndarray | None,
        resident: list[Any],
        new: Any,
    ) -> None:
        """One batch: the features (one array per feature input, in
        :func:`agent_step`'s order) and ``resident`` (C OrtValues) in, ``new`` (a C vector
        of as many OrtValues, from :func:`.agent.values_vector`) out."""
        arrays = (*features, y) if w is None else (*features, y, w)
        contiguous = [np.ascontiguousarray(a) for a in arrays]
        train_batch(self.agent, contiguous, self._device, resident, self._grads, new)


def _after_yield(graph: onnx.GraphProto, dloss: str, outputs: list[str]) -> list[str]:
    """``outputs``, each computed after the yield: the backward must compute every value
    it returns (onnxruntime refuses a fetch the forward already filled), and an output
    that does not depend on the yield's output (``step + 1``, ``loss_sum + loss``) would
    be computed by the forward. Those pass through ``Where(IsNaN(dloss), x, x)``: the
    same value, now depending on the fed ``dloss`` (a dependency no optimizer folds)."""
    downstream = {dloss}
    for node in graph.node:
        if any(i in downstream for i in node.input):
            downstream.update(node.output)
    early = [o for o in outputs if o not in downstream]
    if not early:
        return outputs
    taken = graph_names(graph)
    scalar = fresh_name(f"{dloss}/scalar", taken)  # a condition that broadcasts to any rank
    graph.node.extend(_reshape(dloss, (), scalar, taken))
    gate = fresh_name(f"{dloss}/is_nan", taken)
    graph.node.append(helper.make_node("IsNaN", [scalar], [gate], name=gate))
    gated = {}
    for name in early:
        gated[name] = fresh_name(f"{name}/after_yield", taken)
        graph.node.append(
            helper.make_node("Where", [gate, name, name], [gated[name]], name=gated[name])
        )
    return [gated.get(o, o) for o in outputs]


def _reshape(x: str, shape: tuple[int, ...], out: str, taken: set[str]) -> list[onnx.NodeProto]:
    target = fresh_name(f"{out}/shape", taken)
    return [int_constant(target, list(shape)), helper.make_node("Reshape", [x, target], [out])]


__all__ = ["AgentRun", "AgentStep", "agent_step"]
