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

from collections.abc import Iterator

import numpy as np

GATHER_BYTES = 1 << 20
"""The smallest piece of shuffled rows gathered at once (bytes, all data arrays)."""


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


def epoch_batches(
    X: np.ndarray,
    y: np.ndarray,
    w: np.ndarray | None,
    order: np.ndarray | None,
    batch_size: int,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray | None]]:
    """``(X, y, w)`` of each batch of an epoch over the rows ``order`` (all rows in order
    when None, as views of the arrays)."""
    arrays = [X, y] if w is None else [X, y, w]
    if order is None:
        pieces: Iterator[list[np.ndarray]] = iter([arrays])
    else:
        row_bytes = sum(a[:1].nbytes for a in arrays)
        pieces = (
            [np.take(a, rows, axis=0) for a in arrays]
            for rows in shuffled_pieces(order, batch_size, row_bytes)
        )
    for piece in pieces:
        for start in range(0, len(piece[0]), batch_size):
            batch = [a[start : start + batch_size] for a in piece]
            yield batch[0], batch[1], batch[2] if w is not None else None


__all__ = ["GATHER_BYTES", "epoch_batches", "shuffled_pieces"]
