"""Graph rewriting: turn a prediction graph into a training graph, and back.

* :func:`add_loss_output` appends a loss (and penalties) to a prediction graph:
  ``Y = f(X; W)`` becomes ``loss, Y = L(f(X; W), label[, weight]) + P(W)``; or one loss
  per output, weighted: ``loss, A, B = a L_A(A, label_A) + b L_B(B, label_B) + P(W)``.
* :func:`get_train_initializer` lists the weights that can be trained.
* :func:`initializers_to_inputs` / :func:`inputs_to_initializers` move weights between
  initializers and graph inputs; :func:`rename_weights` renames them;
  :func:`set_weights` writes trained values back into the original graph.

Every function returns a new model and leaves its argument unchanged. The names a
training graph uses are recorded in its ``metadata_props`` (keys ``graphkit.*``) so a
runtime never has to guess them.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxscript
from onnx import TensorProto, helper, numpy_helper

from graphkit import losses as _losses
from graphkit import penalties as _penalties
from graphkit._graph import (
    ELEM_TO_DTYPE,
    FLOAT_TYPES,
    fresh_name,
    graph_names,
    initializers_as_inputs,
    named_shape,
    rename_tensors,
    shape_matches,
    splice,
    static_shape,
    value_info,
)
from graphkit.compat import (
    DSL_OPSET,
    PORTABLE,
    Ceiling,
    check_tensor_sizes,
    finalize,
    load_model,
    make_compatible,
)
from graphkit.engine import ort_engine
from graphkit.errors import DTypeError, ShapeError, UnknownNameError
from graphkit.parameters import FLOAT_ELEM_TYPES, parameter_names
from graphkit.quantized import quantized_as_standard
from graphkit.standard_ops import as_standard_operators
from graphkit.tensor_store import tensor_value

# metadata keys of a training graph
META_LOSS = "graphkit.loss_output"
META_LABEL = "graphkit.label_input"
META_WEIGHT = "graphkit.weight_input"
META_PREDICTION = "graphkit.prediction_output"
META_LOSS_FUNCTION = "graphkit.loss_function"
META_HEADS = "graphkit.loss_heads"
META_LORA = "graphkit.lora"  # graphkit.lora's record of its adapters: the prediction's own
"""A graph with a loss per output records its heads here (JSON: a list of
``{"output", "label", "loss", "weight"}``) instead of the three one-loss keys above."""


@dataclass(frozen=True)
class LossHead:
    """One loss of a training graph: the prediction ``output`` it reads, its ``label``
    input, its ``loss`` as recorded (``{"name", "reduction", hyper-parameters}``; empty
    when unknown) and its ``weight`` in the total loss."""

    output: str
    label: str
    loss: dict[str, Any] = field(default_factory=dict, compare=False)
    weight: float = 1.0


def loss_heads(model: onnx.ModelProto) -> list[LossHead]:
    """The losses :func:`add_loss_output` recorded in a training graph, in order: one for
    a graph with one loss, one per output for a loss per output, none for a graph it did
    not make."""
    meta = metadata(model)
    if meta.get(META_HEADS):
        return [
            LossHead(h["output"], h["label"], dict(h.get("loss") or {}), float(h["weight"]))
            for h in json.loads(meta[META_HEADS])
        ]
    if meta.get(META_LABEL):
        description = json.loads(meta[META_LOSS_FUNCTION]) if meta.get(META_LOSS_FUNCTION) else {}
        return [LossHead(meta.get(META_PREDICTION, ""), meta[META_LABEL], description)]
    return []


def get_train_initializer(onx: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The parameters of ``onx`` (the weights trained by default), in graph order.

    Parameters are the float initializers read as weights, biases, normalization scales
    or embedding tables; constants (skl2onnx's ``unity``, an exported GELU's ``0.5``,
    running statistics, scaling constants) and integer initializers are left out. The
    rule is :mod:`graphkit.parameters`; :func:`graphkit.parameters.explain` shows the
    role of each initializer.
    """
    check_tensor_sizes(onx)  # a tensor shorter than its dims: named, not numpy's reshape
    names = set(parameter_names(onx))
    return {init.name: tensor_value(init) for init in onx.graph.initializer if init.name in names}


def weight_values(onx: onnx.ModelProto, names: Iterable[str]) -> dict[str, np.ndarray]:
    """``{name: value}`` of the named initializers, in the order of ``names``."""
    found = {i.name: i for i in onx.graph.initializer}
    return {name: tensor_value(found[name]) for name in names}


def float_initializers(onx: onnx.ModelProto) -> list[str]:
    """Every float initializer: what ``weights_to_train`` may name explicitly."""
    return [i.name for i in onx.graph.initializer if i.data_type in FLOAT_ELEM_TYPES]


def check_weight_names(onx: onnx.ModelProto, names: Iterable[str] | str) -> list[str]:
    """Return ``names`` as a list after checking each is a float initializer of ``onx``.

    A single string is one name. Constants may be named on purpose: the default rule
    (:func:`get_train_initializer`) only decides what is trained when nothing is named.

    Raises:
        UnknownNameError: listing the float initializers when a name is not one.
    """
    names = [names] if isinstance(names, str) else list(names)
    candidates = float_initializers(onx)
    unknown = [n for n in names if n not in candidates]
    if unknown:
        others = {i.name for i in onx.graph.initializer} - set(candidates)
        detail = (
            f" ({sorted(others & set(unknown))} are not float)" if others & set(unknown) else ""
        )
        raise UnknownNameError(
            f"{unknown} {'is' if len(unknown) == 1 else 'are'} not a trainable weight of the "
            f"model{detail}. Trainable weights (float initializers): {candidates}; "
            f"trained by default: {parameter_names(onx)}."
        )
    return names


def add_loss_output(
    onx: onnx.ModelProto | bytes | str | os.PathLike[str],
    score_name: str | _losses.Loss | onnxscript.OnnxFunction | Mapping[str, Any] = "squared_error",
    loss_name: str = "loss",
    label_name: str | Mapping[str, str] = "label",
    weight_name: str | None = None,
    penalty: Mapping[str, Any] | _penalties.Penalty | None = None,
    output_index: int | str | None = None,
    *,
    loss_weights: Mapping[str, float] | None = None,
    **kwargs: Any,
) -> onnx.ModelProto:
    """Append a loss to a prediction graph, or one loss per output, weighted.

    The returned graph has a new input ``label_name`` (and ``weight_name`` for sample
    weights when given) and outputs ``loss_name`` first, then the original outputs.

    **A loss per output** (a regression head and a classification head, say): pass
    ``score_name`` as a dict ``{output name: loss}`` and, optionally, ``loss_weights``
    ``{output name: weight}`` (1 for a head left out). The graph gets one label input per
    head, ``label_<output>`` (or the names of a ``label_name`` dict ``{output: label
    input}``), and one loss, the weighted sum of the heads' losses, each reduced as its
    own loss says, plus the penalties once::

        loss = sum_h weight_h L_h(output_h, label_h[, weight]) + P(W)

    ``add_loss_output(onx, {"price": "squared_error", "kind": "cross_entropy"},
    loss_weights={"price": 0.7, "kind": 0.3})`` is torch's ``0.7 * mse(price, y_price) +
    0.3 * cross_entropy(kind, y_kind)``. Sample weights (``weight_name``) weight every
    head. A head's hyper-parameters come with its loss, ``{"price":
    graphkit.losses.get("huber", delta=2.0)}`` (``kwargs`` would apply to every head and
    are refused). The heads are recorded in the graph's metadata (:func:`loss_heads`) for
    the trainers, which take ``y`` as a dict ``{output name: labels}``.

    Args:
        onx: the prediction graph, a ModelProto, its bytes or a path (converted to a
            supported IR version / opset if needed: kept up to what the installed
            onnxruntime loads, the native backend's ``ceiling``; its operators made
            ones both gradient sources take: :mod:`graphkit.standard_ops`).
        score_name: ``"squared_error"``/``"l2"``, ``"absolute_error"``/``"l1"``,
            ``"elastic"`` (``l1_weight``, ``l2_weight``), ``"huber"`` (``delta``),
            ``"log"`` (log loss on probabilities: multiclass on an (N, K) output, binary
            on a single probability column), ``"cross_entropy"`` (softmax from logits),
            ``"token_cross_entropy"`` (softmax from (N, T, V) logits, a class label per
            token: ``ignore_index``, ``label_smoothing``),
            ``"sigmoid_log_loss"`` (binary, from a raw score), a :class:`~graphkit.losses.Loss`
            or a user onnxscript function of ``(prediction, label[, weight])``; or a dict
            ``{output name: any of these}`` for a loss per output.
        loss_name: name of the loss output.
        label_name: name of the label input (for regression, float and shaped like the
            prediction: ``(N, k)`` for a model predicting k values per sample; int64
            class indices of shape (N,) for classification; int64 of the prediction's
            shape without its last axis for ``token_cross_entropy``, ``(N, T)`` for
            ``(N, T, V)`` logits; a custom loss's int64 labels: see
            :meth:`~graphkit.losses.Loss.label_shape`). With a loss per output, a dict
            ``{output name: label input name}`` (``label_<output>`` for the others).
        weight_name: name of a sample-weight input (N,), or None for no weights.
        penalty: ``{"coef": {"l1": a, "l2": b}}`` or ``{"coef": b}`` (an l2
            coefficient), or a :class:`~graphkit.penalties.Penalty`; penalized names must be
            float initializers.
        output_index: the output the loss applies to, by position or name; required when
            the graph has several outputs (a loss per output names them in its dict).
        loss_weights: with a loss per output, ``{output name: weight}`` (finite, >= 0).
        kwargs: hyper-parameters of the loss (``l1_weight``, ``delta``, ``eps``,
            ``reduction``: ``"mean"`` by default, over every predicted value for a
            regression on k values per sample, as ``torch.nn.MSELoss()``; ``"sum"`` as
            in the seed library).

    Returns:
        The training graph, a new model.

    Raises:
        UnknownNameError: an output (``output_index``, a key of the loss dict, of
            ``loss_weights`` or of ``label_name``) the graph does not have; the message
            lists its outputs.

    Example:
        >>> onx_loss = add_loss_output(onx, "elastic", l1_weight=0.1, l2_weight=0.9,
        ...                            penalty={"coef": {"l2": 0.01}})  # doctest: +SKIP
        >>> two_heads = add_loss_output(onx, {"price": "squared_error",
        ...                                   "kind": "cross_entropy"},
        ...                             loss_weights={"price": 0.7, "kind": 0.3})  # doctest: +SKIP
    """
    if isinstance(score_name, Mapping):
        return _add_loss_per_output(
            onx, score_name, loss_name, label_name, weight_name, penalty, output_index,
            loss_weights, kwargs,
        )  # fmt: skip
    if loss_weights is not None:
        raise ValueError(
            "loss_weights weighs the losses of several outputs: pass score_name as a dict "
            "{output name: loss}, e.g. add_loss_output(onx, {'out_a': 'squared_error', "
            "'out_b': 'cross_entropy'}, loss_weights={'out_a': 1.0, 'out_b': 0.5})."
        )
    if not isinstance(label_name, str):
        raise TypeError(
            "label_name is one input name for one loss; a dict {output: label input} goes "
            "with a loss per output (score_name as a dict)."
        )
    compatible = make_compatible(
        quantized_as_standard(load_model(onx)), min_opset=DSL_OPSET, ceiling=_runtime_ceiling()
    )
    model, prediction = select_prediction(as_standard_operators(compatible), output_index)
    loss = _head_loss(score_name, kwargs, prediction)

    weighted = weight_name is not None
    taken = graph_names(model.graph)
    data_loss, piece, label_name = _splice_head(
        model, prediction, loss, label_name, weighted, taken, "loss"
    )
    if weighted:
        weight_name = _add_weight_input(model, weight_name, piece, taken)  # type: ignore[arg-type]
        # the head was spliced before the input existed: wire it now
        _rewire(model, _WEIGHT_PLACEHOLDER, weight_name)
    loss_name = _new_name(model, loss_name, taken, "loss_name")
    _finish_total(model, [data_loss], penalty, loss.reduction == "none", loss_name, piece, taken)
    description = _describe(loss)
    _set_metadata(
        model,
        {
            META_LOSS: loss_name,
            META_LABEL: label_name,
            META_WEIGHT: weight_name or "",
            META_PREDICTION: prediction.name,
            META_LOSS_FUNCTION: json.dumps(description),
        },
    )
    return finalize(model)


def _runtime_ceiling() -> Ceiling:
    """What the installed onnxruntime loads (:func:`graphkit.engine.ort_engine.runtime_ceiling`:
    the native backend's ceiling, and onnxruntime-training's 21 where that is the build
    installed), or :data:`~graphkit.compat.PORTABLE` where none is: a training graph loads
    where it was built. No backend is resolved here (a trainer resolves its own once)."""
    try:
        return ort_engine.runtime_ceiling()
    except ImportError:
        return PORTABLE


_WEIGHT_PLACEHOLDER = "graphkit.sample_weight"
"""What the losses read for the sample weights until the weight input is added (the heads
are spliced first, so that the inputs come in the order labels, then weights)."""


def _head_loss(score: Any, kwargs: dict[str, Any], prediction: onnx.ValueInfoProto) -> _losses.Loss:
    """The loss ``score`` resolved for ``prediction``'s shape, which it must suit."""
    shape = named_shape(prediction)
    loss = _make_loss(score, kwargs).for_prediction(shape)
    _check_prediction_shape(loss, shape, prediction.name)
    return loss


def _splice_head(
    model: onnx.ModelProto,
    prediction: onnx.ValueInfoProto,
    loss: _losses.Loss,
    label_name: str,
    weighted: bool,
    taken: set[str],
    prefix: str,
) -> tuple[str, onnx.ModelProto, str]:
    """Add ``loss`` of ``prediction`` to ``model`` (in place) with a new label input:
    ``(its value's tensor, the loss piece, the label input's name)``. A weighted loss
    reads the sample weights from :data:`_WEIGHT_PLACEHOLDER`."""
    dtype = ELEM_TO_DTYPE[prediction.type.tensor_type.elem_type]
    piece = loss.value_model(dtype, weighted, named_shape(prediction))
    label = _new_name(model, label_name, taken, "label_name")
    wiring = {"prediction": prediction.name, "label": label}
    model.graph.input.append(value_info(label, _input_elem(piece, "label"), _dims(piece, "label")))
    if weighted:
        wiring["weight"] = _WEIGHT_PLACEHOLDER
    value = splice(model, piece, wiring, prefix=prefix)["loss"]
    taken |= graph_names(model.graph)
    return value, piece, label


def _add_weight_input(
    model: onnx.ModelProto, weight_name: str, piece: onnx.ModelProto, taken: set[str]
) -> str:
    name = _new_name(model, weight_name, taken, "weight_name")
    elem = _input_elem(piece, "prediction")
    model.graph.input.append(value_info(name, elem, _dims(piece, "weight")))
    return name


def _rewire(model: onnx.ModelProto, old: str, new: str) -> None:
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = new


def _finish_total(
    model: onnx.ModelProto,
    terms: list[str],
    penalty: Any,
    per_sample: bool,
    loss_name: str,
    piece: onnx.ModelProto,
    taken: set[str],
) -> None:
    """``loss_name = terms[0] + terms[1] + ... + penalties``, the first output."""
    total = terms[0]
    penalties = _add_penalties(model, _penalties.from_spec(penalty), per_sample)
    for i, term in enumerate([*terms[1:], *penalties]):
        # a chain of Add: onnxruntime-training has no gradient for Sum
        partial = fresh_name(f"loss/total_{i}", taken)
        model.graph.node.append(helper.make_node("Add", [total, term], [partial], name=partial))
        total = partial
    model.graph.node.append(helper.make_node("Identity", [total], [loss_name], name=loss_name))
    elem = next(o.type.tensor_type.elem_type for o in piece.graph.output if o.name == "loss")
    loss_value = value_info(loss_name, elem, _dims(piece, "loss"))
    outputs = [loss_value, *model.graph.output]
    del model.graph.output[:]
    model.graph.output.extend(outputs)


def _describe(loss: _losses.Loss) -> dict[str, Any]:
    return {"name": loss.name, "reduction": loss.reduction, **_jsonable(loss.params)}


def _add_loss_per_output(
    onx: Any,
    scores: Mapping[str, Any],
    loss_name: str,
    label_name: str | Mapping[str, str],
    weight_name: str | None,
    penalty: Any,
    output_index: int | str | None,
    loss_weights: Mapping[str, float] | None,
    kwargs: dict[str, Any],
) -> onnx.ModelProto:
    """:func:`add_loss_output` with a loss per output (``scores``: ``{output: loss}``)."""
    if output_index is not None:
        raise ValueError(
            "output_index chooses the output of one loss; with a loss per output, the keys "
            f"of the dict name the outputs ({list(scores)}): leave output_index out."
        )
    if kwargs:
        raise TypeError(
            f"Hyper-parameters {sorted(kwargs)} would apply to every output's loss: give each "
            "head its own loss object instead, e.g. {'out': graphkit.losses.get('huber', "
            "delta=2.0, reduction='sum')}."
        )
    if not scores:
        raise ValueError("The dict of losses is empty: give a loss for at least one output.")
    compatible = make_compatible(
        quantized_as_standard(load_model(onx)), min_opset=DSL_OPSET, ceiling=_runtime_ceiling()
    )
    model = as_standard_operators(compatible)
    outputs = [o.name for o in model.graph.output]
    heads = list(scores)
    _check_outputs_named(heads, outputs, "the dict of losses")
    weights = _check_loss_weights(loss_weights, heads, outputs)
    labels = _label_names(label_name, heads, outputs)

    chosen: list[tuple[str, onnx.ValueInfoProto, _losses.Loss]] = []
    for head in heads:
        model, prediction = select_prediction(model, head)
        chosen.append((head, prediction, _head_loss(scores[head], {}, prediction)))
    elems = {p.name: p.type.tensor_type.elem_type for _, p, _ in chosen}
    if len(set(elems.values())) > 1:
        types = {n: TensorProto.DataType.Name(e) for n, e in elems.items()}
        raise DTypeError(
            f"The outputs {types} have different element types; one loss sums them: convert "
            "the model to one float type first."
        )
    per_sample = {head: loss.reduction == "none" for head, _, loss in chosen}
    if len(set(per_sample.values())) > 1:
        raise ValueError(
            f"Losses {[h for h, none in per_sample.items() if none]} keep one value per sample "
            "(reduction='none') and the others reduce the batch to one value: their sum would "
            "broadcast. Give every head the same kind of reduction."
        )

    weighted = weight_name is not None
    taken = graph_names(model.graph)
    terms, records = [], []
    piece = None
    for head, prediction, loss in chosen:
        value, piece, label = _splice_head(
            model, prediction, loss, labels[head], weighted, taken, f"loss/{head}"
        )
        if weights[head] != 1.0:
            dtype = ELEM_TO_DTYPE[prediction.type.tensor_type.elem_type]
            factor = fresh_name(f"loss/{head}/weight", taken)
            scaled = fresh_name(f"loss/{head}/weighted", taken)
            constant = numpy_helper.from_array(np.array(weights[head], dtype=dtype), factor)
            model.graph.node.extend(
                [
                    helper.make_node("Constant", [], [factor], name=factor, value=constant),
                    helper.make_node("Mul", [factor, value], [scaled], name=scaled),
                ]
            )
            value = scaled
        terms.append(value)
        records.append(
            {"output": prediction.name, "label": label, "loss": _describe(loss),
             "weight": weights[head]}
        )  # fmt: skip
    if weighted:
        weight_name = _add_weight_input(model, weight_name, piece, taken)  # type: ignore[arg-type]
        _rewire(model, _WEIGHT_PLACEHOLDER, weight_name)
    loss_name = _new_name(model, loss_name, taken, "loss_name")
    none = next(iter(per_sample.values()))
    _finish_total(model, terms, penalty, none, loss_name, piece, taken)  # type: ignore[arg-type]
    _set_metadata(
        model,
        {
            META_LOSS: loss_name,
            META_WEIGHT: weight_name or "",
            META_HEADS: json.dumps(records),
        },
    )
    return finalize(model)


def _check_outputs_named(names: Iterable[Any], outputs: list[str], what: str) -> None:
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise UnknownNameError(
            f"{what} names {unknown}, {'which is' if len(unknown) == 1 else 'which are'} not "
            f"an output of the model; its outputs are {outputs}."
        )


def _check_loss_weights(
    loss_weights: Mapping[str, float] | None, heads: list[str], outputs: list[str]
) -> dict[str, float]:
    """``{head: weight}``, 1 for the heads ``loss_weights`` leaves out."""
    given = dict(loss_weights or {})
    unknown = [n for n in given if n not in heads]
    if unknown:
        others = [n for n in unknown if n in outputs]
        detail = f" ({others} have no loss)" if others else ""
        raise UnknownNameError(
            f"loss_weights names {unknown}, which {'is' if len(unknown) == 1 else 'are'} not "
            f"a head with a loss{detail}; the heads are {heads} (the outputs {outputs})."
        )
    weights = {}
    for head in heads:
        value = given.get(head, 1.0)
        try:
            weight = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"loss_weights[{head!r}] must be a number, got {value!r}.") from None
        if not np.isfinite(weight) or weight < 0:
            raise ValueError(f"loss_weights[{head!r}] must be finite and >= 0, got {value!r}.")
        weights[head] = weight
    return weights


def _label_names(
    label_name: str | Mapping[str, str], heads: list[str], outputs: list[str]
) -> dict[str, str]:
    """The label input of every head: ``label_<output>`` unless ``label_name`` maps it."""
    if isinstance(label_name, str):
        if label_name != "label":
            raise TypeError(
                f"label_name={label_name!r} is one name, but there is a loss per output: pass "
                "a dict {output name: label input name} (by default label_<output>)."
            )
        label_name = {}
    _check_outputs_named(label_name, heads, "label_name")
    names = {head: label_name.get(head, f"label_{head}") for head in heads}
    repeated = sorted({n for n in names.values() if list(names.values()).count(n) > 1})
    if repeated:
        raise ValueError(f"label_name gives several heads the same label input {repeated}.")
    return names


def select_prediction(
    onx: onnx.ModelProto, output_index: int | str | None = None
) -> tuple[onnx.ModelProto, onnx.ValueInfoProto]:
    """``(model, prediction output)``: the float tensor output a loss compares with labels.

    Args:
        onx: a prediction graph.
        output_index: a position or a name among the outputs; None picks the only float
            tensor output (a skl2onnx classifier's probabilities next to its labels).

    A skl2onnx ``ZipMap`` output (a sequence of maps, not a tensor) stands for the
    probability tensor it is made from: that tensor is added to the outputs of the
    returned copy and chosen instead. A skl2onnx ``MLPRegressor`` of k > 1 targets
    flattens its (N, k) prediction into (N k, 1) rows (skl2onnx 1.20 reshapes every MLP
    regression to ``[-1, 1]``); the returned copy reshapes it to ``[-1, k]``, the
    prediction scikit-learn's ``predict`` returns.

    Raises:
        UnknownNameError: ``output_index`` names no output.
        ValueError: several float outputs and no ``output_index``.
        DTypeError: the chosen output is not a float tensor.
    """
    model = onnx.ModelProto()
    model.CopyFrom(onx)
    outputs = list(model.graph.output)
    names = [o.name for o in outputs]
    if output_index is None:
        floats = [o for o in outputs if _float_tensor(_tensor_behind(model, o))]
        tensors = [o for o in outputs if _tensor_behind(model, o).type.HasField("tensor_type")]
        if not floats and len(tensors) == 1:
            floats = tensors  # the only tensor: refused below for its element type
        if len(floats) != 1:
            raise ValueError(
                f"The graph has {len(outputs)} outputs {names}: say which one the loss "
                "applies to with output_index (a position or a name), e.g. "
                f"output_index={names[-1]!r}."
            )
        chosen = floats[0]
    elif isinstance(output_index, str):
        if output_index not in names:
            raise UnknownNameError(
                f"output_index={output_index!r} names no output; outputs are {names}."
            )
        chosen = outputs[names.index(output_index)]
    else:
        if not -len(outputs) <= int(output_index) < len(outputs):
            raise UnknownNameError(
                f"output_index={output_index} is out of range: the graph has "
                f"{len(outputs)} outputs {names}."
            )
        chosen = outputs[int(output_index)]
    tensor = _tensor_behind(model, chosen)
    if tensor is not chosen:
        model.graph.output.append(tensor)
    _unflatten_targets(model, tensor)
    if not tensor.type.HasField("tensor_type"):
        raise DTypeError(
            f"Output {chosen.name!r} is a {chosen.type.WhichOneof('value')}, not a tensor; "
            "choose a float tensor output with output_index."
        )
    elem = tensor.type.tensor_type.elem_type
    if elem == TensorProto.FLOAT16:
        raise DTypeError(
            f"Output {tensor.name!r} is float16: graphkit's losses, penalties and "
            "optimizers are compiled for float32 and float64 (float16 optimizer state "
            "loses small updates), so it trains float32 and float64 graphs. Convert the "
            "model to float32 first (re-export it in float32, or "
            "onnxconverter_common.float16.convert_float16_to_float32)."
        )
    if elem not in FLOAT_TYPES.values():
        raise DTypeError(
            f"Output {tensor.name!r} is {TensorProto.DataType.Name(elem)}; a loss needs a "
            "float32 or float64 prediction. Choose another output with output_index."
        )
    return model, tensor


def _float_tensor(value: onnx.ValueInfoProto) -> bool:
    return value.type.HasField("tensor_type") and (
        value.type.tensor_type.elem_type in FLOAT_TYPES.values()
    )


def _tensor_behind(model: onnx.ModelProto, output: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    """``output`` itself, or for a ZipMap output the typed probability tensor it reads."""
    producer = next((n for n in model.graph.node if output.name in n.output), None)
    if producer is None or producer.op_type != "ZipMap":
        return output
    source = producer.input[0]
    for value in [*model.graph.value_info, *model.graph.output]:
        if value.name == source and value.type.HasField("tensor_type"):
            return value
    try:
        typed = onnx.shape_inference.infer_shapes(model)
        found = [v for v in typed.graph.value_info if v.name == source]
    except Exception:  # skl2onnx graphs infer; a failure only loses the static shape
        found = []
    if found:
        return found[0]
    return value_info(source, TensorProto.FLOAT, ["N", None])


def _unflatten_targets(model: onnx.ModelProto, output: onnx.ValueInfoProto) -> None:
    """Undo skl2onnx's ``Reshape(scores, [-1, 1])`` of an (N, k) regression, k > 1 (in
    place, on the copy :func:`select_prediction` returns): it reshapes to ``[-1, k]``
    instead, and the output is declared ``[N, k]``."""
    if model.producer_name != "skl2onnx":
        return
    producer = next((n for n in model.graph.node if output.name in n.output), None)
    if producer is None or producer.op_type != "Reshape" or len(producer.input) < 2:
        return
    shape = next((i for i in model.graph.initializer if i.name == producer.input[1]), None)
    if shape is None or tensor_value(shape).tolist() != [-1, 1]:
        return
    try:
        typed = onnx.shape_inference.infer_shapes(model)
    except Exception:  # skl2onnx graphs infer; without it the output stays as it is
        return
    scores = next((v for v in typed.graph.value_info if v.name == producer.input[0]), None)
    dims = static_shape(scores) if scores is not None else None
    if not dims or len(dims) != 2 or not isinstance(dims[1], int) or dims[1] < 2:
        return
    target = np.array([-1, dims[1]], dtype=np.int64)
    readers = sum(list(n.input).count(shape.name) for n in model.graph.node)
    if readers == 1:  # its only reader: the initializer changes
        shape.CopyFrom(numpy_helper.from_array(target, shape.name))
    else:
        columns = fresh_name(f"{shape.name}/targets", graph_names(model.graph))
        model.graph.initializer.append(numpy_helper.from_array(target, columns))
        producer.input[1] = columns
    declared = output.type.tensor_type
    batch = declared.shape.dim[0] if declared.HasField("shape") and declared.shape.dim else None
    batch_dim = batch.dim_param or batch.dim_value or None if batch is not None else None
    output.type.CopyFrom(helper.make_tensor_type_proto(declared.elem_type, [batch_dim, dims[1]]))


def _make_loss(score: Any, kwargs: dict[str, Any]) -> _losses.Loss:
    if isinstance(score, onnxscript.OnnxFunction):
        if kwargs:
            raise ValueError(f"A custom loss takes no hyper-parameters, got {sorted(kwargs)}.")
        return _losses.custom_loss(score)
    if isinstance(score, _losses.Loss):
        return _losses.get(score, **kwargs)
    if not isinstance(score, str):
        raise TypeError(
            f"score_name must be a loss name, a graphkit Loss or an onnxscript function, "
            f"not {type(score).__name__}."
        )
    try:
        return _losses.get(score, **kwargs)
    except TypeError as exc:
        raise TypeError(f"Loss {score!r} does not take these arguments: {exc}") from exc


def _check_prediction_shape(loss: _losses.Loss, shape: tuple[int | str, ...], name: str) -> None:
    if loss.token_labels:
        if len(shape) < 2:
            raise ShapeError(
                f"Loss {loss.name!r} needs logits (N, ..., V), the classes on the last axis; "
                f"output {name!r} has rank {len(shape)}."
            )
        return
    if loss.multiclass:
        if len(shape) != 2:
            raise ShapeError(
                f"Loss {loss.name!r} needs a (N, K) prediction; output {name!r} has rank "
                f"{len(shape)}."
            )
        if isinstance(shape[1], int) and shape[1] < 2:
            raise ShapeError(
                f"Loss {loss.name!r} needs K >= 2 class columns; output {name!r} has "
                f"{shape[1]}. For one probability column use score_name='log' with "
                "binary=True, for a raw score 'sigmoid_log_loss'."
            )
    if loss.name == "sigmoid_log_loss" or loss.params.get("binary"):
        if len(shape) > 2 or (len(shape) == 2 and isinstance(shape[1], int) and shape[1] != 1):
            raise ShapeError(
                f"Loss {loss.name!r} needs one score or probability per sample; output "
                f"{name!r} has shape {shape}."
            )


def _new_name(model: onnx.ModelProto, wanted: str, taken: set[str], argument: str) -> str:
    """``wanted`` if free; an internal tensor of that name is renamed; otherwise a fresh
    name derived from it (with a warning naming it)."""
    if wanted not in taken:
        taken.add(wanted)
        return wanted
    interface = {v.name for v in [*model.graph.input, *model.graph.output]}
    interface |= {i.name for i in model.graph.initializer}
    if wanted not in interface:
        replacement = fresh_name(f"{wanted}_internal", taken)
        rename_tensors(model.graph, lambda n: replacement if n == wanted else n)
        return wanted
    name = fresh_name(wanted, taken)
    warnings.warn(
        f"{argument}={wanted!r} is already an input, output or initializer of the graph; "
        f"using {name!r} instead (pass another {argument} to choose it).",
        stacklevel=3,
    )
    return name


def _input_elem(piece: onnx.ModelProto, name: str) -> int:
    return next(i.type.tensor_type.elem_type for i in piece.graph.input if i.name == name)


def _dims(piece: onnx.ModelProto, name: str) -> list[int | str | None]:
    for value in [*piece.graph.input, *piece.graph.output]:
        if value.name == name:
            return static_shape(value) or []
    raise KeyError(name)


def _add_penalties(
    model: onnx.ModelProto, penalty: _penalties.Penalty, per_sample: bool
) -> list[str]:
    weights = get_train_initializer(model)
    names = penalty.penalized(weights)
    if not names or penalty.is_zero:
        return []
    if per_sample:
        raise ValueError("A penalty cannot be added to a per-sample loss (reduction='none').")
    terms = []
    for name in names:
        value = weights[name]
        piece = penalty.value_model(name, value.dtype, value.shape)
        terms.append(splice(model, piece, {"weight": name}, prefix=f"penalty/{name}")["penalty"])
    return terms


def _jsonable(params: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in params.items() if isinstance(v, (int, float, str, bool))}


def _set_metadata(model: onnx.ModelProto, values: Mapping[str, str]) -> None:
    kept = [p for p in model.metadata_props if p.key not in values]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in values.items():
        model.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))


def metadata(model: onnx.ModelProto) -> dict[str, str]:
    """The ``graphkit.*`` metadata of a training graph (empty for other graphs)."""
    return {p.key: p.value for p in model.metadata_props if p.key.startswith("graphkit.")}


# -- moving weights -------------------------------------------------------------------------


def _copy(onx: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(onx)
    return out


def initializers_to_inputs(
    onx: onnx.ModelProto, names: Iterable[str] | None = None
) -> onnx.ModelProto:
    """Turn initializers (the parameters when ``names`` is None) into graph inputs.

    The new inputs come after the existing ones, in the order of ``names``.
    """
    names = list(get_train_initializer(onx)) if names is None else check_weight_names(onx, names)
    return initializers_as_inputs(onx, names)


def inputs_to_initializers(onx: onnx.ModelProto, values: Mapping[str, Any]) -> onnx.ModelProto:
    """Turn the graph inputs named in ``values`` into initializers holding those values."""
    model = _copy(onx)
    inputs = {i.name: i for i in model.graph.input}
    unknown = [n for n in values if n not in inputs]
    if unknown:
        raise UnknownNameError(f"{unknown} are not inputs of the graph; inputs: {list(inputs)}.")
    for name, value in values.items():
        model.graph.initializer.append(_tensor_for(inputs[name], name, value))
    kept = [i for i in model.graph.input if i.name not in values]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    return model


def _tensor_for(value_info_: onnx.ValueInfoProto, name: str, value: Any) -> onnx.TensorProto:
    elem = value_info_.type.tensor_type.elem_type
    array = np.asarray(value)
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    if array.dtype != dtype:
        if array.dtype.kind != np.dtype(dtype).kind:
            raise DTypeError(f"{name!r} is {np.dtype(dtype)}, the value given is {array.dtype}.")
        array = array.astype(dtype)
    dims = static_shape(value_info_)
    if not shape_matches(dims, array.shape):
        raise ShapeError(f"{name!r} has shape {dims}, the value given {array.shape}.")
    return numpy_helper.from_array(array, name)


def rename_weights(onx: onnx.ModelProto, mapping: Mapping[str, str]) -> onnx.ModelProto:
    """Rename initializers (and every use of them, subgraphs included)."""
    initializers = [i.name for i in onx.graph.initializer]
    unknown = [n for n in mapping if n not in initializers]
    if unknown:
        raise UnknownNameError(f"{unknown} are not initializers; initializers: {initializers}.")
    taken = graph_names(onx.graph) - set(mapping)
    clashes = [new for new in mapping.values() if new in taken]
    if clashes or len(set(mapping.values())) != len(mapping):
        raise ValueError(f"New names {clashes or list(mapping.values())} are already used.")
    model = _copy(onx)
    rename_tensors(model.graph, lambda n: mapping.get(n, n))
    return model


def set_weights(onx: onnx.ModelProto, weights: Mapping[str, Any]) -> onnx.ModelProto:
    """A copy of ``onx`` whose initializers hold ``weights`` (trained values, say).

    Names must be initializers; dtypes and shapes must match the original ones.
    """
    model = _copy(onx)
    index = {init.name: i for i, init in enumerate(model.graph.initializer)}
    unknown = [n for n in weights if n not in index]
    if unknown:
        raise UnknownNameError(
            f"{unknown} are not initializers of the model; initializers: {list(index)}."
        )
    for name, value in weights.items():
        old = model.graph.initializer[index[name]]
        array = np.asarray(value)
        expected = helper.tensor_dtype_to_np_dtype(old.data_type)
        if tuple(old.dims) != array.shape:
            raise ShapeError(f"{name!r} has shape {tuple(old.dims)}, the value {array.shape}.")
        if array.dtype != expected:
            if array.dtype.kind != np.dtype(expected).kind:
                raise DTypeError(f"{name!r} is {np.dtype(expected)}, the value {array.dtype}.")
            array = array.astype(expected)
        model.graph.initializer[index[name]].CopyFrom(numpy_helper.from_array(array, name))
    return model


__all__ = [
    "add_loss_output",
    "check_weight_names",
    "float_initializers",
    "get_train_initializer",
    "initializers_to_inputs",
    "inputs_to_initializers",
    "LossHead",
    "loss_heads",
    "metadata",
    "prune",
    "select_prediction",
    "rename_weights",
    "set_weights",
    "strip_loss_output",
    "weight_values",
]


def keep_outputs(onx: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``onx`` whose outputs are ``names`` (in that order), without the nodes
    they do not need.

    Raises:
        UnknownNameError: a name that is not an output.
    """
    model = _copy(onx)
    outputs = {o.name: o for o in model.graph.output}
    unknown = [n for n in names if n not in outputs]
    if unknown:
        raise UnknownNameError(f"{unknown} are not outputs of the graph; outputs: {list(outputs)}.")
    del model.graph.output[:]
    model.graph.output.extend(outputs[n] for n in names)
    return prune(model)


def prune(onx: onnx.ModelProto) -> onnx.ModelProto:
    """Drop nodes, initializers and inputs that no output depends on (a new model)."""
    model = _copy(onx)
    needed = {o.name for o in model.graph.output}
    kept_nodes = []
    for node in reversed(model.graph.node):
        if any(o in needed for o in node.output):
            kept_nodes.append(node)
            needed.update(i for i in node.input if i)
            for sub in _subgraph_inputs(node):
                needed.add(sub)
    kept_nodes.reverse()
    del model.graph.node[:]
    model.graph.node.extend(kept_nodes)
    inits = [i for i in model.graph.initializer if i.name in needed]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    inputs = [i for i in model.graph.input if i.name in needed]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    return model


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from the outer scope (a superset is fine)."""
    names: set[str] = set()
    for attr in node.attribute:
        for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
            for inner in sub.node:
                names.update(inner.input)
                names |= _subgraph_inputs(inner)
    return names


def strip_loss_output(onx: onnx.ModelProto) -> onnx.ModelProto:
    """The prediction graph inside a training graph made by :func:`add_loss_output`.

    Removes the loss output and what only it needed (label and weight inputs, loss and
    penalty nodes) and the ``graphkit.*`` metadata (but for :mod:`graphkit.lora`'s record).
    """
    meta = metadata(onx)
    loss_name = meta.get(META_LOSS, "loss")
    outputs = [o.name for o in onx.graph.output]
    if loss_name not in outputs:
        raise UnknownNameError(f"{loss_name!r} is not an output of the graph; outputs: {outputs}.")
    model = _copy(onx)
    kept = [o for o in model.graph.output if o.name != loss_name]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    kept_meta = [
        p for p in model.metadata_props if not p.key.startswith("graphkit.") or p.key == META_LORA
    ]
    del model.metadata_props[:]
    model.metadata_props.extend(kept_meta)
    return prune(model)
