"""Full training: the loss is part of the graph, one fused ONNX graph per training step.

:class:`Trainer` (and :class:`OrtGradientOptimizer`, the same with the seed's API)
builds the training step once
(:func:`graphkit.training.step.build_training_step`) and runs it once per mini-batch: the
weights, the optimizer state, the step counter and the epoch's loss sum stay resident
in onnxruntime (see :mod:`graphkit_train.trainers.base`); only the batch's features and
labels are bound per step, and the loss is read back once per epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from graphkit import backends, losses
from graphkit.compat import load_model
from graphkit.engine import ort_engine as engine
from graphkit.engine.ort_engine import Threads
from graphkit.gradient import gradient_model
from graphkit.losses import Loss
from graphkit.rewrite import (
    META_LABEL,
    META_PREDICTION,
    add_loss_output,
    initializers_to_inputs,
    loss_heads,
    metadata,
    strip_loss_output,
)
from graphkit.shapes import ELEM_TO_DTYPE, named_shape
from graphkit.train_mode import DROPOUT_SEED
from graphkit.training.batches import NamedRows, Rows, epoch_batches, shuffled_pieces
from graphkit.training.problem import TrainingProblem
from graphkit.training.specialized import Fold, fused_step
from graphkit.training.step import TrainingStep, build_update_step
from graphkit.transforms import GradientTransformation
from graphkit.update_step import LOSS_SUM, grad_name
from graphkit_train.engine.forward_backward import binding_outputs
from graphkit_train.trainers.base import BaseTrainer
from graphkit_train.trainers.checkpointing import dropout_seed
from graphkit_train.trainers.heads import heads_of, recorded_loss
from graphkit_train.trainers.params import (
    input_value,
    providers_for,
    select_learning_rate,
    select_optimizer,
)
from graphkit_train.trainers.shared import refuse_distributed_training_mode, shared_parameters


@shared_parameters
class Trainer(BaseTrainer):
    """Train the weights of an ONNX graph whose loss is one of its outputs.

    Args:
        model_onnx: a training graph, e.g. from :func:`graphkit.add_loss_output`, or a
            prediction graph when ``loss`` is given (a ModelProto, its bytes or a path).
        loss: None (the default): ``model_onnx`` outputs its loss already. A loss name
            or :class:`~graphkit.losses.Loss`: ``model_onnx`` is a prediction graph, and
            the trainer appends the loss to its only float output with
            ``graphkit.add_loss_output(model_onnx, loss, loss_name=loss_output_name)``
            (no sample-weight input and no penalty: for those, or to choose the output,
            call ``add_loss_output`` yourself). A dict ``{output name: loss}``: a loss
            per output, weighted by ``loss_weights`` (Keras's ``loss`` and
            ``loss_weights``); ``fit`` then takes ``y = {output name: labels}``.
        loss_weights: with a dict of losses, ``{output name: weight}`` (1 for a head
            left out).
        loss_output_name: the output holding the loss.
        distributed: data-parallel training over the ranks of an initialized
            ``torch.distributed`` process group (see :mod:`graphkit_train.distributed`):
            the fused step is split into a gradient graph and an update graph around
            one all-reduce per step.
        every other parameter: see :mod:`graphkit_train.trainers.shared`.

    Attributes (after ``fit``):
        train_losses_: mean batch loss of every epoch.
        validation_losses_: loss on ``(X_val, y_val)`` at each validation.
        learning_rate_, optimizer_: the gradient transformation trained with (its
            learning rate filled in).
        weights_to_train_: the weights trained.
        problem_: the :class:`~graphkit.training.problem.TrainingProblem` every graph
            is built from.
        training_step_: the :class:`~graphkit.training.step.TrainingStep` (its ``model`` is
            the fused ONNX graph).
    """

    # its own constructor parameters (the shared ones are declared on BaseTrainer)
    optimizer: Any
    schedule: Any
    loss: Any
    sample_weight_name: str
    steps_per_run: int | str
    static_shapes: bool
    loss_weights: Mapping[str, float] | None

    def __init__(
        self,
        model_onnx: Any,
        weights_to_train: list[str] | None = None,
        *,
        optimizer: Any = "sgd",
        schedule: Any = None,
        loss: Any = None,
        loss_output_name: str = "loss",
        max_iter: int = 100,
        batch_size: int = 10,
        device: str = "cpu",
        warm_start: bool = False,
        verbose: int = 0,
        validation_every: float | int = 0.1,
        sample_weight_name: str = "weight",
        shuffle: bool | None = None,
        random_state: int | None = None,
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        n_iter_no_change: int = 10,
        tol: float = 1e-4,
        distributed: bool = False,
        steps_per_run: int | str = "epoch",
        static_shapes: bool = True,
        intra_op_num_threads: int | None = None,
        execution_mode: str = "sequential",
        backend: str | None = None,
        untie_shared_weights: bool = True,
        tie_weights: bool = True,
        loss_weights: Mapping[str, float] | None = None,
        rollback: str = "epoch",
        train_mode: bool | None = None,
    ) -> None:
        self._store_params(locals())
        self._invalidate()

    # -- parameters (the seed's subclass maps its own onto these) --------------------------

    def _select_optimizer(self) -> GradientTransformation:
        return select_optimizer(self.optimizer, self.schedule)

    def _select_loss(self) -> Loss | None:
        """The loss to append to ``model_onnx`` (None: the graph has its loss, or a loss
        per output is appended)."""
        if self.loss is None or isinstance(self.loss, Mapping):
            return None
        return losses.resolve(self.loss)

    def _training_graph(self) -> onnx.ModelProto:
        model = load_model(self.model_onnx)
        loss_weights = getattr(self, "loss_weights", None)  # the seed's API has neither
        per_output = getattr(self, "loss", None)
        if isinstance(per_output, Mapping):
            per_output = {output: losses.resolve(loss) for output, loss in per_output.items()}
            return add_loss_output(
                model, per_output, loss_name=self.loss_output_name, loss_weights=loss_weights
            )
        if loss_weights is not None:
            raise ValueError(
                "loss_weights weighs a loss per output: pass loss as a dict {output name: "
                "loss}, e.g. loss={'price': 'squared_error', 'kind': 'cross_entropy'}."
            )
        loss = self._select_loss()
        if loss is None:
            return model
        return add_loss_output(model, loss, loss_name=self.loss_output_name)

    @property
    def optimizer_(self) -> GradientTransformation:
        """The gradient transformation trained with (``learning_rate_``)."""
        return self.learning_rate_

    # changing how many steps a run takes, or whether the step is specialized, keeps
    # the built graphs: the fused sessions are built per batch size when first needed
    _loop_params = BaseTrainer._loop_params | {"steps_per_run", "static_shapes"}

    def _invalidate(self) -> None:
        super()._invalidate()
        self._fused_runners: dict[tuple[int, bool, bool], FusedRunner] = {}

    def _build(self) -> None:
        if self._built:
            return
        self._check_loop_params()
        steps_per_run(self.steps_per_run)
        self._threads = Threads.checked(self.intra_op_num_threads, self.execution_mode)
        self._providers, self._ort_device, self._device_id = providers_for(self.device)
        self._backend = backends.get(self.backend)
        self._c_device = engine.ort_device(self._ort_device, self._device_id)
        self.learning_rate_ = self._select_optimizer()
        problem = self.problem_ = TrainingProblem.from_model(
            self._training_graph(),
            self.weights_to_train,
            self.learning_rate_,
            self.loss_output_name,
            self.sample_weight_name,
            self._backend,
            self.untie_shared_weights,
            self.tie_weights,
            self.train_mode,
        )
        self.train_onnx_, self.weights_to_train_ = problem.model, problem.weights
        # the graph exported with the trained weights: the user's, linear models written
        # with standard operators (their coefficients are the weights)
        assert problem.user_model is not None  # from_model sets it
        self._user_onnx = problem.user_model
        problem.dropout_seed = dropout_seed(self.random_state)  # the masks' stream
        self.training_step_: TrainingStep = problem.step()
        step = self.update_step_ = self.training_step_
        if self.distributed:  # gradients and update apart, an all-reduce between them
            self._build_distributed()
        else:  # the step for any batch size runs the last, shorter batch of an epoch
            threads = self._threads.once_per_epoch()
            self._resident_session = self._backend.inference_session(
                step.model, self._providers, threads
            )
            self._loss_scratch = self._ortvalue(step.initial["loss_sum"])
        self._input_values = [input_value(self.train_onnx_, n) for n in step.feature_inputs]
        self._heads = heads_of(self.train_onnx_)
        self.loss_ = _recorded_loss(self.train_onnx_) if self._heads is None else None
        if self._heads is not None:
            self.losses_ = {h.output: h.loss for h in self._heads}
            self.loss_weights_ = {h.output: h.weight for h in self._heads}
        prediction = metadata(self.train_onnx_).get(META_PREDICTION)
        outputs = {o.name: o for o in self.train_onnx_.graph.output}
        self._prediction_shape = named_shape(outputs[prediction]) if prediction in outputs else ()
        self._label_value = input_value(self.train_onnx_, step.label)
        self._classifier = self._has_class_labels(self.train_onnx_)
        self._accepts_sample_weight = self._requires_sample_weight = step.sample_weight is not None
        self._weight_dtype = (  # read only where the graph takes sample weights
            _elem_dtype(input_value(self.train_onnx_, step.sample_weight))
            if step.sample_weight
            else np.dtype(np.float32)
        )
        # the training graph and the prediction graph, reading the weights as inputs
        self.evaluation_onnx_ = initializers_to_inputs(self.train_onnx_, step.model_state)
        self.prediction_onnx_ = strip_loss_output(self.evaluation_onnx_)
        self._eval_session = self._session(self.evaluation_onnx_)
        self._predict_session = self._session(self.prediction_onnx_)
        self._built = True

    def _session(self, model: onnx.ModelProto) -> Any:
        return self._backend.inference_session(model, self._providers, self._threads)

    # -- fused steps: one run for many batches ---------------------------------------------

    def _runner(self, batch_size: int, looped: bool | None = None) -> FusedRunner:
        """The fused sessions for this batch size (built once, kept across fits): a
        Scan over several batches when ``looped`` (None: unless ``steps_per_run`` is 1)."""
        if looped is None:
            looped = self._steps_per_run() != 1
        key = (batch_size, bool(self.static_shapes), looped)
        runner = self._fused_runners.get(key)
        if runner is None:
            runner = self._fused_runners[key] = FusedRunner(
                self.training_step_,
                batch_size,
                self._session,
                *key[1:],
                folds=self._backend.constant_folds,
            )
        if runner.bindings is None:
            runner.bind(self)
        return runner

    def _steps_per_run(self) -> int | str:
        """``steps_per_run``, where ``"epoch"`` means one call per batch for trained
        values of :data:`SCAN_UP_TO_BYTES` or more: a Scan holds copies of what it
        carries from batch to batch (the weights, twice), and a batch of such a model
        takes long enough that a call per batch costs nothing measurable."""
        chosen = steps_per_run(self.steps_per_run)
        if chosen != "epoch":
            return chosen
        step = self.training_step_
        carried = sum(np.asarray(step.initial[n]).nbytes for n in step.resident)
        return 1 if carried >= SCAN_UP_TO_BYTES else chosen

    def _buffers_changed(self) -> None:
        for runner in getattr(self, "_fused_runners", {}).values():
            runner.bindings = None

    def _prepare_epochs(
        self, X: Rows, y: np.ndarray, w: np.ndarray | None, batch_size: int
    ) -> None:
        runner = self._runner(batch_size)
        if runner.scan is not None:
            chunk = self._steps_per_run()
            # the arrays in the order of runner.data: every feature input, label, weight
            names = self.training_step_.feature_inputs
            features = [X.arrays[n] for n in names] if isinstance(X, NamedRows) else [X]
            labels = list(self._label_feeds(y).values())
            weights = [] if w is None else [w]
            runner.set_data([*features, *labels, *weights], self._c_device, chunk)

    def _run_rows(
        self,
        X: Rows,
        y: np.ndarray,
        w: np.ndarray | None,
        order: np.ndarray | None,
        batch_size: int,
    ) -> float:
        """Full batches through the fused sessions, a last shorter one through the step
        built for any batch size."""
        runner = self._runner(batch_size)
        n = len(X)
        if runner.scan is not None:
            for values in runner.chunks(order):
                binding = runner.bindings[self._current]  # type: ignore[index]
                bind = engine.input_binder(binding)
                for name, value in zip(runner.data, values):
                    bind(name, value)
                runner.scan.run_with_iobinding(binding)
                self._current = 1 - self._current
            start = n - n % batch_size
            if start < n:
                rest = slice(start, n) if order is None else order[start:]
                self._run_batch(
                    self._bindings[self._current],
                    X[rest],
                    y[rest],
                    None if w is None else w[rest],
                )
                self._current = 1 - self._current
        else:
            for X_batch, y_batch, w_batch in epoch_batches(X, y, w, order, batch_size):
                if len(X_batch) == batch_size:  # a full batch: the step specialized to it
                    binding = runner.bindings[self._current]  # type: ignore[index]
                    self._run_step(runner.session, binding, X_batch, y_batch, w_batch)
                else:
                    self._run_batch(self._bindings[self._current], X_batch, y_batch, w_batch)
                self._current = 1 - self._current
        batches_run = -(-n // batch_size)
        return float(self._resident[LOSS_SUM].numpy()) / batches_run

    def _run_streamed(
        self, binding: Any, X: Rows, y: np.ndarray, w: np.ndarray | None, specialized: bool
    ) -> None:
        """A streamed batch, one run: through the step specialized to its size (as the
        full batches of in-memory data with ``steps_per_run=1``), or the step for any
        size (as a last, shorter batch)."""
        if specialized and self.static_shapes:
            runner = self._runner(len(X), looped=False)
            bindings: list[Any] = runner.bindings  # type: ignore[assignment]
            self._run_step(runner.session, bindings[self._current], X, y, w)
        else:
            self._run_batch(binding, X, y, w)

    def _is_classifier(self) -> bool:
        """Class labels (an int64 label input), read from the graph without building; a
        loss per output is neither a classifier nor a regressor (False)."""
        if self._built:
            return self._classifier
        if isinstance(getattr(self, "loss", None), Mapping):
            return False
        loss = self._select_loss()
        if loss is not None:
            return loss.task == losses.CLASSIFICATION
        return self._has_class_labels(load_model(self.model_onnx))

    @staticmethod
    def _has_class_labels(model: onnx.ModelProto) -> bool:
        if len(loss_heads(model)) > 1:  # a loss per output: neither
            return False
        label = metadata(model).get(META_LABEL) or "label"
        value = next((i for i in model.graph.input if i.name == label), None)
        return value is not None and value.type.tensor_type.elem_type == onnx.TensorProto.INT64

    def _bind_scratch(self, binding: Any) -> None:
        # the batch loss is accumulated in loss_sum; its own output goes to a scratch buffer
        if not self.distributed:
            binding.bind_ortvalue_output(self.training_step_.loss, self._loss_scratch)

    def _build_distributed(self) -> None:
        """The gradient graph of the loss and the update step, as two sessions."""
        step = self.training_step_
        if step.buffers or DROPOUT_SEED in step.state:
            refuse_distributed_training_mode()
        weighted = initializers_to_inputs(self.train_onnx_, step.weights)
        self.gradient_onnx_ = gradient_model(weighted, step.loss, step.weights, self._backend)
        self._gradient_session = self._session(self.gradient_onnx_)
        self._gradient_outputs = [step.loss, *(grad_name(w) for w in step.weights)]
        loss_value = next(o for o in self.gradient_onnx_.graph.output if o.name == step.loss)
        loss_dtype = ELEM_TO_DTYPE[loss_value.type.tensor_type.elem_type]
        values = {w: step.initial[w] for w in step.weights}
        self.update_step_ = build_update_step(values, self.learning_rate_, None, loss_dtype)
        self._resident_session = self._session(self.update_step_.model)

    def _gradients(self, X: Rows, y: np.ndarray, w: np.ndarray | None) -> tuple[Any, dict]:
        step = self.training_step_
        binding = self._gradient_session.io_binding()
        current = self._resident
        for name in step.weights:
            binding.bind_ortvalue_input(name, current[name])
        for name, value in self._feature_feeds(X).items():
            binding.bind_cpu_input(name, value)
        for name, value in self._label_feeds(y).items():
            binding.bind_cpu_input(name, value)
        if w is not None:
            binding.bind_cpu_input(step.sample_weight, w)
        for name in self._gradient_outputs:
            binding.bind_output(name, self._ort_device, self._device_id)
        self._gradient_session.run_with_iobinding(binding)
        loss, *grads = binding_outputs(binding)
        return loss, dict(zip(step.weights, grads))

    def _run_batch(self, binding: Any, X: Rows, y: np.ndarray, w: np.ndarray | None) -> None:
        """One batch through the step built for any batch size (a last, shorter batch)."""
        self._run_step(self._resident_session, binding, X, y, w)

    def _run_step(self, session: Any, binding: Any, X: Rows, y: Rows, w: np.ndarray | None) -> None:
        """One batch through ``session``, whose ``binding`` holds the resident values."""
        step = self.training_step_
        if type(X) is NamedRows:
            for name, value in X.arrays.items():
                binding.bind_cpu_input(name, value)
        else:
            binding.bind_cpu_input(step.features, X)
        if type(y) is NamedRows:  # a loss per output: the labels of every head
            for name, value in y.arrays.items():
                binding.bind_cpu_input(name, value)
        else:
            binding.bind_cpu_input(step.label, y)
        if w is not None:
            binding.bind_cpu_input(step.sample_weight, w)
        session.run_with_iobinding(binding)

    def _run(self, session: Any, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run a session reading the current weights from the resident buffers."""
        binding = session.io_binding()
        current = self._resident
        for name in self.training_step_.model_state:  # the weights, running statistics
            binding.bind_ortvalue_input(name, current[name])
        for name, value in feeds.items():
            binding.bind_cpu_input(name, value)
        names = [o.name for o in session.get_outputs()]
        for name in names:
            binding.bind_output(name, "cpu")
        session.run_with_iobinding(binding)
        return dict(zip(names, binding.copy_outputs_to_cpu()))

    def _feature_feeds(self, X: Rows) -> dict[str, np.ndarray]:
        """``{feature input: array}`` of one array or of :class:`NamedRows`."""
        if isinstance(X, NamedRows):
            return X.arrays
        return {self.training_step_.features: X}

    def _label_feeds(self, y: Rows) -> dict[str, np.ndarray]:
        """``{label input: array}``: the labels of every head (:class:`NamedRows` keyed
        by the label inputs) or of the only one, in the step's order."""
        if isinstance(y, NamedRows):
            return {name: y.arrays[name] for name in self.training_step_.labels}
        return {self.training_step_.label: y}

    def _loss(self, X: Rows, y: Rows, w: np.ndarray | None) -> float:
        step = self.training_step_
        feeds = {**self._feature_feeds(X), **self._label_feeds(y)}
        if w is not None:
            feeds[step.sample_weight] = w  # type: ignore[index]
        return float(self._run(self._eval_session, feeds)[step.loss])

    def _predict_outputs(self, X: Rows) -> np.ndarray:
        outputs = self._run(self._predict_session, self._feature_feeds(X))
        name = metadata(self.train_onnx_).get(META_PREDICTION) or next(iter(outputs))
        return outputs[name]

    def _predict_heads(self, X: Rows) -> dict[str, np.ndarray]:
        outputs = self._run(self._predict_session, self._feature_feeds(X))
        return {h.output: outputs[h.output] for h in self._heads or []}

    def export_training_step(self, path: Any = None) -> onnx.ModelProto:
        """The training step in standard ONNX, to keep training on any runtime; see
        :func:`graphkit.training.export.export_training_step`."""
        from graphkit.training.export import export_training_step

        return export_training_step(self, path)

    def export_training_epoch(self, path: Any = None) -> onnx.ModelProto:
        """One epoch as one standard-ONNX model (the step in a Loop over the batches);
        see :func:`graphkit.training.export.export_training_epoch`."""
        from graphkit.training.export import export_training_epoch

        return export_training_epoch(self, path)

    def export_training_info(self, path: Any = None) -> onnx.ModelProto:
        """The trained prediction model carrying its training step as an ONNX
        TrainingInfoProto; see :func:`graphkit.training.export.export_training_info`."""
        from graphkit.training.export import export_training_info

        return export_training_info(self, path)

    def _prediction_model(self) -> onnx.ModelProto:
        return strip_loss_output(self._user_onnx)

    def _graphs(self) -> dict[str, onnx.ModelProto]:
        """``training_step`` (the fused graph), ``evaluation`` (the loss, weights as
        inputs) and ``prediction`` (weights as inputs); in distributed training also
        ``gradient`` and ``update``, the two graphs run around the all-reduce."""
        graphs = {
            "training_step": self.training_step_.model,
            "evaluation": self.evaluation_onnx_,
            "prediction": self.prediction_onnx_,
        }
        if self.distributed:
            graphs.update(gradient=self.gradient_onnx_, update=self.update_step_.model)
        return graphs


SCAN_UP_TO_BYTES = 64 << 20
"""Trained values (weights and optimizer state) from which ``steps_per_run="epoch"``
runs one call per batch: at 250 MB (an embedding table, SGD), the epoch's Scan peaked at
1.46 GB and took 1.8 s where one call per batch peaked at 0.93 GB and took 0.5 s."""


def steps_per_run(value: Any) -> int | str:
    """The checked ``steps_per_run``: ``"epoch"`` or an int >= 1."""
    if value == "epoch" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"steps_per_run must be 'epoch' or an int >= 1, got {value!r}.")


class FusedRunner:
    """The sessions full training runs for full batches of one size.

    ``step``: the training step (specialized to the batch size when ``static``), run
    once per batch when ``looped`` is False; ``scan``: that step as the body of a Scan
    over batch-major data (:func:`graphkit.training.epoch.scan_over_batches`), run once per
    ``steps_per_run`` batches. Rows in order are fed as views of the training data (no
    copy on the CPU); shuffled rows are gathered by numpy (onnxruntime's ``Gather`` of a
    batch inside the graph costs ~8 us per 1000 rows, numpy's of a whole epoch a few), a
    piece at a time (:func:`graphkit.training.batches.shuffled_pieces`).
    """

    def __init__(
        self,
        step: TrainingStep,
        batch_size: int,
        session: Any,
        static: bool,
        looped: bool,
        folds: Sequence[Fold] = (),
    ) -> None:
        self.step = step
        self.batch_size = batch_size
        self.data = step.data  # every feature input, the label[, sample weights]
        model, scan_model = fused_step(step, batch_size, static, looped, folds)
        self.model = model
        self.scan = None
        self.session = None
        if scan_model is not None:
            self.scan_model = scan_model
            self.scan = session(self.scan_model)
        else:
            self.session = session(model)
        self.bindings: list[Any] | None = None
        self._arrays: list[np.ndarray] = []
        self._chunk: int = 0
        self._in_order: list[list[Any]] | None = None

    def bind(self, trainer: Trainer) -> None:
        """Bindings reading buffer set k and writing 1 - k, k = 0, 1."""
        bindings = []
        for k in (0, 1):
            binding = trainer._bind_resident(self.scan or self.session, k)
            if self.scan is None:
                trainer._bind_scratch(binding)
            bindings.append(binding)
        self.bindings = bindings

    def set_data(self, arrays: list[np.ndarray], device: Any, chunk: int | str) -> None:
        """The training data of a ``fit`` (C-contiguous arrays, rows first), run
        ``chunk`` batches at a time."""
        full = len(arrays[0]) // self.batch_size
        chunk = max(full, 1) if isinstance(chunk, str) else chunk  # "epoch" (steps_per_run)
        same = len(arrays) == len(self._arrays) and all(
            a is b for a, b in zip(arrays, self._arrays)
        )
        if not (same and chunk == self._chunk):  # a warm-started fit on the same arrays
            self._in_order = None  # keeps its values
        self._arrays, self._device, self._chunk = arrays, device, chunk

    def chunks(self, order: np.ndarray | None) -> Iterator[list[Any]]:
        """The values of the data inputs for each run of an epoch over rows ``order``
        (all rows in order when None: made at the first such epoch of a ``fit``; on the
        CPU they borrow the arrays' memory)."""
        b = self.batch_size
        if order is None:
            if self._in_order is None:
                full = len(self._arrays[0]) // b
                views = [a[: full * b].reshape(full, b, *a.shape[1:]) for a in self._arrays]
                self._in_order = [
                    [engine.c_ortvalue(v[start : start + self._chunk], self._device) for v in views]
                    for start in range(0, full, self._chunk)
                ]
            yield from self._in_order
            return
        full = len(order) // b
        row_bytes = sum(a[:1].nbytes for a in self._arrays)
        for rows in shuffled_pieces(order[: full * b], b, row_bytes, self._chunk):
            # the gathered arrays live until the next iteration, after the run
            gathered = [np.take(a, rows, axis=0) for a in self._arrays]
            yield [
                engine.c_ortvalue(g.reshape(-1, b, *g.shape[1:]), self._device) for g in gathered
            ]


def _elem_dtype(value: onnx.ValueInfoProto) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))


def _recorded_loss(train_onnx: onnx.ModelProto) -> Loss | None:
    """The loss ``add_loss_output`` recorded in the graph (None for a custom loss or a
    graph graphkit did not make)."""
    heads = loss_heads(train_onnx)
    return recorded_loss(heads[0].loss) if len(heads) == 1 else None


@shared_parameters
class OrtGradientOptimizer(Trainer):
    """:class:`Trainer` with the seed library's API: ``learning_rate`` stands for
    ``optimizer`` and ``schedule``, and ``model_onnx`` is a training graph (no ``loss``).

    Args:
        model_onnx: a training graph, e.g. from :func:`graphkit.add_loss_output` (a
            ModelProto, its bytes or a path).
        learning_rate: None (the default): the seed's ``LearningRateSGD()``, SGD with
            scikit-learn's invscaling schedule, 0.01 / (step + 1) ** 0.25. A float: SGD
            at that constant rate. A ``LearningRate*`` object (:mod:`graphkit.seed`). An
            optimizer name, meaning graphkit's optimizer at a constant 0.01 as
            everywhere (``"SGD"`` is constant-rate SGD; the seed's ``"SGDNesterov"`` is
            the object ``LearningRateSGDNesterov()``). A graphkit transformation (an open
            learning rate runs at a constant 0.01) or a ``(transformation, schedule)``
            pair.
        every other parameter: see :mod:`graphkit_train.trainers.shared`.

    Attributes (after ``fit``): as in :class:`Trainer`.
    """

    learning_rate: Any

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
        sample_weight_name: str = "weight",
        shuffle: bool | None = None,
        random_state: int | None = None,
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        n_iter_no_change: int = 10,
        tol: float = 1e-4,
        distributed: bool = False,
        steps_per_run: int | str = "epoch",
        static_shapes: bool = True,
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

    def _select_optimizer(self) -> GradientTransformation:
        return select_learning_rate(self.learning_rate)

    def _select_loss(self) -> Loss | None:
        return None


__all__ = ["OrtGradientOptimizer", "Trainer"]
