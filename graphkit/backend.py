"""Everything graphkit asks of onnxruntime-training 1.19.2, in one place.

graphkit takes its gradients from onnxruntime-training and runs them with it. This
module is the seam: the two gradient builders, the TrainingAgent that runs a forward and
its backward as two calls, devices, the OrtValue plumbing the agent needs, and the
translation of their failures into graphkit errors. The rest of graphkit calls these
functions and never ``onnxruntime.capi``; another gradient source or runtime is one
more file with the same functions.

* :func:`gradient_graph`: ``GradientGraphBuilder``, a loss's gradient with respect to
  weights and inputs, as one graph (full training).
* :func:`module_graphs`: ``OrtModuleGraphBuilder``, a forward graph and a backward graph
  (forward/backward training, the PyTorch layer).
* :func:`training_agent`, :func:`run_forward`, :func:`run_backward`,
  :func:`train_batch`: the TrainingAgent.
* :func:`providers_for`, :func:`ort_device`, :func:`ortvalue`, :func:`from_dlpack`,
  :func:`wrap`: devices and values.
* :func:`explain_builder_failure`, :func:`short_message`: errors.

Inference sessions (``InferenceSession``, IOBinding) use onnxruntime's public API, which
every onnxruntime build shares; :mod:`graphkit._ort` creates them. ``tests/test_backend.py``
checks that no other module reaches ``onnxruntime.capi``.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from graphkit._ort import _short, onnxruntime
from graphkit.errors import MissingGradientError

NAME = "onnxruntime-training 1.19.2"

CUDA_HINT = (
    "device='cuda' needs the CUDA build of onnxruntime-training: "
    "pip uninstall -y onnxruntime-training-cpu && pip install onnxruntime-training==1.19.2 "
    "(Linux x86_64, CPython <= 3.11)."
)

_NO_BUILDER = re.compile(r"gradient builder has not been registered: (\S+) for node (\S*)")


def _capi() -> Any:
    return onnxruntime().capi._pybind_state


# -- errors --------------------------------------------------------------------------------


def short_message(exc: BaseException) -> str:
    """The useful part of an onnxruntime message (no C++ source location)."""
    return _short(exc)


def explain_builder_failure(exc: BaseException) -> MissingGradientError:
    """The error to raise when a gradient builder fails."""
    found = _NO_BUILDER.search(str(exc))
    if found:
        op_type, node = found.groups()
        return MissingGradientError(
            f"{NAME} has no gradient for operator {op_type!r} "
            f"(node {node!r}). Rewrite that part with differentiable operators "
            "(e.g. Softplus(x) as Log(1 + Exp(x)), Atan with a series or a lookup) or "
            "keep it off the path between the weights and the loss."
        )
    return MissingGradientError(f"Building the gradient graph failed: {_short(exc)}")


@contextlib.contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Silence the builders' C++ logging, which ignores onnxruntime's logger severity.

    Failures still surface: the builder raises a Python exception, which
    :func:`explain_builder_failure` rewrites.
    """
    fd = 2  # the C++ side writes to fd 2 even where sys.stderr is no file (notebooks)
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


# -- gradient graphs -------------------------------------------------------------------------


def gradient_graph(model: onnx.ModelProto, target: str, wrt: Sequence[str]) -> onnx.ModelProto:
    """``model`` extended with ``<name>_grad`` = d ``target`` / d ``name`` for ``wrt``
    (GradientGraphBuilder; ``target`` must be a float32 output).

    Raises:
        MissingGradientError: an operator on the path has no gradient.
    """
    builder_cls = _capi().GradientGraphBuilder
    try:
        with quiet_native_stderr(), tempfile.TemporaryDirectory() as folder:
            builder = builder_cls(model.SerializeToString(), {target}, set(wrt), target)
            builder.build()
            path = os.path.join(folder, "gradient.onnx")
            builder.save(path)
            return onnx.load(path)
    except RuntimeError as exc:
        raise explain_builder_failure(exc) from exc


@dataclass
class ModuleGraphs:
    """What ``OrtModuleGraphBuilder`` returns for one set of inputs needing gradients."""

    forward: onnx.ModelProto
    gradient: onnx.ModelProto
    user_output_names: list[str]
    user_input_grad_names: dict[str, str]
    """input name -> the name of its gradient"""
    initializer_names_to_train: list[str]
    initializer_grad_names_to_train: list[str]


def module_graphs(
    model: onnx.ModelProto, weights: Sequence[str], inputs_requiring_grad: Sequence[str]
) -> ModuleGraphs:
    """The forward graph and the gradient graph of ``model`` for the TrainingAgent.

    Raises:
        MissingGradientError: an operator on the path has no gradient.
    """
    C = _capi()
    config = C.OrtModuleGraphBuilderConfiguration()
    config.initializer_names = list(weights)
    config.initializer_names_to_train = list(weights)
    config.input_names_require_grad = list(inputs_requiring_grad)
    config.build_gradient_graph = True
    builder = C.OrtModuleGraphBuilder()
    try:
        with quiet_native_stderr():
            builder.initialize(model.SerializeToString(), config)
            builder.build(C.TrainingGraphTransformerConfiguration())
    except RuntimeError as exc:
        raise explain_builder_failure(exc) from exc
    info = builder.get_graph_info()
    return ModuleGraphs(
        forward=onnx.load_from_string(builder.get_forward_model()),
        gradient=onnx.load_from_string(builder.get_gradient_model()),
        user_output_names=list(info.user_output_names),
        user_input_grad_names=dict(info.user_input_grad_names),
        initializer_names_to_train=list(info.initializer_names_to_train),
        initializer_grad_names_to_train=list(info.initializer_grad_names_to_train),
    )


# -- the TrainingAgent ------------------------------------------------------------------------


def training_agent(
    session: Any,
    feed_names: Sequence[str],
    fetch_names: Sequence[str],
    n_outputs: int,
    device: Any,
) -> Any:
    """A TrainingAgent over an InferenceSession of a :class:`ModuleGraphs` gradient graph."""
    return _capi().TrainingAgent(
        session._sess,
        list(feed_names),
        [device] * n_outputs,
        list(fetch_names),
        [device] * len(fetch_names),
        0,
    )


def run_forward(agent: Any, feeds: Sequence[Any]) -> tuple[Any, Any, Any]:
    """``(fetches vector, execution state, feeds vector)``: the forward on C OrtValues.

    The state and the feeds vector must live until the matching backward.
    """
    C = _capi()
    vector = values_vector(feeds)
    fetches, state = C.OrtValueVector(), C.PartialGraphExecutionState()
    _forward(agent, vector, fetches, state)
    return fetches, state, vector


def run_backward(agent: Any, grad_outputs: Sequence[Any], state: Any) -> Any:
    """The fetches vector of the backward matching the forward that made ``state``."""
    fetches = _capi().OrtValueVector()
    _backward(agent, values_vector(grad_outputs), fetches, state)
    return fetches


def train_batch(
    agent: Any,
    arrays: Sequence[np.ndarray],
    device: Any,
    carried: Sequence[Any],
    grads: Any,
    new: Any,
) -> None:
    """A forward on ``arrays`` (C-contiguous, borrowed until the call returns) followed by
    the C OrtValues ``carried``, then its backward fed the C vector ``grads``, writing its
    outputs into ``new`` (a C vector of allocated OrtValues): a forward/backward training
    batch, with its lookups hoisted (it is the hot loop)."""
    C = _capi()
    from_numpy = C.OrtValue.ortvalue_from_numpy
    feeds = C.OrtValueVector()
    push = feeds.push_back
    for array in arrays:
        push(from_numpy(array, device))
    for value in carried:
        push(value)
    outputs, state = C.OrtValueVector(), C.PartialGraphExecutionState()  # live until backward
    _forward(agent, feeds, outputs, state)
    _backward(agent, grads, new, state)


def values_vector(values: Sequence[Any]) -> Any:
    """A C vector of C OrtValues (the TrainingAgent's argument type)."""
    vector = _capi().OrtValueVector()
    vector.reserve(len(values))
    for value in values:
        vector.push_back(value)
    return vector


def _forward(agent: Any, feeds: Any, fetches: Any, state: Any) -> None:
    try:
        agent.run_forward(feeds, fetches, state, _capi().OrtValueCache())
    except Exception as exc:
        raise RuntimeError(f"forward failed in onnxruntime: {_short(exc)}") from exc


def _backward(agent: Any, grads: Any, fetches: Any, state: Any) -> None:
    try:
        agent.run_backward(grads, fetches, state)
    except Exception as exc:
        raise RuntimeError(f"backward failed in onnxruntime: {_short(exc)}") from exc


# -- devices and values -------------------------------------------------------------------------


def providers_for(device: str) -> tuple[list[str], str, int]:
    """``(providers, ort device name, device id)`` for ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""
    if not isinstance(device, str):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {device!r}.")
    if device == "cpu":
        return ["CPUExecutionProvider"], "cpu", 0
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if "CUDAExecutionProvider" not in onnxruntime().get_available_providers():
            raise RuntimeError(CUDA_HINT)
        index = int(device[5:]) if ":" in device else 0
        return ["CUDAExecutionProvider", "CPUExecutionProvider"], "cuda", index
    raise ValueError(f"Unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'.")


def ort_device(kind: str, device_id: int) -> Any:
    """The C OrtDevice for ``"cpu"`` or ``"cuda"``."""
    C = _capi()
    which = C.OrtDevice.cuda() if kind == "cuda" else C.OrtDevice.cpu()
    return C.OrtDevice(which, C.OrtDevice.default_memory(), device_id)


def ortvalue(array: np.ndarray, kind: str = "cpu", device_id: int = 0) -> Any:
    """An ``onnxruntime.OrtValue`` holding ``array`` on the device."""
    if not array.flags.c_contiguous:  # (np.ascontiguousarray would make a 0-d array 1-d)
        array = np.ascontiguousarray(array)
    return onnxruntime().OrtValue.ortvalue_from_numpy(array, kind, device_id)


def c_ortvalue(array: np.ndarray, device: Any) -> Any:
    """A C OrtValue holding ``array`` (C-contiguous) on ``device`` (a C OrtDevice, see
    :func:`ort_device`). On the CPU it borrows the array's memory: the caller keeps the
    array alive while the value is used. (The Python wrapper costs 2 us more a call.)"""
    return _capi().OrtValue.ortvalue_from_numpy(array, device)


def python_ortvalue(c_value: Any) -> Any:
    """The ``onnxruntime.OrtValue`` wrapping a C OrtValue (from :func:`from_dlpack`)."""
    return onnxruntime().OrtValue(c_value)


def is_ortvalue(value: Any) -> bool:
    return isinstance(value, onnxruntime().OrtValue)


def from_dlpack(capsule: Any, is_bool: bool) -> Any:
    """A C OrtValue sharing the memory of a DLPack capsule (no copy)."""
    return _capi().OrtValue.from_dlpack(capsule, is_bool)


def wrap(vector: Any) -> list[Any]:
    """Python OrtValues for the elements of a C OrtValueVector.

    Indexing the vector returns references into it: each wrapper keeps the vector alive,
    or the values would point to freed memory once the vector is collected. (Indexing is
    also what makes this fast: onnxruntime's ``IOBinding.get_outputs()`` iterates the
    vector, which ends in a C++ exception and costs about 35 us per call.)
    """
    ort = onnxruntime()
    values = []
    for i in range(len(vector)):
        value = ort.OrtValue(vector[i])
        value._graphkit_owner = vector
        values.append(value)
    return values


def binding_outputs(binding: Any) -> list[Any]:
    """The outputs of an ``IOBinding`` after a run, read by index (see :func:`wrap`)."""
    return wrap(binding._iobinding.get_outputs())
