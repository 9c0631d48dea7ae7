"""The fused training step: one ONNX graph does forward, gradient and update.

Given a training graph (a prediction graph with a loss output, see
:func:`graphkit.add_loss_output`), :func:`build_training_step` composes

* the gradient graph onnxruntime-training builds for the loss with respect to the
  trained weights,
* the learning-rate schedule, evaluated at ``step``,
* the optimizer's update of every weight and of its state,

into one model::

    inputs : X, label[, weight], <weights>, <optimizer state>, step, loss_sum
    outputs: loss, loss_sum.next, step.next, <weight>.next..., <state>.next...

``step`` and ``loss_sum`` are resident like the weights, so a training loop binds every
``.next`` output to the buffer the next run reads, and reads ``loss_sum`` once per epoch.
The result is a plain ONNX model (with ``com.microsoft`` gradient operators): save it,
open it in Netron, or run it by hand with onnxruntime-training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

from graphkit import BaseLearningRate
from graphkit._graph import ELEM_TO_DTYPE, elem_type, fresh_name, graph_names, splice
from graphkit.compat import finalize
from graphkit.errors import MissingGradientError, UnknownNameError
from graphkit.gradient import gradient_model
from graphkit.rewrite import (
    META_LABEL,
    META_WEIGHT,
    check_weight_names,
    get_train_initializer,
    initializers_to_inputs,
    metadata,
)

STEP = "step"
LOSS_SUM = "loss_sum"


def next_name(name: str) -> str:
    """The output that holds the new value of the resident input ``name``."""
    return f"{name}.next"


@dataclass
class TrainingStep:
    """A fused training-step model and the roles of its inputs and outputs."""

    model: onnx.ModelProto
    features: str
    label: str
    sample_weight: str | None
    loss: str
    weights: list[str]
    state: list[str]
    initial: dict[str, np.ndarray] = field(repr=False)
    """Initial values of the resident inputs (weights, zero state, step 0, loss_sum 0)."""

    @property
    def resident(self) -> list[str]:
        """Inputs carried from one run to the next: weights, state, step, loss_sum."""
        return [*self.weights, *self.state, STEP, LOSS_SUM]


def data_inputs(
    train_onx: onnx.ModelProto, weights: Sequence[str], sample_weight_name: str | None
) -> tuple[str, str, str | None]:
    """``(features, label, sample weight)`` input names of a training graph.

    Graphs made by :func:`graphkit.add_loss_output` record them in their metadata; other
    graphs must have inputs ``(features, label[, sample_weight_name])``.
    """
    meta = metadata(train_onx)
    initializers = {i.name for i in train_onx.graph.initializer}
    inputs = [i.name for i in train_onx.graph.input if i.name not in initializers]
    inputs = [n for n in inputs if n not in set(weights)]
    label = meta.get(META_LABEL) or ("label" if "label" in inputs else None)
    weight = meta.get(META_WEIGHT) or (sample_weight_name if sample_weight_name in inputs else None)
    others = [n for n in inputs if n not in (label, weight)]
    if label is None or label not in inputs:
        raise UnknownNameError(
            f"Cannot tell which input holds the labels among {inputs}: build the training "
            "graph with graphkit.add_loss_output, or name the label input 'label'."
        )
    if len(others) != 1:
        raise ValueError(
            f"The training graph must have one feature input besides the label"
            f"{' and sample weights' if weight else ''}; it has {others}."
        )
    return others[0], label, weight


def build_training_step(
    train_onx: onnx.ModelProto,
    weights_to_train: Sequence[str],
    learning_rate: BaseLearningRate,
    loss_output_name: str = "loss",
    sample_weight_name: str | None = "weight",
) -> TrainingStep:
    """Compose gradient, schedule and optimizer into one training-step model.

    Raises:
        UnknownNameError: a weight is not a float initializer (the message lists them),
            or the loss output does not exist.
        MissingGradientError: an operator between the weights and the loss has no
            gradient in onnxruntime-training 1.19.2 (the message names it).
    """
    outputs = [o.name for o in train_onx.graph.output]
    if loss_output_name not in outputs:
        raise UnknownNameError(
            f"The graph has no output {loss_output_name!r} (outputs: {outputs}). Add a loss "
            "with graphkit.add_loss_output(model, ...) or pass loss_output_name."
        )
    weights = check_weight_names(train_onx, weights_to_train)
    if not weights:
        _no_weights(train_onx)
    features, label, sample_weight = data_inputs(train_onx, weights, sample_weight_name)
    values = get_train_initializer(train_onx)

    model = gradient_model(initializers_to_inputs(train_onx, weights), loss_output_name, weights)
    taken = graph_names(model.graph)
    loss_value = next(o for o in model.graph.output if o.name == loss_output_name)
    loss_elem = loss_value.type.tensor_type.elem_type

    optimizer, schedule = learning_rate.optimizer, learning_rate.schedule
    state: list[str] = []
    initial: dict[str, np.ndarray] = {w: values[w] for w in weights}
    initial.update(optimizer.init({w: values[w] for w in weights}))
    for w in weights:
        state.extend(optimizer.state_names(w))
    for name in state:
        if name in taken:
            raise ValueError(f"Optimizer state name {name!r} is already used in the graph.")
    initial[STEP] = np.array(0, dtype=np.int64)
    initial[LOSS_SUM] = np.array(0, dtype=ELEM_TO_DTYPE[loss_elem])

    new_inputs = [
        helper.make_tensor_value_info(
            s, _elem_of(values[_owner(s, weights)]), values[_owner(s, weights)].shape
        )
        for s in state
    ]
    new_inputs.append(helper.make_tensor_value_info(STEP, TensorProto.INT64, []))
    new_inputs.append(helper.make_tensor_value_info(LOSS_SUM, loss_elem, []))
    model.graph.input.extend(new_inputs)

    # the learning rate, once per step, cast to each weight dtype
    rate = splice(model, schedule.model(), {"step": STEP}, prefix="schedule")["learning_rate"]
    rates: dict[int, str] = {}
    for w in weights:
        elem = _elem_of(values[w])
        if elem not in rates:
            rates[elem] = fresh_name(
                f"learning_rate_{TensorProto.DataType.Name(elem).lower()}", taken
            )
            model.graph.node.append(helper.make_node("Cast", [rate], [rates[elem]], to=elem))

    results: list[onnx.ValueInfoProto] = [loss_value]
    produced: dict[str, str] = {}
    for w in weights:
        value = values[w]
        update = optimizer.update_model(w, value.dtype, value.shape)
        wiring = {"param": w, "grad": f"{w}_grad", "lr": rates[_elem_of(value)], "step": STEP}
        wiring.update({s: s for s in optimizer.state_names(w)})
        out = splice(model, update, wiring, prefix=f"update/{w}")
        produced[w] = out["param.new"]
        produced.update({s: out[f"{s}.new"] for s in optimizer.state_names(w)})

    one = fresh_name("step/one", taken)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.array(1, dtype=np.int64), one))
    model.graph.node.append(helper.make_node("Add", [STEP, one], [next_name(STEP)]))
    model.graph.node.append(
        helper.make_node("Add", [LOSS_SUM, loss_output_name], [next_name(LOSS_SUM)])
    )
    results.append(helper.make_tensor_value_info(next_name(LOSS_SUM), loss_elem, []))
    results.append(helper.make_tensor_value_info(next_name(STEP), TensorProto.INT64, []))
    for name in [*weights, *state]:
        model.graph.node.append(helper.make_node("Identity", [produced[name]], [next_name(name)]))
        owner = values[_owner(name, weights)]
        results.append(helper.make_tensor_value_info(next_name(name), _elem_of(owner), owner.shape))
    del model.graph.output[:]
    model.graph.output.extend(results)
    model.doc_string = (
        "graphkit training step: forward, gradient (onnxruntime-training), "
        f"{optimizer!r} update with {schedule!r}."
    )
    return TrainingStep(
        model=finalize(model, check=False),
        features=features,
        label=label,
        sample_weight=sample_weight,
        loss=loss_output_name,
        weights=weights,
        state=state,
        initial=initial,
    )


def _no_weights(train_onx: onnx.ModelProto) -> None:
    """Explain why there is nothing to train."""
    if get_train_initializer(train_onx):
        raise ValueError("weights_to_train is empty: name at least one weight to train.")
    holders = sorted(
        {
            f"{n.op_type} ({n.domain})"
            for n in train_onx.graph.node
            if n.domain not in ("", "ai.onnx")
            and any(a.floats or a.HasField("t") for a in n.attribute)
        }
    )
    if holders:
        raise MissingGradientError(
            f"The model has no float initializer to train: its parameters are attributes of "
            f"{', '.join(repr(h) for h in holders)}, and onnxruntime-training 1.19.2 has no "
            "gradient for these operators. Rebuild the model from standard operators "
            "(MatMul, Gemm, Add...) whose weights are initializers."
        )
    raise ValueError("The model has no float initializer: there is nothing to train.")


def _owner(name: str, weights: Sequence[str]) -> str:
    """The weight a state tensor ``"{weight}.{optimizer}.{field}"`` belongs to."""
    if name in weights:
        return name
    return max((w for w in weights if name.startswith(f"{w}.")), key=len)


def _elem_of(value: np.ndarray) -> int:
    return elem_type(value.dtype)
