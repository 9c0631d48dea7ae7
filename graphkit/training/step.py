"""The graphs a training loop runs, each built once.

* :func:`build_update_step`: penalty and optimizer (a gradient transformation, its
  learning-rate schedule inside) for every weight, as one graph::

      inputs : <weights>, <weight>_grad..., <optimizer state>, step, loss_sum, loss
      outputs: loss_sum.next, step.next, <weight>.next..., <state>.next...

  Forward/backward training runs it after the backward pass.
* :func:`build_training_step`: full training. The gradient graph the backend's gradient
  source builds for the loss, followed by the update step, as one graph::

      inputs : X (every feature input), label (one per loss head)[, weight], <weights>,
               <optimizer state>, step, loss_sum
      outputs: loss, loss_sum.next, step.next, <weight>.next..., <state>.next...

``step`` and ``loss_sum`` are resident like the weights: a loop binds every ``.next``
output to the buffer the next run reads, and reads ``loss_sum`` once per epoch. Both
results are plain ONNX models (the second with the gradient source's operators, such as
onnxruntime-training's ``com.microsoft`` ones): save them, open them in Netron, or run
them by hand on the backend's engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from graphkit import backends
from graphkit._graph import (
    ELEM_TO_DTYPE,
    elem_type,
    graph_names,
    renamed_value,
    splice,
    static_shape,
    value_info,
)
from graphkit.backends.base import Backend
from graphkit.compat import DSL_OPSET, finalize
from graphkit.errors import ShapeError, UnknownNameError
from graphkit.gradient import gradient_model
from graphkit.penalties import Penalty
from graphkit.prepare import trainable_weights
from graphkit.rewrite import (
    META_WEIGHT,
    initializers_to_inputs,
    loss_heads,
    metadata,
    prune,
    weight_values,
)
from graphkit.train_mode import training_form
from graphkit.transforms import Emitter, GradientTransformation, WeightInfo, emit_all
from graphkit.update_step import (
    LOSS,
    LOSS_SUM,
    PACKED,
    STEP,
    Packing,
    UpdateStep,
    grad_name,
    next_name,
)


@dataclass
class TrainingStep(UpdateStep):
    """A fused full-training step; ``feature_inputs`` (the model's inputs, in graph
    order; ``features`` is the first), ``labels`` (one per loss head, in the heads'
    order; ``label`` is the first) and ``sample_weight`` name its data inputs and
    ``loss`` its loss output."""

    features: str = ""
    label: str = ""
    sample_weight: str | None = None
    loss: str = LOSS
    feature_inputs: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.feature_inputs and self.features:
            self.feature_inputs = [self.features]
        if not self.labels and self.label:
            self.labels = [self.label]

    @property
    def data(self) -> list[str]:
        """The inputs fed per batch: every feature input, every label[, sample weights]."""
        return [*self.feature_inputs, *self.labels] + (
            [self.sample_weight] if self.sample_weight else []
        )


def build_update_step(
    weights: Mapping[str, np.ndarray],
    optimizer: GradientTransformation,
    penalty: Penalty | None = None,
    loss_dtype: object = np.float32,
    learning_rate: Any = None,
    pack: bool = True,
) -> UpdateStep:
    """Penalty + optimizer for every weight, as one ONNX graph.

    For each weight w with gradient g: g' = g + dP/dw (P the penalty on w, if any), then
    ``optimizer`` (a gradient transformation or chain) turns the gradients into updates
    and w <- w + u. ``learning_rate`` (a schedule, its name or a number) fills the
    optimizer's open learning rate. ``loss_sum.next`` adds the batch ``loss`` and the
    penalty values to ``loss_sum``.

    With ``pack`` (the default), an elementwise optimizer runs once on all the weights
    laid end to end (:class:`Packing`): the same values, far fewer kernels, where they
    take at most :data:`PACK_UP_TO_BYTES`.
    """
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"optimizer must be a graphkit gradient transformation, not "
            f"{type(optimizer).__name__}; see graphkit.seed.resolve."
        )
    if learning_rate is not None:
        optimizer = optimizer.with_learning_rate(learning_rate)
    if optimizer.has_open_learning_rate:
        raise ValueError(
            f"{optimizer!r} has an open learning rate: pass learning_rate= (a schedule or "
            "a number)."
        )
    infos = {w: WeightInfo.of(weights[w]) for w in weights}
    plain = _assemble(weights, infos, optimizer, penalty, loss_dtype, None)
    packing = _packing(optimizer, infos) if pack else None
    if packing is None:
        return plain
    # packing costs a Concat and a Split: it pays when the optimizer takes more than a
    # couple of kernels per weight (Adam), not for plain SGD
    packed = _assemble(weights, infos, optimizer, penalty, loss_dtype, packing)
    return packed if _kernels(packed.model) < _kernels(plain.model) else plain


def batch_name(buffer: str) -> str:
    """The update step's input holding a buffer's value computed by the batch's forward
    (:func:`with_buffers`)."""
    return f"{buffer}.batch"


def with_buffers(
    update: UpdateStep, buffers: Mapping[str, np.ndarray], seed: str | None = None
) -> UpdateStep:
    """``update`` carrying the forward's own resident values, for forward/backward
    training: each buffer ``b`` (a running statistic, initial value ``buffers[b]``)
    becomes resident, ``b.next`` the value the batch's forward computed, fed as
    :func:`batch_name`; the Dropout masks' ``seed`` (int64) stays as it is. ``update``
    itself when there is neither."""
    if not buffers and seed is None:
        return update
    model = onnx.ModelProto()
    model.CopyFrom(update.model)
    graph = model.graph
    for name, value in buffers.items():
        elem = helper.np_dtype_to_tensor_dtype(np.asarray(value).dtype)
        shape = list(np.shape(value))
        graph.input.extend(
            [value_info(name, elem, shape), value_info(batch_name(name), elem, shape)]
        )
        graph.node.append(helper.make_node("Identity", [batch_name(name)], [next_name(name)]))
        graph.output.append(value_info(next_name(name), elem, shape))
    initial = {**update.initial, **{b: np.array(v) for b, v in buffers.items()}}
    carried = list(buffers)
    if seed is not None:
        graph.input.append(value_info(seed, TensorProto.INT64, []))
        graph.node.append(helper.make_node("Identity", [seed], [next_name(seed)]))
        graph.output.append(value_info(next_name(seed), TensorProto.INT64, []))
        initial[seed] = np.array(0, dtype=np.int64)
        carried.append(seed)
    return UpdateStep(
        finalize(model, full_check=True),
        update.weights,
        [*update.state, *carried],
        initial,
        update.packing,
        buffers=list(buffers),
    )


def _kernels(model: onnx.ModelProto) -> int:
    return sum(node.op_type not in ("Constant", "Identity") for node in model.graph.node)


def _assemble(
    weights: Mapping[str, np.ndarray],
    infos: Mapping[str, WeightInfo],
    optimizer: GradientTransformation,
    penalty: Penalty | None,
    loss_dtype: object,
    packing: Packing | None,
) -> UpdateStep:
    """The update step, the optimizer run per weight or once on them packed."""
    names = list(weights)
    if packing is not None:
        flat = packing.flat(weights)
        initial_state = optimizer.init({PACKED: flat})
        if any(v.shape not in ((), flat.shape) for v in initial_state.values()):
            packing = None  # a state of another shape: not elementwise after all
    if packing is None:
        initial_state = optimizer.init({w: weights[w] for w in names})
    state = list(initial_state)
    loss_elem = elem_type(loss_dtype)

    inputs = [value_info(w, elem_type(infos[w].dtype), infos[w].shape) for w in names]
    inputs += [value_info(grad_name(w), elem_type(infos[w].dtype), infos[w].shape) for w in names]
    inputs += [
        value_info(s, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for s, v in initial_state.items()
    ]
    inputs += [
        value_info(STEP, TensorProto.INT64, []),
        value_info(LOSS_SUM, loss_elem, []),
        value_info(LOSS, loss_elem, []),
    ]
    graph = helper.make_graph([], "update_step", inputs, [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", DSL_OPSET)])
    g = Emitter(model, infos)
    g.taken |= {next_name(n) for n in [*names, *state, STEP, LOSS_SUM]}
    add = model.graph.node.append

    total = LOSS
    penalized = (
        set(penalty.penalized(names, strict=True)) if penalty and not penalty.is_zero else set()
    )
    gradients = {w: grad_name(w) for w in names}
    for w in names:
        if w in penalized:
            piece = penalty.gradient_model(w, infos[w].dtype, infos[w].shape)  # type: ignore[union-attr]
            out = splice(model, piece, {"weight": w}, prefix=f"penalty/{w}")
            gradients[w] = g.node("Add", [grad_name(w), out["weight_grad"]], f"penalty/{w}/grad")
            term = g.node("CastLike", [out["penalty"], LOSS], f"penalty/{w}/value")
            total = g.node("Add", [total, term], "loss/with_penalty")

    if packing is None:
        updates, new_state = emit_all(optimizer, g, gradients, {s: s for s in state}, STEP)
    else:
        updates, new_state = _emit_packed(optimizer, g, packing, gradients, state)
    produced = {w: g.node("Add", [w, updates[w]], f"apply/{w}") for w in names}
    produced.update(new_state)

    one = g.constant(1, np.int64, "step/one")
    add(helper.make_node("Add", [STEP, one], [next_name(STEP)]))
    add(helper.make_node("Add", [LOSS_SUM, total], [next_name(LOSS_SUM)]))
    outputs = [
        value_info(next_name(LOSS_SUM), loss_elem, []),
        value_info(next_name(STEP), TensorProto.INT64, []),
    ]
    resident = {i.name: i for i in inputs if i.name in produced}  # the weights and state
    for value in resident.values():
        add(helper.make_node("Identity", [produced[value.name]], [next_name(value.name)]))
        out_value = onnx.ValueInfoProto()
        out_value.CopyFrom(value)
        out_value.name = next_name(value.name)
        outputs.append(out_value)
    model.graph.output.extend(outputs)
    model.doc_string = f"graphkit update step: {optimizer!r}, penalty {penalty!r}."

    # a weight mapped from its external data file (read-only) is not copied here: the
    # trainer copies it into its buffers, then lets the system drop the mapped pages
    initial: dict[str, np.ndarray] = {
        w: weights[w] if isinstance(weights[w], np.memmap) else np.array(weights[w]) for w in names
    }
    initial.update(initial_state)
    initial[STEP] = np.array(0, dtype=np.int64)
    initial[LOSS_SUM] = np.array(0, dtype=ELEM_TO_DTYPE[loss_elem])
    model = prune(model)  # e.g. the flat weights, when no transformation reads them
    return UpdateStep(finalize(model, full_check=True), names, state, initial, packing)


PACK_UP_TO_BYTES = 512 * 1024
"""The most bytes of weights an update runs on laid end to end. Beyond, each pass over
the vector leaves the caches, and the copies packing adds (the gradients' Concat, the
weights' Split) cost more than the kernels it saves. AdamW, MLP 100-h-h-10 at batch 128,
native, us a batch packed / per weight: h = 256 (94,218 weights) 656 / 704, h = 384
(190,474) 1051 / 1002, h = 640 (481,290) 2717 / 2462; the MLP 784-512-512-10 (669,706)
3500 / 2870."""


def _packing(optimizer: GradientTransformation, infos: Mapping[str, WeightInfo]) -> Packing | None:
    """The packing for an elementwise optimizer of two or more weights of one dtype,
    :data:`PACK_UP_TO_BYTES` at most."""
    dtypes = {info.dtype for info in infos.values()}
    if len(infos) < 2 or len(dtypes) != 1 or PACKED in infos or not optimizer.elementwise:
        return None
    size = sum(math.prod(info.shape) for info in infos.values())
    if size * np.dtype(next(iter(dtypes))).itemsize > PACK_UP_TO_BYTES:
        return None
    return Packing(tuple(infos), tuple(infos[w].shape for w in infos))


def _emit_packed(
    optimizer: GradientTransformation,
    g: Emitter,
    packing: Packing,
    gradients: Mapping[str, str],
    state: Sequence[str],
) -> tuple[dict[str, str], dict[str, str]]:
    """The optimizer once on the gradients and weights laid end to end; the update
    split back into one tensor per weight."""
    flat_shape = g.constant([-1], np.int64, "packed/flat")

    def laid_end_to_end(tensors: Sequence[str], base: str) -> str:
        flat = [g.node("Reshape", [t, flat_shape], f"{base}/flat") for t in tensors]
        return g.node("Concat", flat, base, axis=0)

    weights = packing.weights
    grads = laid_end_to_end([gradients[w] for w in weights], "packed/grads")
    params = laid_end_to_end(list(weights), "packed/weights")
    info = WeightInfo(g.weights[weights[0]].dtype, (sum(packing.sizes),))
    packed = Emitter(g.model, {PACKED: info}, g.learning_rate)
    packed.taken |= g.taken
    update, new_state = optimizer.emit(
        packed, {PACKED: grads}, {s: s for s in state}, {PACKED: params}, STEP
    )
    g.taken |= packed.taken
    sizes = g.constant(packing.sizes, np.int64, "packed/sizes")
    pieces = [g.fresh(f"packed/update/{w}") for w in weights]
    g.model.graph.node.append(
        helper.make_node(
            "Split", [update[PACKED], sizes], pieces, axis=0, name=g.fresh("packed/split")
        )
    )
    updates = {}
    for w, piece, shape in zip(weights, pieces, packing.shapes):
        target = g.constant(list(shape), np.int64, f"packed/{w}/shape")
        updates[w] = g.node("Reshape", [piece, target], f"packed/{w}/update")
    return updates, {**{s: s for s in state}, **new_state}


def data_inputs(
    train_onx: onnx.ModelProto, weights: Sequence[str], sample_weight_name: str | None
) -> tuple[list[str], str, str | None]:
    """``(feature inputs, label, sample weight)`` input names of a training graph: the
    feature inputs are every other input, in graph order (a model may take several,
    numeric features beside token ids, say).

    Graphs made by :func:`graphkit.add_loss_output` record the label and sample-weight
    names in their metadata; other graphs must name them ``label`` (and
    ``sample_weight_name``). A graph with a loss per output has a label per head
    (:func:`label_inputs`): ``label`` is the first, and none of them is a feature.

    Raises:
        UnknownNameError: no input holds the labels.
        ValueError: no input is left for the features.
    """
    meta = metadata(train_onx)
    initializers = {i.name for i in train_onx.graph.initializer}
    inputs = [i.name for i in train_onx.graph.input if i.name not in initializers]
    inputs = [n for n in inputs if n not in set(weights)]
    labels = [head.label for head in loss_heads(train_onx)]
    label = labels[0] if labels else ("label" if "label" in inputs else None)
    weight = meta.get(META_WEIGHT) or (sample_weight_name if sample_weight_name in inputs else None)
    others = [n for n in inputs if n not in {label, weight, *labels}]
    if label is None or label not in inputs:
        raise UnknownNameError(
            f"Cannot tell which input holds the labels among {inputs}: build the training "
            "graph with graphkit.add_loss_output, or name the label input 'label'."
        )
    if not others:
        raise ValueError(
            f"The training graph has no feature input besides the label"
            f"{' and sample weights' if weight else ''}: its inputs are {inputs}."
        )
    return others, label, weight


def label_inputs(train_onx: onnx.ModelProto, label: str) -> list[str]:
    """The label inputs of a training graph, one per loss head (:func:`graphkit.rewrite.
    loss_heads`); ``[label]`` for a graph with one loss.

    Raises:
        UnknownNameError: a head's label is not an input of the graph.
    """
    labels = [head.label for head in loss_heads(train_onx)] or [label]
    inputs = [i.name for i in train_onx.graph.input]
    missing = [n for n in labels if n not in inputs]
    if missing:
        raise UnknownNameError(
            f"The label inputs {missing} recorded in the graph's metadata are not inputs "
            f"(inputs: {inputs}): rebuild the training graph with graphkit.add_loss_output."
        )
    return labels


def build_training_step(
    train_onx: onnx.ModelProto,
    weights_to_train: Sequence[str] | None,
    optimizer: GradientTransformation,
    loss_output_name: str = LOSS,
    sample_weight_name: str | None = "weight",
    learning_rate: Any = None,
    pack: bool = True,
    backend: str | Backend | None = None,
) -> TrainingStep:
    """Compose the gradient graph of the loss and the update step into one model.

    The gradient graph comes from ``backend``'s gradient source (None: the default,
    see :func:`graphkit.backends.get`).

    Raises:
        UnknownNameError: a weight is not a float initializer (the message lists them),
            or the loss output does not exist.
        MissingGradientError: an operator between the weights and the loss has no
            gradient in the backend (the message names it).
    """
    outputs = [o.name for o in train_onx.graph.output]
    if loss_output_name not in outputs:
        raise UnknownNameError(
            f"The graph has no output {loss_output_name!r} (outputs: {outputs}). Add a loss "
            "with graphkit.add_loss_output(model, ...) or pass loss_output_name."
        )
    _check_scalar_loss(train_onx, loss_output_name)
    weights = trainable_weights(train_onx, weights_to_train)
    features, label, sample_weight = data_inputs(train_onx, weights, sample_weight_name)
    labels = label_inputs(train_onx, label)
    form = training_form(train_onx, STEP)
    buffers = list(form.buffers)
    values = weight_values(train_onx, [*weights, *buffers])

    model = gradient_model(
        initializers_to_inputs(form.model, [*weights, *buffers]), loss_output_name, weights, backend
    )
    source = backends.get(backend).name
    loss_value = next(o for o in model.graph.output if o.name == loss_output_name)
    loss_dtype = ELEM_TO_DTYPE[loss_value.type.tensor_type.elem_type]
    update = build_update_step(
        {w: values[w] for w in weights}, optimizer, None, loss_dtype, learning_rate, pack
    )
    # the forward's own resident values: running statistics, the Dropout masks' seed
    own = [*buffers, *([form.seed] if form.seed else [])]
    taken = graph_names(model.graph)
    clash = sorted(set(update.state + [LOSS_SUM] + ([] if form.step else [STEP])) & taken)
    if clash:
        raise ValueError(f"Names {clash} of the training step are already used in the graph.")
    inputs = {i.name for i in model.graph.input}
    model.graph.input.extend(
        i
        for i in update.model.graph.input
        if i.name in {*update.state, STEP, LOSS_SUM} and i.name not in inputs
    )
    wiring = {name: name for name in [*weights, *update.state, STEP, LOSS_SUM]}
    wiring.update({grad_name(w): grad_name(w) for w in weights})
    wiring[LOSS] = loss_output_name
    produced = splice(model, update.model, wiring, prefix="update_step")
    for output in update.model.graph.output:
        model.graph.node.append(
            helper.make_node("Identity", [produced[output.name]], [output.name])
        )
    declared = {i.name: i for i in model.graph.input}
    updated = {**form.buffers, **({form.seed: form.seed} if form.seed else {})}
    own_outputs = []
    for name in own:
        model.graph.node.append(helper.make_node("Identity", [updated[name]], [next_name(name)]))
        own_outputs.append(renamed_value(declared[name], next_name(name)))
    del model.graph.output[:]
    model.graph.output.extend([loss_value, *update.model.graph.output, *own_outputs])
    model.doc_string = f"graphkit training step: forward, gradient ({source}), " + (
        update.model.doc_string.removeprefix("graphkit update step: ")
    )
    initial = dict(update.initial)
    initial.update({b: np.array(values[b]) for b in buffers})
    if form.seed:
        initial[form.seed] = np.array(0, dtype=np.int64)
    return TrainingStep(
        model=finalize(model),
        weights=weights,
        state=[*update.state, *own],
        initial=initial,
        packing=update.packing,
        buffers=buffers,
        features=features[0],
        label=label,
        sample_weight=sample_weight,
        loss=loss_output_name,
        feature_inputs=features,
        labels=labels,
    )


def _check_scalar_loss(train_onx: onnx.ModelProto, loss: str) -> None:
    """Refuse a loss output that is not a scalar (declared, or found by shape inference)."""
    declared = next(o for o in train_onx.graph.output if o.name == loss)
    dims = static_shape(declared)
    if dims is None:
        try:
            typed = onnx.shape_inference.infer_shapes(train_onx)
            dims = static_shape(next(o for o in typed.graph.output if o.name == loss))
        except Exception:  # inference is a help; the gradient builder checks again
            dims = None
    if dims:
        shown = [d if d is not None else "?" for d in dims]
        raise ShapeError(
            f"The loss output {loss!r} has shape {shown}: the loss must be a scalar; reduce "
            "it over the batch (e.g. op.ReduceMean(per_sample, keepdims=0)), or build the "
            "training graph with graphkit.add_loss_output."
        )
