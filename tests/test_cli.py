"""graphkit-train end to end: a CSV and an NPZ dataset, its options and its help (the
embedded default job, make demo's entry point, is tests/test_first_run.py's)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx, requires_ort_training

import graphkit as gk
from graphkit import backends
from graphkit_train.cli import build_parser, main


def test_help_lists_every_option():
    text = build_parser().format_help()
    for option in (
        "--data",
        "--label",
        "--loss",
        "--optimizer",
        "--schedule",
        "--lr",
        "--epochs",
        "--batch-size",
        "--validation-split",
        "--seed",
        "--weights",
        "--output",
        "--input",
        "--checkpoint",
        "--resume",
    ):
        assert option in text
    assert "squared_error" in text and "adam" in text and "cosine" in text


def test_console_script_help():
    out = subprocess.run(
        [sys.executable, "-m", "graphkit_train.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "graphkit-train" in out.stdout


def test_version_prints_the_distributions_version(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    printed = capsys.readouterr().out
    installed = []
    for name in ("graphkit-onnx", "graphkit"):  # the distribution, renamed from graphkit
        try:
            installed.append(metadata.version(name))
        except metadata.PackageNotFoundError:
            pass
    assert printed == f"graphkit-train {(installed or [gk.__version__])[0]}\n"


def test_version_falls_back_to_the_package_and_ignores_another_projects(monkeypatch):
    """A source tree on sys.path has no distribution; a distribution named graphkit
    that does not declare graphkit-train is another project."""
    from importlib import metadata

    from graphkit_train import cli

    class Foreign:
        version = "9.9.9"
        entry_points: list = []

    def distribution(name):
        if name == "graphkit":
            return Foreign()
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", distribution)
    monkeypatch.setattr(gk, "__version__", "1.2.3")
    assert cli.version() == "1.2.3"


def _option_helps(parser):
    return {a.option_strings[-1] if a.option_strings else a.dest: a.help for a in parser._actions}


def test_help_reads_well_and_prints_each_default_once():
    parser = build_parser()
    text = parser.format_help()
    assert text.startswith("usage: graphkit-train [export] ")
    assert "so an error" not in text  # the old sentence about export, garbled
    assert "makes that an error instead" in text
    # the help strings say their defaults: argparse's formatter would add each again
    assert not issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
    assert "(default: None)" not in text and "(default: False)" not in text
    helps = _option_helps(parser)
    for option, help_text in helps.items():
        said = re.findall(r"\(default: [^)]*\)", help_text or "")
        assert len(said) == len(set(said)) and "%(default)" not in (help_text or ""), option
    for option, default in [("--lr", "0.001"), ("--batch-size", "32"), ("--epochs", "100")]:
        assert f"default: {default})" in helps[option]
    assert "(default: adam)" in helps["--optimizer"]
    assert "GRAPHKIT_BACKEND" in helps["--backend"]
    assert "GRAPHKIT_ORT_LOG_SEVERITY" in text


def test_help_states_how_its_defaults_differ_from_the_trainers():
    """The help's numbers are Trainer's own: checked against its signature."""
    import inspect

    from graphkit.optimizers import DEFAULT_LEARNING_RATE
    from graphkit_train import Trainer

    text = " ".join(build_parser().format_help().split())
    assert "The defaults differ from graphkit_train.Trainer's: here --optimizer adam" in text
    trainer = inspect.signature(Trainer).parameters
    assert f"optimizer='{trainer['optimizer'].default}'" in text
    assert f"learning rate of {DEFAULT_LEARNING_RATE}" in text
    assert f"batch_size={trainer['batch_size'].default}" in text


def test_help_names_onnxruntime_training_only_where_it_is_installed(monkeypatch):
    from graphkit.backends.base import BackendInfo

    registered = backends.available()
    assert any("onnxruntime-training" in b.description for b in registered)
    text = build_parser().format_help()
    installed = any(b.installed and "onnxruntime-training" in b.description for b in registered)
    assert ("onnxruntime-training" in text) == installed
    missing = [
        BackendInfo(b.name, b.name != "ort_training", b.install, b.description) for b in registered
    ]
    monkeypatch.setattr(backends, "available", lambda: missing)
    text = build_parser().format_help()
    assert "onnxruntime-training" not in text
    assert "--backend {" + ",".join(backends.names()) + "}" in text


def test_backend_option_trains_with_that_backend(csv_problem, tmp_path, monkeypatch):
    """--backend native trains natively, even where GRAPHKIT_BACKEND names another."""
    data, model, _, _ = csv_problem
    other = [n for n in backends.names() if n != "native"]
    if other:
        monkeypatch.setenv(backends.ENVIRONMENT_VARIABLE, other[0])
    out = tmp_path / "out"
    argv = [str(model), "--data", str(data), "--epochs", "2", "--quiet", "--output", str(out)]
    assert main([*argv, "--backend", "native"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["backend"] == "native" and report["settings"]["backend"] == "native"


def test_the_first_line_names_the_backend(csv_problem, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(backends.ENVIRONMENT_VARIABLE, raising=False)
    data, model, _, _ = csv_problem
    argv = [str(model), "--data", str(data), "--epochs", "1", "--output", str(tmp_path)]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    report = json.loads((tmp_path / "report.json").read_text())
    assert first.endswith(f", backend {report['backend']}")
    assert report["backend"] == backends.canonical(None)


def test_an_unknown_backend_is_one_line_and_exit_code_2(csv_problem, tmp_path, capsys):
    data, model, _, _ = csv_problem
    argv = [str(model), "--data", str(data), "--backend", "tensorflow", "--output", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "argument --backend: invalid choice: 'tensorflow'" in err
    assert not (tmp_path / "report.json").exists()


@pytest.fixture
def csv_problem(tmp_path, rng):
    X = rng.normal(size=(300, 3))
    y = X @ np.array([2.0, -1.0, 0.5]) + 1.0 + rng.normal(scale=0.05, size=300)
    path = tmp_path / "train.csv"
    table = np.column_stack([X, y])
    np.savetxt(path, table, delimiter=",", header="a,b,c,target", comments="")
    model = tmp_path / "linear.onnx"
    onnx.save(linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32)), model)
    return path, model, X, y


def test_csv_end_to_end(csv_problem, tmp_path, capsys):
    data, model, X, y = csv_problem
    out = tmp_path / "out"
    code = main(
        [
            str(model),
            "--data",
            str(data),
            "--label",
            "target",
            "--optimizer",
            "adam",
            "--lr",
            "0.05",
            "--epochs",
            "40",
            "--batch-size",
            "16",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr()
    assert "held-out R^2 (graphkit)" in printed.out
    report = json.loads((out / "report.json").read_text())
    assert report["features"] == ["a", "b", "c"]
    assert report["rows"] == {"train": 240, "held_out": 60}
    assert len(report["train_losses"]) == 40 and report["held_out_r2"] > 0.99
    assert (out / "loss_curve.png").stat().st_size > 1000
    trained = onnx.load(str(out / "model.onnx"))
    np.testing.assert_allclose(
        gk.get_train_initializer(trained)["coef"][:, 0], [2.0, -1.0, 0.5], atol=0.05
    )
    step = onnx.load(str(out / "training_step.onnx"))
    assert [o.name for o in step.graph.output][:3] == ["loss", "loss_sum.next", "step.next"]


def test_npz_classification(tmp_path):
    from sklearn.datasets import load_iris
    from sklearn.preprocessing import StandardScaler

    X, y = load_iris(return_X_y=True)
    np.savez(tmp_path / "iris.npz", X=StandardScaler().fit_transform(X), y=y)
    onnx.save(
        linear_regression_onnx(np.zeros((4, 3), np.float32), np.zeros(3, np.float32)),
        tmp_path / "m.onnx",
    )
    code = main(
        [
            str(tmp_path / "m.onnx"),
            "--data",
            str(tmp_path / "iris.npz"),
            "--loss",
            "cross_entropy",
            "--lr",
            "0.05",
            "--epochs",
            "60",
            "--quiet",
            "--output",
            str(tmp_path / "out"),
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["held_out_accuracy"] > 0.85


def _write(path, text):
    path.write_text(text)
    return str(path)


def _cli_error_cases(tmp_path, data, model):
    """(arguments, what the one-line error must say) for every error the CLI reports."""
    out = ["--output", str(tmp_path / "out"), "--quiet"]
    csv_file = lambda name, text: _write(tmp_path / name, text)  # noqa: E731
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(model.read_bytes()[:40])
    return [
        ([str(model), *out], "a MODEL needs --data"),
        (["--data", str(data), *out], "--data needs a MODEL"),
        ([str(tmp_path / "none.onnx"), "--data", str(data), *out], "none.onnx"),
        ([str(model), "--data", str(tmp_path / "none.csv"), *out], "no data file"),
        ([str(truncated), "--data", str(data), *out], "not a valid ONNX model"),
        ([str(model), "--data", str(data), "--label", "price", *out], "no column 'price'"),
        ([str(model), "--data", str(data), "--loss", "mse2", *out], "Unknown loss 'mse2'"),
        ([str(model), "--data", str(data), "--epochs", "0", *out], "--epochs 0 trains nothing"),
        ([str(model), "--data", str(data), "--epochs", "-1", *out], "--epochs: must be >= 0"),
        ([str(model), "--data", str(data), "--batch-size", "0", *out], "must be >= 1, got 0"),
        ([str(model), "--data", str(data), "--epochs", "x", *out], "'x' is not an integer"),
        (
            [str(model), "--data", csv_file("words.csv", "a,b,c,t\n1,2,3,4\n1,two,3,4\n"), *out],
            "words.csv, line 3, column 2 ('b'): 'two' is not a number",
        ),
        (
            [str(model), "--data", csv_file("label.csv", "a,b,c,t\n1,2,3,4\n1,2,3,high\n"), *out],
            "label.csv, line 3, column 4 ('t'): 'high' is not a number",
        ),
        (
            [str(model), "--data", csv_file("hole.csv", "a,b,c,t\n1,2,3,4\n\n1,,3,4\n"), *out],
            "hole.csv, line 4, column 2 ('b'): empty cell",
        ),
        (
            [str(model), "--data", csv_file("short.csv", "a,b,c,t\n1,2,3\n"), *out],
            "short.csv, line 2: 3 cells, but the header has 4",
        ),
        ([str(model), "--data", csv_file("empty.csv", ""), *out], "empty.csv is empty"),
        (
            [str(model), "--data", str(data), "--output-index", "3", *out],
            "output_index=3 is out of range",
        ),
        ([str(model), "--data", str(data), "--weights", "W9", *out], "['W9'] is not a trainable"),
        (
            [str(model), "--data", str(data), "--schedule", "join", *out],
            "the schedule 'join' needs schedules, boundaries",
        ),
        ([str(model), "--data", str(data), "--schedule", "cosin", *out], "Unknown schedule"),
        ([str(model), "--data", str(data), "--optimizer", "lions", *out], "Unknown optimizer"),
    ]


def test_every_cli_error_is_one_line_with_exit_code_2(csv_problem, tmp_path, capsys):
    data, model, _, _ = csv_problem
    for argv, expected in _cli_error_cases(tmp_path, data, model):
        code = main(argv)
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert len(err.strip().splitlines()) == 1, (argv, err)
        assert err.startswith("graphkit-train: ") and expected in err, (argv, err)


def test_cli_reads_quoted_headers_and_blank_lines(tmp_path, rng):
    X = rng.normal(size=(120, 3))
    y = X @ np.array([2.0, -1.0, 0.5]) + 1.0
    lines = ['"a","b, the second","c","target"']
    lines += [",".join(f"{v:.6f}" for v in row) for row in np.column_stack([X, y])]
    (tmp_path / "quoted.csv").write_text("\n".join(lines[:60] + [""] + lines[60:]) + "\n")
    model = tmp_path / "linear.onnx"
    onnx.save(linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32)), model)
    args = [str(model), "--data", str(tmp_path / "quoted.csv"), "--label", "target"]
    args += ["--epochs", "40", "--lr", "0.05", "--quiet", "--output", str(tmp_path / "out")]
    assert main(args) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["features"] == ["a", "b, the second", "c"]
    assert report["rows"]["train"] + report["rows"]["held_out"] == 120
    assert report["held_out_r2"] > 0.99


def test_cli_trains_a_skl2onnx_classifier_with_output_index(tmp_path):
    from skl2onnx import to_onnx
    from sklearn.datasets import load_breast_cancer
    from sklearn.neural_network import MLPClassifier
    from sklearn.preprocessing import StandardScaler

    X, y = load_breast_cancer(return_X_y=True)
    X = StandardScaler().fit_transform(X).astype(np.float32)
    np.savez(tmp_path / "cancer.npz", X=X, y=y)
    clf = MLPClassifier((8,), max_iter=1, random_state=0)
    with pytest.warns(Warning):
        clf.fit(X[:50], y[:50])
    onnx.save(to_onnx(clf, X[:1], options={"zipmap": False}), tmp_path / "mlp.onnx")
    args = [str(tmp_path / "mlp.onnx"), "--data", str(tmp_path / "cancer.npz"), "--loss", "log"]
    args += ["--output-index", "probabilities", "--epochs", "10", "--lr", "0.01", "--quiet"]
    assert main([*args, "--output", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert "unity" not in report["weights_trained"]
    assert len(report["epoch_end_seconds"]) == 10
    assert report["epoch_end_seconds"] == sorted(report["epoch_end_seconds"])
    assert report["held_out_accuracy"] > 0.9
    assert min(report["train_losses"]) > 0


def test_cli_schedules_span_the_run():
    """--lr is the initial (or peak) rate; a decaying schedule decays over the run."""
    from graphkit_train.cli import cli_schedule

    assert cli_schedule("constant", 0.1, 500)(499) == pytest.approx(0.1)
    cosine = cli_schedule("cosine", 0.1, 500)
    assert cosine(0) == pytest.approx(0.1) and cosine(500) == pytest.approx(0.0, abs=1e-9)
    one_cycle = cli_schedule("one_cycle", 0.1, 500)
    assert max(one_cycle(t) for t in range(500)) == pytest.approx(0.1)
    assert one_cycle(499) < 1e-5


def test_export_writes_portable_training(csv_problem, tmp_path):
    """``graphkit-train export``: the trained model carries its training step, which
    onnx.reference runs."""
    from onnx import numpy_helper

    from graphkit.training_info import initial_state, run_training_info

    data, model, _, _ = csv_problem
    out = tmp_path / "out"
    assert main(["export", str(model), "--data", str(data), "--epochs", "2", "--quiet",
                 "--output", str(out)]) == 0  # fmt: skip
    trainable = onnx.load(out / "model.trainable.onnx")
    rows = np.loadtxt(data, delimiter=",", skiprows=1, dtype=np.float32)
    batch = {"X": rows[:8, :-1], "label": rows[:8, -1:]}
    _, history = run_training_info(trainable, [batch], runtime="reference")
    assert np.isfinite(float(history[0]["loss"]))
    # the portable step starts from the trained values: the outputs of its
    # TrainingInfoProto's initialization graph, not initializers (no algorithm)
    step = onnx.load(out / "training_step.portable.onnx")
    assert [len(i.algorithm.node) for i in step.training_info] == [0]
    state = initial_state(step)
    trained = {t.name: numpy_helper.to_array(t) for t in trainable.graph.initializer}
    shared = set(state) & set(trained)
    assert shared and not set(state) & {t.name for t in step.graph.initializer}
    for name in shared:
        np.testing.assert_array_equal(state[name], trained[name])


def same_upper_conv(folder) -> str:
    """A model with a Conv whose padding is auto_pad=SAME_UPPER (as TensorFlow's
    converters write it), saved in ``folder``; its path."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["X", "as_signal"], ["signal"]),
            helper.make_node("Conv", ["signal", "K"], ["conv"], auto_pad="SAME_UPPER"),
            helper.make_node("Reshape", ["conv", "as_rows"], ["rows"]),
            helper.make_node("MatMul", ["rows", "W"], ["Y"]),
        ],
        "same_upper",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [
            numpy_helper.from_array(np.ones((1, 1, 2), np.float32), "K"),
            numpy_helper.from_array(np.ones((3, 1), np.float32) * 0.1, "W"),
            numpy_helper.from_array(np.array([-1, 1, 3], np.int64), "as_signal"),
            numpy_helper.from_array(np.array([-1, 3], np.int64), "as_rows"),
        ],
    )
    gathered = folder / "gathered.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), gathered)
    return str(gathered)


def test_a_conv_with_same_upper_padding_trains(csv_problem, tmp_path, capsys):
    """On the default backend, whichever it is."""
    data = csv_problem[0]
    argv = [same_upper_conv(tmp_path), "--data", str(data), "--epochs", "1", "--quiet"]
    assert main([*argv, "--weights", "K,W", "--output", str(tmp_path / "a")]) == 0, (
        capsys.readouterr().err
    )


@requires_ort_training
def test_an_export_the_lowering_cannot_rewrite_fails_in_one_line(
    csv_problem, tmp_path, capsys, monkeypatch
):
    """onnxruntime-training's gradient of a Conv with auto_pad=SAME_UPPER (ConvGrad) has
    no standard lowering: training works, ``graphkit-train export`` is a one-line error."""
    monkeypatch.setenv(backends.ENVIRONMENT_VARIABLE, "ort_training")
    data = csv_problem[0]
    argv = [same_upper_conv(tmp_path), "--data", str(data), "--epochs", "1", "--quiet"]
    argv += ["--weights", "K,W"]
    assert main([*argv, "--output", str(tmp_path / "a")]) == 0  # training alone works
    capsys.readouterr()
    assert main(["export", *argv, "--output", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "ConvGrad" in err, err


def _features_and_ids_model() -> onnx.ModelProto:
    """Y = a W + E[ids]: two float columns and an int64 category id (an embedding)."""
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["a", "W"], ["linear"]),
            helper.make_node("Gather", ["E", "ids"], ["embedded"]),  # (N, 1, 1)
            helper.make_node("Squeeze", ["embedded", "axis"], ["offset"]),
            helper.make_node("Add", ["linear", "offset"], ["Y"]),
        ],
        "features_and_ids",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 2]),
            helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 1]),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [
            numpy_helper.from_array(np.zeros((2, 1), np.float32), "W"),
            numpy_helper.from_array(np.zeros((5, 1), np.float32), "E"),
            numpy_helper.from_array(np.array([1], np.int64), "axis"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_input_maps_columns_to_a_model_with_several_inputs(tmp_path, rng, capsys):
    """--input NAME=COLUMNS, once per input: float columns to one, category ids (numbers
    in the CSV) to an int64 input; omitting it, or leaving a column out, is refused."""
    X = rng.normal(size=(300, 2))
    category = rng.integers(0, 5, size=300)
    offsets = np.array([0.5, -1.0, 0.0, 1.0, 2.0])
    y = X @ np.array([2.0, -1.0]) + offsets[category]
    data = tmp_path / "train.csv"
    table = np.column_stack([X, category, y])
    np.savetxt(data, table, delimiter=",", header="x1,x2,city,target", comments="")
    model = tmp_path / "model.onnx"
    onnx.save(_features_and_ids_model(), model)
    argv = [str(model), "--data", str(data), "--lr", "0.05", "--epochs", "60", "--quiet"]
    out = tmp_path / "out"
    code = main([*argv, "--input", "a=x1,x2", "--input", "ids=city", "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["held_out_r2"] > 0.99
    trained = gk.get_train_initializer(onnx.load(str(out / "model.onnx")))
    np.testing.assert_allclose(trained["W"][:, 0], [2.0, -1.0], atol=0.05)
    np.testing.assert_allclose(trained["E"][:, 0], offsets, atol=0.1)
    # the same data as NPZ arrays
    np.savez(tmp_path / "train.npz", features=X, city=category[:, None], y=y)
    npz = [str(model), "--data", str(tmp_path / "train.npz"), "--epochs", "2", "--quiet"]
    assert main([*npz, "--input", "a=features", "--input", "ids=city", "--output", str(out)]) == 0
    for extra, expected in [
        ([], "the model takes 2 inputs ['a', 'ids']: say which columns each reads with --input"),
        (["--input", "a=x1", "--input", "ids=city"], "columns ['x2'] go to no input"),
        (["--input", "a=x1,x2", "--input", "idz=city"], "the model's inputs are ['a', 'ids']"),
        (["--input", "a=x1,x2,x9", "--input", "ids=city"], "has no column ['x9']"),
        (["--input", "a"], "write NAME=COLUMNS"),
    ]:
        assert main([*argv, *extra, "--output", str(out)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err, err
