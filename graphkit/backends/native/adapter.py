"""The one adapter over onnx-ad, the reverse-mode rule library the native backend uses.

`onnx-ad <https://pypi.org/project/onnx-ad/>`_ (MIT, onnx + numpy only, pinned in
``pyproject.toml``) differentiates an ONNX graph by source transformation: it keeps the
primal graph and appends, for every node between the differentiated inputs and the seeded
outputs, the nodes of its vector-Jacobian product, in standard ``ai.onnx`` operators
(``If``/``Loop``/``Scan`` and ``RNN``/``GRU``/``LSTM`` included). Nothing else in graphkit
imports it; this module turns its conventions into graphkit's:

* onnx-ad differentiates graph *inputs*: the initializers to differentiate become inputs
  for the call and initializers again after it;
* it takes the seed (the incoming gradient of the output) as an input with a trailing
  axis of seed directions, ``shape(output) + [nadj]``: graphkit always seeds one direction
  of ones (d output / d output), built in the graph, and squeezes the axis off each
  gradient, which is then called ``<name>_grad`` as onnxruntime-training's builders call
  it;
* a name it has no path to gets a gradient of zeros: graphkit refuses it instead
  (:class:`~graphkit.errors.MissingGradientError`), since a weight reached only through
  ``Shape``, ``ArgMax``, comparisons or integer tensors cannot be trained;
* graphkit's own rules (:mod:`.rules`) are consulted before onnx-ad's;
* its ``UnsupportedOperator`` becomes a :class:`~graphkit.errors.MissingGradientError`
  that keeps its text (which names the operator and the node).

The emitted shape arithmetic (the batch dimension is symbolic) disappears once
:func:`graphkit.static_shapes.specialize` fixes the batch size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import (
    ancestors,
    copy_model,
    fresh_name,
    graph_names,
    outer_reads,
    static_shape,
)
from graphkit.backends.native import rules
from graphkit.errors import MissingGradientError, UnknownNameError
from graphkit.static_shapes import integer_arithmetic_as_constants, known_parts_as_constants

PACKAGE = "onnx-ad"
VERSION = "0.3.0"
"""The release this adapter was written and tested against (``pyproject.toml`` pins it)."""

_SEED_AXIS = "gk_nadj"


def installed() -> bool:
    """Whether onnx-ad can be imported."""
    try:
        import onnx_ad  # noqa: F401
    except ImportError:
        return False
    return True


def gradient_graph(model: onnx.ModelProto, output: str, wrt: Sequence[str]) -> onnx.ModelProto:
    """``model`` extended with ``<name>_grad`` = d ``sum(output)`` / d ``name`` for each
    name of ``wrt`` (graph inputs or initializers); its outputs stay first.

    Raises:
        MissingGradientError: an operator on the path has no rule (the message names the
            operator and the node), or a name of ``wrt`` reaches ``output`` only through
            operators with no derivative.
    """
    derived, seeds, n_outputs = _reverse(model, [output], wrt)
    _seed_with_ones(derived, seeds[output], output)
    _squeeze_seed_axis(derived, n_outputs, list(wrt))
    return derived


def vector_jacobian_graph(
    model: onnx.ModelProto, outputs: Sequence[str], wrt: Sequence[str]
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """``model`` extended with ``<name>_grad`` = sum over ``outputs`` of ``seed(o) . d o /
    d name`` for each name of ``wrt``, the seeds being new inputs shaped like their
    outputs (the gradient of a larger model's loss with respect to each output); and
    ``{output: its seed input}``.

    Raises:
        MissingGradientError: as :func:`gradient_graph`.
    """
    derived, seeds, n_outputs = _reverse(model, outputs, wrt)
    graph = derived.graph
    taken = graph_names(graph)
    axis = fresh_name("seed/last_axis", taken)
    graph.node.insert(0, _ints_constant(axis, [-1]))
    names = {}
    for output, seed in seeds.items():
        name = names[output] = fresh_name(f"{output}_grad_output", taken)
        graph.node.insert(1, helper.make_node("Unsqueeze", [name, axis], [seed.name]))
        graph.input.remove(seed)
        value = onnx.ValueInfoProto()
        value.CopyFrom(next(o for o in model.graph.output if o.name == output))
        value.name = name
        graph.input.append(value)
    _squeeze_seed_axis(derived, n_outputs, list(wrt))
    return derived, names


def _reverse(
    model: onnx.ModelProto, outputs: Sequence[str], wrt: Sequence[str]
) -> tuple[onnx.ModelProto, dict[str, onnx.ValueInfoProto], int]:
    """onnx-ad's adjoint model of ``outputs`` with respect to ``wrt``, the initializers
    among them back as initializers; with the seed input of each output, and the number
    of the model's own outputs (the gradients follow them)."""
    from onnx_ad import UnsupportedOperator, reverse

    wrt = list(wrt)
    repeated = sorted({n for n in wrt if wrt.count(n) > 1})
    if repeated:
        raise UnknownNameError(
            f"{repeated} appear more than once among the names to differentiate."
        )
    initializers = {i.name: i for i in model.graph.initializer if i.name in set(wrt)}
    opened = _initializers_as_inputs(model, initializers)
    _max_pools_with_indices(opened)
    # a bound read off a symbolic-batch tensor's static axes, and the integer arithmetic
    # on it (dynamo's LSTM gate slices): the slices get static shapes
    if known_parts_as_constants(opened):
        integer_arithmetic_as_constants(opened)
    n_outputs = len(opened.graph.output)
    opened = onnx.shape_inference.infer_shapes(opened, data_prop=True)
    _explicit_same_pads(opened)
    try:
        with rules.consulted_first():
            derived = reverse(
                opened, inputs=wrt, outputs=list(outputs), layout="onnx", dim=_SEED_AXIS
            )
    except UnsupportedOperator as exc:
        # onnx-ad walks backwards: an operator without a rule may hide the rank of what
        # it feeds, and the first failure is then its neighbour's; name the operator
        _refuse_operators_without_rule(opened, wrt, outputs)
        raise MissingGradientError(
            f"The native gradient source (onnx-ad {VERSION}) cannot differentiate this graph: "
            f"{exc}. Keep that operator off the path between the weights and the loss, or "
            "rewrite it with differentiable operators."
        ) from exc
    inputs = {i.name for i in opened.graph.input}
    seed_inputs = [i for i in derived.graph.input if i.name not in inputs]
    seeds = dict(zip(outputs, seed_inputs))
    gradients = [o.name for o in derived.graph.output[n_outputs:]]
    _refuse_zero_gradients(derived, dict(zip(wrt, gradients)), [s.name for s in seed_inputs])
    _inputs_as_initializers(derived, initializers)
    _unique_node_names(derived.graph, set())
    # the outputs' types as inferred (the seeds are shaped after them)
    inferred = {v.name: v for v in [*opened.graph.value_info, *opened.graph.output]}
    for output in derived.graph.output[:n_outputs]:
        if static_shape(output) is None and output.name in inferred:
            output.CopyFrom(inferred[output.name])
    return derived, seeds, n_outputs


_REWRITTEN_BEFORE_RULES = frozenset(
    {"RNN", "GRU", "LSTM", "LRN", "GridSample", "DeformConv", "STFT", "TensorScatter"}
)
"""Operators onnx-ad lowers to others before its rules run (its function-bodied ones,
``GroupNormalization`` or ``Attention``, have their body in the schema: see below)."""


def _refuse_operators_without_rule(
    model: onnx.ModelProto, wrt: Sequence[str], outputs: Sequence[str]
) -> None:
    """Raise :class:`MissingGradientError` naming the first node between ``wrt`` and
    ``outputs`` whose operator has no reverse rule (operators whose ONNX schema has a
    function body are expanded by onnx-ad, and count as known)."""
    from onnx_ad import rules as ad

    known = set(ad.REVERSE) | set(rules.REVERSE) | _REWRITTEN_BEFORE_RULES
    graph = model.graph
    elem = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input]}
    elem.update((t.name, t.data_type) for t in graph.initializer)
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
    reached = set(wrt)  # float tensors that depend on wrt (as onnx-ad's own sweep)
    needed = ancestors(graph, outputs)
    for node in graph.node:
        if not outer_reads(node) & reached:
            continue
        reached.update(o for o in node.output if elem.get(o, onnx.TensorProto.FLOAT) in floats)
        standard = node.domain in ("", "ai.onnx", "ai.onnx.ml")
        if standard and (node.op_type in known or _has_function_body(node)):
            continue
        if needed.intersection(node.output):
            domain = "" if node.domain in ("", "ai.onnx") else f" of domain {node.domain}"
            raise MissingGradientError(
                f"The native gradient source (onnx-ad {VERSION}) has no gradient for operator "
                f"{node.op_type!r} (node {node.name or node.output[0]!r}){domain}. Keep it off "
                "the path between the weights and the loss, or rewrite it with differentiable "
                "operators."
            )


def _has_function_body(node: onnx.NodeProto) -> bool:
    try:
        schema = onnx.defs.get_schema(node.op_type, domain=node.domain)
    except onnx.defs.SchemaError:
        return False
    # onnx's stub for OpSchema lacks these two properties, which it has at run time
    return schema.has_function or schema.has_context_dependent_function  # type: ignore[attr-defined]


_AUTO_PADDED = frozenset({"Conv", "MaxPool", "AveragePool", "LpPool"})


def _explicit_same_pads(model: onnx.ModelProto) -> None:
    """``auto_pad=SAME_UPPER/SAME_LOWER`` written as the explicit ``pads`` it means (in
    place), where the input's spatial size is known: onnx-ad differentiates explicit
    pads only. ``SAME``: the output has ``ceil(size / stride)`` positions, the padding
    needed for that split in two, the odd one at the end (UPPER) or the start (LOWER)."""
    shapes = {v.name: static_shape(v) for v in [*model.graph.value_info, *model.graph.input]}
    weights = {t.name: list(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type not in _AUTO_PADDED or node.domain not in ("", "ai.onnx"):
            continue
        attrs = {a.name: a for a in node.attribute}
        mode = attrs["auto_pad"].s.decode() if "auto_pad" in attrs else "NOTSET"
        if mode not in ("SAME_UPPER", "SAME_LOWER"):
            continue
        dims = shapes.get(node.input[0])
        spatial = [d for d in (dims or [])[2:] if isinstance(d, int)]
        if dims is None or len(spatial) != len(dims[2:]):
            continue  # onnx-ad's refusal names the node
        if "kernel_shape" in attrs:
            kernel = list(attrs["kernel_shape"].ints)
        else:
            kernel = list(shapes.get(node.input[1]) or weights.get(node.input[1]) or [])[2:]
            if len(kernel) != len(spatial):
                continue
        strides = list(attrs["strides"].ints) if "strides" in attrs else [1] * len(spatial)
        dilations = list(attrs["dilations"].ints) if "dilations" in attrs else [1] * len(spatial)
        begins, ends = [], []
        for size, k, stride, dilation in zip(spatial, kernel, strides, dilations):
            out = -(-size // stride)
            total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begins.append(small if mode == "SAME_UPPER" else large)
            ends.append(large if mode == "SAME_UPPER" else small)
        kept = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.append(helper.make_attribute("pads", begins + ends))


def _unique_node_names(graph: onnx.GraphProto, seen: set[str]) -> None:
    """Give every node of ``graph`` and its subgraphs a name no other node has (in
    place): onnx-ad's rules copy branches whose nodes keep their names, and onnxruntime
    refuses a model where two nodes share one ('two nodes with same node name')."""
    for node in graph.node:
        if node.name:
            name, i = node.name, 0
            while name in seen:
                i += 1
                name = f"{node.name}_{i}"
            node.name = name
            seen.add(name)
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                _unique_node_names(attribute.g, seen)
            for sub in attribute.graphs:
                _unique_node_names(sub, seen)


def _max_pools_with_indices(model: onnx.ModelProto) -> None:
    """Give each ``MaxPool`` its optional ``Indices`` output (in place): onnx-ad's rule
    scatters the gradient to where each window's maximum was, and reads them there
    rather than running the pooling a second time to find them."""
    taken = graph_names(model.graph)
    for node in model.graph.node:
        if node.op_type != "MaxPool" or node.domain not in ("", "ai.onnx"):
            continue
        storage_order = next((a.i for a in node.attribute if a.name == "storage_order"), 0)
        if storage_order == 0 and (len(node.output) < 2 or not node.output[1]):
            del node.output[1:]
            node.output.append(fresh_name(f"{node.output[0]}/argmax", taken))


def _ints_constant(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(values, np.int64))
    )


def _initializers_as_inputs(
    model: onnx.ModelProto, initializers: dict[str, onnx.TensorProto]
) -> onnx.ModelProto:
    opened = copy_model(model)
    kept = [i for i in opened.graph.initializer if i.name not in initializers]
    del opened.graph.initializer[:]
    opened.graph.initializer.extend(kept)
    opened.graph.input.extend(
        helper.make_tensor_value_info(name, t.data_type, list(t.dims))
        for name, t in initializers.items()
    )
    return opened


def _inputs_as_initializers(
    model: onnx.ModelProto, initializers: dict[str, onnx.TensorProto]
) -> None:
    inputs = [i for i in model.graph.input if i.name not in initializers]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.graph.initializer.extend(initializers.values())


def _refuse_zero_gradients(
    model: onnx.ModelProto, gradients: dict[str, str], seeds: list[str]
) -> None:
    """A gradient that reads no seed is zeros for any data: onnx-ad found no
    differentiable path from its name to the outputs."""
    zeros = [n for n, g in gradients.items() if not _value_ancestors(model.graph, g) & set(seeds)]
    if zeros:
        raise MissingGradientError(
            f"The outputs depend on {zeros} only through operators with no derivative "
            "(Shape, Size, ArgMax, comparisons, integer casts, indices...): their gradient "
            "is zero for any data, so they cannot be trained. Leave them out of "
            "weights_to_train."
        )


_SHAPE_ONLY = frozenset({"Shape", "Size"})


def _value_ancestors(graph: onnx.GraphProto, name: str) -> set[str]:
    """The tensors whose *values* ``name`` depends on: what reaches it only through
    ``Shape`` or ``Size`` (onnx-ad's zeros are shaped after the seed) does not count."""
    needed = {name}
    for node in reversed(graph.node):
        if needed.intersection(node.output) and node.op_type not in _SHAPE_ONLY:
            needed |= outer_reads(node)
    return needed


def _seed_with_ones(model: onnx.ModelProto, seed: onnx.ValueInfoProto, output: str) -> None:
    """Replace the seed input by ones of shape ``shape(output) + [1]``: a constant where
    that shape is declared (a scalar loss: then everything the seed alone computes folds
    away once shapes are static; onnxscript's folding keeps a ``ConstantOfShape``),
    else computed right after ``output``."""
    graph = model.graph
    taken = graph_names(graph)
    elem = seed.type.tensor_type.elem_type
    declared = next((o for o in graph.output if o.name == output), None)
    dims_ = None if declared is None else static_shape(declared)
    known = [d for d in dims_ or () if isinstance(d, int)]
    if dims_ is not None and len(known) == len(dims_):
        ones = np.ones([*known, 1], dtype=helper.tensor_dtype_to_np_dtype(elem))
        constant = helper.make_node(
            "Constant", [], [seed.name], value=numpy_helper.from_array(ones)
        )
        graph.node.insert(0, constant)
        graph.input.remove(seed)
        return
    shape, dims = fresh_name("seed/shape", taken), fresh_name("seed/dims", taken)
    one = fresh_name("seed/one_axis", taken)
    nodes = [
        helper.make_node("Shape", [output], [shape]),
        _ints_constant(one, [1]),
        helper.make_node("Concat", [shape, one], [dims], axis=0),
        helper.make_node(
            "ConstantOfShape",
            [dims],
            [seed.name],
            value=helper.make_tensor("one", elem, [1], [1]),
        ),
    ]
    position = 1 + max(
        (i for i, node in enumerate(graph.node) if output in node.output), default=-1
    )
    for offset, node in enumerate(nodes):
        graph.node.insert(position + offset, node)
    graph.input.remove(seed)


def _squeeze_seed_axis(model: onnx.ModelProto, n_outputs: int, wrt: list[str]) -> None:
    """Each gradient output ``[..., 1]`` squeezed to its name's shape, as ``<name>_grad``."""
    graph = model.graph
    taken = graph_names(graph)
    axis = fresh_name("seed/squeezed_axis", taken)
    graph.node.append(_ints_constant(axis, [-1]))
    derived = list(graph.output[n_outputs:])
    del graph.output[n_outputs:]
    for name, value in zip(wrt, derived):
        grad = f"{name}_grad"
        if grad in taken:
            raise MissingGradientError(
                f"The graph already has a tensor named {grad!r}, the name of the gradient of "
                f"{name!r}: rename it."
            )
        graph.node.append(helper.make_node("Squeeze", [value.name, axis], [grad]))
        dims = value.type.tensor_type.shape.dim[:-1]
        graph.output.append(
            helper.make_tensor_value_info(
                grad,
                value.type.tensor_type.elem_type,
                [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims],
            )
        )


__all__ = ["PACKAGE", "VERSION", "gradient_graph", "installed", "vector_jacobian_graph"]
