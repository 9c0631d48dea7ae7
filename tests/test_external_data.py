"""External data (weights kept beside the .onnx file) is read from the model's own
folder only: never from the working directory, never from outside the folder."""

from __future__ import annotations

import os
import re

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx
from onnx import numpy_helper

import graphkit as gk
from graphkit.compat import load_model
from graphkit_train import Trainer

COEF = np.array([[1.0], [-2.0], [0.5]], np.float32)
INTERCEPT = np.array([0.25], np.float32)
DECOY = np.full((3, 1), 7.0, np.float32), np.array([-9.0], np.float32)


def save_external(folder, coef=COEF, intercept=INTERCEPT, name="model.onnx"):
    """A linear model saved with every initializer in ``folder/w.data``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    onnx.save_model(
        linear_regression_onnx(coef, intercept),
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="w.data",
        size_threshold=0,
    )
    return path


@pytest.fixture
def saved(tmp_path, monkeypatch):
    """The model in ``tmp_path/model``, run from ``tmp_path/cwd``, which holds a decoy
    ``w.data`` (the same layout, other values) that a working-directory lookup would read."""
    path = save_external(tmp_path / "model")
    save_external(tmp_path / "cwd", *DECOY, name="decoy.onnx")
    monkeypatch.chdir(tmp_path / "cwd")
    assert os.path.exists("w.data")
    return path


def with_location(path, location, tensor="coef"):
    """Rewrite the external-data location of ``tensor`` in the model file ``path``."""
    model = onnx.load(str(path), load_external_data=False)
    init = next(i for i in model.graph.initializer if i.name == tensor)
    for entry in init.external_data:
        if entry.key == "location":
            entry.value = location
    path.write_bytes(model.SerializeToString())


def test_external_data_is_read_from_the_model_folder_not_the_working_directory(saved, rng):
    X = rng.normal(size=(5, 3)).astype(np.float32)
    loaded = load_model(str(saved))
    values = {i.name: numpy_helper.to_array(i) for i in loaded.graph.initializer}
    np.testing.assert_array_equal(values["coef"], COEF)
    np.testing.assert_array_equal(values["intercept"], INTERCEPT)
    assert all(i.data_location == onnx.TensorProto.DEFAULT for i in loaded.graph.initializer)
    np.testing.assert_allclose(gk.run(str(saved), {"X": X})["Y"], X @ COEF + INTERCEPT, rtol=1e-6)
    np.testing.assert_allclose(gk.run(saved, {"X": X})["Y"], X @ COEF + INTERCEPT, rtol=1e-6)


def test_a_trainer_trains_an_external_data_model_from_its_path(saved, rng):
    X = rng.normal(size=(20, 3)).astype(np.float32)
    y = rng.normal(size=20).astype(np.float32)
    settings = dict(loss="squared_error", max_iter=1, batch_size=20, shuffle=False)
    from_path = Trainer(str(saved), **settings).fit(X, y)
    # onnx.load reads the data from the model's folder: the weights graphkit must start from
    inline = Trainer(onnx.load(str(saved)), **settings).fit(X, y)
    decoy = Trainer(linear_regression_onnx(*DECOY), **settings).fit(X, y)
    for name in ("coef", "intercept"):
        np.testing.assert_array_equal(from_path.get_state()[name], inline.get_state()[name])
        assert not np.allclose(from_path.get_state()[name], decoy.get_state()[name])
    trained = from_path.get_state()
    np.testing.assert_allclose(
        from_path.predict(X), (X @ trained["coef"] + trained["intercept"])[:, 0], rtol=1e-5
    )
    # the training moved the folder's weights (one full-batch step), not the decoy's
    assert np.abs(trained["coef"] - COEF).max() < 1


@pytest.mark.parametrize(
    "location, why",
    [
        ("/etc/passwd", "an absolute path"),
        ("ABSOLUTE", "an absolute path"),  # an existing file, given by its absolute path
        ("../x.data", "'..' component"),
        ("sub/../../x.data", "'..' component"),
        ("..\\x.data", "'..' component"),
        ("C:\\x.data", "an absolute path"),
    ],
)
def test_locations_outside_the_model_folder_are_refused(saved, location, why):
    (saved.parent.parent / "x.data").write_bytes(os.urandom(64))
    if location == "ABSOLUTE":
        location = str(saved.parent.parent / "x.data")
    with_location(saved, location)
    with pytest.raises(gk.IncompatibleModelError) as info:
        load_model(str(saved))
    message = str(info.value)
    assert "'coef'" in message and repr(location) in message and why in message
    assert "inside the model's folder" in message
    with pytest.raises(gk.IncompatibleModelError, match=re.escape(repr(location))):
        Trainer(str(saved), loss="squared_error", max_iter=1).fit(np.ones((4, 3)), np.ones(4))


def test_a_symbolic_link_out_of_the_model_folder_is_refused(saved, tmp_path):
    outside = tmp_path / "secret.data"
    outside.write_bytes(os.urandom(64))
    (saved.parent / "link.data").symlink_to(outside)
    with_location(saved, "link.data", tensor="intercept")
    with pytest.raises(gk.IncompatibleModelError) as info:
        load_model(str(saved))
    message = str(info.value)
    assert "'intercept'" in message and "'link.data'" in message
    assert "leads out of the model's folder" in message and str(outside) in message


def test_a_symbolic_link_inside_the_model_folder_is_followed(saved, rng):
    (saved.parent / "link.data").symlink_to(saved.parent / "w.data")
    with_location(saved, "link.data")
    coef = numpy_helper.to_array(load_model(str(saved)).graph.initializer[0])
    np.testing.assert_array_equal(coef, COEF)


def test_a_missing_external_data_file_is_named(saved):
    os.remove(saved.parent / "w.data")
    with pytest.raises(gk.IncompatibleModelError) as info:
        load_model(saved)
    message = str(info.value)
    assert "'coef'" in message and str(saved.parent / "w.data") in message
    assert "does not exist" in message


def test_a_too_short_external_data_file_is_named(saved):
    data = saved.parent / "w.data"
    data.write_bytes(data.read_bytes()[:5])
    with pytest.raises(gk.IncompatibleModelError) as info:
        load_model(saved)
    message = str(info.value)
    assert "'coef'" in message and str(data) in message
    assert "bytes 0 to 12" in message and "holds 5 bytes" in message


@pytest.mark.parametrize("given", ["ModelProto", "bytes"])
def test_external_data_references_in_memory_are_refused(saved, given):
    model = onnx.load(str(saved), load_external_data=False)
    model = model if given == "ModelProto" else model.SerializeToString()
    with pytest.raises(gk.IncompatibleModelError) as info:
        load_model(model)
    message = str(info.value)
    assert "'coef'" in message and "'w.data'" in message
    assert "Pass the path of the .onnx file" in message and "onnx.load(path)" in message
    with pytest.raises(gk.IncompatibleModelError, match="Pass the path of the .onnx file"):
        gk.add_loss_output(model)
