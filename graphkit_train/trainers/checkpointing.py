"""The training state across calls: resuming from a checkpoint, a warm start, the state
carried over when a parameter that rebuilds the graphs changes, and pickling.

Writing and reading a checkpoint file is the resident state's
(:meth:`graphkit_train.engine.resident.ResidentState.save_checkpoint`,
``load_checkpoint``; the format is :mod:`graphkit_train.checkpoint`); :class:`Checkpointing`
decides, at the start of ``fit``, whether training resumes, continues (``warm_start``) or
starts over, and pickles a trainer as its parameters and that state.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from graphkit.compat import load_model
from graphkit.train_mode import DROPOUT_SEED
from graphkit.update_step import STEP, UpdateStep
from graphkit_train.trainers.params import as_state


class Checkpointing:
    """Where the state of a ``fit`` starts, and pickling (see the module docstring).

    The trainer provides ``warm_start``, ``update_step_``, the resident state
    (``_fitted``, ``_allocate``, ``get_state``, ``set_state``, ``load_checkpoint``) and
    ``get_params``.
    """

    # what the trainer provides, declared for the type checker (none exists at run time)
    warm_start: bool
    update_step_: UpdateStep
    train_losses_: list[float]
    validation_losses_: list[float]
    _rng: np.random.Generator | None
    _built: bool
    _carried: tuple[Any, ...] | None

    if TYPE_CHECKING:

        @property
        def _fitted(self) -> bool: ...

        def _allocate(self, values: Mapping[str, np.ndarray]) -> None: ...

        def get_state(self) -> dict[str, np.ndarray]: ...

        def set_state(self, state: Mapping[str, Any]) -> Any: ...

        def load_checkpoint(self, path: str | os.PathLike[str]) -> Any: ...

        def get_params(self, deep: bool = True) -> dict[str, Any]: ...

    def _resume(self, checkpoint: str | os.PathLike[str] | None) -> bool:
        """Load ``checkpoint`` when the file exists (``fit(..., checkpoint=path)``
        resumes from it); whether it did."""
        resumed = checkpoint is not None and os.path.exists(checkpoint)
        if resumed and checkpoint is not None:  # (resumed says it is not None)
            self.load_checkpoint(checkpoint)
        return resumed

    def _start_state(self, resumed: bool, seed: int | None) -> None:
        """The state the epochs of a ``fit`` start from: the resumed one, the previous
        fit's for ``warm_start`` (the one carried over a rebuild included), or the
        initial weights with no loss history and a generator seeded with ``seed``."""
        if self.warm_start and not resumed and not self._fitted and self._carried is not None:
            self._carry_over()
        self._carried = None
        if not ((self.warm_start or resumed) and self._fitted):
            initial = self.update_step_.initial
            if DROPOUT_SEED in initial:  # the Dropout masks' stream, seeded by random_state
                initial = {**initial, DROPOUT_SEED: dropout_seed(seed)}
            self._allocate(initial)
            self.train_losses_ = []
            self.validation_losses_ = []
            self._rng = np.random.default_rng(seed)
        if self._rng is None:  # state loaded with set_state()
            self._rng = np.random.default_rng(seed)

    def _carried_state(self) -> tuple[Any, ...] | None:
        """What a fitted trainer keeps when a parameter that rebuilds the graphs (the
        schedule, the optimizer) changes: ``warm_start=True`` then continues from it (see
        :meth:`_carry_over`); None before a fit."""
        fitted = getattr(self, "_buffers", None) is not None and getattr(self, "_built", False)
        return (
            (self.get_state(), self.train_losses_, self.validation_losses_, self._rng)
            if fitted
            else None
        )

    def _carry_over(self) -> None:
        """Start from the state of the fit before the parameters changed: the weights,
        ``step`` and the optimizer state entries the new step still has (same name and
        shape; a new optimizer's own state starts at its initial value), the loss
        history and the shuffling generator."""
        state, train_losses, validation_losses, rng = self._carried  # type: ignore[misc]
        step = self.update_step_
        expected = step.public({n: step.initial[n] for n in [*step.weights, *step.state, STEP]})
        kept = {n: v for n, v in state.items() if n in expected and v.shape == expected[n].shape}
        self.set_state(kept)
        self.train_losses_ = list(train_losses)
        self.validation_losses_ = list(validation_losses)
        self._rng = rng

    # -- pickling --------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        params = self.get_params()
        if not isinstance(params["model_onnx"], (str, os.PathLike)):  # a path stays one
            params["model_onnx"] = load_model(params["model_onnx"]).SerializeToString()
        state: dict[str, Any] = {"params": params}
        if self._built and self._fitted:
            state["trained"] = self.get_state()
            state["train_losses_"] = self.train_losses_
            state["validation_losses_"] = self.validation_losses_
            state["rng"] = self._rng.bit_generator.state if self._rng is not None else None
        # what fit learnt of the data (scikit-learn's attributes), checked at predict
        learnt = ("n_features_in_", "feature_names_in_")
        state.update({name: getattr(self, name) for name in learnt if hasattr(self, name)})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        params = dict(state["params"])
        # pickled before tie_weights existed: trained as then (copies apart), so that the
        # state's names match
        params.setdefault("tie_weights", False)
        if isinstance(params["model_onnx"], bytes):
            params["model_onnx"] = onnx.load_from_string(params["model_onnx"])
        self.__init__(**params)  # type: ignore[misc]
        if "trained" in state:
            self.set_state(as_state(state["trained"]))
            self.train_losses_ = list(state["train_losses_"])
            self.validation_losses_ = list(state["validation_losses_"])
            if state["rng"] is not None:
                self._rng = np.random.default_rng()
                self._rng.bit_generator.state = state["rng"]
        for name in ("n_features_in_", "feature_names_in_"):
            if name in state:
                setattr(self, name, state[name])


def seed_dropout_stream(initial: dict[str, np.ndarray], seed: int | None) -> None:
    """Set the initial seed of the Dropout masks' stream in a step's ``initial`` values
    (if it has one) from ``random_state``: a step exported before ``fit`` draws the
    masks the fit draws."""
    if DROPOUT_SEED in initial:
        initial[DROPOUT_SEED] = dropout_seed(seed)


def dropout_seed(seed: int | None) -> np.ndarray:
    """The seed of the Dropout masks' stream (:mod:`graphkit.train_mode`) for a fit with
    ``random_state=seed``: drawn from ``seed`` (None: from fresh entropy), int64."""
    drawn = np.random.SeedSequence(seed).generate_state(1, np.uint32)[0]
    return np.array(int(drawn) & 0x7FFFFFFF, dtype=np.int64)
