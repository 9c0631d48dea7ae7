"""Gradient transformations, optax-style, compiled to ONNX.

Every name is importable from here (``from graphkit.transforms import chain``); each
module holds one concept:

* :mod:`graphkit.transforms.base`: the framework: :class:`GradientTransformation`
  (``init``, ``update``, ``emit``), the :class:`Emitter` it writes ONNX nodes into,
  :class:`Scripted` (a transformation written as an onnxscript function), :func:`factory`
  and :func:`apply_updates`;
* :mod:`graphkit.transforms.combine`: :func:`chain`, :func:`partition`, :func:`masked`,
  :func:`freeze`, :func:`identity`, :func:`set_to_zero`;
* :mod:`graphkit.transforms.wrappers`: :func:`multi_steps`, :func:`apply_if_finite`,
  :func:`lookahead`;
* :mod:`graphkit.transforms.scaling`: :func:`scale_by_learning_rate`, :func:`scale`,
  :func:`add_decayed_weights`;
* :mod:`graphkit.transforms.clipping`: :func:`clip`, :func:`clip_by_global_norm`,
  :func:`adaptive_clip`;
* :mod:`graphkit.transforms.averaging`: :func:`ema`, :func:`ema_weights`;
* :mod:`graphkit.transforms.rules`: the named optimizers' rules, :func:`trace` and the
  ``scale_by_*`` transformations (:mod:`graphkit.optimizers` chains them).
"""

from __future__ import annotations

from graphkit.transforms.averaging import ema, ema_weights
from graphkit.transforms.base import (
    OPEN,
    Emitter,
    Field,
    GradientTransformation,
    Scripted,
    Tensors,
    WeightInfo,
    _rebuild,  # noqa: F401  (pickles written before the split name graphkit.transforms._rebuild)
    apply_updates,
    emit_all,
    factory,
)
from graphkit.transforms.clipping import adaptive_clip, clip, clip_by_global_norm
from graphkit.transforms.combine import (
    Chain,
    Labels,
    Partition,
    chain,
    freeze,
    identity,
    masked,
    partition,
    set_to_zero,
)
from graphkit.transforms.rules import (
    scale_by_adadelta,
    scale_by_adafactor,
    scale_by_adagrad,
    scale_by_adam,
    scale_by_lion,
    scale_by_radam,
    scale_by_rms,
    scale_by_trust_ratio,
    trace,
)
from graphkit.transforms.scaling import (
    add_decayed_weights,
    check_learning_rate,
    scale,
    scale_by_learning_rate,
)
from graphkit.transforms.wrappers import (
    ApplyIfFinite,
    Lookahead,
    MultiSteps,
    apply_if_finite,
    lookahead,
    multi_steps,
)

__all__ = [
    "OPEN",
    "ApplyIfFinite",
    "Chain",
    "Emitter",
    "Field",
    "GradientTransformation",
    "Labels",
    "Lookahead",
    "MultiSteps",
    "Partition",
    "Scripted",
    "Tensors",
    "WeightInfo",
    "adaptive_clip",
    "add_decayed_weights",
    "apply_if_finite",
    "apply_updates",
    "chain",
    "check_learning_rate",
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
    "scale_by_adadelta",
    "scale_by_adafactor",
    "scale_by_adagrad",
    "scale_by_adam",
    "scale_by_learning_rate",
    "scale_by_lion",
    "scale_by_radam",
    "scale_by_rms",
    "scale_by_trust_ratio",
    "set_to_zero",
    "trace",
]
