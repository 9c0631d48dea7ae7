"""Combinators: transformations built from others, one after the other (:func:`chain`)
or one per group of weights (:func:`partition`, :func:`masked`, :func:`freeze`), and the
trivial ones they use (:func:`identity`, :func:`set_to_zero`)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from onnx import helper

from graphkit._graph import elem_type
from graphkit.errors import UnknownNameError
from graphkit.transforms.base import (
    Emitter,
    GradientTransformation,
    Tensors,
    WeightInfo,
    _copy,
    factory,
)


class Chain(GradientTransformation):
    """Transformations applied one after the other, each to the previous one's updates."""

    def __init__(
        self,
        *transforms: GradientTransformation,
        name: str = "chain",
        params: Mapping[str, Any] | None = None,
    ) -> None:
        for t in transforms:
            if not isinstance(t, GradientTransformation):
                raise TypeError(
                    f"chain() takes gradient transformations, not {type(t).__name__} {t!r}."
                )
        self.transforms = tuple(transforms)
        self.name = name
        self.params = dict(params or {})

    def __repr__(self) -> str:
        if self.name != "chain" or self.params:
            return super().__repr__()
        return f"chain({', '.join(map(repr, self.transforms))})"

    def children(self) -> tuple[GradientTransformation, ...]:
        return self.transforms

    def _with_children(self, children: Sequence[GradientTransformation]) -> Chain:
        out = _copy(self)
        out.transforms = tuple(children)
        return out

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        state: dict[str, np.ndarray] = {}
        owner: dict[str, GradientTransformation] = {}
        for t in self.transforms:
            part = t.init(params)
            clash = sorted(set(part) & set(state))
            if clash:
                raise ValueError(
                    f"chain: {t!r} and {owner[clash[0]]!r} both keep state {clash}; give one "
                    "a distinct name with .renamed('...')."
                )
            state.update(part)
            owner.update(dict.fromkeys(part, t))
        return state

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        owned: Tensors = {}
        for t in self.transforms:
            updates, new = t.emit(g, updates, state, params, step)
            owned.update(new)
        return updates, owned


def chain(*transforms: GradientTransformation) -> Chain:
    """``chain(a, b)``: b transforms the updates a returns."""
    return Chain(*transforms)


Labels = Mapping[str, str] | Callable[..., str]


def _call_label(fn: Callable[..., Any], name: str, info: WeightInfo) -> Any:
    """Call a user predicate as ``fn(name)`` or ``fn(name, weight_info)``."""
    try:
        n_args = len(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        n_args = 2
    return fn(name) if n_args == 1 else fn(name, info)


class Partition(GradientTransformation):
    """A different transformation per group of weights.

    ``labels`` maps each weight name to a key of ``transforms``: a dict (which must name
    every weight) or a function ``(name) -> key`` or ``(name, WeightInfo) -> key``.
    """

    name = "partition"
    elementwise = False  # its groups are chosen by name

    def __init__(self, transforms: Mapping[str, GradientTransformation], labels: Labels) -> None:
        if not transforms:
            raise ValueError("partition() needs at least one transformation.")
        self.transforms = dict(transforms)
        self.labels = labels
        self.params = {"groups": sorted(self.transforms)}

    def children(self) -> tuple[GradientTransformation, ...]:
        return tuple(self.transforms.values())

    def _with_children(self, children: Sequence[GradientTransformation]) -> Partition:
        out = _copy(self)
        out.transforms = dict(zip(self.transforms, children))
        return out

    def groups(self, weights: Mapping[str, WeightInfo]) -> dict[str, list[str]]:
        """``{group: weight names}``; raise on unknown or missing names."""
        if isinstance(self.labels, Mapping):
            unknown = sorted(set(self.labels) - set(weights))
            if unknown:
                raise UnknownNameError(
                    f"The partition names weights {unknown} the model does not have; its "
                    f"weights are {sorted(weights)}."
                )
            missing = sorted(set(weights) - set(self.labels))
            if missing:
                raise UnknownNameError(
                    f"The partition gives no group to weights {missing}; label every weight "
                    "or use a function."
                )
            label_of = dict(self.labels)
        else:
            label_of = {w: _call_label(self.labels, w, info) for w, info in weights.items()}
        groups: dict[str, list[str]] = {key: [] for key in self.transforms}
        for w, label in label_of.items():
            if label not in groups:
                raise UnknownNameError(
                    f"Weight {w!r} is labelled {label!r}, which is not one of the partition's "
                    f"groups {sorted(groups)}."
                )
            groups[label].append(w)
        return groups

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        infos = {w: WeightInfo.of(v) for w, v in params.items()}
        state: dict[str, np.ndarray] = {}
        for key, names in self.groups(infos).items():
            if names:
                state.update(self.transforms[key].init({w: params[w] for w in names}))
        return state

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        infos = {w: g.weights[w] for w in updates}
        new_updates, owned = dict(updates), {}
        for key, names in self.groups(infos).items():
            if names:
                part = {w: updates[w] for w in names}
                out, new = self.transforms[key].emit(g, part, state, params, step)
                new_updates.update(out)
                owned.update(new)
        return new_updates, owned


def partition(transforms: Mapping[str, GradientTransformation], labels: Labels) -> Partition:
    """Apply ``transforms[labels(w)]`` to each weight ``w`` (optax's multi_transform)."""
    return Partition(transforms, labels)


class _PassThrough(GradientTransformation):
    name = "identity"
    params: dict[str, Any] = {}
    elementwise = True

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {}

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        return dict(updates), {}


class _Zero(_PassThrough):
    name = "set_to_zero"

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        zeros = {}
        for w in updates:
            zero = helper.make_tensor("zero", elem_type(g.weights[w].dtype), [1], [0.0])
            shape = g.node("Shape", [updates[w]], f"set_to_zero/{w}/shape")
            zeros[w] = g.node("ConstantOfShape", [shape], f"set_to_zero/{w}", value=zero)
        return zeros, {}


@factory
def identity() -> GradientTransformation:
    """u -> u"""
    return _PassThrough()


@factory
def set_to_zero() -> GradientTransformation:
    """u -> 0: the weights it sees stay exactly as they are (a frozen layer)."""
    return _Zero()


def masked(inner: GradientTransformation, mask: Sequence[str] | Callable[..., bool]) -> Partition:
    """``inner`` on the weights ``mask`` selects; the others' updates pass unchanged.

    ``mask`` is a list of weight names or a predicate ``(name)`` / ``(name, WeightInfo)``.
    """
    if isinstance(mask, str):
        mask = [mask]
    if callable(mask):
        predicate = mask

        def label(name: str, info: WeightInfo) -> str:
            return "masked" if _call_label(predicate, name, info) else "rest"

        return Partition({"masked": inner, "rest": identity()}, label)
    chosen = list(mask)
    return _NamedMask({"masked": inner, "rest": identity()}, chosen)


class _NamedMask(Partition):
    """A mask given as names: every name must be a weight."""

    def __init__(self, transforms: Mapping[str, GradientTransformation], names: list[str]):
        super().__init__(transforms, lambda name: "masked" if name in names else "rest")
        self.names = names

    def groups(self, weights: Mapping[str, WeightInfo]) -> dict[str, list[str]]:
        unknown = sorted(set(self.names) - set(weights))
        if unknown:
            raise UnknownNameError(
                f"The mask names weights {unknown} the model does not have; its weights are "
                f"{sorted(weights)}."
            )
        return super().groups(weights)


def freeze(names: Sequence[str] | Callable[..., bool]) -> Partition:
    """Leave the selected weights bit-identical: ``masked(set_to_zero(), names)``."""
    return masked(set_to_zero(), names)


__all__ = [
    "Chain",
    "Labels",
    "Partition",
    "chain",
    "freeze",
    "identity",
    "masked",
    "partition",
    "set_to_zero",
]
