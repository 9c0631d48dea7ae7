"""An epoch's batches: rows in order as views, shuffled rows gathered a piece at a time.

Gathering a whole shuffled epoch at once (``X[order]``) copies the data: the peak memory
doubles. Gathering batch by batch costs a numpy call per array and batch. In between,
:func:`shuffled_pieces` cuts the permutation into pieces of whole batches, at most
:data:`GATHER_BYTES` or an eighth of the data each (whichever is larger), which
``np.take`` gathers at memory speed: the copy adds at most that to the peak memory.
Measured on 50,000 x 100 float32 rows in batches of 256: ``X[order]`` 38 us a batch,
``np.take`` of 1 MiB pieces 13.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import numpy as np

GATHER_BYTES = 1 << 20
"""The smallest piece of shuffled rows gathered at once (bytes, all data arrays)."""


class NamedRows:
    """The inputs of a model that has several, as one value indexed by rows: named
    arrays sharing their first axis (``{"X": (N, 4) floats, "ids": (N, 7) int64}``).

    ``len(rows)``, ``rows[start:stop]``, ``rows[index_array]`` and ``rows[:1].nbytes``
    work as on one array, on every array at once (the same rows of each), so batches,
    shuffling and held-out splits treat several inputs as they treat one.
    """

    __slots__ = ("arrays",)

    def __init__(self, arrays: Mapping[str, np.ndarray]) -> None:
        self.arrays = dict(arrays)
        if not self.arrays:
            raise ValueError("NamedRows needs at least one array.")
        rows = {name: len(a) for name, a in self.arrays.items()}
        if len(set(rows.values())) != 1:
            raise ValueError(f"The arrays must have the same number of rows, got {rows}.")

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, rows: Any) -> NamedRows:
        return NamedRows({name: a[rows] for name, a in self.arrays.items()})

    def take(self, rows: np.ndarray) -> NamedRows:
        """The rows ``rows`` of every array (``np.take`` along the first axis)."""
        return NamedRows({name: np.take(a, rows, axis=0) for name, a in self.arrays.items()})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n!r}: {a.shape} {a.dtype}" for n, a in self.arrays.items())
        return f"NamedRows({{{shapes}}})"


Rows = np.ndarray | NamedRows
"""One array, or several inputs' arrays as :class:`NamedRows`."""


def take_rows(data: Rows, rows: np.ndarray) -> Rows:
    """The rows ``rows`` of an array or of every array of a :class:`NamedRows`."""
    if isinstance(data, NamedRows):
        return data.take(rows)
    return np.take(data, rows, axis=0)


def shuffled_pieces(
    order: np.ndarray, batch_size: int, row_bytes: int, most_batches: int | None = None
) -> Iterator[np.ndarray]:
    """The rows of ``order`` in pieces of whole batches (the last piece may end with a
    shorter batch): at most ``max(GATHER_BYTES, data / 8)`` bytes of ``row_bytes`` rows,
    and at most ``most_batches`` batches, each."""
    piece = max(GATHER_BYTES, len(order) * row_bytes // 8)
    batches = max(1, piece // (batch_size * row_bytes))
    if most_batches is not None:
        batches = min(batches, most_batches)
    step = batches * batch_size
    for start in range(0, len(order), step):
        yield order[start : start + step]


_Labels = TypeVar("_Labels", bound=Rows)  # one array, or NamedRows for a loss per output


def epoch_batches(
    X: Rows,
    y: _Labels,
    w: np.ndarray | None,
    order: np.ndarray | None,
    batch_size: int,
) -> Iterator[tuple[Rows, _Labels, np.ndarray | None]]:
    """``(X, y, w)`` of each batch of an epoch over the rows ``order`` (all rows in order
    when None, as views of the arrays); ``X`` (and ``y``, with a loss per output) is one
    array or several inputs' :class:`NamedRows`, whose arrays are all cut at the same
    rows."""
    arrays: list[Rows] = [X, y] if w is None else [X, y, w]
    if order is None:
        pieces: Iterator[list[Rows]] = iter([arrays])
    else:
        row_bytes = sum(a[:1].nbytes for a in arrays)
        pieces = (
            [take_rows(a, rows) for a in arrays]
            for rows in shuffled_pieces(order, batch_size, row_bytes)
        )
    for piece in pieces:
        for start in range(0, len(piece[0]), batch_size):
            batch = [a[start : start + batch_size] for a in piece]
            yield batch[0], batch[1], batch[2] if w is not None else None  # type: ignore[misc]


__all__ = ["GATHER_BYTES", "NamedRows", "Rows", "epoch_batches", "shuffled_pieces", "take_rows"]
