"""Bad models and bad data get graphkit's errors, naming what is wrong and where: a folder
given as a model, a tensor shorter than its dims, data frame columns out of order, a
batch_size above the rows, text cells and ragged rows."""

from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit.compat import load_model, make_compatible
from graphkit_train import ForwardBackwardTrainer, Trainer

KINDS = {"full": Trainer, "forward_backward": ForwardBackwardTrainer}


def linear(n_features=3):
    return linear_regression_onnx(np.zeros((n_features, 1)), np.zeros(1))


def trainer(kind="full", model=None, **settings):
    settings = {"loss": "squared_error", "max_iter": 2, "random_state": 0, **settings}
    return KINDS[kind](linear() if model is None else model, **settings)


# -- a folder given as the model ------------------------------------------------------------


def test_a_folder_is_named_as_a_folder_with_the_model_to_pass(tmp_path):
    onnx.save(linear(), tmp_path / "model.onnx")
    for use in (
        load_model,
        gk.add_loss_output,
        lambda m: trainer(model=m).fit(np.ones((4, 3)), np.ones(4)),
    ):
        with pytest.raises(IsADirectoryError) as info:
            use(str(tmp_path))
        message = str(info.value)
        assert "is a directory" in message and "does not exist" not in message
        assert repr(str(tmp_path / "model.onnx")) in message
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(IsADirectoryError, match="is a directory.*holds no .onnx file"):
        load_model(empty)


# -- a tensor whose data does not fill its dims ---------------------------------------------


def short_initializer_model():
    """``coef`` declared [3, 4] float32 (48 bytes) with 10 floats (40 bytes) of raw data."""
    model = linear_regression_onnx(np.zeros((3, 4), np.float32), np.zeros(4, np.float32))
    coef = next(i for i in model.graph.initializer if i.name == "coef")
    coef.raw_data = np.arange(10, dtype=np.float32).tobytes()
    return model


def test_an_initializer_shorter_than_its_dims_is_named(tmp_path):
    model = short_initializer_model()
    path = tmp_path / "model.onnx"
    path.write_bytes(model.SerializeToString())
    X = np.ones((4, 3), np.float32)
    for use in (
        lambda: load_model(str(path)),
        lambda: load_model(model.SerializeToString()),
        lambda: make_compatible(model),
        lambda: gk.add_loss_output(model),
        lambda: gk.run(model, {"X": X}),
        lambda: Trainer(str(path), loss="squared_error").fit(X, np.ones((4, 4), np.float32)),
        lambda: ForwardBackwardTrainer(model).fit(X, np.ones((4, 4), np.float32)),
    ):
        with pytest.raises(gk.IncompatibleModelError) as info:
            use()
        message = str(info.value)
        assert "initializer 'coef'" in message and "dims [3, 4]" in message
        assert "48 bytes" in message and "holds 40 bytes" in message


def test_a_typed_initializer_shorter_than_its_dims_is_named():
    model = linear()
    model.graph.initializer.append(
        TensorProto(
            name="scale", data_type=TensorProto.FLOAT, dims=[2, 3], float_data=[1.0, 2.0, 3.0, 4.0]
        )
    )
    with pytest.raises(gk.IncompatibleModelError) as info:
        make_compatible(model)
    message = str(info.value)
    assert "initializer 'scale'" in message and "dims [2, 3]" in message
    assert "holds 4 values in float_data" in message


def test_well_formed_tensors_of_every_storage_pass():
    model = linear()
    model.graph.initializer.extend(
        [
            helper.make_tensor("typed", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0]),
            helper.make_tensor("half", TensorProto.FLOAT16, [3], np.ones(3, np.float16)),
            helper.make_tensor("flags", TensorProto.BOOL, [2], [True, False]),
            helper.make_tensor("empty", TensorProto.FLOAT, [0, 4], []),
            numpy_helper.from_array(np.ones((2, 5), np.int64), "ids"),
            helper.make_tensor("scalar", TensorProto.DOUBLE, [], [2.0]),
        ]
    )
    assert len(make_compatible(model).graph.initializer) == len(model.graph.initializer)


# -- data frames: the columns fitted with, in that order (scikit-learn's convention) --------


def frame_data(rng):
    pd = pytest.importorskip("pandas")
    X = rng.normal(size=(40, 3))
    y = X @ np.array([1.0, -2.0, 0.5]) + 0.3
    return pd, pd.DataFrame(X, columns=["age", "bmi", "bp"]), y


def sklearn_error(fitted, X, method="predict"):
    """The ValueError a fitted scikit-learn estimator raises for ``X`` (its message)."""
    with pytest.raises(ValueError) as info:
        getattr(fitted, method)(X)
    return str(info.value)


def test_the_fitted_column_names_survive_pickling(rng):
    import pickle

    pd, X, y = frame_data(rng)
    copy = pickle.loads(pickle.dumps(trainer("full", max_iter=2).fit(X, y)))
    assert list(copy.feature_names_in_) == ["age", "bmi", "bp"] and copy.n_features_in_ == 3
    with pytest.raises(ValueError, match="must be in the same order"):
        copy.predict(X[["bp", "age", "bmi"]])


@pytest.mark.parametrize("kind", KINDS)
def test_frames_with_other_columns_are_refused_as_scikit_learn_does(kind, rng):
    from sklearn.linear_model import LinearRegression

    pd, X, y = frame_data(rng)
    ours = trainer(kind, max_iter=3).fit(X, y)
    reference = LinearRegression().fit(X, y)
    assert ours.feature_names_in_.dtype == object
    np.testing.assert_array_equal(ours.feature_names_in_, reference.feature_names_in_)
    assert ours.n_features_in_ == reference.n_features_in_ == 3
    # the columns as fitted: the frame predicts as its array does
    with pytest.warns(UserWarning, match="X does not have valid feature names"):
        from_array = ours.predict(X.to_numpy())
    np.testing.assert_array_equal(ours.predict(X), from_array)
    bad = {
        "reordered": X[["bp", "age", "bmi"]],
        "renamed": X.rename(columns={"bmi": "BMI"}),
        "missing": X[["age", "bp"]],
        "extra": X.assign(sex=1.0),
    }
    for name, frame in bad.items():
        expected = sklearn_error(reference, frame)
        for method in ("predict", "score", "compute_loss"):
            call = getattr(ours, method)
            with pytest.raises(ValueError) as info:
                call(frame) if method == "predict" else call(frame, y)
            message = str(info.value)
            assert message.startswith(expected), (name, method, message)
            assert "X[trainer.feature_names_in_]" in message
    assert "must be in the same order" in sklearn_error(reference, bad["reordered"])
    assert "- BMI\n" in sklearn_error(reference, bad["renamed"])
    # selecting the fitted columns by name fixes it
    fixed = bad["reordered"][ours.feature_names_in_]
    np.testing.assert_array_equal(ours.predict(fixed), ours.predict(X))


def test_frames_and_arrays_warn_as_scikit_learn_does(rng):
    from sklearn.linear_model import LinearRegression

    pd, X, y = frame_data(rng)
    ours = trainer().fit(X, y)
    reference = LinearRegression().fit(X, y)
    for fitted in (ours, reference):
        with pytest.warns(UserWarning, match="X does not have valid feature names"):
            fitted.predict(X.to_numpy())
    ours.fit(X.to_numpy(), y)  # refitted on an array: the names are forgotten
    reference.fit(X.to_numpy(), y)
    assert not hasattr(ours, "feature_names_in_") and not hasattr(reference, "feature_names_in_")
    for fitted in (ours, reference):
        with pytest.warns(UserWarning, match="X has feature names, but .* was fitted without"):
            fitted.predict(X)
    # integer column names are no feature names, as in scikit-learn
    numbered = pd.DataFrame(X.to_numpy())
    ours.fit(numbered, y)
    reference.fit(numbered, y)
    assert not hasattr(ours, "feature_names_in_") and not hasattr(reference, "feature_names_in_")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours.predict(numbered[[2, 0, 1]].set_axis([0, 1, 2], axis=1))


def test_a_warm_start_and_held_out_frames_must_keep_the_columns(rng):
    pd, X, y = frame_data(rng)
    reordered = X[["bmi", "age", "bp"]]
    with pytest.raises(ValueError, match="must be in the same order"):
        trainer().fit(X, y, X_val=reordered, y_val=y)
    warm = trainer(warm_start=True).fit(X, y)
    with pytest.raises(ValueError, match="must be in the same order"):
        warm.fit(reordered, y)
    assert len(warm.train_losses_) == 2  # refused before training
    cold = trainer().fit(X, y)
    cold.fit(reordered, y)  # a new fit: the new columns
    np.testing.assert_array_equal(cold.feature_names_in_, ["bmi", "age", "bp"])


class Frame:
    """A frame of the data frame interchange protocol (``__dataframe__``), as polars'
    and pyarrow's, without pandas."""

    def __init__(self, values, names):
        self.values, self.names = np.asarray(values), list(names)

    def __array__(self, dtype=None, copy=None):
        return self.values if dtype is None else self.values.astype(dtype)

    def __dataframe__(self, nan_as_null=False, allow_copy=True):
        return self

    def column_names(self):
        return self.names

    def __len__(self):
        return len(self.values)


def test_frames_of_the_interchange_protocol_are_checked_too(rng):
    X = rng.normal(size=(20, 3))
    y = X.sum(axis=1)
    ours = trainer().fit(Frame(X, ["a", "b", "c"]), y)
    np.testing.assert_array_equal(ours.feature_names_in_, ["a", "b", "c"])
    with pytest.warns(UserWarning, match="X does not have valid feature names"):
        from_array = ours.predict(X)
    np.testing.assert_array_equal(ours.predict(Frame(X, "abc")), from_array)
    with pytest.raises(ValueError, match=re.escape("Feature names must be in the same order")):
        ours.predict(Frame(X[:, [1, 0, 2]], ["b", "a", "c"]))
    with pytest.raises(ValueError, match="unseen at fit time:\n- d\n.*missing:\n- c\n"):
        ours.predict(Frame(X, ["a", "b", "d"]))
    with pytest.raises(TypeError, match="all input features have string names"):
        trainer().fit(Frame(X, ["a", 1, "c"]), y)


# -- batch_size above the number of rows ----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_size_above_the_rows_is_every_row(kind, rng):
    X = rng.normal(size=(100, 3))
    y = X @ np.array([1.0, -2.0, 0.5])
    huge = trainer(kind, batch_size=10**9, max_iter=3).fit(X, y)
    every_row = trainer(kind, batch_size=100, max_iter=3).fit(X, y)
    assert huge.batch_size == 10**9  # the parameter stays as given (scikit-learn's clone)
    for name, value in every_row.get_state().items():
        np.testing.assert_array_equal(huge.get_state()[name], value, err_msg=name)
    np.testing.assert_array_equal(huge.train_losses_, every_row.train_losses_)


# -- text cells and ragged rows -------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_text_cell_in_features_is_named_by_row_and_column(kind):
    fitted = trainer(kind, max_iter=1).fit(np.ones((4, 3)), np.ones(4))
    X = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [1.0, 2.0, "a"]], dtype=object)
    for use in (lambda: trainer(kind).fit(X, np.ones(3)), lambda: fitted.predict(X)):
        with pytest.raises(gk.DTypeError) as info:
            use()
        message = str(info.value)
        assert "'a' (a str) at row 2, column 2" in message and "OrdinalEncoder" in message
    with pytest.raises(gk.DTypeError, match="holds 'x' at row 1, column 0"):
        fitted.predict(np.array([["1", "2", "3"], ["x", "2", "3"]]))
    # numbers stored as objects (a frame with mixed columns) still train
    mixed = np.array([[1, 2.5, np.float32(3)], [4, 5, 6]], dtype=object)
    np.testing.assert_array_equal(fitted.predict(mixed), fitted.predict(mixed.astype(float)))


@pytest.mark.parametrize("kind", KINDS)
def test_ragged_rows_are_named(kind):
    fitted = trainer(kind, max_iter=1).fit(np.ones((4, 3)), np.ones(4))
    ragged = [[1.0, 2.0, 3.0], [3.0, 4.0, 5.0], [6.0, 7.0]]
    for X in (ragged, np.array(ragged, dtype=object)):
        for use in (lambda X=X: trainer(kind).fit(X, np.ones(3)), lambda X=X: fitted.predict(X)):
            with pytest.raises(
                gk.ShapeError, match="X is ragged: row 2 has 2 values where row 0 has 3"
            ):
                use()


@pytest.mark.parametrize("kind", KINDS)
def test_text_and_ragged_labels_are_named(kind):
    X = np.ones((3, 3))
    with pytest.raises(gk.DTypeError) as info:
        trainer(kind).fit(X, np.array([1.0, "a", 2.0], dtype=object))
    message = str(info.value)
    assert message.startswith("Unknown label type: y holds 'a' (a str) at row 1")
    assert "LabelEncoder" in message
    with pytest.raises(gk.ShapeError, match="y is ragged: row 1 has 2 values where row 0 has 1"):
        trainer(kind).fit(X, [[1.0], [2.0, 3.0], [4.0]])
    with pytest.raises(
        gk.ShapeError, match="y is ragged: row 1 has 1 value where row 0 is a single"
    ):
        trainer(kind).fit(X, [1.0, [2.0], 3.0])
