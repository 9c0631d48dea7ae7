"""The training loop both trainers share.

:class:`BaseTrainer` is three parts: the loop (here: epochs, the per-epoch loss
read-back, the rollback on NaN, early stopping, checkpoints, callbacks, exports and
pickling), the engine side (:class:`graphkit_train.engine.resident.ResidentState`: the weights
and optimizer state in two alternating buffer sets of a resident session) and the
estimator protocol (:class:`graphkit_train.trainers.estimator.EstimatorMixin`). A subclass says
how one batch runs (:meth:`BaseTrainer._run_batch`).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from graphkit.compat import load_model
from graphkit.errors import ConvergenceError
from graphkit.losses import REGRESSION, Loss, check_class_labels
from graphkit.parameters import untie_constants, untie_shared_parameters
from graphkit.rewrite import set_weights
from graphkit.training.batches import NamedRows, Rows, epoch_batches
from graphkit.transforms import GradientTransformation, ema_weights
from graphkit.update_step import LOSS_SUM, STEP, UpdateStep
from graphkit_train.distributed import ProcessGroup, digest, shard
from graphkit_train.engine.resident import ResidentState
from graphkit_train.progress import EpochProgress
from graphkit_train.trainers.estimator import EstimatorMixin
from graphkit_train.trainers.heads import Head, check_head_labels
from graphkit_train.trainers.params import (
    ParamsMixin,
    as_state,
    check_inputs,
    check_label_width,
    check_labels,
    check_loop_param,
    check_sample_weight,
    validation_period,
)
from graphkit_train.trainers.streaming import (
    SPECIALIZED_SIZES,
    BatchSource,
    in_batch,
    is_batch_source,
    torch_dataset_hint,
    unpack_batch,
)

logger = logging.getLogger(__name__)


class BaseTrainer(ParamsMixin, ResidentState, EstimatorMixin, ABC):
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
        fitted = getattr(self, "_buffers", None) is not None and getattr(self, "_built", False)
        self._carried: tuple[Any, ...] | None = (
            (self.get_state(), self.train_losses_, self.validation_losses_, self._rng)
            if fitted
            else None
        )
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
        check_loop_param("max_iter", self.max_iter)
        check_loop_param("batch_size", self.batch_size)
        check_loop_param("n_iter_no_change", self.n_iter_no_change)
        if not 0 < self.validation_fraction < 1:
            raise ValueError(
                f"validation_fraction must lie in (0, 1), got {self.validation_fraction!r}."
            )
        if self.tol < 0:
            raise ValueError(f"tol must be >= 0, got {self.tol!r}.")

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
        try:
            for epoch in range(run.first_epoch, run.max_iter):
                if self._fit_epoch(epoch, run):
                    break
        finally:
            if run.progress is not None:
                run.progress.close()
        logger.info(
            "%s: %d epochs in %.2f s, last train loss %s",
            type(self).__name__,
            self.n_iter_,
            time.perf_counter() - start,
            f"{self.train_losses_[-1]:.6g}" if self.train_losses_ else None,
        )
        if run.stopper is not None and run.stopper.best is not None:
            self._restore(run.stopper.best)
            self.best_loss_ = run.stopper.best_loss
        return self

    def _start_fit(
        self,
        train: tuple[Any, Any, Any],
        held_out: tuple[Any, Any],
        checkpoint: str | os.PathLike[str] | None,
        checkpoint_every: int,
        callback: Callable[..., Any] | None,
    ) -> _FitRun:
        """Check the arguments and the data, resume or start the state: what the epochs
        of one ``fit`` share."""
        if checkpoint is not None and self.distributed:
            raise ValueError("checkpoint= is not supported with distributed=True yet.")
        check_loop_param("checkpoint_every", checkpoint_every)
        stream = self._stream(train)
        resumed = checkpoint is not None and os.path.exists(checkpoint)
        if resumed and checkpoint is not None:  # (resumed says it is not None)
            self.load_checkpoint(checkpoint)
            logger.info(
                "resumed from %s after epoch %d", os.fspath(checkpoint), len(self.train_losses_)
            )
        group = self._group = ProcessGroup() if self.distributed else None
        seed = self.random_state if group is None else group.broadcast_seed(self.random_state)
        max_iter = check_loop_param("max_iter", self.max_iter)
        batch_size = check_loop_param("batch_size", self.batch_size)
        if stream is None:
            X, y, w, validation = self._checked_data(train, held_out, group, seed, batch_size)
            if isinstance(X, np.ndarray) and X.ndim == 2:  # one input (scikit-learn's habit)
                self.n_features_in_ = int(X.shape[1])
            self._fit_feature_names(train[0], held_out[0])
            # as scikit-learn's MLP: a batch holds at most every row (a larger batch_size
            # would size the fused epoch's batches, and their buffers, by itself)
            batch_size = min(batch_size, len(X))
        else:  # the batches are checked as they come
            X = y = w = None  # type: ignore[assignment]
            validation = self._checked_held_out(held_out)
            if validation is None and self.early_stopping:
                raise ValueError(
                    "early_stopping=True on streamed batches needs held-out data: pass X_val "
                    "(an iterable of batches, or arrays with y_val); there are no rows to hold "
                    "out validation_fraction of."
                )
        first_epoch = len(self.train_losses_) if resumed else 0
        early = self.early_stopping
        period = 1 if early else validation_period(self.validation_every, max_iter)
        self._refuse_one_shot(stream, validation, first_epoch, max_iter, period)
        if self.warm_start and not resumed and not self._fitted and self._carried is not None:
            self._carry_over()
        self._carried = None
        if not ((self.warm_start or resumed) and self._fitted):
            self._allocate(self.update_step_.initial)
            self.train_losses_ = []
            self.validation_losses_ = []
            self._rng = np.random.default_rng(seed)
        if self._rng is None:  # state loaded with set_state()
            self._rng = np.random.default_rng(seed)
        shows = self.verbose and (group is None or group.rank == 0)
        self.n_iter_ = 0
        if group is None and stream is None:
            self._prepare_epochs(X, y, w, batch_size)
        return _FitRun(
            data=(X, y, w),
            validation=validation,
            group=group,
            batch_size=batch_size,
            max_iter=max_iter,
            first_epoch=first_epoch,
            period=period,
            stopper=_EarlyStopping(self.n_iter_no_change, self.tol) if early else None,
            progress=EpochProgress(max_iter) if shows else None,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
            callback=callback,
            stream=stream,
        )

    def _carry_over(self) -> None:
        """Start from the state of the fit before the parameters changed: the weights,
        ``step`` and the optimizer state entries the new step still has (same name and
        shape; a new optimizer's own state starts at its initial value), the loss
        history and the shuffling generator."""
        state, train_losses, validation_losses, rng = self._carried  # type: ignore[misc]
        step = self.update_step_
        expected = step.public({n: step.initial[n] for n in [*step.weights, *step.state, STEP]})
        kept = {n: v for n, v in state.items() if n in expected and v.shape == expected[n].shape}
        self.set_state(kept)
        self.train_losses_ = list(train_losses)
        self.validation_losses_ = list(validation_losses)
        self._rng = rng

    def _stream(self, train: tuple[Any, Any, Any]) -> BatchSource | None:
        """The source of streamed batches ``fit(batches)`` was given (None for
        in-memory data), refused where streaming does not apply."""
        X, y, w = train
        if y is not None:
            self._refuse_labels_beside_batches(X, "X", "y")
            return None
        hint = torch_dataset_hint(X)
        if hint:
            raise TypeError(hint)
        if not is_batch_source(X):
            return None  # arrays without y: the checks say y is required
        if w is not None:
            raise ValueError(
                "sample_weight= is for in-memory data; streamed batches hold their sample "
                "weights: yield (X, y, sample_weight) tuples."
            )
        if self.distributed:
            raise ValueError(
                "distributed=True trains on in-memory arrays (every rank passes the same X "
                "and y); streamed batches are not supported with distributed training yet."
            )
        if self.shuffle is True:
            warnings.warn(
                "shuffle=True does not apply to streamed batches: they are trained in the "
                "order the iterable yields them. Shuffle in the iterable (torch's "
                "DataLoader(..., shuffle=True)), or leave shuffle unset.",
                UserWarning,
                stacklevel=4,  # at the caller of fit
            )
        return BatchSource(X, "X")

    @staticmethod
    def _refuse_labels_beside_batches(X: Any, x_name: str, y_name: str) -> None:
        """Refuse labels given beside an iterable of batches (a list stays rows)."""
        if is_batch_source(X) and not isinstance(X, (list, tuple)):
            raise ValueError(
                f"{x_name} is an iterable of batches ({type(X).__name__}), which hold their "
                f"labels: leave {y_name} out and yield ({x_name}, y) or ({x_name}, y, "
                "sample_weight) tuples."
            )

    def _checked_held_out(self, held_out: tuple[Any, Any]) -> Any:
        """The held-out data: ``(X, y, None)`` checked, a :class:`BatchSource`, or None."""
        X_val, y_val = held_out
        if X_val is None:
            return None
        if y_val is not None:
            self._refuse_labels_beside_batches(X_val, "X_val", "y_val")
            return self._check(X_val, y_val, None, "X_val", "y_val")
        if not is_batch_source(X_val):
            raise ValueError("X_val is given without y_val.")
        if self.distributed:
            raise ValueError(
                "X_val as an iterable of batches is not supported with distributed=True yet; "
                "pass arrays X_val and y_val."
            )
        return BatchSource(X_val, "X_val")

    @staticmethod
    def _refuse_one_shot(
        stream: BatchSource | None, validation: Any, first: int, max_iter: int, period: int
    ) -> None:
        """Refuse, before training, a one-shot iterator that would be read again."""
        if stream is not None:
            done = f" ({first} epochs done)" if first else ""
            stream.refuse_passes(max_iter - first, f"max_iter={max_iter}{done}")
        if isinstance(validation, BatchSource) and period:
            reads = sum(1 for e in range(first, max_iter) if (e + 1) % period == 0)
            validation.refuse_passes(reads, f"validating every {period} epoch(s)")

    def _fit_epoch(self, epoch: int, run: _FitRun) -> bool:
        """One epoch of ``fit`` and what follows it (validation, progress, early stopping,
        the callback, the checkpoint); whether training stops."""
        snapshot = {name: value.numpy().copy() for name, value in self._resident.items()}
        shuffling = None if self._rng is None else self._rng.bit_generator.state
        self._resident[LOSS_SUM].update_inplace(np.zeros_like(snapshot[LOSS_SUM]))
        batches = None
        try:
            if run.stream is None:
                loss = self._run_epoch(*run.data, run.batch_size, run.group)
            else:
                loss, batches = self._run_stream(run, epoch)
        except KeyboardInterrupt:
            # Ctrl-C: the state of the last finished epoch, its shuffling generator
            # included, so that a checkpoint saved now resumes exactly
            self._restore(snapshot, shuffling)
            raise
        except Exception:
            # a bad streamed batch, the iterable's own error: the last good epoch; a
            # batch of in-memory rows that failed in onnxruntime changed nothing, and the
            # weights stay those of the batches before it
            if run.stream is not None:
                self._restore(snapshot, shuffling)
            raise
        problem = self._loss_problem(loss)
        # a last update can overflow while the loss it was computed with is finite
        overflow = None if problem else self._non_finite_state()
        if problem or overflow:
            self._restore(snapshot)
            if overflow:
                message = (
                    f"{overflow} became non-finite (inf or nan) during epoch "
                    f"{len(self.train_losses_) + 1} while the loss stayed finite "
                    f"({loss:.6g}): an update overflowed. Lower the learning rate or scale "
                    "the features; the weights and optimizer state are those of the "
                    "previous epoch."
                )
            else:
                message = (
                    f"The loss became {loss:.6g} during epoch {len(self.train_losses_) + 1}"
                    f"{problem}; the weights and optimizer state are those of the previous "
                    "epoch."
                )
            if self.exc:
                raise ConvergenceError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)  # at the caller of fit
            return True
        held_out = None
        if run.validation is not None and run.period and (epoch + 1) % run.period == 0:
            try:  # a bad held-out batch: the epoch is not kept either
                held_out = self._held_out_loss(run.validation, run.group)
            except BaseException:
                self._restore(snapshot, shuffling)
                raise
            self.validation_losses_.append(held_out)
        self.train_losses_.append(loss)
        self.n_iter_ += 1
        if run.progress is not None:
            lr = self.learning_rate_.learning_rate_at(int(self._resident[STEP].numpy()))
            run.progress.update(epoch + 1, loss, held_out, lr, batches)
        if run.stopper is not None and run.stopper.done(held_out, self):  # type: ignore[arg-type]
            return True
        stop = bool(
            run.callback is not None
            and run.callback(epoch + 1, {"train": loss, "validation": held_out}, self)
        )
        if run.checkpoint is not None and (
            stop or epoch + 1 == run.max_iter or (epoch + 1) % run.checkpoint_every == 0
        ):
            self.save_checkpoint(run.checkpoint)
        return stop if run.group is None else run.group.any(stop)

    def _checked_data(
        self,
        train: tuple[Any, Any, Any],
        held_out: tuple[Any, Any],
        group: ProcessGroup | None,
        seed: int | None,
        batch_size: int,
    ) -> tuple[Rows, np.ndarray, np.ndarray | None, tuple[Any, ...] | None]:
        """``(X, y, w, validation)`` checked; in distributed training a failure on one
        rank stops every rank with that rank's message."""
        failure: BaseException | None = None
        try:
            X, y, w = self._check(*train)
            validation = self._checked_held_out(held_out)
            if validation is None and self.early_stopping:
                X, y, w, validation = self._hold_out(X, y, w, seed)
            if group is not None and len(X) < group.world_size:
                raise ValueError(
                    f"{len(X)} training rows for {group.world_size} ranks: every rank needs "
                    "at least one row; use fewer processes."
                )
            self._check_outputs(X[:batch_size], y)
        except Exception as exc:
            if group is None:
                raise
            failure = exc
        if group is not None:
            group.raise_if_any_failed(failure)
            group.check_same(self._digest(), "the model and its initial weights")
        return X, y, w, validation

    def _run_epoch(
        self,
        X: Rows,
        y: np.ndarray,
        w: np.ndarray | None,
        batch_size: int,
        group: ProcessGroup | None,
    ) -> float:
        """One pass over the rows (this rank's share of them); the mean batch loss."""
        shuffles = self.shuffle is None or bool(self.shuffle)  # None: the default, True
        order = self._rng.permutation(len(X)) if shuffles else None  # type: ignore[union-attr]
        if group is None:
            return self._run_rows(X, y, w, order, batch_size)
        order = shard(np.arange(len(X)) if order is None else order, *group.place)
        return self._run_steps(X, y, w, order, batch_size, group)

    def _prepare_epochs(
        self, X: Rows, y: np.ndarray, w: np.ndarray | None, batch_size: int
    ) -> None:
        """Called once per ``fit`` before the first epoch, with the training data
        (subclasses that bind the whole data once do it here)."""

    def _run_rows(
        self,
        X: Rows,
        y: np.ndarray,
        w: np.ndarray | None,
        order: np.ndarray | None,
        batch_size: int,
    ) -> float:
        """One epoch over the rows in ``order`` (all rows in order when None); the mean
        batch loss. Here one run per batch; full training overrides it."""
        return self._run_steps(X, y, w, order, batch_size, None)

    def _run_steps(
        self,
        X: Rows,
        y: np.ndarray,
        w: np.ndarray | None,
        order: np.ndarray | None,
        batch_size: int,
        group: ProcessGroup | None,
    ) -> float:
        """One run of the resident session per batch."""
        bindings, run_batch = self._bindings, self._run_batch  # the hot loop: no lookups
        batches = 0
        for X_batch, y_batch, w_batch in epoch_batches(X, y, w, order, batch_size):
            if group is None:
                run_batch(bindings[self._current], X_batch, y_batch, w_batch)
            else:
                self._run_batch_distributed(group, X_batch, y_batch, w_batch)
            self._current = 1 - self._current
            batches += 1
        return float(self._resident[LOSS_SUM].numpy()) / batches

    def _run_stream(self, run: _FitRun, epoch: int) -> tuple[float, int]:
        """One pass over the streamed batches (``epoch`` counted from 0): the mean batch
        loss and the number of batches."""
        stream, progress = run.stream, run.progress
        batches, length = stream.epoch()  # type: ignore[union-attr]
        if progress is not None:
            progress.start_epoch(length)
        specializes, run_streamed = self._specializes, self._run_streamed
        count = 0
        for index, batch in enumerate(batches):
            where = f"training batch {index} (counted from 0) of epoch {epoch + 1}"
            X, y, w = self._checked_batch(batch, where, first=not run.checked)
            run.checked = True
            run_streamed(self._bindings[self._current], X, y, w, specializes(len(X)))
            self._current = 1 - self._current
            count += 1
            if progress is not None:
                progress.batch()
        if not count:
            raise stream.empty(epoch + 1)  # type: ignore[union-attr]
        return float(self._resident[LOSS_SUM].numpy()) / count, count

    def _checked_batch(
        self, batch: Any, where: str, first: bool = False
    ) -> tuple[Rows, np.ndarray, np.ndarray | None]:
        """``(X, y, w)`` of a streamed batch, checked as ``fit(X, y)`` checks its data
        (and, ``first`` in a fit, what the model's output tells); errors name ``where``."""
        try:
            X, y, w = self._check(*unpack_batch(batch, where))
            if first:
                if isinstance(X, np.ndarray) and X.ndim == 2:
                    self.n_features_in_ = int(X.shape[1])
                self._check_outputs(X, y)
        except (ValueError, TypeError, KeyError) as exc:
            raise in_batch(exc, where) from None
        return X, y, w

    def _specializes(self, rows: int) -> bool:
        """Whether a streamed batch of ``rows`` rows runs a graph specialized to its size:
        the first :data:`~graphkit_train.trainers.streaming.SPECIALIZED_SIZES` sizes do."""
        sizes = self._streamed_sizes
        if rows in sizes:
            return True
        if len(sizes) < SPECIALIZED_SIZES:
            sizes.add(rows)
            return True
        return False

    def _run_streamed(
        self, binding: Any, X: Rows, y: np.ndarray, w: np.ndarray | None, specialized: bool
    ) -> None:
        """One streamed batch; ``specialized``: through a graph built for its size."""
        self._run_batch(binding, X, y, w)

    def _hold_out(
        self, X: Rows, y: np.ndarray, w: np.ndarray | None, seed: int | None
    ) -> tuple[Rows, np.ndarray, np.ndarray | None, tuple[Any, ...]]:
        """Split ``validation_fraction`` of the rows off for early stopping (seeded by
        ``random_state``, as scikit-learn's MLP does)."""
        n_val = int(round(self.validation_fraction * len(X)))
        if n_val < 1 or n_val >= len(X):
            raise ValueError(
                f"early_stopping holds out validation_fraction={self.validation_fraction} of "
                f"{len(X)} rows, which leaves {n_val} rows to validate on: pass more data, "
                "another fraction, or X_val and y_val."
            )
        order = np.random.default_rng(seed).permutation(len(X))
        val, train = order[:n_val], order[n_val:]
        held = (X[val], y[val], None if w is None else w[val])
        return X[train], y[train], None if w is None else w[train], held

    def _held_out_loss(self, validation: tuple[Any, ...], group: ProcessGroup | None) -> float:
        """The held-out loss; in distributed training each rank scores its share of the
        rows and the shares are averaged by their weight."""
        if isinstance(validation, BatchSource):
            return self._streamed_loss(validation)
        if group is None:
            return self._loss(*validation)
        X, y, w = validation
        rows = np.array_split(np.arange(len(X)), group.world_size)[group.rank]
        weight = float(len(rows) if w is None else w[rows].sum())
        value = self._loss(X[rows], y[rows], None if w is None else w[rows]) if weight else 0.0
        return group.weighted_mean(value, weight)

    def _streamed_loss(self, source: BatchSource) -> float:
        """The loss on held-out batches: the batch losses weighted by each batch's total
        sample weight (its rows when unweighted), that is the loss of all the rows for
        a mean loss (their sum for a loss whose reduction is ``"sum"``)."""
        epoch = len(self.train_losses_) + 1  # scored before the epoch's loss is kept
        summed = self._reduction() == "sum"
        total = weight = 0.0
        count = 0
        batches, _ = source.epoch()
        for index, batch in enumerate(batches):
            where = f"held-out batch {index} (counted from 0) after epoch {epoch}"
            X, y, w = self._checked_batch(batch, where)
            rows = float(len(X) if w is None else w.sum(dtype=np.float64))
            loss = self._loss(X, y, w)
            total += loss if summed else loss * rows
            weight += rows
            count += 1
        if not count:
            raise source.empty(epoch)
        return total if summed else total / weight

    def _reduction(self) -> str | None:
        """The loss's reduction ("mean", "sum"...; None for a custom loss), the heads'
        for a graph with a loss per output (add_loss_output refuses mixed ones)."""
        heads = getattr(self, "_heads", None)
        loss = heads[0].loss if heads else getattr(self, "loss_", None)
        return None if loss is None else loss.reduction

    def _digest(self) -> str:
        """A hash of the model and the initial weights (every rank must hold the same)."""
        model = load_model(self.model_onnx).SerializeToString()
        initial = self.update_step_.initial
        return digest(model, *[initial[name] for name in self.update_step_.weights])

    def _loss_problem(self, loss: float) -> str:
        """Why an epoch's loss cannot be right ("" when it can)."""
        if not np.isfinite(loss):
            return ". Lower the learning rate or scale the features"
        known = (
            [self.loss_]
            if self._heads is None
            else [h.loss for h in self._heads if h.loss is not None]
        )
        if self._heads is not None and len(known) < len(self._heads):
            known = []  # a custom loss may be negative
        if loss < 0 and known and all(k is not None and not k.is_custom for k in known):
            names = ", ".join(repr(k.name) for k in known)  # type: ignore[union-attr]
            return (
                f", below zero, which {names} cannot be: the model's outputs left the "
                "range the loss takes (probabilities outside [0, 1]). Check weights_to_train_ "
                "for a constant being trained"
            )
        return ""

    def _check_outputs(self, X: Any, y: Rows) -> None:
        """What only the model's output tells, checked on one batch ``X`` (``y``: all the
        labels): a log loss on
        probabilities refuses outputs that are not probabilities (logits or scores would
        be clipped at eps silently); a regression loss on an output whose declared shape
        does not say its values per sample refuses labels of another width."""
        if not len(X):
            return
        checks: list[tuple[Loss | None, tuple[int | str, ...], Any, str | None, str]]
        if self._heads is None:
            checks = [(self.loss_, self._prediction_shape, y, None, "y")]
        else:
            assert isinstance(y, NamedRows)  # a loss per output: the labels of every head
            checks = [
                (h.loss, h.prediction_shape, y.arrays[h.label], h.output, f"y[{h.output!r}]")
                for h in self._heads
            ]
        needed = [
            (loss, shape, labels, output, what)
            for loss, shape, labels, output, what in checks
            if loss is not None and _needs_output(loss, shape)
        ]
        if not needed:
            return
        outputs = self._probe(X, every_output=self._heads is not None)
        for loss, _, labels, output, what in needed:
            value = outputs if output is None else outputs[output]
            if loss.task == REGRESSION:
                check_label_width(what, labels, value)
                continue
            low, high = float(value.min()), float(value.max())
            if low < -1e-6 or high > 1 + 1e-6:
                of = "the model's output" if output is None else f"output {output!r}"
                raise ValueError(
                    f"The loss 'log' takes probabilities, but {of} ranges from "
                    f"{low:.4g} to {high:.4g}. For logits use 'cross_entropy'; for one raw "
                    "score use 'sigmoid_log_loss'."
                )

    @abstractmethod
    def _gradients(self, X: Rows, y: np.ndarray, w: np.ndarray | None) -> tuple[Any, dict]:
        """``(loss, {weight: gradient})`` of one batch as OrtValues (weights unchanged)."""

    @abstractmethod
    def _run_batch(self, binding: Any, X: Rows, y: np.ndarray, w: np.ndarray | None) -> None:
        """One training step on a batch; ``binding`` reads the current resident set."""

    def _check(
        self, X: Any, y: Any, sample_weight: Any, x_name: str = "X", y_name: str = "y"
    ) -> tuple[Rows, np.ndarray, np.ndarray | None]:
        """``(X, y, sample weights)`` checked: X one array for a one-input model,
        :class:`NamedRows` for several (from ``{input name: array}``)."""
        X = check_inputs(X, self._input_values, x_name, type(self).__name__)
        if self._heads is not None:
            y = check_head_labels(y, self._heads, len(X), y_name, self._n_classes)
        else:
            y = check_labels(y, self._label_value, len(X), y_name)
            if self._is_classifier() and self.loss_ is not None:
                check_class_labels(y, self._n_classes(), not self.loss_.multiclass, y_name)
        if sample_weight is None:
            if not self._requires_sample_weight:
                return X, y, None
            sample_weight = np.ones(len(X))
        elif not self._accepts_sample_weight:
            raise ValueError(
                "sample_weight given but the training graph has no sample-weight input; "
                "build it with add_loss_output(..., weight_name='weight')."
            )
        return X, y, check_sample_weight(sample_weight, len(X), self._weight_dtype)

    def get_trained_onnx(
        self, model: onnx.ModelProto | None = None, ema: bool = False
    ) -> onnx.ModelProto:
        """The prediction graph (or ``model``, e.g. the original one) with the trained
        weights, or with their moving average when ``ema`` (the optimizer's chain must
        end with :func:`graphkit.transforms.ema`)."""
        self._build()
        state = self.get_state()
        if ema:
            weights = ema_weights(state)
        else:
            weights = {n: v for n, v in state.items() if n in self.update_step_.weights}
        target = self._untied(self._prediction_model() if model is None else load_model(model))
        # a constant the exporter merged with a weight must keep its value
        return set_weights(untie_constants(target, weights), weights)

    def _untied(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """``model`` with the copies of shared weights that training made (see
        ``untie_shared_weights``), so that every trained weight is one of its
        initializers."""
        if not getattr(self, "untie_shared_weights", False):
            return model
        present = {i.name for i in model.graph.initializer}
        trained = [w for w in self.update_step_.weights if w in present]
        return untie_shared_parameters(model, trained)[0]

    def save_onnx_graph(self, export: str | os.PathLike[str] | type[bytes]) -> dict[str, Any]:
        """Export every graph the trainer uses.

        Args:
            export: a folder (created if needed) or the type ``bytes`` to serialize in
                memory.

        Returns:
            ``{name: path}`` or ``{name: serialized bytes}``; once trained, ``trained``
            is the prediction graph with the trained weights. In distributed training
            only rank 0 writes files (the other ranks return ``{}``).
        """
        self._build()
        group = getattr(self, "_group", None)
        if group is not None and group.rank != 0 and export is not bytes:
            return {}
        graphs = self._graphs()
        if self._fitted:
            graphs["trained"] = self.get_trained_onnx()
        if export is bytes:
            return {name: g.SerializeToString() for name, g in graphs.items()}
        folder = os.fspath(export)  # type: ignore[arg-type]
        os.makedirs(folder, exist_ok=True)
        paths = {}
        for name, graph in graphs.items():
            paths[name] = os.path.join(folder, f"{name}.onnx")
            onnx.save(graph, paths[name])
        return paths

    # -- pickling --------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        params = self.get_params()
        params["model_onnx"] = load_model(params["model_onnx"]).SerializeToString()
        state: dict[str, Any] = {"params": params}
        if self._built and self._fitted:
            state["trained"] = self.get_state()
            state["train_losses_"] = self.train_losses_
            state["validation_losses_"] = self.validation_losses_
            state["rng"] = self._rng.bit_generator.state if self._rng is not None else None
        # what fit learnt of the data (scikit-learn's attributes), checked at predict
        learnt = ("n_features_in_", "feature_names_in_")
        state.update({name: getattr(self, name) for name in learnt if hasattr(self, name)})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        params = dict(state["params"])
        params["model_onnx"] = onnx.load_from_string(params["model_onnx"])
        self.__init__(**params)  # type: ignore[misc]
        if "trained" in state:
            self.set_state(as_state(state["trained"]))
            self.train_losses_ = list(state["train_losses_"])
            self.validation_losses_ = list(state["validation_losses_"])
            if state["rng"] is not None:
                self._rng = np.random.default_rng()
                self._rng.bit_generator.state = state["rng"]
        for name in ("n_features_in_", "feature_names_in_"):
            if name in state:
                setattr(self, name, state[name])

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


def _needs_output(loss: Loss | None, shape: tuple[int | str, ...]) -> bool:
    """Whether checking labels for ``loss`` needs the model's output: a log loss on
    probabilities (refusing logits), a regression on an output of undeclared width."""
    if loss is None:
        return False
    unknown_width = loss.task == REGRESSION and not all(isinstance(d, int) for d in shape[1:])
    return unknown_width or loss.prediction == "probabilities"


@dataclass
class _FitRun:
    """What the epochs of one ``fit`` call share."""

    data: tuple[Rows, np.ndarray, np.ndarray | None]
    validation: tuple[Any, ...] | None
    group: ProcessGroup | None
    batch_size: int
    max_iter: int
    first_epoch: int
    period: int
    stopper: _EarlyStopping | None
    progress: EpochProgress | None
    checkpoint: str | os.PathLike[str] | None
    checkpoint_every: int
    callback: Callable[..., Any] | None
    stream: BatchSource | None = None  # fit(batches): the training batches
    checked: bool = False  # the first streamed batch was checked (what the output tells)


class _EarlyStopping:
    """Stop when the held-out loss has not improved by ``tol`` for ``patience`` epochs,
    keeping the best weights (scikit-learn's ``n_iter_no_change`` / ``tol``)."""

    def __init__(self, patience: int, tol: float) -> None:
        self.patience, self.tol = patience, tol
        self.best: dict[str, np.ndarray] | None = None
        self.best_loss = np.inf
        self.waited = 0

    def done(self, loss: float, trainer: BaseTrainer) -> bool:
        if loss < self.best_loss - self.tol:
            self.waited = 0
        else:
            self.waited += 1
        if loss < self.best_loss:
            self.best_loss = loss
            self.best = {name: v.numpy().copy() for name, v in trainer._resident.items()}
        return self.waited >= self.patience
