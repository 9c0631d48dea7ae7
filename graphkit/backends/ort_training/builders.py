"""onnxruntime-training's two gradient builders, and their workarounds.

* :func:`gradient_graph`: ``GradientGraphBuilder``, the gradient of a loss with respect
  to weights and inputs, as one graph (full training, :func:`graphkit.gradient_model`).
* :func:`module_graphs`: ``OrtModuleGraphBuilder``, a forward graph and a gradient graph
  for the TrainingAgent (forward/backward training, the PyTorch layer).
* :func:`explain_builder_failure`: their failures as graphkit errors.

Both builders emit ``com.microsoft`` gradient operators (:mod:`.lowering` rewrites them
into standard ONNX) and have quirks of their own, fixed here before they are called:
a node reading a differentiated input twice, a float64 loss, the order of the trained
initializers. What they abort the process on (control flow on the path to the loss) is
refused before they are called, and what they write to stderr is left there: silencing
it would hide the text of an abort nobody foresaw.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Sequence
from typing import Any

import onnx

from graphkit._graph import (
    ancestors,
    copy_model,
    descendants,
    fresh_name,
    graph_names,
    outer_reads,
    rename_tensors,
)
from graphkit.backends.base import ForwardBackwardGraphs
from graphkit.backends.ort_training.lowering import lower_float32_only_ops
from graphkit.engine.ort_engine import log_severity, onnxruntime, session_options, short_message
from graphkit.errors import MissingGradientError

NAME = "onnxruntime-training 1.19.2"

_NO_BUILDER = re.compile(r"gradient builder has not been registered: (\S+) for node (\S*)")
_UNREACHABLE = re.compile(r"partial derivative for '([^']+)' as it's unreachable")


def _capi() -> Any:
    return onnxruntime().capi._pybind_state


# -- errors --------------------------------------------------------------------------------


MODULE_BUILDER_ONLY = frozenset({"GRU", "LSTM"})
"""Operators the forward/backward builder (OrtModuleGraphBuilder) differentiates and the
full-training one (GradientGraphBuilder) does not."""

OTHER_BUILDER_HINT = (
    " Forward/backward training (ForwardBackwardTrainer) takes its gradients from "
    "onnxruntime-training's other builder, which differentiates it: try it on the "
    "prediction graph."
)

NATIVE_HINT = (
    " The native backend (backend='native', standard-ONNX gradients) covers more operators: try it."
)


def explain_builder_failure(exc: BaseException, hint: str = "") -> MissingGradientError:
    """The error to raise when a gradient builder fails (``hint``, the other builder's
    offer, is added where that builder differentiates the operator)."""
    unreachable = _UNREACHABLE.search(str(exc))
    if unreachable:
        return MissingGradientError(
            f"{NAME} finds no path from the weight {unreachable.group(1)!r} to the outputs "
            "through operators it differentiates: an operator on the way stops it (a "
            "sequence operator other than those graphkit rewrites, a Loop...), though the "
            f"weight reaches the outputs. Its own message: {short_message(exc)}" + NATIVE_HINT
        )
    found = _NO_BUILDER.search(str(exc))
    if found:
        op_type, node = found.groups()
        offer = hint + NATIVE_HINT if op_type in MODULE_BUILDER_ONLY else NATIVE_HINT
        return MissingGradientError(
            f"{NAME} has no gradient for operator {op_type!r} "
            f"(node {node!r}). Rewrite that part with differentiable operators "
            "(e.g. Cosh(x) as (Exp(x) + Exp(-x)) / 2, Atan with a series or a lookup) or "
            "keep it off the path between the weights and the loss." + offer
        )
    return MissingGradientError(f"Building the gradient graph failed: {short_message(exc)}" + hint)


CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})
"""Operators both builders have no gradient for, and on which they abort the process
(a C++ assertion, SIGABRT) instead of raising when one lies between the differentiated
tensors and the outputs."""


def _on_the_path(
    model: onnx.ModelProto, kinds: frozenset[str], wrt: Sequence[str], outputs: Sequence[str]
) -> list[tuple[onnx.NodeProto, set[str]]]:
    """The main graph's standard nodes of ``kinds`` between ``wrt`` and ``outputs``, each
    with the names it reads that depend on ``wrt`` (what a subgraph reads from the outer
    graph counts as its node's input)."""
    found = [n for n in model.graph.node if n.op_type in kinds and n.domain in ("", "ai.onnx")]
    if not found:
        return []
    reached = descendants(model.graph, wrt)
    needed = ancestors(model.graph, outputs)
    return [
        (node, outer_reads(node) & reached)
        for node in found
        if outer_reads(node) & reached and needed.intersection(node.output)
    ]


def refuse_control_flow(model: onnx.ModelProto, wrt: Sequence[str], outputs: Sequence[str]) -> None:
    """Raise :class:`MissingGradientError` naming the first control-flow node between
    ``wrt`` and ``outputs`` (what its subgraphs read from the outer graph counts as its
    input), before a builder sees it.
    """
    for node, reads in _on_the_path(model, CONTROL_FLOW, wrt, outputs):
        raise MissingGradientError(
            f"{NAME} has no gradient for control flow: {node.op_type} node "
            f"{node.name or node.output[0]!r} lies between the trained weights and the "
            f"loss (through {sorted(reads)[:3]}), and its gradient builders "
            "abort the process on it. Keep the weights off the branch or loop (export "
            "the model with the branch taken, e.g. torch.jit.trace), or name other "
            "weights_to_train."
        )


def refuse_recurrent_beyond_kernels(
    model: onnx.ModelProto, wrt: Sequence[str], outputs: Sequence[str]
) -> None:
    """Raise :class:`MissingGradientError` naming the first ``LSTM`` or ``GRU`` between
    ``wrt`` and ``outputs`` that onnxruntime-training's gradient kernels cannot take:
    ``LSTMGrad`` and ``GRUGrad`` run the forward direction only, without
    ``sequence_lens`` or ``clip`` (onnxruntime fails to load the session otherwise, naming
    its kernel's assertion)."""
    for node, _ in _on_the_path(model, MODULE_BUILDER_ONLY, wrt, outputs):
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        direction = attrs.get("direction", b"forward").decode()
        inputs = list(node.input) + [""] * 5
        found = [f"direction={direction!r}"] if direction != "forward" else []
        found += ["sequence_lens"] * bool(inputs[4]) + ["clip"] * ("clip" in attrs)
        if found:
            raise MissingGradientError(
                f"{NAME}'s {node.op_type}Grad kernel takes the forward direction only, "
                f"without sequence_lens or clip: {node.op_type} node "
                f"{node.name or node.output[0]!r} has {', '.join(found)}." + NATIVE_HINT
            )


# -- gradient graphs -------------------------------------------------------------------------


def gradient_graph(model: onnx.ModelProto, output: str, wrt: Sequence[str]) -> onnx.ModelProto:
    """``model`` extended with ``<name>_grad`` = d ``output`` / d ``name`` for ``wrt``
    (GradientGraphBuilder), ``output`` being any float output.

    Raises:
        MissingGradientError: an operator on the path has no gradient.
    """
    wrt = list(wrt)
    refuse_control_flow(model, wrt, [output])
    model = _frozen_reads_apart(model, wrt, [])
    model, target = _float32_target(_isolate(model, wrt), output)
    grad = _build_gradient(model, target, wrt)
    if target != output:
        extra = next(o for o in grad.graph.output if o.name == target)
        grad.graph.output.remove(extra)
        lower_float32_only_ops(grad)
    return grad


def _build_gradient(model: onnx.ModelProto, target: str, wrt: list[str]) -> onnx.ModelProto:
    builder_cls = _capi().GradientGraphBuilder
    try:
        with tempfile.TemporaryDirectory() as folder:
            # without options, the builder logs at INFO (a 'GraphTransformer ... modified'
            # line per build); the options carry graphkit's severity (ort_engine)
            builder = builder_cls(
                model.SerializeToString(), {target}, set(wrt), target, session_options()
            )
            builder.build()
            path = os.path.join(folder, "gradient.onnx")
            builder.save(path)
            return onnx.load(path)
    except RuntimeError as exc:
        raise explain_builder_failure(exc, OTHER_BUILDER_HINT) from exc


def _isolate(model: onnx.ModelProto, wrt: list[str]) -> onnx.ModelProto:
    """Route each name of ``wrt`` through an Identity before its consumers.

    onnxruntime-training 1.19.2 emits ``<name>_grad`` twice (an invalid graph) when one
    node reads a differentiated input twice, as ``Mul(w, w)`` does.
    """
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    taken = graph_names(copy.graph)
    mapping = {name: fresh_name(f"{name}__read", taken) for name in wrt}
    for node in copy.graph.node:
        node.input[:] = [mapping.get(n, n) for n in node.input]
    nodes = [onnx.helper.make_node("Identity", [n], [m]) for n, m in mapping.items()]
    nodes.extend(copy.graph.node)
    del copy.graph.node[:]
    copy.graph.node.extend(nodes)
    return copy


def _float32_target(model: onnx.ModelProto, output: str) -> tuple[onnx.ModelProto, str]:
    """The model and the name of a float32 version of ``output`` to differentiate.

    onnxruntime-training 1.19.2 seeds the gradient of the differentiated output with a
    float32 tensor, so a float64 loss fails to build. Differentiating ``Cast(loss, float)``
    instead is exact: the seed is 1 and Cast's gradient casts it back to float64.
    """
    value = next(o for o in model.graph.output if o.name == output)
    if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
        return model, output
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    target = f"{output}__float32"
    copy.graph.node.append(
        onnx.helper.make_node("Cast", [output], [target], to=onnx.TensorProto.FLOAT)
    )
    shape = value.type.tensor_type.shape
    copy.graph.output.append(
        onnx.helper.make_tensor_value_info(
            target, onnx.TensorProto.FLOAT, [d.dim_value or d.dim_param or None for d in shape.dim]
        )
    )
    return copy, target


ModuleGraphs = ForwardBackwardGraphs
"""What ``OrtModuleGraphBuilder`` returns for one set of inputs needing gradients."""


def module_graphs(
    model: onnx.ModelProto, weights: Sequence[str], inputs_requiring_grad: Sequence[str]
) -> ModuleGraphs:
    """The forward graph and the gradient graph of ``model`` for the TrainingAgent, both
    in the names of ``model``.

    Raises:
        MissingGradientError: an operator on the path has no gradient.
    """
    outputs = [o.name for o in model.graph.output]
    refuse_control_flow(model, [*weights, *inputs_requiring_grad], outputs)
    refuse_recurrent_beyond_kernels(model, [*weights, *inputs_requiring_grad], outputs)
    model = _frozen_reads_apart(model, weights, inputs_requiring_grad)
    model, internal = _alphabetical_weights(model, weights)
    original = {v: k for k, v in internal.items()}
    try:
        graphs = _build_module(model, [internal[w] for w in weights], inputs_requiring_grad)
    except MissingGradientError as exc:  # in the user's names, not the builder's
        message = str(exc)
        for name, user in original.items():
            message = message.replace(f"'{name}'", f"'{user}'")
        raise MissingGradientError(message) from exc
    for graph in (graphs.forward.graph, graphs.gradient.graph):
        rename_tensors(graph, lambda n: original.get(n, n))
    graphs.initializer_names_to_train = [original[n] for n in graphs.initializer_names_to_train]
    return graphs


_FLOATS = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)


def _frozen_reads_apart(
    model: onnx.ModelProto, weights: Sequence[str], inputs_requiring_grad: Sequence[str]
) -> onnx.ModelProto:
    """``model`` where no frozen float initializer is read twice on the gradient path.

    Both builders define the gradient of such a tensor once per reader ("Duplicate
    definition of name (...weight_grad)") when a weight before it trains: a Llama
    exported by TorchScript, whose equal RMSNorm weights the exporter merged into one
    initializer read through an ``Identity`` per layer, failed so, and GPT-2 exported by
    dynamo with LoRA adapters (its frozen LayerNorm weights). Each ``Identity``
    of a frozen initializer is bypassed, and each further reader on the gradient path
    gets a tensor of its own: the same bytes under another name (a mapped tensor stays
    one mapping; an inline one is copied). A trained initializer is never read so:
    training unties it first (:func:`graphkit.parameters.untie_shared_parameters`).
    """
    frozen = {
        i.name: i
        for i in model.graph.initializer
        if i.name not in set(weights) and i.data_type in _FLOATS
    }
    outputs = {o.name for o in model.graph.output}
    alias = {
        n.output[0]: n.input[0]
        for n in model.graph.node
        if n.op_type == "Identity" and n.input[0] in frozen and n.output[0] not in outputs
    }
    out = copy_model(model)
    graph = out.graph
    nodes = [n for n in graph.node if not (n.op_type == "Identity" and n.output[0] in alias)]
    for node in nodes:
        node.input[:] = [alias.get(name, name) for name in node.input]
    on_path = descendants(graph, [*weights, *inputs_requiring_grad])
    taken = graph_names(graph)
    seen: set[str] = set()
    for node in nodes:
        if not on_path.intersection(node.output):
            continue
        for k, name in enumerate(node.input):
            if name not in frozen:
                continue
            if name in seen:
                copy = graph.initializer.add()
                copy.CopyFrom(frozen[name])
                copy.name = node.input[k] = fresh_name(f"{name}/read", taken)
            seen.add(name)
    del graph.node[:]
    graph.node.extend(nodes)
    return out


def _alphabetical_weights(
    model: onnx.ModelProto, weights: Sequence[str]
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``model`` with the trained weights renamed ``gkw00000``... and placed first, and
    ``{weight: its new name}``: ``OrtModuleGraphBuilder`` wants the trained initializers
    in alphabetical order of their position."""
    copy = copy_model(model)
    taken = graph_names(copy.graph)
    internal = {w: fresh_name(f"gkw{i:05d}", taken) for i, w in enumerate(weights)}
    rename_tensors(copy.graph, lambda n: internal.get(n, n))
    trained = {i.name: i for i in copy.graph.initializer if i.name in internal.values()}
    others = [i for i in copy.graph.initializer if i.name not in trained]
    initializers = [trained[internal[w]] for w in weights] + others
    del copy.graph.initializer[:]
    copy.graph.initializer.extend(initializers)
    return copy, internal


def _build_module(
    model: onnx.ModelProto, weights: Sequence[str], inputs_requiring_grad: Sequence[str]
) -> ModuleGraphs:
    C = _capi()
    config = C.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = list(weights)
    config.initializer_names_to_train = list(weights)
    config.input_names_require_grad = list(inputs_requiring_grad)
    config.build_gradient_graph = True
    config.loglevel = C.Severity(log_severity())  # its own logger, WARNING by default
    builder = C.OrtModuleGraphBuilder()
    try:
        builder.initialize(model.SerializeToString(), config)
        builder.build(C.TrainingGraphTransformerConfiguration())
    except RuntimeError as exc:
        raise explain_builder_failure(exc) from exc
    info = builder.get_graph_info()
    return ModuleGraphs(
        forward=onnx.load_from_string(builder.get_forward_model()),
        gradient=onnx.load_from_string(builder.get_gradient_model()),
        user_output_names=list(info.user_output_names),
        user_input_grad_names=dict(info.user_input_grad_names),
        initializer_names_to_train=list(info.initializer_names_to_train),
        initializer_grad_names_to_train=list(info.initializer_grad_names_to_train),
    )
