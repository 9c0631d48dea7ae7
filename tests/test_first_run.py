"""What a first run shows: ``graphkit-train`` with no arguments (``make demo``) on a bare
install, with the numbers it always gave; onnxruntime's C++ log lines kept off stderr
unless asked for; graphkit's own messages through :mod:`logging`, silent by default."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from conftest import linear_regression_onnx, requires_ort_training
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import backends
from graphkit.engine import ort_engine
from graphkit_train import Trainer
from graphkit_train.cli import diabetes, main

# what the demo printed and wrote before its data moved into the package: held-out R^2
# 0.4710, epoch-100 losses 2422.1 (train) and 3143.38 (held out)
DEMO_R2, DEMO_TRAIN_LOSS, DEMO_HELD_OUT_LOSS = 0.4710, 2422.1, 3143.38

# importable here, but none of graphkit's required dependencies: a bare install lacks them
NOT_REQUIRED = ("sklearn", "scipy", "matplotlib", "torch", "pandas", "skl2onnx")

# put first in a child interpreter: the modules of NOT_REQUIRED import as if not installed
BLOCKER = textwrap.dedent(
    f"""
    import importlib.abc, sys

    class NotInstalled(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in {NOT_REQUIRED!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None

    sys.meta_path.insert(0, NotInstalled())
    """
)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter, its stdout and stderr captured from the file
    descriptors (onnxruntime writes from C++); ``env`` added to a copy of this process's
    environment, where graphkit's own variables are unset."""
    environment = {k: v for k, v in os.environ.items() if k not in ("GRAPHKIT_ORT_LOG_SEVERITY",)}
    environment.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environment, timeout=300
    )


# -- the demo on a bare install ---------------------------------------------------------


@pytest.fixture(scope="module")
def demo_with_sklearn(tmp_path_factory):
    """The demo's report, trained in this process where scikit-learn is installed."""
    pytest.importorskip("sklearn")
    folder = tmp_path_factory.mktemp("demo")
    assert main(["--quiet", "--output", str(folder)]) == 0
    return json.loads((folder / "report.json").read_text())


def test_the_demo_matches_scikit_learn_and_its_recorded_numbers(demo_with_sklearn):
    report = demo_with_sklearn
    assert report["dataset"] == "diabetes (Efron et al. 2004)"
    assert report["rows"] == {"train": 354, "held_out": 88}
    assert report["held_out_r2"] == pytest.approx(report["sklearn"]["held_out_r2"], abs=0.05)
    assert report["held_out_r2"] == pytest.approx(DEMO_R2, abs=1e-4)
    assert report["train_losses"][99] == pytest.approx(DEMO_TRAIN_LOSS, rel=1e-5)
    assert report["held_out_losses"][99] == pytest.approx(DEMO_HELD_OUT_LOSS, rel=1e-5)


def test_the_shipped_diabetes_data_is_scikit_learns():
    datasets = pytest.importorskip("sklearn.datasets")
    X, y, names = diabetes()
    reference = datasets.load_diabetes()
    assert X.dtype == y.dtype == np.float64 and X.shape == (442, 10)
    assert np.array_equal(X, reference.data) and np.array_equal(y, reference.target)
    assert names == list(reference.feature_names)


def test_the_demo_runs_on_a_bare_install_with_the_same_numbers(tmp_path, demo_with_sklearn):
    """No scikit-learn, matplotlib or torch: the demo trains on its shipped data, says in
    one line each what the comparison and the loss curve need, and reports what it
    reports with scikit-learn installed."""
    out = tmp_path / "bare"
    run = _python(
        BLOCKER
        + textwrap.dedent(
            f"""
            from graphkit_train.cli import main
            code = main(["--output", {str(out)!r}])
            loaded = sorted(m for m in {NOT_REQUIRED!r} if m in sys.modules)
            print("RESULT", code, loaded)
            """
        )
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "RESULT 0 []", run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    needs = [line for line in run.stdout.splitlines() if "pip install" in line]
    assert needs == [
        "held-out R^2 (scikit-learn): not compared, the comparison needs scikit-learn "
        "(pip install scikit-learn)",
        "loss_curve.png: not drawn, the loss curve needs matplotlib (pip install matplotlib)",
    ]
    report = json.loads((out / "report.json").read_text())
    assert "sklearn" not in report and "loss_curve" not in report["files"]
    assert not (out / "loss_curve.png").exists() and (out / "model.onnx").exists()
    for key in ("held_out_r2", "train_losses", "held_out_losses", "features", "rows"):
        assert report[key] == demo_with_sklearn[key], key


def test_without_scikit_learn_and_matplotlib_each_is_one_line(monkeypatch, tmp_path, capsys):
    """The same in this process, scikit-learn and matplotlib made unimportable."""
    for name in list(sys.modules):  # submodules too: an imported one would still load
        if name.partition(".")[0] in ("sklearn", "matplotlib"):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["--epochs", "2", "--output", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "needs scikit-learn (pip install scikit-learn)" in out
    assert "the loss curve needs matplotlib (pip install matplotlib)" in out
    assert "held-out R^2 (graphkit):" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert "sklearn" not in report and len(report["train_losses"]) == 2
    assert sorted(os.listdir(tmp_path)) == sorted(
        os.path.basename(p) for p in report["files"].values()
    )


# -- onnxruntime's own log lines ---------------------------------------------------------


def _unused_initializer_model() -> onnx.ModelProto:
    """Y = X W + b with a loss, and an initializer no node reads (which onnxruntime warns
    about when it loads the graph)."""
    model = linear_regression_onnx(np.ones((2, 1), np.float32), np.zeros(1, np.float32))
    model.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "unused"))
    return gk.add_loss_output(model, "squared_error")


# a session on a graph with an unused initializer and, with onnxruntime-training, a
# gradient build on its builders; the model is read from sys.argv[1]
SESSION_AND_GRADIENT = textwrap.dedent(
    """
    import sys
    import numpy as np, onnx
    import graphkit as gk
    from graphkit import backends
    from graphkit.engine import ort_engine

    if len(sys.argv) > 2:
        ort_engine.set_log_severity(sys.argv[2])
    model = onnx.load(sys.argv[1])
    feeds = {"X": np.ones((4, 2), np.float32), "label": np.ones((4, 1), np.float32)}
    print("loss", gk.run(model, feeds)["loss"])
    if any(b.name == "ort_training" and b.installed for b in backends.available()):
        gk.gradient_model(model, "loss", ["coef"], backend="ort_training")
        print("gradient built")
    """
)


def _session_and_gradient(tmp_path, *severity: str, **env: str) -> subprocess.CompletedProcess:
    path = tmp_path / "unused.onnx"
    onnx.save(_unused_initializer_model(), path)
    code = f"import sys; sys.argv[1:] = {[str(path), *severity]!r}\n" + SESSION_AND_GRADIENT
    run = _python(code, **env)
    assert run.returncode == 0, run.stderr
    return run


def _ort_training_installed() -> bool:
    return any(b.name == "ort_training" and b.installed for b in backends.available())


def test_onnxruntime_logs_nothing_by_default(tmp_path):
    """Neither the builders' INFO line nor the session's unused-initializer warning."""
    run = _session_and_gradient(tmp_path)
    assert "loss" in run.stdout
    assert ("gradient built" in run.stdout) == _ort_training_installed()
    assert run.stderr == ""


@pytest.mark.parametrize("how", ["environment", "function"])
def test_onnxruntime_logs_come_back_when_asked(tmp_path, how):
    """GRAPHKIT_ORT_LOG_SEVERITY=info, or ort_engine.set_log_severity("info")."""
    if how == "environment":
        run = _session_and_gradient(tmp_path, GRAPHKIT_ORT_LOG_SEVERITY="info")
    else:
        run = _session_and_gradient(tmp_path, "info")
    assert "Removing initializer 'unused'" in run.stderr
    assert "Initializing session" in run.stderr  # a session's own INFO line
    if _ort_training_installed():
        assert "GraphTransformer pre_training_rule_based_graph_transformer" in run.stderr


@requires_ort_training
def test_the_builders_are_quiet_by_default(tmp_path):
    """The INFO line the training build's GradientGraphBuilder printed on every build."""
    run = _session_and_gradient(tmp_path)
    assert "gradient built" in run.stdout
    assert "GraphTransformer" not in run.stderr and "[I:onnxruntime" not in run.stderr


def test_a_refusal_still_carries_onnxruntimes_message():
    """onnxruntime's errors come as exceptions, which keep its own text."""
    graph = helper.make_graph(
        [helper.make_node("Add", ["X", "Z"], ["Y"])],
        "mismatch",
        [
            helper.make_tensor_value_info("X", TensorProto.FLOAT, [2]),
            helper.make_tensor_value_info("Z", TensorProto.INT64, [2]),
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    feeds = {"X": np.zeros(2, np.float32), "Z": np.zeros(2, np.int64)}
    with pytest.raises(gk.IncompatibleModelError, match=r"bound to different types"):
        gk.run(model, feeds)


def test_log_severity_reads_the_environment(monkeypatch):
    monkeypatch.delenv(ort_engine.LOG_SEVERITY_VARIABLE, raising=False)
    assert ort_engine.log_severity() == ort_engine.QUIET == 3
    for value, level in [("0", 0), ("warning", 2), (" Fatal ", 4)]:
        monkeypatch.setenv(ort_engine.LOG_SEVERITY_VARIABLE, value)
        assert ort_engine.log_severity() == level
    monkeypatch.setenv(ort_engine.LOG_SEVERITY_VARIABLE, "loud")
    with pytest.raises(ValueError, match="GRAPHKIT_ORT_LOG_SEVERITY='loud' is not an"):
        ort_engine.log_severity()


def test_a_bad_log_severity_is_one_cli_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(ort_engine.LOG_SEVERITY_VARIABLE, "7")
    assert main(["--epochs", "1", "--quiet", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("graphkit-train: ValueError: "), err
    assert "GRAPHKIT_ORT_LOG_SEVERITY='7' is not an onnxruntime log severity: give 0-4" in err


# -- graphkit's loggers --------------------------------------------------------------------

# a Trainer on each backend of BACKENDS, on a graph with an initializer no node reads
TRAIN_QUIETLY = textwrap.dedent(
    """
    import numpy as np
    from onnx import numpy_helper
    import graphkit as gk
    from graphkit_train import Trainer
    from conftest import linear_regression_onnx

    model = linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32))
    model.graph.initializer.append(numpy_helper.from_array(np.ones(2, np.float32), "unused"))
    X = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    y = X @ np.array([1.0, -2.0, 0.5], np.float32)
    for backend in BACKENDS:
        Trainer(gk.add_loss_output(model, "squared_error"), max_iter=3, backend=backend).fit(X, y)
    """
)


def test_importing_and_training_prints_nothing():
    """Not a line on stdout or stderr (file descriptors: onnxruntime's C++ included), on
    every installed backend."""
    installed = [b.name for b in backends.available() if b.installed]
    tests = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {tests!r}); BACKENDS = {installed!r}\n"
    run = _python(code + TRAIN_QUIETLY)
    assert run.returncode == 0, run.stderr
    assert (run.stdout, run.stderr) == ("", "")


def test_the_loggers_are_silent_until_configured_then_tell(caplog, rng):
    for name in ("graphkit", "graphkit_train"):
        assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger(name).handlers)
    model = linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32))
    X = rng.normal(size=(64, 3)).astype(np.float32)
    y = X @ np.array([1.0, -2.0, 0.5], np.float32)
    caplog.set_level(logging.DEBUG, logger="graphkit_train")
    caplog.set_level(logging.DEBUG, logger="graphkit")
    trainer = Trainer(gk.add_loss_output(model, "squared_error"), max_iter=3)
    trainer.fit(X, y)
    gk.gradient_model(trainer.train_onnx_, "loss", ["coef"], backend=trainer._backend.name)
    messages = [(r.name, r.getMessage()) for r in caplog.records]
    backend = trainer._backend.name
    assert any(
        n == "graphkit_train.trainers.base"
        and m.startswith(f"Trainer: graphs built with the {backend} backend in")
        for n, m in messages
    ), messages
    assert any(
        n == "graphkit_train.trainers.base" and m.startswith("Trainer: 3 epochs in")
        for n, m in messages
    ), messages
    assert any(
        n == "graphkit.gradient"
        and m == f"gradient of 'loss' with respect to ['coef'] from the {backend} backend"
        for n, m in messages
    ), messages
