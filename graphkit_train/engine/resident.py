"""The engine side of a trainer: resident values in two alternating buffer sets.

A trainer owns a *resident session*: a graph whose inputs include the weights, the
optimizer state, ``step`` and ``loss_sum``, and whose ``.next`` outputs hold their new
values (the fused training step, or the update step of forward/backward training).
Those values live in two sets of OrtValues bound once to two IOBindings that
alternate: one reads set A and writes set B, the other the reverse, so a batch moves
no weight through Python. :class:`ResidentState` holds them, reads and writes the
training state (``get_state``, ``set_state``, checkpoints) and runs the update step on
gradients computed elsewhere (forward/backward and distributed training).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from graphkit import tensor_store
from graphkit.compat import load_model
from graphkit.engine import ort_engine as engine
from graphkit.errors import ConvergenceError, ShapeError, UnknownNameError, not_fitted
from graphkit.update_step import LOSS, STEP, UpdateStep, grad_name, next_name
from graphkit_train import checkpoint, memory
from graphkit_train.distributed import ProcessGroup

if TYPE_CHECKING:
    from graphkit.losses import Loss
    from graphkit.training.batches import Rows

logger = logging.getLogger(__name__)


class BindingCache:
    """Binds an OrtValue input only when its data pointer or shape changed (the seed's
    cache): an IOBinding holds its own reference to what it binds, so an unchanged
    pointer is the same live buffer."""

    def __init__(self, binding: Any) -> None:
        self.binding = binding
        self._bound: dict[str, tuple[int, tuple[int, ...]]] = {}
        self.hits = 0
        self.binds = 0

    def bind(self, name: str, value: Any) -> None:
        key = (value.data_ptr(), tuple(value.shape()))
        if self._bound.get(name) == key:
            self.hits += 1
            return
        self.binding.bind_ortvalue_input(name, value)
        self._bound[name] = key
        self.binds += 1


class ResidentState:
    """Two buffer sets of resident values, their bindings, and the training state.

    The trainer sets ``update_step_`` and ``_resident_session`` (and ``_ort_device``,
    ``_device_id``) when it builds; :meth:`_allocate` then makes the buffers. The update
    path (:meth:`_run_batch_distributed`) asks the trainer's ``_gradients`` for one
    batch's loss and gradients.
    """

    update_step_: UpdateStep
    _resident_session: Any
    _buffers: list[dict[str, Any]] | None
    _host_views: list[dict[str, np.ndarray]] | None
    _current: int
    _rng: np.random.Generator | None
    train_losses_: list[float]
    validation_losses_: list[float]
    # what the trainer provides, declared for the type checker (none exists at run time)
    model_onnx: Any
    loss_: Loss | None
    _ort_device: str
    _device_id: int

    if TYPE_CHECKING:

        def _build(self) -> None: ...

        def _gradients(self, X: Rows, y: np.ndarray, w: np.ndarray | None) -> tuple[Any, dict]: ...

    def _ortvalue(self, array: np.ndarray) -> Any:
        # a weight mapped from its file is copied without holding it twice
        return engine.ortvalue(tensor_store.copied(array), self._ort_device, self._device_id)

    def _allocate(self, values: Mapping[str, np.ndarray]) -> None:
        """Two buffer sets holding ``values``, the two bindings that alternate, and a
        cache of what the update-step path binds in each."""
        step = self.update_step_
        if self._ort_device == "cpu":
            resident = sum(np.asarray(values[n]).nbytes for n in step.resident)
            largest = max((np.asarray(values[n]).nbytes for n in step.resident), default=0)
            held = 2 * resident if getattr(self, "_buffers", None) is not None else 0
            epoch_copy = getattr(self, "rollback", "epoch") != "checkpoint"
            memory.check_fits(resident, largest, epoch_copy, held)
        if self._ort_device == "cpu":
            # onnxruntime shares a CPU array's memory: the arrays are views of the buffers
            host = [{n: tensor_store.copied(values[n]) for n in step.resident} for _ in range(2)]
            self._host_views = host
            self._buffers = [{n: engine.ortvalue(a, "cpu", 0) for n, a in h.items()} for h in host]
        else:
            self._host_views = None
            self._buffers = [
                {n: self._ortvalue(values[n]) for n in step.resident} for _ in range(2)
            ]
        self._bindings = []
        for k in (0, 1):
            binding = self._bind_resident(self._resident_session, k)
            self._bind_scratch(binding)
            self._bindings.append(binding)
        self._update_caches = [BindingCache(b) for b in self._bindings]
        self._weight_names = list(step.weights)
        self._grad_names = [grad_name(n) for n in step.weights]
        self._current = 0
        self._buffers_changed()

    def _bind_resident(self, session: Any, k: int) -> Any:
        """A binding of ``session`` reading buffer set ``k`` and writing set ``1 - k``."""
        binding = session.io_binding()
        for name in self.update_step_.resident:
            binding.bind_ortvalue_input(name, self._buffers[k][name])  # type: ignore[index]
            binding.bind_ortvalue_output(next_name(name), self._buffers[1 - k][name])  # type: ignore[index]
        return binding

    def _buffers_changed(self) -> None:
        """The buffer sets were (re)allocated: bindings made on the old ones are stale
        (subclasses that keep more bindings drop them here)."""

    def _bind_scratch(self, binding: Any) -> None:
        """Bind the session's outputs that are not resident (subclasses)."""

    @property
    def _fitted(self) -> bool:
        return self._buffers is not None

    @property
    def _resident(self) -> dict[str, Any]:
        """The buffer set holding the current values."""
        if self._buffers is None:
            raise not_fitted(
                f"This {type(self).__name__} is not fitted yet: call fit() or set_state() first."
            )
        return self._buffers[self._current]

    def __sklearn_is_fitted__(self) -> bool:
        return bool(getattr(self, "_buffers", None))

    # -- state -----------------------------------------------------------------------------

    def get_state(self) -> dict[str, np.ndarray]:
        """Weights, optimizer state and ``"step"`` (updates applied), as numpy copies."""
        step = self.update_step_
        views = self._state_views()
        return step.public({n: np.array(views[n]) for n in [*step.weights, *step.state, STEP]})

    def _state_views(self) -> Mapping[str, np.ndarray]:
        """The current resident values without a copy where the buffers are on the CPU
        (read them before the next run changes them), else copies."""
        current = self._resident
        host = getattr(self, "_host_views", None)
        if host is not None:
            return host[self._current]
        return {n: value.numpy() for n, value in current.items()}

    def _non_finite_state(self) -> str | None:
        """The first weight or optimizer-state entry holding an inf or a nan, described
        (``"Weight 'coef'"``), or None when every value is finite. Reads the buffers as
        they are (a few microseconds an epoch); names the entry per weight only when one
        is found (a packed state entry holds every weight's)."""
        step = self.update_step_
        current = self._state_views()
        if all(_finite(current[name]) for name in [*step.weights, *step.state]):
            return None
        weights = set(step.weights)
        for name, value in self.get_state().items():
            if not _finite(value):
                return f"{'Weight' if name in weights else 'Optimizer state'} {name!r}"
        return None

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Write weights, optimizer state, step, the shuffling generator, the epoch count
        and the loss history to ``path``, atomically (see :mod:`graphkit_train.checkpoint`).

        Raises:
            ConvergenceError: a weight or optimizer-state value is inf or nan (set by
                ``set_state``: training never keeps one); nothing is written.
        """
        broken = self._non_finite_state()
        if broken is not None:
            raise ConvergenceError(
                f"{broken} holds inf or nan: a checkpoint of it could not resume training; "
                f"nothing was written to {os.fspath(path)!r}."
            )
        step = self.update_step_
        views = self._state_views()  # written as they are: no copy of the weights
        arrays = step.public({n: views[n] for n in [*step.weights, *step.state, STEP]})
        header = {
            "trainer": type(self).__name__,
            "graph_hash": self._graph_hash(),
            "epochs": len(self.train_losses_),
            "train_losses": [float(x) for x in self.train_losses_],
            "validation_losses": [float(x) for x in self.validation_losses_],
            "rng": self._rng.bit_generator.state if self._rng is not None else None,
            # weights read from their own file and not trained: referenced, not copied
            "frozen": self._frozen_references(),
        }
        checkpoint.write(path, arrays, header)
        logger.debug("saved the state after epoch %d to %s", header["epochs"], os.fspath(path))

    def load_checkpoint(self, path: str | os.PathLike[str]) -> ResidentState:
        """Continue from a checkpoint of :meth:`save_checkpoint`: the next ``fit`` with
        ``warm_start=True`` (or ``checkpoint=path``) goes on exactly where it stopped.

        Raises:
            CheckpointError: the file is truncated or corrupted, or belongs to another
                model (other weights, shapes, dtypes, operators or optimizer).
        """
        self._build()
        arrays, header = self._read_checkpoint(path)
        self.set_state(arrays)
        self.train_losses_ = list(header["train_losses"])
        self.validation_losses_ = list(header["validation_losses"])
        if header["rng"] is not None:
            self._rng = np.random.default_rng()
            self._rng.bit_generator.state = header["rng"]
        return self

    def _read_checkpoint(
        self, path: str | os.PathLike[str]
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """The arrays and header of a checkpoint of this trainer's graphs (checked)."""
        arrays, header = checkpoint.read(path)
        step = self.update_step_
        expected = step.public({n: step.initial[n] for n in [*step.weights, *step.state, STEP]})
        checkpoint.check_frozen(os.fspath(path), header, self._frozen_references())
        checkpoint.check_matches(os.fspath(path), header, arrays, expected, self._graph_hash())
        return arrays, header

    def _frozen_references(self) -> dict[str, dict]:
        """The weights mapped from their file that this trainer does not train."""
        return tensor_store.references(load_model(self.model_onnx), self.update_step_.weights)

    def _restore_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Put the state of the checkpoint at ``path`` back in the current buffers (no
        new buffers: ``rollback="checkpoint"`` keeps the memory it saves), with its loss
        history and shuffling state."""
        arrays, header = self._read_checkpoint(path)
        self._restore(self.update_step_.internal(arrays), header["rng"])
        self.train_losses_ = list(header["train_losses"])
        self.validation_losses_ = list(header["validation_losses"])

    def _graph_hash(self) -> str:
        """The structure of the user's graph and of the update step (no weight values)."""
        return checkpoint.graph_hash(load_model(self.model_onnx), self.update_step_.model)

    def set_state(self, state: Mapping[str, Any]) -> ResidentState:
        """Load weights (and optionally optimizer state and ``"step"``) to train from.

        Missing optimizer state starts at its initial value; the next ``fit`` with
        ``warm_start=True`` continues from this state.
        """
        self._build()
        step = self.update_step_
        unknown = sorted(set(state) - {*step.weights, *step.public_state, STEP})
        if unknown:
            raise UnknownNameError(
                f"Unknown state entries {unknown}; expected weights {step.weights}, "
                f"optimizer state {step.public_state} and 'step'."
            )
        values = step.public(step.initial)
        for name, value in state.items():
            value = np.asarray(value)
            expected = values[name]
            if value.shape != expected.shape:
                raise ShapeError(
                    f"State {name!r} has shape {value.shape}, expected {expected.shape}."
                )
            values[name] = value.astype(expected.dtype)
        self._allocate(step.internal(values))
        if not hasattr(self, "train_losses_"):
            self.train_losses_ = []
            self.validation_losses_ = []
        return self

    # -- the update-step path: gradients, (all-reduce), update ------------------------------

    def _apply_update(self, binding: Any, loss: Any, grads: Mapping[str, Any]) -> None:
        """Run the update step on given gradients and loss (binding what changed)."""
        gradients = [grads[name]._ortvalue for name in self._weight_names]
        self._run_update(binding, loss, self._grad_names, gradients)

    def _run_update(
        self, binding: Any, loss: Any, inputs: Sequence[str], gradients: Sequence[Any]
    ) -> None:
        """Run the update step on the gradients (C OrtValues) bound to ``inputs``."""
        # gradients are new tensors every batch: bound without the cache's check
        bind = engine.input_binder(binding)
        for name, gradient in zip(inputs, gradients):
            bind(name, gradient)
        self._update_caches[self._current].bind(LOSS, loss)
        self._resident_session.run_with_iobinding(binding)

    def _run_batch_distributed(
        self, group: ProcessGroup, X: Rows, y: np.ndarray, w: np.ndarray | None
    ) -> None:
        """Local gradients, one all-reduce of them (see :mod:`graphkit_train.distributed`),
        the same update on every rank."""
        from graphkit_train.torch_module import _to_ortvalue, _to_tensor

        loss, grads = self._gradients(X, y, w)
        names = self.update_step_.weights
        weight = len(X) if w is None else float(w.sum())
        mean = self.loss_ is None or self.loss_.reduction != "sum"
        tensors = [_to_tensor(grads[n]) for n in names]  # DLPack views, as OnnxModule's
        reduced = group.average(tensors, _to_tensor(loss), weight, mean)
        values = [engine.python_ortvalue(_to_ortvalue(t)) for t in reduced]
        for value, tensor in zip(values, reduced):
            value._graphkit_owner = tensor  # the OrtValue borrows the tensor's memory
        self._apply_update(self._bindings[self._current], values[-1], dict(zip(names, values[:-1])))

    def _restore(
        self, values: Mapping[str, np.ndarray], shuffling: Mapping[str, Any] | None = None
    ) -> None:
        """Put ``values`` back in the current buffers (and the shuffling generator's
        ``shuffling`` state, when given)."""
        for name, value in values.items():
            self._resident[name].update_inplace(value)
        if shuffling is not None and self._rng is not None:
            self._rng.bit_generator.state = shuffling


_FINITE_CHUNK = 1 << 22
"""Elements checked at once: the check of a table of gigabytes allocates 4 MB, not its
size in booleans."""


def _finite(value: np.ndarray) -> bool:
    """Whether a float array holds no inf and no nan (other dtypes always do)."""
    if value.dtype.kind != "f":
        return True
    flat = value.reshape(-1)
    return all(
        bool(np.isfinite(flat[i : i + _FINITE_CHUNK]).all())
        for i in range(0, flat.size, _FINITE_CHUNK)
    )
