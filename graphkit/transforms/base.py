"""The framework of gradient transformations, optax-style, compiled to ONNX: the
protocol every transformation follows, the graph it writes into, and :class:`Scripted`,
a transformation written as one onnxscript function.

A gradient transformation turns the updates of every weight (the gradients, at the start
of a chain) into new updates, keeping its state in ONNX tensors::

    state = tx.init(params)                                  # {state name: array}
    updates, state = tx.update(grads, state, params, step)   # computed by ONNX graphs
    params = apply_updates(params, updates)                  # p + u

Transformations compose: ``chain(clip_by_global_norm(1.0), scale_by_adam(),
scale_by_learning_rate(schedule))`` is one transformation, and the training step
compiles the whole of it into the single graph it runs. ``step`` counts the updates
already applied (0 at the first one).

Writing one is writing an onnxscript function. A :class:`Scripted` transformation runs
its ``update_fn`` on each weight::

    (update, param, *state fields, step[, lr][, total]) -> (update, *state fields)

``lr`` is present when it uses the learning rate (``learning_rate=``); ``total`` when it
declares a ``statistic``, a scripted ``(update, param) -> scalar`` summed over all the
weights it sees (global norms). The state is declared as :class:`Field` s, named
``"{weight}.{transformation}.{field}"``; the signature is checked against it.

The learning rate is a transformation too (:func:`scale_by_learning_rate`): left *open*
(the default), the training runtime or :meth:`GradientTransformation.with_learning_rate`
fills it with a schedule, so one optimizer serves any schedule.
"""

from __future__ import annotations

import abc
import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import onnx
import onnxscript
from onnx import TensorProto, helper

from graphkit._graph import (
    compile_function,
    elem_type,
    fresh_name,
    graph_names,
    splice,
    value_info,
)
from graphkit.compat import DSL_OPSET, finalize
from graphkit.engine.ort_engine import Runner
from graphkit.errors import ShapeError, UnknownNameError

Tensors = dict[str, str]
"""Weight or state name -> the name of the tensor holding it in the graph being built."""

T = TypeVar("T", bound="GradientTransformation")


class _Open:
    """The learning rate of a transformation that the runtime fills with a schedule."""

    def __repr__(self) -> str:
        return "OPEN"

    def __reduce__(self) -> str:
        return "OPEN"


OPEN = _Open()


@dataclass(frozen=True)
class WeightInfo:
    """What a transformation knows of a weight while its graph is built."""

    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @classmethod
    def of(cls, value: np.ndarray) -> WeightInfo:
        value = np.asarray(value)
        if value.dtype not in (np.float32, np.float64):
            raise ShapeError(
                f"Weights are float32 or float64, got {value.dtype}; cast with .astype()."
            )
        return cls(value.dtype, tuple(value.shape))


@dataclass(frozen=True)
class Field:
    """A state tensor kept per weight: its name and its initial value.

    ``init`` is a number (a tensor shaped like the weight, filled with it) or a function
    of the weight's initial value returning an array of any shape (the weight itself for
    an average; a vector for factored moments).
    """

    name: str
    init: float | Callable[[np.ndarray], np.ndarray] = 0.0

    def initial(self, value: np.ndarray) -> np.ndarray:
        if callable(self.init):
            return np.array(self.init(value), dtype=value.dtype)
        return np.full_like(value, self.init)

    def shape(self, info: WeightInfo) -> tuple[int, ...]:
        return self.initial(np.zeros(info.shape, info.dtype)).shape


# -- the graph under construction --------------------------------------------------------


class Emitter:
    """The ONNX model a transformation writes its nodes into.

    Attributes:
        model: the model being built (nodes are appended).
        weights: every weight's dtype and shape.
        learning_rate: the float64 tensor an open learning rate reads, if any.
    """

    def __init__(
        self,
        model: onnx.ModelProto,
        weights: Mapping[str, WeightInfo],
        learning_rate: str | None = None,
    ) -> None:
        self.model = model
        self.weights = dict(weights)
        self.learning_rate = learning_rate
        self.taken = graph_names(model.graph)
        self._rates: dict[tuple[int, str, int], str] = {}

    def fresh(self, base: str) -> str:
        return fresh_name(base, self.taken)

    def node(self, op_type: str, inputs: Sequence[str], base: str, **attrs: Any) -> str:
        """Append one node with one output; return the output's name."""
        out = self.fresh(base)
        self.model.graph.node.append(
            helper.make_node(op_type, list(inputs), [out], name=self.fresh(f"{base}/node"), **attrs)
        )
        return out

    def constant(self, value: Any, dtype: npt.DTypeLike, base: str) -> str:
        name = self.fresh(base)
        tensor = onnx.numpy_helper.from_array(np.array(value, dtype=dtype), name)
        self.model.graph.initializer.append(tensor)
        return name

    def call(
        self,
        fn: onnxscript.OnnxFunction,
        dtype: np.dtype,
        inputs: Mapping[str, str],
        shapes: Mapping[str, tuple[int, ...]],
        outputs: Sequence[tuple[int, ...]],
        prefix: str,
    ) -> list[str]:
        """Splice ``fn`` compiled for ``dtype``; ``inputs`` wires its parameters by name.

        ``step`` is int64, every other input and output ``dtype``; ``outputs`` gives the
        shape of each output. Returns the names of the outputs in the host graph.
        """
        names = [f"out{i}" for i in range(len(outputs))]
        all_shapes = {**shapes, **dict(zip(names, outputs))}
        piece = compile_function(fn, dtype, all_shapes, int64=["step"], outputs=names)
        produced = splice(self.model, piece, inputs, prefix=prefix)
        return [produced[n] for n in names]

    def learning_rate_for(self, schedule: Any, step: str, dtype: np.dtype) -> str:
        """The learning rate at ``step`` as a scalar of ``dtype`` (computed once per
        schedule, step and dtype)."""
        key = (id(schedule), step, elem_type(dtype))
        if key in self._rates:
            return self._rates[key]
        if schedule is OPEN:
            if self.learning_rate is None:
                raise ValueError(
                    "This transformation has an open learning rate: give it one with "
                    ".with_learning_rate(schedule), or pass learning_rate= to update()."
                )
            rate = self.learning_rate
        else:
            rate = splice(self.model, schedule.model(), {"step": step}, prefix="schedule")[
                "learning_rate"
            ]
        self._rates[key] = self.node("Cast", [rate], "learning_rate", to=elem_type(dtype))
        return self._rates[key]


# -- the base class --------------------------------------------------------------------


class GradientTransformation(abc.ABC):
    """``init(params) -> state`` and ``update(updates, state, params, step)``.

    Subclasses implement :meth:`init` and :meth:`emit` (the update written as ONNX
    nodes); wrappers list their inner transformations in :meth:`children`.

    Attributes:
        name: a short name (the prefix of per-weight state names for scripted ones).
        params: the hyper-parameters it was built with.
    """

    name: str = "transformation"
    params: dict[str, Any]

    @abc.abstractmethod
    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The initial state, ``{state name: array}``."""

    @abc.abstractmethod
    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        """Write the update into ``g``; return the new updates and the new values of the
        state this transformation owns (``state`` maps every state name to its tensor)."""

    def children(self) -> tuple[GradientTransformation, ...]:
        return ()

    def _with_children(self: T, children: Sequence[GradientTransformation]) -> T:
        return self

    @property
    def elementwise(self) -> bool:
        """True when each entry of the new update and state depends only on the same
        entry of the update, weight and state, and on sums over every entry: the update
        of all weights can then run once on them laid end to end (the training step
        packs them so, see :func:`graphkit.training.step.build_update_step`). False unless
        a transformation says so (a per-weight norm, a factored moment, a partition by
        name are not)."""
        return all(c.elementwise for c in self.children()) if self.children() else False

    # -- learning rates ---------------------------------------------------------------

    def _walk(self) -> list[GradientTransformation]:
        return [self, *(t for c in self.children() for t in c._walk())]

    def schedules(self) -> list[Any]:
        """The learning rates inside (schedules, or ``OPEN``), in chain order."""
        return [lr for t in self._walk() if (lr := getattr(t, "learning_rate", None))]

    @property
    def has_open_learning_rate(self) -> bool:
        return any(s is OPEN for s in self.schedules())

    def with_learning_rate(self: T, learning_rate: Any) -> T:
        """A copy whose open learning rates read ``learning_rate`` (a schedule, its
        name, or a number for a constant rate)."""
        from graphkit import schedules

        schedule = schedules.get(learning_rate)
        if not self.has_open_learning_rate:
            raise ValueError(
                f"{self!r} has no open learning rate to fill (it has {self.schedules()})."
            )
        filled = self._filled(schedule)
        filled._recipe = self._recipe_filled(schedule)
        return filled

    def _filled(self: T, schedule: Any) -> T:
        children = [c._filled(schedule) for c in self.children()]
        out = _copy(self)
        if getattr(out, "learning_rate", None) is OPEN:
            out.learning_rate = schedule  # type: ignore[attr-defined]
        return out._with_children(children) if children else out

    def learning_rate_at(self, step: int) -> float | None:
        """The learning rate the update at ``step`` uses, when there is exactly one."""
        found = self._rates_at(step)
        return found[0] if len(found) == 1 else None

    def _rates_at(self, step: int) -> list[float]:
        own = getattr(self, "learning_rate", None)
        rates = [float(own(step))] if own is not None and own is not OPEN else []
        return rates + [r for c in self.children() for r in c._rates_at(step)]

    # -- numpy evaluation ---------------------------------------------------------------

    def model(
        self, weights: Mapping[str, np.ndarray | WeightInfo], learning_rate_input: bool = False
    ) -> onnx.ModelProto:
        """The update of ``weights`` as an ONNX model.

        Inputs ``<w>`` (each weight), ``<w>.update``, the state, ``step`` (int64) and,
        with ``learning_rate_input``, ``learning_rate`` (float64, for an open rate);
        outputs ``<w>.update.next`` and ``<state>.next`` for every state tensor.
        """
        infos = {
            w: v if isinstance(v, WeightInfo) else WeightInfo.of(v) for w, v in weights.items()
        }
        initial = self.init({w: np.zeros(i.shape, i.dtype) for w, i in infos.items()})
        inputs = [value_info(w, elem_type(i.dtype), i.shape) for w, i in infos.items()]
        inputs += [value_info(f"{w}.update", elem_type(i.dtype), i.shape) for w, i in infos.items()]
        inputs += [_state_info(s, v) for s, v in initial.items()]
        inputs.append(value_info("step", TensorProto.INT64, []))
        if learning_rate_input:
            inputs.append(value_info("learning_rate", TensorProto.DOUBLE, []))
        graph = helper.make_graph([], self.name, inputs, [])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", DSL_OPSET)])
        g = Emitter(model, infos, "learning_rate" if learning_rate_input else None)
        updates, state = emit_all(
            self, g, {w: f"{w}.update" for w in infos}, {s: s for s in initial}, "step"
        )
        outputs = []
        for w, info in infos.items():
            outputs.append(value_info(f"{w}.update.next", elem_type(info.dtype), info.shape))
            model.graph.node.append(helper.make_node("Identity", [updates[w]], [outputs[-1].name]))
        for s, value in initial.items():
            outputs.append(_state_info(f"{s}.next", value))
            model.graph.node.append(helper.make_node("Identity", [state[s]], [outputs[-1].name]))
        model.graph.output.extend(outputs)
        model.doc_string = f"graphkit gradient transformation {self!r}"
        return finalize(model, full_check=True)

    def update(
        self,
        updates: Mapping[str, np.ndarray],
        state: Mapping[str, np.ndarray],
        params: Mapping[str, np.ndarray],
        step: int = 0,
        learning_rate: float | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """One update on numpy arrays, computed by the compiled graph (built once per
        weight names, dtypes and shapes). ``learning_rate`` fills an open rate.

        Returns:
            ``(updates, state)``; the inputs are not modified.
        """
        missing = sorted(set(params) - set(updates))
        if missing:
            raise UnknownNameError(f"No gradient given for weights {missing}.")
        params = {w: np.asarray(v) for w, v in params.items()}
        infos = {w: WeightInfo.of(v) for w, v in params.items()}
        feeds: dict[str, np.ndarray] = dict(params)
        for w, info in infos.items():
            u = np.asarray(updates[w], dtype=info.dtype)
            if u.shape != info.shape:
                raise ShapeError(f"Gradient of {w!r} has shape {u.shape}, the weight {info.shape}.")
            feeds[f"{w}.update"] = u
        open_rate = self.has_open_learning_rate
        if open_rate and learning_rate is None:
            raise ValueError(f"{self!r} has an open learning rate: pass learning_rate=.")
        key = (tuple(infos.items()), open_rate)
        if key not in _compiled(self):
            initial = self.init({w: np.zeros(i.shape, i.dtype) for w, i in infos.items()})
            dtypes = {n: v.dtype for n, v in initial.items()}
            _compiled(self)[key] = (Runner(self.model(infos, open_rate)), dtypes)
        runner, state_dtypes = _compiled(self)[key]
        absent = [n for n in state_dtypes if n not in state]
        if absent:
            raise UnknownNameError(
                f"State {absent} missing: build the state with {self.name}.init(params)."
            )
        feeds.update({n: np.asarray(state[n], dtype=t) for n, t in state_dtypes.items()})
        feeds["step"] = np.array(step, dtype=np.int64)
        if open_rate:
            feeds["learning_rate"] = np.array(learning_rate, dtype=np.float64)
        out = dict(zip(runner.output_names, runner(feeds)))
        new_updates = {w: out[f"{w}.update.next"] for w in infos}
        return new_updates, {n: out[f"{n}.next"] for n in state_dtypes}

    # -- identity -------------------------------------------------------------------------

    _recipe: tuple[Any, ...] | None = None

    def _recipe_filled(self, schedule: Any) -> tuple[Any, ...] | None:
        return None if self._recipe is None else (*self._recipe[:3], schedule)

    def __copy__(self: T) -> T:
        out = object.__new__(type(self))
        out.__dict__.update(self.__dict__)
        return out

    def __deepcopy__(self: T, memo: dict[int, Any]) -> T:
        return self  # immutable: methods return new transformations, never modify one

    def __reduce__(self) -> Any:
        """Pickle as "call the factory again" (scripted closures do not pickle)."""
        if self._recipe is None:
            raise TypeError(
                f"{self!r} was not built by a graphkit factory and cannot be pickled; "
                "wrap the function that builds it with graphkit.transforms.factory."
            )
        return (_rebuild, self._recipe)

    def __repr__(self) -> str:
        params = dict(getattr(self, "params", {}))
        rates = [r for r in self._learning_rates() if r is not OPEN]
        if "learning_rate" not in params and len(rates) == 1 and self.children():
            # a named optimizer shows the rate it was given: adam(1e-3) is not adam()
            params = {"learning_rate": rates[0], **params}
        args = ", ".join(f"{k}={v!r}" for k, v in params.items())
        return f"{self.name}({args})"

    def _learning_rates(self) -> list[Any]:
        """The learning rates (schedules, or OPEN) of this transformation and its parts."""
        own = getattr(self, "learning_rate", None)
        return ([own] if own is not None else []) + [
            r for c in self.children() for r in c._learning_rates()
        ]


def _rebuild(factory: Callable[..., Any], args: tuple, kwargs: dict, schedule: Any = None) -> Any:
    tx = factory(*args, **kwargs)
    return tx if schedule is None else tx.with_learning_rate(schedule)


F = TypeVar("F", bound=Callable[..., GradientTransformation])


def factory(fn: F) -> F:
    """Decorate a function building a transformation so that what it builds pickles
    (as a call to the function) and prints as ``name(hyper-parameters)``."""

    @functools.wraps(fn)
    def build(*args: Any, **kwargs: Any) -> GradientTransformation:
        tx = fn(*args, **kwargs)
        tx._recipe = (build, args, kwargs, None)
        return tx

    return build  # type: ignore[return-value]


def _copy(tx: T) -> T:
    """A shallow copy without the compiled runners of the original."""
    out = copy.copy(tx)
    out.__dict__.pop("_runner_cache", None)
    return out


def _compiled(tx: GradientTransformation) -> dict[Any, tuple[Runner, dict[str, np.dtype]]]:
    """The sessions ``tx.update`` built, by weights and open learning rate."""
    return tx.__dict__.setdefault("_runner_cache", {})


def _state_info(name: str, value: np.ndarray) -> onnx.ValueInfoProto:
    return value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)


def emit_all(
    tx: GradientTransformation, g: Emitter, updates: Tensors, state: Tensors, step: str
) -> tuple[Tensors, Tensors]:
    """Emit ``tx`` on every weight of ``g``; the returned state covers all of ``state``
    (tensors a transformation does not update keep their value)."""
    params = {w: w for w in g.weights}
    new_updates, owned = tx.emit(g, updates, state, params, step)
    return new_updates, {**state, **owned}


def apply_updates(
    params: Mapping[str, np.ndarray], updates: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``p + u`` for every weight (the training step does the same in its graph)."""
    return {
        w: np.asarray(p) + np.asarray(updates[w], dtype=np.asarray(p).dtype)
        for w, p in params.items()
    }


# -- scripted transformations ------------------------------------------------------------


class Scripted(GradientTransformation):
    """A transformation whose update is one onnxscript function applied to each weight.

    Args:
        name: the prefix of its state names.
        update_fn: ``(update, param, *fields, step[, lr][, total]) -> (update, *fields)``.
        fields: the state it keeps per weight, in ``update_fn`` order.
        learning_rate: ``None`` when it does not use one, else a schedule or ``OPEN``.
        statistic: ``(update, param) -> scalar``, summed over the weights into ``total``.
        params: the hyper-parameters, for display.
        elementwise: declare that ``update_fn`` works entry by entry (and ``statistic``
            sums entries), so that it may run on all weights laid end to end; the
            default, False, is always safe.
    """

    def __init__(
        self,
        name: str,
        update_fn: onnxscript.OnnxFunction,
        fields: Sequence[Field] = (),
        *,
        learning_rate: Any = None,
        statistic: onnxscript.OnnxFunction | None = None,
        params: Mapping[str, Any] | None = None,
        elementwise: bool = False,
    ) -> None:
        self.name = name
        self._elementwise = bool(elementwise)
        self.update_fn = update_fn
        self.fields = tuple(Field(f) if isinstance(f, str) else f for f in fields)
        self.learning_rate = learning_rate
        self.statistic = statistic
        self.params = dict(params or {})
        self._check_signature()

    def _check_signature(self) -> None:
        if not isinstance(self.update_fn, onnxscript.OnnxFunction):
            raise TypeError(
                f"{self.name}: update_fn must be an onnxscript function (decorate it with "
                f"graphkit.dsl.script()), not {type(self.update_fn).__name__}."
            )
        inputs = [i.name for i in self.update_fn.function_ir.inputs]
        fields = [f.name for f in self.fields]
        tail = ["step"]
        tail += ["lr"] if self.learning_rate is not None else []
        tail += ["total"] if self.statistic is not None else []
        expected = ["update", "param", *fields, *tail]
        if len(inputs) != len(expected) or inputs[2:] != expected[2:]:
            raise TypeError(
                f"Transformation {self.name!r}: {self.update_fn.name}"
                f"({', '.join(map(str, inputs))}) does not match its declared state {fields}: "
                f"it must take ({', '.join(expected)}) and return "
                f"(update, {', '.join(fields) or '-'})."
            )
        n_out = len(self.update_fn.function_ir.outputs)
        if n_out != 1 + len(fields):
            raise TypeError(
                f"Transformation {self.name!r}: {self.update_fn.name} returns {n_out} "
                f"value(s); with state {fields} it must return {1 + len(fields)} "
                f"(the update, then {', '.join(fields) or 'nothing else'})."
            )
        if self.statistic is not None:
            stat = self.statistic.function_ir
            if len(stat.inputs) != 2 or len(stat.outputs) != 1:
                raise TypeError(
                    f"Transformation {self.name!r}: its statistic must be "
                    "(update, param) -> scalar."
                )

    @property
    def elementwise(self) -> bool:
        return self._elementwise

    def renamed(self, name: str) -> Scripted:
        """A copy whose state is named after ``name`` (two of one kind in a chain)."""
        out = _copy(self)
        out.name = name
        return out

    def state_name(self, weight: str, field: str) -> str:
        return f"{weight}.{self.name}.{field}"

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = {}
        for w, value in params.items():
            value = np.asarray(value)
            WeightInfo.of(value)
            for f in self.fields:
                state[self.state_name(w, f.name)] = f.initial(value)
        return state

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        totals: dict[int, str] = {}
        if self.statistic is not None:
            parts = []
            for w in updates:
                info = g.weights[w]
                (stat,) = g.call(
                    self.statistic,
                    info.dtype,
                    {"update": updates[w], "param": params[w]},
                    {"update": info.shape, "param": info.shape},
                    [()],
                    prefix=f"{self.name}/{w}/statistic",
                )
                parts.append(
                    g.node("Cast", [stat], f"{self.name}/statistic", to=TensorProto.DOUBLE)
                )
            total = g.node("Sum", parts, f"{self.name}/total")
            for w in updates:
                elem = elem_type(g.weights[w].dtype)
                if elem not in totals:
                    totals[elem] = g.node("Cast", [total], f"{self.name}/total", to=elem)
        new_updates: dict[str, str] = {}
        new_state: dict[str, str] = {}
        for w in updates:
            info = g.weights[w]
            names = [self.state_name(w, f.name) for f in self.fields]
            shapes = [f.shape(info) for f in self.fields]
            wiring = {"update": updates[w], "param": params[w], "step": step}
            sizes: dict[str, tuple[int, ...]] = {"update": info.shape, "param": info.shape}
            sizes["step"] = ()
            for f, s, shape in zip(self.fields, names, shapes):
                wiring[f.name], sizes[f.name] = state[s], shape
            if self.learning_rate is not None:
                wiring["lr"] = g.learning_rate_for(self.learning_rate, step, info.dtype)
                sizes["lr"] = ()
            if self.statistic is not None:
                wiring["total"], sizes["total"] = totals[elem_type(info.dtype)], ()
            out = g.call(
                self.update_fn, info.dtype, wiring, sizes, [info.shape, *shapes], f"{self.name}/{w}"
            )
            new_updates[w] = out[0]
            new_state.update(zip(names, out[1:]))
        return new_updates, new_state


__all__ = [
    "OPEN",
    "Emitter",
    "Field",
    "GradientTransformation",
    "Scripted",
    "Tensors",
    "WeightInfo",
    "apply_updates",
    "emit_all",
    "factory",
]
