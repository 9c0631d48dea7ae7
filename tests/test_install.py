"""The installable: graphkit-onnx's metadata and extras, its dependency floors, and the
checks of graphkit/runtime_check.py (one complete onnxruntime; no other `graphkit`).

The environments a check refuses are faked through importlib.metadata and the import
path (nothing is installed here); the real environment passes them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path, PurePosixPath

import pytest

import graphkit
from graphkit import runtime_check
from graphkit.engine import ort_engine
from graphkit.runtime_check import (
    OnnxruntimeInstallError,
    OnnxruntimeNotInstalledError,
    check_namesake,
    check_onnxruntime,
)

ROOT = Path(__file__).resolve().parents[1]


class FakeDistribution:
    """What runtime_check reads of an installed distribution."""

    def __init__(
        self, name: str, version: str, top_level: str | None = "onnxruntime", files=()
    ) -> None:
        self.metadata = {"Name": name}
        self.version = version
        self._top_level = top_level
        self.files = [PurePosixPath(f) for f in files]

    def read_text(self, filename: str) -> str | None:
        return self._top_level if filename == "top_level.txt" else None


def fake_environment(monkeypatch, tmp_path, dists, package: str | None) -> None:
    """``dists`` installed; ``import onnxruntime`` finding ``package``: "complete" (a
    folder with an __init__.py), "folder" (without one), or None (nothing)."""
    others = [FakeDistribution("numpy", "2.0.0", "numpy"), FakeDistribution("onnx", "1.23.0")]
    others[1]._top_level = "onnx"
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: [*others, *dists])
    monkeypatch.delitem(sys.modules, "onnxruntime", raising=False)
    if package is None:
        real = importlib.util.find_spec
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a: None if name == "onnxruntime" else real(name, *a),
        )
        return
    # a regular package anywhere on the path wins over a namespace folder, so the real
    # one is hidden: only the fake folder's parent is searched for onnxruntime
    folder = tmp_path / "site" / "onnxruntime"
    folder.mkdir(parents=True)
    (folder / "capi").mkdir()
    if package == "complete":
        (folder / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    importlib.invalidate_caches()


def test_the_environment_has_one_complete_onnxruntime():
    """The real environment passes, and the distribution named is the one imported."""
    name = check_onnxruntime()
    assert name in {"onnxruntime", "onnxruntime-training-cpu", "onnxruntime-gpu"}
    assert importlib.metadata.version(name) == ort_engine.onnxruntime().__version__
    assert [runtime_check._name(d) for d in runtime_check.onnxruntime_distributions()] == [name]


def test_no_onnxruntime_names_the_extras(monkeypatch, tmp_path):
    fake_environment(monkeypatch, tmp_path, [], None)
    with pytest.raises(OnnxruntimeNotInstalledError) as caught:
        check_onnxruntime()
    message = str(caught.value)
    for extra in ("cpu", "gpu", "ort-training"):
        assert f'pip install "graphkit-onnx[{extra}]"' in message
    # an ImportError: the backends then read as not installed, and say what to install
    assert isinstance(caught.value, ImportError)
    with pytest.raises(OnnxruntimeNotInstalledError):
        ort_engine.onnxruntime.__wrapped__()  # the engine checks before importing


@pytest.mark.parametrize(
    "installed, extra",
    [
        ({"onnxruntime": "1.20.0", "onnxruntime-gpu": "1.31.1"}, "gpu"),
        (
            {"onnxruntime": "1.32.0", "onnxruntime-training-cpu": "1.19.2"},
            "ort-training" if sys.version_info < (3, 13) else "cpu",
        ),
        ({"onnxruntime": "1.32.0", "onnxruntime-openvino": "1.22.0"}, "cpu"),
    ],
)
def test_two_builds_are_named_with_their_versions_and_one_command(
    monkeypatch, tmp_path, installed, extra
):
    dists = [FakeDistribution(n, v) for n, v in installed.items()]
    fake_environment(monkeypatch, tmp_path, dists, "complete")
    with pytest.raises(OnnxruntimeInstallError) as caught:
        check_onnxruntime()
    message = str(caught.value)
    assert (
        "Several onnxruntime builds are installed: "
        + ", ".join(f"{n} {v}" for n, v in installed.items())
        in message
    )
    assert (
        f'pip uninstall -y {" ".join(installed)} && pip install "graphkit-onnx[{extra}]"' in message
    )
    # not an ImportError: a backend's installed() must not read it as "not installed"
    assert not isinstance(caught.value, ImportError)
    with pytest.raises(OnnxruntimeInstallError):
        ort_engine.onnxruntime.__wrapped__()


def test_a_folder_no_distribution_owns_says_to_reinstall(monkeypatch, tmp_path):
    """What an uninstall leaves: an onnxruntime folder that would import as an empty
    namespace package (graphkit then died with AttributeError)."""
    fake_environment(monkeypatch, tmp_path, [], "folder")
    with pytest.raises(OnnxruntimeInstallError) as caught:
        check_onnxruntime()
    message = str(caught.value)
    assert str(tmp_path / "site" / "onnxruntime") in message
    assert "belongs to no installed distribution" in message
    assert 'pip install "graphkit-onnx[cpu]"' in message


@pytest.mark.parametrize("package", ["folder", None])
def test_a_build_whose_files_are_gone_is_reinstalled_by_name(monkeypatch, tmp_path, package):
    dists = [FakeDistribution("onnxruntime-gpu", "1.31.1")]
    fake_environment(monkeypatch, tmp_path, dists, package)
    with pytest.raises(OnnxruntimeInstallError) as caught:
        check_onnxruntime()
    message = str(caught.value)
    assert message.startswith("onnxruntime-gpu 1.31.1 is installed, but its `onnxruntime`")
    assert ("has no __init__.py" if package else "package is gone") in message
    assert message.endswith("pip install --force-reinstall --no-deps onnxruntime-gpu==1.31.1")


def test_a_complete_build_passes_and_is_named(monkeypatch, tmp_path):
    fake_environment(monkeypatch, tmp_path, [FakeDistribution("onnxruntime", "1.20.0")], "complete")
    assert check_onnxruntime() == "onnxruntime"


def test_distributions_are_found_by_top_level_or_files_and_counted_once(monkeypatch, tmp_path):
    """A distribution without top_level.txt is read by its files; the same name found
    twice on sys.path (a user site and a venv) is one distribution, not a conflict."""
    dists = [
        FakeDistribution("ort_nightly", "1.21.0.dev1", None, ["onnxruntime/__init__.py"]),
        FakeDistribution("onnxruntime-tools", "1.7.0", None, ["onnxruntime_tools/a.py"]),
        FakeDistribution("ORT-Nightly", "1.20.0.dev9", None, ["onnxruntime/__init__.py"]),
    ]
    fake_environment(monkeypatch, tmp_path, dists, "complete")
    found = runtime_check.onnxruntime_distributions()
    assert [(runtime_check._name(d), d.version) for d in found] == [("ort-nightly", "1.21.0.dev1")]
    assert check_onnxruntime() == "ort-nightly"


def test_the_other_graphkit_beside_this_one_is_refused(monkeypatch, tmp_path):
    """PyPI's `graphkit` (1.2.4, 2018) installs the import package `graphkit` too: its
    modules in graphkit-onnx's folder are named, with the repair."""
    assert check_namesake(graphkit.__path__[0]) is None  # this one is clean
    (tmp_path / "__init__.py").write_text("")
    for module in ("base.py", "functional.py", "network.py"):
        (tmp_path / module).write_text("")
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "1.2.4" if name == "graphkit" else None
    )
    with pytest.raises(ImportError) as caught:
        check_namesake(str(tmp_path))
    message = str(caught.value)
    assert "another library, graphkit 1.2.4 (base.py, functional.py, network.py)" in message
    assert message.endswith(
        'pip uninstall -y graphkit graphkit-onnx && pip install "graphkit-onnx[cpu]"'
    )


def test_an_init_the_other_graphkit_took_along_is_reinstalled(tmp_path):
    """`pip uninstall graphkit` (the other project) deletes the `graphkit/__init__.py`
    the two shared: the rest of graphkit-onnx's folder then imports as an empty
    namespace package, which its modules refuse, naming the reinstall."""
    (tmp_path / "losses.py").write_text("")
    with pytest.raises(ImportError, match="has no __init__.py: uninstalling the PyPI"):
        check_namesake(str(tmp_path))
    with pytest.raises(ImportError, match="pip install --force-reinstall --no-deps graphkit-onnx$"):
        check_namesake(str(tmp_path))


# -- the distribution ----------------------------------------------------------------


def _requirement(text: str) -> tuple[str, str, str]:
    """``"onnx>=1.23"`` -> ``("onnx", ">=", "1.23")`` (no marker, one clause)."""
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(==|>=)\s*([0-9][0-9.]*)", text)
    assert match, f"{text!r}: a floor (>=) or a pin (==) of one release, no marker"
    return match.groups()  # type: ignore[return-value]


def _release(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


def test_the_floors_file_holds_the_declared_floors():
    """.ci/floors.txt (what `make test-floors` installs) pins each dependency, and the
    `cpu` extra's onnxruntime, to the lowest release pyproject.toml allows."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {
        name: version
        for name, _, version in map(
            _requirement, project["dependencies"] + project["optional-dependencies"]["cpu"]
        )
    }
    lines = (ROOT / ".ci" / "floors.txt").read_text().splitlines()
    pins = {}
    for line in lines:
        if line.strip() and not line.startswith("#"):
            name, operator, version = _requirement(line)
            assert operator == "==", line
            pins[name] = version
    assert pins.keys() == declared.keys()
    assert {n: _release(v) for n, v in pins.items()} == {
        n: _release(v) for n, v in declared.items()
    }


def test_the_metadata_names_graphkit_onnx_and_a_runtime_per_extra():
    metadata = importlib.metadata.metadata("graphkit-onnx")
    assert metadata["Name"] == "graphkit-onnx"
    assert metadata["License-Expression"] == "MIT"
    assert set(metadata.get_all("Provides-Extra")) >= {"cpu", "gpu", "ort-training", "dev"}
    assert "torch" not in metadata.get_all("Provides-Extra")  # it would pull CUDA wheels
    requires = importlib.metadata.requires("graphkit-onnx") or []
    base = [r for r in requires if "extra ==" not in r]
    assert not [r for r in base if r.startswith("onnxruntime")]
    runtimes = {
        extra: [r.split(";")[0].strip() for r in requires if f'extra == "{extra}"' in r]
        for extra in ("cpu", "gpu", "ort-training")
    }
    assert runtimes == {
        "cpu": ["onnxruntime>=1.20"],
        "gpu": ["onnxruntime-gpu>=1.20"],
        "ort-training": ["onnxruntime-training-cpu==1.19.2"],
    }
    scripts = importlib.metadata.distribution("graphkit-onnx").entry_points
    assert {e.name: e.value for e in scripts if e.group == "console_scripts"} == {
        "graphkit-train": "graphkit_train.cli:main"
    }


def test_both_packages_say_they_are_typed():
    tomllib = pytest.importorskip("tomllib")
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]
    for package in ("graphkit", "graphkit_train"):
        assert (ROOT / package / "py.typed").is_file()
        assert "py.typed" in package_data[package]
