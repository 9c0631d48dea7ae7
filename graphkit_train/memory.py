"""What full training holds in memory, estimated before anything is allocated.

A trainer keeps, for the weights it trains and their optimizer state (the *resident*
values):

* two buffer sets: each run reads one and writes the other, so that a failed step
  (onnxruntime's error, a non-finite loss) leaves the weights as they were;
* one snapshot per epoch, so that Ctrl-C or a bad streamed batch returns to the
  epoch's start;
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
"""Copies of the resident values: two buffer sets and the epoch's snapshot."""

STEP_COPIES = 3
"""Weight-sized temporaries while a step runs: gradient, update, new value."""


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


def training_bytes(resident_bytes: int, weight_bytes: int) -> int:
    """The estimate of what training adds: :data:`RESIDENT_COPIES` of the resident
    values and :data:`STEP_COPIES` of the trained weights."""
    return RESIDENT_COPIES * resident_bytes + STEP_COPIES * weight_bytes


def check_fits(resident_bytes: int, weight_bytes: int, what: str = "Training") -> None:
    """Refuse training whose estimate (:func:`training_bytes`) exceeds the memory
    available now.

    Raises:
        InsufficientMemoryError: with the estimate, its parts and what is available.
    """
    available = available_bytes()
    need = training_bytes(resident_bytes, weight_bytes)
    if available is None or need <= available:
        return
    gib = 2**30
    raise InsufficientMemoryError(
        f"{what} needs about {need / gib:.1f} GiB of memory and {available / gib:.1f} GiB "
        f"is available: {RESIDENT_COPIES} copies of the {resident_bytes / gib:.2f} GiB of "
        "trained weights and optimizer state (two buffer sets, so that a failed step "
        f"leaves the weights as they were, and the epoch's snapshot), and {STEP_COPIES} "
        f"copies of the {weight_bytes / gib:.2f} GiB of trained weights while a step runs "
        "(gradients and updates). Train fewer weights (weights_to_train: the last layers "
        "and the head, the base frozen costs its size once), choose an optimizer with "
        "less state ('sgd' keeps none, 'adam' two values per weight), or free memory."
    )


__all__ = ["RESIDENT_COPIES", "STEP_COPIES", "available_bytes", "check_fits", "training_bytes"]
