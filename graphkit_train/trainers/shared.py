"""The constructor parameters the trainers share: one description of each, one check.

The four trainers (:class:`~graphkit_train.Trainer`,
:class:`~graphkit_train.OrtGradientOptimizer`,
:class:`~graphkit_train.ForwardBackwardTrainer`,
:class:`~graphkit_train.OrtGradientForwardBackwardOptimizer`) take about 28 parameters
each, most of them the same. The table below describes each shared one once
(:data:`SHARED_PARAMETERS` reads it); :func:`shared_parameters` writes those
descriptions into a trainer's docstring, in place of its line ``every other parameter:
see :mod:`graphkit_train.trainers.shared`.`` (what a reader of the source sees), for
every parameter of its constructor that the docstring does not describe itself, in the
constructor's order. :func:`check_common_params` checks their values, once, when a
trainer builds (as scikit-learn does: the constructors store their arguments unchanged,
so that ``get_params``, ``set_params`` and ``clone`` work; see
:class:`graphkit_train.trainers.params.ParamsMixin`).

Shared parameters:
    weights_to_train: names of the float initializers to train (a list or one name); None
        trains the model's parameters and never its constants (the rule is in
        :mod:`graphkit.parameters`; ``weights_to_train_`` holds the choice).
    optimizer: an optimizer name, meaning exactly ``graphkit.optimizers.get(name)`` in any
        case (``"sgd"``, ``"adam"``, ``"nesterov"``...), or a graphkit gradient
        transformation or chain (:mod:`graphkit.transforms`). Default ``"sgd"``: plain SGD
        at a constant 0.01.
    schedule: fills the optimizer's open learning rate: a
        :class:`~graphkit.schedules.Schedule`, a schedule name (``"cosine"``...) or a float.
        None: an open rate runs at a constant 0.01
        (:data:`graphkit.optimizers.DEFAULT_LEARNING_RATE`).
    max_iter: number of epochs.
    batch_size: rows per training step (of in-memory data: streamed batches,
        ``fit(batches)``, keep the sizes the iterable gives them).
    device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (needs the CUDA build).
    warm_start: continue from where the previous ``fit`` stopped (weights, optimizer state,
        step count and shuffling sequence) instead of the initial weights.
    verbose: show a progress bar with the loss and the learning rate.
    validation_every: validate every ``validation_every * max_iter`` epochs (a float below
        1) or every ``validation_every`` epochs; 0 never.
    sample_weight_name: name of the sample-weight input of graphs not made by
        ``add_loss_output`` (which records it).
    shuffle: draw a new permutation of the rows every epoch (None, the default, means True;
        False keeps them in order). Streamed batches (``fit(batches)``) keep the iterable's
        order: there ``shuffle`` does not apply, and True warns.
    random_state: seed of the permutations.
    early_stopping: hold out ``validation_fraction`` of the rows (or use ``X_val``,
        ``y_val``), stop when the held-out loss has not improved by ``tol`` for
        ``n_iter_no_change`` epochs, and keep the best weights (scikit-learn's convention).
    validation_fraction: the fraction of the rows ``early_stopping`` holds out, in (0, 1).
    n_iter_no_change: epochs without an improvement of the held-out loss after which
        ``early_stopping`` stops (an int >= 1).
    tol: the improvement of the held-out loss that counts as one (>= 0).
    distributed: data-parallel training over the ranks of an initialized
        ``torch.distributed`` process group (see :mod:`graphkit_train.distributed`): the
        gradients of each step are all-reduced.
    steps_per_run: training steps per onnxruntime call: ``"epoch"`` (the default) runs every
        full batch of an epoch in one call of a ``Scan`` graph over the data laid out batch
        by batch (:mod:`graphkit.training.epoch`); an int k runs k batches per call; 1 runs
        one call per batch. The weights are the same whichever is chosen; only the speed
        differs. Streamed batches (``fit(batches)``) run one call per batch, and so does
        ``"epoch"`` for trained weights and optimizer state of 64 MiB or more (the Scan
        would hold copies of them; ``SCAN_UP_TO_BYTES`` in :mod:`graphkit_train.trainers.full`).
    static_shapes: build the step for the concrete ``batch_size`` with its shape arithmetic
        folded away (:mod:`graphkit.static_shapes`); a last, shorter batch runs the step
        built for any batch size.
    intra_op_num_threads: threads per kernel, in every session the trainer runs (None: one
        per core, onnxruntime's default).
    execution_mode: ``"sequential"`` or ``"parallel"`` (independent nodes at once), in every
        session the trainer runs.
    backend: where gradients come from and what runs them, a name registered in
        :mod:`graphkit.backends` (None: ``GRAPHKIT_BACKEND``, else the first installed in
        the order ``"native"``, ``"ort_training"``).
    untie_shared_weights: an initializer read by several parameter slots becomes one weight
        per slot, ``<name>``, ``<name>.1``... (torch's TorchScript exporter merges equal
        initializers, such as two fresh LayerNorms' weights, which torch trains apart).
        False keeps them tied (weights tied on purpose). A weight torch ties, read both
        directly and through a Transpose, stays one weight with ``tie_weights``.
    tie_weights: weights torch ties are trained as one, as torch trains them: an exact
        transposed copy of a weight (a tied output projection, its transpose folded by the
        exporter) reads the weight through a Transpose instead, and a weight read both
        directly and through a Transpose (an embedding and the output layer) is not untied
        (see :mod:`graphkit.tied_weights`). False trains such copies apart.
    train_mode: which BatchNormalization and Dropout layers train in training mode, as
        torch's ``model.train()`` runs them (batch statistics and running averages
        updated with torch's momentum; Dropout masks from a stream seeded by
        ``random_state``; see :mod:`graphkit.train_mode`). None (the default): those the
        graph was exported in training mode; True: every one (a model exported in
        ``eval()`` mode whose BatchNorm should train with batch statistics); False: none.
        Prediction, evaluation and every exported inference model use the running
        statistics and no Dropout.
    rollback: what a failed epoch (a non-finite loss or weight, Ctrl-C, a bad streamed or
        held-out batch) returns to. ``"epoch"`` (the default): the state at the start of
        the epoch, from a copy of the trained weights and optimizer state taken then.
        ``"checkpoint"``: the last checkpoint of ``fit(..., checkpoint=path)`` (written at
        the start of the fit if the file does not exist yet), with its loss history and
        shuffling state; no copy is kept in memory, which for a model of gigabytes is its
        size saved (see :mod:`graphkit_train.memory`). A failed step leaves the weights
        as they were either way: each run reads one buffer set and writes the other.
    output_index: the output the loss applies to, by position or name (None: the only float
        tensor output; a skl2onnx ZipMap output stands for its probabilities).
    exc: raise ``ConvergenceError`` on a NaN loss; False warns and stops instead.
"""

from __future__ import annotations

import re
import textwrap
from typing import Any, TypeVar

from graphkit.errors import IncompatibleModelError
from graphkit_train.trainers.params import check_loop_param

_ENTRY = re.compile(r"([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*):")


def _table(doc: str | None) -> dict[str, str]:
    """``{parameter: description}`` from the table ``Shared parameters:`` of ``doc``
    (empty when Python runs without docstrings, ``-OO``)."""
    lines = (doc or "").split("\n")
    start = next((k + 1 for k, ln in enumerate(lines) if ln == "Shared parameters:"), len(lines))
    table: dict[str, str] = {}
    for line in lines[start:]:
        found = _ENTRY.match(line[4:])
        if line.startswith("    ") and found:
            name = found.group(1)
            table[name] = line[4 + len(name) + 1 :].strip()
        elif line.startswith("        ") and table:
            name = next(reversed(table))
            table[name] += " " + line.strip()
    return table


SHARED_PARAMETERS: dict[str, str] = _table(__doc__)
"""``{parameter: its description}``, for every parameter two trainers or more share
(the table of this module's docstring)."""

MARK = "every other parameter: see :mod:`graphkit_train.trainers.shared`."
"""The last line of a trainer's ``Args:``, which :func:`shared_parameters` replaces."""

_WIDTH = 92  # the docstrings' lines stay within ruff's 100 columns

T = TypeVar("T", bound=type)


def shared_parameters(cls: T) -> T:
    """Write the ``Args:`` of ``cls``'s docstring in its constructor's order: the
    entries the docstring writes itself (those above its line :data:`MARK`),
    for every other parameter the description of the nearest base class decorated so
    (the seed's trainers take their parents' words), else that of
    :data:`SHARED_PARAMETERS`.

    Raises:
        ValueError: the docstring has no line :data:`MARK`, or describes a
            parameter the constructor does not take (a stale docstring).
    """
    if cls.__doc__ is None:  # python -OO
        return cls
    lines = cls.__doc__.split("\n")
    end = next((k for k, ln in enumerate(lines) if ln.strip() == MARK), None)
    if end is None:
        raise ValueError(f"{cls.__name__}'s docstring has no line {MARK!r}")
    indent = lines[end][: len(lines[end]) - len(lines[end].lstrip())]
    start = max(k for k in range(end) if lines[k].strip() == "Args:") + 1
    own: dict[str, list[str]] = {}  # each entry under its first name
    names_of: dict[str, str] = {}
    for line in lines[start:end]:
        found = _ENTRY.match(line[len(indent) :])
        if found and line.startswith(indent):
            first, *others = found.group(1).split(", ")
            own[first] = [line]
            names_of.update(dict.fromkeys([first, *others], first))
        else:
            own[next(reversed(own))].append(line)  # a continuation line
    params = cls._param_names()  # type: ignore[attr-defined]
    stale = sorted(set(names_of) - set(params))
    if stale:
        raise ValueError(f"{cls.__name__}'s docstring describes {stale}, no parameters")
    inherited: dict[str, list[str]] = getattr(cls, "_parameter_docs", {})
    entries: list[str] = []
    described: dict[str, list[str]] = {}
    for name in params:
        if name in names_of:
            entry = own.pop(names_of[name], [])
        elif name in inherited:
            entry = inherited[name]
        elif name in SHARED_PARAMETERS:
            text = f"{name}: {SHARED_PARAMETERS[name]}"
            wrapped = textwrap.fill(
                text,
                width=_WIDTH,
                initial_indent=indent,
                subsequent_indent=indent + "    ",
                break_on_hyphens=False,
                break_long_words=False,
            )
            entry = wrapped.split("\n")
        else:
            continue
        described[name] = entry
        entries.extend(entry)
    cls.__doc__ = "\n".join([*lines[:start], *entries, *lines[end + 1 :]])
    cls._parameter_docs = described  # type: ignore[attr-defined]
    return cls


ROLLBACKS = ("epoch", "checkpoint")
"""The values of ``rollback``."""


def check_common_params(params: Any) -> None:
    """Check the shared parameters that steer the loop (``max_iter``, ``batch_size``,
    ``n_iter_no_change``, ``validation_fraction``, ``tol``, ``train_mode``, ``rollback``) of
    a trainer (or any object holding them as attributes), when it builds.

    Raises:
        ValueError: naming the parameter and the value.
    """
    check_loop_param("max_iter", params.max_iter)
    check_loop_param("batch_size", params.batch_size)
    check_loop_param("n_iter_no_change", params.n_iter_no_change)
    if not 0 < params.validation_fraction < 1:
        raise ValueError(
            f"validation_fraction must lie in (0, 1), got {params.validation_fraction!r}."
        )
    if params.tol < 0:
        raise ValueError(f"tol must be >= 0, got {params.tol!r}.")
    train_mode = getattr(params, "train_mode", None)
    if train_mode is not None and not isinstance(train_mode, bool):
        raise ValueError(
            f"train_mode must be None (as the graph was exported), True or False, got "
            f"{train_mode!r}."
        )
    if getattr(params, "rollback", "epoch") not in ROLLBACKS:
        raise ValueError(f"rollback must be one of {list(ROLLBACKS)}, got {params.rollback!r}.")


def refuse_distributed_training_mode() -> None:
    """Raise: data-parallel training does not run layers in training mode yet.

    Raises:
        IncompatibleModelError: always, naming the way out.
    """
    raise IncompatibleModelError(
        "distributed=True does not run BatchNormalization or Dropout in training mode yet "
        "(graphkit.train_mode): train on one process, or pass train_mode=False to train "
        "every layer in inference mode."
    )


__all__ = [
    "MARK",
    "ROLLBACKS",
    "SHARED_PARAMETERS",
    "check_common_params",
    "refuse_distributed_training_mode",
    "shared_parameters",
]
