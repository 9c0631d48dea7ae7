"""LoRA: low-rank adapters beside a model's products, written in standard ONNX.

:func:`add_lora` rewrites each product that reads a chosen weight ``W`` (``MatMul``, or
``Gemm`` without ``transA``, reading ``W`` directly or through ``Transpose``; a quantized
``W`` behind a ``DequantizeLinear``, onnxruntime's ``MatMulNBits`` written as one by
:mod:`graphkit.quantized`) so that it computes, as PEFT's ``LoraLayer`` does for a
``torch.nn.Linear``,

    y = x W + (alpha / rank) ((x A) B)

(for a ``Conv`` without groups: ``A`` a kernel like ``W``'s to ``rank`` channels, then
``B`` a 1 x 1 kernel to ``W``'s, as PEFT's ``Conv2d`` adapters) with ``A`` (``[in,
rank]``) and ``B`` (``[rank, out]``) new float initializers: the only
weights a trainer trains by default (:func:`graphkit.prepare.trainable_weights` reads
them from the model's metadata); ``W`` stays frozen (a memory-mapped base stays in its
file, stored once). ``A`` is drawn as PEFT's default (Kaiming-uniform: ``U(-1/sqrt(in),
1/sqrt(in))``) or Gaussian (``N(0, 1/rank^2)``), ``B`` is zeros: the adapted model
predicts as the base model until it is trained.

What an adapted model becomes:

* :func:`merge_lora`: the plain model, ``W + (alpha / rank) A B`` folded into each
  weight (in ``W``'s layout), no trace of the adapters;
* :func:`serving_model`: the base model with each adapter weight a graph input (zeros
  by default, the base model), which onnxruntime's LoRA serving feeds from an adapter
  file (``RunOptions.add_active_adapter``);
* :func:`save_adapter`: the adapters alone, in onnxruntime's adapter format or as PEFT's
  ``adapter_model.safetensors`` and ``adapter_config.json`` (``PeftModel.from_pretrained``
  loads them into the torch model the ONNX graph was exported from).

What was added is recorded in the model's metadata (``graphkit.lora``: each weight, its
adapters, rank and alpha, and the nodes that compute them), which these functions and
the trainers read; it survives :func:`graphkit.add_loss_output` and the trained exports.

The adapters sit in the graph in the layout the products read (``A`` ``[in, rank]``,
``B`` ``[rank, out]``), so no ``Transpose`` runs at each step; PEFT's layout (``lora_A``
``[rank, in]``, ``lora_B`` ``[out, rank]``) is written by ``save_adapter(...,
format="peft")`` only.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit import tensor_store
from graphkit._graph import copy_model, fresh_name, graph_names
from graphkit.compat import load_model
from graphkit.errors import GraphkitError
from graphkit.parameters import FLOAT_ELEM_TYPES
from graphkit.quantized import quantized_as_standard
from graphkit.rewrite import META_LORA
from graphkit.tensor_store import tensor_value
from graphkit.train_mode import DROPOUT, MARK

INITS = ("kaiming", "gaussian")
"""How :func:`add_lora` draws ``A``: PEFT's default (``init_lora_weights=True``) or its
``"gaussian"``; ``B`` starts at zeros either way."""

FORMATS = ("onnxruntime", "peft")
"""What :func:`save_adapter` writes."""

_WEIGHT_SUFFIX = ".weight"


class LoraError(GraphkitError, ValueError):
    """LoRA asked of what cannot take it: targets that match no weight, a weight no
    product reads, a rank out of range, a model without adapters."""


@dataclass(frozen=True)
class Site:
    """One product that reads an adapted weight: the nodes added beside it, the
    product's own output (renamed ``base``) and the output they now write (``output``)."""

    product: str
    base: str
    output: str
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Adapter:
    """The adapters of one weight: ``W`` (``layout`` ``"in_out"``: ``[in, out]`` as the
    product reads it; ``"out_in"``: torch's ``[out, in]``, read through ``Transpose`` or
    by a ``Gemm`` with ``transB``), ``A`` ``[in, rank]``, ``B`` ``[rank, out]``; or a
    ``Conv``'s kernel (``"conv"``: ``W`` ``[out, in, k...]``, ``A`` ``[rank, in, k...]``
    convolving as the product does, ``B`` ``[out, rank, 1...]``, as PEFT's ``Conv2d``). For a
    quantized base, ``weight`` is the quantized initializer and ``chain`` the outputs of
    the nodes that make it float (its ``DequantizeLinear``, then a ``Slice`` where
    :mod:`graphkit.quantized` cut a block's padding)."""

    weight: str
    a: str
    b: str
    rank: int
    alpha: float
    layout: str
    sites: tuple[Site, ...]
    chain: tuple[str, ...] = ()
    module: str | None = None
    dropout: float = 0.0
    """PEFT's ``lora_dropout``: the probability that a unit of the adapters' input is
    dropped while training (a Dropout in training mode, :mod:`graphkit.train_mode`)."""

    @property
    def scale(self) -> float:
        """alpha / rank, what the adapters' product is multiplied by."""
        return self.alpha / self.rank


# -- adding adapters -----------------------------------------------------------------------


def add_lora(
    model: onnx.ModelProto | str | os.PathLike[str],
    targets: str | Iterable[str] | Callable[[str], bool],
    rank: int = 8,
    alpha: float = 16.0,
    dropout: float = 0.0,
    init: str = "kaiming",
    random_state: int | None = 0,
) -> onnx.ModelProto:
    """``model`` with a low-rank adapter beside each product that reads a target weight.

    Args:
        model: a ModelProto or a path (large external weights stay mapped, not copied).
        targets: which weights: a name, a glob pattern (``"*.q_proj.weight"``), a module
            name as PEFT's ``target_modules`` takes it (``"q_proj"`` matches the weight
            ``...self_attn.q_proj.weight``, and a weight an exporter renamed that a
            ``q_proj`` module's product reads: :func:`module_of`), a list of these, or a
            predicate of the initializer's name.
        rank: the adapters' rank r, 1 <= r <= min(in, out) of every target.
        alpha: the scale's numerator: the adapters add ``(alpha / rank) (x A) B``.
        dropout: PEFT's ``lora_dropout``, in [0, 1): the adapters read ``Dropout(x)``
            (``B A Dropout(x)``), active while training (its masks from the trainers'
            seeded stream, :mod:`graphkit.train_mode`), inactive when predicting and in
            the exported inference and merged models.
        init: ``"kaiming"`` (PEFT's default) or ``"gaussian"``, how ``A`` is drawn.
        random_state: the seed of ``A``'s draw (None: a fresh one).

    Returns:
        A new model; the adapters are recorded in its metadata (:func:`adapters`).

    Raises:
        LoraError: no weight matches (the message lists the candidates), a matched weight
            is read by no product, the rank is out of range, the model has adapters
            already, or a parameter is invalid.
    """
    model = load_model(model)
    if adapters(model):
        raise LoraError(
            "The model has LoRA adapters already; merge them first (graphkit.lora."
            "merge_lora) or add every target in one add_lora call."
        )
    _check_params(rank, alpha, dropout, init)
    out = copy_model(quantized_as_standard(model))
    candidates = _product_weights(out.graph)
    chosen = _match(targets, [t.name for t in out.graph.initializer], candidates)
    rng = np.random.default_rng(random_state)
    taken = graph_names(out.graph)
    added = [
        _add_adapter(out.graph, *candidates[name], rank, alpha, init, rng, taken, dropout)
        for name in chosen
    ]
    _write_record(out, added)
    return out


def _check_params(rank: int, alpha: float, dropout: float, init: str) -> None:
    if not isinstance(rank, (int, np.integer)) or isinstance(rank, bool) or rank < 1:
        raise LoraError(f"rank must be a positive integer, got {rank!r}.")
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
        raise LoraError(f"alpha must be a positive number, got {alpha!r}.")
    if not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
        raise LoraError(f"dropout must lie in [0, 1), got {dropout!r}.")
    if init not in INITS:
        raise LoraError(f"init must be one of {INITS}, not {init!r}.")


@dataclass(frozen=True)
class _Weight:
    """A weight a product can read: the initializer ``name`` itself, or the quantized
    tensor ``name`` that the nodes whose outputs are ``chain`` make float (its
    ``DequantizeLinear``, a ``Slice`` of it); ``dims`` are the float weight's, ``dtype``
    the float type the product computes in."""

    name: str
    dims: tuple[int, ...]
    dtype: np.dtype
    chain: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Reader:
    """A product reading a weight: the node, the input it multiplies the weight by, and
    the layout it reads the weight in."""

    node: onnx.NodeProto
    x: str
    layout: str


def _weights(graph: onnx.GraphProto) -> dict[str, _Weight]:
    """The tensors a product may read as its weight, by the name it reads: each rank-2
    float initializer, and each ``DequantizeLinear`` of a rank-2 initializer (a quantized
    base: per-tensor, per-channel or block-wise, any integer type)."""
    initializers = {t.name: t for t in graph.initializer}
    found = {
        t.name: _Weight(t.name, tuple(t.dims), helper.tensor_dtype_to_np_dtype(t.data_type))
        for t in graph.initializer
        if len(t.dims) == 2 and t.data_type in FLOAT_ELEM_TYPES
    }
    for node in graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in initializers:
            quantized, scale = initializers[node.input[0]], initializers.get(node.input[1])
            if len(quantized.dims) == 2 and scale is not None:
                dtype = helper.tensor_dtype_to_np_dtype(scale.data_type)
                dims = tuple(quantized.dims)
                found[node.output[0]] = _Weight(quantized.name, dims, dtype, (node.output[0],))
        elif node.op_type == "Slice" and node.input[0] in found and found[node.input[0]].chain:
            if all(name in initializers for name in node.input[1:] if name):
                weight = found[node.input[0]]
                dims = _sliced(weight.dims, [initializers.get(n) for n in node.input[1:]])
                chain = (*weight.chain, node.output[0])
                found[node.output[0]] = _Weight(weight.name, dims, weight.dtype, chain)
    return found


def _sliced(dims: tuple[int, ...], bounds: list[onnx.TensorProto | None]) -> tuple[int, ...]:
    """The dims of a ``Slice`` of a ``dims`` tensor by constant starts, ends[, axes, steps]."""
    starts, ends, axes, steps = ([*bounds, None, None][k] for k in range(4))
    assert starts is not None and ends is not None  # a Slice's two required inputs
    index = [slice(None)] * len(dims)
    axes_ = tensor_value(axes).tolist() if axes is not None else range(len(dims))
    steps_ = tensor_value(steps).tolist() if steps is not None else [1] * len(dims)
    for axis, start, end, step in zip(
        axes_, tensor_value(starts).tolist(), tensor_value(ends).tolist(), steps_, strict=False
    ):
        index[axis] = slice(start, end, step)
    return tuple(len(range(d)[i]) for d, i in zip(dims, index, strict=True))


def _product_weights(graph: onnx.GraphProto) -> dict[str, tuple[_Weight, list[_Reader]]]:
    """Each weight (:func:`_weights`) read as the right operand of a product, by its
    initializer's name: ``MatMul(x, W)``, ``MatMul(x, Transpose(W))``, ``Gemm(x, W)``
    (``transA=0``; ``transB`` says the layout); and each kernel of a ``Conv`` without
    groups (layout ``"conv"``)."""
    weights = _weights(graph)
    transposed = {
        n.output[0]: weights[n.input[0]]
        for n in graph.node
        if n.op_type == "Transpose"
        and n.input[0] in weights
        and list(_attr(n, "perm", [1, 0])) == [1, 0]
    }
    found: dict[str, tuple[_Weight, list[_Reader]]] = {}
    kernels = {
        t.name: _Weight(t.name, tuple(t.dims), helper.tensor_dtype_to_np_dtype(t.data_type))
        for t in graph.initializer
        if len(t.dims) >= 3 and t.data_type in FLOAT_ELEM_TYPES
    }
    for node in graph.node:
        if node.op_type == "Conv" and node.input[1] in kernels and _attr(node, "group", 1) == 1:
            weight = kernels[node.input[1]]
            found.setdefault(weight.name, (weight, []))[1].append(
                _Reader(node, node.input[0], "conv")
            )
            continue
        if node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        if node.op_type == "Gemm" and _attr(node, "transA", 0):
            continue
        right = node.input[1]
        if right in weights:
            weight = weights[right]
            layout = "out_in" if node.op_type == "Gemm" and _attr(node, "transB", 0) else "in_out"
        elif right in transposed and node.op_type == "MatMul":
            weight, layout = transposed[right], "out_in"
        else:
            continue
        found.setdefault(weight.name, (weight, []))[1].append(_Reader(node, node.input[0], layout))
    return found


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _match(
    targets: str | Iterable[str] | Callable[[str], bool],
    names: Sequence[str],
    candidates: Mapping[str, tuple[_Weight, list[_Reader]]],
) -> list[str]:
    """The initializer names ``targets`` chooses, in graph order, each read by a product."""
    modules = {n: module_of(n, readers[0].node) for n, (_, readers) in candidates.items()}
    if callable(targets):
        chosen = [n for n in names if targets(n)]
        asked = "the predicate"
    else:
        patterns = [targets] if isinstance(targets, str) else list(targets)
        if not patterns or not all(isinstance(p, str) for p in patterns):
            raise LoraError(
                "targets must be a name, a glob pattern, a list of them or a predicate, "
                f"got {targets!r}."
            )
        chosen = [n for n in names if any(_matches(n, modules.get(n), p) for p in patterns)]
        asked = f"targets {patterns}"
    listing = _listing(f"{n!r} ({modules[n]})" if modules[n] else repr(n) for n in candidates)
    if not chosen:
        raise LoraError(
            f"{asked} match no weight of the model. Weights read by a product (MatMul, "
            f"Gemm), with the torch module they came from where the graph says: {listing}."
        )
    unread = [n for n in chosen if n not in candidates]
    if unread and not any(n in candidates for n in chosen):
        raise LoraError(
            f"{asked} match {_listing(map(repr, unread))}, which no product (MatMul, Gemm) "
            "reads as its weight: LoRA adapts the weights of linear layers. Weights read "
            f"by a product: {listing}."
        )
    return [n for n in chosen if n in candidates]


def _matches(name: str, module: str | None, pattern: str) -> bool:
    """An exact name or a glob of the weight's, or a module name (PEFT's
    ``target_modules``): the weight's module (:func:`module_of`) equal to the pattern,
    ending with ``.pattern``, or matching it as a glob."""
    if name == pattern or fnmatch.fnmatchcase(name, pattern):
        return True
    return module is not None and (
        module == pattern or module.endswith("." + pattern) or fnmatch.fnmatchcase(module, pattern)
    )


def module_of(weight: str, product: onnx.NodeProto) -> str | None:
    """The torch module a weight came from: its name without ``.weight``; else, for a
    weight an exporter renamed (``onnx::MatMul_644``, ``val_23``: a transpose folded),
    the module of the product that reads it, from the dynamo exporter's name scopes
    (``pkg.torch.onnx.name_scopes``) or the TorchScript exporter's node name
    (``/m/model/layers.0/self_attn/q_proj/MatMul``); None where neither says."""
    if weight.endswith(_WEIGHT_SUFFIX):
        return weight.removesuffix(_WEIGHT_SUFFIX)
    meta = {p.key: p.value for p in product.metadata_props}
    if "pkg.torch.onnx.name_scopes" in meta and "pkg.torch.onnx.class_hierarchy" in meta:
        try:
            scopes = ast.literal_eval(meta["pkg.torch.onnx.name_scopes"])
            classes = ast.literal_eval(meta["pkg.torch.onnx.class_hierarchy"])
        except (ValueError, SyntaxError):
            return None
        modules = [s for s, c in zip(scopes, classes, strict=False) if s and "aten." not in c]
        return modules[-1] if modules else None
    parts = product.name.split("/")
    if product.name.startswith("/") and len(parts) > 2:
        return ".".join(parts[1:-1])
    return None


def _listing(names: Iterable[str], most: int = 12) -> str:
    names = list(names)
    shown = ", ".join(names[:most])
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return (shown + more) if names else "none"


def _add_adapter(
    graph: onnx.GraphProto,
    weight: _Weight,
    readers: list[_Reader],
    rank: int,
    alpha: float,
    init: str,
    rng: np.random.Generator,
    taken: set[str],
    dropout: float = 0.0,
) -> Adapter:
    """``A``, ``B`` of ``weight`` and the nodes that add ``(alpha / rank) (x A) B`` to
    each product reading it (``x`` through a Dropout of ratio ``dropout`` if positive);
    the adapters are named after the weight's torch module where the graph says it
    (``<module>.lora_A.weight``), else after the weight."""
    layout = readers[0].layout
    if any(r.layout != layout for r in readers):
        raise LoraError(
            f"{weight.name!r} is read in two layouts (directly and transposed); adapt one "
            "product at a time is not supported."
        )
    if layout == "conv":  # W [out, in, k...]: A [rank, in, k...], B [out, rank, 1...]
        fan_in, fan_out = math.prod(weight.dims[1:]), weight.dims[0]
    else:
        rows, cols = weight.dims
        fan_in, fan_out = (rows, cols) if layout == "in_out" else (cols, rows)
    if rank > min(fan_in, fan_out):
        raise LoraError(
            f"rank={rank} exceeds {weight.name!r}'s dimensions ({fan_in} inputs, {fan_out} "
            f"outputs): the rank must be at most {min(fan_in, fan_out)}."
        )
    dtype = weight.dtype
    module = module_of(weight.name, readers[0].node)
    stem = module or weight.name
    suffix = _WEIGHT_SUFFIX if module else ""
    a_name = fresh_name(f"{stem}.lora_A{suffix}", taken)
    b_name = fresh_name(f"{stem}.lora_B{suffix}", taken)
    a = _draw_a(init, fan_in, rank, rng).astype(dtype)
    b = np.zeros((rank, fan_out), dtype)
    if layout == "conv":  # PEFT's Conv adapters: a kernel like W's to rank, then 1 x 1
        spatial = len(weight.dims) - 2
        a = np.ascontiguousarray(a.T).reshape(rank, *weight.dims[1:])
        b = np.zeros((fan_out, rank, *[1] * spatial), dtype)
    graph.initializer.extend(
        [numpy_helper.from_array(a, a_name), numpy_helper.from_array(b, b_name)]
    )
    sites = [
        _add_site(graph, r, a_name, b_name, alpha / rank, dtype, taken, dropout) for r in readers
    ]
    return Adapter(
        weight.name,
        a_name,
        b_name,
        rank,
        float(alpha),
        layout,
        tuple(sites),
        weight.chain,
        module,
        float(dropout),
    )


def _draw_a(init: str, fan_in: int, rank: int, rng: np.random.Generator) -> np.ndarray:
    """PEFT's draws of ``lora_A`` (``[rank, in]`` in torch), returned as ``[in, rank]``:
    Kaiming-uniform with ``a = sqrt(5)``, i.e. ``U(-1/sqrt(in), 1/sqrt(in))``, or
    ``N(0, (1/rank)^2)``."""
    if init == "kaiming":
        bound = 1.0 / math.sqrt(fan_in)
        return rng.uniform(-bound, bound, size=(rank, fan_in)).T
    return rng.normal(0.0, 1.0 / rank, size=(rank, fan_in)).T


def _add_site(
    graph: onnx.GraphProto,
    reader: _Reader,
    a: str,
    b: str,
    scale: float,
    dtype: np.dtype,
    taken: set[str],
    dropout: float = 0.0,
) -> Site:
    """After ``reader``'s product: ``y = base + ((x A) B) * scale``, where the product
    now writes ``base`` (the nodes computed in PEFT's order); with ``dropout``, ``x`` is
    ``Dropout(x)`` in its inference form, marked to train in training mode."""
    product = reader.node
    output = product.output[0]
    base = fresh_name(f"{output}/lora_base", taken)
    product.output[0] = base
    prefix = f"lora/{product.name or output}"
    names = [
        fresh_name(f"{prefix}/{op}", taken) for op in ("MatMulA", "MatMulB", "Scale", "Mul", "Add")
    ]
    xa, xab, scale_name, scaled = (
        fresh_name(f"{prefix}/{v}", taken) for v in ("xA", "xAB", "s", "sxAB")
    )
    x = reader.x
    dropped: list[onnx.NodeProto] = []
    if dropout > 0:
        ratio, x = fresh_name(f"{prefix}/ratio", taken), fresh_name(f"{prefix}/dropped", taken)
        ratio_name, dropout_name = (
            fresh_name(f"{prefix}/{op}", taken) for op in ("Ratio", "Dropout")
        )
        value = numpy_helper.from_array(np.array(dropout, dtype=dtype))
        dropped = [
            helper.make_node("Constant", [], [ratio], name=ratio_name, value=value),
            helper.make_node("Dropout", [reader.x, ratio], [x], name=dropout_name),
        ]
        dropped[1].metadata_props.add(key=MARK, value=DROPOUT)
        names += [ratio_name, dropout_name]
    if reader.layout == "conv":  # A convolves as the product does; B is 1 x 1
        geometry = [
            attr
            for attr in product.attribute
            if attr.name in ("auto_pad", "dilations", "pads", "strides")
        ]
        first = helper.make_node("Conv", [x, a], [xa], name=names[0])
        first.attribute.extend(geometry)
        second = helper.make_node("Conv", [xa, b], [xab], name=names[1])
    else:
        first = helper.make_node("MatMul", [x, a], [xa], name=names[0])
        second = helper.make_node("MatMul", [xa, b], [xab], name=names[1])
    nodes = [
        *dropped,
        first,
        second,
        helper.make_node(
            "Constant",
            [],
            [scale_name],
            name=names[2],
            value=numpy_helper.from_array(np.array(scale, dtype=dtype)),
        ),
        helper.make_node("Mul", [xab, scale_name], [scaled], name=names[3]),
        helper.make_node("Add", [base, scaled], [output], name=names[4]),
    ]
    position = list(graph.node).index(product) + 1
    for offset, node in enumerate(nodes):
        graph.node.insert(position + offset, node)
    return Site(product.name, base, output, tuple(names))


# -- the record in the metadata ------------------------------------------------------------


def _write_record(model: onnx.ModelProto, added: Sequence[Adapter]) -> None:
    record = json.dumps({"version": 1, "adapters": [asdict(a) for a in added]})
    kept = [p for p in model.metadata_props if p.key != META_LORA]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.append(onnx.StringStringEntryProto(key=META_LORA, value=record))


def adapters(model: onnx.ModelProto) -> list[Adapter]:
    """The adapters :func:`add_lora` recorded in ``model`` (empty for other models)."""
    for prop in model.metadata_props:
        if prop.key == META_LORA:
            record = json.loads(prop.value)
            return [
                Adapter(
                    **{
                        **a,
                        "sites": tuple(
                            Site(**{**s, "nodes": tuple(s["nodes"])}) for s in a["sites"]
                        ),
                        "chain": tuple(a.get("chain", ())),
                    }
                )
                for a in record["adapters"]
            ]
    return []


def adapter_names(model: onnx.ModelProto) -> list[str]:
    """The adapter weights of ``model`` (``A`` then ``B`` of each target), which a trainer
    trains by default; empty for a model without adapters."""
    return [name for a in adapters(model) for name in (a.a, a.b)]


def _adapters_of(model: onnx.ModelProto, what: str) -> list[Adapter]:
    found = adapters(model)
    if not found:
        raise LoraError(
            f"{what}: the model has no LoRA adapters (none recorded by graphkit.lora."
            "add_lora in its metadata)."
        )
    return found


# -- values --------------------------------------------------------------------------------


def lora_state(
    model: onnx.ModelProto | str | os.PathLike[str],
    state: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The adapter weights' values, in the graph's layout (``A`` ``[in, rank]``, ``B``
    ``[rank, out]``): from ``state`` (a trainer's ``get_state()``) where it has them,
    else from the model's initializers.

    Raises:
        LoraError: the model has no adapters.
    """
    model = load_model(model)
    names = adapter_names(_checked(model, "lora_state"))
    initializers = {t.name: t for t in model.graph.initializer if t.name in names}
    return {
        n: np.array(state[n] if state is not None and n in state else tensor_value(initializers[n]))
        for n in names
    }  # copies: small, and the caller's to change


def _checked(model: onnx.ModelProto, what: str) -> onnx.ModelProto:
    _adapters_of(model, what)
    return model


def merge_lora(
    model: onnx.ModelProto | str | os.PathLike[str],
    state: Mapping[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    """The plain model: each adapted weight replaced by ``W + (alpha / rank) A B`` (in
    ``W``'s layout), the adapters' nodes, initializers and record removed.

    Args:
        model: a model :func:`add_lora` adapted (a trainer's ``get_trained_onnx()``, or
            the model given to the trainer with ``state``).
        state: trained values by name (a trainer's ``get_state()``): they replace the
            initializers of the same name first.

    Raises:
        LoraError: the model has no adapters.
    """
    model = load_model(model)
    found = _adapters_of(model, "merge_lora")
    out = copy_model(model)
    values = lora_state(out, state)
    graph = out.graph
    if state is not None:
        _set_values(graph, state)
    # each merged weight as a float initializer named as the product reads it: W's own
    # name, or the end of a quantized base's chain (whose nodes then go)
    merged = {(a.chain or (a.weight,))[-1]: _merged_weight(graph, a, values) for a in found}
    chains = {name for a in found for name in a.chain}
    removed = {name for a in found for s in a.sites for name in s.nodes}
    renamed = {s.base: s.output for a in found for s in a.sites}
    kept = [n for n in graph.node if n.name not in removed and n.output[0] not in chains]
    for node in kept:
        node.output[:] = [renamed.get(o, o) for o in node.output]
    del graph.node[:]
    graph.node.extend(kept)
    read = {name for n in kept for name in n.input}
    dropped = set(adapter_names(out)) | set(merged)
    dropped |= _quantization_inputs(found, model) - read
    tensors = [t for t in graph.initializer if t.name not in dropped]
    tensors += [numpy_helper.from_array(value, name) for name, value in merged.items()]
    del graph.initializer[:]
    graph.initializer.extend(tensors)
    _drop_record(out)
    return out


def _set_values(graph: onnx.GraphProto, state: Mapping[str, np.ndarray]) -> None:
    """Replace the initializers ``state`` names by its values."""
    for k, tensor in enumerate(graph.initializer):
        if tensor.name in state:
            graph.initializer[k].CopyFrom(
                numpy_helper.from_array(np.asarray(state[tensor.name]), tensor.name)
            )


def _quantization_inputs(found: Sequence[Adapter], model: onnx.ModelProto) -> set[str]:
    """What the chains of merged quantized weights read (the quantized tensor, its scales
    and zero points, a slice's bounds): dropped where nothing else reads them."""
    chains = {name for a in found for name in a.chain}
    return {name for n in model.graph.node if n.output[0] in chains for name in n.input} - chains


def _merged_weight(
    graph: onnx.GraphProto, adapter: Adapter, values: Mapping[str, np.ndarray]
) -> np.ndarray:
    """W + (alpha / rank) A B, transposed for a weight stored ``[out, in]``; a quantized
    weight is dequantized first (the merged weight is float)."""
    w = _dequantized(graph, adapter) if adapter.chain else _initializer(graph, adapter.weight)
    a, b = values[adapter.a], values[adapter.b]
    if adapter.layout == "conv":  # B [out, rank, 1...] A [rank, in, k...] -> [out, in, k...]
        delta = (b.reshape(b.shape[0], -1) @ a.reshape(a.shape[0], -1)).reshape(w.shape)
    else:
        delta = a @ b
    delta = delta * np.asarray(adapter.scale, dtype=w.dtype)
    if adapter.layout == "out_in":
        delta = delta.T
    return (w + delta.astype(w.dtype)).astype(w.dtype)


def _initializer(graph: onnx.GraphProto, name: str) -> np.ndarray:
    return tensor_value(next(t for t in graph.initializer if t.name == name))


def _dequantized(graph: onnx.GraphProto, adapter: Adapter) -> np.ndarray:
    """The float value of a quantized weight: its chain (``DequantizeLinear``, ``Slice``)
    evaluated by onnx's reference implementation on the initializers it reads."""
    nodes = [n for n in graph.node if n.output[0] in set(adapter.chain)]
    read = {name for n in nodes for name in n.input}
    chain = helper.make_graph(
        nodes,
        "dequantize",
        [],
        [helper.make_tensor_value_info(adapter.chain[-1], 0, None)],
        [t for t in graph.initializer if t.name in read],
    )
    model = helper.make_model(chain, opset_imports=[helper.make_opsetid("", 21)])
    from onnx.reference import ReferenceEvaluator  # only here: a second to import

    (value,) = ReferenceEvaluator(tensor_store.inline(model)).run(None, {})
    return np.asarray(value)


def _drop_record(model: onnx.ModelProto) -> None:
    kept = [p for p in model.metadata_props if p.key != META_LORA]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)


def serving_model(model: onnx.ModelProto | str | os.PathLike[str]) -> onnx.ModelProto:
    """The adapted model as onnxruntime serves LoRA: each adapter weight a graph input
    whose default is zeros (without an active adapter, the base model predicts), which an
    adapter file written by :func:`save_adapter` fills (``RunOptions.add_active_adapter``
    on onnxruntime 1.20 or later).

    Raises:
        LoraError: the model has no adapters.
    """
    model = load_model(model)
    names = set(adapter_names(_checked(model, "serving_model")))
    out = copy_model(model)
    graph = out.graph
    tensors = []
    for tensor in graph.initializer:
        if tensor.name in names:
            dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
            graph.input.append(
                helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
            )
            tensor = numpy_helper.from_array(np.zeros(tuple(tensor.dims), dtype), tensor.name)
        tensors.append(tensor)
    del graph.initializer[:]
    graph.initializer.extend(tensors)
    return out


# -- adapter files -------------------------------------------------------------------------


def save_adapter(
    model: onnx.ModelProto | str | os.PathLike[str],
    path: str | os.PathLike[str],
    format: str = "onnxruntime",  # noqa: A002 - the word users know
    state: Mapping[str, np.ndarray] | None = None,
    *,
    adapter_version: int = 1,
    model_version: int = 1,
    base_model_name_or_path: str | None = None,
    module_prefix: str = "",
) -> str:
    """Write the adapters alone; returns the path written.

    Args:
        model: the adapted model (its record says what the adapters are).
        path: ``format="onnxruntime"``: the adapter file (``.onnx_adapter``);
            ``format="peft"``: a folder, where ``adapter_model.safetensors`` and
            ``adapter_config.json`` are written.
        format: ``"onnxruntime"``: onnxruntime's adapter format, the graph's names and
            layout (:func:`serving_model` is the model it activates on); ``"peft"``:
            PEFT's names and torch's layout, for ``PeftModel.from_pretrained`` on the
            torch model the graph was exported from.
        state: trained values by name (a trainer's ``get_state()``), else the model's.
        adapter_version, model_version: onnxruntime's version fields.
        base_model_name_or_path: PEFT's field of that name.
        module_prefix: for ``format="peft"``, a prefix of the ONNX weight names that the
            torch model PEFT loads into does not have (the attribute of a wrapper module
            the graph was exported through: ``"m."``); removed from the module names.

    Raises:
        LoraError: the model has no adapters; ``format="peft"`` for a weight whose name
            did not come from a torch module (``<module>.weight``); an unknown format.
        ImportError: the writer's package is missing (the message names it).
    """
    if format not in FORMATS:
        raise LoraError(f"format must be one of {FORMATS}, not {format!r}.")
    model = load_model(model)
    found = _adapters_of(model, "save_adapter")
    values = lora_state(model, state)
    path = os.fspath(path)
    if format == "onnxruntime":
        from graphkit.engine.ort_engine import write_adapter

        write_adapter(path, values, adapter_version, model_version)
        return path
    return _save_peft(found, values, path, base_model_name_or_path, module_prefix)


def _save_peft(
    found: Sequence[Adapter],
    values: Mapping[str, np.ndarray],
    folder: str,
    base_model_name_or_path: str | None,
    module_prefix: str,
) -> str:
    """PEFT's ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``
    ``[rank, in]``, ``lora_B.weight`` ``[out, rank]``) and ``adapter_config.json``."""
    untraceable = [repr(a.weight) for a in found if a.module is None]
    if untraceable:
        raise LoraError(
            f"PEFT's format names adapters by torch module, but the graph does not say "
            f"which module {_listing(untraceable)} came from (neither its name, "
            "'<module>.weight', nor its product's name or metadata, as torch's exporters "
            "write them). Save format='onnxruntime' instead."
        )
    ranks = {a.rank for a in found}
    alphas = {a.alpha for a in found}
    if len(ranks) != 1 or len(alphas) != 1:
        raise LoraError(
            f"PEFT's adapter_config.json holds one rank and alpha; the adapters have ranks "
            f"{sorted(ranks)} and alphas {sorted(alphas)}."
        )
    try:
        from safetensors.numpy import save_file
    except ImportError as exc:
        raise ImportError(
            "Saving PEFT's format needs safetensors: pip install 'graphkit-onnx[peft]' "
            "(or pip install safetensors)."
        ) from exc
    tensors: dict[str, np.ndarray] = {}
    modules = []
    for a in found:
        module = a.module or ""
        if module_prefix and not module.startswith(module_prefix):
            raise LoraError(f"{a.weight!r} does not start with module_prefix {module_prefix!r}.")
        module = module.removeprefix(module_prefix)
        modules.append(module)
        a_value, b_value = values[a.a], values[a.b]
        if a.layout != "conv":  # torch's Linear layout: lora_A [rank, in], lora_B [out, rank]
            a_value, b_value = a_value.T, b_value.T
        tensors[f"base_model.model.{module}.lora_A.weight"] = np.ascontiguousarray(a_value)
        tensors[f"base_model.model.{module}.lora_B.weight"] = np.ascontiguousarray(b_value)
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": None,
        "base_model_name_or_path": base_model_name_or_path,
        "r": found[0].rank,
        "lora_alpha": int(found[0].alpha) if found[0].alpha.is_integer() else found[0].alpha,
        "lora_dropout": found[0].dropout,
        "target_modules": modules,  # the full names: PEFT adapts exactly these
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
    }
    with open(os.path.join(folder, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return folder


__all__ = [
    "Adapter",
    "LoraError",
    "adapter_names",
    "adapters",
    "add_lora",
    "lora_state",
    "merge_lora",
    "module_of",
    "save_adapter",
    "serving_model",
]
