"""A decoupled weight decay's update with its scalar factors gathered.

AdamW's and Lion's steps end the way the optimizer chain writes them (optax's order:
the rule's direction ``d``, the decay added, the learning rate applied, the update
added to the weight)::

    p + lr (d + wd p)                      4 passes over the weights

and Adam's direction is itself ``d = (s m) / r`` (``s`` its bias correction, one
element). ONNX has no fused optimizer kernel, so on onnxruntime's CPU kernels each
operator above is a pass over all the weights. Gathered, the same formula is::

    p (1 + lr wd) + ((lr s) m) / r         3 passes, and Adam's Mul by s folded in

torch.optim.AdamW's own order (the weight decayed first, then the step added): four
passes where the chain wrote six, the one-element factors computed once. Values are the
same formula rounded in another order, as torch rounds it. AdamW's step is then 13
passes over the weights, the fewest standard ONNX allows (``docs/design/performance.md``).
Measured, native, a fused epoch, us a batch (one process per version, taking turns):
MLP 10-10-1 at batch 10, 11.7 -> 11.3; MLP 100-256-256-1 at batch 256, 836-885 ->
822-833; MLP 784-512-512-10 at batch 128 (one update per weight), 2998-3019 ->
2740-2868.

:func:`gather_decay` runs on a training step whose weights' shapes are known: on a step
specialized to its batch size (:func:`graphkit.static_shapes.specialize`, each weight's
update) and on a fused epoch's step whose weights the Scan carries laid end to end
(:func:`graphkit.training.epoch.scan_over_batches`). The factors it adds that depend on
the step counter alone move before the epoch's Scan with the rest of the counter's
arithmetic (:mod:`graphkit.training.counter`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from graphkit._graph import fresh_name, graph_names, read_counts
from graphkit.tensor_store import tensor_value

GATHER_FROM = 4096
"""Elements of a weight (or of the weights laid end to end) from which the rewrite pays
for the kernels it adds on scalars at each step (up to five, where the learning rate
changes at each step, outside a fused epoch) with the two passes over the weights it
saves; below, it is made only where it adds fewer kernels than it saves."""

Shapes = Mapping[str, tuple[int, ...]]


@dataclass
class _Decay:
    """``p + lr (d + wd p)`` found in a graph; ``numerator``: ``(s, m, r)`` where
    ``d = (s m) / r``; ``nodes``: what the rewrite replaces, the final Add excepted."""

    p: str
    lr: str
    wd: str
    d: str
    numerator: tuple[str, str, str] | None
    nodes: list[onnx.NodeProto]


class _Finder:
    """Reads the pattern off ``graph``: single-reader producers of known shapes."""

    def __init__(self, graph: onnx.GraphProto, shapes: Shapes) -> None:
        self.shapes = shapes
        self.producer = {o: n for n in graph.node for o in n.output}
        self.reads = read_counts(graph.node, (o.name for o in graph.output))

    def only(self, name: str, op_type: str) -> onnx.NodeProto | None:
        """The ``op_type`` node producing ``name``, read nowhere else."""
        node = self.producer.get(name)
        if node is None or node.op_type != op_type or node.domain not in ("", "ai.onnx"):
            return None
        return node if self.reads.get(name) == 1 else None

    def scalar(self, name: str, rank: int) -> bool:
        shape = self.shapes.get(name)
        return shape is not None and len(shape) <= rank and math.prod(shape) == 1

    def factors(self, node: onnx.NodeProto | None, rank: int) -> tuple[str, str] | None:
        """A ``Mul``'s (one-element factor, tensor) operands."""
        if node is None or len(node.input) != 2:
            return None
        for a, b in (node.input, reversed(node.input)):
            if self.scalar(a, rank) and not self.scalar(b, rank):
                return a, b
        return None

    def decay(self, p: str, u: str) -> _Decay | None:
        """``p + u`` as a decoupled decay's update, or None."""
        shape = self.shapes.get(p)
        if shape is None:
            return None
        rank = len(shape)
        rate = self.only(u, "Mul")
        scaled = self.factors(rate, rank)
        total = self.only(scaled[1], "Add") if scaled else None
        if rate is None or scaled is None or total is None or len(total.input) != 2:
            return None
        found = self._decaying(total, p, shape, rank)
        if found is None:
            return None
        d, decaying, decay = found
        nodes = [rate, total, decaying]
        quotient = self.only(d, "Div")
        top = self.only(quotient.input[0], "Mul") if quotient is not None else None
        numerator = self.factors(top, rank)
        if numerator is None or quotient is None or top is None:
            return _Decay(p, scaled[0], decay[0], d, None, nodes)
        s, m = numerator
        return _Decay(p, scaled[0], decay[0], d, (s, m, quotient.input[1]), [*nodes, quotient, top])

    def _decaying(
        self, total: onnx.NodeProto, p: str, shape: tuple[int, ...], rank: int
    ) -> tuple[str, onnx.NodeProto, tuple[str, str]] | None:
        """``(d, the Mul, (wd, p))`` where ``total`` adds ``d`` of ``p``'s shape to
        ``wd p``, or None."""
        for d, q in (total.input, reversed(total.input)):
            decaying = self.only(q, "Mul")
            decay = self.factors(decaying, rank)
            if decaying is not None and decay is not None and decay[1] == p:
                if self.shapes.get(d) == shape:
                    return d, decaying, decay
        return None


def gather_decay(
    model: onnx.ModelProto, shapes: Shapes, computed_once: Collection[str] = ()
) -> int:
    """Rewrites, in place, each ``p + lr (d + wd p)`` of ``model``'s graph (``wd`` a
    constant, ``lr`` and ``wd`` one element, ``p`` of the result's shape) as
    ``p (1 + lr wd) + lr d``, and ``lr d`` as ``((lr s) m) / r`` where ``d = (s m) / r``
    (see the module docstring). Where the nodes it replaces have no other reader, and
    where it pays (:data:`GATHER_FROM`): ``computed_once`` names the values a fused
    epoch computes before its Scan (the counter's arithmetic, which takes the new
    kernels on them along), free at each step. Returns how many it rewrote."""
    graph = model.graph
    constants = {t.name: tensor_value(t) for t in graph.initializer}
    finder = _Finder(graph, shapes)
    taken = graph_names(graph)
    replaced: dict[int, list[onnx.NodeProto]] = {}
    gone: set[int] = set()
    for index, node in enumerate(graph.node):
        if node.op_type != "Add" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        for p, u in (node.input, reversed(node.input)):
            found = finder.decay(p, u)
            if found is None or shapes.get(node.output[0]) != shapes[p]:
                continue
            if found.wd not in constants:
                continue  # a decay that changes at each step: left as written
            if any(id(n) in gone for n in found.nodes) or not _pays(
                found, constants, shapes, computed_once
            ):
                continue
            rank = len(shapes[p])
            replaced[index] = _gathered(
                found, node.output[0], rank, finder, constants, taken, graph
            )
            gone.update(map(id, found.nodes))
            break
    kept = []
    for index, node in enumerate(graph.node):
        if index in replaced:
            kept += replaced[index]
        elif id(node) not in gone:
            kept.append(node)
    del graph.node[:]
    graph.node.extend(kept)
    return len(replaced)


def _pays(
    found: _Decay,
    constants: Mapping[str, np.ndarray],
    shapes: Shapes,
    computed_once: Collection[str],
) -> bool:
    """Whether the passes over the weights saved outweigh the kernels added on scalars
    that run at each step (``1 + lr wd`` and its Reshape to the weight's rank: 3; ``lr
    s`` and its Reshape: 2)."""

    def free(name: str) -> bool:
        return name in constants or name in computed_once

    added = 0 if free(found.lr) else 3
    if found.numerator is not None and not (free(found.lr) and free(found.numerator[0])):
        added += 2
    saved = 2 if found.numerator is not None else 1
    return added < saved or math.prod(shapes[found.p]) >= GATHER_FROM


def _gathered(
    found: _Decay,
    result: str,
    rank: int,
    finder: _Finder,
    constants: Mapping[str, np.ndarray],
    taken: set[str],
    graph: onnx.GraphProto,
) -> list[onnx.NodeProto]:
    """The nodes computing ``result`` from ``found`` with its factors gathered.

    The factors are computed on scalars: constants folded in float64; a factor the step
    computes (a schedule's rate, Adam's bias correction) read before its ``Reshape`` to
    ``[1] * rank``, so that the scalar arithmetic moves before an epoch's Scan with the
    counter's (:mod:`graphkit.training.counter`), then reshaped to the weight's rank
    (onnxruntime broadcasts a lower-rank one element at a time)."""
    p, dtype = found.p, constants[found.wd].dtype
    nodes: list[onnx.NodeProto] = []
    made: dict[str, int] = {}  # the ranks of the tensors made here

    def rank_of(name: str) -> int:
        return made[name] if name in made else len(finder.shapes[name])

    def node(op: str, inputs: list[str], base: str, out_rank: int = rank) -> str:
        out = fresh_name(base, taken)
        nodes.append(helper.make_node(op, inputs, [out]))
        made[out] = out_rank
        return out

    def initializer(value: np.ndarray, base: str, shape: list[int]) -> str:
        name = fresh_name(base, taken)
        array = np.asarray(value, np.float64).astype(dtype).reshape(shape)
        graph.initializer.append(numpy_helper.from_array(array, name))
        made[name] = len(shape)
        return name

    def scalar(name: str) -> str | np.ndarray:
        """A factor as a float64 value (a constant) or a tensor's name, a rank-0 one
        where the step reshapes one."""
        if name in constants:
            return constants[name].astype(np.float64).reshape(())
        reshape = finder.producer.get(name)
        if reshape is not None and reshape.op_type == "Reshape":
            source = reshape.input[0]
            if finder.shapes.get(source) == ():
                return source
        return name

    def times(a: str | np.ndarray, b: str | np.ndarray, base: str) -> str | np.ndarray:
        if not isinstance(a, str) and not isinstance(b, str):
            return np.asarray(a * b)
        a, b = (x if isinstance(x, str) else initializer(x, f"{base}/factor", []) for x in (a, b))
        return node("Mul", [a, b], base, max(rank_of(a), rank_of(b)))

    def at_rank(value: str | np.ndarray, base: str) -> str:
        if not isinstance(value, str):
            return initializer(value, base, [1] * rank)
        if rank_of(value) < rank:
            shape = fresh_name(f"{base}/shape", taken)
            graph.initializer.append(numpy_helper.from_array(np.ones(rank, np.int64), shape))
            return node("Reshape", [value, shape], base)
        return value

    lr, wd = scalar(found.lr), scalar(found.wd)
    kept = times(lr, wd, f"{p}/lr_wd")
    if not isinstance(kept, str):
        kept = np.asarray(1 + kept)
    else:
        one = initializer(np.ones(()), f"{p}/one", [])
        kept = node("Add", [one, kept], f"{p}/kept", rank_of(kept))
    decayed = node("Mul", [p, at_rank(kept, f"{p}/kept")], f"{p}/decayed")
    if found.numerator is not None:
        s, m, r = found.numerator
        rate = at_rank(times(lr, scalar(s), f"{p}/rate"), f"{p}/rate")
        step = node("Div", [node("Mul", [rate, m], f"{p}/scaled"), r], f"{p}/step")
    else:
        step = node("Mul", [found.d, at_rank(lr, f"{p}/lr")], f"{p}/step")
    nodes.append(helper.make_node("Add", [decayed, step], [result]))
    return nodes
