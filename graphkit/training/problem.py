"""One description of a full-training problem, from which every training graph is built.

A :class:`TrainingProblem` is what the fused step, the whole-epoch graph and the
portable exports are built from: the prepared training graph (its weights chosen once,
by :func:`graphkit.prepare.prepare_for_training`), the weights, the optimizer, the names
of the loss and sample-weight tensors, and the backend that differentiates. Each step
it describes is built on first use and kept::

    problem = TrainingProblem.from_model(train_onx, None, optimizers.get("adam"))
    problem.step()            # the fused step the trainer runs (weights packed)
    problem.step(pack=False)  # the same step with its state named per weight (exports)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from graphkit import backends
from graphkit.backends.base import Backend
from graphkit.gradient import reaching
from graphkit.prepare import prepare_standard_model, standard_model
from graphkit.train_mode import DROPOUT_SEED
from graphkit.training.step import TrainingStep, build_training_step
from graphkit.transforms import GradientTransformation
from graphkit.update_step import LOSS


@dataclass
class TrainingProblem:
    """What to train and how, for full training (see the module docstring).

    ``model`` is the prepared training graph and ``weights`` the chosen weights: build
    one with :meth:`from_model` from a user's graph.
    """

    model: onnx.ModelProto
    weights: list[str]
    optimizer: GradientTransformation
    loss_output_name: str = LOSS
    sample_weight_name: str | None = "weight"
    backend: str | Backend | None = None
    user_model: onnx.ModelProto | None = field(default=None, repr=False, compare=False)
    """The user's graph as graphkit trains and exports it, before the training rewrites
    (:func:`graphkit.prepare.standard_model`): what the trained weights are written into."""
    dropout_seed: np.ndarray | None = field(default=None, compare=False)
    """The seed the Dropout masks of every step built start from (an int64 scalar; None:
    0), where a layer trains in training mode (:mod:`graphkit.train_mode`): a trainer
    sets it from ``random_state``, so that a step exported before ``fit`` draws the masks
    the fit draws."""
    _steps: dict[bool, TrainingStep] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_model(
        cls,
        model: onnx.ModelProto,
        weights_to_train: Sequence[str] | str | None,
        optimizer: GradientTransformation,
        loss_output_name: str = LOSS,
        sample_weight_name: str | None = "weight",
        backend: str | Backend | None = None,
        untie_shared_weights: bool = True,
        tie_weights: bool = True,
        train_mode: bool | None = None,
    ) -> TrainingProblem:
        """The problem of training ``model`` (a graph with a loss output): its weights
        are chosen here, once (None: the model's parameters that the loss depends on,
        never its constants). ``backend`` is resolved here, once (a name, or None for
        the default), and every graph of the problem comes from that backend.
        ``untie_shared_weights``, ``tie_weights`` and ``train_mode`` are
        :func:`graphkit.prepare.prepare_for_training`'s."""
        backend = backends.get(backend)
        user_model = standard_model(model, train_mode, backend.ceiling)
        prepared, weights = prepare_standard_model(
            user_model,
            weights_to_train,
            backend,
            untie_shared_weights,
            loss_output_name,
            tie_weights=tie_weights,
        )
        if weights_to_train is None:  # the parameters of another output's head stay put
            weights = reaching(prepared, weights, [loss_output_name])
        return cls(
            prepared,
            weights,
            optimizer,
            loss_output_name,
            sample_weight_name,
            backend,
            user_model=user_model,
        )

    def step(self, pack: bool = True) -> TrainingStep:
        """The fused training step (built once per ``pack``): with ``pack``, the
        elementwise optimizer updates every weight in one run of kernels; without, its
        state is named per weight, as other runtimes and ``get_state`` name it.

        Raises:
            MissingGradientError: an operator between the weights and the loss has no
                gradient in the backend (the message names it).
        """
        packed = self._steps.get(True)
        if not pack and packed is not None and packed.packing is None:
            return packed  # nothing was packed: the same step
        if pack not in self._steps:
            step = build_training_step(
                self.model,
                self.weights,
                self.optimizer,
                self.loss_output_name,
                self.sample_weight_name,
                pack=pack,
                backend=self.backend,
            )
            if self.dropout_seed is not None and DROPOUT_SEED in step.initial:
                step.initial[DROPOUT_SEED] = np.array(self.dropout_seed, dtype=np.int64)
            self._steps[pack] = step
        return self._steps[pack]


__all__ = ["TrainingProblem"]
