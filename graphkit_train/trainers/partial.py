"""Forward/backward (partial) training: the ONNX graph predicts, graphkit does the rest.

:class:`ForwardBackwardTrainer` trains a *prediction* graph with graphkit's pieces:

* ``loss``: the loss and its gradient with respect to the prediction;
* ``penalty``: a penalty on the weights and its gradient;
* ``optimizer`` and ``schedule``: the update and its learning rate.

:class:`OrtGradientForwardBackwardOptimizer` is the same trainer with the seed's
``learning_loss``, ``learning_penalty`` and ``learning_rate``.

Each batch takes two onnxruntime calls: the TrainingAgent's forward, which also computes
the loss and its gradient, and its backward, which also applies one fused update of every
weight (penalty + schedule + optimizer, see :func:`graphkit.training.step.build_update_step`
and :mod:`graphkit.backends.ort_training.agent_step`). Distributed training, which all-reduces the
gradients between backward and update, and graphs older than the loss and update
graphs' opset run the same pieces as four calls: forward, loss and its gradient,
backward, update. The seed's design ran one session for forward, one for the loss, one
for backward, and one update per weight.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from graphkit import backends, losses, penalties
from graphkit.compat import load_model
from graphkit.engine import ort_engine as engine
from graphkit.engine.ort_engine import Threads
from graphkit.ml_ops import linear_models_as_standard_ops
from graphkit.rewrite import select_prediction
from graphkit.shapes import ELEM_TO_DTYPE, named_shape
from graphkit.train_mode import DROPOUT_SEED
from graphkit.training.batches import NamedRows, Rows
from graphkit.training.specialized import folded, for_rows
from graphkit.training.step import batch_name, build_update_step, with_buffers
from graphkit.transforms import GradientTransformation
from graphkit.update_step import fuses_into, grad_name
from graphkit_train.engine.forward_backward import OrtGradientForwardBackward, binding_outputs
from graphkit_train.engine.resident import BindingCache
from graphkit_train.trainers.base import BaseTrainer
from graphkit_train.trainers.checkpointing import seed_dropout_stream
from graphkit_train.trainers.params import (
    input_value,
    providers_for,
    select_learning_rate,
    select_optimizer,
)
from graphkit_train.trainers.shared import refuse_distributed_training_mode, shared_parameters

SPINNING = True
"""Whether the TrainingAgent session's idle threads spin (onnxruntime's default)."""

SERIAL_BELOW = 250_000
"""Tensor elements (weights for the update, predictions of a batch for the loss) below
which the loss and update sessions run on the calling thread, with no thread pool (where
they run as sessions of their own: the four-call batches, validation losses).

Each session owns a pool (onnxruntime-training 1.19.2's Python API has no global one), and
a pool that spins after its run takes cores from the next session's kernels. Measured on
a 2-core machine, AdamW on MLP 100-256-256-1 at batch 256 (92k weights): 1300-1340
us/batch with a serial loss and update, 1400-2150 with pools (spinning or not); the
update alone costs 250 us serial, 212 on 2 threads, but 1362 against 833 at 500k weights."""


@shared_parameters
class ForwardBackwardTrainer(BaseTrainer):
    """Train a prediction graph with forward/backward passes and graphkit's DSL pieces.

    Args:
        model_onnx: the prediction graph (ModelProto, bytes or path); its first float
            output is the prediction the loss compares with the labels.
        loss_output_name: name given to the loss in the exported graphs.
        loss: a loss name (the names of :mod:`graphkit.losses`, the same as
            everywhere in graphkit: ``"squared_error"``, ``"elastic"``, ``"log"`` for
            probabilities, ``"sigmoid_log_loss"`` for raw scores, ``"cross_entropy"``
            for logits...) or a graphkit Loss. One loss on one output: a dict of losses
            (one per output) is refused; :class:`~graphkit_train.Trainer` trains those.
        penalty: None, a penalty name or a graphkit Penalty.
            Its gradient is added to the loss gradient (so the learning rate scales it;
            the seed decayed the weights without it).
        every other parameter: see :mod:`graphkit_train.trainers.shared`.

    Attributes (after ``fit``): ``train_losses_``, ``validation_losses_``,
    ``loss_`` (the loss resolved for the prediction's shape; ``learning_loss_`` as
    given), ``optimizer_`` (the gradient transformation, also ``learning_rate_``),
    ``penalty_`` (a graphkit Penalty, also ``learning_penalty_``), ``forward_backward_``,
    ``weights_to_train_``.
    """

    loss_: losses.Loss  # always known here: the loss it builds the gradient from
    # its own constructor parameters (the shared ones are declared on BaseTrainer)
    loss: Any
    penalty: Any
    optimizer: Any
    schedule: Any
    output_index: int | str | None

    def __init__(
        self,
        model_onnx: Any,
        weights_to_train: list[str] | None = None,
        *,
        loss: Any = "squared_error",
        penalty: Any = None,
        optimizer: Any = "sgd",
        schedule: Any = None,
        loss_output_name: str = "loss",
        max_iter: int = 100,
        batch_size: int = 10,
        device: str = "cpu",
        warm_start: bool = False,
        verbose: int = 0,
        validation_every: float | int = 0.1,
        output_index: int | str | None = None,
        exc: bool = True,
        shuffle: bool | None = None,
        random_state: int | None = None,
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        n_iter_no_change: int = 10,
        tol: float = 1e-4,
        distributed: bool = False,
        intra_op_num_threads: int | None = None,
        execution_mode: str = "sequential",
        backend: str | None = None,
        untie_shared_weights: bool = True,
        rollback: str = "epoch",
        tie_weights: bool = True,
        train_mode: bool | None = None,
    ) -> None:
        self._store_params(locals())
        self._invalidate()

    # -- parameters (the seed's subclass maps its own onto these) --------------------------

    def _select_loss(self) -> losses.Loss:
        return _one_loss(self.loss, "loss")

    def _select_optimizer(self) -> GradientTransformation:
        return select_optimizer(self.optimizer, self.schedule)

    def _select_penalty(self) -> penalties.Penalty:
        return penalties.resolve(self.penalty)

    @property
    def optimizer_(self) -> GradientTransformation:
        """The gradient transformation trained with (``learning_rate_``)."""
        return self.learning_rate_

    @property
    def penalty_(self) -> penalties.Penalty:
        """The penalty trained with (``learning_penalty_``)."""
        return self.learning_penalty_

    # -- building --------------------------------------------------------------------------

    def _build(self) -> None:
        if self._built:
            return
        self._check_loop_params()
        self._backend = backends.get(self.backend)
        self._providers, self._ort_device, self._device_id = providers_for(self.device)
        threads = Threads.checked(self.intra_op_num_threads, self.execution_mode)
        self._threads = Threads(threads.intra_op, threads.mode, spinning=SPINNING)
        self.learning_loss_ = self._select_loss()  # first: a dict of losses is refused
        model, prediction = select_prediction(load_model(self.model_onnx), self.output_index)
        self.learning_rate_ = self._select_optimizer()
        self.learning_penalty_ = self._select_penalty()
        fb = self.forward_backward_ = OrtGradientForwardBackward(
            model,
            self.weights_to_train,
            output_names=[prediction.name],
            device=self.device,
            threads=self._threads,
            backend=self._backend,
            untie_shared_weights=self.untie_shared_weights,
            tie_weights=self.tie_weights,
            train_mode=self.train_mode,
        )
        dtype = ELEM_TO_DTYPE[prediction.type.tensor_type.elem_type]
        self._prediction_shape = named_shape(prediction)
        self.loss_ = self.learning_loss_.for_prediction(self._prediction_shape)
        self._loss_dtype = dtype
        self._loss_runs: dict[tuple[bool, int | None], LossRun] = {}
        self.weights_to_train_ = list(fb.weight_names)
        values = {w: fb.weights[w].numpy() for w in fb.weight_names}
        self.update_step_ = build_update_step(
            values, self.learning_rate_, self.learning_penalty_, dtype
        )
        # layers in training mode: the running statistics the forward updates are
        # resident, the update step writes the forward's values (graphkit.train_mode)
        self._training_mode = fb.trains_layers_in_training_mode
        if self._training_mode and self.distributed:
            refuse_distributed_training_mode()
        if self._training_mode:
            buffers = {b: fb.buffers[b].numpy() for b in fb.buffer_names}
            seed = DROPOUT_SEED if DROPOUT_SEED in fb.buffers else None
            self.update_step_ = with_buffers(self.update_step_, buffers, seed)
            seed_dropout_stream(self.update_step_.initial, self.random_state)
        self._no_input_grads: frozenset[str] = frozenset()
        self._variant = fb._variant(self._no_input_grads)
        # known before any loss or update session is made: their threads depend on it
        self._fuses = not self._training_mode and fuses_into(
            self._variant.gradient_model,
            self.loss_.gradient_model(dtype, False, self._prediction_shape),
            self.update_step_,
        )
        self.loss_onnx_ = self._loss_run(weighted=False, rows=None).graph
        # folded once (its scalar arithmetic on constants, the Identity nodes): the
        # exported "update" graph stays the readable one
        size = sum(v.size for v in values.values())
        self._resident_session = self._backend.inference_session(
            folded(self.update_step_.model), self._providers, self._threads_for(size)
        )
        self._input_values = [input_value(model, n) for n in fb.input_names]
        self._label_value = input_value(self.loss_onnx_, "label")
        self._weight_dtype = np.dtype(dtype)
        self._accepts_sample_weight = True
        self._requires_sample_weight = False
        self._c_device = engine.ort_device(self._ort_device, self._device_id)
        self._feed_sources = fb.feed_sources(self._variant)
        # the weight of each gradient the backward returns, in its order (the same in
        # every variant: specializing keeps a graph's outputs)
        self._gradient_of = [self._variant.grad_of[n] for n in self._variant.fetch_names]
        self._update_inputs = [grad_name(w) for w in self._gradient_of]
        self._agent_runs: dict[tuple[bool, int | None], Any] = {}
        self._per_sample: Any = None
        self._built = True

    def _is_classifier(self) -> bool:
        """Whether the loss takes class labels (read from the loss parameter, no build)."""
        if self._built:
            return self.loss_.task == losses.CLASSIFICATION
        try:
            return self._select_loss().task == losses.CLASSIFICATION
        except (TypeError, ValueError, KeyError):  # fit() will report the bad loss
            return False

    def _loss_run(self, weighted: bool, rows: int | None) -> LossRun:
        """The loss-and-gradient session (with or without sample weights), built once;
        for a batch of ``rows`` rows it is specialized to that size (its shape arithmetic
        folded away: 9 kernels instead of 33 for the squared error), for None it takes
        any number of rows."""
        key = (weighted, rows)
        if key not in self._loss_runs:
            graph = self.loss_.gradient_model(self._loss_dtype, weighted, self._prediction_shape)
            if rows is not None:
                data = ["prediction", "label"] + (["weight"] if weighted else [])
                graph = for_rows(graph, data, rows, self._backend.constant_folds)
            per_row = self._prediction_shape[1:]
            widths = [d for d in per_row if isinstance(d, int)]
            known = rows is not None and len(widths) == len(per_row)
            size = rows * math.prod(widths) if rows is not None and known else None
            session = self._backend.inference_session(
                graph, self._providers, self._threads_for(size)
            )
            self._loss_runs[key] = LossRun(graph, session, self._ort_device, self._device_id)
        return self._loss_runs[key]

    def _agent_step(self, weighted: bool) -> Any:
        """The agent's gradient graph with the loss and the update fused in, for any
        number of rows (see :mod:`graphkit.backends.ort_training.agent_step`)."""
        fb, variant = self.forward_backward_, self._variant
        loss = self.loss_.gradient_model(self._loss_dtype, weighted, self._prediction_shape)
        return self._backend.agent_step(
            variant.gradient_model,
            loss,
            self.update_step_,
            {w: w for w in fb.weight_names},
            variant.grad_of,
            fb.input_names,
            seeds=variant.seeds,
        )

    def _agent_run(self, weighted: bool, rows: int | None) -> Any:
        """The two-call batch for batches of ``rows`` rows, with or without sample
        weights: :meth:`_agent_step` specialized to that size (None: for any size),
        built once."""
        key = (weighted, rows)
        if key not in self._agent_runs:
            step = self._agent_step(weighted)
            model = (
                step.model
                if rows is None
                else for_rows(step.model, step.data, rows, self._backend.constant_folds)
            )
            short = rows is not None and rows < self.batch_size  # the last batch, once per epoch
            threads = self._threads.once_per_epoch() if short else self._threads
            session = self._backend.inference_session(model, self._providers, threads)
            self._agent_runs[key] = self._backend.AgentRun(
                model, session, step, self._loss_dtype, self._c_device
            )
        return self._agent_runs[key]

    def _threads_for(self, elements: int | None) -> Threads:
        """The loss and update sessions' threads: serial for small tensors (see
        :data:`SERIAL_BELOW`), the trainer's otherwise."""
        if self.intra_op_num_threads is None and elements is not None:
            if elements < SERIAL_BELOW:
                return Threads(1, self._threads.mode, spinning=False)
        if not self._fuses:
            # four sessions a batch (a backend whose runner does not fuse the loss and
            # the update): a pool that spins after its run takes the next one's cores
            return Threads(self._threads.intra_op, self._threads.mode, spinning=False)
        return self._threads

    def _bind_scratch(self, binding: Any) -> None:
        """The update step has no output besides the resident ones."""

    def _buffers_changed(self) -> None:
        self._weight_feeds: list[list[Any]] | None = None
        # per buffer set k: its C values, and a C vector of the other set's, written into
        resident = self.update_step_.resident
        sets = [[b[n]._ortvalue for n in resident] for b in self._buffers]  # type: ignore[union-attr]
        self._agent_sets = [(sets[k], self._backend.values_vector(sets[1 - k])) for k in (0, 1)]

    # -- one batch -------------------------------------------------------------------------

    def _run_batch(
        self, binding: Any, X: Rows, y: np.ndarray, w: np.ndarray | None, static: bool = True
    ) -> None:
        """The backend's fused step (ort_training: the agent's forward with the loss, its
        backward with the update; native: one call; it reads the current buffer set and
        writes the other, so a batch that fails leaves the current set as the last good
        batch left it) or, where the pieces cannot be fused (distributed training, graphs
        onnx cannot raise to the pieces' opset), four calls. ``static``:
        through graphs specialized to the batch's size (else the graphs for any size)."""
        if self._fuses:
            key, runs = (w is not None, len(X) if static else None), self._agent_runs
            run = runs[key] if key in runs else self._agent_run(*key)
            run(self._feature_arrays(X), y, w, *self._agent_sets[self._current])
            return
        loss, gradients = self._backward(X, y, w, static)
        names = self._update_inputs
        values = [gradients[i] for i in range(len(names))]
        if self._training_mode:  # the running statistics the forward computed
            names = [*names, *(batch_name(b) for b in self.update_step_.buffers)]
            values += [v._ortvalue for v in self._batch_buffers]
        self._run_update(binding, loss, names, values)

    def _run_streamed(
        self, binding: Any, X: Rows, y: np.ndarray, w: np.ndarray | None, specialized: bool
    ) -> None:
        self._run_batch(binding, X, y, w, static=specialized)

    # -- four calls (distributed training, graphs older than the pieces' opset) ---------

    def _feeds(self, features: list[Any]) -> list[Any]:
        """The forward's C OrtValues in feed order: the features (C OrtValues, one per
        input in ``input_names`` order) and the current weights (one list per buffer set,
        made once)."""
        if self._weight_feeds is None:
            sources = self._feed_sources
            self._features_at = [sources.index(n) for n in self.forward_backward_.input_names]
            self._weight_feeds = [
                [None if n not in buffers else buffers[n]._ortvalue for n in sources]
                for buffers in self._buffers  # type: ignore[union-attr]
            ]
        feeds = list(self._weight_feeds[self._current])
        for at, value in zip(self._features_at, features):
            feeds[at] = value
        return feeds

    def _feature_arrays(self, X: Rows) -> list[np.ndarray]:
        """The arrays of every input, in ``input_names`` order, C-contiguous (the C values
        made from them borrow their memory)."""
        if isinstance(X, NamedRows):
            arrays = X.arrays
            return [np.ascontiguousarray(arrays[n]) for n in self.forward_backward_.input_names]
        return [np.ascontiguousarray(X)]

    def _forward(self, X: Rows) -> Any:
        """The prediction (an OrtValue) with the current weights, without training."""
        fb = self.forward_backward_
        features = dict(zip(fb.input_names, map(fb.to_ortvalue, self._feature_arrays(X))))
        current = self._resident
        if self._training_mode:  # the inference form, with the running statistics
            session = fb.inference_session()
            reads = [i.name for i in session.get_inputs()]
            given = {n: features[n] if n in features else current[n] for n in reads}
            return session.run_with_ort_values([fb.output_names[0]], given)[0]
        feeds = [features[n] if n in features else current[n] for n in self._feed_sources]
        session = self._variant.forward_session
        names = dict(zip(self._variant.feed_names, feeds))
        return session.run_with_ort_values([fb.output_names[0]], names)[0]

    def _loss_and_grad(
        self, prediction: Any, y: np.ndarray, w: np.ndarray | None, static: bool = False
    ) -> list[Any]:
        """``[loss, prediction_grad]`` (OrtValues) for a C OrtValue prediction; both are
        overwritten by the next call with the same session (read them first). ``static``:
        a training batch, whose few sizes each get a specialized graph."""
        key = (w is not None, len(y) if static else None)
        runs = self._loss_runs
        run = runs[key] if key in runs else self._loss_run(*key)
        y = np.ascontiguousarray(y)  # the C values borrow the arrays until the run ends
        w = None if w is None else np.ascontiguousarray(w)
        device = self._c_device
        label = engine.c_ortvalue(y, device)
        return run(prediction, label, None if w is None else engine.c_ortvalue(w, device))

    def _backward(
        self, X: Rows, y: np.ndarray, w: np.ndarray | None, static: bool = True
    ) -> tuple[Any, Any]:
        """``(loss, gradients)`` of one batch: forward, loss and its gradient, backward,
        on C OrtValues (this is the hot loop: nothing is wrapped in Python objects); the
        gradients are a C vector in ``_gradient_of`` order. ``static``: through graphs
        specialized to the batch's size."""
        arrays = self._feature_arrays(X)  # the C values borrow them until the backward
        fb = self.forward_backward_
        # specialized to the batch size, or the graphs for any size
        variant = fb._variant(self._no_input_grads, len(X) if static else None)
        device = self._c_device
        features = [engine.c_ortvalue(a, device) for a in arrays]
        # the feeds vector (third) must live until the backward
        fetches, state, _feeds = self._backend.run_forward(variant.agent, self._feeds(features))
        seeds = []
        if self._training_mode:  # copied out: the backward reuses the forward's memory
            updated = engine.wrap(fetches)[1 : 1 + len(fb.buffer_names)]
            self._batch_buffers = [fb.to_ortvalue(np.array(v.numpy())) for v in updated]
            self._buffer_seeds = fb.zeros_like(updated)  # alive until the backward ends
            seeds = [z._ortvalue for z in self._buffer_seeds]
        loss, prediction_grad = self._loss_and_grad(fetches[0], y, w, static=static)
        gradients = self._backend.run_backward(
            variant.agent, [prediction_grad._ortvalue, *seeds], state
        )
        return loss, gradients

    def _gradients(self, X: Rows, y: np.ndarray, w: np.ndarray | None) -> tuple[Any, dict]:
        loss, gradients = self._backward(X, y, w)
        return loss, dict(zip(self._gradient_of, engine.wrap(gradients)))

    # -- using the trained weights ---------------------------------------------------------

    def _loss(self, X: Rows, y: np.ndarray, w: np.ndarray | None) -> float:
        prediction = self._forward(X)._ortvalue
        return float(self._loss_and_grad(prediction, y, w)[0].numpy())

    def _predict_outputs(self, X: Rows) -> np.ndarray:
        return self._forward(X).numpy()

    def losses(self, X: Any, y: Any, sample_weight: Any = None) -> np.ndarray:
        """The loss of every sample (weighted when sample weights are given)."""
        self._build()
        X, y, w = self._check(X, y, sample_weight)
        if self._per_sample is None:
            loss = self.loss_
            per_sample = losses.get(loss.name, **{**loss.params, "reduction": "none"})
            self._per_sample = per_sample
        prediction = self._forward(X).numpy()
        return self._per_sample(prediction, y, w)

    def _prediction_model(self) -> onnx.ModelProto:
        model = linear_models_as_standard_ops(load_model(self.model_onnx))
        return select_prediction(model, self.output_index)[0]

    def _graphs(self) -> dict[str, onnx.ModelProto]:
        """``forward`` and ``gradient`` (from onnxruntime-training), ``loss`` (loss and its
        gradient) and ``update`` (penalty + schedule + optimizer for every weight)."""
        return {
            "forward": self._variant.forward_model,
            "gradient": self._variant.gradient_model,
            self.loss_output_name: self.loss_onnx_,
            "update": self.update_step_.model,
        }


def _one_loss(loss: Any, parameter: str) -> losses.Loss:
    """The one loss of forward/backward training; a dict of losses (one per output) is
    refused, naming the trainer that takes it."""
    if isinstance(loss, Mapping):
        raise TypeError(
            f"{parameter}={dict(loss)!r}: forward/backward training applies one loss to one "
            "output (output_index). For a loss per output, build the training graph with "
            "graphkit.add_loss_output(model, {output: loss, ...}, loss_weights={...}) and "
            "train it with graphkit_train.Trainer (or pass Trainer(model, loss={output: "
            "loss, ...}, loss_weights={...})), whose fit takes y = {output name: labels}."
        )
    return losses.resolve(loss)


class LossRun:
    """A loss-and-gradient session on C OrtValues, whose outputs are allocated by its
    first run for a prediction shape and then bound, so later runs write into them (no
    allocation, no output read-back). The values returned are those buffers: each run
    overwrites the previous run's."""

    def __init__(self, graph: onnx.ModelProto, session: Any, device: str, device_id: int) -> None:
        self.graph = graph
        self.session = session
        self.binding = session.io_binding()
        self._bind = engine.input_binder(self.binding)
        self._device = (device, device_id)
        self._shape: list[int] | None = None
        self._outputs: list[Any] = []

    def __call__(self, prediction: Any, label: Any, weight: Any | None) -> list[Any]:
        bind = self._bind
        bind("prediction", prediction)
        bind("label", label)
        if weight is not None:
            bind("weight", weight)
        shape = prediction.shape()
        if shape == self._shape:
            self.session.run_with_iobinding(self.binding)
            return self._outputs
        binding = self.binding
        binding.clear_binding_outputs()
        for name in _LOSS_OUTPUTS:
            binding.bind_output(name, *self._device)
        self.session.run_with_iobinding(binding)
        self._outputs = binding_outputs(binding)
        for name, value in zip(_LOSS_OUTPUTS, self._outputs):
            binding.bind_ortvalue_output(name, value)
        self._shape = shape
        return self._outputs


_LOSS_OUTPUTS = ("loss", "prediction_grad")


@shared_parameters
class OrtGradientForwardBackwardOptimizer(ForwardBackwardTrainer):
    """:class:`ForwardBackwardTrainer` with the seed library's three attributes.

    Args:
        learning_rate: the optimizer and its schedule, as in
            :class:`~graphkit_train.OrtGradientOptimizer`: None (the default) is the
            seed's ``LearningRateSGD()``, SGD with scikit-learn's invscaling schedule; a
            name is graphkit's optimizer at a constant 0.01 (``"SGD"`` is constant-rate
            SGD).
        learning_loss: a loss name (graphkit's, as everywhere: ``"squared_error"``,
            ``"sigmoid_log_loss"``...), a graphkit Loss or a ``*LearningLoss`` object
            (:mod:`graphkit.seed`; a seed class name is no loss name).
        learning_penalty: None, a penalty name, a graphkit Penalty or a
            ``*LearningPenalty`` object.
        every other parameter: see :mod:`graphkit_train.trainers.shared`.

    Attributes (after ``fit``): as in :class:`ForwardBackwardTrainer`.
    """

    learning_rate: Any
    learning_loss: Any
    learning_penalty: Any

    def __init__(
        self,
        model_onnx: Any,
        weights_to_train: list[str] | None = None,
        loss_output_name: str = "loss",
        max_iter: int = 100,
        batch_size: int = 10,
        learning_rate: Any = None,
        device: str = "cpu",
        warm_start: bool = False,
        verbose: int = 0,
        validation_every: float | int = 0.1,
        learning_loss: Any = "squared_error",
        output_index: int | str | None = None,
        learning_penalty: Any = None,
        exc: bool = True,
        shuffle: bool | None = None,
        random_state: int | None = None,
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        n_iter_no_change: int = 10,
        tol: float = 1e-4,
        distributed: bool = False,
        intra_op_num_threads: int | None = None,
        execution_mode: str = "sequential",
        backend: str | None = None,
        untie_shared_weights: bool = True,
        rollback: str = "epoch",
        tie_weights: bool = True,
        train_mode: bool | None = None,
    ) -> None:
        self._store_params(locals())
        self._invalidate()

    def _select_loss(self) -> losses.Loss:
        return _one_loss(self.learning_loss, "learning_loss")

    def _select_optimizer(self) -> GradientTransformation:
        return select_learning_rate(self.learning_rate)

    def _select_penalty(self) -> penalties.Penalty:
        return penalties.resolve(self.learning_penalty)


# BindingCache: seed API
__all__ = [
    "BindingCache",
    "ForwardBackwardTrainer",
    "LossRun",
    "OrtGradientForwardBackwardOptimizer",
]
