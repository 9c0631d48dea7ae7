"""The IR-version and opset policy: one place decides what the backends load.

Each registered backend declares the newest IR version and ``ai.onnx`` opset its
runtime loads (:func:`graphkit.backends.format_limits`); graphkit writes models every one
of them loads. With onnxruntime-training 1.19.2 (the ``ort_training`` backend) that is
IR version <= 10 and opset <= 21, while onnx >= 1.18 writes newer IR versions by default.
Every model graphkit produces goes through :func:`finalize`; every model a user hands in
goes through :func:`make_compatible`, which converts what can be converted and refuses
the rest with a message saying what to do.
"""

from __future__ import annotations

import os
import re

import onnx
from onnx import TensorProto

from graphkit.backends import format_limits
from graphkit.errors import IncompatibleModelError

MAX_IR_VERSION, MAX_OPSET = format_limits()
"""Highest ONNX IR version and ``ai.onnx`` opset every registered backend loads."""

DSL_OPSET = 18
"""The ``ai.onnx`` opset graphkit's onnxscript functions are written against."""

# Element types that exist in IR version 10 (TensorProto.DataType values up to INT4).
_MAX_IR10_ELEM_TYPE = TensorProto.INT4

_REEXPORT_HINT = (
    "Re-export the model with an opset from 18 to 21, e.g. "
    "torch.onnx.export(..., opset_version=18) or skl2onnx.to_onnx(..., target_opset=18)."
)


def load_model(model: onnx.ModelProto | bytes | str | os.PathLike[str]) -> onnx.ModelProto:
    """A ModelProto from itself, its serialized bytes or a path to a .onnx file.

    Raises:
        FileNotFoundError: the path does not exist.
        IncompatibleModelError: the file or bytes are not a valid ONNX model (truncated,
            corrupted, another format); the message names the file.
        TypeError: ``model`` is none of these.
    """
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        where, data = "The bytes given", bytes(model)
    elif isinstance(model, (str, os.PathLike)):
        where = f"{os.fspath(model)!r}"
        if not os.path.isfile(model):
            raise FileNotFoundError(f"No ONNX model at {where}: the file does not exist.")
        with open(model, "rb") as handle:
            data = handle.read()
    else:
        raise TypeError(
            "A model must be an onnx.ModelProto, its serialized bytes or a path to a .onnx "
            f"file, not {type(model).__name__}."
        )
    try:
        loaded = onnx.load_from_string(data)
    except Exception as exc:  # protobuf's DecodeError, or a truncated external-data model
        raise IncompatibleModelError(
            f"{where} is not a valid ONNX model (truncated or corrupted?): {exc}. "
            "Export or download it again."
        ) from None
    if not loaded.graph.node and not loaded.graph.output:
        raise IncompatibleModelError(
            f"{where} is not a valid ONNX model: it decodes to an empty graph (truncated, "
            "corrupted or another file format?). Export or download it again."
        )
    return loaded


def opset_of(model: onnx.ModelProto, domain: str = "") -> int | None:
    """The version of ``domain`` the model imports (``""`` is ``ai.onnx``), or None."""
    for entry in model.opset_import:
        if entry.domain in ((domain, "ai.onnx") if domain == "" else (domain,)):
            return entry.version
    return None


def set_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    for entry in model.opset_import:
        if entry.domain == domain:
            entry.version = version
            return
    model.opset_import.append(onnx.helper.make_opsetid(domain, version))


def make_compatible(model: onnx.ModelProto, min_opset: int | None = None) -> onnx.ModelProto:
    """Return a copy of ``model`` that every backend can load.

    Args:
        model: any ONNX model.
        min_opset: raise the ``ai.onnx`` opset to at least this version (used when
            graphkit pieces written for :data:`DSL_OPSET` are merged into the model).

    Returns:
        A converted copy with IR version <= 10 and ``min_opset <= opset <= 21``.

    Raises:
        IncompatibleModelError: the IR version or opset cannot be converted.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _merge_opset_imports(out)
    _declare_io_shapes(out)
    _lower_ir_version(out)
    opset = opset_of(out)
    if opset is None:
        raise IncompatibleModelError(
            "The model imports no ai.onnx opset; add one with "
            "onnx.helper.make_opsetid('', 18) in opset_imports."
        )
    target = opset
    if opset > MAX_OPSET:
        target = MAX_OPSET
    if min_opset is not None and target < min_opset:
        target = min_opset
    if target != opset:
        out = _convert_opset(out, opset, target)
    else:
        check_valid(out)
    return out


def _declare_io_shapes(model: onnx.ModelProto) -> None:
    """Give the graph's inputs and outputs that declare an element type but no shape
    the shape onnx's inference finds (in place): ``onnx.checker`` refuses them ("Field
    'shape' of 'type' is required but missing"), where onnxruntime runs them.

    Raises:
        IncompatibleModelError: inference cannot tell the shape of one of them (a graph
            input always: nothing comes before it).
    """
    values = [*model.graph.input, *model.graph.output]
    missing = [
        v
        for v in values
        if v.type.HasField("tensor_type") and not v.type.tensor_type.HasField("shape")
    ]
    if not missing:
        return
    try:
        inferred = onnx.shape_inference.infer_shapes(model).graph
        known = {v.name: v for v in [*inferred.value_info, *inferred.output]}
    except Exception:  # the checker below says what is wrong with the model
        known = {}
    unknown = []
    for value in missing:
        found = known.get(value.name)
        if found is not None and found.type.tensor_type.HasField("shape"):
            value.type.tensor_type.shape.CopyFrom(found.type.tensor_type.shape)
        else:
            unknown.append(value.name)
    if unknown:
        raise IncompatibleModelError(
            f"The model's inputs or outputs {unknown} declare an element type but no shape, "
            "which onnx.checker refuses, and onnx's shape inference cannot tell it: declare "
            "each one's shape, with a name for the batch dimension (onnx.helper."
            "make_tensor_value_info(name, elem_type, ['N', 4]))."
        )


_BAD_NODE = re.compile(r"Name: (\S*) OpType: (\S+)")


def check_valid(model: onnx.ModelProto) -> None:
    """Raise :class:`IncompatibleModelError` naming the node when a node of ``model`` is
    not valid ONNX (``onnx.checker``), instead of the checker's own ``ValidationError``.

    Exporters can write invalid nodes: one left in an older opset's form (an ``axes``
    attribute where the opset takes an input), an attribute of the wrong type... What the
    checker says of the graph around the nodes (an output declared without a shape) is
    left to the runtime, which loads such models.
    """
    try:
        onnx.checker.check_model(_checkable(model))
    except onnx.checker.ValidationError as exc:
        text = str(exc).strip()
        found = _BAD_NODE.search(text)
        if not found:
            return
        where = f" (node {found.group(1)!r}, {found.group(2)})"
        raise IncompatibleModelError(
            f"The model is not valid ONNX{where}: {text.splitlines()[0]}. An exporter can "
            "leave a node in an older opset's form; re-export the model (another "
            "opset_version, or the other torch.onnx.export exporter) or fix that node."
        ) from exc


def finalize(
    model: onnx.ModelProto, check: bool = True, full_check: bool = False
) -> onnx.ModelProto:
    """Stamp a model graphkit built so that every backend loads it.

    Sets the IR version to at most :data:`MAX_IR_VERSION`, checks the ``ai.onnx`` opset is
    at most :data:`MAX_OPSET` and runs
    ``onnx.checker`` (with type and shape inference when ``full_check``).
    Modifies ``model`` in place and returns it.
    """
    model.ir_version = min(model.ir_version or MAX_IR_VERSION, MAX_IR_VERSION)
    opset = opset_of(model)
    if opset is not None and opset > MAX_OPSET:
        raise IncompatibleModelError(
            f"graphkit produced a model with ai.onnx opset {opset} > {MAX_OPSET}; "
            "this is a bug in graphkit, please report it."
        )
    if check:
        onnx.checker.check_model(_checkable(model), full_check=full_check)
    return model


_RUNTIME_DOMAIN = "graphkit.onnxruntime_internal"


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy the checker can read when it holds onnxruntime's internal
    gradient operators.

    onnxruntime-training registers a few gradient kernels (``MaxPoolGrad``,
    ``AveragePoolGrad``...) in the default ONNX domain, where ``onnx.checker`` knows no
    schema for them ("No Op registered for MaxPoolGrad"). The copy moves exactly those
    nodes to a private domain so that the rest of the graph is still fully checked.
    """
    unknown = {
        node.op_type
        for node in model.graph.node
        if node.domain in ("", "ai.onnx")
        and not onnx.defs.has(node.op_type)
        and node.op_type.endswith("Grad")
    }
    if not unknown:
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in unknown:
            node.domain = _RUNTIME_DOMAIN
    set_opset(copy, _RUNTIME_DOMAIN, 1)
    return copy


def _merge_opset_imports(model: onnx.ModelProto) -> None:
    """One entry per domain, the highest version ("ai.onnx" is ""); skl2onnx sometimes
    writes the default domain twice, and the version converter then updates only one."""
    versions: dict[str, int] = {}
    for entry in model.opset_import:
        domain = "" if entry.domain == "ai.onnx" else entry.domain
        versions[domain] = max(versions.get(domain, 0), entry.version)
    del model.opset_import[:]
    model.opset_import.extend(onnx.helper.make_opsetid(d, v) for d, v in versions.items())


def _lower_ir_version(model: onnx.ModelProto) -> None:
    if model.ir_version <= MAX_IR_VERSION:
        return
    too_new = sorted({_type_name(t) for t in _elem_types(model.graph) if t > _MAX_IR10_ELEM_TYPE})
    if too_new:
        raise IncompatibleModelError(
            f"The model has IR version {model.ir_version} and uses element types "
            f"{', '.join(too_new)} that IR version {MAX_IR_VERSION} (the newest "
            "every backend loads) does not have. Convert those tensors to "
            "float32 or float16 before training."
        )
    model.ir_version = MAX_IR_VERSION


def _type_name(elem: int) -> str:
    try:
        return TensorProto.DataType.Name(elem)
    except ValueError:  # newer than this onnx release (FLOAT4E2M1 is 23, FLOAT8E8M0 24...)
        return f"element type {elem}"


def _elem_types(graph: onnx.GraphProto):
    for init in graph.initializer:
        yield init.data_type
    for value in [*graph.input, *graph.output, *graph.value_info]:
        if value.type.HasField("tensor_type"):
            yield value.type.tensor_type.elem_type
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t.data_type
            if attr.HasField("g"):
                yield from _elem_types(attr.g)
            for sub in attr.graphs:
                yield from _elem_types(sub)


def _convert_opset(model: onnx.ModelProto, source: int, target: int) -> onnx.ModelProto:
    from onnx import version_converter

    try:
        converted = version_converter.convert_version(model, target)
        # value_info entries are hints; the converter leaves some untyped (skl2onnx graphs)
        del converted.graph.value_info[:]
        # and it drops the type of non-tensor inputs / outputs (sequences of maps)
        original = {v.name: v for v in [*model.graph.input, *model.graph.output]}
        for value in [*converted.graph.input, *converted.graph.output]:
            if not value.HasField("type") and value.name in original:
                value.type.CopyFrom(original[value.name].type)
        # the converter drops ModelProto.training_info: the training graphs come back as
        # they were (their operators are checked against the new opset by the checker)
        converted.training_info.extend(model.training_info)
        onnx.checker.check_model(converted)
    except Exception as exc:
        direction = "down" if target < source else "up"
        raise IncompatibleModelError(
            f"The model uses ai.onnx opset {source}; graphkit needs opset {target} "
            f"(graphkit's backends train opsets {DSL_OPSET} to {MAX_OPSET}) and "
            f"onnx.version_converter could not convert it {direction}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. " + _REEXPORT_HINT
        ) from exc
    converted.ir_version = min(converted.ir_version, MAX_IR_VERSION)
    return converted
