"""Which initializers of a graph are parameters to train, and which are constants.

Converters store everything as initializers: weights and biases, but also constants that
must never move (skl2onnx's ``unity`` in ``P(class 0) = unity - P(class 1)``, the
``0.5`` and ``sqrt(2)`` of an exported GELU, BatchNormalization's running statistics,
scaling constants). Training a constant gives silently wrong models, so the default
(``weights_to_train=None`` everywhere in graphkit) follows one rule, decided from the
graph:

    A float initializer is a **parameter** when, possibly through layout operators
    (Identity, Cast, Transpose, Reshape, Squeeze, Unsqueeze, Flatten) and the operators
    that cut or join pieces (Slice, Split, Concat), it is read

    * in a parameter slot of a parametric operator (:data:`PARAMETER_SLOTS`: the
      weights of MatMul, Gemm, Conv, ConvTranspose, Einsum, RNN/GRU/LSTM, the scale and
      bias of BatchNormalization and the other normalizations, the table of an
      embedding ``Gather``, PRelu's slope), or
    * as a **bias**: an operand of ``Add`` whose other operand comes from a linear
      operator (MatMul, Gemm, Conv, ConvTranspose, Einsum) or an embedding ``Gather``,
      possibly through other such Adds (a learned position added to a projection
      plus its bias, or to a token embedding), or
    * as an **affine scale or shift**: an operand of ``Mul`` or ``Add`` after a
      normalization (:data:`NORMALIZATIONS`): torch's GroupNorm exports as
      InstanceNormalization over the groups, then ``Mul`` and ``Add`` by its weight and
      bias (the InstanceNormalization's own ones and zeros are then constants); or
      after a normalization written out in arithmetic, ``x`` times or divided by a
      function of a mean of ``x``'s powers (:data:`NORMALIZING_MATH`): an RMSNorm
      (``x * rsqrt(mean(x^2) + eps)``, torch's ``nn.RMSNorm`` by dynamo, Llama's and
      T5's norms by both exporters) or a LayerNorm spelled out by an older exporter.
      A scalar operand there stays a constant (a fixed factor, not a per-feature scale).

    Every other float initializer is a **constant**.

Any float initializer can still be trained by naming it in ``weights_to_train``.
:func:`explain` says which role each initializer got and why.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from graphkit._graph import _subgraphs, all_graphs, constant_tensors, fresh_name, graph_names
from graphkit.tensor_store import tensor_value

FLOAT_ELEM_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)

PARAMETER_SLOTS: dict[str, tuple[int, ...]] = {
    "MatMul": (0, 1),
    "Gemm": (0, 1, 2),
    "Einsum": tuple(range(16)),
    "Conv": (1, 2),
    "ConvTranspose": (1, 2),
    "BatchNormalization": (1, 2),  # scale, bias; not input_mean / input_var (statistics)
    "LayerNormalization": (1, 2),
    "InstanceNormalization": (1, 2),
    "GroupNormalization": (1, 2),
    "Gather": (0,),  # an embedding table
    "RNN": (1, 2, 3),
    "GRU": (1, 2, 3),
    "LSTM": (1, 2, 3, 7),  # W, R, B, peepholes
    "PRelu": (1,),
}
"""Operator type -> positions of its inputs that hold learnable parameters."""

LINEAR_OPS = frozenset({"MatMul", "Gemm", "Einsum", "Conv", "ConvTranspose"})
"""Operators whose output a bias is added to."""

NORMALIZATIONS = frozenset(
    {
        "BatchNormalization",
        "InstanceNormalization",
        "LayerNormalization",
        "GroupNormalization",
        "MeanVarianceNormalization",
    }
)
"""Operators after which a ``Mul``/``Add`` operand is an affine scale or shift."""

NORMALIZING_MATH = frozenset(
    {"Add", "Sub", "Sqrt", "Reciprocal", "Pow", "Div", "Mul", "Max", "Clip", "Expand"}
)
"""What lies between a mean of a tensor's powers and the factor that normalizes the
tensor (``rsqrt(mean(x^2) + eps)``, ``sqrt(var + eps)``)."""

MEANS = frozenset({"ReduceMean", "ReduceSumSquare", "ReduceL2"})
"""Reductions a normalization written in arithmetic takes of its input."""

LAYOUT_OPS: dict[str, tuple[int, ...]] = {
    "Identity": (0,),
    "Cast": (0,),
    "Transpose": (0,),
    "Reshape": (0,),
    "Squeeze": (0,),
    "Unsqueeze": (0,),
    "Flatten": (0,),
}
"""Operators that move a tensor without changing what it is (the data input only)."""

PIECE_OPS: dict[str, tuple[int, ...]] = {
    "Slice": (0,),
    "Split": (0,),
    "Concat": tuple(range(64)),
}
"""Operators that cut a tensor into pieces or join pieces: a parameter's role flows
through them (torch's TorchScript exporter, without constant folding, reorders an LSTM's
gate weights with Slice and Concat before the LSTM reads them)."""

EMBEDDINGS = frozenset({"Gather"})
"""Operators whose output, like a linear operator's, a learned shift may be added to (a
learned position added to a token embedding)."""


class _Uses:
    """Where each tensor is read and what produces it, in the main graph and in its
    subgraphs (If branches, Loop and Scan bodies read the weights of the graph around
    them by name)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.readers: dict[str, list[tuple[onnx.NodeProto, int]]] = defaultdict(list)
        self.producer: dict[str, onnx.NodeProto] = {}
        self.index: dict[int, int] = {}  # id of a main-graph node object -> its position
        self.scalars = {
            init.name for init in graph.initializer if math.prod(init.dims) <= 1
        }  # at most one value: a fixed factor wherever it is read
        for i, node in enumerate(graph.node):
            # one pass: protobuf hands out a new wrapper object at every access, so the
            # node kept in ``readers`` must be the one whose id is indexed
            self.index[id(node)] = i
            self._add(node)
            for sub in _subgraphs(node):
                for inner in all_graphs(sub):
                    for nested in inner.node:
                        self._add(nested)

    def _add(self, node: onnx.NodeProto) -> None:
        for position, name in enumerate(node.input):
            if name:
                self.readers[name].append((node, position))
        for name in node.output:
            self.producer[name] = node

    def source_op(self, name: str) -> str | None:
        """The operator that really produced ``name``, looking through layout operators."""
        seen = set()
        while name in self.producer and name not in seen:
            seen.add(name)
            node = self.producer[name]
            if node.op_type not in LAYOUT_OPS:
                return node.op_type
            name = node.input[0]
        return None

    def roles(self, name: str) -> list[tuple[str, onnx.NodeProto, int]]:
        """``(role, reader, position)`` for every final reader of ``name``; role is
        ``"parameter"`` or ``"constant"``."""
        return [
            found
            for node, position in self.readers.get(name, [])
            for found in self.edge_roles(node, position)
        ]

    def edge_roles(
        self, node: onnx.NodeProto, position: int
    ) -> list[tuple[str, onnx.NodeProto, int]]:
        """The roles reached through one reader edge (layout operators are followed)."""
        standard = node.domain in ("", "ai.onnx")
        if standard and (
            position in LAYOUT_OPS.get(node.op_type, ())
            or position in PIECE_OPS.get(node.op_type, ())
        ):
            return [found for output in node.output for found in self.roles(output)]
        if standard and position in PARAMETER_SLOTS.get(node.op_type, ()):
            if node.op_type == "InstanceNormalization" and self.feeds_an_affine(node):
                return [("constant", node, position)]  # a GroupNorm's groups (see below)
            return [("parameter", node, position)]
        if standard and node.op_type in ("Add", "Mul") and len(node.input) == 2:
            other = node.input[1 - position]
            bias = node.op_type == "Add" and self.linear(other)
            affine = self.normalized(other) and self.origin(node.input[position]) not in (
                self.scalars
            )
            role = "parameter" if bias or affine else "constant"
            return [(role, node, position)]
        return [("constant", node, position)]

    def linear(self, name: str) -> bool:
        """Whether ``name`` is a linear operator's or an embedding's output, possibly
        plus shifts (``Add``s of it): what a learned bias or shift is added to (a
        projection's bias, then a learned position added to the projection)."""
        seen = set()
        while name not in seen:
            seen.add(name)
            source = self._source(name)
            if source is None:
                return False
            if source.op_type in LINEAR_OPS or source.op_type in EMBEDDINGS:
                return True
            if source.op_type != "Add" or len(source.input) != 2:
                return False
            # (x W + b) + p: follow the operand that is not an initializer of its own
            inputs = [i for i in source.input if i in self.producer]
            if len(inputs) != 1:
                return any(self.source_op(i) in LINEAR_OPS for i in source.input)
            name = inputs[0]
        return False

    def normalized(self, name: str) -> bool:
        """Whether ``name`` is a normalization's output, or its product by a scale: the
        operand of an affine ``Mul``/``Add`` after it is a scale or a shift."""
        source = self._source(name)
        if source is None:
            return False
        if source.op_type in NORMALIZATIONS or self.normalizes(source):
            return True
        return source.op_type == "Mul" and any(
            self.source_op(i) in NORMALIZATIONS
            or (self._source(i) is not None and self.normalizes(self._source(i)))  # type: ignore[arg-type]
            for i in source.input
        )

    def normalizes(self, node: onnx.NodeProto) -> bool:
        """Whether ``node`` is a normalization written in arithmetic: ``x * f`` or
        ``x / f`` where ``f`` comes, through :data:`NORMALIZING_MATH`, from a mean
        (:data:`MEANS`) of ``x`` or of a power of ``x`` (``x * x``, ``Pow(x, 2)``)."""
        if node.op_type not in ("Mul", "Div") or len(node.input) != 2:
            return False
        pairs = [(node.input[0], node.input[1])]
        if node.op_type == "Mul":
            pairs.append((node.input[1], node.input[0]))
        return any(self._mean_of(factor, self.origin(x)) for x, factor in pairs)

    def _mean_of(self, factor: str, x: str, depth: int = 8) -> bool:
        """Whether ``factor`` is computed from a mean of ``x``'s powers (a few nodes of
        :data:`NORMALIZING_MATH` at most)."""
        names = [(factor, 0)]
        while names:
            name, steps = names.pop()
            node = self.producer.get(name)
            if node is None or steps > depth:
                continue
            if node.op_type in MEANS and node.input:
                reduced = self.producer.get(self.origin(node.input[0]))
                powers = (
                    [self.origin(i) for i in reduced.input[: 1 if reduced.op_type == "Pow" else 2]]
                    if reduced is not None and reduced.op_type in ("Pow", "Mul")
                    else []
                )
                if x == self.origin(node.input[0]) or (powers and set(powers) == {x}):
                    return True
            elif node.op_type in NORMALIZING_MATH or node.op_type in LAYOUT_OPS:
                names.extend((i, steps + 1) for i in node.input if i)
            elif node.op_type == "CastLike":
                names.append((node.input[0], steps + 1))
        return False

    def origin(self, name: str) -> str:
        """``name`` with the layout operators that produced it looked through (a
        ``Cast`` to float32 and back, an ``Identity``)."""
        seen = set()
        while name in self.producer and name not in seen:
            seen.add(name)
            node = self.producer[name]
            if node.op_type not in LAYOUT_OPS and node.op_type != "CastLike":
                break
            name = node.input[0]
        return name

    def feeds_an_affine(self, node: onnx.NodeProto) -> bool:
        """Whether ``node``'s output, through layout operators, is multiplied: both
        exporters write torch's GroupNorm as InstanceNormalization over the groups (its
        scale and bias ones and zeros, no weights of torch's) then Mul and Add by the
        per-channel weight and bias, which are the parameters."""
        names = list(node.output)
        while names:
            for reader, position in self.readers.get(names.pop(), []):
                if reader.op_type in LAYOUT_OPS and position == 0:
                    names.extend(reader.output)
                elif reader.op_type == "Mul":
                    return True
        return False

    def reaches(self, node: onnx.NodeProto, targets: set[str]) -> bool:
        """Whether a result of ``node`` flows, through any readers, into ``targets``."""
        names, seen = list(node.output), set()
        while names:
            name = names.pop()
            if name in targets:
                return True
            if name in seen:
                continue
            seen.add(name)
            for reader, _ in self.readers.get(name, []):
                names.extend(reader.output)
        return False

    def _source(self, name: str) -> onnx.NodeProto | None:
        seen = set()
        while name in self.producer and name not in seen:
            seen.add(name)
            node = self.producer[name]
            if node.op_type not in LAYOUT_OPS:
                return node
            name = node.input[0]
        return None


def _float_initializers(onx: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [i for i in onx.graph.initializer if i.data_type in FLOAT_ELEM_TYPES]


def parameter_names(onx: onnx.ModelProto) -> list[str]:
    """The float initializers the rule above calls parameters, in graph order."""
    uses = _Uses(onx.graph)
    return [
        init.name
        for init in _float_initializers(onx)
        if any(role == "parameter" for role, _, _ in uses.roles(init.name))
    ]


def explain(onx: onnx.ModelProto) -> dict[str, str]:
    """``{float initializer: "parameter (...)" or "constant (...)"}``: the role given by
    the rule and the readers that decided it."""
    uses = _Uses(onx.graph)
    report = {}
    for init in _float_initializers(onx):
        roles = uses.roles(init.name)
        readers = ", ".join(sorted({f"{node.op_type} input {pos}" for _, node, pos in roles}))
        kind = "parameter" if any(r == "parameter" for r, _, _ in roles) else "constant"
        report[init.name] = f"{kind} (read by {readers or 'nothing'})"
    return report


def untie_constants(
    onx: onnx.ModelProto, trained: Iterable[str], loss_outputs: Iterable[str] = ()
) -> onnx.ModelProto:
    """A copy where a trained initializer no longer feeds constant roles.

    Exporters merge initializers with equal values: torch's TorchScript exporter writes a
    fresh BatchNorm's ``running_var = Identity(weight)`` because both are ones. Training
    ``weight`` would then move the running statistics too. Each constant-role reader of
    a trained initializer reads a frozen copy instead; parameter readers stay tied
    (tied embeddings keep training together).

    A reader whose results reach no output but ``loss_outputs`` is a term of the loss
    written on the weight itself, a penalty (``add_loss_output(..., penalty=...)``
    writes ``l2 * ReduceSum(w * w)``): it stays tied, or the penalty would be computed
    on the initial weights and never trained.
    """
    trained = set(trained)
    uses = _Uses(onx.graph)
    losses = set(loss_outputs)
    outputs = {o.name for o in onx.graph.output}
    model = onnx.ModelProto()
    model.CopyFrom(onx)
    taken = graph_names(model.graph)
    values = {i.name: i for i in model.graph.initializer}
    for name in sorted(trained & set(values)):
        direct_constant_readers = []
        for node, position in uses.readers.get(name, []):
            if id(node) not in uses.index:
                continue  # read inside a subgraph: left tied
            roles = [role for role, _, _ in uses.edge_roles(node, position)]
            if roles and all(role == "constant" for role in roles):
                if losses and not uses.reaches(node, outputs - losses):
                    continue  # a loss term on the weight itself: a penalty
                direct_constant_readers.append((node, position))
        if not direct_constant_readers or all(
            role == "constant" for role, _, _ in uses.roles(name)
        ):
            continue  # nothing to untie, or the user trains a constant on purpose
        copy = fresh_name(f"{name}.frozen", taken)
        frozen = numpy_helper.from_array(tensor_value(values[name]), copy)
        model.graph.initializer.append(frozen)
        for node, position in direct_constant_readers:
            model.graph.node[uses.index[id(node)]].input[position] = copy
    return model


def untie_shared_parameters(
    onx: onnx.ModelProto, trained: Iterable[str], keep: Iterable[str] = ()
) -> tuple[onnx.ModelProto, list[str]]:
    """``(copy, trained weights)`` where a trained initializer read by several parameter
    slots gives each reader after the first a copy of its own, ``<name>.1``,
    ``<name>.2``... (listed right after it); those in ``keep`` stay one weight.

    torch's TorchScript exporter merges initializers of equal value: a fresh network's
    two LayerNorm weights (ones) or several zero biases become one tensor, which
    training would then keep tied where torch trains them apart. Untying is what the
    trainers do by default. Weights torch ties (an embedding read through a Transpose
    by the output layer: :func:`graphkit.tied_weights.read_transposed`) are kept with
    ``tie_weights=True``, the default; every shared weight stays tied with
    ``untie_shared_weights=False``.
    """
    kept = set(keep)
    uses = _Uses(onx.graph)
    model = onnx.ModelProto()
    model.CopyFrom(onx)
    taken = graph_names(model.graph)
    values = {i.name: i for i in model.graph.initializer}
    bounds = _IntegerConstants(onx)
    weights: list[str] = []
    for name in trained:
        weights.append(name)
        slots = [
            (node, position)
            for node, position in uses.readers.get(name, [])
            if id(node) in uses.index  # the main graph's readers
            and any(role == "parameter" for role, _, _ in uses.edge_roles(node, position))
        ]
        if name not in values or len(slots) < 2 or name in kept:
            continue
        if _parts_of_one_tensor([node for node, _ in slots], bounds):
            continue
        # the name stays with a slot that reads it directly; readers through an alias
        # (TorchScript writes the merged tensor as "4.weight = Identity(1.weight)") copy
        slots.sort(key=lambda slot: slot[0].op_type in LAYOUT_OPS)
        for k, (node, position) in enumerate(slots[1:], start=1):
            copy = fresh_name(f"{name}.{k}", taken)
            model.graph.initializer.append(
                numpy_helper.from_array(tensor_value(values[name]), copy)
            )
            model.graph.node[uses.index[id(node)]].input[position] = copy
            weights.append(copy)
    return model, weights


class _IntegerConstants:
    """The small integer constants of a graph (``Slice`` bounds), those computed from
    static axes of symbolic-batch tensors too (dynamo writes an LSTM's gate slices up to
    ``k * Shape(h0, start=2)``): evaluated once, when first asked for."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        self.values: dict[str, np.ndarray] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self._values()

    def __getitem__(self, name: str) -> np.ndarray:
        return self._values()[name]

    def _values(self) -> dict[str, np.ndarray]:
        if self.values is None:
            from graphkit.static_shapes.shape_constants import (
                integer_arithmetic_as_constants,
                known_parts_as_constants,
            )

            resolved = onnx.ModelProto()
            resolved.CopyFrom(self.model)
            known_parts_as_constants(resolved)
            integer_arithmetic_as_constants(resolved)
            integers = (TensorProto.INT64, TensorProto.INT32)
            self.values = {
                name: tensor_value(t)
                for name, t in constant_tensors(resolved.graph)
                if t.data_type in integers and math.prod(t.dims) <= 64
            }
        return self.values


def _parts_of_one_tensor(readers: list[onnx.NodeProto], constants: _IntegerConstants) -> bool:
    """Whether ``readers`` are ``Slice`` s of one tensor along one axis, with constant
    bounds, no two of which overlap: the parts of one parameter, not copies of a merged
    initializer. torch's export of an ``nn.LSTM`` or ``nn.GRU`` reorders its gates so;
    untying the parts would train each in a copy of its own, leaving the weight's own
    name with one part trained (the model's function is the same, its state is not)."""
    ranges: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for node in readers:
        inputs = list(node.input) + [""] * (5 - len(node.input))
        if node.op_type != "Slice" or not all(i in constants for i in inputs[1:4]):
            return False
        if inputs[4] and not np.all(constants[inputs[4]] == 1):
            return False
        starts, ends, axes = (constants[i].reshape(-1) for i in inputs[1:4])
        if len(axes) != 1 or min(starts[0], ends[0]) < 0:
            return False  # negative bounds need the tensor's extent: not worth it here
        ranges[int(axes[0])].append((int(starts[0]), int(ends[0])))
    if len(ranges) != 1:
        return False
    (spans,) = ranges.values()
    spans.sort()
    return all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


__all__ = [
    "PARAMETER_SLOTS",
    "explain",
    "parameter_names",
    "untie_constants",
    "untie_shared_parameters",
]
