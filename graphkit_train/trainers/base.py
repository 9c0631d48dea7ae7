"""The trainer both trainers share: :class:`BaseTrainer` composes one class per concept.

* the training loop (:class:`graphkit_train.trainers.loop.TrainingLoop`: epochs, their
  batches, the rollback on NaN, early stopping, the callback, checkpoints written);
* the checks of the data ``fit`` takes (:class:`graphkit_train.trainers.fit_data.FitData`);
* the held-out loss and early stopping (:mod:`graphkit_train.trainers.held_out`);
* where the state of a ``fit`` starts (resume, warm start) and pickling
  (:class:`graphkit_train.trainers.checkpointing.Checkpointing`);
* the exports of the trained model (:class:`graphkit_train.trainers.exports.ModelExports`);
* the engine side (:class:`graphkit_train.engine.resident.ResidentState`: the weights
  and optimizer state in two alternating buffer sets of a resident session, read and
  written by ``get_state``, ``set_state`` and the checkpoint files);
* the estimator protocol (:class:`graphkit_train.trainers.estimator.EstimatorMixin`) and
  the scikit-learn parameter protocol (:class:`graphkit_train.trainers.params.ParamsMixin`),
  whose parameters are described once in :mod:`graphkit_train.trainers.shared`.

A subclass builds its graphs (:meth:`BaseTrainer._build`) and says how one batch runs
(:meth:`BaseTrainer._run_batch`).
"""

from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx

from graphkit.losses import Loss
from graphkit.training.batches import Rows
from graphkit.transforms import GradientTransformation
from graphkit.update_step import UpdateStep
from graphkit_train.engine.resident import ResidentState
from graphkit_train.trainers.checkpointing import Checkpointing
from graphkit_train.trainers.estimator import EstimatorMixin
from graphkit_train.trainers.exports import ModelExports
from graphkit_train.trainers.fit_data import FitData
from graphkit_train.trainers.heads import Head
from graphkit_train.trainers.held_out import HeldOut
from graphkit_train.trainers.loop import TrainingLoop
from graphkit_train.trainers.params import ParamsMixin
from graphkit_train.trainers.shared import check_common_params

logger = logging.getLogger(__name__)


class BaseTrainer(
    ParamsMixin,
    ResidentState,
    EstimatorMixin,
    TrainingLoop,
    FitData,
    HeldOut,
    Checkpointing,
    ModelExports,
    ABC,
):
    """Mini-batch training around a resident session; see the module docstring.

    Subclasses set in ``_build``: ``update_step_`` (an :class:`UpdateStep`),
    ``_resident_session``, ``_input_values`` (the model's inputs, in graph order),
    ``_label_value``, ``_weight_dtype``, ``_accepts_sample_weight``,
    ``_requires_sample_weight``,
    ``_providers``, ``_ort_device``, ``_device_id``; and implement ``_run_batch``,
    ``_predict_outputs``, ``_loss``, ``_prediction_model`` and ``_graphs``.
    """

    exc: bool = True  # raise ConvergenceError on NaN (forward/backward can warn instead)

    # the constructor's parameters both trainers take (``_store_params`` sets them)
    model_onnx: Any
    weights_to_train: list[str] | None
    loss_output_name: str
    max_iter: int
    batch_size: int
    device: str
    warm_start: bool
    verbose: int
    validation_every: float | int
    shuffle: bool | None
    random_state: int | None
    early_stopping: bool
    validation_fraction: float
    n_iter_no_change: int
    tol: float
    distributed: bool
    intra_op_num_threads: int | None
    execution_mode: str
    backend: str | None
    untie_shared_weights: bool
    tie_weights: bool
    train_mode: bool | None
    rollback: str
    # set by ``_build``
    learning_rate_: GradientTransformation
    _label_value: onnx.ValueInfoProto
    _weight_dtype: np.dtype
    _accepts_sample_weight: bool
    _requires_sample_weight: bool

    # -- building --------------------------------------------------------------------------

    def _invalidate(self) -> None:
        # a parameter that rebuilds the graphs (the schedule, the optimizer) changed after
        # a fit: warm_start=True then continues from that fit's weights (see _carry_over)
        self._carried: tuple[Any, ...] | None = self._carried_state()
        self._built = False
        self._buffers: list[dict[str, Any]] | None = None
        self._current = 0
        self._rng: np.random.Generator | None = None
        self._probed_classes: int | None = None
        self._heads: list[Head] | None = None  # a loss per output (set by _build)
        self._streamed_sizes: set[int] = set()

    @abstractmethod
    def _build(self) -> None:
        """Build graphs and sessions from the parameters (once; see ``_invalidate``)."""

    def _check_loop_params(self) -> None:
        check_common_params(self)

    # -- the loop --------------------------------------------------------------------------

    def fit(
        self,
        X: Any,
        y: Any = None,
        sample_weight: Any = None,
        X_val: Any = None,
        y_val: Any = None,
        callback: Callable[[int, dict[str, float | None], BaseTrainer], Any] | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 1,
    ) -> BaseTrainer:
        """Train for ``max_iter`` epochs of mini-batches: of in-memory arrays,
        ``fit(X, y)`` (cut into ``batch_size`` rows, shuffled every epoch unless
        ``shuffle=False``), or of batches streamed from an iterable, ``fit(batches)``.

        Args:
            X: the features: an array for a model with one input, or a dict
                ``{input name: array}`` (as onnxruntime's feeds) for a model with several
                (every array with one row per sample; integer inputs such as token ids
                are fed, never differentiated). Or, with ``y`` left out, data that does
                not fit in memory: an iterable of ``(X, y)`` or ``(X, y, sample_weight)``
                batches (a list, a generator, a ``torch.utils.data.DataLoader``), or a
                function returning a fresh one. One pass is one epoch (a one-shot
                generator allows ``max_iter=1`` only); the order and the batch sizes are
                the iterable's, so ``shuffle``, ``batch_size`` and ``steps_per_run`` do
                not apply, and streamed data runs batch by batch (the whole-epoch
                ``Scan`` needs the rows in memory). With the same batches in the same
                order the weights are those of ``fit(X, y)`` with ``shuffle=False``. See
                :mod:`graphkit_train.trainers.streaming`.
            y: the labels, shaped like the prediction for a regression (``(N, k)`` for k
                outputs; ``(N,)`` or ``(N, 1)`` for one), class indices ``(N,)`` for a
                classification. For a graph with a loss per output
                (``add_loss_output(onx, {output: loss, ...})``), a dict ``{output name:
                labels}`` with the labels of every head, each as its loss takes them.
                None for streamed batches, which hold their labels (a dict too).
            sample_weight: one weight per sample, when the loss takes them (streamed
                batches hold theirs: ``(X, y, sample_weight)``).
            X_val, y_val: held-out data (``X_val`` in the form of ``X``), scored every
                ``validation_every`` epochs (and every epoch for ``early_stopping``, which
                otherwise holds out ``validation_fraction`` of the rows; streamed training
                data needs ``X_val``). ``X_val`` may be an iterable of batches too
                (``y_val`` None).
            callback: called after every epoch as ``callback(epoch, losses, trainer)``
                with ``losses = {"train": ..., "validation": ... or None}``; returning
                True stops training.
            checkpoint: a file to write a checkpoint to every ``checkpoint_every``
                epochs and at the end (:meth:`save_checkpoint`). When the file exists,
                training resumes from it and runs the epochs left to ``max_iter``: a
                killed run, started again with the same call, ends with the weights an
                uninterrupted run would have (for streamed data, if the iterable yields
                the same batches in each epoch).

        Raises:
            ConvergenceError: the loss of an epoch is NaN, infinite, or negative for a
                loss that cannot be (probabilities outside [0, 1]), or an update left a
                weight or an optimizer-state value inf or NaN (checked at the end of
                every epoch, before any checkpoint is written); the weights and the
                optimizer state are restored to the end of the last good epoch (with
                ``exc=False``, a warning instead, and training stops). Any error during
                a streamed epoch (a bad batch, the iterable's own) restores them too.
            ShapeError: one array given to a model with several inputs (it names them
                and says to pass a dict), arrays with different numbers of rows, or labels
                of another width than the prediction (it names both shapes).
            UnknownNameError: a dict of inputs missing one or naming an unknown one.
            ValueError: class labels outside the model's classes, a one-shot iterator
                with ``max_iter`` > 1, a batch that is no ``(X, y[, w])`` tuple, and
                other bad input. Errors about a streamed batch name it (counted from 0)
                and its epoch.
        """
        start, built = time.perf_counter(), self._built
        self._build()
        if not built:
            backend = getattr(getattr(self, "_backend", None), "name", None)
            logger.info(
                "%s: graphs built with the %s backend in %.2f s",
                type(self).__name__,
                backend,
                time.perf_counter() - start,
            )
        run = self._start_fit(
            (X, y, sample_weight), (X_val, y_val), checkpoint, checkpoint_every, callback
        )
        start = time.perf_counter()
        self._run_epochs(run)
        logger.info(
            "%s: %d epochs in %.2f s, last train loss %s",
            type(self).__name__,
            self.n_iter_,
            time.perf_counter() - start,
            f"{self.train_losses_[-1]:.6g}" if self.train_losses_ else None,
        )
        self._keep_best(run)
        return self

    # -- one batch ------------------------------------------------------------------------

    @abstractmethod
    def _gradients(self, X: Rows, y: np.ndarray, w: np.ndarray | None) -> tuple[Any, dict]:
        """``(loss, {weight: gradient})`` of one batch as OrtValues (weights unchanged)."""

    @abstractmethod
    def _run_batch(self, binding: Any, X: Rows, y: np.ndarray, w: np.ndarray | None) -> None:
        """One training step on a batch; ``binding`` reads the current resident set."""

    # -- subclass hooks --------------------------------------------------------------------

    update_step_: UpdateStep
    loss_: Loss | None
    """The loss the trainer minimizes, resolved for the prediction (None when unknown:
    a custom loss or a graph not made by ``add_loss_output``)."""
    _prediction_shape: tuple[int | str, ...]

    @abstractmethod
    def _predict_outputs(self, X: Rows) -> np.ndarray:
        """The prediction output for checked features, with the current weights."""

    @abstractmethod
    def _loss(self, X: Rows, y: np.ndarray, w: np.ndarray | None) -> float:
        """The loss on checked data, with the current weights."""

    @abstractmethod
    def _prediction_model(self) -> onnx.ModelProto:
        """The prediction graph, weights as initializers."""

    @abstractmethod
    def _graphs(self) -> dict[str, onnx.ModelProto]:
        """Every graph the trainer runs, by name (for ``save_onnx_graph``)."""
