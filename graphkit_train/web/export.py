"""Write the folder that trains a model in a web page (see :mod:`graphkit_train.web`).

The folder holds nothing but standard ONNX, raw little-endian tensors and JSON, so that
onnxruntime-web's wasm backend, which has no training API since onnxruntime 1.20,
trains it as an inference engine: a loop feeds a batch and the resident tensors to the
exported step (or the whole epoch to the exported epoch) and feeds each ``<name>.next``
back, as :class:`graphkit.portable_trainer.PortableTrainer` does in Python::

    manifest.json            what the ES module needs to know (below)
    training_step.onnx       one batch: graphkit.training.export.export_training_step
    training_epoch.onnx      one epoch, the step in a Loop: export_training_epoch
    evaluate.onnx            the loss, the weights as inputs (held-out loss)
    predict.onnx             the prediction the loss reads, the weights as inputs
    model.template.onnx      the prediction model without its trained initializers
    state.bin                the resident tensors' current values, 8-byte aligned
    graphkit-web.mjs         the ES module (loadTrainer)
    model.trainable.onnx     the prediction model carrying the step as a TrainingInfoProto
                             (graphkit.training.export.export_training_info), for Python
    data.json                optional: rows to train on (the demo page's)

``exportModel()`` in the browser appends the trained weights to the template as
initializers. Protocol buffers merge a message that is serialized twice: the bytes of
``ModelProto{graph{initializer: [...]}}`` after the template's bytes add those
initializers to its graph. :func:`export_web` checks here, with ``onnx.checker``, that
the template plus the current weights is the trained model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from graphkit import backends
from graphkit.backends.base import Backend
from graphkit.errors import IncompatibleModelError
from graphkit.losses import Loss
from graphkit.rewrite import (
    META_HEADS,
    loss_heads,
    metadata,
)
from graphkit.tensor_store import tensor_value
from graphkit.training.batches import NamedRows
from graphkit.training.export import State, export_info
from graphkit.training.problem import TrainingProblem
from graphkit.training.web_graphs import web_graphs

MANIFEST = "manifest.json"
MODULE = "graphkit-web.mjs"
TRAINABLE = "model.trainable.onnx"
FORMAT, VERSION = "graphkit-web", 1
_ALIGN = 8  # a Float64Array or BigInt64Array view needs its offset a multiple of 8

_FILES = {
    "step": "training_step.onnx",
    "epoch": "training_epoch.onnx",
    "evaluate": "evaluate.onnx",
    "predict": "predict.onnx",
    "template": "model.template.onnx",
    "state": "state.bin",
}

# numpy dtypes as onnxruntime-web names them (ort.Tensor's type strings)
_WEB_TYPES = {
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
    np.dtype(np.int64): "int64",
    np.dtype(np.int32): "int32",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.int8): "int8",
    np.dtype(np.bool_): "bool",
}


def export_web(
    trainer: Any,
    folder: str | os.PathLike[str],
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``folder`` so that a web page trains the trainer's model with
    onnxruntime-web, from the trainer's current state (its initial one before ``fit``).

    Args:
        trainer: a :class:`graphkit_train.Trainer` (full training: its step is one ONNX
            graph) with one loss.
        folder: created if missing; the files it already holds with the same names are
            replaced.
        data: optional rows to ship with the model, ``{"train": (X, y), "held_out": (X,
            y)}`` (arrays), written to ``data.json`` for a page to train on.

    Returns:
        The manifest (also written to ``folder/manifest.json``).

    Raises:
        TypeError: a forward/backward trainer (its gradient comes from the outer model).
        IncompatibleModelError: a loss per output, or a step the lowering to standard
            ONNX cannot write.
    """
    backend = trainer.backend_  # builds
    problem = getattr(trainer, "problem_", None)
    if problem is None:  # as graphkit.training.export says
        raise TypeError(
            f"{type(trainer).__name__} has no fused training step to export; "
            "OrtGradientOptimizer has one."
        )
    return export_web_problem(
        problem,
        folder,
        prediction=trainer.prediction_template(),
        batch_size=int(trainer.batch_size),
        backend=backend,
        state=trainer.fitted_state(),
        loss=trainer.loss_,
        classes=trainer.class_count(),
        data=data,
    )


def export_web_problem(
    problem: TrainingProblem,
    folder: str | os.PathLike[str],
    *,
    prediction: onnx.ModelProto,
    batch_size: int,
    backend: Backend | None = None,
    state: State | None = None,
    loss: Loss | None = None,
    classes: int | None = None,
    data: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``folder`` so that a web page trains ``problem`` with onnxruntime-web, from
    ``state``: what :func:`export_web` writes for a trainer, from what it takes of it.

    Args:
        problem: what to train and how (a full trainer's ``problem_``), with one loss.
        folder, data: as in :func:`export_web`.
        prediction: the prediction graph, weights as initializers (a trainer's
            ``prediction_template()``): the page's template, and the model it exports.
        batch_size: the rows per batch the page trains with.
        backend: lowers the backend's operators to standard ONNX (None: the problem's).
        state: the training state to start from (``get_state()``'s arrays; None: the
            initial one).
        loss: the loss the graph computes, when known (its name and reduction go into
            the manifest; the page predicts labels with it).
        classes: the number of classes of a classification loss (labels 0 .. K-1);
            None for a regression.

    Returns:
        The manifest (also written to ``folder/manifest.json``).

    Raises:
        IncompatibleModelError: a loss per output, or a step the lowering to standard
            ONNX cannot write.
    """
    backend = backends.get(problem.backend) if backend is None else backend
    heads = loss_heads(problem.model) if metadata(problem.model).get(META_HEADS) else []
    if heads:
        outputs = [h.output for h in heads]
        raise IncompatibleModelError(
            f"export_web trains one loss; this trainer has a loss per output {outputs}. "
            "Export a model with one loss (add_loss_output(model, loss))."
        )
    graphs = web_graphs(problem, prediction, backend, state)
    step, epoch, roles, resident = graphs.step, graphs.epoch, graphs.roles, graphs.resident
    weights, prediction_output = graphs.weights, graphs.prediction_output

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    blobs = {
        "step": step.SerializeToString(),
        "epoch": epoch.SerializeToString(),
        "evaluate": graphs.evaluate.SerializeToString(),
        "predict": graphs.predict.SerializeToString(),
        "template": graphs.template.SerializeToString(),
    }
    state_bytes, state_entries = _pack(resident)
    blobs["state"] = state_bytes
    _check_assembly(blobs["template"], {w: resident[w] for w in weights}, graphs.trained)
    for key, blob in blobs.items():
        (out / _FILES[key]).write_bytes(blob)

    inputs = {i.name: i for i in step.graph.input}
    label = inputs[roles["label"]]
    sample_weight = roles.get("sample_weight")
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "files": {
            key: {"path": _FILES[key], "sha256": hashlib.sha256(blob).hexdigest()}
            for key, blob in blobs.items()
        },
        "inputs": [_value(inputs[name]) for name in roles["inputs"]],
        "label": {**_value(label), "classes": classes},
        "sample_weight": _value(inputs[sample_weight]) if sample_weight else None,
        "loss": {
            "output": roles["loss"],
            "name": loss.name if loss is not None else None,
            "reduction": loss.reduction if loss is not None else None,
        },
        "prediction": {"output": prediction_output, **_prediction_kind(loss, classes)},
        "weights": weights,
        "state": state_entries,
        "batch_size": int(batch_size),
        "optimizer": {"name": problem.optimizer.name, "params": problem.optimizer.params},
        "operators": {
            key: sorted({n.op_type for n in model.graph.node})
            for key, model in (("step", step), ("epoch", epoch), ("predict", graphs.predict))
        },
    }
    # the same model for Python and other runtimes: the prediction model carrying its
    # training step as a TrainingInfoProto (the page itself does not read it)
    try:
        export_info(problem, prediction, backend, state, out / TRAINABLE)
        manifest["trainable"] = TRAINABLE
    except IncompatibleModelError:  # a weight that is not a prediction-graph initializer
        manifest["trainable"] = None
    if data is not None:
        (out / "data.json").write_text(json.dumps(_rows_json(data)))
        manifest["data"] = "data.json"
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, default=_json_default))
    shutil.copyfile(Path(__file__).with_name(MODULE), out / MODULE)
    return manifest


def _check_assembly(
    template: bytes, weights: dict[str, np.ndarray], trained: onnx.ModelProto
) -> None:
    """The template's bytes followed by ``ModelProto{graph{initializer}}`` (what the
    page's ``exportModel`` writes) parse as the trained model and pass the full check."""
    tail = onnx.ModelProto()
    tail.graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in weights.items())
    model = onnx.ModelProto.FromString(template + tail.SerializeToString())
    onnx.checker.check_model(model, full_check=True)
    got = {t.name: tensor_value(t) for t in model.graph.initializer}
    for tensor in trained.graph.initializer:
        value = got.get(tensor.name)
        if value is None or not np.array_equal(value, tensor_value(tensor)):
            raise AssertionError(f"graphkit bug: the web template loses {tensor.name!r}")


def _pack(state: dict[str, np.ndarray]) -> tuple[bytes, list[dict[str, Any]]]:
    """The tensors little-endian one after the other, each at an 8-byte boundary."""
    buffer, entries = bytearray(), []
    for name, value in state.items():
        value = np.asarray(value)  # (np.ascontiguousarray makes a scalar 1-D)
        buffer.extend(b"\0" * (-len(buffer) % _ALIGN))
        raw = value.astype(value.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
        entries.append(
            {
                "name": name,
                "type": _web_type(value.dtype, name),
                "dims": list(value.shape),
                "offset": len(buffer),
                "bytes": len(raw),
            }
        )
        buffer.extend(raw)
    return bytes(buffer), entries


def _web_type(dtype: np.dtype, name: str) -> str:
    if np.dtype(dtype) not in _WEB_TYPES:
        raise IncompatibleModelError(
            f"{name!r} is {dtype}, which onnxruntime-web's tensors do not hold "
            f"({sorted(_WEB_TYPES.values())})."
        )
    return _WEB_TYPES[np.dtype(dtype)]


def _value(info: onnx.ValueInfoProto) -> dict[str, Any]:
    """Name, onnxruntime-web type and dims (None where not fixed) of an input."""
    tensor = info.type.tensor_type
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type))
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
    return {"name": info.name, "type": _web_type(dtype, info.name), "dims": dims}


def _prediction_kind(loss: Loss | None, classes: int | None) -> dict[str, Any]:
    """How ``predict`` turns the output into predictions, as
    :meth:`graphkit.losses.Loss.labels` does: the values themselves (regression), the
    argmax of several columns, or a threshold on one column."""
    if classes is None or loss is None:
        return {"kind": "values"}
    threshold = 0.5 if loss.prediction == "probabilities" else 0.0
    return {"kind": "labels", "threshold": threshold}


def _rows_json(data: dict[str, Any]) -> dict[str, Any]:
    """``{"train": {"X": rows, "y": labels}, ...}`` as lists (X as ``{input: rows}`` for
    several inputs)."""
    out: dict[str, Any] = {}
    for part, arrays in data.items():
        if part == "feature_names":
            out[part] = list(arrays)
            continue
        X, y = arrays[0], arrays[1]
        if isinstance(X, NamedRows):
            X = X.arrays
        rows = (
            {name: np.asarray(a).tolist() for name, a in X.items()}
            if isinstance(X, dict)
            else np.asarray(X).tolist()
        )
        out[part] = {"X": rows, "y": np.asarray(y).tolist()}
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")
