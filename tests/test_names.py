"""One name, one meaning: every entry point resolves every registered name (and alias),
in any case, to the same loss or optimizer; the seed's class names are objects of
graphkit.seed, never names."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import linear_regression_onnx

import graphkit as gk
import graphkit.seed
import graphkit_train
from graphkit import losses, optimizers, penalties, schedules
from graphkit.rewrite import META_LOSS_FUNCTION, metadata
from graphkit.seed import (
    BaseLearningLoss,
    BaseLearningPenalty,
    BaseLearningRate,
    LearningRateAdam,
    LearningRateSGD,
    LearningRateSGDNesterov,
    SquareLearningLoss,
)
from graphkit_train import (
    ForwardBackwardTrainer,
    OrtGradientForwardBackwardOptimizer,
    OrtGradientOptimizer,
    Trainer,
)
from graphkit_train.trainers.params import select_learning_rate, select_optimizer


def _description(loss: losses.Loss) -> tuple:
    return loss.name, loss.reduction, tuple(sorted(loss.params.items()))


def _prediction_model(loss: losses.Loss):
    """A graph whose output suits the loss: 3 columns for multiclass, else 1."""
    probe = loss.for_prediction(("N", 3))
    columns = 3 if probe.multiclass else 1
    return linear_regression_onnx(np.zeros((4, columns), np.float32), np.zeros(columns, np.float32))


LOSS_SPELLINGS = sorted(losses.LOSSES.spellings().items())


@pytest.mark.parametrize("spelling,name", LOSS_SPELLINGS, ids=[s for s, _ in LOSS_SPELLINGS])
def test_every_loss_name_means_one_loss_everywhere(spelling, name):
    reference = losses.LOSSES.get(name)
    onx = _prediction_model(reference)
    shape = tuple(
        d.dim_param or d.dim_value for d in onx.graph.output[0].type.tensor_type.shape.dim
    )
    expected = _description(reference.for_prediction(shape))
    for variant in (spelling, spelling.upper()):
        assert _description(losses.get(variant).for_prediction(shape)) == expected
        seed = BaseLearningLoss.select(variant).loss.for_prediction(shape)
        assert _description(seed) == expected
    recorded = json.loads(metadata(gk.add_loss_output(onx, spelling))[META_LOSS_FUNCTION])
    assert recorded["name"] == expected[0]
    for trainer in (
        OrtGradientForwardBackwardOptimizer(onx, learning_loss=spelling),
        ForwardBackwardTrainer(onx, loss=spelling.upper()),
    ):
        trainer._build()
        assert _description(trainer.loss_) == expected
    full = Trainer(onx, loss=spelling)  # appends the loss to the prediction graph
    full._build()
    assert json.loads(metadata(full.train_onnx_)[META_LOSS_FUNCTION])["name"] == expected[0]


OPTIMIZER_SPELLINGS = sorted(optimizers.OPTIMIZERS.spellings().items())


def _update(transformation) -> tuple:
    """What an update does: the optimizer, its hyper-parameters, its learning rates."""
    rates = tuple(transformation.learning_rate_at(step) for step in (0, 1, 10))
    return transformation.name, transformation.params, rates


def _linear_training_graph():
    return gk.add_loss_output(linear_regression_onnx(np.zeros((4, 1)), np.zeros(1)))


def _trained_with(spelling: str) -> list:
    """The transformation each trainer trains with when given ``spelling``."""
    onx = linear_regression_onnx(np.zeros((4, 1)), np.zeros(1))
    trainers = [
        OrtGradientOptimizer(_linear_training_graph(), learning_rate=spelling),
        OrtGradientForwardBackwardOptimizer(onx, learning_rate=spelling),
        Trainer(_linear_training_graph(), optimizer=spelling),
        ForwardBackwardTrainer(onx, optimizer=spelling),
    ]
    for trainer in trainers:
        trainer._build()
    assert all(t.optimizer_ is t.learning_rate_ for t in trainers)
    return [t.learning_rate_ for t in trainers]


@pytest.mark.parametrize(
    "spelling,name", OPTIMIZER_SPELLINGS, ids=[s for s, _ in OPTIMIZER_SPELLINGS]
)
def test_every_optimizer_name_means_one_update_everywhere(spelling, name):
    # a name alone: graphkit's optimizer, its open learning rate at a constant 0.01
    expected = _update(optimizers.get(name, learning_rate=0.01))
    for variant in (spelling, spelling.upper(), spelling.capitalize()):
        assert _update(optimizers.get(variant, learning_rate=0.01)) == expected
        assert _update(graphkit.seed.resolve(variant)) == expected
        assert _update(select_learning_rate(variant)) == expected
        assert _update(select_optimizer(variant)) == expected
        assert _update(BaseLearningRate.select(variant).to_transformation()) == expected
    for variant in (spelling, spelling.upper()):
        assert [_update(t) for t in _trained_with(variant)] == [expected] * 4


def test_sgd_in_any_case_is_one_constant_rate_sgd_everywhere(tmp_path):
    constant = ("sgd", {"weight_decay": 0.0}, (0.01, 0.01, 0.01))
    for spelling in ("SGD", "sgd", "Sgd"):
        assert _update(optimizers.get(spelling, learning_rate=0.01)) == constant
        assert _update(graphkit.seed.resolve(spelling)) == constant
        assert _update(BaseLearningRate.select(spelling).to_transformation()) == constant
        assert type(BaseLearningRate.select(spelling)) is BaseLearningRate  # not the seed's
        assert [_update(t) for t in _trained_with(spelling)] == [constant] * 4
        assert _cli_optimizer(spelling, tmp_path / spelling) == {
            "name": "sgd",
            "params": {"weight_decay": 0.0},
        }


def _cli_optimizer(spelling: str, folder) -> dict:
    """The optimizer graphkit-train reports for ``--optimizer spelling``."""
    from graphkit_train.cli import main

    rng = np.random.default_rng(0)
    data = folder / "data.npz"
    folder.mkdir()
    np.savez(data, X=rng.normal(size=(20, 4)), y=rng.normal(size=20))
    model = folder / "linear.onnx"
    model.write_bytes(linear_regression_onnx(np.zeros((4, 1)), np.zeros(1)).SerializeToString())
    out = folder / "out"
    argv = [str(model), "--data", str(data), "--optimizer", spelling, "--epochs", "1"]
    assert main([*argv, "--quiet", "--output", str(out)]) == 0
    return json.loads((out / "report.json").read_text())["optimizer"]


def test_seed_trainers_default_to_the_seeds_invscaling_sgd():
    """LearningRateSGD(): eta = eta0 / t ** power_t, scikit-learn's t = step + 1."""
    eta0, power_t = 0.01, 0.25
    steps = np.array([0, 1, 10])
    sklearn_rates = eta0 / (steps + 1.0) ** power_t
    onx = linear_regression_onnx(np.zeros((4, 1)), np.zeros(1))
    for trainer in (
        OrtGradientOptimizer(_linear_training_graph()),
        OrtGradientForwardBackwardOptimizer(onx),
    ):
        assert trainer.learning_rate is None  # documented as the seed's LearningRateSGD()
        trainer._build()
        tx = trainer.learning_rate_
        assert tx.name == "sgd" and tx.params == {"weight_decay": 0.0}
        rates = [tx.learning_rate_at(int(step)) for step in steps]
        np.testing.assert_allclose(rates, sklearn_rates, rtol=1e-12)
    assert _update(LearningRateSGD().to_transformation()) == _update(tx)
    assert type(BaseLearningRate.select()) is LearningRateSGD
    # graphkit's trainers default to constant-rate SGD
    for trainer in (Trainer(_linear_training_graph()), ForwardBackwardTrainer(onx)):
        trainer._build()
        assert _update(trainer.optimizer_) == ("sgd", {"weight_decay": 0.0}, (0.01,) * 3)


@pytest.mark.parametrize(
    "call,seed_class",
    [
        (lambda: optimizers.get("SGDNesterov"), "LearningRateSGDNesterov"),
        (lambda: graphkit.seed.resolve("sgdnesterov"), "LearningRateSGDNesterov"),
        (lambda: graphkit.seed.resolve("LearningRateSGD"), "LearningRateSGD"),
        (lambda: select_optimizer("LearningRateAdam"), "LearningRateAdam"),
        (lambda: BaseLearningRate.select("SGDNesterov"), "LearningRateSGDNesterov"),
        (lambda: losses.get("SquareLearningLoss"), "SquareLearningLoss"),
        (lambda: losses.resolve("NegLogLearningLoss"), "NegLogLearningLoss"),
        (lambda: gk.add_loss_output(_linear(), "HuberLearningLoss"), "HuberLearningLoss"),
        (lambda: penalties.get("ElasticLearningPenalty"), "ElasticLearningPenalty"),
        (lambda: penalties.resolve("NoLearningPenalty"), "NoLearningPenalty"),
        (lambda: _fit(OrtGradientOptimizer, learning_rate="SGDNesterov"), "SGDNesterov"),
        (lambda: _fit(Trainer, optimizer="LearningRateSGD"), "LearningRateSGD"),
        (
            lambda: _fit(OrtGradientForwardBackwardOptimizer, learning_loss="SquareLearningLoss"),
            "SquareLearningLoss",
        ),
        (lambda: _fit(ForwardBackwardTrainer, penalty="ElasticLearningPenalty"), "Elastic"),
    ],
)
def test_seed_class_names_are_no_names_and_the_error_says_which_object(call, seed_class):
    with pytest.raises(
        gk.UnknownNameError, match=r"The seed's .* is the object graphkit\.seed\."
    ) as info:
        call()
    assert seed_class in str(info.value)
    assert "Valid names" in str(info.value)


def test_the_error_for_the_seeds_nesterov_says_what_it_is_in_graphkit():
    with pytest.raises(gk.UnknownNameError) as info:
        graphkit.seed.resolve("SGDNesterov")
    message = str(info.value)
    assert "LearningRateSGDNesterov()" in message
    assert "convention='sklearn'" in message and "'nesterov' is torch's convention" in message


def _linear():
    return linear_regression_onnx(np.zeros((4, 1)), np.zeros(1))


def _fit(cls, **kwargs):
    onx = _linear() if "Forward" in cls.__name__ else _linear_training_graph()
    return cls(onx, max_iter=1, **kwargs).fit(np.zeros((4, 4)), np.zeros(4))


def test_the_seed_api_still_selects_its_own_classes_by_class_name():
    assert type(BaseLearningLoss.select("SquareLearningLoss")) is SquareLearningLoss
    assert type(BaseLearningRate.select("LearningRateSGDNesterov")) is LearningRateSGDNesterov
    assert type(BaseLearningPenalty.select("ElasticLearningPenalty")).__name__ == (
        "ElasticLearningPenalty"
    )


def test_no_registry_holds_a_seed_class_name():
    seed_names = {name.lower() for name in graphkit.seed.__all__}
    for registry in (
        losses.LOSSES,
        penalties.PENALTIES,
        optimizers.OPTIMIZERS,
        schedules.SCHEDULES,
    ):
        assert not {s.lower() for s in registry.spellings()} & seed_names, registry.kind
    assert not hasattr(optimizers, "PRESETS")


def test_the_top_level_holds_graphkits_names_and_still_finds_the_seeds():
    assert not set(gk.__all__) & set(graphkit.seed.__all__)
    assert gk.LearningRateSGD is LearningRateSGD
    from graphkit import SquareLearningLoss as imported

    assert imported is SquareLearningLoss
    with pytest.raises(AttributeError):
        gk.LearningRateSGDD  # noqa: B018
    assert {"Trainer", "ForwardBackwardTrainer"} <= set(graphkit_train.__all__)


def test_a_gradient_transformation_has_one_name():
    """graphkit's optimizers are gradient transformations (GradientTransformation, as in
    optax); "Optimizer" names the seed's trainers (OrtGradientOptimizer), nothing else."""
    assert isinstance(gk.optimizers.adam(), gk.GradientTransformation)
    assert "Optimizer" not in gk.__all__ and not hasattr(gk.optimizers, "Optimizer")
    optimizers_named = {n for n in [*gk.__all__, *graphkit_train.__all__] if "Optimizer" in n}
    assert optimizers_named == {"OrtGradientOptimizer", "OrtGradientForwardBackwardOptimizer"}


def test_the_names_that_used_to_mean_two_things():
    assert losses.get("log").name == "log_loss"
    assert BaseLearningLoss.select("log").loss.name == "log_loss"
    assert losses.get("binary_log_loss").params["binary"] is True
    assert BaseLearningLoss.select("binary_log_loss").loss.params["binary"] is True
    momentum = select_learning_rate("momentum")
    assert momentum.params["convention"] == "torch" and momentum.params["nesterov"] is False
    # the seed's scikit-learn-convention Nesterov is an object, with no name of its own
    seed = select_learning_rate(LearningRateSGDNesterov())
    assert seed.params["convention"] == "sklearn" and seed.params["nesterov"] is True
    assert select_learning_rate("nesterov").params["convention"] == "torch"
    with pytest.raises(gk.UnknownNameError):
        select_learning_rate("sgd_nesterov_sklearn")


# -- graphkit's trainers and the seed's: one implementation ----------------------------


@pytest.fixture
def regression(rng):
    X = rng.normal(size=(40, 4))
    return X, X @ np.array([1.0, -2.0, 0.5, 3.0]) + 0.7


def test_graphkit_trainers_equal_the_seed_trainers_given_the_same_update(regression):
    X, y = regression
    settings = dict(max_iter=4, batch_size=8, random_state=0)
    ours = Trainer(_linear_training_graph(), optimizer="adam", **settings).fit(X, y)
    seed = OrtGradientOptimizer(
        _linear_training_graph(), learning_rate=LearningRateAdam(eta0=0.01), **settings
    ).fit(X, y)
    fb = ForwardBackwardTrainer(_linear(), optimizer="adam", **settings).fit(X, y)
    seed_fb = OrtGradientForwardBackwardOptimizer(
        _linear(), learning_rate=LearningRateAdam(eta0=0.01), **settings
    ).fit(X, y)
    # the seed's default, LearningRateSGD(), in graphkit's words
    invscaling = schedules.invscaling(0.01, 0.25)
    sgd = Trainer(_linear_training_graph(), schedule=invscaling, **settings).fit(X, y)
    seed_sgd = OrtGradientOptimizer(_linear_training_graph(), **settings).fit(X, y)
    for a, b in ((ours, seed), (fb, seed_fb), (sgd, seed_sgd)):
        assert a.get_state().keys() == b.get_state().keys()
        for key, value in a.get_state().items():
            np.testing.assert_array_equal(b.get_state()[key], value)
        assert a.train_losses_ == b.train_losses_


@pytest.mark.parametrize(
    "seed,ours,seed_only,ours_only",
    [
        # loss_weights weighs the losses of a dict given as loss: the seed trainer takes
        # a training graph, its losses (and their weights) already in it
        (
            OrtGradientOptimizer,
            Trainer,
            {"learning_rate"},
            {"optimizer", "schedule", "loss", "loss_weights"},
        ),
        (
            OrtGradientForwardBackwardOptimizer,
            ForwardBackwardTrainer,
            {"learning_rate", "learning_loss", "learning_penalty"},
            {"optimizer", "schedule", "loss", "penalty"},
        ),
    ],
)
def test_seed_trainers_take_every_other_parameter_of_graphkits(seed, ours, seed_only, ours_only):
    """The seed's subclass repeats its parent's signature with the seed's words: a
    parameter added to graphkit's trainer must be added to the seed's too."""
    seed_params, our_params = set(seed._param_names()), set(ours._param_names())
    assert seed_params - seed_only == our_params - ours_only
    assert seed_only <= seed_params and ours_only <= our_params


@pytest.mark.parametrize("appended", [True, False], ids=["loss=", "training graph"])
def test_trainer_sgd_matches_numpy_sgd_on_linear_regression(regression, appended):
    """Mean squared error over a batch, d/dW = 2/n X^T (XW + b - y); SGD at 0.01."""
    X, y = regression
    batch, epochs, lr = 8, 3, 0.01
    if appended:
        trainer = Trainer(_linear(), loss="squared_error")
    else:
        trainer = Trainer(_linear_training_graph())
    trainer.set_params(max_iter=epochs, batch_size=batch, shuffle=False).fit(X, y)
    w, b = np.zeros((4, 1)), np.zeros(1)
    for _ in range(epochs):
        for start in range(0, len(X), batch):
            xb, yb = X[start : start + batch], y[start : start + batch, None]
            residual = xb @ w + b - yb
            w = w - lr * 2 / len(xb) * xb.T @ residual
            b = b - lr * 2 / len(xb) * residual.sum(axis=0)
    state = trainer.get_state()
    np.testing.assert_allclose(state["coef"], w, rtol=1e-10)
    np.testing.assert_allclose(state["intercept"], b, rtol=1e-10)
    assert state["step"] == epochs * len(X) // batch


def test_graphkit_trainers_take_a_schedule_and_follow_the_sklearn_protocol(regression):
    from sklearn.base import clone

    trainer = ForwardBackwardTrainer(
        _linear(), optimizer="momentum", schedule="cosine", penalty="l2", loss="huber"
    )
    copy = clone(trainer)
    assert copy.get_params() == trainer.get_params()
    assert copy.set_params(schedule=schedules.constant(0.05)).schedule.params["eta0"] == 0.05
    copy.fit(*regression)
    assert copy.optimizer_.learning_rate_at(7) == 0.05
    assert repr(copy.penalty_) == repr(penalties.get("l2")) and copy.loss_.name == "huber"
    with pytest.raises(ValueError, match="has its learning rate already"):
        Trainer(
            _linear_training_graph(), optimizer=optimizers.sgd(learning_rate=0.1), schedule=0.2
        ).fit(*regression)
    with pytest.raises(TypeError, match="LearningRate\\* objects go to the seed trainers"):
        Trainer(_linear_training_graph(), optimizer=LearningRateSGD()).fit(*regression)
