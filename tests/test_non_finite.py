"""Training state is never lost: an update that overflows while its loss is still finite
is rolled back to the end of the previous epoch, with a ConvergenceError naming the epoch
and the weight, and no checkpoint holds it; an epoch interrupted by Ctrl-C leaves the state of
the last finished one, its shuffling generator too (so a checkpoint saved then resumes
exactly)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import INSTALLED_BACKENDS, linear_regression_onnx

from graphkit import ConvergenceError
from graphkit_train import ForwardBackwardTrainer, Trainer

OVERFLOW = 3e38
"""A float32 learning rate whose first SGD step takes a weight past float32's maximum
(3.4e38) while the loss it was computed with is about 0.8."""


@pytest.fixture
def data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(20, 3)).astype(np.float32)
    return X, (X @ np.ones((3, 1))).astype(np.float32)


def model():
    return linear_regression_onnx(np.full((3, 1), 0.5, np.float32), np.zeros(1, np.float32))


TRAINERS = [Trainer, ForwardBackwardTrainer]


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_an_overflowing_update_is_rolled_back_and_named(cls, backend, data, tmp_path):
    X, y = data
    settings = dict(loss="squared_error", batch_size=20, shuffle=False, backend=backend)
    trainer = cls(model(), max_iter=2, schedule=0.01, **settings).fit(X, y)
    good = trainer.get_state()
    # numpy's SGD with the overflowing rate: the loss is finite, a weight is not
    residual = X @ good["coef"] + good["intercept"] - y
    assert np.isfinite((residual**2).mean())
    with np.errstate(over="ignore"):
        stepped = good["coef"] - np.float32(OVERFLOW) * (2 * X.T @ residual / len(X))
    assert not np.isfinite(stepped).all()

    trainer.set_params(schedule=OVERFLOW, max_iter=1, warm_start=True)
    path = tmp_path / "run.ckpt"
    with pytest.raises(ConvergenceError, match=r"Weight 'coef'.*non-finite.*epoch 3"):
        trainer.fit(X, y, checkpoint=path)
    state = trainer.get_state()
    for name, value in good.items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    assert trainer.train_losses_ == pytest.approx(trainer.train_losses_[:2])
    assert len(trainer.train_losses_) == 2
    assert not path.exists()


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_without_exc_a_warning_and_the_previous_weights(cls, data):
    if cls is Trainer:
        pytest.skip("the full trainer always raises (the seed's exc is forward/backward's)")
    X, y = data
    trainer = cls(
        model(), loss="squared_error", max_iter=1, batch_size=20, schedule=OVERFLOW, exc=False
    )
    with pytest.warns(RuntimeWarning, match="non-finite"):
        trainer.fit(X, y)
    np.testing.assert_array_equal(trainer.get_state()["coef"], np.full((3, 1), 0.5, np.float32))


def test_no_checkpoint_of_a_non_finite_state(data, tmp_path):
    X, y = data
    trainer = Trainer(model(), loss="squared_error", max_iter=1).fit(X, y)
    trainer.set_state({"coef": np.array([[np.inf], [0.0], [0.0]], np.float32)})
    path = tmp_path / "bad.ckpt"
    with pytest.raises(ConvergenceError, match=r"'coef' holds inf or nan.*nothing was written"):
        trainer.save_checkpoint(path)
    assert not path.exists()


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_an_interrupted_epoch_leaves_the_last_finished_one(cls, data, monkeypatch):
    X, y = data
    trainer = cls(model(), loss="squared_error", max_iter=1, batch_size=5, random_state=0)
    trainer.fit(X, y)
    finished, shuffling = trainer.get_state(), trainer._rng.bit_generator.state
    original = type(trainer)._run_rows

    def run_then_fail(self, *args, **kwargs):
        original(self, *args, **kwargs)  # every batch of the epoch updated the weights
        raise KeyboardInterrupt("stopped")

    monkeypatch.setattr(type(trainer), "_run_rows", run_then_fail)
    with pytest.raises(KeyboardInterrupt):
        trainer.set_params(warm_start=True).fit(X, y)
    for name, value in finished.items():
        np.testing.assert_array_equal(trainer.get_state()[name], value, err_msg=name)
    assert trainer._rng.bit_generator.state == shuffling
    monkeypatch.undo()
    # the next epoch is the one an uninterrupted run would have trained
    trainer.fit(X, y)
    reference = cls(model(), loss="squared_error", max_iter=2, batch_size=5, random_state=0)
    for name, value in reference.fit(X, y).get_state().items():
        np.testing.assert_array_equal(trainer.get_state()[name], value, err_msg=name)


@pytest.mark.parametrize("cls", TRAINERS, ids=lambda c: c.__name__)
def test_rollback_to_the_checkpoint_keeps_no_copy_and_returns_to_it(cls, data, tmp_path):
    X, y = data
    settings = dict(loss="squared_error", batch_size=20, shuffle=False, rollback="checkpoint")
    path = tmp_path / "run.ckpt"
    with pytest.raises(ValueError, match=r"rollback='checkpoint'.*checkpoint="):
        cls(model(), max_iter=1, **settings).fit(X, y)
    # the reference: two epochs of the default rollback
    good = cls(model(), max_iter=2, schedule=0.01, **{**settings, "rollback": "epoch"})
    good = good.fit(X, y).get_state()
    trainer = cls(model(), max_iter=2, schedule=0.01, **settings).fit(X, y, checkpoint=path)
    for name, value in good.items():
        np.testing.assert_array_equal(trainer.get_state()[name], value, err_msg=name)
    # an overflowing third epoch (another schedule: another graph, another checkpoint,
    # written when the fit starts): back to the state it started from
    trainer.set_params(schedule=OVERFLOW, max_iter=1, warm_start=True)
    with pytest.raises(ConvergenceError, match=r"last checkpoint.*after epoch 2"):
        trainer.fit(X, y, checkpoint=tmp_path / "overflow.ckpt")
    for name, value in good.items():
        np.testing.assert_array_equal(trainer.get_state()[name], value, err_msg=name)
    assert len(trainer.train_losses_) == 2
