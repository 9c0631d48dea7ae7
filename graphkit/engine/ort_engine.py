"""The engine: onnxruntime sessions, values on a device, bindings and DLPack.

Everything here is the API that every onnxruntime build shares (the plain CPU and GPU
wheels and the training build): ``InferenceSession``, ``IOBinding``, ``OrtValue``, and
the few C-binding fast paths the hot loops need (binding a C OrtValue, a C OrtValue
borrowing a numpy array). Gradient sources live in their own packages
(:mod:`graphkit.backends.ort_training`); this module knows none of them.

onnxruntime is imported lazily: building graphs needs only ``onnx`` and ``onnxscript``.

onnxruntime logs to stderr from C++: graphkit keeps its errors only (severity 3), so that
a gradient build does not print the training build's ``GraphTransformer ... modified``
INFO lines, nor a session its warnings about initializers graphkit's graphs leave unused.
Every failure graphkit reports comes as an exception carrying onnxruntime's own message.
``GRAPHKIT_ORT_LOG_SEVERITY`` (0 verbose, 1 info, 2 warning, 3 error, 4 fatal, or those
names) or :func:`set_log_severity` turns it back up.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from graphkit import runtime_check, tensor_store
from graphkit._graph import all_graphs
from graphkit.compat import MAX_IR_VERSION, MAX_OPSET, NEWEST, Ceiling, ir_version_for
from graphkit.engine.cuda_splits import split_long_axes_as_slices
from graphkit.engine.cuda_unpools import max_unpools_as_scatters
from graphkit.errors import IncompatibleModelError

CPU = ("CPUExecutionProvider",)
# an onnxruntime provider: its name, or (name, options) as InferenceSession takes it
Provider = str | tuple[str, dict[str, str]]

CUDA_HINT = (
    "device='cuda' needs a CUDA build of onnxruntime and a GPU it can see: for the native "
    "backend, onnxruntime-gpu: pip uninstall -y onnxruntime onnxruntime-training-cpu && "
    "pip install 'graphkit-onnx[gpu]' (its CUDA libraries: pip install "
    "'onnxruntime-gpu[cuda,cudnn]'); for "
    "the ort_training backend, pip uninstall -y onnxruntime-training-cpu && pip install "
    "onnxruntime-training==1.19.2 (Linux x86_64, CPython <= 3.11, CUDA 12)."
)
# float32 graphs train in float32 on CUDA, as on the CPU: onnxruntime's CUDA provider
# would otherwise round MatMul/Gemm/Conv inputs to TF32 (10-bit mantissas). A user who
# wants TF32 passes providers with use_tf32=1 (the forward/backward trainer's providers=).
CUDA_OPTIONS = {"use_tf32": "0"}
LOG_SEVERITY_VARIABLE = "GRAPHKIT_ORT_LOG_SEVERITY"
"""The environment variable that sets onnxruntime's log severity for graphkit (see
:func:`log_severity`)."""
QUIET = 3
"""onnxruntime's severity by default: errors (a provider library that did not load, which
onnxruntime only logs) show; warnings and information do not."""
SEVERITIES = ("verbose", "info", "warning", "error", "fatal")  # onnxruntime's 0 to 4
_chosen_severity: int | None = None  # set_log_severity's, which outranks the variable
logger = logging.getLogger(__name__)
_NO_KERNEL = re.compile(
    r"Could not find an implementation for (\w+)\(\d+\) node with name '([^']*)'"
)


def _capi() -> Any:
    """onnxruntime's C bindings (every build has them)."""
    return onnxruntime().capi._pybind_state


@functools.cache
def onnxruntime() -> Any:
    """Import onnxruntime once, quietly, and without importing torch.

    The training wheel's ``import onnxruntime`` probes for ORTModule, which imports torch
    (about 2 s and 200 MB) whenever torch is installed. The probe treats an ImportError as
    "no ORTModule", so while torch is not loaded yet, ``onnxruntime.training`` is masked
    for the duration of the import; it imports normally afterwards. graphkit uses only
    the C bindings, which do not need torch.

    First, :func:`graphkit.runtime_check.check_onnxruntime` makes sure that one complete
    onnxruntime build is installed (graphkit-onnx's extras install one; two builds share
    the import package and break each other).

    Raises:
        graphkit.runtime_check.OnnxruntimeNotInstalledError: none is installed (an
            ImportError: the backends then read as not installed).
        graphkit.runtime_check.OnnxruntimeInstallError: several builds, or one whose
            files are gone; the message says the command that repairs it.
    """
    build = runtime_check.check_onnxruntime()
    masked = "torch" not in sys.modules and "onnxruntime" not in sys.modules
    if masked:
        sys.modules["onnxruntime.training"] = None  # type: ignore[assignment]
    try:
        import onnxruntime as ort
    except ImportError as exc:  # its own import failed: a missing library, say
        raise ImportError(
            f"{build} is installed, but `import onnxruntime` fails: {exc}. Reinstalling "
            f"it may help: pip install --force-reinstall --no-deps {build}"
        ) from exc
    finally:
        if masked and sys.modules.get("onnxruntime.training", 0) is None:
            del sys.modules["onnxruntime.training"]
    # the default logger: what onnxruntime logs outside a session (the training build's
    # builders copy it; graphkit's sessions and builders get the level explicitly too)
    severity = log_severity()
    ort.set_default_logger_severity(severity)
    logger.debug("onnxruntime %s, log severity %d", ort.__version__, severity)
    return ort


def log_severity() -> int:
    """The severity of what onnxruntime logs for graphkit's sessions and gradient
    builders: :func:`set_log_severity`'s, else ``GRAPHKIT_ORT_LOG_SEVERITY``'s (read at
    every session), else :data:`QUIET` (errors only).

    Raises:
        ValueError: the environment variable is neither 0-4 nor a name of
            :data:`SEVERITIES`.
    """
    if _chosen_severity is not None:
        return _chosen_severity
    text = os.environ.get(LOG_SEVERITY_VARIABLE, "").strip()
    return _severity(text, LOG_SEVERITY_VARIABLE) if text else QUIET


def set_log_severity(level: int | str) -> None:
    """Log onnxruntime's messages of severity ``level`` and above (0 or ``"verbose"``,
    1 ``"info"``, 2 ``"warning"``, 3 ``"error"``, the default, 4 ``"fatal"``): its default
    logger now, and the sessions and gradient builders graphkit makes from now on.

    Raises:
        ValueError: another level.
    """
    global _chosen_severity
    _chosen_severity = _severity(level, "level")
    onnxruntime().set_default_logger_severity(_chosen_severity)


def _severity(level: int | str, what: str) -> int:
    """``level`` (0-4, as a number or its text, or a name of :data:`SEVERITIES`) as
    onnxruntime's number."""
    text = str(level).strip().lower()
    if text in SEVERITIES:
        return SEVERITIES.index(text)
    if text.isdigit() and int(text) < len(SEVERITIES):
        return int(text)
    raise ValueError(
        f"{what}={level!r} is not an onnxruntime log severity: give 0-4 or one of "
        f"{', '.join(SEVERITIES)}"
    )


def version() -> str:
    """The installed onnxruntime's version, e.g. ``"1.19.2"`` (for messages)."""
    return str(onnxruntime().__version__)


def version_tuple() -> tuple[int, int]:
    """``(major, minor)`` of the installed onnxruntime."""
    major, minor = version().split(".")[:2]
    return int(major), int(minor)


@functools.cache
def runtime_ceiling() -> Ceiling:
    """The newest IR version and ``ai.onnx`` opset the installed onnxruntime loads (at
    most :data:`graphkit.compat.NEWEST`, what onnx knows), found by loading a small model
    at each, newest first, once per process (:func:`_loads`): onnxruntime publishes no
    such number (1.19.2 loads opset 21 and IR 10; 1.32, opset 28 and IR 14)."""
    opset = next(
        (o for o in range(NEWEST.opset, MAX_OPSET, -1) if _loads(ir_version_for(o), o)),
        MAX_OPSET,
    )
    ir = next(
        (v for v in range(NEWEST.ir_version, MAX_IR_VERSION, -1) if _loads(v, MAX_OPSET)),
        MAX_IR_VERSION,
    )
    return Ceiling(ir, opset)


def _loads(ir_version: int, opset: int) -> bool:
    """Whether onnxruntime loads, at IR ``ir_version`` and opset ``opset``, a chain of the
    shape operators graphkit's gradients emit whose newest versions are recent (``Cast``,
    ``Reshape``, ``Squeeze``, ``Pad``... each changed at opsets 23 to 25): a runtime that
    knows an opset but lacks one of its kernels does not count as loading it."""
    from onnx import helper

    i64 = onnx.TensorProto.INT64
    nodes = [
        helper.make_node("Cast", ["x"], ["cast"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Constant", [], ["dims"], value=helper.make_tensor("d", i64, [2], [3, 2])),
        helper.make_node("Reshape", ["cast", "dims"], ["reshaped"]),
        helper.make_node("Constant", [], ["axis"], value=helper.make_tensor("a", i64, [1], [0])),
        helper.make_node("Unsqueeze", ["reshaped", "axis"], ["unsqueezed"]),
        helper.make_node("Squeeze", ["unsqueezed", "axis"], ["squeezed"]),
        helper.make_node("Transpose", ["squeezed"], ["transposed"]),
        helper.make_node(
            "Constant", [], ["pads"], value=helper.make_tensor("p", i64, [4], [0, 0, 0, 1])
        ),
        helper.make_node("Pad", ["transposed", "pads"], ["padded"]),
        helper.make_node("Flatten", ["padded"], ["flat"]),
        helper.make_node("Shape", ["flat"], ["shape"]),
        helper.make_node("ConstantOfShape", ["shape"], ["zeros"]),
        helper.make_node("Identity", ["zeros"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "probe",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    ort = onnxruntime()
    options = ort.SessionOptions()
    options.log_severity_level = 4  # a refusal is the answer, not an error to print
    # every node kept as it is, so that each one's kernel is looked up
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception:
        return False
    return True


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
    options.log_severity_level = log_severity()
    if threads is not None:
        if threads.intra_op is not None:
            options.intra_op_num_threads = threads.intra_op
        if threads.mode == "parallel":
            options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        if not threads.spinning:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


BROKEN_OPTIMIZERS = ("GatherSliceToSplitFusion",)
"""onnxruntime graph optimizers every session turns off: in onnxruntime 1.19.2,
GatherSliceToSplitFusion gives two nodes one name in a recurrent net's gradient graph,
and the session then refuses the graph it made itself ('two nodes with same node name')."""

FLOAT64_BROKEN_OPTIMIZERS = ("MatmulTransposeFusion",)
"""Turned off too in float64 graphs before onnxruntime 1.30: the fusion makes a
``com.microsoft.FusedMatMul`` of every ``MatMul`` of a transposed operand (what gradients
are made of), a kernel that exists for float32 only before 1.30."""


FLOAT64_KERNELS_SINCE = (1, 30)
"""The onnxruntime release with float64 kernels for ``FusedMatMul`` and the activations
graphkit writes out before it (:mod:`graphkit.backends.activations`)."""


def is_float64(model: onnx.ModelProto) -> bool:
    """Whether a graph input or output is float64 (a float64 model, or its gradient)."""
    values = [*model.graph.input, *model.graph.output]
    return any(v.type.tensor_type.elem_type == onnx.TensorProto.DOUBLE for v in values)


def lacks_float64_kernels() -> bool:
    """Whether the installed onnxruntime predates :data:`FLOAT64_KERNELS_SINCE`."""
    return version_tuple() < FLOAT64_KERNELS_SINCE


LARGE_MODEL_BYTES = 64 << 20
"""A graph whose inputs and initializers hold at least this many bytes, or that holds a
weight mapped from its file (:mod:`graphkit.tensor_store`), runs without onnxruntime's
constant folding: onnxruntime folds every constant subgraph into an
initializer of each session, however large (a zero tensor of an embedding table's size,
for its gradient, costs the table's size again in every session), and graphkit has
folded the shape arithmetic that matters already (:mod:`graphkit.static_shapes`)."""


def _without_graph_rewrites(options: Any) -> None:
    """Turn off onnxruntime's graph rewrites for a session whose graph dequantizes a
    frozen weight (a quantized base: ``DequantizeLinear`` of an initializer, a
    ``Transpose`` after it). Its rewrites of quantized graphs, from the basic level on
    and whatever ``session.disable_quant_qdq`` or the optimizers disabled by name say,
    move each ``DequantizeLinear`` past its ``Transpose`` by inserting a
    ``QuantizeLinear`` of the float weight, which then runs at every step: on 12 layers
    of 2048 x 2048 in int8, 2.6 s a step on ort_training's graph (23 of them: 2.2 s),
    0.32 s without any rewrite; an int8 weight without a zero point even got a uint8
    one and failed to load. graphkit's graphs need none of the rewrites to be right."""
    options.graph_optimization_level = onnxruntime().GraphOptimizationLevel.ORT_DISABLE_ALL


def _dequantizes(model: onnx.ModelProto) -> bool:
    return any(n.op_type == "DequantizeLinear" for g in all_graphs(model.graph) for n in g.node)


def _broken_optimizers(model: onnx.ModelProto | bytes) -> tuple[str, ...]:
    if not isinstance(model, onnx.ModelProto):
        return BROKEN_OPTIMIZERS
    disabled: tuple[str, ...] = BROKEN_OPTIMIZERS
    if lacks_float64_kernels() and is_float64(model):
        disabled += FLOAT64_BROKEN_OPTIMIZERS
    # a stored initializer is shared, not the session's: folding it would read its
    # file by its stored name, and copy it into the session
    if is_large(model):
        disabled += ("ConstantFolding",)
    return disabled


def is_large(model: onnx.ModelProto | bytes) -> bool:
    """Whether ``model`` holds a weight mapped from its file or values of at least
    :data:`LARGE_MODEL_BYTES`: its sessions run without constant folding and without
    onnxruntime's CPU memory arena (the arena keeps every block it ever grew to, in
    powers of two: a frozen 1.1-billion-parameter decoder peaked 0.44 GB higher with it,
    at the same speed)."""
    if not isinstance(model, onnx.ModelProto):
        return False
    return tensor_store.has_stored(model) or _value_bytes(model) >= LARGE_MODEL_BYTES


def _value_bytes(model: onnx.ModelProto) -> int:
    """The bytes of the graph's inputs of static shape and its initializers."""
    total = sum(tensor_store.tensor_bytes(t) for t in model.graph.initializer)
    for value in model.graph.input:
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 0 for d in tensor.shape.dim]
        if tensor.HasField("shape") and all(dims):
            total += tensor_store.elem_bytes(tensor.elem_type) * int(np.prod(dims, dtype=np.int64))
    return total


def inference_session(
    model: onnx.ModelProto | bytes,
    providers: Sequence[Provider] = CPU,
    threads: Threads | None = None,
) -> Any:
    """An InferenceSession on ``model`` with :data:`BROKEN_OPTIMIZERS` off; a load
    failure becomes ``IncompatibleModelError``.

    The model runs as it is, but for two rewrites on CUDA that both backends need (long
    ``Split`` nodes as ``Slice`` nodes, :mod:`graphkit.engine.cuda_splits`;
    ``MaxUnpool``, which has no CUDA kernel, as a ``ScatterND``,
    :mod:`graphkit.engine.cuda_unpools`): a gradient source that wants its graphs
    rewritten for a device does so in its own ``inference_session`` (ort_training
    lowers slow kernels).
    """
    if providers and provider_name(providers[0]) == "CUDAExecutionProvider":
        parsed = onnx.load_from_string(model) if isinstance(model, bytes) else model
        model = max_unpools_as_scatters(split_long_axes_as_slices(parsed))
    if isinstance(model, onnx.ModelProto):
        model = tensor_store.hoisted(model)  # shared initializers live in the main graph
    data = model if isinstance(model, bytes) else serialized(model)
    ort = onnxruntime()
    disabled = list(_broken_optimizers(model))
    options = session_options(threads)  # outside the try: a bad setting is not the model's
    if isinstance(model, onnx.ModelProto) and _dequantizes(model):
        _without_graph_rewrites(options)
    shared = share_stored_initializers(model, options)
    if is_large(model):
        options.enable_cpu_mem_arena = False
    try:
        session = ort.InferenceSession(
            data, options, providers=list(providers), disabled_optimizers=disabled
        )
    except Exception as exc:  # onnxruntime raises its own Fail / InvalidGraph types
        missing = _NO_KERNEL.search(str(exc))
        if missing:
            float64 = isinstance(model, onnx.ModelProto) and is_float64(model)
            advice = (
                " The model is float64, and several of onnxruntime's kernels exist for "
                "float32 only (Erf, Cos, some gradients): train in float32, or avoid this "
                "operator."
                if float64
                else ""
            )
            raise MissingKernelError(
                f"onnxruntime {version()} has no kernel for operator {missing.group(1)!r} "
                f"(node {missing.group(2)!r}) with these element types on "
                f"{provider_name(providers[0])}.{advice}",
                missing.group(1),
            ) from exc
        raise IncompatibleModelError(
            f"onnxruntime {version()} cannot load this model: {short_message(exc)}"
        ) from exc
    _check_providers_loaded(session, providers)
    session._graphkit_shared = shared  # onnxruntime reads their buffers: keep them alive
    return session


def serialized(model: onnx.ModelProto) -> bytes:
    """``model``'s bytes, or a clear error past protobuf's 2 GB where a weight is held
    inline (graphs built from a model loaded by path keep their large weights mapped,
    :mod:`graphkit.tensor_store`, and stay small)."""
    size = model.ByteSize()
    if size > tensor_store.PROTOBUF_LIMIT:
        raise IncompatibleModelError(
            f"This graph holds {size / 2**30:.2f} GiB of weights inside its ModelProto, past "
            "protobuf's 2 GiB limit. Save the model with its weights as external data "
            "(onnx.save_model(model, 'model.onnx', save_as_external_data=True)) and pass "
            "graphkit the path of the .onnx file: it then maps the weights from their file "
            "instead of holding them in the protobuf."
        )
    return model.SerializeToString()


def share_stored_initializers(model: onnx.ModelProto | bytes, options: Any) -> list[Any]:
    """Hand ``model``'s stored initializers (:mod:`graphkit.tensor_store`) to onnxruntime
    as shared initializers (``SessionOptions.add_initializer``): every session reads the
    one mapped array, no copy. The OrtValues returned must outlive the session."""
    if isinstance(model, bytes):
        return []
    ort = onnxruntime()
    stored = tensor_store.stored_initializers(model)
    if stored:
        # onnxruntime packs a constant MatMul operand into a layout of its own, a copy
        # in every session: for a frozen base of gigabytes, its size once per session
        options.add_session_config_entry("session.disable_prepacking", "1")
    names = list(stored)
    values = [ort.OrtValue.ortvalue_from_numpy(array) for array in stored.values()]
    if not names:
        return values
    if version_tuple() < SHARED_INITIALIZERS_BEFORE:
        for name, value in zip(names, values):
            options.add_initializer(name, value)
    else:  # newer releases check an initializer's external path before replacing it
        options.add_external_initializers(names, values)
    return values


SHARED_INITIALIZERS_BEFORE = (1, 20)
"""onnxruntime releases before this take a stored tensor through ``add_initializer``
(shared, no copy; checked on 1.19.2). Later ones (checked: 1.32) validate the external
path of an initializer before ``add_initializer`` replaces it, and take it through
``add_external_initializers``, meant for initializers kept outside the model."""


def _check_providers_loaded(session: Any, providers: Sequence[Provider]) -> None:
    """onnxruntime falls back to the CPU, with a warning on stderr only, when a provider
    it was built with does not load (CUDA's libraries missing, no GPU): the session would
    then train on the CPU while the trainer binds its values on the GPU."""
    wanted = [provider_name(p) for p in providers]
    lost = [p for p in wanted if p != "CPUExecutionProvider" and p not in session.get_providers()]
    if lost:
        raise RuntimeError(
            f"onnxruntime {version()} could not start {', '.join(lost)}: its libraries did "
            "not load, or it sees no device (onnxruntime logs why on stderr). " + CUDA_HINT
        )


class MissingKernelError(IncompatibleModelError):
    """The runtime has no kernel for an operator of the model (``op_type``), in its
    element types on that device."""

    def __init__(self, message: str, op_type: str) -> None:
        super().__init__(message)
        self.op_type = op_type


class Runner:
    """A model compiled once into an InferenceSession, called with numpy arrays."""

    def __init__(self, model: onnx.ModelProto | bytes, providers: Sequence[Provider] = CPU) -> None:
        self.session = inference_session(model, providers)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def __call__(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        try:
            return self.session.run(None, dict(feeds))
        except Exception as exc:
            message = short_message(exc)
            raise RuntimeError(f"onnxruntime failed to run the graph: {message}") from exc


def short_message(exc: BaseException) -> str:
    """The useful part of an onnxruntime message (drops the C++ source location)."""
    text = str(exc).strip()
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    text = re.sub(r"/onnxruntime_src/\S+ [^\n]*? (?=\S+ was false\.)", "", text)
    return text.splitlines()[0] if text else type(exc).__name__


def run(model: Any, feeds: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Run ``model`` once on CPU with numpy ``feeds``; return ``{output name: array}``.

    ``model`` is a ModelProto, its bytes or a path; it goes through the same
    compatibility policy as training (:func:`graphkit.compat.make_compatible`, up to what
    the installed onnxruntime loads: :func:`runtime_ceiling`). A
    convenience for notebooks and tests (it builds a session on every call): the
    training runtime keeps its sessions bound instead.
    """
    from graphkit.compat import load_model, make_compatible

    runner = Runner(make_compatible(load_model(model), ceiling=runtime_ceiling()))
    unknown = sorted(set(feeds) - set(runner.input_names))
    missing = sorted(set(runner.input_names) - set(feeds))
    if unknown or missing:
        raise ValueError(
            f"Feeds do not match the graph inputs {runner.input_names}: "
            f"missing {missing}, unknown {unknown}."
        )
    arrays = {k: np.asarray(v) for k, v in feeds.items()}
    return dict(zip(runner.output_names, runner(arrays)))


# -- devices, values and bindings ---------------------------------------------------------------


def providers_for(device: str) -> tuple[list[Provider], str, int]:
    """``(providers, ort device name, device id)`` for ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    The CUDA provider comes with its options: the device's index (a session on
    ``"cuda:1"`` runs there, beside the values bound on it) and float32 arithmetic
    (:data:`CUDA_OPTIONS`)."""
    if not isinstance(device, str):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {device!r}.")
    if device == "cpu":
        return ["CPUExecutionProvider"], "cpu", 0
    if device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()):
        if "CUDAExecutionProvider" not in onnxruntime().get_available_providers():
            raise RuntimeError(CUDA_HINT)
        index = int(device[5:]) if ":" in device else 0
        cuda = ("CUDAExecutionProvider", {"device_id": str(index), **CUDA_OPTIONS})
        return [cuda, "CPUExecutionProvider"], "cuda", index
    raise ValueError(f"Unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'.")


def provider_name(provider: Provider) -> str:
    """``"CUDAExecutionProvider"`` for the name or a ``(name, options)`` pair."""
    return provider if isinstance(provider, str) else provider[0]


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


def write_adapter(
    path: str, values: Mapping[str, np.ndarray], adapter_version: int, model_version: int
) -> None:
    """Write ``values`` (name -> array) as onnxruntime's LoRA adapter file at ``path``
    (``onnxruntime.AdapterFormat``, onnxruntime 1.20 and later: what
    ``RunOptions.add_active_adapter`` activates).

    Raises:
        ImportError: the installed onnxruntime has no adapter format (the training build
            1.19.2, say); the message names what writes one.
    """
    ort = onnxruntime()
    if not hasattr(ort, "AdapterFormat"):
        raise ImportError(
            f"onnxruntime {ort.__version__} cannot write adapter files: its adapter format "
            "came with onnxruntime 1.20. Save the adapters where onnxruntime>=1.20 is "
            "installed (graphkit-onnx[cpu], the native backend), or save format='peft'."
        )
    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(int(adapter_version))
    adapter.set_model_version(int(model_version))
    adapter.set_parameters({name: ortvalue(np.asarray(v)) for name, v in values.items()})
    adapter.export_adapter(path)


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
    """A C OrtValue sharing the memory of a DLPack capsule (no copy).

    onnxruntime-training 1.19.2 takes whether the tensor is boolean (DLPack's ``uint8``
    serves both); the plain releases that have DLPack take the capsule alone.
    """
    make = _capi().OrtValue.from_dlpack
    try:
        return make(capsule, is_bool)
    except TypeError:  # the one-argument form
        return make(capsule)


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


def input_binder(binding: Any) -> Any:
    """``bind(name, c_value)``: binds a C OrtValue (:func:`c_ortvalue`, :func:`wrap`'s
    elements' ``_ortvalue``) to an input of an ``IOBinding``, without the Python
    wrapper's checks (the hot loops bind every batch)."""
    return binding._iobinding.bind_ortvalue_input
