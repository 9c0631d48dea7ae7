"""The zoo's training steps in standard ONNX: each exported step, and each trained model
carrying it as a TrainingInfoProto, trains on onnx.reference (which knows no com.microsoft
operator) and on the latest plain onnxruntime exactly as graphkit trains."""

from __future__ import annotations

import subprocess
import warnings

import numpy as np
import pytest
from onnx.reference import ReferenceEvaluator

import graphkit as gk
from graphkit.training_info import initial_state
from graphkit_train import OrtGradientOptimizer

from .models import CASES, FULL
from .run import built, runnable

PORTABLE = [  # a LoRA case's graph is its full case's; the default backend is native
    case
    for case in CASES
    if case.refusal(FULL) is None and case.refusal(FULL, "native") is None and not case.lora
]
ONE_PER_MODEL = list({case.name: case for case in reversed(PORTABLE)}.values())[::-1]
"""One case per model (its first exporter's) for onnx.reference, numpy's slow kernels, and
for the latest plain onnxruntime: what a step computes no longer depends on the exporter
once graphkit has prepared it (both exporters train in tests/zoo/test_zoo.py)."""
BATCHES = 3


def batches_of(case, trainer):
    """The first BATCHES batches of the case's training data, as the step's feeds."""
    _, data = built(case)
    step = trainer.training_step_
    rows = BATCHES * case.batch_size
    X, y = data.X_train[:rows], data.y_train[:rows]
    feeds = []
    for i in range(0, rows, case.batch_size):
        batch = {step.features: X[i : i + case.batch_size], step.label: y[i : i + case.batch_size]}
        if batch[step.label].dtype.kind == "f":
            batch[step.label] = batch[step.label].reshape(-1, 1).astype(X.dtype)
        feeds.append(batch)
    return X, y, feeds


def zoo_trainer(case, shuffle=False):
    onx, _ = built(case)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return OrtGradientOptimizer(
            gk.add_loss_output(onx, case.loss, output_index=case.output_index, label_name="y"),
            learning_rate=(gk.optimizers.get(case.optimizer), case.lr),
            max_iter=1,
            batch_size=case.batch_size,
            shuffle=shuffle,
            random_state=0,
        )


def epoch_feeds(case, trainer, X, y):
    """The exported epoch's inputs: all rows, numpy's permutation with seed 0 (the first
    epoch of a trainer with random_state=0)."""
    step = trainer.training_step_
    label = y.reshape(-1, 1).astype(X.dtype) if y.dtype.kind == "f" else y
    return {
        step.features: X,
        step.label: label,
        "permutation": np.random.default_rng(0).permutation(len(X)),
        "batch_size": np.array(case.batch_size, np.int64),
    }


def shuffled_epoch(case, X, y):
    """graphkit's own first shuffled epoch over the rows."""
    trainer = zoo_trainer(case, shuffle=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer.fit(X, y).get_state()


PLAIN_CHUNKS = 3
"""The plain-onnxruntime check runs in this many parts, one worker process each, so that
the suite's workers share it (as one test it took 42 s of one worker)."""


@pytest.mark.parametrize("chunk", range(PLAIN_CHUNKS))
def test_exported_zoo_training_runs_on_plain_onnxruntime(tmp_path, chunk):
    from test_plain_onnxruntime import WORKER, plain_python

    python = plain_python()
    expected = {}
    cases = [c for c in ONE_PER_MODEL if runnable(c)][chunk::PLAIN_CHUNKS]
    for number, case in enumerate(cases):
        name = f"case{number}"
        trainer = zoo_trainer(case)
        trainer.export_training_step(tmp_path / f"{name}.step.onnx")
        trainer.export_training_info(tmp_path / f"{name}.info.onnx")
        trainer.export_training_epoch(tmp_path / f"{name}.epoch.onnx")
        X, y, feeds = batches_of(case, trainer)
        epoch = epoch_feeds(case, trainer, X, y)
        np.savez(tmp_path / f"{name}.epoch_feeds.npz", **epoch)
        packed = {f"{i}/{k}": v for i, batch in enumerate(feeds) for k, v in batch.items()}
        np.savez(tmp_path / f"{name}.batches.npz", **packed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(X, y)
        expected[name] = (case, trainer.get_state(), trainer.training_step_.weights)
        expected[name] += (shuffled_epoch(case, X, y),)
    subprocess.run([python, str(WORKER), str(tmp_path)], check=True)
    for name, (case, state, weights, epoch) in expected.items():
        result = np.load(tmp_path / f"{name}.result.npz")
        for key, value in state.items():
            np.testing.assert_allclose(
                result[f"step/{key}"], value, rtol=2e-4, atol=2e-5, err_msg=f"{case.id} {key}"
            )
        for key in weights:
            np.testing.assert_allclose(
                result[f"info/{key}"], state[key], rtol=2e-4, atol=2e-5, err_msg=f"{case.id} {key}"
            )
        for key, value in epoch.items():
            np.testing.assert_allclose(
                result[f"epoch/{key}.next"], value, rtol=2e-4, atol=2e-5, err_msg=f"{case.id} {key}"
            )


@pytest.mark.parametrize("case", ONE_PER_MODEL, ids=[c.id for c in ONE_PER_MODEL])
def test_exported_step_trains_on_onnx_reference(case):
    if not runnable(case):
        pytest.skip("torch is not installed")
    trainer = zoo_trainer(case)
    exported = trainer.export_training_step()
    epoch = trainer.export_training_epoch()  # both from the initial weights
    X, y, feeds = batches_of(case, trainer)
    reference = ReferenceEvaluator(exported)
    outputs = [o.name for o in exported.graph.output]
    resident = initial_state(exported)
    for batch in feeds:
        out = dict(zip(outputs, reference.run(None, {**batch, **resident})))
        resident = {n.removesuffix(".next"): v for n, v in out.items() if n.endswith(".next")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(X, y)
    for name, value in trainer.get_state().items():
        np.testing.assert_allclose(resident[name], value, rtol=2e-4, atol=2e-5, err_msg=name)
    # the epoch as one Loop, shuffled, on onnx.reference
    names = [o.name for o in epoch.graph.output]
    epoch_in = {**epoch_feeds(case, trainer, X, y), **initial_state(epoch)}
    out = dict(zip(names, ReferenceEvaluator(epoch).run(None, epoch_in)))
    for name, value in shuffled_epoch(case, X, y).items():
        np.testing.assert_allclose(out[f"{name}.next"], value, rtol=2e-4, atol=2e-5, err_msg=name)
