"""Optimizers: named chains of gradient transformations (:mod:`graphkit.transforms`).

Each optimizer is a few lines: the ``scale_by_*`` transformation that holds its rule
(:mod:`graphkit.transforms.rules`), coupled or decoupled weight decay where it has one,
and the learning rate::

    adam = chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(lr))
    adamw = chain(scale_by_adam(...), add_decayed_weights(wd), scale_by_learning_rate(lr))

``learning_rate`` is a schedule, its name or a number; left ``None`` it stays *open* and
the trainers (or :meth:`~graphkit.transforms.GradientTransformation.with_learning_rate`)
fill it. Every optimizer takes ``learning_rate`` first and its other hyper-parameters by
keyword only, in optax's and torch's order: ``adam(1e-3)`` is Adam at rate 0.001, and
``adam(1e-3, 0.9)`` is a TypeError, never a silent ``b1``. Per-weight state is named
``"{weight}.{rule}.{field}"`` (``"coef.adam.m"``)::

    opt = graphkit.optimizers.adam()
    state = opt.init({"coef": w})
    updates, state = opt.update({"coef": g}, state, {"coef": w}, step=0, learning_rate=0.01)
    w = apply_updates({"coef": w}, updates)["coef"]

Where frameworks disagree the choice is an argument, documented on each factory; each
optimizer is checked against torch.optim where torch has it, else against numpy written
from the paper.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import onnx

from graphkit.registry import Registry
from graphkit.transforms import (
    OPEN,
    Chain,
    GradientTransformation,
    WeightInfo,
    add_decayed_weights,
    apply_updates,
    factory,
    scale_by_adadelta,
    scale_by_adafactor,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_learning_rate,
    scale_by_lion,
    scale_by_radam,
    scale_by_rms,
    scale_by_trust_ratio,
    trace,
)

OPTIMIZERS: Registry[GradientTransformation] = Registry("optimizer")


def _named(name: str, parts: list[GradientTransformation | None], **params: Any) -> Chain:
    return Chain(*(p for p in parts if p is not None), name=name, params=params)


def _decay(weight_decay: float) -> GradientTransformation | None:
    return add_decayed_weights(weight_decay) if weight_decay else None


def _coupled(
    name: str, rule: GradientTransformation, weight_decay: float, learning_rate: Any, **params: Any
) -> Chain:
    """L2 added to the gradient, then the rule, then the rate (torch's ``weight_decay``)."""
    parts = [_decay(weight_decay), rule, scale_by_learning_rate(learning_rate)]
    return _named(name, parts, **params, weight_decay=weight_decay)


def _decoupled(
    name: str, rule: GradientTransformation, weight_decay: float, learning_rate: Any, **params: Any
) -> Chain:
    """The rule, then the decay, then the rate: p <- p - lr (rule(g) + weight_decay p)."""
    parts = [rule, _decay(weight_decay), scale_by_learning_rate(learning_rate)]
    return _named(name, parts, **params, weight_decay=weight_decay)


# -- optimizers -----------------------------------------------------------------------------


@OPTIMIZERS.register("sgd")
@factory
def sgd(learning_rate: Any = None, *, weight_decay: float = 0.0) -> Chain:
    """p <- p - lr (g + weight_decay p)  (coupled L2, as torch's SGD)"""
    return _named(
        "sgd",
        [_decay(weight_decay), scale_by_learning_rate(learning_rate)],
        weight_decay=weight_decay,
    )


@OPTIMIZERS.register("momentum", "sgd_momentum")
@factory
def momentum(
    learning_rate: Any = None,
    *,
    momentum: float = 0.9,
    nesterov: bool = False,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    convention: str = "torch",
) -> Chain:
    """SGD with momentum, heavy-ball or Nesterov (see :func:`trace`).

    ``convention="torch"``: p <- p - lr trace(g); ``convention="sklearn"`` (scikit-learn's
    MLP and the seed library): the learning rate sits inside the velocity,
    v <- momentum v - lr g, which matters when it changes over time.
    ``weight_decay`` adds a coupled L2 term to g in both.
    """
    buffer = trace(momentum, nesterov=nesterov, dampening=dampening, convention=convention)
    rate = scale_by_learning_rate(learning_rate)
    parts = [rate, buffer] if convention == "sklearn" else [buffer, rate]
    return _named(
        "momentum",
        [_decay(weight_decay), *parts],
        momentum=momentum,
        nesterov=nesterov,
        dampening=dampening,
        weight_decay=weight_decay,
        convention=convention,
    )


_momentum = momentum


@OPTIMIZERS.register("nesterov")
@factory
def nesterov(
    learning_rate: Any = None,
    *,
    momentum: float = 0.9,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    convention: str = "torch",
) -> Chain:
    """SGD with Nesterov momentum: ``momentum(learning_rate, ..., nesterov=True)``."""
    return _momentum(
        learning_rate,
        momentum=momentum,
        nesterov=True,
        dampening=dampening,
        weight_decay=weight_decay,
        convention=convention,
    )


@OPTIMIZERS.register("adam")
@factory
def adam(
    learning_rate: Any = None,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    eps_mode: str = "corrected",
) -> Chain:
    """Adam: ``chain(add_decayed_weights, scale_by_adam, scale_by_learning_rate)``.

    ``weight_decay`` is coupled L2 (added to g, as torch's Adam); see :func:`adamw`.
    """
    rule = scale_by_adam(b1, b2, eps, eps_mode)
    return _coupled(
        "adam", rule, weight_decay, learning_rate, b1=b1, b2=b2, eps=eps, eps_mode=eps_mode
    )


@OPTIMIZERS.register("adamw")
@factory
def adamw(
    learning_rate: Any = None,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    eps_mode: str = "corrected",
) -> Chain:
    """AdamW (Loshchilov & Hutter): the decay comes after Adam's rescaling,
    p <- p - lr (adam(g) + weight_decay p), which is torch.optim.AdamW's update."""
    rule = scale_by_adam(b1, b2, eps, eps_mode)
    return _decoupled(
        "adamw", rule, weight_decay, learning_rate, b1=b1, b2=b2, eps=eps, eps_mode=eps_mode
    )


@OPTIMIZERS.register("adagrad")
@factory
def adagrad(
    learning_rate: Any = None,
    *,
    eps: float = 1e-10,
    lr_decay: float = 0.0,
    initial_accumulator_value: float = 0.0,
    weight_decay: float = 0.0,
) -> Chain:
    """Adagrad (torch.optim.Adagrad's form, eps outside the sqrt)."""
    rule = scale_by_adagrad(eps, lr_decay, initial_accumulator_value)
    return _coupled(
        "adagrad",
        rule,
        weight_decay,
        learning_rate,
        eps=eps,
        lr_decay=lr_decay,
        initial_accumulator_value=initial_accumulator_value,
    )


@OPTIMIZERS.register("rmsprop")
@factory
def rmsprop(
    learning_rate: Any = None,
    *,
    alpha: float = 0.99,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> Chain:
    """RMSprop (torch.optim.RMSprop's form, eps outside the sqrt, no momentum)."""
    rule = scale_by_rms(alpha, eps)
    return _coupled("rmsprop", rule, weight_decay, learning_rate, alpha=alpha, eps=eps)


@OPTIMIZERS.register("lion")
@factory
def lion(
    learning_rate: Any = None, *, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 0.0
) -> Chain:
    """Lion: p <- p - lr (sign(b1 m + (1 - b1) g) + weight_decay p)."""
    return _decoupled("lion", scale_by_lion(b1, b2), weight_decay, learning_rate, b1=b1, b2=b2)


@OPTIMIZERS.register("lamb")
@factory
def lamb(
    learning_rate: Any = None,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
) -> Chain:
    """LAMB (You et al. 2020): Adam's direction plus decoupled decay, rescaled per
    weight by the trust ratio ||p|| / ||r||: p <- p - lr trust r."""
    return _named(
        "lamb",
        [
            scale_by_adam(b1, b2, eps),
            _decay(weight_decay),
            scale_by_trust_ratio(),
            scale_by_learning_rate(learning_rate),
        ],
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
    )


@OPTIMIZERS.register("radam")
@factory
def radam(
    learning_rate: Any = None,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> Chain:
    """RAdam (torch.optim.RAdam, coupled ``weight_decay``)."""
    rule = scale_by_radam(b1, b2, eps)
    return _coupled("radam", rule, weight_decay, learning_rate, b1=b1, b2=b2, eps=eps)


@OPTIMIZERS.register("adadelta")
@factory
def adadelta(
    learning_rate: Any = None, *, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0
) -> Chain:
    """Adadelta (torch.optim.Adadelta; torch's default learning rate is 1.0)."""
    rule = scale_by_adadelta(rho, eps)
    return _coupled("adadelta", rule, weight_decay, learning_rate, rho=rho, eps=eps)


@OPTIMIZERS.register("adafactor")
@factory
def adafactor(
    learning_rate: Any = None,
    *,
    beta2_decay: float = -0.8,
    eps1: float | None = None,
    eps2: float = 1e-3,
    d: float = 1.0,
    weight_decay: float = 0.0,
) -> Chain:
    """Adafactor (torch.optim.Adafactor; see :func:`scale_by_adafactor`)."""
    rule = scale_by_adafactor(
        learning_rate, beta2_decay=beta2_decay, eps1=eps1, eps2=eps2, d=d, weight_decay=weight_decay
    )
    return _named(
        "adafactor",
        [rule],
        beta2_decay=beta2_decay,
        eps1=eps1,
        eps2=eps2,
        d=d,
        weight_decay=weight_decay,
    )


def get(name: str | GradientTransformation, **kwargs: Any) -> GradientTransformation:
    """The optimizer registered as ``name`` (its learning rate open unless given)."""
    if isinstance(name, GradientTransformation):
        return name
    return OPTIMIZERS.get(name, **kwargs)


DEFAULT_LEARNING_RATE = 0.01
"""The constant rate that fills an open learning rate when a trainer is given none."""


def update_model(
    optimizer: GradientTransformation,
    param: str,
    dtype: npt.DTypeLike,
    shape: tuple[int, ...],
) -> onnx.ModelProto:
    """One weight's full step as an ONNX model: ``(param, grad, <state>, step) ->
    (param.new, <state>.new)``, the learning rate computed in the graph from ``step``."""
    from graphkit._graph import rename_tensors

    model = optimizer.model({param: WeightInfo(np.dtype(dtype), tuple(shape))})
    # p + u, then the seed's names
    update = f"{param}.update.next"
    model.graph.node.append(onnx.helper.make_node("Add", [param, update], ["param.new"]))
    out = model.graph.output[0]
    out.name = "param.new"
    mapping = {param: "param", f"{param}.update": "grad"}
    for o in model.graph.output[1:]:
        mapping[o.name] = o.name.removesuffix(".next") + ".new"
    rename_tensors(model.graph, lambda n: mapping.get(n, n))
    return model


__all__ = [
    "DEFAULT_LEARNING_RATE",
    "OPEN",
    "OPTIMIZERS",
    "adadelta",
    "adafactor",
    "adagrad",
    "adam",
    "adamw",
    "apply_updates",
    "get",
    "lamb",
    "lion",
    "momentum",
    "nesterov",
    "radam",
    "rmsprop",
    "sgd",
]
