"""Penalties on weights: onnxscript functions of one weight tensor and their gradients.

A :class:`Penalty` holds, per weight name, an elastic coefficient pair ``(l1, l2)``::

    penalty = graphkit.penalties.elastic(l1=0.01, l2=0.1, weights=["coef"])
    penalty.value({"coef": w, "intercept": b})      # l1 sum|coef| + l2 sum coef^2
    penalty.gradient({"coef": w, "intercept": b})   # {"coef": l1 sign(coef) + 2 l2 coef}

``weights=None`` means every weight it is given. A user-written penalty
(:func:`custom_penalty`) gets its gradient from the backend's gradient source.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, no_type_check

import numpy as np
import onnx
import onnxscript

from graphkit._graph import Dim, compile_function, float_dtype, splice
from graphkit.dsl import FLOAT, op, script
from graphkit.engine.ort_engine import Runner
from graphkit.errors import UnknownNameError
from graphkit.gradient import gradient_model
from graphkit.losses import elastic_formula
from graphkit.registry import Registry


def _elastic_functions(l1: float, l2: float) -> tuple[Any, Any]:
    """``(P, dP/dw)``: the elastic loss's formula, ``l1 |w| + l2 w^2`` (whose derivative
    is ``l1 sign(w) + 2 l2 w``, 0 at w = 0 for the l1 part), summed over the weight."""
    elementwise, derivative = elastic_formula(l1, l2)

    @script()
    @no_type_check
    def elastic_penalty(weight: FLOAT) -> FLOAT:
        """P(w) = sum_i l1 |w_i| + l2 w_i^2"""
        return op.ReduceSum(elementwise(weight), keepdims=0)

    @script()
    @no_type_check
    def elastic_penalty_grad(weight: FLOAT) -> FLOAT:
        """dP/dw_i = l1 sign(w_i) + 2 l2 w_i"""
        return derivative(weight)

    return elastic_penalty, elastic_penalty_grad


class Penalty:
    """A penalty added to the loss: the sum over weights of a function of each weight.

    Args:
        coefficients: ``{weight name: (l1, l2)}``; with ``default`` set, names not listed
            use it.
        default: ``(l1, l2)`` for weights not in ``coefficients`` (None: unpenalized).
        function: a custom scripted ``weight -> scalar`` used instead of the elastic form,
            for the weights of ``coefficients`` (values ignored) or all when ``default``.
    """

    def __init__(
        self,
        coefficients: Mapping[str, tuple[float, float]] | None = None,
        default: tuple[float, float] | None = None,
        function: onnxscript.OnnxFunction | None = None,
        name: str = "elastic",
    ) -> None:
        self.coefficients = {k: (float(v[0]), float(v[1])) for k, v in (coefficients or {}).items()}
        for key, (l1, l2) in [*self.coefficients.items(), ("default", default or (0.0, 0.0))]:
            if l1 < 0 or l2 < 0:
                raise ValueError(f"Penalty coefficients must be >= 0, got {(l1, l2)} for {key!r}.")
        self.default = None if default is None else (float(default[0]), float(default[1]))
        self.custom = function
        self.name = name
        self._runners: dict[tuple[Any, ...], Runner] = {}

    def __getstate__(self) -> dict[str, Any]:
        if self.custom is not None:
            raise TypeError(f"Custom penalty {self.name!r} cannot be pickled: it is code.")
        return {k: v for k, v in self.__dict__.items() if k != "_runners"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _runners={})

    def __repr__(self) -> str:
        return f"Penalty({self.name!r}, coefficients={self.coefficients}, default={self.default})"

    @property
    def is_zero(self) -> bool:
        if self.custom is not None:
            return False
        pairs = list(self.coefficients.values()) + ([self.default] if self.default else [])
        return all(l1 == 0 and l2 == 0 for l1, l2 in pairs)

    def penalized(self, names: Iterable[str], strict: bool = True) -> list[str]:
        """The names, among ``names``, this penalty applies to.

        Raises:
            UnknownNameError: with ``strict``, a coefficient names a weight not in ``names``.
        """
        names = list(names)
        unknown = sorted(set(self.coefficients) - set(names))
        if strict and unknown:
            raise UnknownNameError(
                f"Penalty on {unknown}, which {'is' if len(unknown) == 1 else 'are'} not a "
                f"trainable weight. Trainable weights: {names}."
            )
        if self.default is not None:
            return names
        return [n for n in names if n in self.coefficients]

    def coefficients_of(self, name: str) -> tuple[float, float]:
        if name in self.coefficients:
            return self.coefficients[name]
        return self.default or (0.0, 0.0)

    # -- onnxscript functions and models -------------------------------------------------

    def functions(
        self, name: str
    ) -> tuple[onnxscript.OnnxFunction, onnxscript.OnnxFunction | None]:
        """``(value, gradient)`` scripted functions for weight ``name`` (gradient None for a
        custom penalty, derived by the backend's gradient source)."""
        if self.custom is not None:
            return self.custom, None
        return _elastic_functions(*self.coefficients_of(name))

    def value_model(self, name: str, dtype: object, shape: Sequence[Dim]) -> onnx.ModelProto:
        """``weight -> penalty`` for the weight ``name`` of ``shape``."""
        fn, _ = self.functions(name)
        return compile_function(
            fn, dtype, {"weight": tuple(shape), "penalty": ()}, outputs=["penalty"]
        )

    def gradient_model(self, name: str, dtype: object, shape: Sequence[Dim]) -> onnx.ModelProto:
        """``weight -> (penalty, weight_grad)``."""
        fn, grad = self.functions(name)
        if grad is None:
            return gradient_model(self.value_model(name, dtype, shape), "penalty", ["weight"])
        value = self.value_model(name, dtype, shape)
        derivative = compile_function(
            grad,
            dtype,
            {"weight": tuple(shape), "weight_grad": tuple(shape)},
            outputs=["weight_grad"],
        )
        produced = splice(value, derivative, {"weight": "weight"}, prefix="grad")
        value.graph.node.append(
            onnx.helper.make_node("Identity", [produced["weight_grad"]], ["weight_grad"])
        )
        value.graph.output.extend(derivative.graph.output)
        return value

    # -- evaluation ----------------------------------------------------------------------

    def value(self, weights: Mapping[str, np.ndarray]) -> float:
        """The total penalty on ``weights`` (names not penalized contribute 0)."""
        return float(sum(self._run(n, w)[0] for n, w in self._items(weights)))

    def gradient(self, weights: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``{name: d penalty / d weight}`` for the penalized weights."""
        return {n: self._run(n, w)[1] for n, w in self._items(weights)}

    def _items(self, weights: Mapping[str, np.ndarray]) -> list[tuple[str, np.ndarray]]:
        names = self.penalized(weights)
        return [(n, np.asarray(weights[n])) for n in names]

    def _run(self, name: str, weight: np.ndarray) -> list[np.ndarray]:
        dtype = float_dtype(weight.dtype)
        key = (name if self.custom is None else None, dtype, weight.shape)
        if key not in self._runners:
            self._runners[key] = Runner(self.gradient_model(name, dtype, weight.shape))
        return self._runners[key]({"weight": weight})


PENALTIES: Registry[Penalty] = Registry("penalty")


@PENALTIES.register("none")
def no_penalty() -> Penalty:
    """No penalty."""
    return Penalty(name="none")


@PENALTIES.register("l1", "lasso")
def l1(alpha: float = 1e-4, weights: Iterable[str] | None = None) -> Penalty:
    """alpha sum|w| on ``weights`` (all when None)."""
    return elastic(alpha, 0.0, weights)


@PENALTIES.register("l2", "ridge")
def l2(alpha: float = 1e-4, weights: Iterable[str] | None = None) -> Penalty:
    """alpha sum w^2 on ``weights`` (all when None)."""
    return elastic(0.0, alpha, weights)


@PENALTIES.register("elastic", "elasticnet")
def elastic(l1: float = 0.5, l2: float = 0.5, weights: Iterable[str] | None = None) -> Penalty:
    """l1 sum|w| + l2 sum w^2 on ``weights`` (all when None)."""
    if weights is None:
        return Penalty(default=(l1, l2))
    return Penalty({name: (l1, l2) for name in weights})


def from_spec(spec: Mapping[str, float | Mapping[str, float]] | Penalty | None) -> Penalty:
    """A penalty from the seed's ``add_loss_output`` syntax.

    ``{"coef": {"l1": 0.1, "l2": 0.01}}`` or ``{"coef": 0.01}`` (a number is an l2
    coefficient, as in the seed library).
    """
    if spec is None:
        return no_penalty()
    if isinstance(spec, Penalty):
        return spec
    coefficients = {}
    for name, value in spec.items():
        if isinstance(value, Mapping):
            unknown = set(value) - {"l1", "l2"}
            if unknown:
                raise ValueError(
                    f"Penalty on {name!r} has unknown keys {sorted(unknown)}; use 'l1' and 'l2'."
                )
            coefficients[name] = (float(value.get("l1", 0.0)), float(value.get("l2", 0.0)))
        else:
            coefficients[name] = (0.0, float(value))
    return Penalty(coefficients)


def custom_penalty(fn: Callable[..., Any], weights: Iterable[str] | None = None) -> Penalty:
    """A penalty written as an onnxscript function ``weight -> scalar``.

    Its gradient is derived by the backend's gradient source. Applies to ``weights`` (all if None).
    """
    if not isinstance(fn, onnxscript.OnnxFunction):
        raise TypeError("A custom penalty must be an onnxscript function (@graphkit.dsl.script()).")
    if len(fn.function_ir.inputs) != 1:
        raise ValueError(f"A custom penalty takes one weight tensor; {fn.name} takes more.")
    if weights is None:
        return Penalty(default=(0.0, 0.0), function=fn, name=fn.name)
    return Penalty({w: (0.0, 0.0) for w in weights}, function=fn, name=fn.name)


def get(name: str | Penalty | None, **kwargs: Any) -> Penalty:
    """The penalty registered as ``name``; None means no penalty."""
    if name is None:
        return no_penalty()
    if isinstance(name, Penalty):
        return name
    return PENALTIES.get(name, **kwargs)


def resolve(penalty: Any) -> Penalty:
    """The penalty a trainer's ``penalty`` (the seed's ``learning_penalty``) stands
    for: None (no penalty), a :class:`Penalty`, a registered name, or an object with
    ``to_penalty()`` (the seed's ``*LearningPenalty`` instances)."""
    if penalty is None or isinstance(penalty, (Penalty, str)):
        return get(penalty)
    if hasattr(penalty, "to_penalty"):
        return penalty.to_penalty()
    raise TypeError(
        f"learning_penalty must be None, a graphkit Penalty, a penalty name or a "
        f"*LearningPenalty object, not {type(penalty).__name__} {penalty!r}."
    )


__all__ = [
    "PENALTIES",
    "Penalty",
    "custom_penalty",
    "elastic",
    "from_spec",
    "get",
    "l1",
    "l2",
    "resolve",
]
