"""Rules: the transformations that hold each named optimizer's update rule, momentum
(:func:`trace`) and the ``scale_by_*`` directions (Adam, Adagrad, RMSprop, Lion, LAMB's
trust ratio, RAdam, Adadelta, Adafactor); :mod:`graphkit.optimizers` chains them with
weight decay and the learning rate."""

from __future__ import annotations

from typing import Any, no_type_check

import numpy as np

from graphkit.dsl import FLOAT, INT64, f64, op, script
from graphkit.transforms.base import Field, Scripted, WeightInfo, factory
from graphkit.transforms.combine import Partition
from graphkit.transforms.scaling import check_learning_rate


def _unit_interval(**values: float) -> None:
    for key, value in values.items():
        if not 0 <= value < 1:
            raise ValueError(f"{key} must lie in [0, 1), got {value}.")


@factory
def trace(
    momentum: float = 0.9,
    nesterov: bool = False,
    dampening: float = 0.0,
    convention: str = "torch",
) -> Scripted:
    """A momentum buffer over the updates (state ``momentum.buffer`` or ``.velocity``).

    ``convention="torch"`` (torch.optim.SGD; the buffer starts at the first update)::

        b <- u at step 0, then momentum b + (1 - dampening) u
        u' = u + momentum b if nesterov, else b

    ``convention="sklearn"`` (scikit-learn's MLP; put it after the learning rate, so
    that the rate sits inside the velocity)::

        v <- momentum v + u;  u' = u + momentum v if nesterov, else v
    """
    _unit_interval(momentum=momentum)
    if convention not in ("torch", "sklearn"):
        raise ValueError(f"convention must be 'torch' or 'sklearn', got {convention!r}.")
    mu, damp = f64(momentum), f64(1.0 - dampening)
    params = dict(momentum=momentum, nesterov=nesterov, dampening=dampening)

    if convention == "sklearn":
        if dampening:
            raise ValueError("dampening is a torch option; use convention='torch'.")

        @script()
        @no_type_check
        def velocity_trace(
            update: FLOAT, param: FLOAT, velocity: FLOAT, step: INT64
        ) -> tuple[FLOAT, FLOAT]:
            v = op.CastLike(mu, update) * velocity + update
            return v, v

        @script()
        @no_type_check
        def velocity_nesterov(
            update: FLOAT, param: FLOAT, velocity: FLOAT, step: INT64
        ) -> tuple[FLOAT, FLOAT]:
            m = op.CastLike(mu, update)
            v = m * velocity + update
            return m * v + update, v

        fn = velocity_nesterov if nesterov else velocity_trace
        return Scripted("momentum", fn, (Field("velocity"),), params=params, elementwise=True)

    @script()
    @no_type_check
    def buffer_trace(
        update: FLOAT, param: FLOAT, buffer: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT]:
        b = op.Where(
            step == 0, update, op.CastLike(mu, update) * buffer + op.CastLike(damp, update) * update
        )
        return b, b

    @script()
    @no_type_check
    def buffer_nesterov(
        update: FLOAT, param: FLOAT, buffer: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT]:
        m = op.CastLike(mu, update)
        b = op.Where(step == 0, update, m * buffer + op.CastLike(damp, update) * update)
        return update + m * b, b

    fn = buffer_nesterov if nesterov else buffer_trace
    return Scripted("momentum", fn, (Field("buffer"),), params=params, elementwise=True)


@factory
def scale_by_adam(
    b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_mode: str = "corrected"
) -> Scripted:
    """Adam's direction (Kingma & Ba). m <- b1 m + (1 - b1) u; v <- b2 v + (1 - b2) u^2;
    t = step + 1, c1 = 1 - b1^t, c2 = 1 - b2^t.

    ``eps_mode="corrected"`` (torch, the paper): u' = (m / c1) / (sqrt(v / c2) + eps).
    ``eps_mode="uncorrected"`` (scikit-learn, TensorFlow): u' = sqrt(c2) / c1 m /
    (sqrt(v) + eps); eps then weighs more early on.
    """
    _unit_interval(b1=b1, b2=b2)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}.")
    if eps_mode not in ("corrected", "uncorrected"):
        raise ValueError(f"eps_mode must be 'corrected' or 'uncorrected', got {eps_mode!r}.")
    beta1, beta2, e, one = f64(b1), f64(b2), f64(eps), f64(1.0)
    params = dict(b1=b1, b2=b2, eps=eps, eps_mode=eps_mode)

    @script()
    @no_type_check
    def adam_moments(
        update: FLOAT, m: FLOAT, v: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT, FLOAT, FLOAT]:
        """m, v the new moments; c1, c2 = 1 - b1^t, 1 - b2^t"""
        b_1, b_2 = op.CastLike(beta1, update), op.CastLike(beta2, update)
        m_new = b_1 * m + (op.CastLike(one, update) - b_1) * update
        v_new = b_2 * v + (op.CastLike(one, update) - b_2) * update * update
        t = op.CastLike(step + 1, update)
        c1 = op.CastLike(one, update) - op.Pow(b_1, t)
        c2 = op.CastLike(one, update) - op.Pow(b_2, t)
        return m_new, v_new, c1, c2

    @script()
    @no_type_check
    def adam_corrected(
        update: FLOAT, param: FLOAT, m: FLOAT, v: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT, FLOAT]:
        m_new, v_new, c1, c2 = adam_moments(update, m, v, step)
        # (m / c1) / (sqrt(v / c2) + eps), its scalars gathered: 4 passes over the
        # weights, not 5 (each a kernel over all of them)
        root = op.Sqrt(c2)
        eps_hat = op.CastLike(e, update) * root
        return (root / c1) * m_new / (op.Sqrt(v_new) + eps_hat), m_new, v_new

    @script()
    @no_type_check
    def adam_uncorrected(
        update: FLOAT, param: FLOAT, m: FLOAT, v: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT, FLOAT]:
        m_new, v_new, c1, c2 = adam_moments(update, m, v, step)
        scale = op.Sqrt(c2) / c1
        return scale * m_new / (op.Sqrt(v_new) + op.CastLike(e, update)), m_new, v_new

    fn = adam_corrected if eps_mode == "corrected" else adam_uncorrected
    return Scripted("adam", fn, (Field("m"), Field("v")), params=params, elementwise=True)


@factory
def scale_by_adagrad(
    eps: float = 1e-10, lr_decay: float = 0.0, initial_accumulator_value: float = 0.0
) -> Scripted:
    """s <- s + u^2;  u' = u / (1 + step lr_decay) / (sqrt(s) + eps)  (torch's Adagrad)"""
    if eps < 0 or lr_decay < 0 or initial_accumulator_value < 0:
        raise ValueError("eps, lr_decay and initial_accumulator_value must be >= 0.")
    e, decay, one = f64(eps), f64(lr_decay), f64(1.0)

    @script()
    @no_type_check
    def adagrad(update: FLOAT, param: FLOAT, sum_sq: FLOAT, step: INT64) -> tuple[FLOAT, FLOAT]:
        s = sum_sq + update * update
        slow = op.CastLike(one, update) + op.CastLike(step, update) * op.CastLike(decay, update)
        return update / slow / (op.Sqrt(s) + op.CastLike(e, update)), s

    params = dict(eps=eps, lr_decay=lr_decay, initial_accumulator_value=initial_accumulator_value)
    return Scripted(
        "adagrad",
        adagrad,
        (Field("sum_sq", initial_accumulator_value),),
        params=params,
        elementwise=True,
    )


@factory
def scale_by_rms(alpha: float = 0.99, eps: float = 1e-8) -> Scripted:
    """v <- alpha v + (1 - alpha) u^2;  u' = u / (sqrt(v) + eps)  (torch's RMSprop)"""
    _unit_interval(alpha=alpha)
    a, e, one = f64(alpha), f64(eps), f64(1.0)

    @script()
    @no_type_check
    def rms(update: FLOAT, param: FLOAT, square_avg: FLOAT, step: INT64) -> tuple[FLOAT, FLOAT]:
        a_ = op.CastLike(a, update)
        v = a_ * square_avg + (op.CastLike(one, update) - a_) * update * update
        return update / (op.Sqrt(v) + op.CastLike(e, update)), v

    return Scripted(
        "rmsprop", rms, (Field("square_avg"),), params=dict(alpha=alpha, eps=eps), elementwise=True
    )


@factory
def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> Scripted:
    """Lion (Chen et al. 2023): u' = sign(b1 m + (1 - b1) u);  m <- b2 m + (1 - b2) u"""
    _unit_interval(b1=b1, b2=b2)
    beta1, beta2, one = f64(b1), f64(b2), f64(1.0)

    @script()
    @no_type_check
    def lion(update: FLOAT, param: FLOAT, m: FLOAT, step: INT64) -> tuple[FLOAT, FLOAT]:
        b_1, b_2 = op.CastLike(beta1, update), op.CastLike(beta2, update)
        direction = op.Sign(b_1 * m + (op.CastLike(one, update) - b_1) * update)
        return direction, b_2 * m + (op.CastLike(one, update) - b_2) * update

    return Scripted("lion", lion, (Field("m"),), params=dict(b1=b1, b2=b2), elementwise=True)


@factory
def scale_by_trust_ratio() -> Scripted:
    """LAMB's layer-wise trust ratio: u' = u ||p|| / ||u|| (u' = u when a norm is 0)."""

    @script()
    @no_type_check
    def trust_ratio(update: FLOAT, param: FLOAT, step: INT64) -> FLOAT:
        p_norm = op.Sqrt(op.ReduceSumSquare(param, keepdims=0))
        u_norm = op.Sqrt(op.ReduceSumSquare(update, keepdims=0))
        zero = op.CastLike(0.0, update)
        degenerate = op.Or(p_norm == zero, u_norm == zero)
        ratio = op.Where(degenerate, op.CastLike(1.0, update), p_norm / u_norm)
        return update * ratio

    return Scripted("trust_ratio", trust_ratio)


@factory
def scale_by_radam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> Scripted:
    """RAdam (Liu et al. 2020), torch.optim.RAdam's form. With Adam's m, v and
    t = step + 1: rho_inf = 2 / (1 - b2) - 1, rho_t = rho_inf - 2 t b2^t / (1 - b2^t);

        u' = m_hat r sqrt(1 - b2^t) / (sqrt(v) + eps)   if rho_t > 5
        u' = m_hat                                        otherwise

    with m_hat = m / (1 - b1^t), r = sqrt((rho_t - 4)(rho_t - 2) rho_inf /
    ((rho_inf - 4)(rho_inf - 2) rho_t)).
    """
    _unit_interval(b1=b1, b2=b2)
    beta1, beta2, e, one = f64(b1), f64(b2), f64(eps), f64(1.0)
    rho_inf = f64(2.0 / (1.0 - b2) - 1.0)

    @script()
    @no_type_check
    def radam(
        update: FLOAT, param: FLOAT, m: FLOAT, v: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT, FLOAT]:
        b_1, b_2, o = (
            op.CastLike(beta1, update),
            op.CastLike(beta2, update),
            op.CastLike(one, update),
        )
        m_new = b_1 * m + (o - b_1) * update
        v_new = b_2 * v + (o - b_2) * update * update
        t = op.CastLike(step + 1, update)
        c1 = o - op.Pow(b_1, t)
        c2 = o - op.Pow(b_2, t)
        m_hat = m_new / c1
        r_inf = op.CastLike(rho_inf, update)
        rho = r_inf - op.CastLike(2.0, update) * t * op.Pow(b_2, t) / c2
        four, two = op.CastLike(4.0, update), op.CastLike(2.0, update)
        safe = op.Max(rho, op.CastLike(5.0, update))  # the rectified branch is only read there
        rect = op.Sqrt(
            (safe - four) * (safe - two) * r_inf / ((r_inf - four) * (r_inf - two) * safe)
        )
        adaptive = op.Sqrt(c2) / (op.Sqrt(v_new) + op.CastLike(e, update))
        rectified = m_hat * rect * adaptive
        return op.Where(rho > op.CastLike(5.0, update), rectified, m_hat), m_new, v_new

    return Scripted(
        "radam",
        radam,
        (Field("m"), Field("v")),
        params=dict(b1=b1, b2=b2, eps=eps),
        elementwise=True,
    )


@factory
def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> Scripted:
    """Adadelta (Zeiler 2012), torch.optim.Adadelta's form::

    v <- rho v + (1 - rho) u^2
    u' = sqrt(d + eps) / sqrt(v + eps) u
    d <- rho d + (1 - rho) u'^2
    """
    _unit_interval(rho=rho)
    r, e, one = f64(rho), f64(eps), f64(1.0)

    @script()
    @no_type_check
    def adadelta(
        update: FLOAT, param: FLOAT, square_avg: FLOAT, acc_delta: FLOAT, step: INT64
    ) -> tuple[FLOAT, FLOAT, FLOAT]:
        r_, e_ = op.CastLike(r, update), op.CastLike(e, update)
        v = r_ * square_avg + (op.CastLike(one, update) - r_) * update * update
        delta = op.Sqrt(acc_delta + e_) / op.Sqrt(v + e_) * update
        d = r_ * acc_delta + (op.CastLike(one, update) - r_) * delta * delta
        return delta, v, d

    fields = (Field("square_avg"), Field("acc_delta"))
    return Scripted("adadelta", adadelta, fields, params=dict(rho=rho, eps=eps), elementwise=True)


@factory
def scale_by_adafactor(
    learning_rate: Any = None,
    *,
    beta2_decay: float = -0.8,
    eps1: float | None = None,
    eps2: float = 1e-3,
    d: float = 1.0,
    weight_decay: float = 0.0,
) -> Partition:
    """Adafactor (Shazeer & Stern 2018), torch.optim.Adafactor's form, learning rate and
    decay included (its step size depends on the rate non-linearly). t = step + 1::

        beta_t = t^beta2_decay;  rho_t = min(lr, 1 / sqrt(t))
        alpha_t = max(eps2, RMS(p)) rho_t
        matrices (factored over the last two axes):
            R <- (1 - beta_t) R + beta_t mean_cols(u^2)
            C <- (1 - beta_t) C + beta_t mean_rows(u^2)
            V = R C / max(mean(R), eps1)
        vectors: V <- (1 - beta_t) V + beta_t u^2
        U = u / sqrt(max(V, eps1^2));  U_hat = U / max(1, RMS(U) / d)
        u' = -alpha_t U_hat - lr weight_decay p

    ``eps1`` defaults to the machine epsilon of the weights' dtype. The state of a
    matrix weight is two vectors (``row``, ``col``), not a tensor of its size.
    """
    if not beta2_decay <= 0:
        raise ValueError(f"beta2_decay must be <= 0, got {beta2_decay}.")
    if (eps1 is not None and eps1 < 0) or eps2 < 0 or weight_decay < 0:
        raise ValueError("eps1, eps2 and weight_decay must be >= 0.")
    if not d >= 1:
        raise ValueError(f"d (the update clipping threshold) must be >= 1, got {d}.")
    decay, e2, clip_d, wd = f64(beta2_decay), f64(eps2), f64(d), f64(weight_decay)
    one, half = f64(1.0), f64(-0.5)

    @script()
    @no_type_check
    def adafactor_scale(update: FLOAT, param: FLOAT, step: INT64, lr: FLOAT) -> tuple[FLOAT, FLOAT]:
        """beta_t and alpha_t for this step and weight"""
        t = op.CastLike(step + 1, update)
        beta = op.Pow(t, op.CastLike(decay, update))
        rho = op.Min(lr, op.Pow(t, op.CastLike(half, update)))
        rms_p = op.Sqrt(op.ReduceMean(param * param, keepdims=0))
        return beta, op.Max(op.CastLike(e2, update), rms_p) * rho

    @script()
    @no_type_check
    def adafactor_finish(
        update: FLOAT, param: FLOAT, var: FLOAT, alpha: FLOAT, eps: FLOAT, lr: FLOAT
    ) -> FLOAT:
        u = update / op.Sqrt(op.Max(var, eps * eps))
        rms_u = op.Sqrt(op.ReduceMean(u * u, keepdims=0))
        denom = op.Max(op.CastLike(one, update), rms_u / op.CastLike(clip_d, update))
        return op.Neg(alpha / denom) * u - lr * op.CastLike(wd, update) * param

    def rules(dtype: type) -> dict[str, Scripted]:
        # eps1 defaults to the machine epsilon of the weight's dtype
        e1 = f64(eps1 if eps1 is not None else np.finfo(dtype).eps)

        @script()
        @no_type_check
        def adafactor_matrix(
            update: FLOAT, param: FLOAT, row: FLOAT, col: FLOAT, step: INT64, lr: FLOAT
        ) -> tuple[FLOAT, FLOAT, FLOAT]:
            beta, alpha = adafactor_scale(update, param, step, lr)
            eps = op.CastLike(e1, update)
            keep = op.CastLike(one, update) - beta
            sq = update * update
            row_new = keep * row + beta * op.ReduceMean(sq, [-1], keepdims=1)
            col_new = keep * col + beta * op.ReduceMean(sq, [-2], keepdims=1)
            norm = op.Max(op.ReduceMean(row_new, [-2], keepdims=1), eps)
            var = op.MatMul(row_new, col_new) / norm
            return adafactor_finish(update, param, var, alpha, eps, lr), row_new, col_new

        @script()
        @no_type_check
        def adafactor_vector(
            update: FLOAT, param: FLOAT, variance: FLOAT, step: INT64, lr: FLOAT
        ) -> tuple[FLOAT, FLOAT]:
            beta, alpha = adafactor_scale(update, param, step, lr)
            var = (op.CastLike(one, update) - beta) * variance + beta * update * update
            eps = op.CastLike(e1, update)
            return adafactor_finish(update, param, var, alpha, eps, lr), var

        rows = Field("row", lambda p: np.zeros((*p.shape[:-1], 1)))
        cols = Field("col", lambda p: np.zeros((*p.shape[:-2], 1, p.shape[-1])))
        name = np.dtype(dtype).name
        return {
            f"matrix/{name}": Scripted(
                "adafactor", adafactor_matrix, (rows, cols), learning_rate=rate
            ),
            f"vector/{name}": Scripted(
                "adafactor", adafactor_vector, (Field("variance"),), learning_rate=rate
            ),
        }

    rate = check_learning_rate(learning_rate)

    def kind(name: str, info: WeightInfo) -> str:
        return f"{'matrix' if info.ndim >= 2 else 'vector'}/{info.dtype.name}"

    out = Partition({**rules(np.float32), **rules(np.float64)}, kind)
    out.name = "adafactor"
    out.params = dict(beta2_decay=beta2_decay, eps1=eps1, eps2=eps2, d=d, weight_decay=weight_decay)
    return out


__all__ = [
    "scale_by_adadelta",
    "scale_by_adafactor",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_lion",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_trust_ratio",
    "trace",
]
