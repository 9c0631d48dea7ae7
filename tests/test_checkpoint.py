"""Checkpoints: a run killed with SIGKILL and started again ends with exactly the weights
of an uninterrupted run; bad checkpoints are refused with a clear error."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import linear_regression_onnx

import graphkit as gk
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer
from graphkit_train.checkpoint import CheckpointError

WORKER = Path(__file__).with_name("checkpoint_worker.py")


def make(kind, onx, max_iter, learning_rate=None):
    learning_rate = learning_rate or (gk.optimizers.adam(), gk.schedules.invscaling(0.05, 0.5))
    if kind == "full":
        return OrtGradientOptimizer(
            gk.add_loss_output(onx), learning_rate=learning_rate, max_iter=max_iter, random_state=0
        )
    return OrtGradientForwardBackwardOptimizer(
        onx, learning_rate=learning_rate, max_iter=max_iter, random_state=0
    )


@pytest.fixture()
def problem(rng):
    X = rng.normal(size=(150, 4))
    y = X @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.1 * rng.normal(size=150)
    return linear_regression_onnx(np.zeros((4, 1)), np.zeros(1)), X, y


@pytest.mark.parametrize("kind", ["full", "forward_backward"])
def test_resumed_training_equals_an_uninterrupted_run(kind, problem, tmp_path):
    onx, X, y = problem
    path = tmp_path / "run.ckpt"
    whole = make(kind, onx, 7).fit(X, y)
    make(kind, onx, 3).fit(X, y, checkpoint=path)  # stops after 3 epochs
    resumed = make(kind, onx, 7).fit(X, y, checkpoint=path)  # the same call, 4 more
    for name, value in whole.get_state().items():
        np.testing.assert_array_equal(resumed.get_state()[name], value)
    assert resumed.train_losses_ == whole.train_losses_
    # explicit save / load, then warm start
    reloaded = make(kind, onx, 7).load_checkpoint(path)
    assert reloaded.train_losses_ == whole.train_losses_
    np.testing.assert_array_equal(reloaded.get_state()["coef"], whole.get_state()["coef"])
    finished = make(kind, onx, 7).fit(X, y, checkpoint=path)  # nothing left to do
    assert finished.train_losses_ == whole.train_losses_


def test_sigkill_in_the_middle_of_an_epoch_then_resume(tmp_path):
    checkpoint, markers = tmp_path / "run.ckpt", tmp_path / "markers"
    markers.mkdir()
    command = [sys.executable, str(WORKER), str(checkpoint), str(tmp_path / "resumed.npz")]
    process = subprocess.Popen([*command, str(markers)])
    deadline = time.time() + 120
    while not (markers / "epoch2").exists():
        assert process.poll() is None, "the worker ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.005)
    time.sleep(0.1)  # an epoch takes about 0.25 s: this lands inside epoch 3
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    done = json.loads(bytes(np.load(checkpoint)["__header__"]).decode())["epochs"]
    assert 1 <= done < 6, done

    subprocess.run([*command, str(markers)], check=True)  # started again, same command
    reference = tmp_path / "uninterrupted.npz"
    subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "unused"), str(reference), str(markers)]
        + ["--no-checkpoint"],
        check=True,
    )
    resumed, expected = np.load(tmp_path / "resumed.npz"), np.load(reference)
    assert sorted(resumed.files) == sorted(expected.files)
    for name in expected.files:
        np.testing.assert_array_equal(resumed[name], expected[name], err_msg=name)


def test_a_failed_write_keeps_the_previous_checkpoint(problem, tmp_path, monkeypatch):
    onx, X, y = problem
    path = tmp_path / "run.ckpt"
    trainer = make("full", onx, 2).fit(X, y, checkpoint=path)
    before = path.read_bytes()

    def broken_replace(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", broken_replace)
    trainer.set_params(warm_start=True).fit(X, y)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["run.ckpt"]  # no temporary file left


def test_bad_checkpoints_are_refused(problem, tmp_path):
    onx, X, y = problem
    path = tmp_path / "run.ckpt"
    make("full", onx, 1).fit(X, y, checkpoint=path)
    data = path.read_bytes()

    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        make("full", onx, 1).load_checkpoint(truncated)
    corrupted = tmp_path / "corrupted.ckpt"
    corrupted.write_bytes(data[:100] + bytes(200) + data[300:])
    with pytest.raises(CheckpointError, match="truncated or corrupted"):
        make("full", onx, 1).load_checkpoint(corrupted)
    with pytest.raises(CheckpointError, match="No checkpoint"):
        make("full", onx, 1).load_checkpoint(tmp_path / "missing.ckpt")
    other = tmp_path / "other.npz"
    np.savez(other, x=np.zeros(3))
    with pytest.raises(CheckpointError, match="not a readable graphkit checkpoint"):
        make("full", onx, 1).load_checkpoint(other)

    wider = linear_regression_onnx(np.zeros((5, 1)), np.zeros(1))
    with pytest.raises(CheckpointError, match=r"holds 'coef' as float64\[4, 1\].*\[5, 1\]"):
        make("full", wider, 1).load_checkpoint(path)
    with pytest.raises(CheckpointError, match="lacks.*coef.momentum.buffer.*has.*coef.adam.m"):
        make("full", onx, 1, learning_rate=(gk.optimizers.momentum(), 0.1)).load_checkpoint(path)
    # same names and shapes, another loss: the graph hash tells them apart
    other_loss = OrtGradientOptimizer(
        gk.add_loss_output(onx, "absolute_error"),
        learning_rate=(gk.optimizers.adam(), gk.schedules.invscaling(0.05, 0.5)),
    )
    with pytest.raises(CheckpointError, match="another graph"):
        other_loss.load_checkpoint(path)
    with pytest.raises(ValueError, match="checkpoint_every"):
        make("full", onx, 1).fit(X, y, checkpoint=path, checkpoint_every=0)
