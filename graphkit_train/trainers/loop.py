"""The training loop: the epochs of one ``fit``, their batches, the rollback of a bad
epoch, early stopping, and what follows each epoch (progress, the callback, the
checkpoint).

:class:`TrainingLoop` runs on the trainer's resident state
(:class:`graphkit_train.engine.resident.ResidentState`): :meth:`TrainingLoop._start_fit`
checks the data (:mod:`.fit_data`) and starts or resumes the state
(:mod:`.checkpointing`), then each :meth:`TrainingLoop._fit_epoch` runs the batches
(the subclass's ``_run_batch``; full training overrides :meth:`TrainingLoop._run_rows` to
run many batches per call), reads the epoch's loss back, restores the previous epoch
when the loss or the state went wrong (:func:`loss_problem`), scores the held-out data
(:mod:`.held_out`) and calls the callback.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from graphkit.errors import ConvergenceError
from graphkit.training.batches import Rows, epoch_batches
from graphkit.update_step import LOSS_SUM, STEP, UpdateStep
from graphkit_train.distributed import ProcessGroup, shard
from graphkit_train.progress import EpochProgress
from graphkit_train.trainers.held_out import EarlyStopping
from graphkit_train.trainers.params import check_loop_param, validation_period
from graphkit_train.trainers.streaming import SPECIALIZED_SIZES, BatchSource

if TYPE_CHECKING:
    from graphkit.losses import Loss
    from graphkit.transforms import GradientTransformation
    from graphkit_train.trainers.heads import Head

# the trainers' logger keeps the name it had when the loop was in base.py (users and
# tests select its records by that name)
logger = logging.getLogger("graphkit_train.trainers.base")


class TrainingLoop:
    """The epochs of ``fit`` (see the module docstring).

    The trainer provides the parameters (``distributed``, ``random_state``,
    ``max_iter``, ``batch_size``, ``early_stopping``, ``validation_every``, ``shuffle``,
    ``verbose``, ``n_iter_no_change``, ``tol``, ``exc``, ``rollback``), the resident
    state (``_resident``, ``_bindings``, ``_current``, ``_restore``, ``_state_views``,
    ``_restore_checkpoint``, ``_non_finite_state``),
    the checks of the data (``_stream``, ``_checked_data``, ``_checked_held_out``,
    ``_checked_batch``, ``_refuse_one_shot``), the held-out loss, the start of the state
    (``_resume``, ``_start_state``), ``save_checkpoint`` and one batch (``_run_batch``).
    """

    # what the trainer provides, declared for the type checker (none exists at run time)
    distributed: bool
    random_state: int | None
    max_iter: int
    batch_size: int
    early_stopping: bool
    validation_every: float | int
    shuffle: bool | None
    verbose: int
    n_iter_no_change: int
    tol: float
    exc: bool
    rollback: str
    update_step_: UpdateStep
    learning_rate_: GradientTransformation
    loss_: Loss | None
    train_losses_: list[float]
    validation_losses_: list[float]
    _heads: list[Head] | None
    _rng: np.random.Generator | None
    _current: int
    _bindings: list[Any]
    _streamed_sizes: set[int]

    if TYPE_CHECKING:

        @property
        def _resident(self) -> dict[str, Any]: ...

        def _restore(
            self, values: Mapping[str, np.ndarray], shuffling: Mapping[str, Any] | None = None
        ) -> None: ...

        def _non_finite_state(self) -> str | None: ...

        def _state_views(self) -> Mapping[str, np.ndarray]: ...

        def _restore_checkpoint(self, path: str | os.PathLike[str]) -> None: ...

        def save_checkpoint(self, path: str | os.PathLike[str]) -> None: ...

        def _stream(self, train: tuple[Any, Any, Any]) -> BatchSource | None: ...

        def _checked_data(
            self,
            train: tuple[Any, Any, Any],
            held_out: tuple[Any, Any],
            group: ProcessGroup | None,
            seed: int | None,
            batch_size: int,
        ) -> tuple[Rows, np.ndarray, np.ndarray | None, tuple[Any, ...] | None]: ...

        def _checked_held_out(self, held_out: tuple[Any, Any]) -> Any: ...

        def _checked_batch(
            self, batch: Any, where: str, first: bool = False
        ) -> tuple[Rows, np.ndarray, np.ndarray | None]: ...

        @staticmethod
        def _refuse_one_shot(
            stream: BatchSource | None, validation: Any, first: int, max_iter: int, period: int
        ) -> None: ...

        def _fit_feature_names(self, X: Any, X_val: Any = None) -> None: ...

        def _held_out_loss(
            self, validation: tuple[Any, ...], group: ProcessGroup | None
        ) -> float: ...

        def _resume(self, checkpoint: str | os.PathLike[str] | None) -> bool: ...

        def _start_state(self, resumed: bool, seed: int | None) -> None: ...

        def _run_batch(
            self, binding: Any, X: Rows, y: np.ndarray, w: np.ndarray | None
        ) -> None: ...

        def _run_batch_distributed(
            self, group: ProcessGroup, X: Rows, y: np.ndarray, w: np.ndarray | None
        ) -> None: ...

    def _start_fit(
        self,
        train: tuple[Any, Any, Any],
        held_out: tuple[Any, Any],
        checkpoint: str | os.PathLike[str] | None,
        checkpoint_every: int,
        callback: Callable[..., Any] | None,
    ) -> FitRun:
        """Check the arguments and the data, resume or start the state: what the epochs
        of one ``fit`` share."""
        if checkpoint is not None and self.distributed:
            raise ValueError("checkpoint= is not supported with distributed=True yet.")
        if self.rollback == "checkpoint" and checkpoint is None:
            raise ValueError(
                "rollback='checkpoint' returns a failed epoch to the last checkpoint: pass "
                "fit(..., checkpoint='run.ckpt'), or keep rollback='epoch' (a copy of the "
                "trained weights and optimizer state in memory)."
            )
        check_loop_param("checkpoint_every", checkpoint_every)
        stream = self._stream(train)
        resumed = self._resume(checkpoint)
        if resumed:
            logger.info(
                "resumed from %s after epoch %d",
                os.fspath(checkpoint),  # type: ignore[arg-type]
                len(self.train_losses_),
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
        self._start_state(resumed, seed)
        if self.rollback == "checkpoint" and not resumed:
            self.save_checkpoint(checkpoint)  # type: ignore[arg-type]  # the point to return to
        shows = self.verbose and (group is None or group.rank == 0)
        self.n_iter_ = 0
        if group is None and stream is None:
            self._prepare_epochs(X, y, w, batch_size)
        return FitRun(
            data=(X, y, w),
            validation=validation,
            group=group,
            batch_size=batch_size,
            max_iter=max_iter,
            first_epoch=first_epoch,
            period=period,
            stopper=EarlyStopping(self.n_iter_no_change, self.tol) if early else None,
            progress=EpochProgress(max_iter) if shows else None,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
            callback=callback,
            stream=stream,
        )

    def _run_epochs(self, run: FitRun) -> None:
        """The epochs of ``run``, until ``max_iter`` or a stop (the progress bar closed
        whatever happens)."""
        try:
            for epoch in range(run.first_epoch, run.max_iter):
                if self._fit_epoch(epoch, run):
                    break
        finally:
            if run.progress is not None:
                run.progress.close()

    def _keep_best(self, run: FitRun) -> None:
        """After early stopping: the best weights seen, and their held-out loss as
        ``best_loss_``."""
        if run.stopper is not None and run.stopper.best is not None:
            self._restore(run.stopper.best)
            self.best_loss_ = run.stopper.best_loss

    def _fit_epoch(self, epoch: int, run: FitRun) -> bool:
        """One epoch of ``fit`` and what follows it (validation, progress, early stopping,
        the callback, the checkpoint); whether training stops."""
        snapshot = self._rollback_point()
        shuffling = None if self._rng is None else self._rng.bit_generator.state
        self._resident[LOSS_SUM].update_inplace(np.zeros_like(self._resident[LOSS_SUM].numpy()))
        batches = None
        try:
            if run.stream is None:
                loss = self._run_epoch(*run.data, run.batch_size, run.group)
            else:
                loss, batches = self._run_stream(run, epoch)
        except KeyboardInterrupt:
            # Ctrl-C: the state of the last finished epoch, its shuffling generator
            # included, so that a checkpoint saved now resumes exactly
            self._roll_back(run, snapshot, shuffling)
            raise
        except Exception:
            # a bad streamed batch, the iterable's own error: the last good epoch; a
            # batch of in-memory rows that failed in onnxruntime changed nothing, and the
            # weights stay those of the batches before it
            if run.stream is not None:
                self._roll_back(run, snapshot, shuffling)
            raise
        problem = loss_problem(loss, self.loss_, self._heads)
        # a last update can overflow while the loss it was computed with is finite
        overflow = None if problem else self._non_finite_state()
        if problem or overflow:
            failed = len(self.train_losses_) + 1
            self._roll_back(run, snapshot)
            state = self._rolled_back_to(run)
            if overflow:
                message = (
                    f"{overflow} became non-finite (inf or nan) during epoch {failed} while "
                    f"the loss stayed finite ({loss:.6g}): an update overflowed. Lower the "
                    f"learning rate or scale the features; the weights and optimizer state "
                    f"are {state}."
                )
            else:
                message = (
                    f"The loss became {loss:.6g} during epoch {failed}{problem}; the weights "
                    f"and optimizer state are {state}."
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
                self._roll_back(run, snapshot, shuffling)
                raise
            self.validation_losses_.append(held_out)
        self.train_losses_.append(loss)
        self.n_iter_ += 1
        if run.progress is not None:
            lr = self.learning_rate_.learning_rate_at(int(self._resident[STEP].numpy()))
            run.progress.update(epoch + 1, loss, held_out, lr, batches)
        if run.stopper is not None and run.stopper.done(held_out, self._resident):  # type: ignore[arg-type]
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

    def _rollback_point(self) -> dict[str, np.ndarray] | None:
        """What a failed epoch returns to: a copy of the resident values now
        (``rollback="epoch"``), or None where the last checkpoint is
        (``rollback="checkpoint"``)."""
        if self.rollback == "checkpoint":
            return None
        return {name: np.array(value) for name, value in self._state_views().items()}

    def _roll_back(
        self,
        run: FitRun,
        snapshot: Mapping[str, np.ndarray] | None,
        shuffling: Mapping[str, Any] | None = None,
    ) -> None:
        """Return to ``snapshot`` (and the shuffling state), or to the last checkpoint."""
        if snapshot is not None:
            self._restore(snapshot, shuffling)
        else:
            self._restore_checkpoint(run.checkpoint)  # type: ignore[arg-type]

    def _rolled_back_to(self, run: FitRun) -> str:
        """Where :meth:`_roll_back` returned, for a message."""
        if self.rollback != "checkpoint":
            return "those of the previous epoch"
        return (
            f"those of the last checkpoint, {os.fspath(run.checkpoint)!r} (after epoch "  # type: ignore[arg-type]
            f"{len(self.train_losses_)})"
        )

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

    def _run_stream(self, run: FitRun, epoch: int) -> tuple[float, int]:
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


@dataclass
class FitRun:
    """What the epochs of one ``fit`` call share."""

    data: tuple[Rows, np.ndarray, np.ndarray | None]
    validation: tuple[Any, ...] | None
    group: ProcessGroup | None
    batch_size: int
    max_iter: int
    first_epoch: int
    period: int
    stopper: EarlyStopping | None
    progress: EpochProgress | None
    checkpoint: str | os.PathLike[str] | None
    checkpoint_every: int
    callback: Callable[..., Any] | None
    stream: BatchSource | None = None  # fit(batches): the training batches
    checked: bool = False  # the first streamed batch was checked (what the output tells)


def loss_problem(loss: float, single: Loss | None, heads: list[Head] | None) -> str:
    """Why an epoch's loss cannot be right ("" when it can): ``single`` is the trainer's
    loss (``loss_``), ``heads`` its heads for a graph with a loss per output."""
    if not np.isfinite(loss):
        return ". Lower the learning rate or scale the features"
    known = [single] if heads is None else [h.loss for h in heads if h.loss is not None]
    if heads is not None and len(known) < len(heads):
        known = []  # a custom loss may be negative
    if loss < 0 and known and all(k is not None and not k.is_custom for k in known):
        names = ", ".join(repr(k.name) for k in known)  # type: ignore[union-attr]
        return (
            f", below zero, which {names} cannot be: the model's outputs left the "
            "range the loss takes (probabilities outside [0, 1]). Check weights_to_train_ "
            "for a constant being trained"
        )
    return ""
