"""Large tensors kept outside the protobuf, memory-mapped from their external data file.

Protobuf cannot serialize a message over 2 GB, and every copy of a ModelProto copies the
weights inside it. A model loaded by path (:func:`graphkit.compat.load_model`) therefore
keeps each large tensor of its external data where it is, in its file: the tensor stays
in the graph with its name, type and dims, but its data location names a *stored*
tensor (``graphkit-stored/<n>``), and this module maps the bytes from the file on first
use, once per process, read-only. Graphs that carry stored tensors are small: copying,
rewriting, differentiating and serializing them never touches the weights.

Who reads a stored tensor:

* :func:`tensor_value` (graphkit's rewrites, where they need a value: the array, mapped);
* the engine, which hands the mapped arrays to onnxruntime as shared initializers
  (``SessionOptions.add_initializer``, no copy): every session of a training run reads
  the one mapping, so a frozen weight is in memory once;
* :func:`inline` (a self-contained ModelProto for a user) and :func:`save_model` (a
  model file with its external data written beside it).

A stored tensor is only meaningful in this process: graphkit never returns one to a
user (:func:`inline`) nor writes one to a file unresolved (:func:`save_model`).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
import weakref
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

PREFIX = "graphkit-stored/"
"""The data location of a stored tensor: ``PREFIX`` and the tensor's number."""

MAP_FROM_BYTES = 1 << 20
"""External tensors at least this large stay in their file (mapped); smaller ones are
read into the ModelProto, where rewrites that fold constants can read them cheaply."""

PROTOBUF_LIMIT = 2**31 - 1
"""The largest message protobuf serializes, in bytes."""

# element types mapped as they are stored (little-endian, whole bytes per element)
_MAPPABLE: dict[int, type] = {
    TensorProto.FLOAT: np.float32,
    TensorProto.DOUBLE: np.float64,
    TensorProto.FLOAT16: np.float16,
    TensorProto.INT8: np.int8,
    TensorProto.UINT8: np.uint8,
    TensorProto.INT16: np.int16,
    TensorProto.UINT16: np.uint16,
    TensorProto.INT32: np.int32,
    TensorProto.UINT32: np.uint32,
    TensorProto.INT64: np.int64,
    TensorProto.UINT64: np.uint64,
    TensorProto.BOOL: np.bool_,
}


@dataclass(frozen=True)
class FileSlice:
    """Where a stored tensor's bytes are: ``length`` bytes at ``offset`` of ``path``."""

    path: str
    offset: int
    length: int
    dtype: np.dtype
    shape: tuple[int, ...]

    def map(self) -> np.ndarray:
        """The bytes as a read-only array (a memory map: pages load when read)."""
        if not self.length:
            return np.zeros(self.shape, self.dtype)
        return np.memmap(self.path, self.dtype, "r", self.offset, self.shape)


_lock = threading.Lock()
_slices: dict[str, FileSlice] = {}  # location -> where its bytes are (never dropped: tiny)
_locations: dict[FileSlice, str] = {}
_mapped: weakref.WeakValueDictionary[str, np.ndarray] = weakref.WeakValueDictionary()
_digests: dict[str, str] = {}


def mappable(tensor: TensorProto, offset: int) -> bool:
    """Whether ``tensor``'s external bytes at ``offset`` can be used in place: an element
    type numpy and onnxruntime read as stored, aligned to its item size."""
    dtype = _MAPPABLE.get(tensor.data_type)
    if dtype is None or np.little_endian is False:
        return False
    return offset % np.dtype(dtype).itemsize == 0


def store(tensor: TensorProto, path: str, offset: int, length: int) -> None:
    """Make ``tensor`` (in place) a stored tensor whose bytes are ``length`` bytes at
    ``offset`` of the file ``path`` (already checked to be safe and long enough)."""
    dtype = np.dtype(_MAPPABLE[tensor.data_type])
    where = FileSlice(os.path.realpath(path), offset, length, dtype, tuple(tensor.dims))
    with _lock:  # the same bytes loaded twice are one stored tensor, mapped once
        location = _locations.get(where)
        if location is None:
            location = _locations[where] = f"{PREFIX}{len(_slices)}"
            _slices[location] = where
    tensor.ClearField("raw_data")
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    tensor.external_data.add(key="length", value=str(length))


def _location(tensor: TensorProto) -> str | None:
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    for entry in tensor.external_data:
        if entry.key == "location" and entry.value.startswith(PREFIX):
            return entry.value
    return None


def is_stored(tensor: TensorProto) -> bool:
    """Whether ``tensor`` is a stored tensor (its data mapped by this module)."""
    return _location(tensor) is not None


def tensor_value(tensor: TensorProto) -> np.ndarray:
    """The value of ``tensor``: for a stored tensor the mapped array (read-only, shared:
    copy it before writing), else ``numpy_helper.to_array``."""
    location = _location(tensor)
    if location is None:
        return numpy_helper.to_array(tensor)
    return _array(location)


def _array(location: str) -> np.ndarray:
    with _lock:
        array = _mapped.get(location)
        if array is None:
            array = _slices[location].map()
            _mapped[location] = array
    return array


def digest(tensor: TensorProto) -> str:
    """A digest of a stored tensor's bytes (blake2b, computed once per process): what a
    checkpoint records of a weight it does not copy."""
    location = _location(tensor)
    if location is None:
        raise ValueError(f"{tensor.name!r} is not a stored tensor")
    with _lock:
        known = _digests.get(location)
    if known is None:
        h = hashlib.blake2b(digest_size=16)
        where = _slices[location]
        # read from the file, not the mapping: the pages then stay out of this process
        with open(where.path, "rb") as handle:
            handle.seek(where.offset)
            left = where.length
            while left:
                chunk = handle.read(min(left, COPY_CHUNK_BYTES))
                if not chunk:
                    raise OSError(f"{where.path!r} is shorter than when it was loaded")
                h.update(chunk)
                left -= len(chunk)
        known = h.hexdigest()
        with _lock:
            _digests[location] = known
    return known


COPY_CHUNK_BYTES = 64 << 20
"""The bytes :func:`copied` reads from a mapping before it lets the system drop them."""


def copied(array: np.ndarray) -> np.ndarray:
    """A writable copy of ``array``; for a tensor mapped from its file, copied by chunks
    of :data:`COPY_CHUNK_BYTES` whose mapped pages are dropped as soon as they are read,
    so that the copy never holds the tensor twice in memory."""
    handle = getattr(array, "_mmap", None)
    if not isinstance(array, np.memmap) or handle is None or not hasattr(mmap, "MADV_DONTNEED"):
        return np.array(array)
    out = np.empty(array.shape, array.dtype)
    source, target = array.reshape(-1), out.reshape(-1)
    start = int(array.offset) % mmap.ALLOCATIONGRANULARITY  # where the array begins in it
    step = max(1, COPY_CHUNK_BYTES // max(1, array.itemsize))
    for first in range(0, source.size, step):
        last = min(source.size, first + step)
        target[first:last] = source[first:last]
        begin = start + first * array.itemsize
        aligned = begin - begin % mmap.PAGESIZE
        handle.madvise(mmap.MADV_DONTNEED, aligned, start + last * array.itemsize - aligned)
    return out


def references(model: onnx.ModelProto, skip: Collection[str] = ()) -> dict[str, dict]:
    """``{name: {"file", "offset", "length", "blake2b"}}`` for the stored initializers of
    ``model`` not in ``skip``: where each weight's bytes are (the file's name, not its
    folder) and their digest, what a checkpoint records instead of copying them."""
    out = {}
    for tensor in model.graph.initializer:
        location = _location(tensor)
        if location is None or tensor.name in skip:
            continue
        where = _slices[location]
        out[tensor.name] = {
            "file": os.path.basename(where.path),
            "offset": where.offset,
            "length": where.length,
            "blake2b": digest(tensor),
        }
    return out


def stored_initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """``{name: mapped array}`` for the stored initializers of ``model``'s main graph."""
    return {t.name: _array(loc) for t in model.graph.initializer if (loc := _location(t))}


def elem_bytes(elem_type: int) -> int:
    """The bytes of one element of ``elem_type`` (0 where it has no whole-byte size)."""
    dtype = _MAPPABLE.get(elem_type)
    return 0 if dtype is None else np.dtype(dtype).itemsize


def tensor_bytes(tensor: TensorProto) -> int:
    """The bytes of ``tensor``'s values, stored or inline (0 where the element type has
    no whole-byte size)."""
    return int(np.prod(tensor.dims, dtype=np.int64)) * elem_bytes(tensor.data_type)


def stored_bytes(model: onnx.ModelProto) -> int:
    """The bytes of ``model``'s stored tensors (what lies outside its protobuf)."""
    return sum(_slices[loc].length for t in _all_tensors(model) if (loc := _location(t)))


def has_stored(model: onnx.ModelProto) -> bool:
    """Whether ``model`` holds a stored tensor anywhere."""
    return any(is_stored(t) for t in _all_tensors(model))


def _all_tensors(model: onnx.ModelProto) -> Iterator[TensorProto]:
    def graph_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
        yield from graph.initializer
        for node in graph.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t
                yield from attr.tensors
                if attr.HasField("g"):
                    yield from graph_tensors(attr.g)
                for sub in attr.graphs:
                    yield from graph_tensors(sub)

    yield from graph_tensors(model.graph)


def inline(model: onnx.ModelProto, names: Collection[str] | None = None) -> onnx.ModelProto:
    """``model`` itself when it holds no stored tensor (of ``names``), else a copy whose
    stored tensors (those of ``names``; None: all) hold their bytes: with all, a
    self-contained ModelProto, as :func:`onnx.load` gives."""
    chosen = [t for t in _all_tensors(model) if is_stored(t) and (names is None or t.name in names)]
    if not chosen:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for tensor in _all_tensors(out):
        location = _location(tensor)
        if location is not None and (names is None or tensor.name in names):
            data = np.ascontiguousarray(_array(location)).tobytes()
            del tensor.external_data[:]
            tensor.data_location = TensorProto.DEFAULT
            tensor.raw_data = data
    return out


def as_inputs_for_checking(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (a copy where needed) with its stored initializers as typed graph inputs:
    what onnx's checker can check without the data (it would look for a file named by
    the stored location)."""
    if not has_stored(model):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    stored = [t for t in graph.initializer if is_stored(t)]
    if any(is_stored(t) for t in _all_tensors(out) if t not in graph.initializer):
        raise ValueError("a stored tensor outside the main graph's initializers")
    kept = [t for t in graph.initializer if not is_stored(t)]
    declared = {i.name for i in graph.input}
    del graph.initializer[:]
    graph.initializer.extend(kept)
    graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in stored
        if t.name not in declared
    )
    return out


def hoisted(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose stored initializers of subgraphs (a step inside an
    epoch's ``Scan`` or ``Loop``) are initializers of the main graph, which the subgraphs
    read from their outer scope: onnxruntime shares main-graph initializers only."""
    if not any(is_stored(t) for t in _all_tensors(model) if not _in_main(model, t)):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = {t.name for t in out.graph.initializer}

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for attr in node.attribute:
                for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    moved = [t for t in sub.initializer if is_stored(t)]
                    for tensor in moved:
                        if tensor.name in taken:
                            raise ValueError(f"stored tensor {tensor.name!r} shadows another")
                        taken.add(tensor.name)
                        out.graph.initializer.append(tensor)
                        sub.initializer.remove(tensor)
                    visit(sub)

    visit(out.graph)
    return out


def _in_main(model: onnx.ModelProto, tensor: TensorProto) -> bool:
    return any(t is tensor for t in model.graph.initializer)


def stored_as_inputs(
    model: onnx.ModelProto, trained: Collection[str] = ()
) -> tuple[onnx.ModelProto, list[TensorProto]]:
    """``(copy of model with its frozen stored initializers as graph inputs, those
    tensors)``, or ``(model, [])`` when it has none: what a gradient source
    differentiates without reading (or folding) the mapped weights.
    :func:`stored_as_initializers` puts them back into the graphs it returns. A stored
    initializer named in ``trained`` is differentiated with respect to: it is read into
    the copy (a gradient source may fold what it reads)."""
    model = inline(model, set(trained))
    stored = [t for t in model.graph.initializer if is_stored(t)]
    if not stored:
        return model, []
    return as_inputs_for_checking(model), stored


def stored_as_initializers(model: onnx.ModelProto, tensors: list[TensorProto]) -> onnx.ModelProto:
    """``model`` (in place) with each of ``tensors`` that it reads as a graph input an
    initializer again (the inverse of :func:`stored_as_inputs`)."""
    if not tensors:
        return model
    by_name = {t.name: t for t in tensors}
    graph = model.graph
    lifted = [i for i in graph.input if i.name in by_name]
    if not lifted:
        return model
    kept = [i for i in graph.input if i.name not in by_name]
    del graph.input[:]
    graph.input.extend(kept)
    graph.initializer.extend(by_name[i.name] for i in lifted)
    return model


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike[str],
    external: bool | None = None,
    size_threshold: int = 1024,
) -> None:
    """Write ``model`` to ``path``, its stored tensors resolved.

    With ``external`` (None: when it holds stored tensors or its tensors total more
    than 1 GB), every tensor of at least ``size_threshold`` bytes goes to one data file
    beside it, ``<file name>.data``, named relative to the model's folder, so that
    onnxruntime and ``onnx.load`` read it from any working directory; the tensors are
    written one at a time, never all in one protobuf. Otherwise one self-contained
    file.

    Raises:
        ValueError: the data file would overwrite the file a stored tensor of this
            process is mapped from (its weights would change under the training).
    """
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if external is None:
        external = has_stored(model) or _inline_bytes(model) > (1 << 30)
    if not external:
        onnx.save_model(inline(model), path)
        return
    data_name = os.path.basename(path) + ".data"
    data_path = os.path.join(os.path.dirname(os.path.abspath(path)), data_name)
    real = os.path.realpath(data_path)
    with _lock:
        mapped_from = {s.path for s in _slices.values()}
    if real in mapped_from:
        raise ValueError(
            f"Writing {data_path!r} would overwrite the external data the weights being "
            "trained are read from: save the model under another name or in another folder."
        )
    out = onnx.ModelProto()
    out.CopyFrom(_without_large_data(model, size_threshold))
    offset = 0
    with open(data_path, "wb") as handle:
        for tensor, source in zip(_all_tensors(out), _all_tensors(model)):
            location = _location(source)
            if location is None and not _large_inline(source, size_threshold):
                continue
            pad = -offset % 4096  # page-aligned, as onnx's own writer aligns large tensors
            handle.write(b"\0" * pad)
            offset += pad
            if location is not None:
                length = _write_array(handle, _array(location))
            elif source.HasField("raw_data"):
                length = handle.write(source.raw_data)
            else:
                length = _write_array(handle, numpy_helper.to_array(source))
            for field in _DATA_FIELDS:
                tensor.ClearField(field)
            del tensor.external_data[:]
            tensor.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_name), ("offset", offset), ("length", length)):
                tensor.external_data.add(key=key, value=str(value))
            offset += length
    with open(path, "wb") as handle:
        handle.write(out.SerializeToString())


_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data")


def _large_inline(tensor: TensorProto, size_threshold: int) -> bool:
    """An inline tensor written to the data file: at least ``size_threshold`` bytes, and
    its bytes as stored (``raw_data``) or an element type read as stored."""
    if tensor.data_location == TensorProto.EXTERNAL or tensor.ByteSize() < size_threshold:
        return False
    return tensor.HasField("raw_data") or tensor.data_type in _MAPPABLE


def _inline_bytes(model: onnx.ModelProto) -> int:
    return sum(t.ByteSize() for t in _all_tensors(model) if not is_stored(t))


def _without_large_data(model: onnx.ModelProto, size_threshold: int) -> onnx.ModelProto:
    """A copy of ``model`` whose large inline tensors have no data yet (filled by the
    caller): copying them whole would hold the weights twice."""
    kept: list[tuple[TensorProto, bytes]] = []
    try:
        for tensor in _all_tensors(model):
            if _large_inline(tensor, size_threshold) and tensor.HasField("raw_data"):
                kept.append((tensor, tensor.raw_data))
                tensor.ClearField("raw_data")
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return out
    finally:
        for tensor, data in kept:
            tensor.raw_data = data


def _write_array(handle: object, array: np.ndarray) -> int:
    """Write ``array``'s bytes (little-endian, C order) in chunks; their length."""
    flat = np.ascontiguousarray(array).reshape(-1)
    chunk = max(1, (64 << 20) // max(1, flat.itemsize))
    for start in range(0, flat.size, chunk):
        handle.write(flat[start : start + chunk].tobytes())  # type: ignore[attr-defined]
    return int(flat.nbytes)


__all__ = [
    "MAP_FROM_BYTES",
    "PREFIX",
    "PROTOBUF_LIMIT",
    "FileSlice",
    "as_inputs_for_checking",
    "copied",
    "digest",
    "elem_bytes",
    "has_stored",
    "hoisted",
    "inline",
    "is_stored",
    "mappable",
    "references",
    "save_model",
    "stored_as_initializers",
    "stored_as_inputs",
    "stored_bytes",
    "stored_initializers",
    "store",
    "tensor_bytes",
    "tensor_value",
]
