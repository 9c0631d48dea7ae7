"""Specialize a graph to a concrete batch size, so that its shape arithmetic disappears.

A training step built for a dynamic batch dimension spends most of its kernels on shape
plumbing: ``Shape``, ``Reshape(label, Shape(Y))``, ``Expand``, and a gradient source's
own shape operators (onnxruntime-training's ``BroadcastGradientArgs``, which tells a
gradient which axes to sum). Once every input
shape is known, all of it is constant. :func:`specialize` fixes the batch dimension of
the named inputs and folds what became constant:

* onnxscript's constant folding (with onnx shape inference) evaluates ``Shape``, ``Size``,
  shape arithmetic and every node whose inputs are all constant;
* the backend's ``folds`` evaluate its own operators on constant inputs (onnx's shape
  inference does not know them; see ``constant_folds`` of
  :class:`graphkit.backends.base.GradientSource`);
* unused nodes go, common subexpressions (the same bias-correction power in every weight's
  Adam update) are computed once;
* :func:`simplify_reductions` rewrites each ``ReduceSum`` whose shape is now known into
  what onnxruntime runs fastest: a ``Reshape`` when it sums over axes of size 1, a
  full reduction when every kept axis has size 1, a ``MatMul`` with a vector of ones
  when it sums a leading or trailing block of axes (onnxruntime's ReduceSum over the
  batch axis of a 256x256 tensor takes 40 us, the MatMul 5 us: it is every bias
  gradient; the ones are a column for a trailing block, as a 1-D right operand is
  onnxruntime's slow path); multiplying by a constant of ones and reshaping a tensor to the shape it
  has go, and a one-element constant operand of ``Add``, ``Sub``, ``Mul``, ``Div`` takes
  the rank of the other operand (onnxruntime broadcasts a lower-rank scalar over an
  ``(n, 1)`` tensor one element at a time); a sum over the batch of a batched
  ``x^T dy`` (a weight multiplying a [B, S, in] input) is one product of the batch
  laid end to end, ``X^T DY`` (:meth:`_Simplifier.summed_product`);
* :func:`_fewer_kernels` writes a squared error's sum of squares and its doubled
  gradient, and a small ReLU gradient's mask, one kernel each instead of two;
* :func:`_gemms` writes a weight's gradient and its SGD update as one ``Gemm``, a large
  product of a transposed matrix as a ``Gemm`` with its ``trans`` attribute
  (:data:`GEMM_ABOVE`), and the transpose of a product as the product of the transposes
  (a transformer's native step: 5140 -> 4970 us a batch, 47 -> 25 Transposes in the
  graph onnxruntime receives);
* :func:`graphkit.decay_factors.gather_decay` writes a decoupled weight decay's update
  (AdamW's) with its scalar factors gathered: two passes over the weights fewer;
* :meth:`_Simplifier.squeeze_units` runs each ``Transpose`` and each reduction
  (``ReduceSum``, ``ReduceMean``...) of a tensor with axes of size 1 (a gradient
  source's seed axis, ``[N, C, H, W, 1]``) on the tensor without them, between two
  ``Reshape`` (which move no data): onnxruntime's kernels take a slow path for such
  shapes, 50x for a Transpose of ``[64, 16, 28, 28, 1]`` (2930 us against 58), 35x for a
  ReduceSum over the softmax axis of ``[32, 4, 32, 32, 1]`` (400 us against 11.5).

onnxscript's *rewrite rules* are deliberately not applied: they treat a constant within
1e-8 of zero as zero (``x + 1e-8 -> x``), which deletes Adam's epsilon. Folding only
evaluates what the graph computes, so the specialized graph computes the same values;
the rewrites above compute the same formulas, and only the gathered decay rounds in
another order (torch's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from graphkit._graph import (
    REDUCTIONS,
    _subgraphs,
    copy_model,
    fresh_name,
    graph_names,
    outer_reads,
    read_counts,
)
from graphkit.decay_factors import gather_decay


def _fold(model: onnx.ModelProto) -> onnx.ModelProto:
    """Constant folding with shape inference, dead-node removal and CSE (no rewrites).

    onnxscript's public ``fold_constants`` (onnxscript >= 0.3) is its
    ``FoldConstantsPass`` run in place with these options; the other passes are onnx_ir's
    public ones (onnx-ir >= 0.1.1 has them all)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import fold_constants

    graph = ir.serde.deserialize_model(model)
    common.InlinePass()(graph)
    # nodes whose inputs and outputs have at most 8192 elements each: a step's shape
    # arithmetic and small constants, never a computation on weight-sized tensors
    fold_constants(graph, onnx_shape_inference=True, input_size_limit=8192, output_size_limit=8192)
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.CommonSubexpressionEliminationPass(),
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedOpsetsPass(),
    )(graph)
    return ir.serde.serialize_model(graph)


def static_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """Every tensor whose shape onnx's inference (or the graph's value_info) fixes."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    shapes = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            shapes[value.name] = tuple(d.dim_value for d in tensor.shape.dim)
    for init in graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _reduce_axes(node: onnx.NodeProto, constants: Mapping[str, np.ndarray]) -> list[int] | None:
    """The axes a ReduceSum sums over ([] for all of them), None when not constant."""
    if len(node.input) > 1 and node.input[1]:
        if node.input[1] not in constants:
            return None
        return [int(a) for a in constants[node.input[1]].ravel()]
    for attr in node.attribute:  # opset < 13
        if attr.name == "axes":
            return list(attr.ints)
    return []


def simplify_reductions(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every ReduceSum of known shape replaced by faster equivalents
    (see the module docstring); multiplications by a constant of ones and reshapes to
    the shape a tensor already has are dropped.

    The sums are the same up to float rounding (a MatMul adds in another order).
    """
    out = copy_model(model)
    _Simplifier(out.graph, static_shapes(out)).run()
    return out


class _Simplifier:
    """Rewrites one graph's nodes in place (see :func:`simplify_reductions`)."""

    def __init__(self, graph: onnx.GraphProto, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.graph, self.shapes = graph, dict(shapes)
        self.constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
        self.elem = {
            v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.value_info]
        }
        self.elem.update({t.name: t.data_type for t in graph.initializer})
        self.taken = graph_names(graph)
        self.ranked: dict[tuple[str, int], str] = {}  # (constant, rank) -> reshaped copy
        self.producer = {o: n for n in graph.node for o in n.output}
        self.reads = read_counts(graph.node, (o.name for o in graph.output))
        self.views: dict[str, str] = {}  # a squeezed copy's name -> the tensor it views
        self.orphans: list[onnx.NodeProto] = []  # nodes a rewrite may have left unread

    def run(self) -> None:
        outputs = {o.name for o in self.graph.output}
        renamed: dict[str, str] = {}
        nodes: list[onnx.NodeProto] = []
        fused = matmul_transposes(self.graph, self.shapes)
        for node in self.graph.node:
            standard = node.domain in ("", "ai.onnx")
            replacement = None
            if node.op_type == "Transpose" and node.output[0] in fused:
                pass
            elif standard and (node.op_type in REDUCTIONS or node.op_type == "Transpose"):
                replacement = self.squeeze_units(node)
                if replacement is not None:
                    inner = replacement[1] if len(replacement) == 3 else None
                    if inner is not None and inner.op_type == "ReduceSum":
                        summed = self.reduce_sum(inner)
                        if summed is not None:
                            replacement[1:2] = summed
                            replacement = _chain_reshapes(replacement)
                elif node.op_type == "ReduceSum":
                    replacement = self.reduce_sum(node)
            elif standard and node.op_type in _ELEMENTWISE:
                factor = self.times_ones(node) if node.output[0] not in outputs else None
                if factor is not None:
                    renamed[node.output[0]] = factor
                    continue
                nodes.extend(self.match_ranks(node))
            elif standard and node.op_type == "Reshape" and node.output[0] not in outputs:
                x = node.input[0]
                if x in self.shapes and self.shapes.get(node.output[0]) == self.shapes[x]:
                    renamed[node.output[0]] = x  # already of that shape (a bias flattened)
                    continue
            nodes.extend(replacement if replacement is not None else [node])
        for node in nodes:
            node.input[:] = [_follow(renamed, i) for i in node.input]
        nodes = self.without_orphans(nodes, outputs)
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        # the axes of the rewritten reductions: onnxruntime warns about unused initializers
        read = {i for node in nodes for i in node.input} | outputs
        for node in nodes:
            read.update(name for sub in _subgraphs(node) for name in graph_names(sub))
        unused = [t for t in self.graph.initializer if t.name not in read]
        for tensor in unused:
            self.graph.initializer.remove(tensor)

    def fresh(self, base: str) -> str:
        return fresh_name(base, self.taken)

    def constant(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        self.graph.initializer.append(numpy_helper.from_array(value, name))
        self.constants[name] = value
        return name

    def reshape(self, x: str, shape: Sequence[int], output: str) -> onnx.NodeProto:
        target = self.constant(f"{output}/shape", np.array(shape, dtype=np.int64))
        return onnx.helper.make_node("Reshape", [x, target], [output])

    def times_ones(self, node: onnx.NodeProto) -> str | None:
        """The other factor of ``x * 1`` when the product has x's shape, else None."""
        if node.op_type != "Mul":
            return None
        for one, x in (node.input, reversed(node.input)):
            value = self.constants.get(one)
            if (
                value is not None
                and value.dtype.kind == "f"
                and np.all(value == 1)
                and x in self.shapes
                and self.shapes.get(node.output[0]) == self.shapes[x]
            ):
                return x
        return None

    def match_ranks(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """A one-element operand of a lower rank than the other operand gets its rank:
        onnxruntime broadcasts a lower-rank scalar over an (n, 1) tensor one element at a
        time, 12 us for n = 1000 instead of 2.3 (the same values: a one-element tensor
        broadcasts alike at any rank up to the result's). A constant is reshaped once; a
        computed scalar by a Reshape before the node (about 1 us), from
        :data:`RESHAPE_SCALARS_FROM` elements of the other operand.

        Returns the nodes to place before ``node`` (which is changed in place)."""
        before = []
        a, b = node.input
        for k, (one, other) in enumerate(((a, b), (b, a))):
            shape = self.shapes.get(one)
            if shape is None or math.prod(shape) != 1 or other not in self.shapes:
                continue
            rank = len(self.shapes[other])
            if len(shape) >= rank:
                continue
            key = (one, rank)
            if key not in self.ranked:
                if one in self.constants:
                    ones = self.constants[one].reshape((1,) * rank)
                    self.ranked[key] = self.constant(one, ones)
                elif math.prod(self.shapes[other]) >= RESHAPE_SCALARS_FROM:
                    self.ranked[key] = self.fresh(f"{one}/rank{rank}")
                    before.append(self.reshape(one, (1,) * rank, self.ranked[key]))
                else:
                    continue
            node.input[k] = self.ranked[key]
        return before

    def squeeze_units(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """A Transpose or a reduction of a tensor with axes of size 1 (those a reduction
        does not reduce), as the same operator on the tensor without them, between two
        Reshapes: ``[Reshape, op, Reshape]``, or one Reshape for a Transpose that only
        moved those axes. None to keep the node. The values are the same: only the shape
        the kernel sees changes. At any size: the slow path costs microseconds even on a
        [32, 10, 1] reduction (a softmax classifier's step: 19.9 -> 15.5 us), more than
        the Reshapes (0.3 us each, and most cancel against their neighbours')."""
        x, y = node.input[0], node.output[0]
        shape, out_shape = self.shapes.get(x), self.shapes.get(y)
        if shape is None or out_shape is None:
            return None
        rank = len(shape)
        changed = onnx.NodeProto()
        changed.CopyFrom(node)
        if node.op_type == "Transpose":
            perm = transpose_perm(node, rank)
            kept = [a for a in range(rank) if shape[a] != 1]
            if len(kept) == rank:
                return None
            moved = [kept.index(p) for p in perm if shape[p] != 1]
            if moved == sorted(moved):  # only the axes of size 1 moved
                return [self.reshape(x, out_shape, y)]
            del changed.attribute[:]
            changed.attribute.append(onnx.helper.make_attribute("perm", moved))
            inner_shape = tuple(shape[kept[p]] for p in moved)
        else:
            axes = _reduce_axes(node, self.constants)
            if not axes:  # all axes, or an identity: nothing to squeeze
                return None
            axes = sorted({a % rank for a in axes})
            kept = [a for a in range(rank) if shape[a] != 1 or a in axes]
            if len(kept) == rank:
                return None
            if node.op_type == "ReduceSum" and all(shape[a] == 1 for a in kept if a not in axes):
                return None  # a full reduction, :meth:`reduce_sum`'s fast path
            squeezed_axes = [kept.index(a) for a in axes]
            keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
            inner_shape = tuple(
                1 if i in squeezed_axes else shape[a]
                for i, a in enumerate(kept)
                if keepdims or i not in squeezed_axes
            )
            if len(node.input) > 1 and node.input[1]:
                changed.input[1] = self.constant(
                    f"{y}/axes", np.array(squeezed_axes, dtype=np.int64)
                )
            else:
                for attribute in changed.attribute:
                    if attribute.name == "axes":
                        attribute.ints[:] = squeezed_axes
        squeezed, result = self.fresh(f"{x}/squeezed"), self.fresh(f"{y}/squeezed")
        self.views[squeezed] = x
        changed.input[0], changed.output[0] = squeezed, result
        self.shapes[squeezed] = tuple(shape[a] for a in kept)
        self.shapes[result] = inner_shape
        if x in self.elem:
            self.elem[squeezed] = self.elem[x]
        return [
            self.reshape(x, self.shapes[squeezed], squeezed),
            changed,
            self.reshape(result, out_shape, y),
        ]

    def reduce_sum(self, node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """The nodes replacing one ReduceSum, or None to keep it."""
        x, y = node.input[0], node.output[0]
        noop = any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute)
        axes = _reduce_axes(node, self.constants)
        if axes is None or x not in self.shapes or y not in self.shapes:
            return None
        shape, out_shape = self.shapes[x], self.shapes[y]
        if not axes:
            return [onnx.helper.make_node("Identity", [x], [y])] if noop else None
        rank = len(shape)
        axes = sorted({a % rank for a in axes})
        summed = int(np.prod([shape[a] for a in axes]))
        kept = int(np.prod([d for i, d in enumerate(shape) if i not in axes]))
        if summed == 1:  # nothing to add up
            return [self.reshape(x, out_shape, y)]
        if kept == 1:  # everything is added up: onnxruntime's fast full reduction
            if not out_shape:
                return [onnx.helper.make_node("ReduceSum", [x], [y], keepdims=0)]
            total = self.fresh(f"{y}/total")
            full = onnx.helper.make_node("ReduceSum", [x], [total], keepdims=0)
            return [full, self.reshape(total, out_shape, y)]
        elem = self.elem.get(x)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else None
        if dtype not in (np.float32, np.float64) or not _is_block(axes, rank):
            return None
        if axes[0] == 0:
            batched = self.summed_product(x, summed, out_shape, y)
            if batched is not None:
                return batched
        # a block of leading axes: ones @ X; of trailing axes: X @ ones, the ones a
        # column (onnxruntime's MatMul by a 1-D right operand takes a slow path: 430 us
        # for [4096, 32] @ [32], 9.5 for @ [32, 1], 11.7 for its ReduceSum)
        leading = axes[0] == 0
        ones = self.constant(f"{y}/ones", np.ones(summed if leading else (summed, 1), dtype))
        nodes = []
        matrix = x
        if rank != 2:
            matrix = self.fresh(f"{y}/matrix")
            nodes.append(self.reshape(x, (summed, kept) if leading else (kept, summed), matrix))
        product = y if leading and tuple(out_shape) == (kept,) else self.fresh(f"{y}/sums")
        factors = [ones, matrix] if leading else [matrix, ones]
        nodes.append(onnx.helper.make_node("MatMul", factors, [product]))
        if product != y:
            nodes.append(self.reshape(product, out_shape, y))
        return nodes

    def summed_product(
        self, x: str, batch: int, out_shape: Sequence[int], y: str
    ) -> list[onnx.NodeProto] | None:
        """``sum_b x_b^T dy_b`` over the leading ``batch`` elements of a batched
        product (a weight's gradient where the weight multiplies a [B, S, in] input:
        ``ReduceSum(MatMul(Transpose(x), dy), axes=[0])``) as one product of the
        batch laid end to end, ``X^T DY`` with X = x as [B S, in] and DY = dy as
        [B S, out]: the same sum, one matrix product instead of B small ones and the
        sum of their results (a transformer's [32, 128, 64] feed-forward gradient: 96
        us a call against 116). None where ``x`` is not such a product."""
        name = self.views.get(x, x)
        while True:  # through the views of the product
            if self.reads.get(name) != 1:
                return None  # read elsewhere too: the product is computed anyway
            node = self.producer.get(name)
            if node is None or node.op_type != "Reshape":
                break
            name = node.input[0]
        if node is None or node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
            return None
        a, b = node.input
        transpose = self.producer.get(a)
        product, left, right = (self.shapes.get(name) for name in (node.output[0], a, b))
        if transpose is None or transpose.op_type != "Transpose":
            return None
        if product is None or left is None or right is None:
            return None
        rank = len(product)
        if rank < 3 or transpose_perm(transpose, rank) != last_two_swapped(rank):
            return None
        if not (left[:-2] == right[:-2] == product[:-2]) or math.prod(product[:-2]) != batch:
            return None
        rows, columns = batch * right[-2], (left[-2], right[-1])
        xt, x2, dy2 = (self.fresh(f"{y}/{stem}") for stem in ("rows", "rows_t", "dy_rows"))
        result = self.fresh(f"{y}/product") if tuple(out_shape) != columns else y
        nodes = [
            self.reshape(transpose.input[0], (rows, columns[0]), xt),
            onnx.helper.make_node("Transpose", [xt], [x2], perm=[1, 0]),
            self.reshape(b, (rows, columns[1]), dy2),
            onnx.helper.make_node("MatMul", [x2, dy2], [result]),
        ]
        self.shapes.update({xt: (rows, columns[0]), x2: (columns[0], rows)})
        self.shapes.update({dy2: (rows, columns[1]), result: columns})
        if result != y:
            nodes.append(self.reshape(result, out_shape, y))
        self.orphans += [node, transpose]
        return nodes

    def without_orphans(
        self, nodes: list[onnx.NodeProto], outputs: set[str]
    ) -> list[onnx.NodeProto]:
        """``nodes`` without the :attr:`orphans` no node reads any more (nor their
        inputs' producers that only they read), last first."""
        read = read_counts(nodes, outputs)
        dropped: set[int] = set()
        for orphan in self.orphans:  # a product before its operand's Transpose
            if any(read.get(o, 0) for o in orphan.output):
                continue
            dropped.add(id(orphan))
            for name in outer_reads(orphan):
                read[name] -= 1
        return [node for node in nodes if id(node) not in dropped]


_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div"})


GEMV_FUSED_UP_TO = 4096
"""Elements of a one-column product's first operand up to which its Gemm takes the
learning rate and the update (:func:`_gemms`): 1.77 us against 2.33 for 32 x 64, 6.77
against 4.15 for 1000 x 10 (their Gemm, Mul and Add)."""

GEMM_ABOVE = 65536
"""Elements of a product of matrices with a transposed operand above which it runs as a
``Gemm`` with a ``trans`` attribute rather than onnxruntime's ``FusedMatMul`` (what its
optimizer makes of ``MatMul(Transpose(A), B)``). In a Scan, us a product, FusedMatMul
against Gemm: 256 x 256 from 256 rows 116.5 / 115.6; 300 x 300 from 128, 95.3 / 87.5;
512 x 512 from 128, 264.8 / 212.6; 784 x 512 from 128 (the MLP 784-512-512-10's first
weight's gradient), 408.7 / 347.2; a transposed right operand, 512 x 512 from 128,
237.4 / 185.4. On 10 x 10 the FusedMatMul is faster (0.7 / 1.1)."""

SIGN_MASK_UP_TO = 256
"""Elements of a ReLU's output up to which its gradient's mask is ``Sign(y)`` rather
than ``Cast(y > 0)`` (:func:`_fewer_kernels`): a kernel fewer, faster on small
tensors, slower from about 300 elements (onnxruntime's Sign)."""

RESHAPE_SCALARS_FROM = 64
"""Elements of the other operand from which a computed scalar is reshaped to its rank:
onnxruntime's element-by-element broadcast costs about 2 + 0.01 n us, the Reshape 1."""


def last_two_swapped(rank: int) -> list[int]:
    """The ``perm`` of a Transpose that swaps a tensor's last two axes (a matrix's)."""
    return [*range(rank - 2), rank - 1, rank - 2]


def transpose_perm(node: onnx.NodeProto, rank: int) -> list[int]:
    """A Transpose's ``perm``: its attribute, else the axes reversed."""
    for attribute in node.attribute:
        if attribute.name == "perm":
            return list(attribute.ints)
    return list(range(rank))[::-1]


def matmul_transposes(graph: onnx.GraphProto, shapes: Mapping[str, tuple[int, ...]]) -> set[str]:
    """The results of the Transposes in ``graph`` that swap a tensor's last two axes and
    that only MatMuls read: onnxruntime runs each as an attribute of its MatMul
    (``FusedMatMul``), a kernel less than the ``Reshape`` a vector's transpose would
    otherwise become."""
    readers: dict[str, list[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node.op_type)
    outputs = {o.name for o in graph.output}
    fused = set()
    for node in graph.node:
        if node.op_type != "Transpose" or node.output[0] in outputs:
            continue
        rank = len(shapes.get(node.input[0], ()))
        if rank < 2 or transpose_perm(node, rank) != last_two_swapped(rank):
            continue
        if set(readers.get(node.output[0], ["none"])) == {"MatMul"}:
            fused.add(node.output[0])
    return fused


def _follow(renamed: Mapping[str, str], name: str) -> str:
    while name in renamed:
        name = renamed[name]
    return name


def _chain_reshapes(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` with each Reshape read by the next Reshape merged into it (their
    intermediate names are this rewrite's own: nothing else reads them)."""
    merged: list[onnx.NodeProto] = []
    for node in nodes:
        last = merged[-1] if merged else None
        if (
            last is not None
            and node.op_type == last.op_type == "Reshape"
            and node.input[0] == last.output[0]
        ):
            node.input[0] = last.input[0]
            merged[-1] = node
        else:
            merged.append(node)
    return merged


def _is_block(axes: list[int], rank: int) -> bool:
    """Whether sorted ``axes`` are the first or the last few axes, not all of them."""
    contiguous = axes == list(range(axes[0], axes[0] + len(axes)))
    return contiguous and len(axes) < rank and (axes[0] == 0 or axes[-1] == rank - 1)


Fold = Callable[[onnx.ModelProto], bool]
"""Folds what it can of a model in place; whether it changed anything."""


def specialize(
    model: onnx.ModelProto, batch: Mapping[str, int], folds: Sequence[Fold] = ()
) -> onnx.ModelProto:
    """``model`` with the first dimension of each input in ``batch`` fixed to its value,
    and every computation that became constant folded away (see the module docstring),
    ``folds`` (a backend's, for its own operators) included.

    The result computes the same values as ``model`` on inputs of those sizes; its
    outputs and inputs keep their names.
    """
    fixed = copy_model(model)
    inputs = {i.name: i for i in fixed.graph.input}
    symbols = {}  # a symbolic dimension fixed here has that size wherever it appears
    for name, size in batch.items():
        dims = inputs[name].type.tensor_type.shape.dim
        if dims:
            if dims[0].dim_param:
                symbols[dims[0].dim_param] = int(size)
            dims[0].Clear()
            dims[0].dim_value = int(size)
    for value in [*fixed.graph.value_info, *fixed.graph.input]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in symbols:
                size = symbols[dim.dim_param]
                dim.Clear()
                dim.dim_value = size
    # outputs keep only their element type: their shapes are inferred again
    for output in fixed.graph.output:
        for dim in output.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.Clear()
    # the gradient builder's value_info is kept: onnxruntime 1.19.2 crashes on some
    # gradient graphs (a ConvGrad after a MaxPoolGrad) whose types it has to infer again
    for _ in range(4):  # folding a BroadcastGradientArgs opens more folding after it
        _shapes_as_constants(fixed)
        fixed = _fold(fixed)
        changed = [fold(fixed) for fold in folds]
        if not any(changed):
            break
    fixed = simplify_reductions(fixed)
    # the reductions' rewrites leave Reshapes a backend's simplifications may merge
    if any([fold(fixed) for fold in folds]):
        fixed = _fold(fixed)
    # one inference for both: _fewer_kernels changes no shape _gemms reads
    shapes = static_shapes(fixed)
    _fewer_kernels(fixed, shapes)
    _gemms(fixed, shapes)
    gather_decay(fixed, shapes)  # reads no name _gemms rewrites
    _specialize_scan_bodies(fixed, folds)
    return fixed


def _fewer_kernels(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Rewrites, in place, pairs of kernels a step often has into one, the values the
    same:

    * the full sum of ``a * a`` (the loss), or of a ``Reshape`` of it:
      ``ReduceSumSquare(a)``;
    * ``Sum(x, x)`` with ``x = a * c`` (``c`` a constant no larger than ``a``):
      ``a * 2c`` (its gradient, ``d (d * d) = d dy + d dy``; doubling is exact);
    * ``Cast(Greater(y, 0))`` with ``y = Relu(x)`` (native's ReLU gradient mask) of at
      most :data:`SIGN_MASK_UP_TO` elements: ``Sign(y)`` (``y >= 0``: 1 where
      ``y > 0``, else 0; a NaN stays NaN), 1.03 us a step against 1.17 on 100 elements
      (with their Mul, in a Scan), but 2.21 against 1.77 on 1,000;
    * the full sum of a ``MatMul`` by ones (per-sample sums, a classification loss's),
      through ``Reshape`` and ``Neg``: the full sum of what the MatMul sums, negated
      as often (the same sum in another order).

    Each where the node it replaces has no other reader. The MLP 10-10-1's step at
    batch 10, SGD: native 22 -> 19 kernels, ort_training 21 -> 18; the softmax
    classifier's, 2 fewer."""
    graph = model.graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    reads = read_counts(graph.node, (o.name for o in graph.output))
    taken = graph_names(graph)
    dropped: set[int] = set()
    small, big = SIGN_MASK_UP_TO, SIGN_MASK_UP_TO + 1

    def only_mul(name: str) -> onnx.NodeProto | None:
        node = producer.get(name)
        if node is None or node.op_type != "Mul" or node.domain not in ("", "ai.onnx"):
            return None
        return node if reads.get(name) == 1 else None

    def full_sum_of_sums(node: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """The full sum of partial sums of ``m`` (a ``MatMul`` by a constant of ones,
        then ``Reshape``\\ s and ``Neg``\\ s: a classification loss's per-sample sums),
        as the full sum of ``m`` (negated as often): ``node`` changed in place, and the
        nodes to place after it."""
        chain, source = [], node.input[0]
        while reads.get(source) == 1 and source in producer:
            inner = producer[source]
            if inner.op_type not in ("Reshape", "Neg") or inner.domain not in ("", "ai.onnx"):
                break
            chain.append(inner)
            source = inner.input[0]
        product = producer.get(source)
        if product is None or product.op_type != "MatMul" or reads.get(source) != 1:
            return None
        m = None
        for ones, other in (product.input, reversed(product.input)):
            value = constants.get(ones)
            if value is not None and value.ndim in (1, 2) and np.all(value == 1):
                m = other if value.ndim == 2 and value.shape[1] == 1 or value.ndim == 1 else None
                break
        if m is None or len(shapes.get(m, ())) < 1:
            return None
        negated = sum(n.op_type == "Neg" for n in chain) % 2 == 1
        dropped.update(map(id, [product, *chain]))
        result = node.output[0]
        total = fresh_name(f"{result}/total", taken) if negated else result
        node.CopyFrom(onnx.helper.make_node("ReduceSum", [m], [total], keepdims=0))
        return [onnx.helper.make_node("Neg", [total], [result])] if negated else []

    after: dict[int, list[onnx.NodeProto]] = {}
    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "ReduceSum" and len(node.input) == 1:
            keepdims = next((a.i for a in node.attribute if a.name == "keepdims"), 1)
            noop = any(a.name == "noop_with_empty_axes" and a.i for a in node.attribute)
            source, views = node.input[0], []
            view = producer.get(source)
            while view is not None and view.op_type == "Reshape" and reads.get(source) == 1:
                views.append(view)  # a full sum reads through Reshapes
                source = view.input[0]
                view = producer.get(source)
            if keepdims or noop:
                continue
            square = only_mul(source)
            if square is not None and square.input[0] == square.input[1]:
                dropped.update(map(id, [square, *views]))
                node.CopyFrom(
                    onnx.helper.make_node(
                        "ReduceSumSquare", [square.input[0]], list(node.output), keepdims=0
                    )
                )
                continue
            summed = full_sum_of_sums(node)
            if summed is not None:
                after[index] = summed
        elif node.op_type == "Cast" and math.prod(shapes.get(node.output[0], (big,))) <= small:
            greater = producer.get(node.input[0])
            if greater is None or greater.op_type != "Greater" or reads.get(node.input[0]) != 1:
                continue
            y, zero = greater.input
            relu = producer.get(y)
            if relu is None or relu.op_type != "Relu" or relu.domain not in ("", "ai.onnx"):
                continue
            value = constants.get(zero)
            if value is None or value.size != 1 or value.item() != 0:
                continue
            to = next(a.i for a in node.attribute if a.name == "to")
            if onnx.helper.np_dtype_to_tensor_dtype(value.dtype) != to:
                continue  # the mask in y's own type (the zero is y's type)
            dropped.add(id(greater))
            node.CopyFrom(onnx.helper.make_node("Sign", [y], list(node.output)))
        elif node.op_type == "Sum" and len(node.input) == 2 and node.input[0] == node.input[1]:
            scaled = only_mul(node.input[0])
            for c, a in (scaled.input, reversed(scaled.input)) if scaled is not None else ():
                value = constants.get(c)
                if value is None or value.dtype.kind != "f" or c == a:
                    continue
                if a not in shapes or shapes.get(a) != shapes.get(node.output[0]):
                    continue  # c broadcasts a to a larger shape: keep the Mul
                twice = fresh_name(f"{c}/twice", taken)
                graph.initializer.append(
                    numpy_helper.from_array((value * 2).astype(value.dtype), twice)
                )
                dropped.add(id(scaled))
                node.CopyFrom(onnx.helper.make_node("Mul", [a, twice], list(node.output)))
                break
    if dropped:
        kept = []
        for index, node in enumerate(graph.node):
            if id(node) not in dropped:
                kept += [node, *after.get(index, [])]
        del graph.node[:]
        graph.node.extend(kept)


def _gemms(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Rewrites, in place, a weight's gradient and its SGD update into one ``Gemm``:

    * ``Transpose(A @ B)`` (its last two axes swapped, the product read only there):
      ``B^T A^T``, see ``transposed_product`` below (the gradient of a weight stored as
      [out, in], torch's Linear, then takes the next rewrites too);
    * ``MatMul(Transpose(A), B)`` of matrices (a weight's gradient, ``x^T dy``) that a
      learning rate scales, that has one column or more than :data:`GEMM_ABOVE`
      elements: ``Gemm(A, B, transA=1)`` (onnxruntime's ``FusedMatMul`` with a
      transposed operand takes 0.5 us on 10 x 10, its Gemm 0.33; on large products the
      Gemm is faster, see :data:`GEMM_ABOVE`; elsewhere the two are level and the
      FusedMatMul stays);
    * a Gemm without ``C`` times a scalar constant (the learning rate): its ``alpha``;
    * ``W + Gemm(...)`` of W's shape (the update): ``Gemm(..., C=W, beta=1)``.

    The same formula, each product's sum scaled and added in one kernel: on a 10 x 10
    weight 0.71 us against 1.57 for Gemm, Mul and Add, on 512 x 10 52 against 74. Not
    where the product has one column (a regression's last layer) and its first operand
    more than :data:`GEMV_FUSED_UP_TO` elements: there onnxruntime's Gemm runs a fast
    path only with ``alpha=1`` and no ``C`` (a 256 x 1 weight's gradient from 256 rows:
    37 us with its Mul and Add, 111 fused, 106 as ``FusedMatMul``)."""
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < 11:  # Gemm's C became optional in opset 11
        return
    graph = model.graph
    constants = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in outer_reads(node):
            readers.setdefault(name, []).append(node)
    position = {o: k for k, n in enumerate(graph.node) for o in n.output}
    absorbed: set[int] = set()  # the positions of Gemms a later node took over
    inserted: dict[int, list[onnx.NodeProto]] = {}  # new nodes before a position
    taken = graph_names(graph)

    def swapped(name: str) -> str | None:
        """The input of the Transpose producing ``name`` if it swaps the last two axes."""
        node = graph.node[position[name]] if name in position else None
        rank = len(shapes.get(name, ()))
        if node is None or node.op_type != "Transpose" or rank < 2:
            return None
        return node.input[0] if transpose_perm(node, rank) == last_two_swapped(rank) else None

    def transposed(name: str) -> str | None:
        """The matrix whose Transpose ``name`` is."""
        return swapped(name) if len(shapes.get(name, ())) == 2 else None

    def rate(name: str) -> float | None:
        """A scalar constant's value, where Gemm's float32 ``alpha`` holds it exactly (a
        float64 rate it cannot hold stays a Mul)."""
        value = constants.get(name)
        if value is None or value.size != 1:
            return None
        number = float(value.item())
        return number if float(np.float32(number)) == number else None

    def plain_gemm(name: str) -> onnx.NodeProto | None:
        """The Gemm without ``C`` producing ``name``, if only one node reads it and
        taking more into it keeps onnxruntime's fast path."""
        gemm = graph.node[position[name]] if name in position else None
        if gemm is None or gemm.op_type != "Gemm" or len(gemm.input) > 2:
            return None
        if len(readers.get(name, [])) != 1 or name in outputs:
            return None
        # one column from a large operand: onnxruntime's fast path wants alpha 1, no C
        column = shapes.get(name, ())[-1:] == (1,)
        large = math.prod(shapes.get(gemm.input[0], (GEMV_FUSED_UP_TO + 1,)))
        return None if column and large > GEMV_FUSED_UP_TO else gemm

    def scaled(name: str) -> bool:
        """Whether the one reader of ``name`` multiplies it by a rate Gemm can hold."""
        found = readers.get(name, [])
        if len(found) != 1 or found[0].op_type != "Mul" or name in outputs:
            return False
        return any(rate(i) is not None for i in found[0].input if i != name)

    def take_over(index: int, inner: str, inputs: list[str], **changes: float) -> None:
        gemm = graph.node[position[inner]]
        settings = {a.name: onnx.helper.get_attribute_value(a) for a in gemm.attribute}
        node = graph.node[index]
        fused = onnx.helper.make_node(
            "Gemm", inputs, list(node.output), name=node.name, **(settings | changes)
        )
        absorbed.add(position[inner])
        node.CopyFrom(fused)

    def transposed_product(index: int, node: onnx.NodeProto) -> onnx.NodeProto | None:
        """``Transpose(A @ B)`` (the last two axes swapped), the product read only
        there, as ``B^T A^T``: each operand's own Transpose cancels, or becomes a
        ``trans`` attribute (a Gemm, of matrices), or a Transpose that onnxruntime
        runs inside its MatMul (batches: only where one operand's cancels). A weight
        stored as [out, in] (torch's Linear) has the transpose of ``x^T dy`` for its
        gradient; attention's keys, the transpose of ``q^T d_scores``."""
        inner = node.input[0] if node.op_type == "Transpose" else None
        if inner is None or swapped(node.output[0]) is None or inner in outputs:
            return None
        product = graph.node[position[inner]] if inner in position else None
        if product is None or product.op_type != "MatMul" or len(readers.get(inner, [])) != 1:
            return None
        ranks = [len(shapes.get(i, ())) for i in product.input]
        if product.domain not in ("", "ai.onnx") or min(ranks) < 2:
            return None
        a, b = product.input
        a0, b0 = swapped(a), swapped(b)
        if ranks == [2, 2]:
            absorbed.add(position[inner])
            return onnx.helper.make_node(
                "Gemm",
                [b0 or b, a0 or a],
                list(node.output),
                name=node.name,
                transA=int(b0 is None),
                transB=int(a0 is None),
            )
        if a0 is None and b0 is None:
            return None  # two Transposes for one
        operands = []
        for x, x0, rank in ((b, b0, ranks[1]), (a, a0, ranks[0])):
            if x0 is None:
                x0 = fresh_name(f"{x}/t", taken)
                inserted.setdefault(index, []).append(
                    onnx.helper.make_node("Transpose", [x], [x0], perm=last_two_swapped(rank))
                )
            operands.append(x0)
        absorbed.add(position[inner])
        return onnx.helper.make_node("MatMul", operands, list(node.output), name=node.name)

    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx"):
            continue
        product = transposed_product(index, node)
        if product is not None:
            node.CopyFrom(product)
        elif node.op_type == "MatMul" and all(len(shapes.get(i, ())) == 2 for i in node.input):
            a, b = (transposed(i) for i in node.input)
            out = shapes.get(node.output[0], ())
            if (a is None and b is None) or not (
                out[-1:] == (1,) or scaled(node.output[0]) or math.prod(out) > GEMM_ABOVE
            ):
                continue  # onnxruntime's FusedMatMul is as fast there
            as_gemm = onnx.helper.make_node(
                "Gemm",
                [a or node.input[0], b or node.input[1]],
                list(node.output),
                name=node.name,
                transA=int(a is not None),
                transB=int(b is not None),
            )
            node.CopyFrom(as_gemm)
        elif node.op_type == "Mul":
            for inner, scale in (node.input, reversed(node.input)):
                gemm, value = plain_gemm(inner), rate(scale)
                if gemm is None or value is None:
                    continue
                if shapes.get(node.output[0]) != shapes.get(inner):
                    continue
                alpha = float(next((a.f for a in gemm.attribute if a.name == "alpha"), 1.0))
                take_over(index, inner, list(gemm.input), alpha=alpha * value)
                break
        elif node.op_type == "Add":
            for weight, inner in (node.input, reversed(node.input)):
                gemm = plain_gemm(inner)
                shape = shapes.get(weight)
                if gemm is None or shape is None:
                    continue
                if not shape == shapes.get(node.output[0]) == shapes.get(inner):
                    continue
                take_over(index, inner, [*gemm.input, weight], beta=1.0)
                break
    kept = []
    for k, node in enumerate(graph.node):
        kept += inserted.get(k, [])
        if k not in absorbed:
            kept.append(node)
    # the Transposes whose products read their input now
    read = set().union(*(outer_reads(n) for n in kept)) | outputs
    kept = [n for n in kept if n.op_type != "Transpose" or n.output[0] in read]
    del graph.node[:]
    graph.node.extend(kept)


def _shapes_as_constants(model: onnx.ModelProto) -> bool:
    """Replaces, in place, each ``Shape`` of a tensor whose shape onnx's inference fixes
    by that shape as an initializer; whether it replaced any. onnxscript's folding
    leaves the ``Shape`` of a ``Scan``'s output (an LSTM's last state), whose shape
    onnx's inference knows."""
    graph = model.graph
    if not any(n.op_type == "Shape" for n in graph.node):
        return False  # no shape inference to pay for
    shapes = static_shapes(model)
    outputs = {o.name for o in graph.output}
    found = [
        n
        for n in graph.node
        if n.op_type == "Shape"
        and n.domain in ("", "ai.onnx")
        and n.input[0] in shapes
        and n.output[0] not in outputs
    ]
    for node in found:
        attrs = {a.name: a.i for a in node.attribute}
        shape = shapes[node.input[0]]
        # ONNX's start and end count from the back when negative and are clamped: slicing
        part = shape[attrs.get("start", 0) : attrs.get("end", len(shape))]
        graph.initializer.append(numpy_helper.from_array(np.array(part, np.int64), node.output[0]))
        graph.node.remove(node)
    return bool(found)


def _specialize_scan_bodies(model: onnx.ModelProto, folds: Sequence[Fold]) -> None:
    """Specializes, in place, the body of each top-level ``Scan`` whose inputs have
    static shapes: as a model of its own whose inputs have the shapes the Scan gives
    them, and what it reads from the graph around it as inputs (constants as
    initializers). A recurrent layer's step (an LSTM's, its gradient's) runs its shape
    arithmetic and a gradient's seed-axis plumbing at every time step otherwise: 37 of
    the 67 kernels of an LSTM's adjoint step."""
    if not any(n.op_type == "Scan" for n in model.graph.node):
        return  # no shape inference to pay for
    shapes = static_shapes(model)
    inferred = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.input, *inferred.value_info]}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    initializers = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Scan" or node.domain not in ("", "ai.onnx"):
            continue
        attribute = next(a for a in node.attribute if a.name == "body")
        body = _specialized_body(model, node, attribute.g, shapes, types, initializers, folds)
        if body is not None:
            attribute.g.CopyFrom(body)


def _specialized_body(
    model: onnx.ModelProto,
    scan: onnx.NodeProto,
    body: onnx.GraphProto,
    shapes: Mapping[str, tuple[int, ...]],
    types: Mapping[str, int],
    initializers: Mapping[str, onnx.TensorProto],
    folds: Sequence[Fold],
) -> onnx.GraphProto | None:
    """``body`` specialized (see :func:`_specialize_scan_bodies`), None where an input's
    shape is not static or the body reads what the Scan's graph does not type."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in scan.attribute}
    scanned = int(attrs["num_scan_inputs"])
    states = len(scan.input) - scanned
    axes = list(attrs.get("scan_input_axes", [0] * scanned))
    inputs = []
    for k, (outer, value) in enumerate(zip(scan.input, body.input)):
        shape = shapes.get(outer)
        if shape is None or not outer:
            return None
        if k >= states:
            axis = axes[k - states] % len(shape)
            shape = shape[:axis] + shape[axis + 1 :]
        elem = value.type.tensor_type.elem_type or types.get(outer, 0)
        if not elem:
            return None
        inputs.append(onnx.helper.make_tensor_value_info(value.name, elem, list(shape)))
    local = {i.name for i in body.input} | {t.name for t in body.initializer}
    local |= {o for n in body.node for o in n.output}
    free = sorted(set().union(*(outer_reads(n) for n in body.node)) - local)
    outer_inputs, outer_constants = [], []
    for name in free:
        if name in initializers:
            outer_constants.append(initializers[name])
        elif name in shapes and types.get(name):
            value = onnx.helper.make_tensor_value_info(name, types[name], list(shapes[name]))
            outer_inputs.append(value)
        else:
            return None
    graph = onnx.GraphProto()
    graph.CopyFrom(body)
    del graph.input[:]
    graph.input.extend([*inputs, *outer_inputs])
    graph.initializer.extend(outer_constants)
    for output in graph.output:  # inferred again
        output.type.tensor_type.ClearField("shape")
    standalone = onnx.helper.make_model(graph, opset_imports=list(model.opset_import))
    standalone.ir_version = model.ir_version
    fixed = specialize(standalone, {}, folds).graph
    names = [i.name for i in fixed.input]
    if names != [i.name for i in graph.input] or [o.name for o in fixed.output] != [
        o.name for o in body.output
    ]:
        return None  # folding gave up a name the Scan reads by position: keep the body
    del fixed.input[len(inputs) :]  # read from the graph around it again
    outer_names = {t.name for t in outer_constants}
    kept = [t for t in fixed.initializer if t.name not in outer_names]
    del fixed.initializer[:]
    fixed.initializer.extend(kept)
    fixed.name = body.name
    return fixed


__all__ = [
    "REDUCTIONS",
    "Fold",
    "matmul_transposes",
    "simplify_reductions",
    "specialize",
    "static_shapes",
    "transpose_perm",
]
