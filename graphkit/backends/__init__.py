"""Backends: where gradients come from and what runs the graphs.

A backend is a package implementing the two protocols of :mod:`graphkit.backends.base`
(a gradient source and an engine), registered here by name and imported only when
chosen::

    from graphkit import backends
    backends.available()           # [BackendInfo(name='native', installed=True, ...), ...]
    backend = backends.get()       # the default: the first installed backend
    backend = backends.get("ort_training")

Every entry point that builds or runs gradients (the trainers, ``gradient_model``,
``OnnxModule``) takes ``backend=`` (a name, or None for the default) and resolves it
here. Adding a backend is one sub-package and one :func:`register` call below.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

from graphkit import runtime_check
from graphkit.backends.base import Backend, BackendInfo
from graphkit.compat import MAX_IR_VERSION, MAX_OPSET
from graphkit.errors import BackendNotInstalledError, UnknownNameError


@dataclass(frozen=True)
class _Entry:
    module: str  # the backend's package, imported when chosen
    installed: Callable[[], bool]
    install: str
    description: str
    max_ir_version: int = 10  # the newest ONNX IR version every runtime it supports loads
    max_opset: int = 21  # the newest ai.onnx opset every runtime it supports implements


_BACKENDS: dict[str, _Entry] = {}

ENVIRONMENT_VARIABLE = "GRAPHKIT_BACKEND"
"""Names the default backend (``backend=None`` everywhere) when set."""


def register(
    name: str,
    module: str,
    installed: Callable[[], bool],
    install: str,
    description: str,
    max_ir_version: int,
    max_opset: int,
) -> None:
    """Register the backend ``name``, implemented by the package ``module`` (which
    defines ``BACKEND``); ``installed()`` says whether its runtime is importable, and
    ``max_ir_version`` / ``max_opset`` are the newest ONNX IR version and ``ai.onnx``
    opset every runtime it supports loads: at least what every backend loads
    (:data:`graphkit.compat.PORTABLE`), which graphkit's own graphs are written at. The
    backend's ``ceiling`` may be newer where its installed runtime is."""
    if name in _BACKENDS:
        raise ValueError(f"backend {name!r} is already registered")
    if (max_ir_version, max_opset) < (MAX_IR_VERSION, MAX_OPSET) or max_opset < MAX_OPSET:
        raise ValueError(
            f"backend {name!r} loads IR version {max_ir_version} and opset {max_opset}, but "
            f"graphkit writes IR version {MAX_IR_VERSION} and opset {MAX_OPSET} "
            "(graphkit.compat): it could not run graphkit's graphs."
        )
    _BACKENDS[name] = _Entry(module, installed, install, description, max_ir_version, max_opset)


def names() -> list[str]:
    """The registered backends, in order of preference for the default."""
    return list(_BACKENDS)


def available() -> list[BackendInfo]:
    """Every registered backend, whether it is installed, and how to install it."""
    return [
        BackendInfo(name, entry.installed(), entry.install, entry.description)
        for name, entry in _BACKENDS.items()
    ]


def canonical(name: str | None) -> str:
    """The registered name ``name`` means (case and ``-``/``_`` ignored); None is the
    default backend: the one the environment variable ``GRAPHKIT_BACKEND`` names, else
    the first registered one that is installed."""
    if name is None and os.environ.get(ENVIRONMENT_VARIABLE):
        name = os.environ[ENVIRONMENT_VARIABLE]
    if name is None:
        for candidate, entry in _BACKENDS.items():
            if entry.installed():
                return candidate
        raise BackendNotInstalledError(
            "No graphkit backend is installed. Install one of: "
            + "; ".join(f"{n}: {e.install}" for n, e in _BACKENDS.items())
            + "."
        )
    if not isinstance(name, str):
        raise TypeError(f"backend must be a name {names()} or None, not {name!r}.")
    key = name.lower().replace("-", "_")
    if key not in _BACKENDS:
        raise UnknownNameError(f"Unknown backend {name!r}. Valid names: {names()}.")
    return key


def get(name: str | Backend | None = None) -> Backend:
    """The backend ``name`` (None: the default), imported on first use; a backend
    object is returned as it is (an entry point resolves a name once and passes the
    object down).

    Raises:
        UnknownNameError: no backend has that name.
        BackendNotInstalledError: its runtime is not installed (the message says what
            to install).
    """
    if name is not None and not isinstance(name, str):
        if isinstance(name, Backend):
            return name
        raise TypeError(f"backend must be a name {names()}, a backend or None, not {name!r}.")
    key = canonical(name)
    entry = _BACKENDS[key]
    if not entry.installed():
        raise BackendNotInstalledError(f"The {key!r} backend is not installed: {entry.install}.")
    return importlib.import_module(entry.module).BACKEND


# The order is the order of preference for the default: native first, on every Python
# and build (standard ONNX, plain onnxruntime, CPU and CUDA); onnxruntime-training where it
# is installed and asked for (backend="ort_training" or GRAPHKIT_BACKEND), which keeps
# cross-checking it.


# whether a backend's runtime is installed is answered from what Python would import
# (importlib.util.find_spec) and the installed distributions, without importing the
# backend's package (nor onnxruntime, which takes a second)


def _native_installed() -> bool:
    """onnx-ad and an onnxruntime build can be imported."""
    return all(importlib.util.find_spec(name) is not None for name in ("onnx_ad", "onnxruntime"))


register(
    "native",
    "graphkit.backends.native",
    _native_installed,
    install="pip install 'graphkit-onnx[cpu]' (CUDA: 'graphkit-onnx[gpu]'): onnx-ad==0.3.0 "
    "and an onnxruntime",
    description="standard-ONNX gradients (onnx-ad rules), run by plain onnxruntime",
    # every onnxruntime it runs on loads opset 21 (its ceiling, Backend.ceiling, is what
    # the installed onnxruntime loads: opset 28 on 1.32)
    max_ir_version=10,
    max_opset=21,
)


def _ort_training_installed() -> bool:
    """The onnxruntime that would be imported is onnxruntime-training's."""
    if importlib.util.find_spec("onnxruntime") is None:
        return False
    names = [d.metadata["Name"] or "" for d in runtime_check.onnxruntime_distributions()]
    return any(name.lower().startswith("onnxruntime-training") for name in names)


register(
    "ort_training",
    "graphkit.backends.ort_training",
    _ort_training_installed,
    install="pip install 'graphkit-onnx[ort-training]' (onnxruntime-training-cpu 1.19.2, "
    "CPython 3.10-3.12)",
    description="gradients from onnxruntime-training 1.19.2's builders, run by its TrainingAgent",
    max_ir_version=10,
    max_opset=21,
)


__all__ = ["Backend", "BackendInfo", "available", "canonical", "get", "names", "register"]
