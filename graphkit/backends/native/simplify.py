"""The native gradient graphs' layout plumbing, removed once shapes are static.

onnx-ad gives every derivative a trailing axis of seed directions and moves it with
``Transpose``, ``Unsqueeze``, ``Reshape`` and ``Squeeze`` around each rule; graphkit
always seeds one direction, so after :func:`graphkit.static_shapes.specialize` that
axis has size 1 and most of the plumbing moves no data. Each kernel still costs a call
(about a microsecond on the CPU), which is most of a small model's step. :func:`simplify`
rewrites, on the main graph:

* a ``Transpose`` of a ``Transpose``: one ``Transpose`` (none when they cancel);
* a ``Transpose`` that moves only axes of size 1: a ``Reshape``;
* a ``Reshape``/``Squeeze``/``Unsqueeze``/``Flatten`` of the result of another: one
  ``Reshape`` of the first one's input (the first stays for its other readers);
* a ``Reshape`` (or ``Identity``) whose input already has its output's shape: nothing,
  its readers read the input;
* an elementwise operator (or an ``Expand``, or a ``Concat`` along an axis before them)
  whose result ends in axes of size 1 (the seed axis), a reduction whose input does and
  that does not reduce them, or a ``MatMul`` whose result starts with them (the seed
  axis moved first), whose inputs were given those axes by a ``Reshape`` (or are
  constants, scalars, or graph inputs: a Scan body's carried gradients), where the
  readers of its result take a Reshape for free: the same operator on the inputs
  without them, one ``Reshape`` after it, which the readers' own ``Reshape`` then
  cancels (``Reshape -> Mul -> Reshape`` around each elementwise rule; onnxruntime's
  broadcasting loops run element by element over a last axis of size 1: a
  LayerNormalization's gradient in a transformer, 2.2 ms a batch with it);
* a ``Reshape`` no node reads any more: nothing;
* the mean and ``1 / sqrt(var + eps)`` that onnx-ad's ``LayerNormalization`` adjoint
  computes again: the forward node's own ``Mean`` and ``InvStdDev`` outputs (a
  transformer's step, 339 -> 315 kernels).

Every rewrite keeps the values: only where data sits in memory changes (and, for the
last, which kernel rounds the statistics), never the formula.
It is the native backend's entry in ``constant_folds`` (run by ``specialize``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import fresh_name, graph_names, outer_reads, read_counts, rename_reads
from graphkit.static_shapes import REDUCTIONS, matmul_transposes, static_shapes, transpose_perm
from graphkit.tensor_store import tensor_value

_RESHAPES = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten"})


def simplify(model: onnx.ModelProto) -> bool:
    """Apply the rewrites of the module docstring in place; whether any applied."""
    # one shape inference: every rewrite keeps the shape of each tensor it leaves
    shapes = static_shapes(model)
    changed = False
    rewrites = (
        _compose_transposes,
        _transposes_as_reshapes,
        _sink_reshapes,
        _merge_reshapes,
        _drop_no_ops,
        _full_reductions_of_reshapes,
        _drop_unread_reshapes,
        _reuse_layer_norm_statistics,
    )
    progress = True
    while progress:  # one rewrite opens the way to another (a sunk Reshape to a merge)
        progress = False
        for rewrite in rewrites:
            while rewrite(model, shapes):
                changed = progress = True
    return changed


_ELEMENTWISE = frozenset(
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Max",
        "Min",
        "Sum",
        "Where",
        "Greater",
        "Less",
        "Equal",
        "GreaterOrEqual",
        "LessOrEqual",
        "And",
        "Or",
        "Not",
        "Neg",
        "Abs",
        "Relu",
        "Sigmoid",
        "Tanh",
        "Exp",
        "Log",
        "Sqrt",
        "Reciprocal",
        "Cast",
        "Erf",
        "Sign",
    }
)
"""Operators that compute each element from the elements at the same (broadcast)
position, whatever the rank: dropping trailing axes of size 1 from the result and from
every input keeps their values."""


_ONE_DATA_INPUT = REDUCTIONS | {"Expand"}
"""Operators whose first input only holds data (the others: axes, a shape)."""


def _readers(graph: onnx.GraphProto) -> dict[str, int]:
    return read_counts(graph.node, (o.name for o in graph.output))


def _compose_transposes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)
    touched: set[int] = set()
    dropped = []
    for node in list(graph.node):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        inner = producer.get(node.input[0])
        if inner is None or inner.op_type != "Transpose" or inner.input[0] not in shapes:
            continue
        if id(inner) in touched or id(node) in touched:
            continue
        rank = len(shapes[inner.input[0]])
        first, second = transpose_perm(inner, rank), transpose_perm(node, rank)
        composed = [first[p] for p in second]
        del node.attribute[:]
        node.attribute.append(helper.make_attribute("perm", composed))
        node.input[0] = inner.input[0]
        touched.update((id(inner), id(node)))
        if readers.get(inner.output[0], 0) == 1:
            dropped.append(inner)
    for inner in dropped:
        graph.node.remove(inner)
    return bool(touched)


def _transposes_as_reshapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    taken = graph_names(graph)
    fused = matmul_transposes(graph, shapes)
    changed = False
    for index, node in enumerate(graph.node):
        if node.op_type != "Transpose" or node.input[0] not in shapes:
            continue
        if node.output[0] in fused:
            continue
        shape = shapes[node.input[0]]
        perm = transpose_perm(node, len(shape))
        moved = [p for p in perm if shape[p] != 1]
        if moved != sorted(moved):
            continue  # real data movement
        target = fresh_name(f"{node.output[0]}/shape", taken)
        graph.initializer.append(
            numpy_helper.from_array(np.array([shape[p] for p in perm], np.int64), target)
        )
        graph.node[index].CopyFrom(
            helper.make_node("Reshape", [node.input[0], target], list(node.output), name=node.name)
        )
        changed = True
    return changed


def _merge_reshapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers = _readers(graph)
    taken = graph_names(graph)
    touched: set[int] = set()
    dropped = []
    for node in list(graph.node):
        if node.op_type not in _RESHAPES or node.output[0] not in shapes:
            continue
        inner = producer.get(node.input[0])
        if inner is None or inner.op_type not in _RESHAPES:
            continue
        if {id(inner), id(node)} & touched:
            continue
        target = fresh_name(f"{node.output[0]}/shape", taken)
        graph.initializer.append(
            numpy_helper.from_array(np.array(shapes[node.output[0]], np.int64), target)
        )
        node.CopyFrom(
            helper.make_node("Reshape", [inner.input[0], target], list(node.output), name=node.name)
        )
        touched.update((id(inner), id(node)))
        if readers.get(inner.output[0], 0) == 1:  # else its other readers keep it
            dropped.append(inner)
    for inner in dropped:
        graph.node.remove(inner)
    return bool(touched)


def _sink_reshapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    constants = {t.name: t for t in graph.initializer}
    taken = graph_names(graph)
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in outer_reads(node):
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    inputs = {i.name for i in graph.input}
    views: dict[tuple[str, tuple[int, ...]], str] = {}  # (tensor, shape) -> its Reshape

    def lets_through(name: str) -> bool:
        """Whether a scalar, a constant, a Reshape's result, or the result of a node that
        can sink itself: what a node can read without its unit axes at no cost."""
        source = producer.get(name)
        return (
            shapes.get(name) == ()
            or name in constants
            or (source is not None and source.op_type in _RESHAPES)
            or (source is not None and _unit_axes(source, shapes, constants) is not None)
        )

    def absorbed(name: str, depth: int = 0) -> bool:
        """Whether every reader of ``name`` takes a Reshape of it for free: a Reshape
        (the two merge), or a node that sinks too, its other inputs letting it, or graph
        inputs (a Scan body's carried gradients: one Reshape each, which every node
        sinking shares) where its own result is absorbed in turn."""
        if name in outputs or depth > 8:
            return False
        for reader in readers.get(name, []):
            if reader.op_type in _RESHAPES:
                continue
            if _unit_axes(reader, shapes, constants) is None:
                return False
            data = reader.input[:1] if reader.op_type in _ONE_DATA_INPUT else reader.input
            others = [i for i in data if i != name]
            if all(lets_through(i) for i in others):
                continue
            if not all(lets_through(i) or i in inputs for i in others):
                return False
            if not absorbed(reader.output[0], depth + 1):
                return False
        return True

    nodes: list[onnx.NodeProto] = []
    changed = False
    for node in graph.node:
        sunk = None
        if node.output and absorbed(node.output[0]):
            sunk = _sink_one(graph, node, shapes, producer, constants, taken, inputs, views)
        if sunk is None:
            nodes.append(node)
        else:
            nodes.extend(sunk)
            producer.update({o: n for n in sunk for o in n.output})
            changed = True
    if changed:
        del graph.node[:]
        graph.node.extend(nodes)
    return changed


def _unit_axes(
    node: onnx.NodeProto,
    shapes: dict[str, tuple[int, ...]],
    constants: dict[str, onnx.TensorProto],
) -> tuple[str, int, list[int] | None] | None:
    """How ``node`` can run without unit axes: ``("trailing", k, None)`` for an
    elementwise node whose result ends in k axes of size 1; ``("concat", k, None)`` for
    a Concat whose result ends in k such axes after the joined one; ``("leading", k, None)`` for
    a MatMul whose result starts with k (batch axes); ``("reduce", k, axes)`` for a
    reduction (constant axes, made non-negative) whose input ends in k axes of size 1 it
    does not reduce. None where none of these holds."""
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    out = shapes.get(node.output[0])
    if not out:
        return None
    if node.op_type in _ELEMENTWISE and out[-1] == 1:
        return "trailing", len(out) - len(_without_trailing_units(out)), None
    if node.op_type == "Concat" and out[-1] == 1:  # the axes after the joined one
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0) % len(out)
        units = min(len(out) - len(_without_trailing_units(out)), len(out) - 1 - axis)
        return ("concat", units, None) if units else None
    if node.op_type == "Expand" and out[-1] == 1:  # its target shape: out's, fixed here
        return "expand", len(out) - len(_without_trailing_units(out)), None
    if node.op_type == "MatMul" and len(out) > 2 and out[0] == 1:
        return "leading", next(i for i, d in enumerate([*out[:-2], 0]) if d != 1), None
    if node.op_type in REDUCTIONS:
        shape = shapes.get(node.input[0])
        axes = _reduction_axes(node, constants)
        if not shape or axes is None:
            return None
        axes = sorted({a % len(shape) for a in axes} if axes else range(len(shape)))
        units = 0
        for axis in reversed(range(len(shape))):
            if shape[axis] != 1 or axis in axes:
                break
            units += 1
        return ("reduce", units, axes) if units else None
    return None


def _without_trailing_units(shape: tuple[int, ...]) -> tuple[int, ...]:
    while shape and shape[-1] == 1:
        shape = shape[:-1]
    return shape


def _reduction_axes(
    node: onnx.NodeProto, constants: dict[str, onnx.TensorProto]
) -> list[int] | None:
    """A reduction's axes ([] for all of them), None when they are not constant (or
    ``noop_with_empty_axes`` makes an empty list an identity)."""
    if any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute):
        return None
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in constants:
            return None
        return [int(a) for a in tensor_value(constants[node.input[1]]).ravel()]
    for attribute in node.attribute:
        if attribute.name == "axes":
            return list(attribute.ints)
    return []


def _sink_one(
    graph: onnx.GraphProto,
    node: onnx.NodeProto,
    shapes: dict[str, tuple[int, ...]],
    producer: dict[str, onnx.NodeProto],
    constants: dict[str, onnx.TensorProto],
    taken: set[str],
    inputs: set[str],
    views: dict[tuple[str, tuple[int, ...]], str],
) -> list[onnx.NodeProto] | None:
    """``[Reshapes of its inputs' sources, node on its inputs without the unit axes of
    :func:`_unit_axes`, Reshape]``, or None where there are none, or where an input that
    is neither a constant nor a scalar was not given its shape by a Reshape (it would
    need one of its own: a kernel more).

    Of a result's trailing axes of size 1, as many go as cost the fewest new Reshapes of
    its inputs, and the fewest axes among those: usually only the seed axis, so that a
    gradient keeps its primal's shape (``[N, 1]`` for a regression's output), which its
    readers take without a Reshape."""
    how = _unit_axes(node, shapes, constants)
    if how is None:
        return None
    kind, most, axes = how
    candidates = [most] if kind == "leading" else range(1, most + 1)
    plans = [
        _sink_plan(node, kind, units, shapes, producer, constants, inputs, views)
        for units in candidates
    ]
    usable = [plan for plan in plans if plan is not None]
    if not usable:
        return None
    units, core, read = min(usable, key=lambda plan: sum(p[2] for p in plan[2]))
    out = shapes[node.output[0]]
    moved = onnx.NodeProto()
    moved.CopyFrom(node)
    del moved.input[len(read) :]
    if kind == "concat":  # the joined axis, counted from the front
        for attribute in moved.attribute:
            if attribute.name == "axis":
                attribute.i %= len(out)
    if kind == "expand":  # broadcast to the core shape itself
        name = fresh_name(f"{node.output[0]}/core_shape", taken)
        graph.initializer.append(numpy_helper.from_array(np.array(core, np.int64), name))
        constants[name] = graph.initializer[-1]
        moved.input.append(name)
    if kind == "reduce":  # the same non-negative axes: those it drops follow them all
        if len(node.input) > 1 and node.input[1]:
            name = fresh_name(f"{node.output[0]}/axes", taken)
            graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), name))
            constants[name] = graph.initializer[-1]
            moved.input.append(name)
        else:
            for attribute in moved.attribute:
                if attribute.name == "axes":
                    attribute.ints[:] = axes
    before: list[onnx.NodeProto] = []
    for position, (name, want, _) in enumerate(read):
        if want is None:  # read as it is
            continue
        if (name, want) in views:
            viewed = views[name, want]
        elif name in constants:
            viewed = fresh_name(f"{name}/core", taken)
            value = tensor_value(constants[name]).reshape(want)
            graph.initializer.append(numpy_helper.from_array(value, viewed))
            constants[viewed] = graph.initializer[-1]
        elif shapes.get(name) != want:  # the same elements, in order
            viewed = views[name, want] = fresh_name(f"{name}/core", taken)
            target = fresh_name(f"{viewed}/shape", taken)
            graph.initializer.append(numpy_helper.from_array(np.array(want, np.int64), target))
            before.append(helper.make_node("Reshape", [name, target], [viewed]))
        else:  # a tensor of that shape already
            viewed = name
        shapes[viewed] = want
        moved.input[position] = viewed
    result = fresh_name(f"{node.output[0]}/core", taken)
    shapes[result] = core
    moved.output[:] = [result]
    target = fresh_name(f"{node.output[0]}/shape", taken)
    graph.initializer.append(numpy_helper.from_array(np.array(out, np.int64), target))
    return [*before, moved, helper.make_node("Reshape", [result, target], list(node.output))]


def _sink_plan(
    node: onnx.NodeProto,
    kind: str,
    units: int,
    shapes: dict[str, tuple[int, ...]],
    producer: dict[str, onnx.NodeProto],
    constants: dict[str, onnx.TensorProto],
    inputs: set[str],
    views: dict[tuple[str, tuple[int, ...]], str],
) -> tuple[int, tuple[int, ...], list[tuple[str, tuple[int, ...] | None, bool]]] | None:
    """How ``node`` runs without ``units`` of its unit axes: ``(units, the result's
    shape, [(input, its shape there or None to read it as it is, whether that takes a
    new Reshape)])``, or None where an input would need a Reshape of its own."""
    out = shapes[node.output[0]]
    if kind == "leading":
        core = tuple(out[units:])

        def kept(shape: tuple[int, ...]) -> tuple[int, ...]:
            # an input's batch axes align on the right with the result's
            offset = len(out) - len(shape)
            return shape[max(units - offset, 0) :] if len(shape) > 2 else shape

    else:
        core = tuple(out[: len(out) - units])

        def kept(shape: tuple[int, ...]) -> tuple[int, ...]:
            return shape[: max(len(shape) - units, 0)]  # broadcasting aligns on the right

    data = node.input[:1] if kind in ("expand", "reduce") else node.input
    read: list[tuple[str, tuple[int, ...] | None, bool]] = []
    for name in data:
        shape = shapes.get(name)
        if shape is None:
            return None
        want = kept(shape)
        source = producer.get(name)
        if want == shape:  # a scalar, or a matrix under a batch
            read.append((name, None, False))
        elif name in constants:
            read.append((name, want, False))
        elif name in inputs:  # one Reshape, shared
            read.append((name, want, (name, want) not in views))
        elif source is not None and source.op_type in _RESHAPES:
            # up its chain of Reshapes (not merged yet) to a tensor of that shape, or
            # to the first tensor of the chain, which a new Reshape then views
            while True:
                name = source.input[0]
                source = producer.get(name)
                if shapes.get(name) == want or source is None or source.op_type not in _RESHAPES:
                    break
            read.append((name, want, shapes.get(name) != want and (name, want) not in views))
        else:
            return None
    return units, core, read


def _reuse_layer_norm_statistics(
    model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]
) -> bool:
    """onnx-ad's ``LayerNormalization`` adjoint computes the input's mean and
    ``1 / sqrt(var + eps)`` again (``ReduceMean``, ``Sub``, ``Mul``, ``ReduceMean``,
    ``Add``, ``Sqrt``, ``Reciprocal``); the forward node reports both (its optional outputs
    ``Mean`` and ``InvStdDev``). Their readers read those: 6 kernels fewer a layer."""
    graph = model.graph
    constants = {t.name: t for t in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)

    def only(name: str, op_type: str, *others: str) -> onnx.NodeProto | None:
        """The reader of ``name`` of type ``op_type`` whose other inputs are ``others``."""
        for reader in readers.get(name, []):
            rest = [i for i in reader.input if i != name] or [name]
            if reader.op_type == op_type and (not others or sorted(rest) == sorted(others)):
                return reader
        return None

    def mean_over(node: onnx.NodeProto | None, axes: list[int], rank: int) -> bool:
        if node is None or node.op_type != "ReduceMean":
            return False
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        found = _reduction_axes(node, constants)
        return bool(keepdims) and found is not None and sorted(a % rank for a in found) == axes

    taken = graph_names(graph)
    for norm in [n for n in graph.node if n.op_type == "LayerNormalization"]:
        x = norm.input[0]
        rank = len(shapes.get(x) or ())
        attrs = {a.name: a for a in norm.attribute}
        if norm.domain not in ("", "ai.onnx") or not rank or "stash_type" in attrs:
            continue
        axes = list(range(attrs["axis"].i % rank if "axis" in attrs else rank - 1, rank))
        epsilon = np.float32(attrs["epsilon"].f if "epsilon" in attrs else 1e-5)
        for mean in [r for r in readers.get(x, []) if mean_over(r, axes, rank)]:
            centered = only(mean.output[0], "Sub", x)
            square = centered and only(centered.output[0], "Mul")
            if centered is None or square is None or list(square.input) != [centered.output[0]] * 2:
                continue
            variance = next(
                (r for r in readers.get(square.output[0], []) if mean_over(r, axes, rank)), None
            )
            shifted = variance and only(variance.output[0], "Add")
            eps = shifted and next((i for i in shifted.input if i in constants), None)
            value = tensor_value(constants[eps]) if eps else None
            if variance is None or shifted is None or value is None or value.dtype != np.float32:
                continue
            if value.size != 1 or value != epsilon:
                continue
            root = only(shifted.output[0], "Sqrt")
            inverse = root and only(root.output[0], "Reciprocal")
            if root is None or inverse is None:
                continue
            while len(norm.output) < 3:
                norm.output.append("")
            for position, name in ((1, mean.output[0]), (2, inverse.output[0])):
                if not norm.output[position]:
                    norm.output[position] = fresh_name(f"{norm.output[0]}/statistic", taken)
                rename_reads(graph, name, norm.output[position])
                shapes[norm.output[position]] = shapes.get(name, ())
            for node in (inverse, root, shifted, variance, square, mean):  # readers first
                if not any(_readers(graph).get(o) for o in node.output):
                    graph.node.remove(node)
            return True  # the maps above are stale now
    return False


def _drop_unread_reshapes(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    readers = _readers(graph)
    unread = [n for n in graph.node if n.op_type in _RESHAPES and readers.get(n.output[0], 0) == 0]
    for node in unread:
        graph.node.remove(node)
    return bool(unread)


def _full_reductions_of_reshapes(
    model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]
) -> bool:
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    constants = {t.name: t for t in graph.initializer}
    changed = False
    for node in graph.node:
        if node.op_type not in REDUCTIONS or node.domain not in ("", "ai.onnx"):
            continue
        keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
        if keepdims or _reduction_axes(node, constants) != []:
            continue  # the result's shape depends on the input's
        source = producer.get(node.input[0])
        if source is not None and source.op_type in _RESHAPES:
            node.input[0] = source.input[0]  # the same elements, whatever their shape
            changed = True
    return changed


def _drop_no_ops(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> bool:
    graph = model.graph
    outputs = {o.name for o in graph.output}
    dropped = []
    for node in list(graph.node):
        if node.op_type not in ("Reshape", "Identity") or node.output[0] in outputs:
            continue
        source, result = node.input[0], node.output[0]
        if node.op_type == "Reshape" and (
            source not in shapes or shapes.get(source) != shapes.get(result)
        ):
            continue
        dropped.append(node)
        graph.node.remove(node)
        rename_reads(graph, result, source)
    return bool(dropped)


__all__ = ["simplify"]
