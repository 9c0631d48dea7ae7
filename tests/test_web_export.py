"""The folder graphkit_train.web.export_web writes, checked without a browser.

The browser itself is tests/test_web.py; here: the manifest describes the files (digests,
the state's layout, the inputs), every graph passes onnx.checker's full check and opens
in onnxruntime, the template plus the weights is the trained model, and what cannot be
exported is refused with the reason.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import numpy_helper

import graphkit as gk
from graphkit.training_info import check_training_info, initial_state
from graphkit_train import ForwardBackwardTrainer, Trainer
from graphkit_train.cli import main
from graphkit_train.web import MANIFEST, MODULE, export_web
from tests.web_models import iris_classifier


def _state(folder, manifest) -> dict[str, np.ndarray]:
    """state.bin read as the manifest lays it out (what the page reads)."""
    raw = (folder / "state.bin").read_bytes()
    out = {}
    for entry in manifest["state"]:
        chunk = raw[entry["offset"] : entry["offset"] + entry["bytes"]]
        assert entry["offset"] % 8 == 0  # a Float64Array/BigInt64Array view needs it
        out[entry["name"]] = np.frombuffer(chunk, dtype=entry["type"]).reshape(entry["dims"])
    return out


@pytest.fixture
def fitted(mlp_regressor, regression_data):
    X, y = regression_data
    model = gk.add_loss_output(mlp_regressor[1], "squared_error")
    trainer = Trainer(model, optimizer="adam", schedule=0.01, batch_size=32, max_iter=2)
    return trainer.fit(X, y), X, y


def test_manifest_describes_the_files(fitted, tmp_path):
    trainer, X, y = fitted
    manifest = export_web(trainer, tmp_path, data={"train": (X, y)})
    assert json.loads((tmp_path / MANIFEST).read_text()) == manifest
    assert (tmp_path / MODULE).read_text().startswith("// graphkit-web")
    for entry in manifest["files"].values():
        digest = hashlib.sha256((tmp_path / entry["path"]).read_bytes()).hexdigest()
        assert digest == entry["sha256"]
    step = onnx.load(tmp_path / "training_step.onnx")
    # the state the page starts from is the trainer's after 2 epochs, as the step's own
    # TrainingInfoProto and get_state() say
    state = _state(tmp_path, manifest)
    assert state.keys() == initial_state(step).keys()
    for name, value in initial_state(step).items():
        np.testing.assert_array_equal(state[name], value)
    trained = trainer.get_state()
    for name in manifest["weights"]:
        np.testing.assert_array_equal(state[name], trained[name])
    assert int(state["step"]) == 2 * -(-len(X) // 32)
    assert manifest["inputs"] == [{"name": "X", "type": "float32", "dims": [None, 4]}]
    assert manifest["label"]["classes"] is None and manifest["prediction"]["kind"] == "values"
    data = json.loads((tmp_path / "data.json").read_text())
    np.testing.assert_array_equal(np.array(data["train"]["X"], np.float32), X)
    # the trainable model, for Python: its training info continues from the same weights
    trainable = onnx.load(tmp_path / manifest["trainable"])
    check_training_info(trainable)
    weights = {t.name: numpy_helper.to_array(t) for t in trainable.graph.initializer}
    for name in manifest["weights"]:
        np.testing.assert_array_equal(weights[name], trained[name])


def test_every_graph_is_standard_onnx_and_opens_in_onnxruntime(fitted, tmp_path):
    trainer, X, _ = fitted
    manifest = export_web(trainer, tmp_path)
    for key in ("step", "epoch", "evaluate", "predict"):
        model = onnx.load(tmp_path / manifest["files"][key]["path"])
        onnx.checker.check_model(model, full_check=True)
        assert {o.domain for o in model.opset_import} <= {"", "ai.onnx", "ai.onnx.ml"}
        onnxruntime.InferenceSession(model.SerializeToString())
    # predict.onnx with the current weights predicts as the trainer does
    session = onnxruntime.InferenceSession(str(tmp_path / "predict.onnx"))
    state = _state(tmp_path, manifest)
    feeds = {"X": X, **{n: state[n] for n in manifest["weights"]}}
    output = session.run([manifest["prediction"]["output"]], feeds)[0]
    np.testing.assert_allclose(output.reshape(-1), trainer.predict(X), rtol=1e-6)


def test_template_plus_weights_is_the_trained_model(fitted, tmp_path):
    """What the page's exportModel writes: the template's bytes, then
    ModelProto{graph{initializer: weights}} (protobuf merges the two graphs)."""
    trainer, X, _ = fitted
    manifest = export_web(trainer, tmp_path)
    state = _state(tmp_path, manifest)
    tail = onnx.ModelProto()
    tail.graph.initializer.extend(numpy_helper.from_array(state[n], n) for n in manifest["weights"])
    blob = (tmp_path / "model.template.onnx").read_bytes() + tail.SerializeToString()
    model = onnx.load_from_string(blob)
    onnx.checker.check_model(model, full_check=True)
    session = onnxruntime.InferenceSession(blob)
    prediction = session.run(None, {"X": X})[0]
    np.testing.assert_allclose(prediction.reshape(-1), trainer.predict(X), rtol=1e-5, atol=1e-6)
    template = onnx.load(tmp_path / "model.template.onnx")
    assert not {t.name for t in template.graph.initializer} & set(manifest["weights"])


def test_classifier_drops_zipmap_and_says_how_to_predict(tmp_path):
    model, _, _ = iris_classifier()
    manifest = export_web(Trainer(model, batch_size=16), tmp_path)
    predict = onnx.load(tmp_path / "predict.onnx")
    assert "ZipMap" not in {n.op_type for n in predict.graph.node}
    assert [o.name for o in predict.graph.output] == [manifest["prediction"]["output"]]
    assert manifest["label"] == {"name": "label", "type": "int64", "dims": [None], "classes": 3}
    assert manifest["sample_weight"]["name"] == "weight"
    assert manifest["prediction"] == {"output": "probabilities", "kind": "labels", "threshold": 0.5}


def test_forward_backward_trainer_is_refused(tmp_path, mlp_regressor):
    trainer = ForwardBackwardTrainer(mlp_regressor[1], loss="squared_error")
    with pytest.raises(TypeError, match="no fused training step"):
        export_web(trainer, tmp_path)


def test_several_losses_are_refused(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["A"]),
            helper.make_node("MatMul", ["X", "V"], ["B"]),
        ],
        "two_heads",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [
            helper.make_tensor_value_info("A", TensorProto.FLOAT, ["N", 1]),
            helper.make_tensor_value_info("B", TensorProto.FLOAT, ["N", 1]),
        ],
        [
            numpy_helper.from_array(np.ones((3, 1), np.float32), "W"),
            numpy_helper.from_array(np.ones((3, 1), np.float32), "V"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    trainer = Trainer(model, loss={"A": "squared_error", "B": "squared_error"})
    with pytest.raises(gk.IncompatibleModelError, match="trains one loss"):
        export_web(trainer, tmp_path)


def test_command_line_epochs_zero_only_exports(tmp_path, capsys):
    assert main(["--epochs", "0", "--output", str(tmp_path)]) == 2
    assert "--epochs 0 trains nothing" in capsys.readouterr().err
    code = main(["export", "--web", str(tmp_path / "w"), "--epochs", "0", "--schedule", "cosine"])
    assert code == 2 and "--schedule constant" in capsys.readouterr().err
    code = main(
        [
            "export",
            "--web",
            str(tmp_path / "w"),
            "--epochs",
            "0",
            "--quiet",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    manifest = json.loads((tmp_path / "w" / MANIFEST).read_text())
    assert int(_state(tmp_path / "w", manifest)["step"]) == 0  # untrained
    data = json.loads((tmp_path / "w" / "data.json").read_text())
    assert len(data["train"]["y"]) + len(data["held_out"]["y"]) == 442  # diabetes
