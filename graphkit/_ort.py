"""Importing onnxruntime, and inference sessions with its public API.

onnxruntime is imported lazily: building graphs needs only ``onnx`` and ``onnxscript``.
The training pieces (gradient builders, the TrainingAgent) go through
:mod:`graphkit.backend`, which uses the C bindings directly: ``onnxruntime.training``
would import torch.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from graphkit.errors import IncompatibleModelError
from graphkit.lowering import lower_slow_cpu_ops

CPU = ("CPUExecutionProvider",)
_NO_KERNEL = re.compile(
    r"Could not find an implementation for (\w+)\(\d+\) node with name '([^']*)'"
)


@functools.cache
def onnxruntime() -> Any:
    """Import onnxruntime once, quietly, and without importing torch.

    The training wheel's ``import onnxruntime`` probes for ORTModule, which imports torch
    (about 2 s and 200 MB) whenever torch is installed. The probe treats an ImportError as
    "no ORTModule", so while torch is not loaded yet, ``onnxruntime.training`` is masked
    for the duration of the import; it imports normally afterwards. graphkit uses only
    the C bindings, which do not need torch.
    """
    masked = "torch" not in sys.modules and "onnxruntime" not in sys.modules
    if masked:
        sys.modules["onnxruntime.training"] = None  # type: ignore[assignment]
    try:
        import onnxruntime as ort
    except ImportError as exc:  # pragma: no cover - the dependency is declared
        raise ImportError(
            "graphkit needs the training build of onnxruntime: "
            "pip install onnxruntime-training-cpu==1.19.2 "
            "(or onnxruntime-training==1.19.2 for CUDA)."
        ) from exc
    finally:
        if masked and sys.modules.get("onnxruntime.training", 0) is None:
            del sys.modules["onnxruntime.training"]
    # the training build logs every graph transform, and load failures in red C++ text;
    # graphkit turns every failure into an exception, so only fatal messages are shown
    ort.set_default_logger_severity(4)
    return ort


EXECUTION_MODES = ("sequential", "parallel")


@dataclass(frozen=True)
class Threads:
    """How onnxruntime runs a trainer's sessions (its ``SessionOptions``).

    ``intra_op``: threads per kernel (None: onnxruntime's default, one per core);
    ``mode``: ``"sequential"`` runs one node at a time, ``"parallel"`` runs independent
    nodes at once on an inter-op pool; ``spinning``: whether idle pool threads spin
    (lower latency, but sessions that spin at once fight over the cores).
    """

    intra_op: int | None = None
    mode: str = "sequential"
    spinning: bool = True

    @classmethod
    def checked(cls, intra_op: Any, mode: Any) -> Threads:
        if intra_op is not None and (
            isinstance(intra_op, bool) or not isinstance(intra_op, int) or intra_op < 1
        ):
            raise ValueError(f"intra_op_num_threads must be None or an int >= 1, got {intra_op!r}.")
        if mode not in EXECUTION_MODES:
            raise ValueError(f"execution_mode must be one of {EXECUTION_MODES}, got {mode!r}.")
        return cls(intra_op, mode)

    def once_per_epoch(self) -> Threads:
        """The settings of a session that runs once per epoch (the last, shorter batch):
        its idle threads do not spin, or they would take cores from the next epoch's
        first runs of the main session (a forward/backward epoch of the MLP 100-256-256-1
        at batch 256: 1022 -> 906 us a batch)."""
        return Threads(self.intra_op, self.mode, spinning=False)


def session_options(threads: Threads | None = None) -> Any:
    ort = onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    if threads is not None:
        if threads.intra_op is not None:
            options.intra_op_num_threads = threads.intra_op
        if threads.mode == "parallel":
            options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        if not threads.spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def inference_session(
    model: onnx.ModelProto | bytes, providers: Sequence[str] = CPU, threads: Threads | None = None
) -> Any:
    """An InferenceSession on ``model``; a load failure becomes ``IncompatibleModelError``.

    On the CPU, a ModelProto runs with the gradient operators whose CPU kernels are slow
    lowered (:func:`graphkit.lowering.lower_slow_cpu_ops`); serialized bytes run as they
    are.
    """
    if isinstance(model, onnx.ModelProto) and tuple(providers) == CPU:
        model = lower_slow_cpu_ops(model)
    data = model if isinstance(model, bytes) else model.SerializeToString()
    ort = onnxruntime()
    try:
        return ort.InferenceSession(data, session_options(threads), providers=list(providers))
    except Exception as exc:  # onnxruntime raises its own Fail / InvalidGraph types
        missing = _NO_KERNEL.search(str(exc))
        if missing:
            raise IncompatibleModelError(
                f"onnxruntime-training 1.19.2 has no kernel for operator {missing.group(1)!r} "
                f"(node {missing.group(2)!r}) with these element types. Several gradient "
                "operators (LogSoftmaxGrad, SoftmaxGrad...) exist for float32 only: train in "
                "float32, or avoid this operator."
            ) from exc
        raise IncompatibleModelError(
            f"onnxruntime-training 1.19.2 cannot load this model: {_short(exc)}"
        ) from exc


class Runner:
    """A model compiled once into an InferenceSession, called with numpy arrays."""

    def __init__(self, model: onnx.ModelProto | bytes, providers: Sequence[str] = CPU) -> None:
        self.session = inference_session(model, providers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return self.session.run(None, dict(feeds))
        except Exception as exc:
            raise RuntimeError(f"onnxruntime failed to run the graph: {_short(exc)}") from exc


def _short(exc: BaseException) -> str:
    """The useful part of an onnxruntime message (drops the C++ source location)."""
    text = str(exc).strip()
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"/onnxruntime_src/\S+ [^\n]*? (?=\S+ was false\.)", "", text)
    return text.splitlines()[0] if text else type(exc).__name__


def run(model: Any, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Run ``model`` once on CPU with numpy ``feeds``; return ``{output name: array}``.

    ``model`` is a ModelProto, its bytes or a path; it goes through the same
    compatibility policy as training (:func:`graphkit.compat.make_compatible`). A
    convenience for notebooks and tests (it builds a session on every call): the
    training runtime keeps its sessions bound instead.
    """
    from graphkit.compat import load_model, make_compatible

    runner = Runner(make_compatible(load_model(model)))
    unknown = sorted(set(feeds) - set(runner.input_names))
    missing = sorted(set(runner.input_names) - set(feeds))
    if unknown or missing:
        raise ValueError(
            f"Feeds do not match the graph inputs {runner.input_names}: "
            f"missing {missing}, unknown {unknown}."
        )
    arrays = {k: np.asarray(v) for k, v in feeds.items()}
    return dict(zip(runner.output_names, runner(arrays)))
