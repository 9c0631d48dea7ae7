"""Training from an iterable of batches: data that does not fit in memory.

``trainer.fit(batches)`` (no ``y``: the labels are in the batches, as in Keras'
``model.fit(dataset)``) trains on what ``batches`` yields:

* **a batch** is a tuple (or list, as torch's ``DataLoader`` collates a
  ``TensorDataset``) ``(X, y)`` or ``(X, y, sample_weight)``. ``X`` is an array, or a
  dict ``{input name: array}`` for a model with several inputs, as ``fit(X, y)`` takes
  it; ``y`` is a dict ``{output name: labels}`` for a graph with a loss per output.
  numpy arrays (a memmap's slices too), torch tensors (CPU tensors become numpy
  arrays sharing their memory; tensors on a GPU are copied to the CPU) and anything
  ``numpy.asarray`` reads are accepted. Each batch is checked as ``fit(X, y)`` checks its
  data, and an error names the batch (counted from 0) and the epoch.
* **an epoch** is one pass over the iterable. For several epochs it must be readable
  again: a list of batches, a ``torch.utils.data.DataLoader``, or a function taking no
  argument that returns a fresh iterable (``lambda: read_batches(path)``). A one-shot
  iterator (a generator) is read once: ``max_iter`` greater than 1 is refused before
  training, as an iterable that yields nothing in some epoch is.
* **the order** is the iterable's: shuffling is its job (``DataLoader(...,
  shuffle=True)``); the trainer's ``shuffle`` does not apply (setting it to True warns).
* **batch sizes** are the iterable's, any of them, a short last batch included (a
  ``DataLoader`` drops it with ``drop_last=True``); the trainer's ``batch_size`` does
  not apply. Every batch is one training step. The first :data:`SPECIALIZED_SIZES`
  distinct sizes a trainer meets each get a graph specialized to that size (as the
  batches of in-memory data do); a batch of any other size runs the graph built for
  any size (the same update, a little slower), so a stream of ever-changing sizes does
  not build a graph per size.
* **the epoch's loss** (``train_losses_``) is, as for in-memory data, the mean of the
  batch losses, each batch's loss the (sample-weighted) mean over its rows: a short last
  batch counts as one batch.
* **held-out data** (``X_val``) is in-memory arrays with ``y_val``, or an iterable of
  batches without ``y_val``, whose loss is the mean of the batch losses weighted by each
  batch's total sample weight (its rows when unweighted): the loss of the whole held-out
  set for a mean loss. ``early_stopping`` needs it (there are no rows to hold out).
* **the hot loop** runs batch by batch: the whole-epoch ``Scan`` of in-memory data
  (``steps_per_run``) needs the epoch's rows in memory.

With the same batches in the same order, training gives the weights that
``fit(X, y)`` gives with ``shuffle=False`` and the same ``batch_size``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from graphkit.training.batches import NamedRows

SPECIALIZED_SIZES = 4
"""Distinct batch sizes of streamed batches that get a graph specialized to them, per
trainer (each costs a graph build and a session; other sizes run the graph for any
size)."""


def is_batch_source(X: Any) -> bool:
    """Whether ``X``, given without ``y``, is a source of batches: an iterable (a list,
    a generator, a ``DataLoader``...) or a function returning one, and not array-like
    (an array, a dict of arrays, a tensor, a data frame, a sparse matrix)."""
    if X is None or isinstance(X, (np.ndarray, Mapping, NamedRows, str, bytes)):
        return False
    if any(hasattr(X, a) for a in ("__array__", "__array_interface__", "__dlpack__")):
        return False
    if type(X).__module__.startswith("scipy.sparse"):
        return False
    return isinstance(X, Iterable) or callable(X)


def torch_dataset_hint(X: Any) -> str | None:
    """What to do with a map-style torch ``Dataset`` given as ``X`` (None otherwise)."""
    if type(X).__module__.startswith("torch") and hasattr(X, "__getitem__"):
        if not isinstance(X, Iterable) and not hasattr(X, "__array__"):
            return (
                f"X is a torch {type(X).__name__}: pass a torch.utils.data.DataLoader("
                "dataset, batch_size=...) over it, which yields (X, y) batches."
            )
    return None


class BatchSource:
    """An iterable of batches (or a function returning one), read once per epoch.

    Args:
        source: the iterable, or a function taking no argument that returns one.
        what: how messages name it (``"X"``, ``"X_val"``).
    """

    def __init__(self, source: Any, what: str) -> None:
        self.source = source
        self.what = what
        self.factory = callable(source) and not isinstance(source, Iterable)
        # a generator, a map object, an open file...: iter(it) is it, readable once
        self.one_shot = not self.factory and isinstance(source, Iterator)
        self.passes = 0

    def refuse_passes(self, passes: int, why: str) -> None:
        """Refuse a one-shot iterator that would be read ``passes`` times (``why``:
        what asks for them)."""
        if self.one_shot and passes > 1:
            raise ValueError(
                f"{self.what} is a one-shot iterator ({type(self.source).__name__}): it can "
                f"be read once, which is one epoch, but {why} reads it {passes} times. Pass "
                "something that can be read again: a list of batches, a torch DataLoader, "
                f"or a function returning a fresh iterator ({self.what}=lambda: "
                "make_batches()); or read it once (max_iter=1)."
            )

    def epoch(self) -> tuple[Iterator[Any], int | None]:
        """An iterator over one pass, and its number of batches when ``len()`` tells."""
        made = self.source() if self.factory else self.source
        if self.factory and (not isinstance(made, Iterable) or isinstance(made, Mapping)):
            raise TypeError(
                f"{self.what} is a function, which must return an iterable of (X, y) batches "
                f"when called with no argument; it returned {type(made).__name__}."
            )
        if self.one_shot and self.passes:
            raise ValueError(
                f"{self.what} is a one-shot iterator, already read once; pass a re-iterable "
                "(a list, a DataLoader, or a function returning a fresh iterator)."
            )
        self.passes += 1
        try:
            length = len(made)
        except (TypeError, NotImplementedError):  # a generator, an IterableDataset's loader
            length = None
        return iter(made), length

    def empty(self, epoch: int) -> ValueError:
        """The error for an epoch in which the source yielded no batch."""
        hint = (
            " A function returning the same exhausted iterator every time? Return a new one."
            if self.factory
            else " An iterable that can be read only once? Pass a list of batches, a "
            "DataLoader, or a function returning a fresh iterator."
        )
        return ValueError(
            f"{self.what} yielded no batch in epoch {epoch}: there is nothing to train on.{hint}"
        )


def unpack_batch(batch: Any, where: str) -> tuple[Any, Any, Any]:
    """``(X, y, sample_weight or None)`` of one batch, tensors as numpy arrays; clear
    errors for what is not an ``(X, y[, sample_weight])`` batch (``where`` names the
    batch in them)."""
    if isinstance(batch, Mapping):
        raise TypeError(
            f"{where} is a dict with keys {list(batch)[:5]}; fit(batches) takes (X, y) or "
            "(X, y, sample_weight) tuples, X being a dict {input name: array} for a model "
            "with several inputs."
        )
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        what = (
            f"a {type(batch).__name__} of {len(batch)} element"
            if isinstance(batch, (tuple, list))
            else f"one {type(batch).__name__}"
        )
        raise ValueError(
            f"{where} has no y: fit(batches) takes (X, y) or (X, y, sample_weight) tuples, "
            f"the labels inside each batch, and this batch is {what}."
        )
    if len(batch) > 3:
        raise ValueError(
            f"{where} has {len(batch)} elements; a batch is (X, y) or (X, y, sample_weight). "
            "For a model with several inputs, X is a dict {input name: array}; for "
            "in-memory rows, call fit(X, y)."
        )
    X, y, w = (*batch, None) if len(batch) == 2 else batch
    if y is None:
        raise ValueError(f"{where} has no y (it is None); every batch needs its labels.")
    if isinstance(X, Mapping):
        X = {name: as_array(value) for name, value in X.items()}
    else:
        X = as_array(X)
        if np.ndim(X) == 0:
            raise ValueError(
                f"{where} starts with a scalar, not the rows of X: fit(X) without y takes an "
                "iterable of (X, y) batches. For in-memory data, call fit(X, y)."
            )
    if isinstance(y, Mapping):  # a loss per output: {output name: labels}
        y = {name: as_array(value) for name, value in y.items()}
    else:
        y = as_array(y)
    return X, y, None if w is None else as_array(w)


def as_array(value: Any) -> Any:
    """A torch tensor as a numpy array (sharing the memory of a CPU tensor); anything
    else unchanged (the trainer's checks read it with ``numpy.asarray``)."""
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        tensor = value.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return tensor.numpy()
    return value


def in_batch(exc: Exception, where: str) -> Exception:
    """``exc`` with ``where`` (the batch and the epoch) in front of its message, of the
    same type (``exc`` itself when that type cannot be built from a message)."""
    message = str(exc)
    if message.startswith(where):
        return exc
    try:
        renamed = type(exc)(f"{where}: {message}")
    except Exception:  # an exception type with another signature
        return exc
    return renamed.with_traceback(exc.__traceback__)


__all__ = [
    "SPECIALIZED_SIZES",
    "BatchSource",
    "as_array",
    "in_batch",
    "is_batch_source",
    "unpack_batch",
]
