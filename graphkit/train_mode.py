"""Layers that compute differently while training: BatchNormalization and Dropout, as
torch's ``model.train()`` runs them.

A graph says which of its layers train in training mode; graphkit then keeps two forms
of it apart:

* the **inference form** (:func:`marked_for_training`), which every prediction,
  evaluation and exported inference model runs: each ``BatchNormalization`` normalizes
  with its running statistics (one output, no ``training_mode``), each ``Dropout`` is
  inactive (no ``training_mode`` input). A layer to train in training mode carries the
  mark :data:`MARK` in its node's metadata;
* the **training form** (:func:`training_form`), which only the training step runs,
  written with standard operators that both gradient sources differentiate. A marked
  ``BatchNormalization`` over ``x`` of shape ``(N, C, ...)``, with ``n = size(x) / C``::

      mean = mean(x) over every axis but 1,   var = mean((x - mean)^2)   (biased)
      y = (x - mean) / sqrt(var + epsilon) * scale + bias
      running_mean <- momentum running_mean + (1 - momentum) mean
      running_var  <- momentum running_var + (1 - momentum) var n / (n - 1)  (unbiased)

  (ONNX's ``momentum`` is ``1 - `` torch's: torch's default 0.1 is exported as 0.9.)
  The updated statistics are outputs of the step, carried as resident state; gradients
  flow through the batch's mean and variance. A marked ``Dropout`` of ratio ``p``::

      y = x * keep / (1 - p),   keep = u >= p

  where ``u`` in [0, 1) comes from the counter-based stream :func:`uniform_stream` of
  the step counter, a seed and the layer's index: the same seed gives the same masks,
  and a run resumed from a checkpoint (its step counter restored) draws the same masks
  as the run it continues. The stream is integer arithmetic (``Range``, ``Mul``, ``Add``,
  ``Div``, ``Mod``) that plain onnxruntime, onnxruntime-web and ``onnx.reference`` all
  run.

Which layers train so (:func:`marked_for_training`'s ``mode``): None, as the graph was
exported: a ``BatchNormalization`` with ``training_mode=1`` (or its running statistics
as outputs), one torch's dynamo exporter wrote for a BatchNorm in ``train()``
(``_native_batch_norm_legit_functional`` in its name or metadata), a ``Dropout`` whose
``training_mode`` is a constant true; True, every BatchNormalization and Dropout; False,
none (all train in inference mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphkit._graph import GraphInfo, NodeWriter, axes_for_opset, copy_model, namer
from graphkit.errors import IncompatibleModelError
from graphkit.tensor_store import tensor_value

MARK = "graphkit.train_mode"
"""The node metadata key marking a layer that trains in training mode."""
BATCH_STATISTICS = "batch_statistics"
"""The mark's value on a BatchNormalization that normalizes with the batch's statistics."""
DROPOUT = "dropout"
"""The mark's value on a Dropout active while training."""

DROPOUT_SEED = "graphkit.dropout_seed"
"""The resident int64 scalar the Dropout masks are drawn from (with the step counter)."""

TRAINING_BATCH_NORMS = ("_native_batch_norm_legit_functional", "_native_batch_norm_legit.")
"""The aten operators torch's dynamo exporter records (in a node's name and its
``pkg.torch.onnx.*`` metadata) for a BatchNorm of a network left in ``train()``; in
``eval()`` it records ``_native_batch_norm_legit_no_training``. Its translation is an
inference ``BatchNormalization``: nothing else in the graph tells."""

MODULUS = 2**31
"""The stream's integers lie in [0, 2^31): a product of two stays below 2^62 (int64)."""
MIX_SHIFTS = (16, 15, 16)
"""The shifts of :func:`mix`'s xor-shifts (``x ^ (x // 2^k)``), before each product."""
MIX_MULTIPLIERS = (0x7FEB352D, 0x4C6CA68B, 0x27D4EB2D)
"""The odd multipliers below 2^31 of :func:`mix` (the first is Wellons' lowbias32's;
below 2^31, so that a product stays within int64)."""
FINAL_SHIFT = 16


def is_marked(node: onnx.NodeProto, kind: str | None = None) -> bool:
    """Whether ``node`` carries :data:`MARK` (of value ``kind``, if given)."""
    return any(p.key == MARK and (kind is None or p.value == kind) for p in node.metadata_props)


def marked_for_training(model: onnx.ModelProto, mode: bool | None = None) -> onnx.ModelProto:
    """``model`` in its inference form, the layers that train in training mode marked
    (see the module docstring; ``model`` itself when it has no BatchNormalization or
    Dropout).

    Raises:
        IncompatibleModelError: a BatchNormalization's running statistics are read by
            another node or are graph outputs, or are not initializers; a Dropout's
            ratio is computed at run time.
    """
    kinds = {"BatchNormalization", "Dropout"}
    _refuse_folded_training_batch_norms(model)
    if not any(n.op_type in kinds and n.domain in ("", "ai.onnx") for n in model.graph.node):
        return model
    out = copy_model(model)
    constants = _small_constants(out.graph)
    initializers = {t.name for t in out.graph.initializer}
    read = {name for n in out.graph.node for name in n.input} | {o.name for o in out.graph.output}
    for node in out.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in kinds:
            continue
        if node.op_type == "BatchNormalization":
            exported = _batch_norm_trains(node)
            _batch_norm_to_inference(node, read)
            kind = BATCH_STATISTICS
            if (exported if mode is None else mode) and not is_marked(node):
                for statistic in node.input[3:5]:
                    if statistic not in initializers:
                        raise IncompatibleModelError(
                            f"BatchNormalization node {_label(node)!r} reads its running "
                            f"statistic {statistic!r}, which is not an initializer: graphkit "
                            "updates running statistics held as initializers. Export the "
                            "model with its BatchNorm buffers as initializers (torch does)."
                        )
        else:
            exported = _dropout_trains(node, constants)
            del node.input[2:]  # training_mode: inactive in the inference form
            kind = DROPOUT
            if (
                (exported or is_marked(node, kind) if mode is None else mode)
                and len(node.input) > 1
                and node.input[1]
            ):
                if node.input[1] not in constants:
                    raise IncompatibleModelError(
                        f"Dropout node {_label(node)!r} computes its ratio at run time: "
                        "graphkit trains a Dropout whose ratio is a constant."
                    )
        # a mark made already (a second pass, add_lora's dropout) stands for an export
        trains = (exported or is_marked(node, kind)) if mode is None else mode
        _set_mark(node, kind if trains else None)
    return out


def _refuse_folded_training_batch_norms(model: onnx.ModelProto) -> None:
    """Refuse a node other than a BatchNormalization that torch's dynamo exporter wrote
    for a BatchNorm in ``train()``: with ``optimize=True`` it folds the BatchNorm into
    the ``Gemm`` or ``Conv`` before it, its running statistics, scale and shift gone."""
    for node in model.graph.node:
        if node.op_type != "BatchNormalization" and _records_training_batch_norm(node):
            raise IncompatibleModelError(
                f"{node.op_type} node {_label(node)!r} is a BatchNorm in train() mode that "
                "torch's dynamo exporter folded into it (optimize=True): its batch "
                "statistics, running statistics, scale and shift are gone. Export with "
                "torch.onnx.export(net, args, dynamo=True, optimize=False) (see the README, "
                "'Exporting a model for training')."
            )


def training_layers(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The marked nodes of ``model``'s main graph, in graph order."""
    return [n for n in model.graph.node if is_marked(n)]


def _label(node: onnx.NodeProto) -> str:
    return node.name or node.output[0]


def _set_mark(node: onnx.NodeProto, kind: str | None) -> None:
    kept = [p for p in node.metadata_props if p.key != MARK]
    del node.metadata_props[:]
    node.metadata_props.extend(kept)
    if kind is not None:
        node.metadata_props.add(key=MARK, value=kind)


def _batch_norm_trains(node: onnx.NodeProto) -> bool:
    """Whether a BatchNormalization was exported in training mode: ``training_mode=1``,
    its running statistics as outputs (before opset 14), or dynamo's record of a
    BatchNorm in ``train()`` (:data:`TRAINING_BATCH_NORMS`)."""
    if any(a.name == "training_mode" and a.i for a in node.attribute):
        return True
    return len([o for o in node.output if o]) > 1 or _records_training_batch_norm(node)


def _records_training_batch_norm(node: onnx.NodeProto) -> bool:
    """Whether dynamo recorded a BatchNorm in ``train()`` for ``node`` (its name, its
    ``pkg.torch.*`` metadata)."""
    texts = [node.name, *(p.value for p in node.metadata_props if p.key.startswith("pkg.torch"))]
    return any(aten in text for text in texts for aten in TRAINING_BATCH_NORMS)


def _batch_norm_to_inference(node: onnx.NodeProto, read: set[str]) -> None:
    """One output, no ``training_mode``: the running statistics it would output must be
    read by nothing."""
    for extra in node.output[1:]:
        if extra and extra in read:
            raise IncompatibleModelError(
                f"BatchNormalization node {_label(node)!r} outputs its updated running "
                f"statistics as {extra!r}, which the graph reads: graphkit updates them "
                "itself while training. Export without reading them (torch.onnx.export "
                "of the network does not)."
            )
    del node.output[1:]
    kept = [a for a in node.attribute if a.name != "training_mode"]
    del node.attribute[:]
    node.attribute.extend(kept)


def _dropout_trains(node: onnx.NodeProto, constants: dict[str, np.ndarray]) -> bool:
    """Whether a Dropout's ``training_mode`` input is a constant true."""
    if len(node.input) < 3 or not node.input[2]:
        return False
    value = constants.get(node.input[2])
    if value is None:
        raise IncompatibleModelError(
            f"Dropout node {_label(node)!r} computes its training_mode at run time: "
            "graphkit decides it (the trainers' train_mode=); export it as a constant."
        )
    return bool(np.asarray(value).all())


def _small_constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    """Scalar initializers and Constant nodes of the main graph."""
    values = {t.name: tensor_value(t) for t in graph.initializer if t.dims in ([], [1])}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            values[node.output[0]] = tensor_value(node.attribute[0].t)
    return values


# -- the training form ------------------------------------------------------------------


@dataclass
class TrainingForm:
    """A graph's training form (:func:`training_form`)."""

    model: onnx.ModelProto
    buffers: dict[str, str] = field(default_factory=dict)
    """Running statistic (an initializer of the graph) -> the output holding its update."""
    step: str | None = None
    """The int64 step-counter input the Dropout masks read (None: no Dropout trains)."""
    seed: str | None = None
    """The int64 seed input (:data:`DROPOUT_SEED`) of the masks (None: no Dropout)."""


def training_form(model: onnx.ModelProto, step: str = "step") -> TrainingForm:
    """``model`` with every marked layer in its training form (module docstring); its
    running statistics' updates become graph outputs, and a model whose Dropouts train
    gains the int64 scalar inputs ``step`` (the step counter) and :data:`DROPOUT_SEED`.
    A model with no marked layer is returned as it is."""
    marked = training_layers(model)
    if not marked:
        return TrainingForm(model)
    out = copy_model(model)
    info = GraphInfo(out)  # the names in use, the opset, inferred types and ranks
    taken, opset = info.taken, info.opset
    constants = _small_constants(out.graph)
    form = TrainingForm(out)
    dropouts = 0
    nodes: list[onnx.NodeProto] = []
    for node in out.graph.node:
        if not is_marked(node):
            nodes.append(node)
            continue
        write = NodeWriter(namer(f"{_label(node)}/train", taken))
        elem = info.elem.get(node.input[0], TensorProto.FLOAT)
        if node.op_type == "BatchNormalization":
            rank = info.rank.get(node.input[0])
            mean_next, var_next = _batch_statistics(node, write, elem, rank)
            form.buffers[node.input[3]] = mean_next
            form.buffers[node.input[4]] = var_next
        else:
            if (opset or 0) < 18:
                raise IncompatibleModelError(
                    f"Dropout node {_label(node)!r}: its training masks need BitwiseXor "
                    f"(opset 18), and the model stays at opset {opset} (onnx could not "
                    "convert it). Export it at opset 18 or later, or train it with "
                    "train_mode=False."
                )
            ratio = 0.5  # ONNX's default
            if node.input[1:2] and node.input[1]:
                ratio = float(np.asarray(constants[node.input[1]]).reshape(-1)[0])
            _dropout(node, write, elem, ratio, dropouts, step)
            dropouts += 1
        nodes.extend(axes_for_opset(write.nodes, opset))
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    statistics = {t.name: t for t in out.graph.initializer if t.name in form.buffers}
    for statistic, updated in form.buffers.items():
        tensor = statistics[statistic]
        out.graph.output.append(
            helper.make_tensor_value_info(updated, tensor.data_type, list(tensor.dims))
        )
    if dropouts:
        inputs = {i.name for i in out.graph.input}
        for name in (step, DROPOUT_SEED):
            if name not in inputs:
                out.graph.input.append(helper.make_tensor_value_info(name, TensorProto.INT64, []))
        form.step, form.seed = step, DROPOUT_SEED
    return form


def _scalar(write: NodeWriter, value: float, elem: int) -> str:
    out = write.fresh("const")
    array = np.array(value, dtype=helper.tensor_dtype_to_np_dtype(elem))
    write.nodes.append(
        helper.make_node("Constant", [], [out], value=numpy_helper.from_array(array))
    )
    return out


def _batch_statistics(
    node: onnx.NodeProto, write: NodeWriter, elem: int, rank: int | None
) -> tuple[str, str]:
    """A marked BatchNormalization's training form (its output written under the node's
    own output name); returns the names of the updated running mean and variance."""
    x, scale, bias, running_mean, running_var = node.input[:5]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    epsilon, momentum = float(attrs.get("epsilon", 1e-5)), float(attrs.get("momentum", 0.9))
    op, ints = write.op, write.ints
    if rank is None or rank < 2:
        raise IncompatibleModelError(
            f"BatchNormalization node {_label(node)!r}: the rank of its input {x!r} is "
            "unknown, and training it with batch statistics needs it. Declare the model's "
            "input shapes (their rank, the batch may stay symbolic)."
        )
    axes = ints([0, *range(2, rank)])  # every axis but the channels'
    mean = op("ReduceMean", [x, axes], keepdims=1)
    centred = op("Sub", [x, mean])
    var = op("ReduceMean", [op("Mul", [centred, centred]), axes], keepdims=1)
    inv_std = op("Reciprocal", [op("Sqrt", [op("Add", [var, _scalar(write, epsilon, elem)])])])
    per_channel = ints([-1] + [1] * (rank - 2))  # (C,) -> (C, 1, ..., 1)
    scale_b = op("Reshape", [scale, per_channel])
    bias_b = op("Reshape", [bias, per_channel])
    normalized = op("Mul", [centred, op("Mul", [inv_std, scale_b])])
    write.nodes.append(helper.make_node("Add", [normalized, bias_b], [node.output[0]]))
    # the running statistics, updated with the batch's (no gradient reaches them)
    flat = ints([-1])
    batch_mean = op("Reshape", [mean, flat])
    count = op("Cast", [op("Size", [x])], to=elem)
    channels = op("Cast", [op("Size", [running_mean])], to=elem)
    n = op("Div", [count, channels])
    unbiased = op("Div", [n, op("Sub", [n, _scalar(write, 1.0, elem)])])
    batch_var = op("Mul", [op("Reshape", [var, flat]), unbiased])
    keep, take = _scalar(write, momentum, elem), _scalar(write, 1.0 - momentum, elem)
    mean_next = op("Add", [op("Mul", [running_mean, keep]), op("Mul", [batch_mean, take])])
    var_next = op("Add", [op("Mul", [running_var, keep]), op("Mul", [batch_var, take])])
    return mean_next, var_next


def _int_scalar(write: NodeWriter, value: int) -> str:
    out = write.fresh("int")
    array = np.array(value, dtype=np.int64)
    write.nodes.append(
        helper.make_node("Constant", [], [out], value=numpy_helper.from_array(array))
    )
    return out


def _mix(write: NodeWriter, x: str) -> str:
    """:func:`mix` written as nodes (``x`` int64 in [0, 2^31))."""
    modulus = _int_scalar(write, MODULUS)

    def xor_shift(x: str, shift: int) -> str:
        return write.op("BitwiseXor", [x, write.op("Div", [x, _int_scalar(write, 2**shift)])])

    for multiplier, shift in zip(MIX_MULTIPLIERS, MIX_SHIFTS):
        product = write.op("Mul", [xor_shift(x, shift), _int_scalar(write, multiplier)])
        x = write.op("Mod", [product, modulus])
    return xor_shift(x, FINAL_SHIFT)


def _dropout(
    node: onnx.NodeProto, write: NodeWriter, elem: int, ratio: float, layer: int, step: str
) -> None:
    """A marked Dropout's training form, under the node's own output names."""
    op = write.op
    x = node.input[0]
    modulus = _int_scalar(write, MODULUS)
    seeded = _mix(write, op("Mod", [DROPOUT_SEED, modulus]))
    stepped = _mix(write, op("Mod", [op("Add", [seeded, op("Mod", [step, modulus])]), modulus]))
    key = _mix(write, op("Mod", [op("Add", [stepped, _int_scalar(write, layer + 1)]), modulus]))
    index = op("Range", [_int_scalar(write, 0), op("Size", [x]), _int_scalar(write, 1)])
    drawn = _mix(write, op("Mod", [op("Add", [_mix(write, index), key]), modulus]))
    # the top 24 bits, exact in float32: u in [0, 1)
    uniform = op(
        "Mul",
        [
            op("Cast", [op("Div", [drawn, _int_scalar(write, 2**7)])], to=elem),
            _scalar(write, 2.0**-24, elem),
        ],
    )
    keep = op(
        "Reshape", [op("GreaterOrEqual", [uniform, _scalar(write, ratio, elem)]), op("Shape", [x])]
    )
    scale = 0.0 if ratio >= 1.0 else 1.0 / (1.0 - ratio)
    kept = op("Mul", [x, op("Cast", [keep], to=elem)])
    write.nodes.append(
        helper.make_node("Mul", [kept, _scalar(write, scale, elem)], [node.output[0]])
    )
    if len(node.output) > 1 and node.output[1]:
        write.nodes.append(helper.make_node("Identity", [keep], [node.output[1]]))


def mix(x: np.ndarray | np.integer | int) -> np.ndarray:
    """The stream's mixing function on int64 values in [0, 2^31): for each shift ``k``
    of :data:`MIX_SHIFTS` and multiplier ``a`` of :data:`MIX_MULTIPLIERS`,
    ``x = ((x ^ (x // 2^k)) a) mod 2^31``; then ``x ^ (x // 2^16)``."""
    x = np.asarray(x, dtype=np.int64) % MODULUS
    for multiplier, shift in zip(MIX_MULTIPLIERS, MIX_SHIFTS):
        x = ((x ^ (x // 2**shift)) * multiplier) % MODULUS
    return x ^ (x // 2**FINAL_SHIFT)


def uniform_stream(seed: int, step: int, layer: int, size: int) -> np.ndarray:
    """The ``size`` uniform numbers in [0, 1) (float32) the ``layer``-th trained Dropout
    (graph order, from 0) draws at step ``step``: with ``key = mix(mix(mix(seed) + step)
    + layer + 1)`` (each sum mod 2^31), ``u_i = (mix(mix(i) + key) // 2^7) 2^-24``. The
    training step computes the same numbers in the graph; ``keep = u >= p``."""
    key = mix(mix(mix(np.int64(seed)) + np.int64(step) % MODULUS) + layer + 1)
    drawn = mix(mix(np.arange(size, dtype=np.int64)) + key)
    return (drawn // 2**7).astype(np.float32) * np.float32(2.0**-24)


__all__ = [
    "BATCH_STATISTICS",
    "DROPOUT",
    "DROPOUT_SEED",
    "MARK",
    "TrainingForm",
    "is_marked",
    "marked_for_training",
    "mix",
    "training_form",
    "training_layers",
    "uniform_stream",
]
