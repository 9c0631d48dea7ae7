"""The seed library's API: its ``*LearningLoss``, ``LearningRate*`` and
``*LearningPenalty`` classes, as thin adapters over graphkit's pieces.

graphkit's own words are its registries' names (:mod:`graphkit.losses`,
:mod:`graphkit.optimizers`, :mod:`graphkit.penalties`, :mod:`graphkit.schedules`): a
string means the same thing wherever it is passed, and none of them is a seed class
name. The seed's classes live here, and say what they are in graphkit's words:

=============================  =========================================================
seed class                     in graphkit
=============================  =========================================================
``SquareLearningLoss``         loss ``"squared_error"``
``AbsoluteLearningLoss``       loss ``"absolute_error"``
``ElasticLearningLoss``        loss ``"elastic"``
``HuberLearningLoss``          loss ``"huber"``
``NegLogLearningLoss``         loss ``"sigmoid_log_loss"`` (from a raw score)
``SoftmaxCrossEntropy...``     loss ``"cross_entropy"`` (from logits)
``NoLearningPenalty``          penalty ``"none"``
``ElasticLearningPenalty``     penalty ``"elastic"``
``LearningRateSGD``            optimizer ``"sgd"`` + schedule ``"invscaling"`` (eta0=0.01,
                               power_t=0.25; ``"constant"``, ``"optimal"`` on request)
``LearningRateSGDNesterov``    ``momentum(nesterov=True, convention="sklearn")`` +
                               ``"invscaling"`` (graphkit's ``"nesterov"`` is torch's
                               convention)
``LearningRateAdam``           optimizer ``"adam"`` at a constant 0.001
``LearningRateAdamW``          optimizer ``"adamw"`` at a constant 0.001
``LearningRateAdagrad``        optimizer ``"adagrad"`` at a constant 0.01
``LearningRateRMSProp``        optimizer ``"rmsprop"`` at a constant 0.01
=============================  =========================================================

Each wraps a graphkit :class:`~graphkit.losses.Loss`, optimizer +
:class:`~graphkit.schedules.Schedule`, or :class:`~graphkit.penalties.Penalty`, and
``build_onnx_function()`` returns the ONNX graph it runs. ``select(x)`` is the seed's
selection: an instance, a seed class name (``"SquareLearningLoss"``,
``"LearningRateSGDNesterov"``) or a graphkit name, which means what it means everywhere
(``BaseLearningRate.select("sgd")`` is graphkit's SGD at a constant 0.01)::

    loss = BaseLearningLoss.select("elastic", l1_weight=0.1, l2_weight=0.9)
    rate = BaseLearningRate.select("LearningRateSGDNesterov", eta0=0.01)
    penalty = BaseLearningPenalty.select("ElasticLearningPenalty", l1=0.1, l2=0.9)

The seed's short names (``"SGD"``, ``"SGDNesterov"``...) are gone: ``"SGD"`` is
graphkit's ``"sgd"`` in any case, and a seed name that is no graphkit name raises an
:class:`~graphkit.errors.UnknownNameError` naming the object to use (:func:`hint`).

Differences from the seed, on purpose: losses are means over the batch by default
(``reduction="sum"`` gives the seed's sums); the absolute and elastic gradients are taken
with respect to the prediction (the seed had the sign wrong); selection by class name
works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt
import onnx

from graphkit import losses as _losses
from graphkit import optimizers as _optimizers
from graphkit import penalties as _penalties
from graphkit import registry as _registry
from graphkit import schedules as _schedules
from graphkit import transforms as _transforms
from graphkit._graph import Dim
from graphkit.errors import UnknownNameError


class BaseLearningOnnx:
    """Common base: selection by a seed class name, a graphkit name or an instance.

    Names belong to graphkit's registries (:data:`graphkit.losses.LOSSES`,
    :data:`graphkit.optimizers.OPTIMIZERS`, :data:`graphkit.penalties.PENALTIES`): a
    name means the same thing here as in ``losses.get``, ``add_loss_output``, the
    trainers or the command line. The seed classes are selected by their class name,
    which no registry holds.
    """

    default: ClassVar[str]
    in_graphkit: ClassVar[str] = ""  # what the class is in graphkit's words

    @classmethod
    def select(cls, x: Any = None, **kwargs: Any) -> Any:
        """An instance from a seed class name, a registered DSL name or an instance."""
        if isinstance(x, cls):
            if kwargs:
                raise ValueError(
                    f"Cannot apply {sorted(kwargs)} to an existing {type(x).__name__}."
                )
            return x
        if x is None:
            x = cls.default
        if not isinstance(x, str):
            raise TypeError(f"Cannot select a {cls.__name__} from {type(x).__name__} {x!r}.")
        seed = {sub.__name__.lower(): sub for sub in _subclasses(cls)}
        if x.lower() in seed:
            return seed[x.lower()](**kwargs)
        try:
            return cls._from_registry(x, **kwargs)
        except UnknownNameError as exc:
            classes = ", ".join(sorted(sub.__name__ for sub in _subclasses(cls)))
            raise UnknownNameError(f"{exc} Valid choices also: {classes}.") from None

    @classmethod
    def _from_registry(cls, name: str, **kwargs: Any) -> Any:
        raise TypeError(
            "Select from BaseLearningLoss, BaseLearningRate or BaseLearningPenalty, "
            f"not {cls.__name__}."
        )

    @classmethod
    def _wrap(cls, canonical: str, attribute: str, *args: Any) -> Any:
        """An instance of the seed class registered for ``canonical`` (else of ``cls``)
        around an already-built DSL object."""
        chosen = next(
            (s for s in _subclasses(cls) if getattr(s, attribute, None) == canonical), cls
        )
        instance = chosen.__new__(chosen)
        cls.__init__(instance, *args)
        return instance

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"

    def _describe(self) -> str:
        return ""


_T = TypeVar("_T")


def _subclasses(cls: type[_T]) -> list[type[_T]]:
    found: list[type[_T]] = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_subclasses(sub))
    return found


# -- losses -----------------------------------------------------------------------------


class BaseLearningLoss(BaseLearningOnnx):
    """A loss and its gradient with respect to the prediction."""

    default = "squared_error"
    loss_name: ClassVar[str | None] = None  # the registered loss a seed class wraps

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.in_graphkit = f"graphkit's loss {cls.loss_name!r}"

    def __init__(self, loss: _losses.Loss) -> None:
        self.loss = loss

    @classmethod
    def _from_registry(cls, name: str, **kwargs: Any) -> BaseLearningLoss:
        loss = _losses.get(name, **kwargs)
        return BaseLearningLoss._wrap(_losses.LOSSES.canonical(name), "loss_name", loss)

    def _describe(self) -> str:
        return repr(self.loss)

    def to_loss(self) -> _losses.Loss:
        """The graphkit loss this adapter stands for."""
        return self.loss

    def build_onnx_function(
        self,
        dtype: object = np.float32,
        weighted: bool = False,
        prediction_shape: Sequence[Dim] = ("N", "K"),
    ) -> onnx.ModelProto:
        """``(prediction, label[, weight]) -> (loss, prediction_grad)``."""
        return self.loss.gradient_model(dtype, weighted, prediction_shape)

    def loss_gradient(
        self, prediction: np.ndarray, label: np.ndarray, weight: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(loss, d loss / d prediction)`` on numpy arrays."""
        return self.loss.value_and_grad(prediction, label, weight)


class SquareLearningLoss(BaseLearningLoss):
    """Squared error: mean over samples of sum_j (p_j - y_j)^2."""

    loss_name = "squared_error"

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(_losses.get("squared_error", reduction=reduction))


class AbsoluteLearningLoss(BaseLearningLoss):
    """Absolute error: mean over samples of sum_j |p_j - y_j|."""

    loss_name = "absolute_error"

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(_losses.get("absolute_error", reduction=reduction))


class ElasticLearningLoss(BaseLearningLoss):
    """l1_weight |p - y| + l2_weight (p - y)^2."""

    loss_name = "elastic"

    def __init__(self, l1_weight: float = 0.5, l2_weight: float = 0.5, reduction: str = "mean"):
        super().__init__(
            _losses.get("elastic", l1_weight=l1_weight, l2_weight=l2_weight, reduction=reduction)
        )


class HuberLearningLoss(BaseLearningLoss):
    """Huber loss with threshold ``delta``."""

    loss_name = "huber"

    def __init__(self, delta: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(_losses.get("huber", delta=delta, reduction=reduction))


class NegLogLearningLoss(BaseLearningLoss):
    """Binary log loss from a raw score s: gradient sigmoid(s) - y (the seed's formula)."""

    loss_name = "sigmoid_log_loss"

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(_losses.get("sigmoid_log_loss", reduction=reduction))


class SoftmaxCrossEntropyLearningLoss(BaseLearningLoss):
    """Softmax cross-entropy from logits, int64 class labels."""

    loss_name = "cross_entropy"

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__(_losses.get("cross_entropy", reduction=reduction))


# -- penalties --------------------------------------------------------------------------


class BaseLearningPenalty(BaseLearningOnnx):
    """A penalty on the weights and its gradient."""

    default = "none"
    penalty_name: ClassVar[str | None] = None  # the registered penalty a seed class wraps

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.in_graphkit = f"graphkit's penalty {cls.penalty_name!r}"

    def __init__(self, penalty: _penalties.Penalty) -> None:
        self.penalty = penalty

    @classmethod
    def _from_registry(cls, name: str, **kwargs: Any) -> BaseLearningPenalty:
        penalty = _penalties.get(name, **kwargs)
        canonical = _penalties.PENALTIES.canonical(name)
        return BaseLearningPenalty._wrap(canonical, "penalty_name", penalty)

    def _describe(self) -> str:
        return repr(self.penalty)

    def to_penalty(self) -> _penalties.Penalty:
        """The graphkit penalty this adapter stands for."""
        return self.penalty

    def build_onnx_function(
        self, name: str = "weight", dtype: object = np.float32, shape: Sequence[Dim] = ("N",)
    ) -> onnx.ModelProto:
        """``weight -> (penalty, weight_grad)`` for the weight ``name``."""
        return self.penalty.gradient_model(name, dtype, shape)


class NoLearningPenalty(BaseLearningPenalty):
    """No penalty."""

    penalty_name = "none"

    def __init__(self) -> None:
        super().__init__(_penalties.no_penalty())


class ElasticLearningPenalty(BaseLearningPenalty):
    """l1 sum|w| + l2 sum w^2, on ``weights`` (all trained weights when None)."""

    penalty_name = "elastic"

    def __init__(self, l1: float = 0.5, l2: float = 0.5, weights: Sequence[str] | None = None):
        super().__init__(_penalties.elastic(l1, l2, weights))


# -- learning rates ---------------------------------------------------------------------


class BaseLearningRate(BaseLearningOnnx):
    """An optimizer with its learning-rate schedule: a thin adapter whose
    :meth:`to_transformation` is the graphkit transformation the runtime trains with.

    A name selects graphkit's optimizer at a constant 0.01, as in the trainers; the
    default is the seed's :class:`LearningRateSGD` (SGD with the invscaling schedule)."""

    default = "LearningRateSGD"

    def __init__(
        self, optimizer: _transforms.GradientTransformation, schedule: _schedules.Schedule
    ) -> None:
        if not optimizer.has_open_learning_rate:
            raise ValueError(f"{optimizer!r} already has its learning rate; use it directly.")
        self.optimizer = optimizer
        self.schedule = schedule

    @classmethod
    def _from_registry(cls, name: str, **kwargs: Any) -> BaseLearningRate:
        """A registered optimizer at a constant learning rate of 0.01."""
        schedule = _schedules.constant(_optimizers.DEFAULT_LEARNING_RATE)
        return BaseLearningRate(_optimizers.get(name, **kwargs), schedule)

    def _describe(self) -> str:
        return f"{self.optimizer!r}, {self.schedule!r}"

    def to_transformation(self) -> _transforms.GradientTransformation:
        """The optimizer with this schedule filled in."""
        return self.optimizer.with_learning_rate(self.schedule)

    def value(self, step: int) -> float:
        """The learning rate at ``step`` (0-based)."""
        return self.schedule(step)

    def init(self, params: Any) -> dict[str, np.ndarray]:
        return self.optimizer.init(params)

    def build_onnx_function(
        self, name: str = "weight", dtype: npt.DTypeLike = np.float32, shape: Sequence[int] = (1,)
    ) -> onnx.ModelProto:
        """``(param, grad, <state>, step) -> (param.new, <state>.new)`` for weight ``name``."""
        return _optimizers.update_model(self.to_transformation(), name, dtype, tuple(shape))


def _sgd_schedule(learning_rate: str, eta0: float, alpha: float, power_t: float) -> Any:
    if learning_rate == "invscaling":
        return _schedules.invscaling(eta0, power_t)
    if learning_rate == "constant":
        return _schedules.constant(eta0)
    if learning_rate == "optimal":
        return _schedules.optimal(alpha)
    raise ValueError(
        f"learning_rate must be 'invscaling', 'constant' or 'optimal', got {learning_rate!r}."
    )


class LearningRateSGD(BaseLearningRate):
    """Plain SGD with scikit-learn's schedules (``learning_rate``), as in the seed:
    ``invscaling`` by default, eta0 / (step + 1) ** power_t."""

    in_graphkit = (
        "graphkit's optimizer 'sgd' with the schedule 'invscaling' (eta0 / (step + 1) ** "
        "power_t); the name 'sgd' alone is SGD at a constant rate"
    )

    def __init__(
        self,
        eta0: float = 0.01,
        alpha: float = 0.0001,
        power_t: float = 0.25,
        learning_rate: str = "invscaling",
    ) -> None:
        self.eta0, self.alpha, self.power_t, self.learning_rate = (
            eta0,
            alpha,
            power_t,
            learning_rate,
        )
        super().__init__(_optimizers.sgd(), _sgd_schedule(learning_rate, eta0, alpha, power_t))


class LearningRateSGDNesterov(BaseLearningRate):
    """SGD with momentum (Nesterov by default), scikit-learn's convention as in the seed:
    v <- momentum v - lr g; w <- w + momentum v - lr g (w + v without Nesterov)."""

    in_graphkit = (
        "graphkit's momentum(nesterov=True, convention='sklearn') with the schedule "
        "'invscaling'; graphkit's 'nesterov' is torch's convention"
    )

    def __init__(
        self,
        eta0: float = 0.01,
        alpha: float = 0.0001,
        power_t: float = 0.25,
        learning_rate: str = "invscaling",
        momentum: float = 0.9,
        nesterov: bool = True,
    ) -> None:
        self.eta0, self.alpha, self.power_t, self.learning_rate = (
            eta0,
            alpha,
            power_t,
            learning_rate,
        )
        self.momentum, self.nesterov = momentum, nesterov
        optimizer = _optimizers.momentum(momentum=momentum, nesterov=nesterov, convention="sklearn")
        super().__init__(optimizer, _sgd_schedule(learning_rate, eta0, alpha, power_t))


def _schedule(learning_rate: Any, eta0: float) -> _schedules.Schedule:
    if learning_rate == "constant":
        return _schedules.constant(eta0)
    return _schedules.get(learning_rate)


class LearningRateAdam(BaseLearningRate):
    """Adam; ``learning_rate`` is ``"constant"`` (at ``eta0``) or any schedule."""

    in_graphkit = "graphkit's optimizer 'adam' at a constant 0.001 (eta0)"

    _factory = staticmethod(_optimizers.adam)

    def __init__(
        self,
        eta0: float = 0.001,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        eps_mode: str = "corrected",
        learning_rate: Any = "constant",
    ) -> None:
        optimizer = self._factory(
            b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, eps_mode=eps_mode
        )
        super().__init__(optimizer, _schedule(learning_rate, eta0))


class LearningRateAdamW(LearningRateAdam):
    """AdamW (decoupled weight decay, 0.01 by default)."""

    in_graphkit = "graphkit's optimizer 'adamw' at a constant 0.001 (eta0)"

    _factory = staticmethod(_optimizers.adamw)

    def __init__(self, eta0: float = 0.001, weight_decay: float = 1e-2, **kwargs: Any) -> None:
        super().__init__(eta0=eta0, weight_decay=weight_decay, **kwargs)


class LearningRateAdagrad(BaseLearningRate):
    """Adagrad."""

    in_graphkit = "graphkit's optimizer 'adagrad' at a constant 0.01 (eta0)"

    def __init__(
        self,
        eta0: float = 0.01,
        eps: float = 1e-10,
        lr_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        learning_rate: Any = "constant",
    ) -> None:
        optimizer = _optimizers.adagrad(
            eps=eps, lr_decay=lr_decay, initial_accumulator_value=initial_accumulator_value
        )
        super().__init__(optimizer, _schedule(learning_rate, eta0))


class LearningRateRMSProp(BaseLearningRate):
    """RMSProp."""

    in_graphkit = "graphkit's optimizer 'rmsprop' at a constant 0.01 (eta0)"

    def __init__(
        self,
        eta0: float = 0.01,
        alpha: float = 0.99,
        eps: float = 1e-8,
        learning_rate: Any = "constant",
    ) -> None:
        super().__init__(_optimizers.rmsprop(alpha=alpha, eps=eps), _schedule(learning_rate, eta0))


def resolve(
    learning_rate: Any, default_rate: float = _optimizers.DEFAULT_LEARNING_RATE
) -> _transforms.GradientTransformation:
    """The transformation a seed trainer's ``learning_rate`` argument stands for.

    * a number: plain SGD at that constant rate;
    * a name: the optimizer :func:`graphkit.optimizers.get` gives, an open rate at
      ``default_rate`` (``"SGD"``, ``"sgd"`` and ``"Sgd"`` are one constant-rate SGD; the
      seed's ``LearningRateSGD``, SGD with the invscaling schedule, is an object of this
      module);
    * a gradient transformation: itself, an open rate filled at ``default_rate``;
    * ``(transformation or name, schedule)``: the schedule (a Schedule, its name or a
      number) fills the transformation's open rate;
    * an object with ``to_transformation()`` (the seed's ``LearningRate*`` classes).
    """
    if isinstance(learning_rate, bool):
        raise TypeError("learning_rate cannot be a bool.")
    if isinstance(learning_rate, (int, float, np.integer, np.floating)):
        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate}.")
        return _optimizers.sgd(learning_rate=float(learning_rate))
    if isinstance(learning_rate, str):
        learning_rate = _optimizers.get(learning_rate)
    if isinstance(learning_rate, _transforms.GradientTransformation):
        if learning_rate.has_open_learning_rate:
            return learning_rate.with_learning_rate(default_rate)
        return learning_rate
    if isinstance(learning_rate, tuple) and len(learning_rate) == 2:
        optimizer, schedule = learning_rate
        if isinstance(optimizer, str):
            optimizer = _optimizers.get(optimizer)
        if isinstance(optimizer, _transforms.GradientTransformation):
            return optimizer.with_learning_rate(_schedules.get(schedule))
    if hasattr(learning_rate, "to_transformation"):
        return learning_rate.to_transformation()
    raise TypeError(
        "learning_rate must be a float, an optimizer name ('sgd', 'adam'...), a gradient "
        "transformation, a (transformation, schedule) pair or a LearningRate* object, "
        f"not {learning_rate!r}."
    )


def hint(kind: str, name: object) -> str:
    """What the seed's ``name`` is in graphkit (``""`` when it is none of the seed's),
    for the error an unknown ``kind`` (``"loss"``, ``"penalty"``, ``"optimizer"``) name
    raises: seed class names and the seed's short learning-rate names
    (``"SGDNesterov"``) are no graphkit names."""
    base: type[BaseLearningOnnx] | None = {
        "loss": BaseLearningLoss,
        "penalty": BaseLearningPenalty,
        "optimizer": BaseLearningRate,
    }.get(kind)
    if base is None or not isinstance(name, str):
        return ""
    for cls in _subclasses(base):
        spellings = {cls.__name__, cls.__name__.removeprefix("LearningRate")}
        if name.lower() in {s.lower() for s in spellings}:
            return (
                f" The seed's {name} is the object graphkit.seed.{cls.__name__}(): "
                f"{cls.in_graphkit}."
            )
    return ""


# an unknown loss, penalty or optimizer name that is a seed class's says which object it is
_registry.add_unknown_name_hint(hint)

__all__ = [
    "AbsoluteLearningLoss",
    "BaseLearningLoss",
    "BaseLearningOnnx",
    "BaseLearningPenalty",
    "BaseLearningRate",
    "ElasticLearningLoss",
    "ElasticLearningPenalty",
    "HuberLearningLoss",
    "LearningRateAdagrad",
    "LearningRateAdam",
    "LearningRateAdamW",
    "LearningRateRMSProp",
    "LearningRateSGD",
    "LearningRateSGDNesterov",
    "NegLogLearningLoss",
    "NoLearningPenalty",
    "SoftmaxCrossEntropyLearningLoss",
    "SquareLearningLoss",
]
