"""A user's model made ready for training: the one place the weights are chosen.

:func:`prepare_for_training` is what every trainer runs on a user's model before any
gradient is built. Each rewrite computes the same function as the nodes it replaces:

* the model is raised to the opset graphkit's loss and update graphs are written for
  (:data:`graphkit.compat.DSL_OPSET`), so that they can join its gradient graph in one
  session (:func:`graphkit.update_step.fuses_into`); one onnx cannot convert keeps its
  own opset and trains in separate sessions (:func:`compatible_for_training`); one newer
  than the backend's ceiling (``Backend.ceiling``) goes down to it;
* skl2onnx's linear models become standard operators whose coefficients are
  initializers (:func:`graphkit.ml_ops.linear_models_as_standard_ops`);
* a ``CastLike`` whose target type is known becomes a ``Cast``
  (:func:`graphkit.castlike.castlike_as_cast`: torch's dynamo exporter writes them, and
  onnxruntime-training has no gradient for them);
* a ``SplitToSequence`` taken apart by ``SequenceAt`` becomes a ``Split``, a
  ``SequenceConstruct`` read by ``ConcatFromSequence`` a ``Concat``
  (:func:`graphkit.sequences.sequences_as_tensors`: neither gradient source
  differentiates sequences; dynamo writes GPT-2's attention split so);
* gathers that take a tensor apart along an axis (an attention's queries, keys and
  values) become one ``Split`` (:func:`graphkit.gathers.gathers_as_split`);
* BatchNormalization and Dropout in their inference form, the layers that train in
  training mode marked (:func:`graphkit.train_mode.marked_for_training`, by
  :func:`standard_model`);
* a weight's transposed copy an exporter folded (a tied embedding's output projection)
  is read as a ``Transpose`` of the weight, so that both train as one
  (:func:`graphkit.tied_weights.tie_transposed_copies`);
* the weights to train are chosen (:func:`trainable_weights`: the model's parameters,
  never its constants, unless named);
* trained weights stop feeding constant roles (:func:`graphkit.parameters.untie_constants`);
* weights an exporter merged are untied, those torch ties are not
  (:func:`graphkit.parameters.untie_shared_parameters`);
* the backend's own rewrites, for what its gradient source cannot differentiate as it
  is (:meth:`graphkit.backends.base.GradientSource.prepare`).
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from graphkit import backends
from graphkit._graph import copy_model
from graphkit.backends.base import Backend
from graphkit.compat import (
    DSL_OPSET,
    PORTABLE,
    Ceiling,
    check_tensor_sizes,
    make_compatible,
    opset_of,
)
from graphkit.errors import IncompatibleModelError, MissingGradientError
from graphkit.gathers import gathers_as_split
from graphkit.lora import adapter_names
from graphkit.parameters import explain, untie_constants, untie_shared_parameters
from graphkit.quantized import quantized_as_standard
from graphkit.rewrite import (
    META_LOSS,
    check_weight_names,
    float_initializers,
    get_train_initializer,
    metadata,
)
from graphkit.standard_ops import as_standard_operators
from graphkit.tied_weights import read_transposed, tie_transposed_copies, tied_names
from graphkit.train_mode import marked_for_training


def prepare_for_training(
    model: onnx.ModelProto,
    weights_to_train: Sequence[str] | str | None,
    backend: str | Backend | None = None,
    untie_shared_weights: bool = True,
    loss_output_name: str | None = None,
    *,
    tie_weights: bool = True,
    train_mode: bool | None = None,
) -> tuple[onnx.ModelProto, list[str]]:
    """``(rewritten model, weights to train)`` for a user's prediction or training graph.

    The weights are decided on the model as given (see :mod:`graphkit.parameters`), then
    the rewrites above are applied, the last ones by ``backend`` (None: the default).
    With ``tie_weights``, weights torch ties are trained as one: a weight's exact
    transposed copy (an output projection tied to the embedding, its ``Transpose``
    folded by the exporter) is read as ``Transpose(weight)``, and a weight read both
    directly and through a ``Transpose`` stays one weight
    (:mod:`graphkit.tied_weights`); a copy named in ``weights_to_train`` stands for the
    weight. With ``untie_shared_weights``, any other weight read by several parameter
    slots (an exporter's merge of equal initializers) becomes one weight per slot
    (:func:`graphkit.parameters.untie_shared_parameters`). ``loss_output_name`` (None:
    the one :func:`graphkit.add_loss_output` recorded, if any) names a training graph's
    loss, whose own terms on a weight (a penalty) keep reading the trained weight.
    ``train_mode`` is :func:`standard_model`'s.
    """
    backend = backends.get(backend)
    return prepare_standard_model(
        standard_model(model, train_mode, backend.ceiling),
        weights_to_train,
        backend,
        untie_shared_weights,
        loss_output_name,
        tie_weights=tie_weights,
    )


def prepare_standard_model(
    standard: onnx.ModelProto,
    weights_to_train: Sequence[str] | str | None,
    backend: str | Backend | None = None,
    untie_shared_weights: bool = True,
    loss_output_name: str | None = None,
    *,
    tie_weights: bool = True,
) -> tuple[onnx.ModelProto, list[str]]:
    """:func:`prepare_for_training` of a model :func:`standard_model` gave (left as it
    is), which is not converted again."""
    model = gathers_as_split(copy_model(standard))
    if tie_weights:
        model, ties = tie_transposed_copies(model)
        weights_to_train = tied_names(weights_to_train, ties)
    weights = trainable_weights(model, weights_to_train)
    loss = loss_output_name or metadata(model).get(META_LOSS)
    model = untie_constants(model, weights, [loss] if loss else [])
    if untie_shared_weights:
        keep = read_transposed(model, weights) if tie_weights else []
        model, weights = untie_shared_parameters(model, weights, keep)
    return backends.get(backend).prepare(model), weights


def standard_model(
    model: onnx.ModelProto, train_mode: bool | None = None, ceiling: Ceiling = PORTABLE
) -> onnx.ModelProto:
    """A copy of ``model`` a backend of that ``ceiling`` loads (``Backend.ceiling``;
    :data:`~graphkit.compat.PORTABLE`: every backend), at
    :data:`~graphkit.compat.DSL_OPSET` at least where
    onnx can convert it (:func:`compatible_for_training`), its linear models in standard
    operators, its ``CastLike`` nodes of a known type ``Cast`` nodes, its sequence
    patterns tensor operators, its BatchNormalization and Dropout in their inference
    form (:func:`graphkit.standard_ops.as_standard_operators`).

    ``train_mode`` says which BatchNormalization and Dropout layers train in training
    mode (:func:`graphkit.train_mode.marked_for_training`): None, those the graph was
    exported so; True, all; False, none.

    A graph :func:`graphkit.add_loss_output` wrote (its loss recorded in the metadata) is
    that already: it is copied, not converted and checked again (a trainer's build
    prepares the model once).
    """
    if _standard_already(model, ceiling):
        check_tensor_sizes(model)  # metadata is no proof: a short tensor is still refused
        standard = copy_model(model)
    else:
        standard = as_standard_operators(
            compatible_for_training(quantized_as_standard(model), ceiling)
        )
    return standard if train_mode is None else marked_for_training(standard, train_mode)


def _standard_already(model: onnx.ModelProto, ceiling: Ceiling) -> bool:
    """Whether ``model`` is add_loss_output's result: compatible at the DSL's opset up to
    ``ceiling``, with no ``ai.onnx.ml`` operator and no tensor stored outside it."""
    return (
        META_LOSS in metadata(model)
        and model.ir_version <= ceiling.ir_version
        and DSL_OPSET <= (opset_of(model) or 0) <= ceiling.opset
        and not any(n.domain == "ai.onnx.ml" for n in model.graph.node)
        and not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)
    )


def compatible_for_training(model: onnx.ModelProto, ceiling: Ceiling = PORTABLE) -> onnx.ModelProto:
    """:func:`~graphkit.compat.make_compatible` up to ``ceiling``, at opset
    :data:`~graphkit.compat.DSL_OPSET` at least where onnx's converter can raise it (a
    forward/backward trainer's batch is then one session call: a transformer exported at
    opset 17 trained 1.3x slower in four calls), at the model's own opset where it
    cannot."""
    try:
        return make_compatible(model, min_opset=DSL_OPSET, ceiling=ceiling)
    except IncompatibleModelError:
        return make_compatible(model, ceiling=ceiling)  # raises what cannot be loaded at all


def trainable_weights(
    onx: onnx.ModelProto, weights_to_train: Sequence[str] | str | None
) -> list[str]:
    """``weights_to_train`` checked against the float initializers; when None, the
    adapters of a model :func:`graphkit.lora.add_lora` adapted (its base stays frozen),
    else the model's parameters (:func:`graphkit.get_train_initializer`), never its
    constants."""
    if weights_to_train is None:
        weights = adapter_names(onx) or list(get_train_initializer(onx))
    else:
        weights = check_weight_names(onx, weights_to_train)
    if not weights:
        _no_weights(onx)
    return weights


def _no_weights(onx: onnx.ModelProto) -> None:
    """Explain why there is nothing to train."""
    if get_train_initializer(onx):
        raise ValueError("weights_to_train is empty: name at least one weight to train.")
    if float_initializers(onx):
        roles = "; ".join(f"{name}: {role}" for name, role in explain(onx).items())
        raise ValueError(
            "No initializer of the model is read as a weight, bias, normalization scale or "
            f"embedding table, so nothing is trained by default ({roles}). Name the ones "
            "to train with weights_to_train=[...]."
        )
    holders = sorted(
        {
            f"{n.op_type} ({n.domain})"
            for n in onx.graph.node
            if n.domain not in ("", "ai.onnx")
            and any(a.floats or a.HasField("t") for a in n.attribute)
        }
    )
    if holders:
        raise MissingGradientError(
            f"The model has no float initializer to train: its parameters are attributes of "
            f"{', '.join(repr(h) for h in holders)}, which no gradient reaches. Rebuild the "
            "model from standard operators (MatMul, Gemm, Add...) whose weights are "
            "initializers."
        )
    raise ValueError("The model has no float initializer: there is nothing to train.")
