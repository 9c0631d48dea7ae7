"""``If`` nodes whose condition is a constant, replaced by the branch they take.

Exporters write some choices made at export time as ``If`` nodes on constants. The
README's dynamo recipe (``optimize=False``) exports ``nn.EmbeddingBag`` so: its mode and
``include_last_offset`` are chosen by ``If`` nodes nested three deep in a ``Loop``'s body.
onnxruntime's constant folding (1.19.2 to 1.32) dies of a segmentation fault on that
graph, loading the model or a gradient graph of it; with the branches inlined first there
is no such ``If`` left to fold, and the ``Loop`` is the one dynamo's optimizer writes
(which :mod:`graphkit.sequences` takes apart).

A condition is evaluated (``onnx.reference``, one node at a time) from ``Constant``
nodes and integer or boolean initializers only, through standard nodes without
subgraphs, on at most :data:`MAX_ELEMENTS` elements: a float initializer may be a weight
that training changes, so nothing computed from one is ever taken for a constant.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import (
    _subgraphs,
    all_graphs,
    copy_model,
    fresh_name,
    graph_names,
    rename_tensors,
)

RANDOM = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli",
     "Multinomial", "Dropout"}
)  # fmt: skip
"""Operators whose result is drawn anew at each run: never taken for a constant (a branch
chosen by one draw would be chosen for every run)."""

MAX_ELEMENTS = 8192
"""The largest input or output (in elements) a condition is computed through."""

_FLOATS = {
    onnx.TensorProto.FLOAT,
    onnx.TensorProto.DOUBLE,
    onnx.TensorProto.FLOAT16,
    onnx.TensorProto.BFLOAT16,
}


def constant_branches_taken(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every ``If`` whose condition is a constant replaced by the nodes of
    the branch it takes (a copy where one is; ``model`` itself otherwise)."""
    if not any(n.op_type == "If" for g in all_graphs(model.graph) for n in g.node):
        return model
    out = copy_model(model)
    taken = graph_names(out.graph)
    return out if _inline(out.graph, {}, taken) else model


def _inline(graph: onnx.GraphProto, outer: Mapping[str, np.ndarray], taken: set[str]) -> bool:
    """Inlines the constant ``If`` nodes of ``graph`` and of its subgraphs in place, the
    values of ``outer`` known; whether any was."""
    known = dict(outer)
    fed = {i.name for i in graph.input}
    for tensor in graph.initializer:
        if tensor.name not in fed and tensor.data_type not in _FLOATS:
            known[tensor.name] = numpy_helper.to_array(tensor)
    changed = False
    nodes: list[onnx.NodeProto] = []
    pending = deque(graph.node)
    while pending:
        node = pending.popleft()
        if node.op_type == "If" and node.domain in ("", "ai.onnx") and node.input[0] in known:
            branch = _branch(node, bool(np.asarray(known[node.input[0]]).reshape(-1)[0]))
            pending.extendleft(reversed(_as_nodes(branch, node, graph, taken)))
            changed = True
            continue
        for sub in _subgraphs(node):
            changed |= _inline(sub, known, taken)
        _evaluate(node, known)
        nodes.append(node)
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _branch(node: onnx.NodeProto, condition: bool) -> onnx.GraphProto:
    wanted = "then_branch" if condition else "else_branch"
    return next(a.g for a in node.attribute if a.name == wanted)


def _as_nodes(
    branch: onnx.GraphProto, node: onnx.NodeProto, graph: onnx.GraphProto, taken: set[str]
) -> list[onnx.NodeProto]:
    """The branch's nodes, its initializers moved into ``graph``, each of its results
    bound to the ``If``'s output by an ``Identity`` (a result may be an outer tensor)."""
    own = {t.name for t in branch.initializer} | {o for n in branch.node for o in n.output}
    # the branch's names stay its own once inlined: none may be read or defined outside it
    outside = taken - graph_names(branch) | {o for n in graph.node for o in n.output}
    clashes = {name: fresh_name(name, taken) for name in own if name in outside}
    if clashes:
        rename_tensors(branch, lambda name: clashes.get(name, name))
    graph.initializer.extend(branch.initializer)
    results = [
        helper.make_node("Identity", [value.name], [name], name=fresh_name(f"{name}/taken", taken))
        for value, name in zip(branch.output, node.output)
        if name
    ]
    return [*branch.node, *results]


def _evaluate(node: onnx.NodeProto, known: dict[str, np.ndarray]) -> None:
    """Adds ``node``'s outputs to ``known`` where it computes them from known values of
    at most :data:`MAX_ELEMENTS` elements, a ``Constant`` its value (a node that fails to
    evaluate adds nothing: it is left for onnxruntime)."""
    if node.domain not in ("", "ai.onnx") or node.op_type in RANDOM:
        return
    inputs = [i for i in node.input if i]
    if any(True for _ in _subgraphs(node)) or not all(i in known for i in inputs):
        return
    if any(np.asarray(known[i]).size > MAX_ELEMENTS for i in inputs):
        return
    from onnx.reference import ReferenceEvaluator

    try:
        values = ReferenceEvaluator(node).run(None, {i: known[i] for i in inputs})
    except Exception:  # noqa: BLE001 - an operator onnx.reference lacks stays unevaluated
        return
    for name, value in zip(node.output, values):
        if name and np.asarray(value).size <= MAX_ELEMENTS:
            known[name] = np.asarray(value)


__all__ = ["MAX_ELEMENTS", "RANDOM", "constant_branches_taken"]
