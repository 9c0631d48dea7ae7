"""Optimizers, optax-style: ``init`` declares the state, ``update`` is an onnxscript function.

For each weight, an optimizer's scripted ``update_fn`` maps::

    (param, grad, *state, lr, step) -> (new_param, *new_state)

``lr`` is a scalar of the weights' dtype, ``step`` an int64 scalar counting the updates
already applied (0 at the first update; Adam's bias correction uses t = step + 1).
State tensors have the weight's shape and are named ``"{param}.{optimizer}.{field}"``::

    opt = graphkit.optimizers.adam(b1=0.9, b2=0.999)
    state = opt.init({"coef": w})            # {"coef.adam.m": 0, "coef.adam.v": 0}
    params, state = opt.update({"coef": w}, {"coef": g}, state, lr=0.01, step=0)
    opt.update_model("coef", numpy.float32, w.shape)   # the ONNX graph doing it

Where frameworks disagree the choice is an argument, documented on each factory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import onnxscript

from graphkit._graph import Dim, compile_function, elem_type, float_dtype, splice
from graphkit._ort import Runner
from graphkit.compat import finalize
from graphkit.dsl import FLOAT, INT64, op, script
from graphkit.errors import ShapeError, UnknownNameError
from graphkit.registry import Registry


def _f64(value: float) -> np.ndarray:
    return np.array(value, dtype=np.float64)


@dataclass(eq=False)
class Optimizer:
    """A gradient transformation: named state and a scripted per-tensor update.

    Attributes:
        name: registered name, used in state tensor names.
        fields: names of the state tensors kept per weight, with their initial value.
        update_fn: ``(param, grad, *state, lr, step) -> (new_param, *new_state)``.
        params: the hyper-parameters it was built with.
    """

    name: str
    fields: tuple[tuple[str, float], ...]
    update_fn: onnxscript.OnnxFunction
    params: dict[str, Any] = field(default_factory=dict)
    _runners: dict[tuple[Any, ...], Runner] = field(default_factory=dict, repr=False)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"Optimizer({self.name!r}{', ' + args if args else ''})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as "rebuild from the registry" (scripted closures do not pickle)."""
        return (_rebuild, (self.name, self.params))

    def state_names(self, param: str) -> list[str]:
        """Names of the state tensors of weight ``param``, in ``update_fn`` order."""
        return [f"{param}.{self.name}.{f}" for f, _ in self.fields]

    def init(self, params: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The initial state: one tensor per weight and field, shaped like the weight."""
        state = {}
        for name, value in params.items():
            value = np.asarray(value)
            float_dtype(value.dtype)
            for state_name, (_, init) in zip(self.state_names(name), self.fields):
                state[state_name] = np.full_like(value, init)
        return state

    def update_model(self, param: str, dtype: object, shape: Sequence[Dim]) -> onnx.ModelProto:
        """The update of one weight as an ONNX model.

        Inputs ``param, grad, <state names>, lr, step``; outputs ``param.new``,
        ``<state name>.new``.
        """
        shape = tuple(shape)
        states = self.state_names(param)
        fn_inputs = [i.name for i in self.update_fn.function_ir.inputs]
        shapes: dict[str, tuple[Dim, ...]] = {n: shape for n in fn_inputs}
        shapes.update(lr=(), step=())
        outputs = ["param.new", *(f"{s}.new" for s in states)]
        shapes.update({o: shape for o in outputs})
        model = compile_function(self.update_fn, dtype, shapes, int64=["step"], outputs=outputs)
        # name the state inputs after the weight
        mapping = dict(zip(fn_inputs[2 : 2 + len(states)], states))
        for value in model.graph.input:
            value.name = mapping.get(value.name, value.name)
        for node in model.graph.node:
            node.input[:] = [mapping.get(n, n) for n in node.input]
        return model

    def update(
        self,
        params: Mapping[str, np.ndarray],
        grads: Mapping[str, np.ndarray],
        state: Mapping[str, np.ndarray],
        lr: float,
        step: int,
    ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """One update of every weight, computed by the compiled ONNX graphs.

        Returns:
            ``(new_params, new_state)``; the inputs are not modified.
        """
        missing = sorted(set(params) - set(grads))
        if missing:
            raise UnknownNameError(f"No gradient given for weights {missing}.")
        new_params, new_state = {}, {}
        for name, value in params.items():
            value = np.asarray(value)
            dtype = float_dtype(value.dtype)
            grad = np.asarray(grads[name], dtype=dtype)
            if grad.shape != value.shape:
                raise ShapeError(
                    f"Gradient of {name!r} has shape {grad.shape}, the weight {value.shape}."
                )
            names = self.state_names(name)
            absent = [n for n in names if n not in state]
            if absent:
                raise UnknownNameError(
                    f"State {absent} missing: build the state with {self.name}.init(params)."
                )
            key = (name, dtype, value.shape)
            if key not in self._runners:
                self._runners[key] = Runner(self.update_model(name, dtype, value.shape))
            feeds = {"param": value, "grad": grad, "lr": np.array(lr, dtype=dtype)}
            feeds["step"] = np.array(step, dtype=np.int64)
            feeds.update({n: np.asarray(state[n], dtype=dtype) for n in names})
            out = self._runners[key](feeds)
            new_params[name] = out[0]
            new_state.update(zip(names, out[1:]))
        return new_params, new_state


OPTIMIZERS: Registry[Optimizer] = Registry("optimizer")


def _rebuild(name: str, params: dict[str, Any]) -> Optimizer:
    return OPTIMIZERS.get(name, **params)


@OPTIMIZERS.register("sgd")
def sgd(weight_decay: float = 0.0) -> Optimizer:
    """p <- p - lr (g + weight_decay p)

    ``weight_decay`` is a coupled L2 term added to the gradient (as torch's SGD).
    """
    wd = _f64(weight_decay)

    @script()
    def sgd_update(param: FLOAT, grad: FLOAT, lr: FLOAT, step: INT64) -> tuple[FLOAT]:
        g = grad + op.CastLike(wd, param) * param
        return param - lr * g

    return Optimizer("sgd", (), sgd_update, {"weight_decay": weight_decay})


@OPTIMIZERS.register("momentum", "sgd_momentum")
def momentum(
    momentum: float = 0.9,
    nesterov: bool = False,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    convention: str = "torch",
) -> Optimizer:
    """SGD with momentum, heavy-ball or Nesterov.

    ``convention="torch"`` (torch.optim.SGD; the buffer starts at the first gradient)::

        b <- g                                  at step 0
        b <- momentum b + (1 - dampening) g     afterwards
        p <- p - lr (g + momentum b)            if nesterov, else p - lr b

    ``convention="sklearn"`` (scikit-learn's MLP and the seed library: the learning rate
    sits inside the velocity, which matters when it changes over time)::

        v <- momentum v - lr g
        p <- p + momentum v - lr g              if nesterov, else p + v

    ``weight_decay`` adds a coupled L2 term to g in both.
    """
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum must lie in [0, 1), got {momentum}.")
    if convention not in ("torch", "sklearn"):
        raise ValueError(f"convention must be 'torch' or 'sklearn', got {convention!r}.")
    mu, damp, wd = _f64(momentum), _f64(1.0 - dampening), _f64(weight_decay)
    params = dict(
        momentum=momentum,
        nesterov=nesterov,
        dampening=dampening,
        weight_decay=weight_decay,
        convention=convention,
    )

    if convention == "sklearn":
        if dampening:
            raise ValueError("dampening is a torch option; use convention='torch'.")

        @script()
        def momentum_sklearn_update(
            param: FLOAT, grad: FLOAT, velocity: FLOAT, lr: FLOAT, step: INT64
        ) -> tuple[FLOAT, FLOAT]:
            g = grad + op.CastLike(wd, param) * param
            v = op.CastLike(mu, param) * velocity - lr * g
            return param + v, v

        @script()
        def nesterov_sklearn_update(
            param: FLOAT, grad: FLOAT, velocity: FLOAT, lr: FLOAT, step: INT64
        ) -> tuple[FLOAT, FLOAT]:
            g = grad + op.CastLike(wd, param) * param
            m = op.CastLike(mu, param)
            v = m * velocity - lr * g
            return param + m * v - lr * g, v

        fn = nesterov_sklearn_update if nesterov else momentum_sklearn_update
        return Optimizer("momentum", (("velocity", 0.0),), fn, params)

    @script()
    def momentum_update(
        param: FLOAT, grad: FLOAT, buffer: FLOAT, lr: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT]:
        g = grad + op.CastLike(wd, param) * param
        b = op.Where(step == 0, g, op.CastLike(mu, param) * buffer + op.CastLike(damp, param) * g)
        return param - lr * b, b

    @script()
    def nesterov_update(
        param: FLOAT, grad: FLOAT, buffer: FLOAT, lr: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT]:
        g = grad + op.CastLike(wd, param) * param
        m = op.CastLike(mu, param)
        b = op.Where(step == 0, g, m * buffer + op.CastLike(damp, param) * g)
        return param - lr * (g + m * b), b

    fn = nesterov_update if nesterov else momentum_update
    return Optimizer("momentum", (("buffer", 0.0),), fn, params)


_momentum = momentum


@OPTIMIZERS.register("nesterov")
def nesterov(
    momentum: float = 0.9,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    convention: str = "torch",
) -> Optimizer:
    """SGD with Nesterov momentum: ``momentum(..., nesterov=True)``."""
    return _momentum(momentum, True, dampening, weight_decay, convention)


def _adam_update(
    b1: float, b2: float, eps: float, wd: float, decoupled: bool, eps_mode: str
) -> Any:
    beta1, beta2, e = _f64(b1), _f64(b2), _f64(eps)
    one_minus_b1, one_minus_b2 = _f64(1.0 - b1), _f64(1.0 - b2)
    coupled, decay = _f64(0.0 if decoupled else wd), _f64(wd if decoupled else 0.0)
    one = _f64(1.0)

    @script()
    def adam_moments(
        param: FLOAT, grad: FLOAT, m: FLOAT, v: FLOAT, lr: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT, FLOAT, FLOAT, FLOAT]:
        """p = param (1 - lr decay); m, v the new moments; c1, c2 = 1 - b1^t, 1 - b2^t"""
        p = param * (op.CastLike(one, param) - lr * op.CastLike(decay, param))
        g = grad + op.CastLike(coupled, param) * param
        m_new = op.CastLike(beta1, param) * m + op.CastLike(one_minus_b1, param) * g
        v_new = op.CastLike(beta2, param) * v + op.CastLike(one_minus_b2, param) * g * g
        t = op.CastLike(step + 1, param)
        c1 = op.CastLike(one, param) - op.Pow(op.CastLike(beta1, param), t)
        c2 = op.CastLike(one, param) - op.Pow(op.CastLike(beta2, param), t)
        return p, m_new, v_new, c1, c2

    if eps_mode == "corrected":

        @script()
        def adam_update(
            param: FLOAT, grad: FLOAT, m: FLOAT, v: FLOAT, lr: FLOAT, step: INT64
        ) -> tuple[FLOAT, FLOAT, FLOAT]:
            # p <- p - lr m_hat / (sqrt(v_hat) + eps), m_hat = m / c1, v_hat = v / c2
            p, m_new, v_new, c1, c2 = adam_moments(param, grad, m, v, lr, step)
            denom = op.Sqrt(v_new / c2) + op.CastLike(e, param)
            return p - lr * (m_new / c1) / denom, m_new, v_new

        return adam_update

    @script()
    def adam_update_uncorrected_eps(
        param: FLOAT, grad: FLOAT, m: FLOAT, v: FLOAT, lr: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT, FLOAT]:
        # lr_t = lr sqrt(c2) / c1; p <- p - lr_t m / (sqrt(v) + eps)
        p, m_new, v_new, c1, c2 = adam_moments(param, grad, m, v, lr, step)
        lr_t = lr * op.Sqrt(c2) / c1
        return p - lr_t * m_new / (op.Sqrt(v_new) + op.CastLike(e, param)), m_new, v_new

    return adam_update_uncorrected_eps


def _check_adam(b1: float, b2: float, eps: float, eps_mode: str) -> None:
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"b1 and b2 must lie in [0, 1), got {b1}, {b2}.")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}.")
    if eps_mode not in ("corrected", "uncorrected"):
        raise ValueError(f"eps_mode must be 'corrected' or 'uncorrected', got {eps_mode!r}.")


@OPTIMIZERS.register("adam")
def adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    eps_mode: str = "corrected",
) -> Optimizer:
    """Adam (Kingma & Ba): bias-corrected moments.

    m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  t = step + 1

    ``eps_mode="corrected"`` (torch, the paper): p <- p - lr m_hat / (sqrt(v_hat) + eps)
    with m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t).
    ``eps_mode="uncorrected"`` (scikit-learn, TensorFlow): p <- p - lr_t m / (sqrt(v) + eps)
    with lr_t = lr sqrt(1 - b2^t) / (1 - b1^t); eps then weighs more early on.

    ``weight_decay`` is coupled L2 (added to g, as torch's Adam); see :func:`adamw`.
    """
    _check_adam(b1, b2, eps, eps_mode)
    fn = _adam_update(b1, b2, eps, weight_decay, False, eps_mode)
    params = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, eps_mode=eps_mode)
    return Optimizer("adam", (("m", 0.0), ("v", 0.0)), fn, params)


@OPTIMIZERS.register("adamw")
def adamw(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    eps_mode: str = "corrected",
) -> Optimizer:
    """AdamW (Loshchilov & Hutter): Adam with decoupled weight decay.

    p <- p (1 - lr weight_decay) first, then the Adam step on the decayed weight, as
    torch.optim.AdamW does (optax applies the decay to the un-decayed weight in the same
    update; the two differ by a term of order lr^2).
    """
    _check_adam(b1, b2, eps, eps_mode)
    fn = _adam_update(b1, b2, eps, weight_decay, True, eps_mode)
    params = dict(b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, eps_mode=eps_mode)
    return Optimizer("adamw", (("m", 0.0), ("v", 0.0)), fn, params)


@OPTIMIZERS.register("adagrad")
def adagrad(
    eps: float = 1e-10,
    lr_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    weight_decay: float = 0.0,
) -> Optimizer:
    """Adagrad (torch.optim.Adagrad's form, eps outside the sqrt).

    s <- s + g^2;  p <- p - lr / (1 + step lr_decay) g / (sqrt(s) + eps)
    """
    if eps < 0 or lr_decay < 0 or initial_accumulator_value < 0:
        raise ValueError("eps, lr_decay and initial_accumulator_value must be >= 0.")
    e, decay, wd, one = _f64(eps), _f64(lr_decay), _f64(weight_decay), _f64(1.0)

    @script()
    def adagrad_update(
        param: FLOAT, grad: FLOAT, sum_sq: FLOAT, lr: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT]:
        g = grad + op.CastLike(wd, param) * param
        s = sum_sq + g * g
        clr = lr / (op.CastLike(one, param) + op.CastLike(step, param) * op.CastLike(decay, param))
        return param - clr * g / (op.Sqrt(s) + op.CastLike(e, param)), s

    params = dict(
        eps=eps,
        lr_decay=lr_decay,
        initial_accumulator_value=initial_accumulator_value,
        weight_decay=weight_decay,
    )
    return Optimizer("adagrad", (("sum_sq", initial_accumulator_value),), adagrad_update, params)


@OPTIMIZERS.register("rmsprop")
def rmsprop(alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0.0) -> Optimizer:
    """RMSprop (torch.optim.RMSprop's form, eps outside the sqrt, no momentum).

    v <- alpha v + (1 - alpha) g^2;  p <- p - lr g / (sqrt(v) + eps)
    """
    if not 0 <= alpha < 1:
        raise ValueError(f"alpha must lie in [0, 1), got {alpha}.")
    a, one_minus_a, e, wd = _f64(alpha), _f64(1.0 - alpha), _f64(eps), _f64(weight_decay)

    @script()
    def rmsprop_update(
        param: FLOAT, grad: FLOAT, square_avg: FLOAT, lr: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT]:
        g = grad + op.CastLike(wd, param) * param
        v = op.CastLike(a, param) * square_avg + op.CastLike(one_minus_a, param) * g * g
        return param - lr * g / (op.Sqrt(v) + op.CastLike(e, param)), v

    params = dict(alpha=alpha, eps=eps, weight_decay=weight_decay)
    return Optimizer("rmsprop", (("square_avg", 0.0),), rmsprop_update, params)


def get(name: str | Optimizer, **kwargs: Any) -> Optimizer:
    """The optimizer registered as ``name`` (``"nesterov"`` is momentum(nesterov=True))."""
    if isinstance(name, Optimizer):
        return name
    return OPTIMIZERS.get(name, **kwargs)


def scheduled_update_model(
    optimizer: Optimizer,
    schedule: Any,
    param: str,
    dtype: object,
    shape: Sequence[Dim],
) -> onnx.ModelProto:
    """One weight's update with the learning rate computed in the graph from ``step``.

    Inputs ``param, grad, <state names>, step``; outputs ``param.new, <state>.new``:
    ``lr = schedule(step)`` (float64, cast to the weight's dtype) feeds ``optimizer``.
    """
    update = optimizer.update_model(param, dtype, shape)
    lr_model = schedule.model()
    model = onnx.ModelProto()
    model.CopyFrom(update)
    lr_input = next(i for i in model.graph.input if i.name == "lr")
    model.graph.input.remove(lr_input)
    # "lr" stops being an input: the schedule's nodes, then a Cast, produce it
    rate = splice(model, lr_model, {"step": "step"}, prefix="schedule")["learning_rate"]
    model.graph.node.append(
        onnx.helper.make_node("Cast", [rate], ["lr"], to=elem_type(dtype), name="cast_lr")
    )
    # keep the nodes topologically sorted: schedule first, then the update
    schedule_nodes = list(model.graph.node)[len(update.graph.node) :]
    update_nodes = list(model.graph.node)[: len(update.graph.node)]
    del model.graph.node[:]
    model.graph.node.extend(schedule_nodes + update_nodes)
    return finalize(model)


__all__ = [
    "OPTIMIZERS",
    "Optimizer",
    "adagrad",
    "adam",
    "adamw",
    "get",
    "momentum",
    "nesterov",
    "rmsprop",
    "scheduled_update_model",
    "sgd",
]
