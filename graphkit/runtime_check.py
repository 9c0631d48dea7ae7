"""Whether the environment holds one complete onnxruntime, checked before importing it.

onnxruntime comes in several distributions that all install the same import package,
``onnxruntime``: ``onnxruntime`` (CPU), ``onnxruntime-gpu``, ``onnxruntime-training``,
``onnxruntime-training-cpu``, ``onnxruntime-directml``, ``onnxruntime-openvino``... pip
does not know that they collide: two of them installed write over each other's files,
and uninstalling one deletes files the other needs, which leaves an ``onnxruntime``
folder that imports as an empty namespace package (graphkit then failed far from the
cause, with ``AttributeError: module 'onnxruntime' has no attribute ...``).
graphkit-onnx therefore depends on no onnxruntime by itself: its extras name one
(:data:`EXTRAS`), and :func:`check_onnxruntime` reads the installed distributions'
metadata, without importing onnxruntime, before graphkit first does.

The PyPI project ``graphkit`` (1.2.4, 2018, another library) installs the same import
package as graphkit-onnx, ``graphkit``: :func:`check_namesake` recognizes its modules
beside graphkit's own, at this module's import.

This module imports only the standard library, nothing of graphkit's: it is the lowest
layer, imported by ``graphkit/__init__.py`` and by :mod:`graphkit.engine.ort_engine`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterable

PACKAGE = "onnxruntime"
DISTRIBUTION = "graphkit-onnx"
EXTRAS = {
    "cpu": "onnxruntime, CPU, every Python",
    "gpu": "onnxruntime-gpu, CUDA 12",
    "ort-training": "onnxruntime-training-cpu 1.19.2, CPython 3.10-3.12: both backends",
}
"""graphkit-onnx's extras, each installing one onnxruntime build (pyproject.toml)."""
# distributions that may install `onnxruntime` without saying so in a top_level.txt (every
# wheel of them has one today; a wheel built without setuptools may not)
_PREFIXES = ("onnxruntime", "ort-nightly")
# the modules of the PyPI project `graphkit` (1.2.4), none of which graphkit-onnx may name
# its own (tests/test_install.py checks graphkit's folder passes)
_NAMESAKE_MODULES = ("base.py", "functional.py", "modifiers.py", "network.py")


class OnnxruntimeNotInstalledError(ImportError):
    """No onnxruntime is installed; the message names the extras that install one."""


class OnnxruntimeInstallError(RuntimeError):
    """Several onnxruntime builds are installed, or one whose files are gone; the message
    says the command that repairs the environment.

    Not an ``ImportError``: a backend's ``installed()`` answers False to an ImportError,
    and this error must reach the user rather than read as "no backend installed".
    """


def install_hint() -> str:
    """The commands that install graphkit-onnx with an onnxruntime, for messages."""
    return "; ".join(
        f'pip install "{DISTRIBUTION}[{extra}]" ({what})' for extra, what in EXTRAS.items()
    )


def onnxruntime_distributions() -> list[importlib.metadata.Distribution]:
    """The installed distributions that provide the import package ``onnxruntime``
    (one per name: the first on ``sys.path``, as ``importlib.metadata`` finds it).

    Reads each distribution's ``top_level.txt`` (30 ms for 110 distributions, where
    ``importlib.metadata.packages_distributions`` reads every RECORD: 0.9 s), and the
    file list of an ``onnxruntime*`` distribution without one.
    """
    found: dict[str, importlib.metadata.Distribution] = {}
    for dist in importlib.metadata.distributions():
        top_level = dist.read_text("top_level.txt")
        if top_level is not None:
            provides = PACKAGE in top_level.split()
        else:
            name = _normalized(dist.metadata["Name"] or "")
            provides = name.startswith(_PREFIXES) and any(
                f.parts[:1] == (PACKAGE,) for f in dist.files or ()
            )
        if provides:
            found.setdefault(_normalized(dist.metadata["Name"] or ""), dist)
    return list(found.values())


def check_onnxruntime() -> str:
    """The name of the one distribution that provides ``onnxruntime``, e.g.
    ``"onnxruntime-training-cpu"``, checked without importing it.

    Raises:
        OnnxruntimeNotInstalledError: none is installed.
        OnnxruntimeInstallError: two or more are (they overwrite each other's files);
            or an ``onnxruntime`` folder no distribution owns, or a distribution whose
            package is gone or incomplete (what uninstalling one of two leaves behind).
            Each message lists what is installed and the command that repairs it.
    """
    dists = onnxruntime_distributions()
    location = _package_location()
    named = ", ".join(f"{_name(d)} {d.version}" for d in dists)
    if len(dists) > 1:
        extra = _extra_for(_name(d) for d in dists)
        raise OnnxruntimeInstallError(
            f"Several onnxruntime builds are installed: {named}. They install the same "
            "package, `onnxruntime`, over each other's files, so whichever was installed "
            "last is partly overwritten, and uninstalling one breaks the other. Keep "
            f"one: pip uninstall -y {' '.join(_name(d) for d in dists)} && "
            f'pip install "{DISTRIBUTION}[{extra}]" (the extras: {_extras()}).'
        )
    if not dists:
        if location is None:
            raise OnnxruntimeNotInstalledError(
                "graphkit needs onnxruntime, and none is installed. Install graphkit-onnx "
                f"with one: {install_hint()}."
            )
        raise OnnxruntimeInstallError(
            f"The onnxruntime package at {location} belongs to no installed distribution: "
            "an uninstall left it behind (pip removes the files of the build it "
            "uninstalls, which another build had written too). Install a complete one "
            f'in its place: pip install "{DISTRIBUTION}[cpu]" (the extras: {_extras()}).'
        )
    (dist,) = dists
    if location is None or not location.endswith("__init__.py"):
        where = "is gone" if location is None else f"at {location} has no __init__.py"
        raise OnnxruntimeInstallError(
            f"{named} is installed, but its `onnxruntime` package {where}: uninstalling "
            "another onnxruntime build removed the files they shared. Reinstall it: "
            f"pip install --force-reinstall --no-deps {_name(dist)}=={dist.version}"
        )
    return _name(dist)


def check_namesake(package_dir: str) -> None:
    """Raises ImportError when the PyPI project ``graphkit`` (another library, which
    installs the same import package) has written its modules into ``package_dir``,
    graphkit-onnx's ``graphkit`` folder, or when uninstalling it took graphkit-onnx's
    ``__init__.py`` along. A few stats: called at every import.

    Its files and graphkit-onnx's share the folder and ``__init__.py``, so neither
    library is intact, and uninstalling the other deletes graphkit-onnx's
    ``__init__.py``: the repair uninstalls both and installs graphkit-onnx again.
    """
    found = [m for m in _NAMESAKE_MODULES if os.path.exists(os.path.join(package_dir, m))]
    if not found:
        if not os.path.exists(os.path.join(package_dir, "__init__.py")):
            # `graphkit` then imports as an empty namespace package
            raise ImportError(
                f"{package_dir} has no __init__.py: uninstalling the PyPI project "
                "`graphkit` (another library, which installs the same import package) "
                "deleted graphkit-onnx's. Reinstall graphkit-onnx: pip install "
                f"--force-reinstall --no-deps {DISTRIBUTION}"
            )
        return
    try:
        other = f"graphkit {importlib.metadata.version('graphkit')}"
    except importlib.metadata.PackageNotFoundError:
        other = "the PyPI project `graphkit`"
    raise ImportError(
        f"{package_dir} holds modules of another library, {other} ({', '.join(found)}): "
        "it is not graphkit-onnx, but installs the same import package, `graphkit`, so "
        "the two overwrite each other's files. Remove both and install graphkit-onnx "
        f'again: pip uninstall -y graphkit {DISTRIBUTION} && pip install "{DISTRIBUTION}[cpu]"'
    )


def _package_location() -> str | None:
    """Where ``import onnxruntime`` would load from: its ``__init__.py``, a folder (a
    namespace package: no ``__init__.py``), or None where nothing would load."""
    module = sys.modules.get(PACKAGE)
    spec = getattr(module, "__spec__", None) if module is not None else None
    if spec is None:
        try:
            spec = importlib.util.find_spec(PACKAGE)
        except (ImportError, ValueError):  # a None or spec-less entry in sys.modules
            return None
    if spec is None:
        return None
    if spec.origin:  # a module or a regular package (a namespace package has none)
        return spec.origin
    return next(iter(spec.submodule_search_locations or ()), None)


def _extras() -> str:
    return "; ".join(f"[{extra}] {what}" for extra, what in EXTRAS.items())


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _name(dist: importlib.metadata.Distribution) -> str:
    return _normalized(dist.metadata["Name"] or "")


def _extra_for(names: Iterable[str]) -> str:
    """The extra that reinstalls the build the user most likely wants among ``names``:
    a GPU build is installed on purpose; the training build next, where it has wheels."""
    names = set(names)
    if any("gpu" in n or n == "onnxruntime-training" for n in names):
        return "gpu"
    if any("training" in n for n in names) and sys.version_info < (3, 13):
        return "ort-training"
    return "cpu"


# Here, at this module's import, and not only from graphkit/__init__.py: installed after
# graphkit-onnx, the other project's `graphkit/__init__.py` replaces graphkit's own, which
# then never runs; this module still loads with the engine (graphkit.engine.ort_engine)
# before anything trains.
check_namesake(os.path.dirname(os.path.abspath(__file__)))
