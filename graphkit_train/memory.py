"""What full training holds in memory, estimated before anything is allocated.

A trainer keeps, for the weights it trains and their optimizer state (the *resident*
values):

* two buffer sets: each run reads one and writes the other, so that a failed step
  (onnxruntime's error, a non-finite loss) leaves the weights as they were;
* with ``rollback="epoch"`` (the default), a copy taken at the start of each epoch, so
  that a failed epoch (a non-finite loss, Ctrl-C, a bad streamed batch) returns to it;
  ``rollback="checkpoint"`` returns to the last checkpoint instead and keeps no copy;
* while a step runs, the gradients and the updates (about three times the weights
  trained: the gradient, its scaled copy, and the new values before they are bound).

Weights it does not train are mapped from their external data file once and shared by
every session (:mod:`graphkit.tensor_store`): they cost their size once, in pages the
system can reclaim, and are not counted here. :func:`check_fits` refuses training that
cannot fit with these numbers, instead of letting the system's out-of-memory killer end
the process halfway.
"""

from __future__ import annotations

import sys

from graphkit.errors import InsufficientMemoryError

RESIDENT_COPIES = 3
"""Copies of the resident values with ``rollback="epoch"``: two buffer sets and the
epoch's copy (one fewer with ``rollback="checkpoint"``)."""

STEP_COPIES = 3
"""Temporaries of the largest trained tensor's size while a step runs: its gradient,
its scaled copy, a temporary."""


def available_bytes() -> int | None:
    """The memory the system can give without swapping (Linux's ``MemAvailable``), or
    None where it is not known."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def training_bytes(resident_bytes: int, largest_bytes: int, epoch_copy: bool = True) -> int:
    """The estimate of what training adds: :data:`RESIDENT_COPIES` of the resident values
    (one fewer without the epoch's copy) and :data:`STEP_COPIES` of the largest trained
    tensor."""
    copies = RESIDENT_COPIES - (0 if epoch_copy else 1)
    return copies * resident_bytes + STEP_COPIES * largest_bytes


def check_fits(
    resident_bytes: int,
    largest_bytes: int,
    epoch_copy: bool = True,
    held_bytes: int = 0,
    what: str = "Training",
) -> None:
    """Refuse training whose estimate (:func:`training_bytes`) exceeds the memory
    available now plus ``held_bytes`` (buffers about to be replaced).

    Raises:
        InsufficientMemoryError: with the estimate, its parts and what is available.
    """
    available = available_bytes()
    need = training_bytes(resident_bytes, largest_bytes, epoch_copy)
    if available is None or need <= available + held_bytes:
        return
    available += held_bytes
    gib = 2**30
    copies = RESIDENT_COPIES - (0 if epoch_copy else 1)
    kept = (
        "two buffer sets, so that a failed step leaves the weights as they were, and the "
        "epoch's copy (rollback='epoch')"
        if epoch_copy
        else "two buffer sets, so that a failed step leaves the weights as they were"
    )
    raise InsufficientMemoryError(
        f"{what} needs about {need / gib:.1f} GiB of memory and {available / gib:.1f} GiB "
        f"is available: {copies} copies of the {resident_bytes / gib:.2f} GiB of trained "
        f"weights and optimizer state ({kept}), and {STEP_COPIES} copies of the largest "
        f"trained tensor ({largest_bytes / gib:.2f} GiB) while a step runs (its gradient "
        "and update). Train fewer weights (weights_to_train: the last layers and the head; "
        "a frozen base costs its size once), choose an optimizer with less state ('sgd' "
        "keeps none, 'adam' two values per weight), return a failed epoch to the last "
        "checkpoint (rollback='checkpoint'), or free memory."
    )


__all__ = ["RESIDENT_COPIES", "STEP_COPIES", "available_bytes", "check_fits", "training_bytes"]
