"""The backend seam: a registry of backends, each a package behind two protocols, and
the import rules that keep onnxruntime-training's knowledge inside its package."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import graphkit as gk
from graphkit import MissingGradientError, backends
from graphkit.backends.base import Backend
from graphkit.engine import ort_engine

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(
    p for package in ("graphkit", "graphkit_train") for p in (ROOT / package).rglob("*.py")
)
BACKENDS = ROOT / "graphkit" / "backends"
ENGINE = ROOT / "graphkit" / "engine"
ORT_TRAINING = BACKENDS / "ort_training"

# onnxruntime's C bindings, and what only onnxruntime-training has
C_API = re.compile(r"\bcapi\b|_pybind_state|\._iobinding|\._sess\b")
ORT_TRAINING_ONLY = re.compile(
    r"GradientGraphBuilder|OrtModuleGraphBuilder|TrainingAgent\(|OrtValueVector|"
    r"PartialGraphExecutionState|OrtValueCache|\"YieldOp\""
)


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, code) without comments and docstrings."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = path.read_text().splitlines()
    return [(n, line.split("#")[0]) for n, line in enumerate(lines, 1) if n not in docstrings]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return found


def _offenders(pattern: re.Pattern[str], *allowed: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{n}: {code.strip()}"
        for path in SOURCES
        if not any(a in path.parents for a in allowed)
        for n, code in _code_lines(path)
        if pattern.search(code)
    ]


def test_only_the_engine_and_the_backends_reach_onnxruntime_c_bindings():
    offenders = _offenders(C_API, BACKENDS, ENGINE)
    assert not offenders, "\n".join(offenders)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path, packages: Sequence[str]) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, for every import of the packages' modules:
    at the top, inside functions, and ``importlib.import_module``/``__import__`` calls
    with a fixed name. A module's own ancestor packages are not counted (Python has run
    them already); ``from a import b`` counts ``a.b`` where that is a module, else ``a``."""
    paths = {_module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}

    def module(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph[name] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                source = (
                    node.module or ""
                    if not node.level
                    else ".".join(p for p in (base, node.module) if p)
                )
                targets = [
                    f"{source}.{a.name}" if f"{source}.{a.name}" in paths else source
                    for a in node.names
                ]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None))
                in ("import_module", "__import__")
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                targets = [node.args[0].value]
            else:
                continue
            for target in filter(None, map(module, targets)):
                # importing a.b.c runs the packages a and a.b first, unless they are the
                # importer's own (already running)
                parts = target.split(".")
                for i in range(1, len(parts) + 1):
                    step = ".".join(parts[:i])
                    if step in paths and step != name and not name.startswith(step + "."):
                        edges.setdefault(step, node.lineno)
    return graph


def _circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_no_module_imports_itself_back_through_any_import():
    """graphkit's layers hold for every import: top-level ones, those inside functions,
    and importlib calls with a fixed name (the backend registry's)."""
    graph = _import_graph(ROOT, ["graphkit", "graphkit_train"])
    circles = _circles(graph)
    described = [
        " <-> ".join(c)
        + "\n"
        + "\n".join(
            f"  {a}:{line} imports {b}" for a in c for b, line in graph[a].items() if b in c
        )
        for c in circles
    ]
    assert not circles, "\n".join(described)


def test_the_import_analysis_sees_imports_inside_functions_and_importlib(tmp_path):
    """The analysis above finds a circle closed by an import inside a function or by an
    importlib call, and none where the only import runs from a package to its module."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n")
    (package / "b.py").write_text("import importlib\nimportlib.import_module('pkg.sub.c')\n")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import c\n")
    (package / "sub" / "c.py").write_text("from . import d\nfrom ..a import f\n")
    (package / "sub" / "d.py").write_text("")
    graph = _import_graph(tmp_path, ["pkg"])
    assert _circles(graph) == [["pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"]]
    (package / "a.py").write_text("")
    assert _circles(_import_graph(tmp_path, ["pkg"])) == []


def test_only_the_ort_training_package_names_its_classes():
    offenders = _offenders(ORT_TRAINING_ONLY, ORT_TRAINING)
    assert not offenders, "\n".join(offenders)


def test_backend_packages_are_reached_through_the_registry_only():
    """Outside graphkit/backends, nothing imports a backend's package: the trainers, the
    exports and OnnxModule get it from graphkit.backends.get."""
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in SOURCES
        if BACKENDS not in path.parents
        for name in _imports(path)
        if name.startswith(("graphkit.backends.ort_training", "graphkit.backends.native"))
    ]
    assert not offenders, "\n".join(offenders)


def test_onnx_ad_is_behind_one_adapter():
    """onnx-ad is imported by the native backend's adapter and by the rules that extend
    its table, nowhere else."""
    allowed = {BACKENDS / "native" / "adapter.py", BACKENDS / "native" / "rules.py"}
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in SOURCES
        if path not in allowed
        for name in _imports(path)
        if name.split(".")[0] == "onnx_ad"
    ]
    assert not offenders, "\n".join(offenders)


def test_the_dsl_never_imports_the_runtime():
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in SOURCES
        if (ROOT / "graphkit") in path.parents
        for name in _imports(path)
        if name.split(".")[0] == "graphkit_train"
    ]
    assert not offenders, "\n".join(offenders)


def test_the_runtime_engine_never_imports_the_trainers():
    engine = ROOT / "graphkit_train" / "engine"
    offenders = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in SOURCES
        if engine in path.parents
        for name in _imports(path)
        if name.startswith("graphkit_train.trainers")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_registry():
    assert backends.names() == ["native", "ort_training"]  # native: the default everywhere
    info = {i.name: i for i in backends.available()}
    assert "graphkit-onnx[ort-training]" in info["ort_training"].install
    assert info["native"].installed and "graphkit-onnx[cpu]" in info["native"].install
    if not os.environ.get(backends.ENVIRONMENT_VARIABLE):
        assert backends.get() is backends.get("native")
    native = backends.get("native")
    assert native is backends.get("Native") is backends.get("NATIVE")
    for name in [n for n, i in info.items() if i.installed]:
        backend = backends.get(name)
        assert backend is backends.get(name.upper().replace("_", "-"))
        assert isinstance(backend, Backend)
    with pytest.raises(gk.UnknownNameError, match="Unknown backend 'tpu'.*native.*ort_training"):
        backends.get("tpu")
    with pytest.raises(TypeError, match="backend must be a name"):
        backends.get(3)  # type: ignore[arg-type]


def test_the_environment_names_the_default_backend(monkeypatch):
    monkeypatch.setenv(backends.ENVIRONMENT_VARIABLE, "native")
    assert backends.get() is backends.get("native")
    monkeypatch.setenv(backends.ENVIRONMENT_VARIABLE, "tpu")
    with pytest.raises(gk.UnknownNameError, match="Unknown backend 'tpu'"):
        backends.get()


def test_a_backend_that_is_not_installed_says_what_to_install(monkeypatch):
    monkeypatch.delenv(backends.ENVIRONMENT_VARIABLE, raising=False)
    for name in backends.names():
        entry = backends._BACKENDS[name]
        monkeypatch.setitem(
            backends._BACKENDS,
            name,
            replace(entry, installed=lambda: False, install="pip install X"),
        )
    missing = "'ort_training' backend is not installed: pip install X"
    with pytest.raises(gk.BackendNotInstalledError, match=missing):
        backends.get("ort_training")
    with pytest.raises(ImportError, match="No graphkit backend is installed.*pip install X"):
        backends.get()
    with pytest.raises(gk.BackendNotInstalledError):
        gk.gradient_model(_model("Tanh"), "y", ["w"], backend="ort_training")
    with pytest.raises(gk.BackendNotInstalledError, match="'native' backend is not installed"):
        gk.gradient_model(_model("Tanh"), "y", ["w"], backend="native")


def _model(op: str) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [])
    w = onnx.numpy_helper.from_array(np.array([0.5, -1.0, 2.0], np.float32), "w")
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["t"]),
        helper.make_node(op, ["t"], ["u"]),
        helper.make_node("ReduceSum", ["u"], ["y"], keepdims=0),
    ]
    graph = helper.make_graph(nodes, "g", [x], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


INSTALLED = [b.name for b in backends.available() if b.installed]


@pytest.mark.parametrize("name", INSTALLED)
def test_gradient_graph_against_the_formula_and_its_errors(name):
    backend = backends.get(name)
    grad = gk.gradient_model(_model("Tanh"), "y", ["w"], backend=name)
    x = np.array([1.0, 2.0, -0.5], np.float32)
    out = gk.run(grad, {"x": x})
    w = np.array([0.5, -1.0, 2.0], np.float32)
    # d/dw sum(tanh(x w)) = x (1 - tanh(x w)^2)
    np.testing.assert_allclose(out["w_grad"], x * (1 - np.tanh(x * w) ** 2), rtol=1e-6)
    if name == "ort_training":
        with pytest.raises(MissingGradientError, match="no gradient for operator 'Cosh'"):
            backend.gradient_graph(_model("Cosh"), "y", ["w"])
    else:  # d/dw sum(cosh(x w)) = x sinh(x w)
        out = gk.run(gk.gradient_model(_model("Cosh"), "y", ["w"], backend=name), {"x": x})
        np.testing.assert_allclose(out["w_grad"], x * np.sinh(x * w), rtol=1e-6)
        with pytest.raises(MissingGradientError, match="ArgMax|only through operators"):
            backend.gradient_graph(_model("ArgMax"), "y", ["w"])
    with pytest.raises(ValueError, match="Unknown device"):
        ort_engine.providers_for("tpu")


def _regression():
    from conftest import linear_regression_onnx

    rng = np.random.default_rng(0)
    X = rng.normal(size=(20, 3)).astype(np.float32)
    y = (X @ np.array([1.0, -2.0, 0.5], np.float32) + 0.3).astype(np.float32)
    onx = linear_regression_onnx(np.zeros((3, 1), np.float32), np.zeros(1, np.float32))
    return onx, X, y


def _entry_points():
    from graphkit_train import ForwardBackwardTrainer, OrtGradientForwardBackward, Trainer

    onx, X, y = _regression()
    yield "gradient_model", lambda b: gk.gradient_model(_model("Tanh"), "y", ["w"], backend=b)
    yield "Trainer", lambda b: Trainer(onx, loss="mse", max_iter=1, backend=b).fit(X, y)
    yield (
        "ForwardBackwardTrainer",
        lambda b: ForwardBackwardTrainer(onx, max_iter=1, backend=b).fit(X, y),
    )
    yield "OrtGradientForwardBackward", lambda b: OrtGradientForwardBackward(onx, backend=b)
    try:
        from graphkit_train.torch_module import OnnxModule
    except ImportError:
        return
    yield "OnnxModule", lambda b: OnnxModule(onx, backend=b)


ENTRY_POINTS = dict(_entry_points())


@pytest.mark.parametrize("name", INSTALLED)
@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_takes_backend(entry, name, monkeypatch):
    build = ENTRY_POINTS[entry]
    build(name)  # installed: builds (and trains) as the default does
    with pytest.raises(gk.UnknownNameError, match="Unknown backend 'nope'"):
        build("nope")
    entry_ = backends._BACKENDS[name]
    monkeypatch.setitem(
        backends._BACKENDS, name, replace(entry_, installed=lambda: False, install="pip install X")
    )
    with pytest.raises(gk.BackendNotInstalledError, match="pip install X"):
        build(name)


def test_the_backend_chosen_by_name_trains_like_the_default():
    """Trainer(backend=name) for every installed backend, and Trainer(), reach the
    weights numpy's SGD does."""
    from graphkit_train import Trainer

    onx, X, y = _regression()
    kwargs = dict(loss="mse", max_iter=3, batch_size=5, shuffle=False, optimizer="sgd")
    states = [Trainer(onx, backend=name, **kwargs).fit(X, y).get_state() for name in INSTALLED]
    states.append(Trainer(onx, **kwargs).fit(X, y).get_state())
    W, b = np.zeros((3, 1)), np.zeros(1)
    for _ in range(3):
        for start in range(0, 20, 5):
            xb, yb = X[start : start + 5].astype(np.float64), y[start : start + 5, None]
            residual = xb @ W + b - yb  # d mean((xW + b - y)^2) = 2 mean(residual x)
            W -= 0.01 * 2 * xb.T @ residual / 5
            b -= 0.01 * 2 * residual.mean(axis=0)
    for state in states:
        np.testing.assert_allclose(state["coef"], W, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["intercept"], b, rtol=1e-5, atol=1e-6)


def test_what_graphkit_writes_loads_on_every_registered_backend(monkeypatch):
    from graphkit import compat

    assert (compat.MAX_IR_VERSION, compat.MAX_OPSET) == (10, 21)  # onnxruntime-training 1.19.2
    for entry in backends._BACKENDS.values():
        assert entry.max_ir_version >= compat.MAX_IR_VERSION and entry.max_opset >= compat.MAX_OPSET
    with pytest.raises(ValueError, match="loads IR version 9 and opset 19, but graphkit writes"):
        backends.register("older", "x", lambda: False, "", "", max_ir_version=9, max_opset=19)
    assert "older" not in backends.names()


def test_the_onnx_ad_pin_is_one_version_everywhere():
    """pyproject's pin, the adapter's VERSION and the registry's install line agree."""
    from graphkit.backends.native import adapter

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [d for d in project["dependencies"] if d.startswith("onnx-ad")]
    assert pins == [f"onnx-ad=={adapter.VERSION}"]
    info = {i.name: i for i in backends.available()}
    assert f"onnx-ad=={adapter.VERSION}" in info["native"].install
    assert adapter.installed() and importlib.metadata.version("onnx-ad") == adapter.VERSION


def test_the_registry_tells_what_is_installed_without_importing_it():
    """backends.available() answers from importlib.util.find_spec and the installed
    distributions: no backend package, onnxruntime or onnx-ad is imported to answer."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from graphkit import backends\n"
        "print([b.installed for b in backends.available()])\n"
        "print(sorted(m for m in sys.modules if m.startswith(('graphkit.backends.native', "
        "'graphkit.backends.ort_training', 'onnxruntime', 'onnx_ad'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    installed, imported = out.stdout.splitlines()
    assert imported == "[]"
    # the reference: importing them
    import onnx_ad  # noqa: F401 - native's gradients

    training = hasattr(ort_engine.onnxruntime().capi._pybind_state, "TrainingAgent")
    assert installed == str([True, training])


def test_the_runtime_imports_no_private_graphkit_module_and_builds_no_graph():
    """graphkit_train runs what graphkit builds: it imports only graphkit's public
    modules, and writes no node (the command line's demo model excepted: it stands for
    the model a user brings)."""
    runtime = ROOT / "graphkit_train"
    private = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in SOURCES
        if runtime in path.parents
        for name in _imports(path)
        if any(part.startswith("_") for part in name.split(".")[1:] if name.startswith("graphkit."))
        or name.startswith("graphkit.static_shapes")
    ]
    assert not private, "\n".join(private)
    builds = _offenders(re.compile(r"\bmake_node\(|\bmake_graph\(|\.graph\.node\.(extend|append)"))
    builds = [b for b in builds if b.startswith("graphkit_train/") and "cli.py" not in b]
    assert not builds, "\n".join(builds)
