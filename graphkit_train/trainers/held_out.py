"""Held-out data: the rows early stopping holds out, their loss, and early stopping.

:func:`hold_out` splits ``validation_fraction`` of the rows off; :class:`HeldOut` scores
held-out data (arrays, streamed batches, or each rank's share in distributed training)
with the current weights; :class:`EarlyStopping` stops when that loss stops improving,
keeping the best weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from graphkit.training.batches import Rows
from graphkit_train.distributed import ProcessGroup
from graphkit_train.trainers.streaming import BatchSource

if TYPE_CHECKING:
    from graphkit.losses import Loss
    from graphkit_train.trainers.heads import Head


class HeldOut:
    """The loss on held-out data, with the current weights.

    The trainer provides ``_loss``, ``_checked_batch``, ``train_losses_``, ``loss_`` and
    ``_heads``.
    """

    # what the trainer provides, declared for the type checker (none exists at run time)
    train_losses_: list[float]
    loss_: Loss | None
    _heads: list[Head] | None

    if TYPE_CHECKING:

        def _loss(self, X: Rows, y: np.ndarray, w: np.ndarray | None) -> float: ...

        def _checked_batch(
            self, batch: Any, where: str, first: bool = False
        ) -> tuple[Rows, np.ndarray, np.ndarray | None]: ...

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


def hold_out(
    X: Rows, y: np.ndarray, w: np.ndarray | None, validation_fraction: float, seed: int | None
) -> tuple[Rows, np.ndarray, np.ndarray | None, tuple[Any, ...]]:
    """Split ``validation_fraction`` of the rows off for early stopping (seeded by
    ``random_state``, as scikit-learn's MLP does): ``(X, y, w, (X_val, y_val, w_val))``."""
    n_val = int(round(validation_fraction * len(X)))
    if n_val < 1 or n_val >= len(X):
        raise ValueError(
            f"early_stopping holds out validation_fraction={validation_fraction} of "
            f"{len(X)} rows, which leaves {n_val} rows to validate on: pass more data, "
            "another fraction, or X_val and y_val."
        )
    order = np.random.default_rng(seed).permutation(len(X))
    val, train = order[:n_val], order[n_val:]
    held = (X[val], y[val], None if w is None else w[val])
    return X[train], y[train], None if w is None else w[train], held


class EarlyStopping:
    """Stop when the held-out loss has not improved by ``tol`` for ``patience`` epochs,
    keeping the best weights (scikit-learn's ``n_iter_no_change`` / ``tol``)."""

    def __init__(self, patience: int, tol: float) -> None:
        self.patience, self.tol = patience, tol
        self.best: dict[str, np.ndarray] | None = None
        self.best_loss = np.inf
        self.waited = 0

    def done(self, loss: float, resident: Mapping[str, Any]) -> bool:
        """Whether to stop after an epoch of held-out ``loss``; ``resident``: the
        trainer's current weights and state (OrtValues), kept when the loss is the best."""
        if loss < self.best_loss - self.tol:
            self.waited = 0
        else:
            self.waited += 1
        if loss < self.best_loss:
            self.best_loss = loss
            self.best = {name: v.numpy().copy() for name, v in resident.items()}
        return self.waited >= self.patience
