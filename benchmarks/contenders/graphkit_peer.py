"""graphkit's contenders (the driver's environment, ``.venv``): the workload's ONNX graph
trained by

* ``full``: full training, one run per epoch (the whole epoch in one ONNX ``Scan``),
  ``OrtGradientOptimizer(steps_per_run="epoch")``;
* ``fwd_bwd``: ``OrtGradientForwardBackwardOptimizer`` (a forward and a
  backward call per batch);

each on a backend of ``graphkit.backends``: ``ort_training`` or ``native``
(``<kind>:<backend>``), on the workload's device (``device="cuda"`` needs a CUDA build of
onnxruntime: ``onnxruntime-gpu`` for the native backend). Both trainers compute every
batch's loss; the epoch returns the mean of the last epoch's batch losses.

The weights to train are named (the workload's weights, those the peers train):
graphkit's default rule (``graphkit.parameters``) takes an initializer read by ``Add``
input 1 (the transformer's learned positions) or by ``Slice`` (torch's export of an LSTM
or a GRU, either direction, reorders its gate weights with Slice + Concat) for a
constant, and would leave them out.
"""

from __future__ import annotations

import onnx
from spec import Spec

import graphkit as gk
from graphkit import optimizers
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    found = []
    for package in ("onnxruntime-training-cpu", "onnxruntime", "onnxruntime-gpu", "onnx-ad"):
        try:
            found.append(f"{package} {version(package)}")
        except PackageNotFoundError:
            pass
    return ", ".join(found)


VERSION = _version()

# the workload's loss (spec.py) -> graphkit's registered loss computing the same mean
LOSSES = {"mse": "squared_error", "ce": "cross_entropy", "token_ce": "token_cross_entropy"}


def make(kind: str, spec: Spec):
    mode, backend = kind.split(":")
    model = onnx.load(spec.model_path)
    weights = list(spec.weights)
    loss = LOSSES[spec.loss]
    if spec.optimizer == "sgd":
        rate = optimizers.sgd(learning_rate=spec.lr)
    else:
        rate = optimizers.adamw(weight_decay=spec.weight_decay, learning_rate=spec.lr)
    common = dict(
        max_iter=1,
        batch_size=spec.batch_size,
        learning_rate=rate,
        shuffle=False,
        warm_start=True,
        validation_every=0,
        backend=backend,
        device=spec.device,
    )
    if mode == "full":
        trainer = OrtGradientOptimizer(
            gk.add_loss_output(model, loss), weights, steps_per_run="epoch", **common
        )
    elif mode == "fwd_bwd":
        trainer = OrtGradientForwardBackwardOptimizer(model, weights, learning_loss=loss, **common)
    else:
        raise ValueError(kind)

    def epoch() -> float:
        trainer.fit(spec.X, spec.y)
        return trainer.train_losses_[-1]

    return epoch
