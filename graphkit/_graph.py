"""Low-level graph plumbing shared by the DSL modules: dtypes, compiling onnxscript
functions into typed models, and splicing one graph into another without name clashes."""

from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnx.inliner
from onnx import TensorProto, helper

from graphkit.compat import DSL_OPSET, MAX_IR_VERSION, finalize, opset_of, set_opset
from graphkit.errors import IncompatibleModelError
from graphkit.shapes import (  # noqa: F401 - graphkit's modules take them from here too
    ELEM_TO_DTYPE,
    FLOAT_TYPES,
    Dim,
    Shape,
    elem_type,
    float_dtype,
    named_shape,
    shape_matches,
    static_shape,
)
from graphkit.tensor_store import tensor_value


class CompiledModels:
    """Serialized models by key, the least recently used dropped first once there are
    more than ``max_entries`` of them or they hold more than ``max_bytes``: the cache of
    :func:`compile_function`, bounded in what it holds, not only in its count."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._models: collections.OrderedDict[Hashable, bytes] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self.hits = self.misses = 0

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            found = self._models.get(key)
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
                self._models.move_to_end(key)
            return found

    def put(self, key: Hashable, model: bytes) -> None:
        with self._lock:
            old = self._models.pop(key, None)
            self.nbytes -= len(old) if old is not None else 0
            self._models[key] = model
            self.nbytes += len(model)
            while self._models and (
                len(self._models) > self.max_entries or self.nbytes > self.max_bytes
            ):
                _, dropped = self._models.popitem(last=False)
                self.nbytes -= len(dropped)

    def clear(self) -> None:
        with self._lock:
            self._models.clear()
            self.nbytes = self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._models)


COMPILED = CompiledModels(max_entries=256, max_bytes=32 * 2**20)
"""The typed models :func:`compile_function` built, by the content of the function and
the types asked for. 256 entries hold the distinct functions of a few dozen optimizers,
losses and schedules; a few KB each, they stay far below 32 MB unless a function holds
large constants, which the bytes bound is for."""

_DIGESTS: weakref.WeakKeyDictionary[Any, bytes] = weakref.WeakKeyDictionary()
"""Function object -> :func:`function_digest`, while the object lives."""


def function_digest(fn: Any) -> bytes:
    """A digest of what ``fn`` computes: its model, the functions it calls included.

    Factories build a new onnxscript function per call (a closure over the
    hyper-parameters), so the function object is no key: two calls with the same
    hyper-parameters give equal digests, two with different ones different digests
    (onnxscript writes the values a closure captures as constants in the body, and the
    functions it calls, with their own constants, in ``model.functions``; the function's
    own ``to_function_proto`` leaves those out).
    """
    try:
        return _DIGESTS[fn]
    except (KeyError, TypeError):  # TypeError: an object weakref cannot hold
        pass
    digest = hashlib.sha256(fn.to_model_proto().SerializeToString()).digest()
    with contextlib.suppress(TypeError):
        _DIGESTS[fn] = digest
    return digest


def _compiled(
    fn: Any,
    dtype: np.dtype,
    shapes: tuple[tuple[str, Shape], ...],
    int64: frozenset[str],
    outputs: tuple[str, ...],
) -> bytes:
    key = (function_digest(fn), dtype, shapes, int64, outputs)
    found = COMPILED.get(key)
    if found is None:
        found = _compile(fn, dtype, shapes, int64, outputs)
        COMPILED.put(key, found)
    return found


def _compile(
    fn: Any,
    dtype: np.dtype,
    shapes: tuple[tuple[str, Shape], ...],
    int64: frozenset[str],
    outputs: tuple[str, ...],
) -> bytes:
    model = fn.to_model_proto()
    model = onnx.inliner.inline_local_functions(model)
    del model.functions[:]
    if outputs:
        if len(outputs) != len(model.graph.output):
            raise ValueError(f"{len(model.graph.output)} outputs, {len(outputs)} names given")
        mapping = {o.name: new for o, new in zip(model.graph.output, outputs)}
        rename_tensors(model.graph, lambda n: mapping.get(n, n))
    shape_of = dict(shapes)
    target = FLOAT_TYPES[dtype]
    for value in model.graph.input:
        if value.name not in shape_of:
            raise ValueError(f"compile_function: no shape given for input {value.name!r}")
        _set_type(value, TensorProto.INT64 if value.name in int64 else target, shape_of[value.name])
    del model.graph.value_info[:]
    resolve_castlike(model)
    inferred = _inferred_output_shapes(model)
    for value in model.graph.output:
        # An output whose shape the caller does not know (a custom loss) is inferred.
        shape = shape_of.get(value.name, inferred.get(value.name, ()))
        _set_type(value, TensorProto.INT64 if value.name in int64 else target, shape)
    keep = [o for o in model.opset_import if o.domain not in ("", "this")]
    del model.opset_import[:]
    model.opset_import.extend([helper.make_opsetid("", DSL_OPSET), *keep])
    model.ir_version = MAX_IR_VERSION
    return finalize(model, full_check=True).SerializeToString()


def resolve_castlike(model: onnx.ModelProto) -> None:
    """Replace ``CastLike`` nodes by ``Constant`` or ``Cast`` once types are known (in place).

    DSL bodies write constants as ``CastLike(c, x)`` to serve any float dtype, but
    onnxruntime-training has no gradient for ``CastLike``: once the model is typed, a
    constant input is cast now and any other input gets a ``Cast`` (which has one).
    """
    from onnx import numpy_helper

    typed = onnx.shape_inference.infer_shapes(model)
    elem_of = {
        v.name: v.type.tensor_type.elem_type
        for v in itertools.chain(typed.graph.input, typed.graph.value_info, typed.graph.output)
        if v.type.tensor_type.elem_type
    }
    constants = {i.name: tensor_value(i) for i in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Constant" and node.domain == "" and node.attribute[0].name == "value":
            constants[node.output[0]] = tensor_value(node.attribute[0].t)
    nodes = []
    for node in model.graph.node:
        target = elem_of.get(node.input[1]) if node.op_type == "CastLike" else None
        if target is None:
            nodes.append(node)
        elif node.input[0] in constants:
            value = _widen(constants[node.input[0]], helper.tensor_dtype_to_np_dtype(target))
            tensor = numpy_helper.from_array(value, node.output[0])
            nodes.append(
                helper.make_node("Constant", [], [node.output[0]], name=node.name, value=tensor)
            )
        else:
            nodes.append(
                helper.make_node(
                    "Cast", [node.input[0]], [node.output[0]], name=node.name, to=target
                )
            )
    # drop the constants only the replaced CastLike nodes read
    used = {name for node in nodes for name in node.input} | {o.name for o in model.graph.output}
    nodes = [n for n in nodes if n.op_type != "Constant" or n.output[0] in used]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    kept = [i for i in model.graph.initializer if i.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def _widen(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Cast a constant; float32 -> float64 goes through the shortest decimal repr.

    onnxscript stores a Python literal such as ``0.8`` as float32; cast naively it would
    mean 0.800000011920929 in a float64 model. ``str(np.float32(0.8))`` is ``"0.8"``.
    """
    if value.dtype == np.float32 and np.dtype(dtype) == np.float64:
        return np.array([float(str(v)) for v in value.ravel()], dtype=np.float64).reshape(
            value.shape
        )
    return value.astype(dtype)


def _set_type(value: onnx.ValueInfoProto, elem: int, shape: Iterable[Dim]) -> None:
    ttype = value.type.tensor_type
    ttype.elem_type = elem
    ttype.ClearField("shape")
    ttype.shape.SetInParent()
    for dim in shape:
        entry = ttype.shape.dim.add()
        if isinstance(dim, int):
            entry.dim_value = dim
        elif dim:
            entry.dim_param = dim


def _inferred_output_shapes(model: onnx.ModelProto) -> dict[str, Shape]:
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for value in probe.graph.output:
        value.type.tensor_type.ClearField("shape")
    try:
        probe = onnx.shape_inference.infer_shapes(probe)
    except Exception:  # inference is a convenience here, never a requirement
        return {}
    shapes = {}
    for value in probe.graph.output:
        dims = static_shape(value)
        if dims is not None:
            shapes[value.name] = tuple(dims)
    return shapes


def compile_function(
    fn: object,
    dtype: object,
    shapes: Mapping[str, Iterable[Dim]],
    int64: Iterable[str] = (),
    outputs: Iterable[str] = (),
) -> onnx.ModelProto:
    """Compile an onnxscript function into a model typed for ``dtype``.

    The functions of the DSL are written with ``FLOAT`` annotations and constants cast
    with ``CastLike``, so one body serves float32 and float64: every input and output is
    typed ``dtype`` except those named in ``int64``. Called functions are inlined.

    Args:
        fn: the onnxscript function.
        dtype: float32 or float64.
        shapes: the shape of every input and output (ints, symbolic names or None);
            ``onnx.checker`` wants a rank for each.
        int64: names of int64 inputs (labels, step).
        outputs: new names for the outputs, in order (default: the function's).

    The result is cached in :data:`COMPILED` by the function's content
    (:func:`function_digest`), not by the function object, which factories make anew
    on every call; each call returns a fresh copy.
    """
    key = tuple(sorted((name, tuple(shape)) for name, shape in shapes.items()))
    model = onnx.ModelProto()
    model.ParseFromString(_compiled(fn, float_dtype(dtype), key, frozenset(int64), tuple(outputs)))
    return model


def symbolic_shape(name: str, rank: int) -> Shape:
    """("N", "name_1", ...): a batch dimension then one symbolic dim per extra axis."""
    return ("N", *(f"{name}_{i}" for i in range(1, rank)))


# -- names -------------------------------------------------------------------------------


def graph_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor and node name used in ``graph`` and its subgraphs."""
    names: set[str] = set()
    names.update(i.name for i in graph.input)
    names.update(o.name for o in graph.output)
    names.update(i.name for i in graph.initializer)
    names.update(i.name for i in graph.sparse_initializer)
    names.update(v.name for v in graph.value_info)
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        names.add(node.name)
        for sub in _subgraphs(node):
            names.update(graph_names(sub))
    names.discard("")
    return names


def _subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs


def all_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and its subgraphs (Loop, Scan and If bodies), at any depth, each before
    its own subgraphs."""
    yield graph
    for node in graph.node:
        for sub in _subgraphs(node):
            yield from all_graphs(sub)


def outer_reads(node: onnx.NodeProto) -> set[str]:
    """The tensors ``node`` reads: its inputs, and what its subgraphs (If branches,
    Loop and Scan bodies, at any depth) read from the graphs around them."""
    names = {n for n in node.input if n}
    for sub in _subgraphs(node):
        names |= _free_names(sub)
    return names


def read_counts(nodes: Iterable[onnx.NodeProto], outputs: Iterable[str] = ()) -> dict[str, int]:
    """How many of ``nodes`` read each tensor (:func:`outer_reads`), a graph output
    counting as one reader more."""
    count: dict[str, int] = {}
    for node in nodes:
        for name in outer_reads(node):
            count[name] = count.get(name, 0) + 1
    for name in outputs:
        count[name] = count.get(name, 0) + 1
    return count


def _free_names(graph: onnx.GraphProto) -> set[str]:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    free: set[str] = set()
    for node in graph.node:
        free |= outer_reads(node) - defined
        defined.update(node.output)
    return free


def descendants(graph: onnx.GraphProto, names: Iterable[str]) -> set[str]:
    """Every tensor that depends on ``names`` (themselves included), through subgraphs."""
    reached = set(names)
    for node in graph.node:
        if outer_reads(node) & reached:
            reached.update(node.output)
    return reached


def ancestors(graph: onnx.GraphProto, outputs: Iterable[str]) -> set[str]:
    """Every tensor ``outputs`` depend on (themselves included), through subgraphs too."""
    needed = set(outputs)
    for node in reversed(graph.node):
        if needed.intersection(node.output):
            needed |= outer_reads(node)
    return needed


def inferred_dims(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    """Each tensor's dimensions as onnx's shape inference gives them (None for a symbolic
    or unknown one), the main graph's inputs, initializers and inferred values; where the
    inference fails, what the graph declares."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
    except Exception:  # inference is a help: what it cannot give stays unknown
        inferred = model.graph
    dims: dict[str, list[int | None]] = {}
    for value in [*inferred.input, *inferred.value_info]:
        if value.type.tensor_type.HasField("shape"):
            found = value.type.tensor_type.shape.dim
            dims[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in found]
    dims.update({t.name: list(t.dims) for t in model.graph.initializer})
    return dims


def constant_tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """``(name, tensor)`` of every value ``graph`` fixes: its initializers, but those a
    graph input of the same name can override at run time, and its ``Constant`` nodes'
    values (``value``, and ``value_float(s)`` / ``value_int(s)`` as float32 / int64
    tensors; not those of its subgraphs)."""
    fed = {i.name for i in graph.input}
    for tensor in graph.initializer:
        if tensor.name not in fed:
            yield tensor.name, tensor
    lists = {
        "value_float": (onnx.TensorProto.FLOAT, False),
        "value_floats": (onnx.TensorProto.FLOAT, True),
        "value_int": (onnx.TensorProto.INT64, False),
        "value_ints": (onnx.TensorProto.INT64, True),
    }
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            for attribute in node.attribute:
                if attribute.name == "value":
                    yield node.output[0], attribute.t
                elif attribute.name in lists:
                    elem, many = lists[attribute.name]
                    values = helper.get_attribute_value(attribute)
                    dims = [len(values)] if many else []
                    flat = list(values) if many else [values]
                    yield node.output[0], helper.make_tensor(node.output[0], elem, dims, flat)


def fresh_name(base: str, taken: set[str]) -> str:
    """``base`` if free, else ``base_1``, ``base_2``...; the result is added to ``taken``."""
    name, i = base, 0
    while name in taken:
        i += 1
        name = f"{base}_{i}"
    taken.add(name)
    return name


def rename_tensors(graph: onnx.GraphProto, rename: Callable[[str], str]) -> None:
    """Rename every tensor of ``graph`` (and of its subgraphs) in place."""
    for value in itertools.chain(graph.input, graph.output, graph.value_info):
        value.name = rename(value.name)
    for init in graph.initializer:
        init.name = rename(init.name)
    for node in graph.node:
        node.input[:] = [rename(n) if n else n for n in node.input]
        node.output[:] = [rename(n) if n else n for n in node.output]
        for sub in _subgraphs(node):
            rename_tensors(sub, rename)


# -- splicing ------------------------------------------------------------------------------


def rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every read of ``old`` (subgraphs included) reads ``new``."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _rename_reads_in(attribute.g, old, new)
            for sub in attribute.graphs:
                _rename_reads_in(sub, old, new)


def rename_subgraph_reads(node: onnx.NodeProto, old: str, new: str) -> None:
    """Every read of the outer ``old`` in ``node``'s subgraphs (at any depth) reads
    ``new``; ``node``'s own inputs are left alone."""
    for sub in _subgraphs(node):
        _rename_reads_in(sub, old, new)


def _rename_reads_in(graph: onnx.GraphProto, old: str, new: str) -> None:
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    defined.update(o for n in graph.node for o in n.output)
    if old in defined:
        return  # the subgraph has a tensor of its own by that name
    if new in defined:  # it would read its own instead of the outer one
        raise ValueError(f"rename_reads: a subgraph defines {new!r}, which it reads from outside")
    rename_reads(graph, old, new)
    for output in graph.output:
        if output.name == old:
            output.name = new


def splice(
    host: onnx.ModelProto,
    piece: onnx.ModelProto,
    inputs: Mapping[str, str],
    prefix: str,
) -> dict[str, str]:
    """Copy the nodes of ``piece`` into ``host`` (in place).

    Each input of ``piece`` is wired to the host tensor ``inputs[name]``; every other name
    of ``piece`` gets a ``prefix`` that no host name uses. The ``ai.onnx`` opset of
    ``host`` is raised to ``piece``'s when lower (the caller converted ``host`` first).

    Returns:
        ``{output of piece: its name in host}``. Outputs are not added to ``host``'s
        graph outputs: the caller decides which become outputs.
    """
    missing = [i.name for i in piece.graph.input if i.name not in inputs]
    if missing:
        raise ValueError(f"splice: inputs {missing} of the piece are not wired")
    taken = graph_names(host.graph)
    local = {}
    for name in sorted(graph_names(piece.graph)):
        if name in inputs:
            local[name] = inputs[name]
        else:
            local[name] = fresh_name(f"{prefix}/{name}", taken)
    copy = onnx.GraphProto()
    copy.CopyFrom(piece.graph)
    rename_tensors(copy, lambda n: local.get(n, n))
    for node in copy.node:
        node.name = local[node.name] if node.name else fresh_name(f"{prefix}/node", taken)
    host.graph.node.extend(copy.node)
    host.graph.initializer.extend(copy.initializer)
    for entry in piece.opset_import:
        current = opset_of(host, entry.domain)
        if current is None or current < entry.version:
            set_opset(host, entry.domain, entry.version)
    return {o.name: local[o.name] for o in piece.graph.output}


def value_info(
    name: str, dtype_or_elem: object, shape: Iterable[Dim] | None
) -> onnx.ValueInfoProto:
    elem = dtype_or_elem if isinstance(dtype_or_elem, int) else elem_type(dtype_or_elem)
    return helper.make_tensor_value_info(name, elem, None if shape is None else list(shape))


# -- rewriting ------------------------------------------------------------------------


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def initializers_as_inputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` whose initializers ``names`` are graph inputs instead, after
    the existing inputs, in the order of ``names`` (each must be an initializer)."""
    out = copy_model(model)
    chosen = {i.name: i for i in out.graph.initializer if i.name in set(names)}
    kept = [i for i in out.graph.initializer if i.name not in chosen]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    out.graph.input.extend(
        helper.make_tensor_value_info(n, chosen[n].data_type, list(chosen[n].dims)) for n in names
    )
    return out


def renamed_value(value: onnx.ValueInfoProto, name: str) -> onnx.ValueInfoProto:
    """A copy of ``value`` (type and shape) under another name."""
    out = onnx.ValueInfoProto()
    out.CopyFrom(value)
    out.name = name
    return out


def namer(base: str, taken: set[str]) -> Callable[[str], str]:
    """Fresh tensor names under one prefix, for the nodes that replace one node."""
    prefix = fresh_name(base, taken)
    return lambda suffix: fresh_name(f"{prefix}/{suffix}", taken)


class NodeWriter:
    """Nodes written one after another, each output a fresh name (from ``fresh``, a
    :func:`namer`): :meth:`op` and :meth:`ints` return the name, :attr:`nodes` holds
    them in order."""

    def __init__(self, fresh: Callable[[str], str]) -> None:
        self.fresh = fresh
        self.nodes: list[onnx.NodeProto] = []

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        out = self.fresh(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], **attrs))
        return out

    def ints(self, values: list[int]) -> str:
        """An int64 vector Constant."""
        out = self.fresh("ints")
        self.nodes.append(int_constant(out, values))
        return out


def int_constant(name: str, values: list[int]) -> onnx.NodeProto:
    """A Constant node holding an int64 vector."""
    return helper.make_node(
        "Constant",
        [],
        [name],
        value=onnx.numpy_helper.from_array(np.array(values, dtype=np.int64)),
    )


REDUCTIONS = frozenset(
    {
        "ReduceSum",
        "ReduceMean",
        "ReduceMax",
        "ReduceMin",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceSumSquare",
    }
)
"""The reductions (a tensor's values summed, averaged... over some axes)."""

AXES_INPUT_SINCE: dict[str, tuple[int, str]] = {
    **{op: (18, "axes") for op in REDUCTIONS},
    "ReduceSum": (13, "axes"),
    "Squeeze": (13, "axes"),
    "Unsqueeze": (13, "axes"),
    "Split": (13, "split"),
}
"""Operator -> (the ``ai.onnx`` opset from which its second input holds what was the
attribute, that attribute's name). Below that opset the attribute is the only form;
from it on, the attribute is refused ("Unrecognized attribute: axes")."""


def _int_values(node: onnx.NodeProto) -> list[int] | None:
    """The int64 values a Constant node holds (``value_ints``, ``value_int`` or an
    integer ``value`` tensor), or None."""
    for attribute in node.attribute:
        if attribute.name == "value_ints":
            return list(attribute.ints)
        if attribute.name == "value_int":
            return [attribute.i]
        if attribute.name == "value" and attribute.t.data_type in (
            TensorProto.INT64,
            TensorProto.INT32,
        ):
            return [int(v) for v in tensor_value(attribute.t).ravel()]
    return None


def axes_for_opset(
    nodes: Sequence[onnx.NodeProto],
    opset: int | None,
    constants: Mapping[str, Sequence[int]] | None = None,
) -> list[onnx.NodeProto]:
    """``nodes``, written with their axes as inputs (opset 18's form), in the form
    ``opset`` takes (``ai.onnx``; None: as written).

    Below :data:`AXES_INPUT_SINCE`'s opset of an operator, its axes (``Split``: its
    sizes), read from a Constant among ``nodes`` or from ``constants``, become its
    attribute, and ``noop_with_empty_axes`` (which that opset does not have) is dropped:
    empty axes with it set are an ``Identity``, without it a reduction over every axis,
    as the attribute left out means. A Constant among ``nodes`` read only as such axes
    is dropped.

    Raises:
        IncompatibleModelError: an axes input computed at run time where ``opset`` takes
            an attribute (naming the node and the opset it needs).
    """
    if opset is None or opset >= 18:
        return list(nodes)
    known: dict[str, list[int]] = {k: list(v) for k, v in (constants or {}).items()}
    for node in nodes:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            values = _int_values(node)
            if values is not None:
                known[node.output[0]] = values
    out: list[onnx.NodeProto] = []
    moved: set[str] = set()  # the Constants read as attributes now
    for node in nodes:
        since, attribute = AXES_INPUT_SINCE.get(node.op_type, (0, ""))
        if node.domain not in ("", "ai.onnx") or opset >= since or len(node.input) < 2:
            out.append(node)
            continue
        source = node.input[1]
        if source and source not in known:
            raise IncompatibleModelError(
                f"{node.op_type} node {node.name or node.output[0]!r} reads its "
                f"{attribute} from {source!r}, computed at run time, which opset {opset} "
                f"cannot take (an attribute until opset {since}): convert the model to "
                f"opset {since} or later."
            )
        values = known.get(source, [])
        moved.add(source)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        noop = attrs.pop("noop_with_empty_axes", 0)
        inputs = [node.input[0], *node.input[2:]]
        if not values and noop:  # nothing to reduce over: the data as it is
            out.append(
                helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name)
            )
            continue
        if values:
            attrs[attribute] = values
        out.append(
            helper.make_node(node.op_type, inputs, list(node.output), name=node.name, **attrs)
        )
    read = {name for node in out for name in outer_reads(node)}
    return [n for n in out if not (n.op_type == "Constant" and n.output[0] in moved - read)]


class GraphInfo:
    """What a graph rewrite needs to know: the names in use, the ``ai.onnx`` opset, and
    the element type and rank of every tensor shape inference can type (inferred once)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.taken = graph_names(model.graph)
        self.opset = opset_of(model)
        try:
            typed = onnx.shape_inference.infer_shapes(model)
        except Exception:  # inference is a help: without it, a rewrite may be skipped
            typed = model
        self.elem: dict[str, int] = {i.name: i.data_type for i in model.graph.initializer}
        self.rank: dict[str, int] = {i.name: len(i.dims) for i in model.graph.initializer}
        for value in [*typed.graph.input, *typed.graph.value_info, *typed.graph.output]:
            ttype = value.type.tensor_type
            if ttype.elem_type:
                self.elem[value.name] = ttype.elem_type
            if ttype.HasField("shape"):
                self.rank[value.name] = len(ttype.shape.dim)

    def dtype(self, name: str) -> np.dtype:
        return helper.tensor_dtype_to_np_dtype(self.elem.get(name, TensorProto.FLOAT))
