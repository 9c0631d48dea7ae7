"""Forward/backward (partial) training: the ONNX graph predicts, graphkit does the rest.

:class:`OrtGradientForwardBackwardOptimizer` trains a *prediction* graph with the seed's
three attributes:

* ``learning_loss``: the loss and its gradient with respect to the prediction;
* ``learning_penalty``: a penalty on the weights and its gradient;
* ``learning_rate``: the optimizer and its schedule.

Each batch takes four onnxruntime runs: forward (TrainingAgent), loss and its gradient,
backward (TrainingAgent), and one fused update of every weight (penalty + schedule +
optimizer, see :func:`graphkit_train.step.build_update_step`). The seed's design ran one
session for forward, one for the loss, one for backward, and one update per weight.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from graphkit import losses, penalties
from graphkit._graph import ELEM_TO_DTYPE, named_shape
from graphkit._ort import Threads, inference_session
from graphkit.compat import load_model
from graphkit.ml_ops import linear_models_as_standard_ops
from graphkit.rewrite import select_prediction
from graphkit_train._base import input_value, providers_for, select_learning_rate
from graphkit_train._trainer import BaseTrainer, BindingCache
from graphkit_train.forward_backward import OrtGradientForwardBackward, binding_outputs
from graphkit_train.step import build_update_step

SPINNING = True
"""Whether the forward/backward sessions' idle threads spin. Measured with Adam on this
2-core machine: equal at MLP 10-10-1 batch 10 (135 vs 139 us/batch), 12% faster with
spinning at MLP 100-256-1 batch 256 (1010 vs 1141 us/batch), so onnxruntime's default stays."""


class OrtGradientForwardBackwardOptimizer(BaseTrainer):
    """Train a prediction graph with forward/backward passes and graphkit's DSL pieces.

    Args:
        model_onnx: the prediction graph (ModelProto, bytes or path); its first float
            output is the prediction the loss compares with the labels.
        weights_to_train: float initializers to train (None: the parameters, never the
            constants; see :mod:`graphkit.parameters`).
        loss_output_name: name given to the loss in the exported graphs.
        max_iter, batch_size, device, warm_start, verbose, validation_every, shuffle,
            random_state: as in :class:`~graphkit_train.OrtGradientOptimizer`.
        learning_rate: a float, a name (``"SGD"``, ``"SGDNesterov"``, ``"adam"``...), a
            graphkit transformation (:mod:`graphkit.transforms`), a ``(transformation,
            schedule)`` pair or a ``LearningRate*`` object.
        learning_loss: a loss name (the names of :mod:`graphkit.losses`, the same as
            everywhere in graphkit: ``"squared_error"``, ``"elastic"``, ``"log"`` for
            probabilities, ``"sigmoid_log_loss"`` for raw scores, ``"cross_entropy"``
            for logits...), a seed class name, a graphkit Loss or a ``*LearningLoss``
            object.
        output_index: the output the loss applies to, by position or name (None: the
            only float tensor output; a skl2onnx ZipMap output stands for its
            probabilities).
        learning_penalty: None, a name, a graphkit Penalty or a ``*LearningPenalty``
            object.
            Its gradient is added to the loss gradient (so the learning rate scales it;
            the seed decayed the weights without it).
        exc: raise ``ConvergenceError`` on a NaN loss; False warns and stops instead.
        early_stopping, validation_fraction, n_iter_no_change, tol, distributed: as in
            :class:`~graphkit_train.OrtGradientOptimizer` (distributed training all-reduces
            the gradients that the backward pass returns).
        intra_op_num_threads, execution_mode: as in
            :class:`~graphkit_train.OrtGradientOptimizer`, for every session (forward,
            backward, loss, update).

    Attributes (after ``fit``): ``train_losses_``, ``validation_losses_``,
    ``learning_loss_`` (a graphkit Loss), ``loss_`` (the loss resolved for the
    prediction's shape), ``learning_rate_`` (the gradient transformation),
    ``learning_penalty_`` (a graphkit Penalty), ``forward_backward_``, ``weights_to_train_``.
    """

    def __init__(
        self,
        model_onnx: Any,
        weights_to_train: list[str] | None = None,
        loss_output_name: str = "loss",
        max_iter: int = 100,
        batch_size: int = 10,
        learning_rate: Any = "SGD",
        device: str = "cpu",
        warm_start: bool = False,
        verbose: int = 0,
        validation_every: float | int = 0.1,
        learning_loss: Any = "squared_error",
        output_index: int | str | None = None,
        learning_penalty: Any = None,
        exc: bool = True,
        shuffle: bool = True,
        random_state: int | None = None,
        early_stopping: bool = False,
        validation_fraction: float = 0.1,
        n_iter_no_change: int = 10,
        tol: float = 1e-4,
        distributed: bool = False,
        intra_op_num_threads: int | None = None,
        execution_mode: str = "sequential",
    ) -> None:
        self._store_params(locals())
        self._invalidate()

    # -- building --------------------------------------------------------------------------

    def _build(self) -> None:
        if self._built:
            return
        self._check_loop_params()
        self._providers, self._ort_device, self._device_id = providers_for(self.device)
        threads = Threads.checked(self.intra_op_num_threads, self.execution_mode)
        self._threads = Threads(threads.intra_op, threads.mode, spinning=SPINNING)
        model, prediction = select_prediction(load_model(self.model_onnx), self.output_index)
        self.learning_loss_ = losses.resolve(self.learning_loss)
        self.learning_rate_ = select_learning_rate(self.learning_rate)
        self.learning_penalty_ = penalties.resolve(self.learning_penalty)
        fb = self.forward_backward_ = OrtGradientForwardBackward(
            model,
            self.weights_to_train,
            output_names=[prediction.name],
            device=self.device,
            threads=self._threads,
        )
        if len(fb.input_names) != 1:
            raise ValueError(f"The graph must have one feature input; it has {fb.input_names}.")
        dtype = ELEM_TO_DTYPE[prediction.type.tensor_type.elem_type]
        self._prediction_shape = named_shape(prediction)
        self.loss_ = self.learning_loss_.for_prediction(self._prediction_shape)
        self._loss_dtype = dtype
        self._loss_runs: dict[bool, tuple[onnx.ModelProto, Any, BindingCache]] = {}
        self.loss_onnx_ = self._loss_run(weighted=False)[0]
        self.weights_to_train_ = list(fb.weight_names)
        values = {w: fb.weights[w].numpy() for w in fb.weight_names}
        self.update_step_ = build_update_step(
            values, self.learning_rate_, self.learning_penalty_, dtype
        )
        self._resident_session = inference_session(
            self.update_step_.model, self._providers, self._threads
        )
        self._features_value = input_value(model, fb.input_names[0])
        self._label_value = input_value(self.loss_onnx_, "label")
        self._accepts_sample_weight = True
        self._requires_sample_weight = False
        self._variant = fb._variant(frozenset())
        self._feed_sources = fb.feed_sources(self._variant)
        self._per_sample: Any = None
        self._built = True

    def _is_classifier(self) -> bool:
        """Whether the loss takes class labels (read from ``learning_loss``, no build)."""
        if self._built:
            return self.loss_.task == losses.CLASSIFICATION
        try:
            return losses.resolve(self.learning_loss).task == losses.CLASSIFICATION
        except (TypeError, ValueError, KeyError):  # fit() will report the bad loss
            return False

    def _loss_run(self, weighted: bool) -> tuple[onnx.ModelProto, Any, BindingCache]:
        """The loss-and-gradient graph (with or without sample weights), built once."""
        if weighted not in self._loss_runs:
            graph = self.loss_.gradient_model(self._loss_dtype, weighted, self._prediction_shape)
            session = inference_session(graph, self._providers, self._threads)
            self._loss_runs[weighted] = (graph, session, BindingCache(session.io_binding()))
        return self._loss_runs[weighted]

    def _bind_scratch(self, binding: Any) -> None:
        """The update step has no output besides the resident ones."""

    # -- one batch -------------------------------------------------------------------------

    def _forward(self, X: Any, training: bool) -> tuple[Any, Any]:
        """Prediction OrtValue (and the pending state when training) with the current weights."""
        fb, current = self.forward_backward_, self._resident
        features = fb.to_ortvalue(X)
        feeds = [features if n == fb.input_names[0] else current[n] for n in self._feed_sources]
        if not training:
            session = self._variant.forward_session
            names = dict(zip(self._variant.feed_names, feeds))
            return session.run_with_ort_values([fb.output_names[0]], names)[0], None
        pending = fb.run_forward(self._variant, [v._ortvalue for v in feeds])
        pending.keep_alive.append(features)
        return pending.outputs[0], pending

    def _loss_and_grad(self, prediction: Any, y: np.ndarray, w: np.ndarray | None) -> list[Any]:
        weighted = w is not None
        runs = self._loss_runs
        _, session, cache = runs[weighted] if weighted in runs else self._loss_run(weighted)
        fb = self.forward_backward_
        cache.bind("prediction", prediction)
        cache.bind("label", fb.to_ortvalue(y))
        if w is not None:
            cache.bind("weight", fb.to_ortvalue(w))
        # outputs are rebound every run: a binding keeps the first run's output shapes
        cache.binding.clear_binding_outputs()
        for name in ("loss", "prediction_grad"):
            cache.binding.bind_output(name, self._ort_device, self._device_id)
        session.run_with_iobinding(cache.binding)
        return binding_outputs(cache.binding)

    def _gradients(self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> tuple[Any, dict]:
        prediction, pending = self._forward(X, training=True)
        loss, prediction_grad = self._loss_and_grad(prediction, y, w)
        return loss, self.forward_backward_.run_backward(pending, [prediction_grad._ortvalue])

    def _run_batch(self, binding: Any, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> None:
        self._apply_update(binding, *self._gradients(X, y, w))

    # -- using the trained weights ---------------------------------------------------------

    def _loss(self, X: np.ndarray, y: np.ndarray, w: np.ndarray | None) -> float:
        prediction, _ = self._forward(X, training=False)
        return float(self._loss_and_grad(prediction, y, w)[0].numpy())

    def _predict_outputs(self, X: np.ndarray) -> np.ndarray:
        return self._forward(X, training=False)[0].numpy()

    def losses(self, X: Any, y: Any, sample_weight: Any = None) -> np.ndarray:
        """The loss of every sample (weighted when sample weights are given)."""
        self._build()
        X, y, w = self._check(X, y, sample_weight)
        if self._per_sample is None:
            loss = self.loss_
            per_sample = losses.get(loss.name, **{**loss.params, "reduction": "none"})
            self._per_sample = per_sample
        prediction = self._forward(X, training=False)[0].numpy()
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


__all__ = ["BindingCache", "OrtGradientForwardBackwardOptimizer"]  # BindingCache: seed API
