"""The data ``fit`` takes, checked: arrays, dicts of inputs and labels, streamed batches,
held-out data, and what only the model's output tells (a log loss fed logits, labels of
another width than an undeclared prediction).

:class:`FitData` checks them as ``fit`` receives them (the arrays before the first
epoch, each streamed batch as it comes); the checks of one array are in
:mod:`.params`, those of labels per output in :mod:`.heads`, streaming's own in
:mod:`.streaming`.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from graphkit.compat import load_model
from graphkit.losses import REGRESSION, Loss
from graphkit.training.batches import NamedRows, Rows
from graphkit.update_step import UpdateStep
from graphkit_train.distributed import ProcessGroup, digest
from graphkit_train.trainers.heads import Head, check_head_labels
from graphkit_train.trainers.held_out import hold_out
from graphkit_train.trainers.params import (
    check_inputs,
    check_label_positions,
    check_label_width,
    check_labels,
    check_sample_weight,
)
from graphkit_train.trainers.streaming import (
    BatchSource,
    in_batch,
    is_batch_source,
    torch_dataset_hint,
    unpack_batch,
)


class FitData:
    """The checks of what ``fit`` is given (see the module docstring).

    The trainer provides the parameters (``distributed``, ``shuffle``,
    ``early_stopping``, ``validation_fraction``, ``model_onnx``), what ``_build`` read
    from the graph (``_input_values``, ``_label_value``, ``_heads``, ``loss_``,
    ``_prediction_shape``, the sample-weight flags and dtype, ``update_step_``) and
    ``_n_classes``, ``_is_classifier``, ``_probe``.
    """

    # what the trainer provides, declared for the type checker (none exists at run time)
    model_onnx: Any
    distributed: bool
    shuffle: bool | None
    early_stopping: bool
    validation_fraction: float
    update_step_: UpdateStep
    loss_: Loss | None
    _heads: list[Head] | None
    _input_values: list[onnx.ValueInfoProto]
    _label_value: onnx.ValueInfoProto
    _prediction_shape: tuple[int | str, ...]
    _weight_dtype: np.dtype
    _accepts_sample_weight: bool
    _requires_sample_weight: bool

    if TYPE_CHECKING:

        def _n_classes(self, head: Head | None = None) -> int: ...

        def _is_classifier(self) -> bool: ...

        def _probe(self, X: Rows, every_output: bool = False) -> Any: ...

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
                X, y, w, validation = hold_out(X, y, w, self.validation_fraction, seed)
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

    def _digest(self) -> str:
        """A hash of the model and the initial weights (every rank must hold the same)."""
        model = load_model(self.model_onnx).SerializeToString()
        initial = self.update_step_.initial
        return digest(model, *[initial[name] for name in self.update_step_.weights])

    def _check_outputs(self, X: Any, y: Rows) -> None:
        """What only the model's output tells, checked on one batch ``X`` (``y``: all the
        labels): a log loss on
        probabilities refuses outputs that are not probabilities (logits or scores would
        be clipped at eps silently); a regression loss on an output whose declared shape
        does not say its values per sample refuses labels of another width; token labels
        must have the prediction's positions (its shape without the class axis)."""
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
            if loss is not None and needs_output(loss, shape)
        ]
        if not needed:
            return
        outputs = self._probe(X, every_output=self._heads is not None)
        for loss, _, labels, output, what in needed:
            value = outputs if output is None else outputs[output]
            if loss.task == REGRESSION:
                check_label_width(what, labels, value)
                continue
            if loss.token_labels:
                check_label_positions(what, labels, value)
                continue
            low, high = float(value.min()), float(value.max())
            if low < -1e-6 or high > 1 + 1e-6:
                of = "the model's output" if output is None else f"output {output!r}"
                raise ValueError(
                    f"The loss 'log' takes probabilities, but {of} ranges from "
                    f"{low:.4g} to {high:.4g}. For logits use 'cross_entropy'; for one raw "
                    "score use 'sigmoid_log_loss'."
                )

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
                self.loss_.check_classes(y, self._n_classes(), y_name)
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


def needs_output(loss: Loss | None, shape: tuple[int | str, ...]) -> bool:
    """Whether checking labels for ``loss`` needs the model's output: a log loss on
    probabilities (refusing logits), a regression on an output of undeclared width,
    token labels on an output of undeclared positions."""
    if loss is None:
        return False
    unknown_width = loss.task == REGRESSION and not all(isinstance(d, int) for d in shape[1:])
    unknown_positions = loss.token_labels and not all(isinstance(d, int) for d in shape[1:-1])
    return unknown_width or unknown_positions or loss.prediction == "probabilities"
