"""What an update step is, and how it joins a gradient graph.

An update step is an ONNX graph that takes the weights, their gradients, the optimizer
state, the step counter and the running loss sum, and returns their next values
(:class:`UpdateStep` names its inputs' roles). Its resident inputs (weights, state,
``step``, ``loss_sum``) are carried from one run to the next: the output holding the new
value of ``name`` is :func:`next_name` (``"<name>.next"``).

:func:`splice_loss` and :func:`splice_update` join a loss and an update step to a
gradient graph, the fused batch of both backends' forward/backward runners; graphs are
built in :mod:`graphkit.training.step`, which uses these definitions too. This module
sits below both the backends and :mod:`graphkit.training`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from graphkit._graph import fresh_name, graph_names, renamed_value, splice
from graphkit.compat import opset_of

STEP = "step"
LOSS_SUM = "loss_sum"
LOSS = "loss"


def next_name(name: str) -> str:
    """The output that holds the new value of the resident input ``name``."""
    return f"{name}.next"


def grad_name(weight: str) -> str:
    return f"{weight}_grad"


def fuses_into(gradient: onnx.ModelProto, loss: onnx.ModelProto, update: UpdateStep) -> bool:
    """Whether the loss and update graphs can join a gradient graph as they are (see
    :func:`splice_update`): written for an ``ai.onnx`` opset no newer than the gradient
    graph's (splicing them into an older graph would change what its operators mean)."""
    host = opset_of(gradient) or 0
    return all((opset_of(piece) or 0) <= host for piece in (loss, update.model))


def splice_loss(
    model: onnx.ModelProto, loss: onnx.ModelProto, prediction: str
) -> tuple[dict[str, str], str, str | None]:
    """Splice ``loss`` into a gradient graph ``model`` (in place, its nodes appended) on
    the tensor ``prediction``, its ``label`` [and ``weight``] read from fresh names:
    ``(produced, label, weight)``, ``produced`` naming ``loss`` and ``prediction_grad``
    in ``model``, ``weight`` None for an unweighted loss. Both backends' fused steps
    start here."""
    taken = graph_names(model.graph)
    label = fresh_name("label", taken)
    weighted = any(i.name == "weight" for i in loss.graph.input)
    weight = fresh_name("weight", taken) if weighted else None
    wiring = {"prediction": prediction, "label": label}
    if weight is not None:
        wiring["weight"] = weight
    return splice(model, loss, wiring, prefix="gk.loss"), label, weight


def splice_update(
    model: onnx.ModelProto,
    loss: onnx.ModelProto,
    update: UpdateStep,
    internal: Mapping[str, str],
    gradient_of: Mapping[str, str],
    loss_value: str,
    data: Sequence[str],
) -> tuple[dict[str, str], dict[str, str]]:
    """Splice ``update`` into a gradient graph ``model`` (in place) after its gradients,
    and make the graph's inputs ``data`` (the features, then the label [and sample
    weight] typed as ``loss`` declares them) followed by the resident values in
    ``update.resident`` order: the fused training batch of a forward/backward trainer,
    for both backends' runners.

    ``internal`` maps a public weight name to its name in ``model``, ``gradient_of`` a
    gradient output of ``model`` to the public weight name, ``loss_value`` is the loss's
    name in ``model``. Returns ``(carried, produced)``: each resident value's input
    name, and each output of ``update`` under its name in ``model``.
    """
    graph = model.graph
    weight_of = {w: g for g, w in gradient_of.items()}
    taken = graph_names(graph)
    carried = {r: internal.get(r) or fresh_name(f"gk.update/{r}", taken) for r in update.resident}
    wiring = {**carried, LOSS: loss_value}
    wiring.update({grad_name(w): weight_of[w] for w in update.weights})
    produced = splice(model, update.model, wiring, prefix="gk.update")
    declared = {i.name: i for i in [*loss.graph.input, *update.model.graph.input]}
    inputs = {i.name: i for i in graph.input}
    labelled = len(loss.graph.input) - 1  # the label [and the sample weight]
    features, labels = data[: len(data) - labelled], data[len(data) - labelled :]
    typed = [inputs[f] for f in features]
    typed += [renamed_value(declared[n], name) for n, name in zip(("label", "weight"), labels)]
    typed += [
        inputs.get(carried[r]) or renamed_value(declared[r], carried[r]) for r in update.resident
    ]
    del graph.input[:]
    graph.input.extend(typed)
    return carried, produced


PACKED = "graphkit.packed"
"""The name the optimizer sees for all the weights laid end to end (see :class:`Packing`)."""


@dataclass(frozen=True)
class Packing:
    """The weights of one dtype laid end to end in one flat vector, for an elementwise
    optimizer (:attr:`graphkit.transforms.GradientTransformation.elementwise`).

    The update step concatenates the gradients, runs the optimizer once on the flat
    vector, and splits the update back: Adam then costs a dozen kernels per step, not a
    dozen per weight. Its per-weight state ``"<weight>.<rest>"`` is kept as one flat
    ``"graphkit.packed.<rest>"``; :meth:`unpack` and :meth:`pack` convert, so that
    ``get_state`` and checkpoints still name the state per weight.
    """

    weights: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(shape, dtype=np.int64)) for shape in self.shapes]

    def flat(self, values: Mapping[str, np.ndarray]) -> np.ndarray:
        """The weights' values end to end."""
        return np.concatenate([np.asarray(values[w]).reshape(-1) for w in self.weights])

    def unpack(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Packed state entries split back per weight; other entries unchanged."""
        out: dict[str, np.ndarray] = {}
        offsets = np.cumsum(self.sizes)[:-1]
        for name, value in values.items():
            if not name.startswith(PACKED + "."):
                out[name] = value
                continue
            rest = name[len(PACKED) :]
            for w, shape, piece in zip(self.weights, self.shapes, np.split(value, offsets)):
                out[f"{w}{rest}"] = piece.reshape(shape)
        return out

    def pack(self, values: Mapping[str, np.ndarray], names: Sequence[str]) -> dict[str, np.ndarray]:
        """``values`` (per weight) with the packed entries ``names`` assembled."""
        packed = set(names)
        out = {n: v for n, v in values.items() if not _packed_part(n, self.weights, packed)}
        for name in names:
            rest = name[len(PACKED) :]
            out[name] = np.concatenate(
                [np.asarray(values[f"{w}{rest}"]).reshape(-1) for w in self.weights]
            )
        return out


def _packed_part(name: str, weights: Sequence[str], packed: set[str]) -> bool:
    """Whether ``name`` is one weight's part of a packed state entry."""
    return any(name.startswith(w + ".") and PACKED + name[len(w) :] in packed for w in weights)


@dataclass
class UpdateStep:
    """An update-step (or training-step) model and the roles of its inputs."""

    model: onnx.ModelProto
    weights: list[str]
    state: list[str]
    """The optimizer state as the graph holds it (packed, see ``packing``)."""
    initial: dict[str, np.ndarray] = field(repr=False)
    """Initial values of the resident inputs (weights, zero state, step 0, loss_sum 0)."""
    packing: Packing | None = None
    """How the weights are laid end to end for the optimizer (None: one by one)."""
    buffers: list[str] = field(default_factory=list)
    """The model's values the step updates without a gradient (torch's buffers: the
    running statistics of a BatchNormalization that trains with batch statistics, see
    :mod:`graphkit.train_mode`); they are also in ``state``."""

    @property
    def model_state(self) -> list[str]:
        """What the prediction graph reads from training: the weights and the buffers."""
        return [*self.weights, *self.buffers]

    @property
    def resident(self) -> list[str]:
        """Inputs carried from one run to the next: weights, state, step, loss_sum."""
        return [*self.weights, *self.state, STEP, LOSS_SUM]

    def public(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Resident values with the optimizer state named per weight."""
        return dict(values) if self.packing is None else self.packing.unpack(values)

    def internal(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Values named per weight (as :meth:`public` gives them) as the graph holds them."""
        if self.packing is None:
            return dict(values)
        return self.packing.pack(values, [s for s in self.state if s.startswith(PACKED + ".")])

    @property
    def public_state(self) -> list[str]:
        """The optimizer state's names, per weight."""
        return list(self.public({s: self.initial[s] for s in self.state}))


__all__ = [
    "LOSS",
    "LOSS_SUM",
    "PACKED",
    "STEP",
    "Packing",
    "UpdateStep",
    "fuses_into",
    "grad_name",
    "next_name",
    "splice_loss",
    "splice_update",
]
