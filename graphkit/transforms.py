"""Gradient transformations, optax-style, compiled to ONNX.

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
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, no_type_check

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
from graphkit.dsl import FLOAT, INT64, f64, op, script
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


# -- composition ----------------------------------------------------------------------


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


# -- wrappers ---------------------------------------------------------------------------


class _Wrapper(GradientTransformation):
    inner: GradientTransformation

    def children(self) -> tuple[GradientTransformation, ...]:
        return (self.inner,)

    def _with_children(self: T, children: Sequence[GradientTransformation]) -> T:
        out = _copy(self)
        out.inner = children[0]  # type: ignore[attr-defined]
        return out

    def _rates_at(self, step: int) -> list[float]:
        return self.inner._rates_at(self._inner_step(step))

    def _inner_step(self, step: int) -> int:
        return step


def _where_all(g: Emitter, cond: str, new: Tensors, old: Tensors, base: str) -> Tensors:
    return {k: g.node("Where", [cond, new[k], old[k]], f"{base}/{k}") for k in new}


def _zero_like(g: Emitter, w: str, base: str) -> str:
    return g.constant(0.0, g.weights[w].dtype, f"{base}/zero")


class MultiSteps(_Wrapper):
    """Accumulate k mini-batches of updates; apply ``inner`` to their mean every k-th
    step (optax's MultiSteps). In between, the updates are 0 and ``inner``'s state
    does not move; ``inner`` sees step // k, the number of updates it has applied.

    acc <- acc + u;  every k-th step: u' = inner(acc / k), acc <- 0;  else u' = 0
    """

    name = "multi_steps"

    def __init__(self, inner: GradientTransformation, every_k: int) -> None:
        if isinstance(every_k, bool) or not isinstance(every_k, (int, np.integer)) or every_k < 1:
            raise ValueError(f"every_k must be an integer >= 1, got {every_k!r}.")
        self.inner, self.every_k = inner, int(every_k)
        self.params = {"every_k": self.every_k}

    def _inner_step(self, step: int) -> int:
        return step // self.every_k

    def acc_name(self, w: str) -> str:
        return f"{w}.{self.name}.acc"

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = {self.acc_name(w): np.zeros_like(np.asarray(v)) for w, v in params.items()}
        return {**state, **self.inner.init(params)}

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        k = g.constant(self.every_k, np.int64, "multi_steps/k")
        last = g.constant(self.every_k - 1, np.int64, "multi_steps/last")
        phase = g.node("Mod", [step, k], "multi_steps/phase")
        apply = g.node("Equal", [phase, last], "multi_steps/apply")
        inner_step = g.node("Div", [step, k], "multi_steps/inner_step")
        acc, mean = {}, {}
        for w in updates:
            acc[w] = g.node("Add", [state[self.acc_name(w)], updates[w]], f"multi_steps/{w}/acc")
            k_w = g.constant(self.every_k, g.weights[w].dtype, f"multi_steps/{w}/k")
            mean[w] = g.node("Div", [acc[w], k_w], f"multi_steps/{w}/mean")
        inner_updates, inner_state = self.inner.emit(g, mean, state, params, inner_step)
        zeros = {w: _zero_like(g, w, f"multi_steps/{w}") for w in updates}
        new_updates = _where_all(g, apply, inner_updates, zeros, "multi_steps/update")
        owned = _where_all(g, apply, inner_state, state, "multi_steps/state")
        for w in updates:
            owned[self.acc_name(w)] = g.node("Where", [apply, zeros[w], acc[w]], f"{w}/acc")
        return new_updates, owned


@factory
def multi_steps(inner: GradientTransformation, every_k: int) -> MultiSteps:
    """Gradient accumulation: ``inner`` on the mean update of every ``every_k`` steps."""
    return MultiSteps(inner, every_k)


class ApplyIfFinite(_Wrapper):
    """Skip a step whose updates are not all finite: the updates are 0, ``inner``'s state
    stays as it was, and ``"{name}.skipped"`` (int64) counts it. ``inner`` sees
    step - skipped, the number of updates it has applied.
    """

    name = "apply_if_finite"

    def __init__(self, inner: GradientTransformation) -> None:
        self.inner = inner
        self.params = {}

    @property
    def counter(self) -> str:
        return f"{self.name}.skipped"

    def _inner_step(self, step: int) -> int:
        return step  # the count of skipped steps lives in the state

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {self.counter: np.array(0, dtype=np.int64), **self.inner.init(params)}

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        # u * 0 is NaN exactly where u is NaN or infinite: one sum tells them all
        zeros = {w: _zero_like(g, w, f"apply_if_finite/{w}") for w in updates}
        parts = []
        for w in updates:
            probe = g.node("Mul", [updates[w], zeros[w]], f"apply_if_finite/{w}/probe")
            total = g.node("ReduceSum", [probe], f"apply_if_finite/{w}/sum", keepdims=0)
            parts.append(g.node("Cast", [total], "apply_if_finite/sum", to=TensorProto.DOUBLE))
        bad = g.node(
            "IsNaN", [g.node("Sum", parts, "apply_if_finite/total")], "apply_if_finite/bad"
        )
        finite = g.node("Not", [bad], "apply_if_finite/finite")
        skipped = state[self.counter]
        inner_step = g.node("Sub", [step, skipped], "apply_if_finite/inner_step")
        inner_updates, inner_state = self.inner.emit(g, updates, state, params, inner_step)
        new_updates = _where_all(g, finite, inner_updates, zeros, "apply_if_finite/update")
        owned = _where_all(g, finite, inner_state, state, "apply_if_finite/state")
        count = g.node("Cast", [bad], "apply_if_finite/bad_int", to=TensorProto.INT64)
        owned[self.counter] = g.node("Add", [skipped, count], "apply_if_finite/skipped")
        return new_updates, owned


@factory
def apply_if_finite(inner: GradientTransformation) -> ApplyIfFinite:
    """``inner``, except on steps whose updates hold a NaN or an infinity: those leave the
    weights and ``inner``'s state unchanged and are counted."""
    return ApplyIfFinite(inner)


class Lookahead(_Wrapper):
    """Lookahead (Zhang et al. 2019): ``inner`` moves fast weights; every k-th step the
    slow weights move a fraction ``alpha`` towards them and the fast weights restart
    from there::

        fast = p + inner(u)
        every k-th step: slow <- slow + alpha (fast - slow); p <- slow
    """

    name = "lookahead"

    def __init__(self, inner: GradientTransformation, sync_period: int, alpha: float) -> None:
        if isinstance(sync_period, bool) or int(sync_period) != sync_period or sync_period < 1:
            raise ValueError(f"sync_period must be an integer >= 1, got {sync_period!r}.")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must lie in (0, 1], got {alpha}.")
        self.inner, self.sync_period, self.alpha = inner, int(sync_period), float(alpha)
        self.params = {"sync_period": self.sync_period, "alpha": self.alpha}

    def slow_name(self, w: str) -> str:
        return f"{w}.{self.name}.slow"

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        state = {self.slow_name(w): np.array(v) for w, v in params.items()}
        return {**state, **self.inner.init(params)}

    def emit(
        self, g: Emitter, updates: Tensors, state: Tensors, params: Tensors, step: str
    ) -> tuple[Tensors, Tensors]:
        inner_updates, owned = self.inner.emit(g, updates, state, params, step)
        one = g.constant(1, np.int64, "lookahead/one")
        k = g.constant(self.sync_period, np.int64, "lookahead/k")
        done = g.node("Add", [step, one], "lookahead/done")
        sync = g.node(
            "Equal",
            [g.node("Mod", [done, k], "lookahead/phase"), g.constant(0, np.int64, "lookahead/0")],
            "lookahead/sync",
        )
        owned = dict(owned)
        new_updates = {}
        for w in updates:
            (new_update, slow) = g.call(
                _lookahead_sync,
                g.weights[w].dtype,
                {
                    "param": params[w],
                    "update": inner_updates[w],
                    "slow": state[self.slow_name(w)],
                    "alpha": g.constant(self.alpha, g.weights[w].dtype, "lookahead/alpha"),
                },
                {
                    "param": g.weights[w].shape,
                    "update": g.weights[w].shape,
                    "slow": g.weights[w].shape,
                    "alpha": (),
                },
                [g.weights[w].shape, g.weights[w].shape],
                prefix=f"lookahead/{w}",
            )
            new_updates[w] = g.node("Where", [sync, new_update, inner_updates[w]], f"lookahead/{w}")
            owned[self.slow_name(w)] = g.node(
                "Where", [sync, slow, state[self.slow_name(w)]], f"lookahead/{w}/slow"
            )
        return new_updates, owned


@script()
@no_type_check
def _lookahead_sync(param: FLOAT, update: FLOAT, slow: FLOAT, alpha: FLOAT) -> tuple[FLOAT, FLOAT]:
    """slow' = slow + alpha (p + u - slow); the update that lands p on slow'"""
    synced = slow + alpha * (param + update - slow)
    return synced - param, synced


@factory
def lookahead(inner: GradientTransformation, sync_period: int = 6, alpha: float = 0.5) -> Lookahead:
    """Lookahead around ``inner``: slow weights synchronised every ``sync_period`` steps."""
    return Lookahead(inner, sync_period, alpha)


# -- elementary transformations -------------------------------------------------------------


def check_learning_rate(learning_rate: Any) -> Any:
    """``OPEN``, or a schedule resolved from a schedule, a name or a number."""
    if learning_rate is OPEN or learning_rate is None:
        return OPEN
    from graphkit import schedules

    return schedules.get(learning_rate)


@factory
def scale_by_learning_rate(learning_rate: Any = None) -> Scripted:
    """u -> -lr u, with lr = schedule(step); left open (None) the runtime fills it."""

    @script()
    @no_type_check
    def scale_by_learning_rate(update: FLOAT, param: FLOAT, step: INT64, lr: FLOAT) -> FLOAT:
        return update * op.Neg(lr)

    return Scripted(
        "learning_rate",
        scale_by_learning_rate,
        learning_rate=check_learning_rate(learning_rate),
        elementwise=True,
    )


@factory
def scale(factor: float) -> Scripted:
    """u -> factor u"""
    f = f64(factor)

    @script()
    @no_type_check
    def scale_update(update: FLOAT, param: FLOAT, step: INT64) -> FLOAT:
        return update * op.CastLike(f, update)

    return Scripted("scale", scale_update, params={"factor": factor}, elementwise=True)


@factory
def add_decayed_weights(weight_decay: float) -> Scripted:
    """u -> u + weight_decay p

    Its place in a chain decides the kind of decay: before a rescaling (Adam's moments)
    it is coupled L2 (torch's ``Adam(weight_decay=)``); after it, right before the
    learning rate, it is decoupled (AdamW: p <- p - lr (adam(u) + weight_decay p)).
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
    wd = f64(weight_decay)

    @script()
    @no_type_check
    def add_decayed_weights(update: FLOAT, param: FLOAT, step: INT64) -> FLOAT:
        return update + op.CastLike(wd, param) * param

    return Scripted(
        "weight_decay",
        add_decayed_weights,
        params={"weight_decay": weight_decay},
        elementwise=True,
    )


@factory
def clip(max_delta: float) -> Scripted:
    """u -> min(max(u, -max_delta), max_delta), element by element"""
    if not max_delta > 0:
        raise ValueError(f"max_delta must be > 0, got {max_delta}.")
    d = f64(max_delta)

    @script()
    @no_type_check
    def clip_update(update: FLOAT, param: FLOAT, step: INT64) -> FLOAT:
        bound = op.CastLike(d, update)
        return op.Clip(update, op.Neg(bound), bound)

    return Scripted("clip", clip_update, params={"max_delta": max_delta}, elementwise=True)


@script()
@no_type_check
def _sum_of_squares(update: FLOAT, param: FLOAT) -> FLOAT:
    return op.ReduceSumSquare(update, keepdims=0)


@factory
def clip_by_global_norm(max_norm: float) -> Scripted:
    """u -> u min(1, max_norm / ||u||), ||u|| the norm of all the weights' updates
    together (optax's clip_by_global_norm)."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}.")
    m = f64(max_norm)

    @script()
    @no_type_check
    def clip_by_global_norm(update: FLOAT, param: FLOAT, step: INT64, total: FLOAT) -> FLOAT:
        norm = op.Sqrt(total)
        limit = op.CastLike(m, update)
        return op.Where(norm < limit, update, update * (limit / norm))

    return Scripted(
        "clip_by_global_norm",
        clip_by_global_norm,
        statistic=_sum_of_squares,
        params={"max_norm": max_norm},
        elementwise=True,
    )


@factory
def adaptive_clip(clipping: float = 0.01, eps: float = 1e-3) -> Partition:
    """Adaptive gradient clipping (Brock et al. 2021), unit by unit::

        u -> u                                   where ||u||_unit < c max(||p||_unit, eps)
        u -> u c max(||p||_unit, eps) / ||u||_unit  elsewhere

    A unit is the whole tensor for vectors and scalars, a column for matrices (the
    ``(in, out)`` layout of MatMul weights), and an output channel (axis 0) for
    convolution kernels of rank 3 and more.
    """
    if not clipping > 0:
        raise ValueError(f"clipping must be > 0, got {clipping}.")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps}.")
    c, e, tiny = f64(clipping), f64(eps), f64(1e-6)

    @script()
    @no_type_check
    def whole_norm(x: FLOAT) -> FLOAT:
        return op.Expand(op.Sqrt(op.ReduceSumSquare(x, keepdims=1)), op.Shape(x))

    def build(axes: list[int] | None) -> Scripted:
        dims = np.array(axes or [0], dtype=np.int64)

        @script()
        @no_type_check
        def axes_norm(x: FLOAT) -> FLOAT:
            return op.Expand(op.Sqrt(op.ReduceSumSquare(x, dims, keepdims=1)), op.Shape(x))

        unit_norm = whole_norm if axes is None else axes_norm

        @script()
        @no_type_check
        def adaptive_clip_update(update: FLOAT, param: FLOAT, step: INT64) -> FLOAT:
            g_norm = unit_norm(update)
            limit = op.Max(unit_norm(param), op.CastLike(e, param)) * op.CastLike(c, param)
            clipped = update * (limit / op.Max(g_norm, op.CastLike(tiny, param)))
            return op.Where(g_norm < limit, update, clipped)

        return Scripted("adaptive_clip", adaptive_clip_update)

    def unit(name: str, info: WeightInfo) -> str:
        return str(info.ndim) if info.ndim >= 2 else "whole"

    groups = {"whole": build(None), "2": build([0])}
    groups.update({str(rank): build(list(range(1, rank))) for rank in range(3, 7)})
    out = Partition(groups, unit)
    out.name = "adaptive_clip"
    out.params = {"clipping": clipping, "eps": eps}
    return out


@factory
def ema(decay: float = 0.999) -> Scripted:
    """An exponential moving average of the weights, kept in the state (put it last).

    avg <- p + u at the first update, then decay avg + (1 - decay) (p + u): torch's
    ``AveragedModel(multi_avg_fn=get_ema_multi_avg_fn(decay))`` updated after each step.
    The updates pass unchanged; :func:`ema_weights` reads the average.
    """
    if not 0 <= decay < 1:
        raise ValueError(f"decay must lie in [0, 1), got {decay}.")
    d = f64(decay)

    @script()
    @no_type_check
    def ema_update(update: FLOAT, param: FLOAT, average: FLOAT, step: INT64) -> tuple[FLOAT, FLOAT]:
        new = param + update
        mixed = (
            op.CastLike(d, param) * average
            + (op.CastLike(1.0, param) - op.CastLike(d, param)) * new
        )
        return update, op.Where(step == op.CastLike(0, step), new, mixed)

    return Scripted(
        "ema",
        ema_update,
        (Field("average", np.copy),),
        params={"decay": decay},
        elementwise=True,
    )


def ema_weights(state: Mapping[str, np.ndarray], name: str = "ema") -> dict[str, np.ndarray]:
    """``{weight: its moving average}`` from a state holding an :func:`ema`."""
    suffix = f".{name}.average"
    found = {k.removesuffix(suffix): v for k, v in state.items() if k.endswith(suffix)}
    if not found:
        raise UnknownNameError(
            f"The state holds no {name!r} average: add graphkit.transforms.ema() at the end "
            "of the optimizer's chain."
        )
    return found


__all__ = [
    "OPEN",
    "ApplyIfFinite",
    "Chain",
    "Emitter",
    "Field",
    "GradientTransformation",
    "Lookahead",
    "MultiSteps",
    "Partition",
    "Scripted",
    "WeightInfo",
    "adaptive_clip",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "clip",
    "clip_by_global_norm",
    "ema",
    "ema_weights",
    "emit_all",
    "factory",
    "freeze",
    "identity",
    "lookahead",
    "masked",
    "multi_steps",
    "partition",
    "scale",
    "scale_by_learning_rate",
    "set_to_zero",
]
