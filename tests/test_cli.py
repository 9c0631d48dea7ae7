"""graphkit-train end to end: a CSV and an NPZ dataset, and the embedded default job
(make demo's entry point) against scikit-learn."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx

import graphkit as gk
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


def test_default_job_matches_sklearn(tmp_path):
    """make demo: the MLP on scikit-learn's diabetes data, next to MLPRegressor."""
    code = main(["--quiet", "--output", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["dataset"] == "scikit-learn diabetes"
    assert report["held_out_r2"] == pytest.approx(report["sklearn"]["held_out_r2"], abs=0.05)
    assert report["held_out_r2"] > 0.4


def test_cli_errors(csv_problem, tmp_path, capsys):
    data, model, _, _ = csv_problem
    with pytest.raises(SystemExit, match="needs --data"):
        main([str(model), "--output", str(tmp_path)])
    with pytest.raises(SystemExit, match="no column 'price'"):
        main([str(model), "--data", str(data), "--label", "price", "--output", str(tmp_path)])
    code = main([str(model), "--data", str(data), "--loss", "mse2", "--output", str(tmp_path)])
    assert code == 2
    assert "Unknown loss 'mse2'" in capsys.readouterr().err
