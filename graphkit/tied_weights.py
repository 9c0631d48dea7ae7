"""Weights torch ties, trained as one.

GPT-2's input embedding (``wte``, [V, D], read by a ``Gather``) and its output
projection (``lm_head``) are one torch parameter. torch's exporters write the
projection's ``x @ W.T`` in one of two ways:

* a ``Transpose`` of the one initializer (dynamo with ``optimize=False``, TorchScript
  without constant folding): one initializer read by a ``Gather`` and by a
  ``Transpose``;
* with the ``Transpose`` folded, a second initializer holding the embedding's transpose
  ([D, V], read by a ``MatMul``: TorchScript's ``onnx::MatMul_1234``, dynamo's
  ``val_151``).

Trained as written, the second would be a weight of its own, and the first would be
untied by :func:`graphkit.parameters.untie_shared_parameters` (which gives each parameter
slot of a tensor an exporter merged a copy): two weights where torch trains one.
:func:`tie_transposed_copies` writes the folded copy back as ``Transpose(A)``, so that
both cases read one initializer both directly and through a ``Transpose``;
:func:`read_transposed` names the weights so read, which training keeps as one weight
(both gradients summed, as torch sums them). ``tie_weights=False`` trains them apart.

What is taken for one torch parameter, and why no more:

* a rank-2 float tensor equal, element for element, to the transpose of another of the
  same dtype. Folding a ``Transpose`` writes exactly that; two distinct parameters never
  hold it unless made so on purpose. Rank 2 only: a vector is its own transpose (two
  equal biases are as often two parameters as one), and what an exporter folds is a
  matrix's transpose;
* never a tensor whose elements are all equal (a fresh LayerNorm's ones, zero biases, a
  one-element tensor): exporters merge those between distinct torch parameters, and two
  of them of transposed shapes are each other's transpose by coincidence, not because
  torch tied them;
* never a symmetric matrix (an identity-initialized one): it is its own transpose, so
  an equal copy of it would pass for a transposed one, and equal copies are not ties;
* never an equal copy (same shape, same values): the layers of
  ``torch.nn.TransformerEncoder`` are deep copies of one layer, distinct parameters of
  equal values, which dynamo with ``optimize=False`` writes as separate equal
  initializers (and the other exports merge into one tensor read the same way by both
  layers, which untying gives back): tying equal copies would train them as one.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np
import onnx
from onnx import helper

from graphkit._graph import copy_model, fresh_name, graph_names
from graphkit.parameters import FLOAT_ELEM_TYPES, _Uses, untie_shared_parameters
from graphkit.tensor_store import tensor_value

PROBE = 4
"""Values read from each end of a matrix's first and last rows and columns, to tell
which tensors may be each other's transpose before comparing them whole."""


def tie_transposed_copies(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``(model, {copy: weight})``: each float initializer ``B`` of the main graph that
    is the exact transpose of an earlier one ``A`` (see the module docstring) is removed,
    and a node ``B = Transpose(A)`` put first in the graph, so that ``B``'s readers (in
    subgraphs too) read ``A``. ``model`` itself when there is none, else a copy.

    The comparison is cheap: tensors are grouped by dtype and sorted shape, then matched
    on a few values at their corners (a memory-mapped tensor is read there only); the
    tensors of a match are compared whole, once.
    """
    graph = model.graph
    overridable = {i.name for i in graph.input}  # an initializer a feed may replace
    groups: dict[tuple[int, tuple[int, ...]], list[onnx.TensorProto]] = defaultdict(list)
    for tensor in graph.initializer:
        if (
            tensor.data_type in FLOAT_ELEM_TYPES
            and len(tensor.dims) == 2
            and min(tensor.dims) >= 1
            and max(tensor.dims) >= 2
            and tensor.name not in overridable
        ):
            groups[(tensor.data_type, tuple(sorted(tensor.dims)))].append(tensor)
    ties: dict[str, str] = {}
    for tensors in groups.values():
        if len(tensors) < 2:
            continue
        seen: dict[bytes, list[onnx.TensorProto]] = defaultdict(list)  # probe -> tensors
        for tensor in tensors:
            value = tensor_value(tensor)
            original = next(
                (
                    other
                    for other in seen.get(_probe(value.T), [])
                    if is_transposed_copy(tensor_value(other), value)
                ),
                None,
            )
            if original is not None:
                ties[tensor.name] = original.name
            else:
                seen[_probe(value)].append(tensor)
    if not ties:
        return model, ties
    out = copy_model(model)
    kept = [t for t in out.graph.initializer if t.name not in ties]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    taken = graph_names(out.graph)
    nodes = [
        helper.make_node(
            "Transpose", [weight], [copy], name=fresh_name(f"{copy}.tied", taken), perm=[1, 0]
        )
        for copy, weight in ties.items()
    ]
    rest = list(out.graph.node)
    del out.graph.node[:]
    out.graph.node.extend([*nodes, *rest])
    return out, ties


def is_transposed_copy(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``b`` is exactly ``a``'s transpose and ``a`` one torch parameter's value:
    rank 2, at least two distinct values, not symmetric (see the module docstring)."""
    return (
        a.ndim == 2
        and a.dtype == b.dtype
        and b.shape == a.shape[::-1]
        and np.array_equal(a.T, b)
        and _parameter_like(a)
    )


def read_transposed(model: onnx.ModelProto, weights: Iterable[str]) -> list[str]:
    """The ``weights`` read by parameter slots of the main graph both through a
    ``Transpose`` and otherwise (an embedding table and the output projection reading
    its transpose), whose value is one torch parameter's (rank 2, at least two distinct
    values, not symmetric): :func:`graphkit.parameters.untie_shared_parameters` keeps
    each as one weight."""
    uses = _Uses(model.graph)
    values = {t.name: t for t in model.graph.initializer}
    found = []
    for name in weights:
        if name not in values or len(values[name].dims) != 2:
            continue
        slots = [
            node
            for node, position in uses.readers.get(name, [])
            if id(node) in uses.index
            and any(role == "parameter" for role, _, _ in uses.edge_roles(node, position))
        ]
        transposes = sum(node.op_type == "Transpose" for node in slots)
        if 0 < transposes < len(slots) and _parameter_like(tensor_value(values[name])):
            found.append(name)
    return found


def tied_names(
    weights_to_train: Sequence[str] | str | None, ties: dict[str, str]
) -> Sequence[str] | str | None:
    """``weights_to_train`` with each copy :func:`tie_transposed_copies` removed named
    by the weight it reads (once)."""
    if weights_to_train is None or not ties:
        return weights_to_train
    if isinstance(weights_to_train, str):
        return ties.get(weights_to_train, weights_to_train)
    return list(dict.fromkeys(ties.get(name, name) for name in weights_to_train))


def shared_as_trained(
    model: onnx.ModelProto,
    weights: Iterable[str],
    tie_weights: bool,
    untie_shared_weights: bool,
) -> onnx.ModelProto:
    """``model`` (a prediction graph) with its shared weights tied and untied as
    :func:`graphkit.prepare.prepare_for_training` ties and unties them, so that every
    trained weight among ``weights`` is one of its initializers (the trained weights are
    then written into it)."""
    if tie_weights:
        model = tie_transposed_copies(model)[0]
    if not untie_shared_weights:
        return model
    present = {t.name for t in model.graph.initializer}
    trained = [w for w in weights if w in present]
    keep = read_transposed(model, trained) if tie_weights else []
    return untie_shared_parameters(model, trained, keep)[0]


def _probe(value: np.ndarray) -> bytes:
    """A few values at the corners of a matrix, and its shape: equal for two tensors
    that may be equal (``_probe(a.T) == _probe(b)`` for ``b`` that may be ``a.T``)."""
    k = PROBE
    parts = [value[0, :k], value[:k, 0], value[-1, -k:], value[-k:, -1]]
    return repr(value.shape).encode() + b"".join(np.ascontiguousarray(p).tobytes() for p in parts)


def _parameter_like(value: np.ndarray) -> bool:
    """At least two distinct values, and not a symmetric matrix."""
    if value.size < 2 or not value.min() < value.max():
        return False
    square = value.ndim == 2 and value.shape[0] == value.shape[1]
    return not (square and np.array_equal(value, value.T))


__all__ = [
    "is_transposed_copy",
    "read_transposed",
    "shared_as_trained",
    "tie_transposed_copies",
    "tied_names",
]
