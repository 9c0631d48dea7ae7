"""The zoo's training steps in standard ONNX: each exported step trains on
onnx.reference (which knows no com.microsoft operator) exactly as graphkit trains."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

import graphkit as gk
from graphkit_train import OrtGradientOptimizer

from .models import CASES, FULL
from .run import built

PORTABLE = [case for case in CASES if case.refusal(FULL) is None]
BATCHES = 3


@pytest.mark.parametrize("case", PORTABLE, ids=[c.id for c in PORTABLE])
def test_exported_step_trains_on_onnx_reference(case):
    onx, data = built(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = OrtGradientOptimizer(
            gk.add_loss_output(onx, case.loss, output_index=case.output_index, label_name="y"),
            learning_rate=(gk.optimizers.get(case.optimizer), case.lr),
            max_iter=1,
            batch_size=case.batch_size,
            shuffle=False,
        )
        exported = trainer.export_training_step()
    step = trainer.training_step_
    rows = BATCHES * case.batch_size
    X, y = data.X_train[:rows], data.y_train[:rows]
    reference = ReferenceEvaluator(exported)
    outputs = [o.name for o in exported.graph.output]
    resident: dict = {}
    for i in range(0, rows, case.batch_size):
        batch = {step.features: X[i : i + case.batch_size], step.label: y[i : i + case.batch_size]}
        if batch[step.label].dtype.kind == "f":
            batch[step.label] = batch[step.label].reshape(-1, 1).astype(X.dtype)
        out = dict(zip(outputs, reference.run(None, {**batch, **resident})))
        resident = {n: out[f"{n}.next"] for n in step.resident}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(X, y)
    for name, value in trainer.get_state().items():
        np.testing.assert_allclose(resident[name], value, rtol=2e-4, atol=2e-5, err_msg=name)
