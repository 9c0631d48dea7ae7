"""The IR-version and opset policy: one place decides what the backends load.

A :class:`Ceiling` is the newest IR version and ``ai.onnx`` opset a backend trains and
writes. :data:`PORTABLE` (IR 10, opset 21) is what every backend loads: what
onnxruntime-training 1.19.2 (the ``ort_training`` backend) loads, and what graphkit
writes where no backend is named (its own loss and update graphs, a model given at an
older opset). The native backend's ceiling is what the installed onnxruntime loads
(``Backend.ceiling``: opset 28 and IR 14 on onnxruntime 1.32, 21 and 10 on 1.19.2), so
that a model exported at opset 23 trains and is written at opset 23 there.
onnx >= 1.18 writes newer IR versions than an opset needs by default: every model
graphkit produces goes through :func:`finalize`, which writes the IR version its opset
needs (10 up to opset 21). Every model a user hands in goes through
:func:`make_compatible`, which converts what can be converted to a backend's ceiling (a
model of a newer opset goes down with onnx's version converter, the operators the
ceiling's opset lacks (opset 23's ``Attention``, ``RMSNormalization``...) first replaced
by onnx's function bodies for them: :mod:`graphkit.expand_functions`) and refuses the
rest with a message saying what to do.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import PureWindowsPath
from typing import NamedTuple

import onnx
from onnx import TensorProto

from graphkit import tensor_store
from graphkit.errors import IncompatibleModelError
from graphkit.expand_functions import new_operators_expanded

MAX_IR_VERSION = 10
"""The newest ONNX IR version every backend loads (onnxruntime-training 1.19.2's)."""
MAX_OPSET = 21
"""The newest ``ai.onnx`` opset every backend loads (onnxruntime-training 1.19.2's)."""


class Ceiling(NamedTuple):
    """The newest ONNX IR version and ``ai.onnx`` opset a backend trains and writes."""

    ir_version: int
    opset: int


PORTABLE = Ceiling(MAX_IR_VERSION, MAX_OPSET)
"""What every backend loads, and what graphkit writes where no backend is named."""
NEWEST = Ceiling(onnx.IR_VERSION, onnx.defs.onnx_opset_version())
"""The newest IR version and opset the installed onnx knows (a runtime's ceiling is at
most this: graphkit checks and converts models with onnx)."""

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

    A model given by path may keep its weights in external data files (``onnx.save_model(
    ..., save_as_external_data=True)``): they are read from the model file's own folder,
    whatever the working directory, and only from there. A location that is absolute,
    holds a ``..`` component or leads out of that folder through a symbolic link is
    refused: a downloaded model could otherwise pull any readable file into its weights.
    A ModelProto or bytes still referring to external data are refused (there is no
    folder to read it from safely): pass the model's path instead.

    Raises:
        FileNotFoundError: the path does not exist.
        IsADirectoryError: the path is a folder; the message names the .onnx files in it.
        IncompatibleModelError: the file or bytes are not a valid ONNX model (truncated,
            corrupted, another format); an external data file is missing, too short or
            outside the model's folder; a ModelProto or bytes refer to external data; a
            tensor holds more or fewer bytes than its dims say. The message names the
            file and the tensor.
        TypeError: ``model`` is none of these.
    """
    if isinstance(model, onnx.ModelProto):
        # a graph graphkit made in this process may hold stored tensors (mapped weights)
        _refuse_external_data(model, "The ModelProto given", allow_stored=True)
        return model
    folder = None
    if isinstance(model, (bytes, bytearray)):
        where, data = "The bytes given", bytes(model)
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        where = f"{path!r}"
        if os.path.isdir(path):
            raise IsADirectoryError(_directory_message(path))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"No ONNX model at {where}: the file does not exist.")
        with open(path, "rb") as handle:
            data = handle.read()
        folder = os.path.dirname(os.path.abspath(path))
    else:
        raise TypeError(
            "A model must be an onnx.ModelProto, its serialized bytes or a path to a .onnx "
            f"file, not {type(model).__name__}."
        )
    try:
        loaded = onnx.load_from_string(data)
    except Exception as exc:  # protobuf's DecodeError
        raise IncompatibleModelError(
            f"{where} is not a valid ONNX model (truncated or corrupted?): {exc}. "
            "Export or download it again."
        ) from None
    if not loaded.graph.node and not loaded.graph.output:
        raise IncompatibleModelError(
            f"{where} is not a valid ONNX model: it decodes to an empty graph (truncated, "
            "corrupted or another file format?). Export or download it again."
        )
    if folder is None:
        _refuse_external_data(loaded, where)
    else:
        _load_external_data(loaded, folder, where)
    check_tensor_sizes(loaded, where)
    return loaded


def _directory_message(path: str) -> str:
    """Why a folder is no model, and the path to pass instead."""
    try:
        found = sorted(name for name in os.listdir(path) if name.endswith(".onnx"))
    except OSError:
        found = []
    if found:
        shown = ", ".join(repr(name) for name in found[:5])
        example = os.path.join(path, found[0])
        return (
            f"{path!r} is a directory, not an ONNX model file; it holds {shown}: pass the "
            f"path of the model file, e.g. {example!r}."
        )
    return (
        f"{path!r} is a directory, not an ONNX model file, and it holds no .onnx file: pass "
        "the path of the model file itself (e.g. 'folder/model.onnx')."
    )


def _tensors(model: onnx.ModelProto) -> Iterator[tuple[str, TensorProto]]:
    """Every tensor stored in ``model`` with what holds it ("initializer 'W'"...): the
    initializers, sparse ones and node attributes of the graph, of its subgraphs, of the
    training graphs and of the model's functions."""
    yield from _graph_tensors(model.graph)
    for info in model.training_info:
        yield from _graph_tensors(info.initialization)
        yield from _graph_tensors(info.algorithm)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, TensorProto]]:
    for init in graph.initializer:
        yield f"initializer {init.name!r}", init
    for sparse in graph.sparse_initializer:
        yield f"sparse initializer {sparse.values.name!r} (values)", sparse.values
        yield f"sparse initializer {sparse.values.name!r} (indices)", sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[tuple[str, TensorProto]]:
    for attr in node.attribute:
        what = f"tensor {{}} of node {node.name!r} ({node.op_type}, attribute {attr.name!r})"
        if attr.HasField("t"):
            yield what.format(repr(attr.t.name)), attr.t
        for tensor in attr.tensors:
            yield what.format(repr(tensor.name)), tensor
        sparse = [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []
        for tensor in [*sparse, *attr.sparse_tensors]:
            yield what.format(repr(tensor.values.name)), tensor.values
            yield what.format(repr(tensor.values.name)) + " indices", tensor.indices
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for graph in attr.graphs:
            yield from _graph_tensors(graph)


def _external(tensor: TensorProto) -> dict[str, str]:
    """The external-data entries of ``tensor`` ({"location": ..., "offset": ...})."""
    return {entry.key: entry.value for entry in tensor.external_data}


def _refuse_external_data(model: onnx.ModelProto, where: str, allow_stored: bool = False) -> None:
    """Refuse a model in memory that still refers to external data files.

    Resolving them against the working directory (what onnxruntime and onnx's checker
    would do) lets a model read any file there; without the model's folder there is no
    safe place to read them from.
    """
    for what, tensor in _tensors(model):
        if tensor.data_location == TensorProto.EXTERNAL:
            if allow_stored and tensor_store.is_stored(tensor):
                continue
            location = _external(tensor).get("location", "")
            raise IncompatibleModelError(
                f"{where} keeps the data of {what} in an external file ({location!r}), "
                "which graphkit cannot read safely from a model in memory: it has no folder "
                "to resolve the file against. Pass the path of the .onnx file instead "
                "(graphkit then reads the external data from the model's own folder), or "
                "load it with onnx.load(path), which reads the data into the ModelProto."
            )


_SEPARATORS = re.compile(r"[\\/]")


def _unsafe_location(location: str) -> str:
    """Why ``location`` cannot name a file inside the model's folder ("" when it can)."""
    if not location:
        return "which names no file"
    if "\0" in location:
        return "which holds a NUL character"
    if os.path.isabs(location) or PureWindowsPath(location).anchor:
        return "an absolute path"
    if ".." in _SEPARATORS.split(location):
        return "a path with a '..' component"
    return ""


def _inside(path: str, folder: str) -> bool:
    """Whether the resolved ``path`` lies inside the resolved ``folder``."""
    try:
        return os.path.commonpath([folder, path]) == folder
    except ValueError:  # on Windows, another drive
        return False


def _load_external_data(model: onnx.ModelProto, folder: str, where: str) -> None:
    """Read the external data of ``model`` (loaded from a file in ``folder``) into its
    tensors, from files inside ``folder`` only (in place).

    Raises:
        IncompatibleModelError: a location is absolute, holds ``..`` or resolves (through
            a symbolic link) outside ``folder``; the file is missing, or shorter than the
            tensor's offset and length. The message names the tensor and the file.
    """
    root = os.path.realpath(folder)
    for what, tensor in _tensors(model):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        entries = _external(tensor)
        location = entries.get("location", "")
        unsafe = _unsafe_location(location)
        if unsafe:
            raise IncompatibleModelError(
                f"{where} keeps the data of {what} at {location!r}, {unsafe}: graphkit reads "
                f"external data only from files inside the model's folder {folder!r}, named "
                "relative to it. Refusing it (a model naming such a path could read any "
                "file into its weights). If the model is yours, save it again with "
                "onnx.save_model(model, path, save_as_external_data=True, "
                "location='weights.data')."
            )
        path = os.path.join(folder, location)  # as the user knows the folder
        real = os.path.realpath(os.path.join(root, location))
        if not _inside(real, root):
            raise IncompatibleModelError(
                f"{where} keeps the data of {what} at {location!r}, which leads out of the "
                f"model's folder {folder!r} (to {real!r}, through a symbolic link): graphkit "
                "reads external data only from files inside that folder. Refusing it; copy "
                "the data file into the folder if you trust it."
            )
        if not os.path.isfile(real):
            state = "is not a file" if os.path.exists(real) else "does not exist"
            raise IncompatibleModelError(
                f"{where} keeps the data of {what} in {path!r}, which {state}. Copy the "
                "model's external data files next to it (they are named relative to the "
                "model's folder), or export the model again."
            )
        try:
            offset = int(entries.get("offset", 0))
            length = int(entries["length"]) if "length" in entries else None
        except ValueError:
            raise IncompatibleModelError(
                f"{where} gives {what} an external data offset {entries.get('offset')!r} or "
                f"length {entries.get('length')!r} in {path!r} that is not an integer: the "
                "model is corrupted; export or download it again."
            ) from None
        size = os.path.getsize(real)
        if length is None:
            length = size - offset
        end = offset + length
        if offset < 0 or length < 0 or end > size:
            raise IncompatibleModelError(
                f"{where} keeps the data of {what} in bytes {offset} to {end} of {path!r}, "
                f"but that file holds {size} bytes: it is truncated, or not this model's "
                "data. Copy or download the model's files again."
            )
        if length >= tensor_store.MAP_FROM_BYTES and tensor_store.mappable(tensor, offset):
            _check_stored_size(tensor, length, what, where)
            tensor_store.store(tensor, real, offset, length)  # mapped when first read
            continue
        with open(real, "rb") as handle:
            handle.seek(offset)
            data = handle.read(length)
        tensor.raw_data = data
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]


def _check_stored_size(tensor: TensorProto, length: int, what: str, where: str) -> None:
    """Refuse external bytes that do not fill the tensor's dims exactly."""
    count = math.prod(tensor.dims)
    expected = count * _ITEM_BYTES[tensor.data_type]
    if length != expected:
        raise IncompatibleModelError(
            f"{where}: {what} declares dims {list(tensor.dims)} of "
            f"{_type_name(tensor.data_type)} ({count} values, {expected} bytes), but its "
            f"external data holds {length} bytes. The file is truncated or corrupted, or the "
            "exporter wrote a wrong shape: export or download the model again."
        )


# Element types packed several to a byte in raw_data (bits per element).
_PACKED_BITS = {
    getattr(TensorProto, name): bits
    for name, bits in (("UINT4", 4), ("INT4", 4), ("FLOAT4E2M1", 4), ("UINT2", 2), ("INT2", 2))
    if hasattr(TensorProto, name)
}
# Whole-byte element types with a known size (others, such as 6-bit floats, are not checked).
_ITEM_BYTES = {
    getattr(TensorProto, name): size
    for name, size in (
        ("FLOAT", 4), ("UINT8", 1), ("INT8", 1), ("UINT16", 2), ("INT16", 2), ("INT32", 4),
        ("INT64", 8), ("BOOL", 1), ("FLOAT16", 2), ("DOUBLE", 8), ("UINT32", 4),
        ("UINT64", 8), ("COMPLEX64", 8), ("COMPLEX128", 16), ("BFLOAT16", 2),
        ("FLOAT8E4M3FN", 1), ("FLOAT8E4M3FNUZ", 1), ("FLOAT8E5M2", 1), ("FLOAT8E5M2FNUZ", 1),
        ("FLOAT8E8M0", 1),
    )
    if hasattr(TensorProto, name)
}  # fmt: skip


def check_tensor_sizes(model: onnx.ModelProto, where: str = "The model") -> None:
    """Refuse a tensor whose data does not fill its dims (raw bytes or typed values).

    Cheap (lengths only), and before anything reads the tensor: numpy's reshape or
    onnxruntime's "buffer size mismatch" would say neither which tensor nor why.

    Raises:
        IncompatibleModelError: naming the tensor, its dims and the byte (or value)
            counts.
    """
    for what, tensor in _tensors(model):
        elem = tensor.data_type
        if tensor.data_location == TensorProto.EXTERNAL or elem == TensorProto.STRING:
            continue
        if elem not in _ITEM_BYTES and elem not in _PACKED_BITS:
            continue
        dims = list(tensor.dims)
        count = math.prod(dims)
        if tensor.HasField("raw_data"):
            if elem in _PACKED_BITS:
                expected = -(-count * _PACKED_BITS[elem] // 8)
            else:
                expected = count * _ITEM_BYTES[elem]
            got = len(tensor.raw_data)
            unit = "bytes"
        elif elem in _PACKED_BITS:
            continue  # packed into typed fields: numpy_helper knows the layout
        else:
            field = onnx.helper.tensor_dtype_to_field(elem)
            complex_ = elem in (TensorProto.COMPLEX64, TensorProto.COMPLEX128)
            expected = count * (2 if complex_ else 1)
            got = len(getattr(tensor, field))
            unit = f"values in {field}"
            if got == 0 and expected:
                unit = "values (no raw_data and no typed data)"
        if got != expected:
            raise IncompatibleModelError(
                f"{where}: {what} declares dims {dims} of {_type_name(elem)} ({count} "
                f"values, {expected} {unit.split(' (')[0]}), but holds {got} {unit}. The "
                "file is truncated or corrupted, or the exporter wrote a wrong shape: export "
                "or download the model again."
            )


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


def make_compatible(
    model: onnx.ModelProto, min_opset: int | None = None, ceiling: Ceiling = PORTABLE
) -> onnx.ModelProto:
    """Return a copy of ``model`` that a backend of that ``ceiling`` can load.

    Args:
        model: any ONNX model.
        min_opset: raise the ``ai.onnx`` opset to at least this version (used when
            graphkit pieces written for :data:`DSL_OPSET` are merged into the model).
        ceiling: the newest IR version and opset to keep (a backend's ``ceiling``;
            :data:`PORTABLE`, what every backend loads, by default).

    Returns:
        A converted copy with IR version <= ``ceiling.ir_version`` and ``min_opset <=
        opset <= ceiling.opset``.

    Raises:
        IncompatibleModelError: the IR version or opset cannot be converted; the model
            refers to external data (:func:`load_model` reads it from a path); a tensor's
            data does not fill its dims.
    """
    _refuse_external_data(model, "The model", allow_stored=True)
    check_tensor_sizes(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _merge_opset_imports(out)
    _declare_io_shapes(out)
    _lower_ir_version(out, ceiling.ir_version)
    opset = opset_of(out)
    if opset is None:
        raise IncompatibleModelError(
            "The model imports no ai.onnx opset; add one with "
            "onnx.helper.make_opsetid('', 18) in opset_imports."
        )
    target = opset
    if opset > ceiling.opset:
        target = ceiling.opset
        # operators with no counterpart at the target (opset 23's Attention): onnx's
        # own function bodies for them, which convert down like any other operator
        out = new_operators_expanded(out, ceiling.opset)
    if min_opset is not None and target < min_opset:
        target = min_opset
    if target != opset:
        out = _convert_opset(out, opset, target, ceiling)
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

    Sets the IR version to at most the one its ``ai.onnx`` opset needs
    (:func:`ir_version_for`: :data:`MAX_IR_VERSION` up to opset 21, which onnx >= 1.18
    would stamp newer; a model holding element types IR 10 lacks, which only a backend of
    a newer ceiling takes, keeps its own) and runs ``onnx.checker`` (with type and shape
    inference when ``full_check``). Modifies ``model`` in place and returns it.
    """
    needed = ir_version_for(opset_of(model) or DSL_OPSET)
    if needed == MAX_IR_VERSION and any(t > _MAX_IR10_ELEM_TYPE for t in _elem_types(model.graph)):
        needed = max(model.ir_version, needed)  # its element types need its IR version
    model.ir_version = min(model.ir_version or needed, needed)
    if check:
        onnx.checker.check_model(_checkable(model), full_check=full_check)
    return model


def ir_version_for(opset: int) -> int:
    """The IR version graphkit writes a model of ``ai.onnx`` opset ``opset`` with: the
    oldest that opset needs (onnx's table), :data:`MAX_IR_VERSION` at least, so that
    every model up to opset 21 loads on every backend."""
    try:
        needed = onnx.helper.find_min_ir_version_for([onnx.helper.make_opsetid("", opset)])
    except Exception:  # an opset newer than this onnx release: the newest IR it knows
        needed = onnx.IR_VERSION
    return max(MAX_IR_VERSION, needed)


_RUNTIME_DOMAIN = "graphkit.onnxruntime_internal"


def _checkable(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy the checker can read when it holds onnxruntime's internal
    gradient operators, or stored tensors (:mod:`graphkit.tensor_store`).

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
    model = tensor_store.as_inputs_for_checking(model)  # the checker would open their files
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


def _lower_ir_version(model: onnx.ModelProto, ceiling: int = MAX_IR_VERSION) -> None:
    if model.ir_version <= ceiling:
        return
    if ceiling <= MAX_IR_VERSION:
        too_new = {_type_name(t) for t in _elem_types(model.graph) if t > _MAX_IR10_ELEM_TYPE}
        if too_new:
            raise IncompatibleModelError(
                f"The model has IR version {model.ir_version} and uses element types "
                f"{', '.join(sorted(too_new))} that IR version {ceiling} (the newest the "
                "backend loads) does not have. Convert those tensors to float32 or "
                "float16 before training, or train on the native backend with an "
                "onnxruntime that loads them."
            )
    model.ir_version = ceiling


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


def _convert_opset(
    model: onnx.ModelProto, source: int, target: int, ceiling: Ceiling = PORTABLE
) -> onnx.ModelProto:
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
        onnx.checker.check_model(_checkable(converted))
    except Exception as exc:
        direction = "down" if target < source else "up"
        raise IncompatibleModelError(
            f"The model uses ai.onnx opset {source}; graphkit needs opset {target} "
            f"(the backend trains opsets {DSL_OPSET} to {ceiling.opset}) and "
            f"onnx.version_converter could not convert it {direction}: "
            f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}. " + _REEXPORT_HINT
        ) from exc
    converted.ir_version = min(converted.ir_version, ceiling.ir_version)
    return converted
