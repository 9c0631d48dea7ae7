"""onnxruntime's ``MatMulNBits`` written as standard operators, which every gradient
source differentiates.

onnxruntime-genai's model builder (and onnxruntime's own quantization tools) store a
4-bit or 8-bit weight as ``com.microsoft.MatMulNBits``: ``Y = A dequantize(B)^T (+
bias)``, with ``B`` ``[N, blocks, block_bytes]`` the quantized ``[N, K]`` weight packed
along ``K``, ``scales`` one per block and ``zero_points`` (packed, default the middle of
the range: 8 for 4 bits, 128 for 8 bits). No gradient source has a rule for it, so
:func:`matmul_nbits_as_standard` rewrites each into

    W = DequantizeLinear(B as uint4 / uint8 [N, K], scales [N, blocks], zero points
                         [N, blocks], axis=1, block_size)
    Y = MatMul(A, Transpose(W)) (+ bias)

reusing ``B``'s bytes as they are: onnx packs 4-bit tensors two to a byte, low nibble
first, in the order ``MatMulNBits`` packs ``K``; a ``Slice`` drops the last block's
padding where ``K`` is no multiple of the block size (onnxruntime 1.19.2 dequantizes
whole blocks only). The quantized tensors stay quantized
and frozen; gradients reach ``A`` through the dequantized weight, and
:func:`graphkit.lora.add_lora` finds the weight behind the ``DequantizeLinear``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphkit._graph import copy_model, fresh_name, graph_names
from graphkit.compat import make_compatible
from graphkit.errors import IncompatibleModelError
from graphkit.tensor_store import tensor_value

MICROSOFT = "com.microsoft"


def matmul_nbits_as_standard(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ``MatMulNBits`` of the main graph as ``DequantizeLinear``,
    ``Transpose`` and ``MatMul`` (``Add`` for a bias); ``model`` itself if it has none.
    A model below opset 21 is converted to it first (block-wise ``DequantizeLinear``).

    Raises:
        IncompatibleModelError: a ``MatMulNBits`` this cannot rewrite: its weight or scales
            not initializers, float zero points, a ``g_idx`` (act-order), bits other than
            4 and 8. The message names the node.
    """
    if not any(n.op_type == "MatMulNBits" and n.domain == MICROSOFT for n in model.graph.node):
        return model
    out = copy_model(model) if _opset(model) >= 21 else make_compatible(model, min_opset=21)
    graph = out.graph
    initializers = {t.name: t for t in graph.initializer}
    taken = graph_names(graph)
    nodes: list[onnx.NodeProto] = []
    replaced: set[str] = set()
    retyped: dict[str, TensorProto] = {}  # B's name -> its bytes as uint4 / uint8 [N, K]
    for node in graph.node:
        if node.op_type == "MatMulNBits" and node.domain == MICROSOFT:
            nodes += _standard_nodes(node, initializers, graph, taken, retyped)
            replaced.update(node.input)
        else:
            nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    for k, tensor in enumerate(graph.initializer):
        if tensor.name in retyped:
            graph.initializer[k].CopyFrom(retyped[tensor.name])
    _drop_unread(graph, replaced)
    if out.ir_version < 10:
        out.ir_version = 10  # uint4 tensors
    return out


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _standard_nodes(
    node: onnx.NodeProto,
    initializers: dict[str, TensorProto],
    graph: onnx.GraphProto,
    taken: set[str],
    retyped: dict[str, TensorProto],
) -> list[onnx.NodeProto]:
    """The standard nodes of one ``MatMulNBits`` (new scales and zero points added to
    ``graph``; its weight, under its own name, to ``retyped``)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    k, n, bits, block = attrs["K"], attrs["N"], attrs.get("bits", 4), attrs["block_size"]
    inputs = list(node.input) + [""] * (6 - len(node.input))
    a, b, scales, zero_points, g_idx, bias = inputs[:6]
    where = f"MatMulNBits node {node.name!r}"
    if bits not in (4, 8):
        raise IncompatibleModelError(f"{where} has bits={bits}; graphkit rewrites 4 and 8.")
    if g_idx:
        raise IncompatibleModelError(f"{where} has a g_idx (act-order); graphkit cannot train it.")
    if b not in initializers or scales not in initializers:
        raise IncompatibleModelError(f"{where}: its weight and scales must be initializers.")
    blocks = -(-k // block)
    padded = blocks * block
    prefix = node.name or node.output[0]

    def name(what: str) -> str:
        return fresh_name(f"{prefix}/{what}", taken)

    if b not in retyped:  # the weight keeps its name: targets of graphkit.lora name it
        retyped[b] = _retyped(initializers[b], b, bits, [n, padded])
    quantized = retyped[b]
    scale = TensorProto()
    scale.CopyFrom(initializers[scales])
    scale.name = name("scales")
    del scale.dims[:]
    scale.dims.extend([n, blocks])
    zero = _zero_points(zero_points, initializers, name("zero_points"), bits, n, blocks, where)
    graph.initializer.extend([scale, zero])
    weight = name("dequantized")
    nodes = [
        helper.make_node(
            "DequantizeLinear",
            [quantized.name, scale.name, zero.name],
            [weight],
            name=name("DequantizeLinear"),
            axis=1,
            block_size=block,
        )
    ]
    if padded != k:  # the last block's padding (onnxruntime 1.19.2 takes whole blocks only)
        bounds = [name(what) for what in ("starts", "ends", "axes")]
        for bound, value in zip(bounds, ([0], [k], [1]), strict=True):
            graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), bound))
        cut = name("cut")
        nodes.append(helper.make_node("Slice", [weight, *bounds], [cut], name=name("Slice")))
        weight = cut
    transposed = name("transposed")
    nodes.append(
        helper.make_node("Transpose", [weight], [transposed], name=name("Transpose"), perm=[1, 0])
    )
    product = name("product") if bias else node.output[0]
    nodes.append(helper.make_node("MatMul", [a, transposed], [product], name=name("MatMul")))
    if bias:
        nodes.append(helper.make_node("Add", [product, bias], [node.output[0]], name=name("Add")))
    return nodes


def _retyped(packed: TensorProto, name: str, bits: int, dims: list[int]) -> TensorProto:
    """``MatMulNBits``' packed uint8 weight as a uint4 (or uint8) tensor ``[N, blocks x
    block_size]``: the same bytes (a mapped weight is read once, here)."""
    tensor = TensorProto()
    tensor.name = name
    tensor.data_type = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
    tensor.dims.extend(dims)
    tensor.raw_data = np.ascontiguousarray(tensor_value(packed), dtype=np.uint8).tobytes()
    return tensor


def _zero_points(
    source: str,
    initializers: dict[str, TensorProto],
    name: str,
    bits: int,
    n: int,
    blocks: int,
    where: str,
) -> TensorProto:
    """The zero points as a uint4 (uint8) tensor ``[N, blocks]``: unpacked from
    ``MatMulNBits``' rows (each row padded to whole bytes), or the default, the middle of
    the range."""
    elem = TensorProto.UINT4 if bits == 4 else TensorProto.UINT8
    if not source:
        middle = 1 << (bits - 1)
        return helper.make_tensor(name, elem, [n, blocks], [middle] * (n * blocks))
    if source not in initializers or initializers[source].data_type != TensorProto.UINT8:
        raise IncompatibleModelError(
            f"{where}: graphkit reads packed uint8 zero points from an initializer only."
        )
    packed = np.asarray(tensor_value(initializers[source]), np.uint8).reshape(n, -1)
    if bits == 4:
        values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    else:
        values = packed[:, :blocks]
    return helper.make_tensor(name, elem, [n, blocks], values.reshape(-1).tolist())


def _drop_unread(graph: onnx.GraphProto, replaced: set[str]) -> None:
    """Remove the rewritten nodes' initializers that nothing reads any more."""
    read = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in read or t.name not in replaced]
    del graph.initializer[:]
    graph.initializer.extend(kept)


def explicit_zero_points(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` whose ``DequantizeLinear`` nodes of an initializer all name their zero
    point (zeros of the quantized type, shaped as the scale), ``model`` itself where they
    do. Without one, onnxruntime 1.19.2's QDQ rewrites insert a ``QuantizeLinear`` typed
    uint8 after an int8 weight, and the session fails to load ("Type (tensor(int8)) of
    output arg (QuantizeLinear_out0) ... does not match expected type (tensor(uint8))")."""
    initializers = {t.name: t for t in model.graph.initializer}
    missing = [
        k
        for k, n in enumerate(model.graph.node)
        if n.op_type == "DequantizeLinear"
        and (len(n.input) < 3 or not n.input[2])
        and n.input[0] in initializers
        and n.input[1] in initializers
    ]
    if not missing:
        return model
    out = copy_model(model)
    taken = graph_names(out.graph)
    for k in missing:
        node = out.graph.node[k]
        quantized, scale = initializers[node.input[0]], initializers[node.input[1]]
        zero = helper.make_tensor(
            fresh_name(f"{node.input[0]}/zero_point", taken),
            quantized.data_type,
            list(scale.dims),
            [0] * int(np.prod(scale.dims, dtype=np.int64)),
        )
        out.graph.initializer.append(zero)
        inputs = [*node.input[:2], zero.name]
        del node.input[:]
        node.input.extend(inputs)
    return out


def quantized_as_standard(model: onnx.ModelProto) -> onnx.ModelProto:
    """:func:`matmul_nbits_as_standard` then :func:`explicit_zero_points`: a quantized
    base every backend trains on."""
    return explicit_zero_points(matmul_nbits_as_standard(model))


__all__ = ["explicit_zero_points", "matmul_nbits_as_standard", "quantized_as_standard"]
