"""Run the training algorithm an ONNX model carries in ``ModelProto.training_info``.

ONNX can store how to keep training a model next to the model itself
(``TrainingInfoProto``, see onnx.proto): an *algorithm* graph whose nodes may read the
inference graph's tensors, computing new values that ``update_binding`` assigns to
initializers after each run, and an *initialization* graph that resets some of them.
:func:`graphkit.training.export.export_training_info` writes one; this module executes it
with plain onnxruntime or ``onnx.reference``, so it needs only onnx and numpy (it can be
loaded from its file where graphkit itself is not installed)::

    model, outputs = run_training_info(model, batches, runtime="reference")
    outputs[-1]["loss"]        # the last batch's loss; model holds the new weights

``onnx.checker`` does not check the bindings; :func:`check_training_info` does.

An exported training step or epoch (:func:`graphkit.training.export.export_training_step`)
carries the initial values of its resident inputs (weights, optimizer state, ``step``,
``loss_sum``) the same way: as the outputs of TrainingInfoProto 0's initialization graph;
:func:`initial_state` reads them and :func:`set_initial_state` writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper


class TrainingInfoError(ValueError):
    """A TrainingInfoProto whose bindings or graphs do not fit the model."""


def _initializers(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in graph.initializer}


def check_training_info(model: onnx.ModelProto, index: int = 0) -> onnx.TrainingInfoProto:
    """The ``index``-th TrainingInfoProto, its bindings checked.

    Raises:
        TrainingInfoError: no training info, or bindings that name tensors which do not
            exist (update keys must be initializers of the inference or algorithm graph,
            values outputs of the algorithm; likewise for the initialization).
    """
    if len(model.training_info) <= index:
        raise TrainingInfoError(
            f"The model carries {len(model.training_info)} TrainingInfoProto; index {index} "
            "does not exist. Export one with graphkit.training.export.export_training_info."
        )
    info = model.training_info[index]
    mutable = set(_initializers(model.graph)) | set(_initializers(info.algorithm))
    problems = []
    for label, bindings, graph in (
        ("update_binding", info.update_binding, info.algorithm),
        ("initialization_binding", info.initialization_binding, info.initialization),
    ):
        outputs = {o.name for o in graph.output}
        for entry in bindings:
            if entry.key not in mutable:
                problems.append(f"{label} key {entry.key!r} is not an initializer")
            if entry.value not in outputs:
                problems.append(f"{label} value {entry.value!r} is not an output of its graph")
    if problems:
        raise TrainingInfoError(
            f"TrainingInfoProto {index} does not fit the model: {'; '.join(problems)}."
        )
    return info


def training_graph(model: onnx.ModelProto, index: int = 0) -> onnx.ModelProto:
    """The inference graph and the algorithm graph combined (as onnx.proto defines), with
    every bound initializer turned into an input so that a loop can feed its value."""
    info = check_training_info(model, index)
    bound = {entry.key for entry in info.update_binding}
    graph = onnx.GraphProto()
    graph.name = f"{model.graph.name}_training"
    for part in (model.graph, info.algorithm):
        graph.node.extend(part.node)
        graph.input.extend(part.input)
        graph.value_info.extend(part.value_info)
        for tensor in part.initializer:
            if tensor.name in bound:
                graph.input.append(
                    onnx.helper.make_tensor_value_info(tensor.name, tensor.data_type, tensor.dims)
                )
            else:
                graph.initializer.append(tensor)
    graph.output.extend(info.algorithm.output)
    combined = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    combined.ir_version = model.ir_version
    return combined


def reattach(original: onnx.ModelProto, transformed: onnx.ModelProto) -> onnx.ModelProto:
    """``transformed`` with ``original``'s training information put back.

    onnx's version converter, onnx_ir and onnxscript's optimizer drop
    ``ModelProto.training_info``; this restores it, then checks that the bindings still
    name tensors of the transformed model (an optimizer that renamed or folded an
    initializer the algorithm updates makes this raise :class:`TrainingInfoError`).
    """
    out = onnx.ModelProto()
    out.CopyFrom(transformed)
    del out.training_info[:]
    out.training_info.extend(original.training_info)
    for index in range(len(out.training_info)):
        check_training_info(out, index)
    return out


def set_initial_state(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> None:
    """Make ``values`` the initial state of an exported training step or epoch, in place.

    They become the outputs of TrainingInfoProto 0's initialization graph (ONNX's "graph
    to compute the initial tensors upon starting the training process"): a graph without
    inputs of ``Constant`` nodes, one output per resident input, named like the input.
    Its ``algorithm`` is empty and it has no ``initialization_binding`` (bindings assign
    initializers of the main graph, and the resident inputs have none: an initializer
    named like an input would be its default, which onnxruntime reports with one warning
    each, "Initializer X appears in graph inputs..."). Any earlier training info is
    replaced.
    """
    nodes, outputs = [], []
    for name, value in values.items():
        value = np.asarray(value)
        nodes.append(
            onnx.helper.make_node(
                "Constant",
                [],
                [name],
                name=f"initial/{name}",
                value=numpy_helper.from_array(value, name),
            )
        )
        outputs.append(
            onnx.helper.make_tensor_value_info(
                name, onnx.helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)
            )
        )
    info = onnx.TrainingInfoProto()
    info.initialization.CopyFrom(
        onnx.helper.make_graph(nodes, "graphkit_initial_state", [], outputs)
    )
    info.algorithm.CopyFrom(onnx.helper.make_graph([], "no_algorithm", [], []))
    del model.training_info[:]
    model.training_info.append(info)


def initial_state(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """The initial values of an exported training step's or epoch's resident inputs.

    They are the outputs of TrainingInfoProto 0's initialization graph, ``Constant``
    nodes named like the inputs (:func:`set_initial_state`). A step exported before
    graphkit wrote them there has none: its resident inputs default to initializers of
    the same name, which are returned instead.
    """
    inputs = {i.name for i in model.graph.input}
    if model.training_info:
        init = model.training_info[0].initialization
        produced = {o.name for o in init.output}
        values = {}
        for node in init.node:
            if node.op_type != "Constant" or node.output[0] not in produced:
                continue
            for attribute in node.attribute:
                if attribute.name == "value":
                    values[node.output[0]] = numpy_helper.to_array(attribute.t)
        if values:
            return values
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name in inputs}


def session(model: onnx.ModelProto, runtime: str) -> Any:
    """``feeds -> outputs`` for ``model`` on ``"reference"`` or ``"onnxruntime"``."""
    if runtime == "reference":
        from onnx.reference import ReferenceEvaluator

        evaluator = ReferenceEvaluator(model)
        return lambda feeds: evaluator.run(None, feeds)
    if runtime == "onnxruntime":
        try:
            from graphkit.engine import ort_engine
        except ImportError:  # this file loaded on its own, where graphkit is not installed
            import onnxruntime as ort

            severity = 3
        else:  # imported after graphkit.runtime_check finds one complete build installed
            ort, severity = ort_engine.onnxruntime(), ort_engine.log_severity()

        # steps exported before graphkit wrote their initial state as TrainingInfoProto
        # default their resident inputs to initializers, which onnxruntime reports one
        # warning each for ('Initializer X appears in graph inputs'): only errors are
        # logged, unless GRAPHKIT_ORT_LOG_SEVERITY asks for more
        options = ort.SessionOptions()
        options.log_severity_level = severity
        session = ort.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        return lambda feeds: session.run(None, feeds)
    raise ValueError(f"runtime must be 'reference' or 'onnxruntime', got {runtime!r}.")


def initialize(
    model: onnx.ModelProto, index: int = 0, runtime: str = "reference"
) -> onnx.ModelProto:
    """A copy of ``model`` with the initialization graph's outputs bound (the optimizer
    state reset, for graphkit's exports)."""
    info = check_training_info(model, index)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    if not info.initialization_binding:
        return out
    init = onnx.helper.make_model(info.initialization, opset_imports=list(model.opset_import))
    init.ir_version = model.ir_version
    values = dict(zip([o.name for o in init.graph.output], session(init, runtime)({})))
    _assign(out, index, {e.key: values[e.value] for e in info.initialization_binding})
    return out


def _assign(model: onnx.ModelProto, index: int, values: Mapping[str, np.ndarray]) -> None:
    for graph in (model.graph, model.training_info[index].algorithm):
        for tensor in graph.initializer:
            if tensor.name in values:
                tensor.CopyFrom(
                    numpy_helper.from_array(np.asarray(values[tensor.name]), tensor.name)
                )


def run_training_info(
    model: onnx.ModelProto,
    batches: Iterable[Mapping[str, np.ndarray]],
    runtime: str = "reference",
    index: int = 0,
) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """Run the training algorithm once per batch, applying ``update_binding`` after each.

    Args:
        model: a model with ``training_info``.
        batches: feeds for the graph inputs the algorithm needs (features, labels...).
        runtime: ``"reference"`` (onnx.reference) or ``"onnxruntime"``.

    Returns:
        The model with its initializers updated, and each run's outputs that no binding
        consumes (the batch loss for graphkit's exports).
    """
    info = check_training_info(model, index)
    combined = training_graph(model, index)
    run = session(combined, runtime)
    names = [o.name for o in combined.graph.output]
    bound = {e.key: e.value for e in info.update_binding}
    consumed = set(bound.values())
    initial = {**_initializers(model.graph), **_initializers(info.algorithm)}
    values = {k: numpy_helper.to_array(initial[k]) for k in bound}
    history = []
    for batch in batches:
        out = dict(zip(names, run({**batch, **values})))
        values = {k: out[v] for k, v in bound.items()}
        history.append({n: v for n, v in out.items() if n not in consumed})
    result = onnx.ModelProto()
    result.CopyFrom(model)
    _assign(result, index, values)
    return result, history
