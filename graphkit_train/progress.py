"""Per-epoch progress for the trainers and the command line.

In a terminal or a notebook, a tqdm bar with the loss and the learning rate. Anywhere
else (CI logs, ``make demo | tee log``), a bar's ``\\r`` updates would be joined on one
line and printed twice, so a plain line per epoch is written instead::

    epoch   3/100  train loss 0.41235  held-out loss 0.45012  lr 0.001  12.1 ms/epoch

The clock starts when the first epoch starts: building the graphs is not counted.

Streamed batches (``fit(batches)``) add the epoch's number of batches to its line
(``... lr 0.001  782 batches  3.41 s/epoch``), and in a terminal or a notebook a second
bar counts the batches of the epoch under way, out of ``len(batches)`` when the iterable
has a length (a list, a ``DataLoader``).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _interactive(stream: TextIO) -> bool:
    if _in_a_notebook():
        return True
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def _in_a_notebook() -> bool:
    """Whether this process is a Jupyter kernel (a process that merely imported ipykernel,
    as a test runner executing notebooks does, is not)."""
    ipython = sys.modules.get("IPython")
    if "ipykernel" not in sys.modules or ipython is None:
        return False
    shell = getattr(ipython, "get_ipython", lambda: None)()
    return shell is not None and "ipykernel" in type(shell).__module__


class EpochProgress:
    """Reports each epoch; see the module docstring.

    Args:
        total: number of epochs planned.
        desc: the bar's label.
        stream: where to write (default ``sys.stderr``).
        bar: force the bar (True) or the plain lines (False); None decides from the
            stream.
    """

    def __init__(
        self,
        total: int,
        desc: str = "epochs",
        stream: TextIO | None = None,
        bar: bool | None = None,
    ) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self._bar: Any = None
        if bar if bar is not None else _interactive(self.stream):
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="epoch", file=self.stream)
        self._start = time.perf_counter()
        self._done = 0
        self._batches: Any = None  # the bar of the batches of the epoch under way

    def start_epoch(self, batches: int | None = None) -> None:
        """An epoch of streamed batches starts: ``batches`` of them when known (in a
        terminal or a notebook, a bar counts them; elsewhere nothing is written)."""
        if self._bar is None:
            return
        from tqdm.auto import tqdm

        self._close_batches()
        self._batches = tqdm(
            total=batches, desc="batches", unit="batch", leave=False, file=self.stream
        )

    def batch(self) -> None:
        """One streamed batch is done."""
        if self._batches is not None:
            self._batches.update(1)

    def _close_batches(self) -> None:
        if self._batches is not None:
            self._batches.close()
            self._batches = None

    def update(
        self,
        epoch: int,
        train_loss: float,
        validation_loss: float | None = None,
        learning_rate: float | None = None,
        batches: int | None = None,
    ) -> None:
        """Report the end of epoch ``epoch`` (1-based), which ran ``batches`` streamed
        batches (None for in-memory data: not shown)."""
        self._done += 1
        if self._bar is not None:
            self._close_batches()
            postfix = {"loss": f"{train_loss:.5g}"}
            if validation_loss is not None:
                postfix["held_out"] = f"{validation_loss:.5g}"
            if learning_rate is not None:
                postfix["lr"] = f"{learning_rate:.3g}"
            if batches is not None:
                postfix["batches"] = str(batches)
            self._bar.update(1)
            self._bar.set_postfix(postfix, refresh=False)
            return
        per_epoch = (time.perf_counter() - self._start) / self._done
        width = len(str(self.total))
        line = f"epoch {epoch:{width}d}/{self.total}  train loss {train_loss:.6g}"
        if validation_loss is not None:
            line += f"  held-out loss {validation_loss:.6g}"
        if learning_rate is not None:
            line += f"  lr {learning_rate:.3g}"
        if batches is not None:
            line += f"  {batches} batch{'es' if batches != 1 else ''}"
        line += f"  {_duration(per_epoch)}/epoch"
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        self._close_batches()
        if self._bar is not None:
            self._bar.close()


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


__all__ = ["EpochProgress"]
