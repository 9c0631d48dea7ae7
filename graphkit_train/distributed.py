"""Data-parallel training on ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Launch N processes with ``torchrun``; in each, call :func:`init` and train with
``distributed=True``::

    # torchrun --nproc_per_node=2 examples/ddp_train.py
    from graphkit_train import OrtGradientOptimizer, distributed
    distributed.init()                      # gloo, with a timeout: no rank waits forever
    trainer = OrtGradientOptimizer(train_onx, distributed=True, random_state=0)
    trainer.fit(X, y)                       # every rank passes the same X and y

The contract, on every rank and at every step:

* **Shards.** Every epoch draws one permutation of the rows, seeded identically on all
  ranks; it is padded by repeating its first rows to a multiple of the world size (as
  ``torch.utils.data.DistributedSampler`` does), and rank ``r`` takes rows ``r, r + N,
  r + 2N...``. So the global batch of a step is the same rows a single process would
  take with ``N`` times the batch size.
* **One all-reduce per step.** Each rank computes its gradients and loss with
  onnxruntime; they cross into torch through DLPack, are flattened into one buffer
  ``[W g_1, ..., W g_k, W loss, W]`` (``W`` the rank's batch weight: its row count, or
  its sum of sample weights) and summed across ranks once; dividing by the summed
  ``W`` gives exactly the gradient and loss of the concatenated batch for a mean loss
  (a ``reduction="sum"`` loss is summed, ``W = 1``). Every rank then applies the same
  update, so the weights stay identical everywhere.
* **The same decisions everywhere.** ``train_losses_`` and ``validation_losses_`` are
  global means on every rank; a NaN stops every rank with the same error; bad input
  on one rank stops every rank with that rank's message; a callback that stops on one
  rank stops all. Only rank 0 shows progress and writes exports.
"""

from __future__ import annotations

import atexit
import datetime
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from graphkit.errors import GraphkitError


class DistributedError(GraphkitError, RuntimeError):
    """Distributed training cannot start or continue; the same message on every rank."""


LAUNCH_HINT = (
    "launch the script with torchrun (torchrun --nproc_per_node=2 train.py) and call "
    "graphkit_train.distributed.init() before fit()"
)


def init(backend: str = "gloo", timeout_seconds: float = 300.0) -> ProcessGroup:
    """Initialize the default process group from torchrun's environment variables.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA).
        timeout_seconds: how long a collective waits for a rank that stopped answering
            before every rank fails (instead of hanging).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds))
        # a group left alive at exit aborts the process ("terminate called without an
        # active exception" from its threads)
        atexit.register(shutdown)
    return ProcessGroup()


def shutdown() -> None:
    """Destroy the default process group (a barrier first, so no rank leaves early);
    :func:`init` registers it to run at exit."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class ProcessGroup:
    """What a trainer needs from ``torch.distributed``: the rank, the world size, one
    all-reduce of a flat buffer, and agreement on errors and decisions.

    Raises:
        DistributedError: no process group is initialized (the message says how to
            launch).
    """

    def __init__(self) -> None:
        try:
            import torch.distributed as dist
        except ImportError as exc:
            raise DistributedError(
                "distributed=True needs torch (pip install torch; its CPU build: pip install "
                "torch --index-url https://download.pytorch.org/whl/cpu); " + LAUNCH_HINT
            ) from exc
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "distributed=True needs an initialized torch.distributed process group: "
                + LAUNCH_HINT
                + "."
            )
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    @property
    def place(self) -> tuple[int, int]:
        """``(rank, world size)``."""
        return self.rank, self.world_size

    # -- collectives ---------------------------------------------------------------------

    def _collective(self, operation: Any, *args: Any, **kwargs: Any) -> None:
        """Run a collective; a rank that failed, stopped or timed out becomes one clear
        error here instead of torch's transport message (or a wait without end)."""
        try:
            operation(*args, **kwargs)
        except Exception as exc:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise DistributedError(
                f"Rank {self.rank} lost the other ranks during training: one of them failed "
                "or stopped (see its own error), or did not answer within the process "
                f"group's timeout. torch.distributed said: {first_line[:200]}"
            ) from exc

    def average(self, tensors: Sequence[Any], loss: Any, weight: float, mean: bool) -> list[Any]:
        """``[g_1, ..., g_k, loss]`` averaged over the global batch in one all-reduce.

        ``tensors`` and ``loss`` are torch tensors (DLPack views of onnxruntime's
        outputs); ``weight`` is this rank's batch weight. With ``mean=False`` the values
        are summed. Returns new tensors shaped like the inputs.
        """
        import torch

        scale = float(weight) if mean else 1.0
        dtype = loss.dtype
        flat = torch.cat(
            [t.reshape(-1).to(dtype) * scale for t in tensors]
            + [loss.reshape(-1) * scale, torch.tensor([scale], dtype=dtype)]
        )
        self._collective(self._dist.all_reduce, flat)
        if mean:
            flat = flat[:-1] / flat[-1]
        pieces, start = [], 0
        for t in [*tensors, loss]:
            pieces.append(flat[start : start + t.numel()].reshape(t.shape).to(t.dtype))
            start += t.numel()
        return pieces

    def weighted_mean(self, value: float, weight: float) -> float:
        """The mean of per-rank values weighted by ``weight`` (held-out losses)."""
        import torch

        pair = torch.tensor([value * weight, weight], dtype=torch.float64)
        self._collective(self._dist.all_reduce, pair)
        return float(pair[0] / pair[1])

    def any(self, flag: bool) -> bool:
        """True on every rank when ``flag`` is true on one."""
        import torch

        value = torch.tensor([1 if flag else 0], dtype=torch.int64)
        self._collective(self._dist.all_reduce, value, op=self._dist.ReduceOp.MAX)
        return bool(value.item())

    def broadcast_seed(self, seed: int | None) -> int:
        """Rank 0's seed (drawn when None), on every rank."""
        import torch

        if seed is None:
            entropy = np.random.SeedSequence().entropy
            assert isinstance(entropy, int)  # drawn here, so one int
            seed = int(entropy % 2**62)
        value = torch.tensor([seed], dtype=torch.int64)
        self._collective(self._dist.broadcast, value, src=0)
        return int(value.item())

    def raise_if_any_failed(self, error: BaseException | None) -> None:
        """Share each rank's failure (or None); every rank raises the same error when one
        rank failed, naming the ranks and their messages."""
        messages: list[Any] = [None] * self.world_size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        self._collective(self._dist.all_gather_object, messages, mine)
        failed = [(rank, text) for rank, text in enumerate(messages) if text is not None]
        if not failed:
            return
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in failed)
        raise DistributedError(f"Distributed training stopped on every rank. {detail}") from error

    def check_same(self, digest: str, what: str) -> None:
        """Refuse to train when the ranks hold different ``what`` (compared by digest)."""
        digests: list[Any] = [None] * self.world_size
        self._collective(self._dist.all_gather_object, digests, digest)
        different = [rank for rank, d in enumerate(digests) if d != digests[0]]
        if different:
            raise DistributedError(
                f"The ranks disagree on {what}: ranks {different} differ from rank 0. Every "
                "rank must load the same model and initial weights."
            )


def shard(order: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """Rank ``rank``'s rows of a permutation: padded by repeating its head to a multiple
    of ``world_size``, then every ``world_size``-th row (DistributedSampler's rule)."""
    padding = (-len(order)) % world_size
    padded = np.concatenate([order, order[:padding]]) if padding else order
    return padded[rank::world_size]


def digest(*parts: bytes | np.ndarray) -> str:
    """A hash of a graph and weights, to check every rank holds the same."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.tobytes() if isinstance(part, np.ndarray) else part)
    return h.hexdigest()


__all__ = ["DistributedError", "ProcessGroup", "digest", "init", "shard", "shutdown"]
