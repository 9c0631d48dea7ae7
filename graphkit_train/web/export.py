"""Write the folder that trains a model in a web page (see :mod:`graphkit_train.web`).

The folder holds nothing but standard ONNX, raw little-endian tensors and JSON, so that
onnxruntime-web's wasm backend, which has no training API since onnxruntime 1.20,
trains it as an inference engine: a loop feeds a batch and the resident tensors to the
exported step (or the whole epoch to the exported epoch) and feeds each ``<name>.next``
back, as :class:`graphkit.step_trainer.StepTrainer` does in Python::

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

from graphkit._graph import copy_model
from graphkit.compat import finalize
from graphkit.errors import IncompatibleModelError
from graphkit.rewrite import META_PREDICTION, metadata, prune
from graphkit.training.batches import NamedRows
from graphkit.training.export import (
    export_training_epoch,
    export_training_info,
    export_training_step,
)
from graphkit.training_info import initial_state

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
    trainer._build()
    if getattr(trainer, "_heads", None):
        outputs = [h.output for h in trainer._heads]
        raise IncompatibleModelError(
            f"export_web trains one loss; this trainer has a loss per output {outputs}. "
            "Export a model with one loss (add_loss_output(model, loss))."
        )
    step = export_training_step(trainer)  # TypeError for forward/backward trainers
    epoch = export_training_epoch(trainer)
    roles = json.loads(metadata(step)["graphkit.training_step"])
    state = initial_state(step)
    state = {name: state[name] for name in roles["resident"]}
    weights = [w for w in trainer.training_step_.weights if w in state]

    evaluate = _forward(trainer, trainer.evaluation_onnx_, [roles["loss"]])
    prediction = metadata(trainer.train_onnx_).get(META_PREDICTION) or next(
        o.name for o in trainer.prediction_onnx_.graph.output
    )
    predict = _forward(trainer, trainer.prediction_onnx_, [prediction])
    template, trained = _template(trainer, weights, state)

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    blobs = {
        "step": step.SerializeToString(),
        "epoch": epoch.SerializeToString(),
        "evaluate": evaluate.SerializeToString(),
        "predict": predict.SerializeToString(),
        "template": template.SerializeToString(),
    }
    state_bytes, state_entries = _pack(state)
    blobs["state"] = state_bytes
    _check_assembly(blobs["template"], {w: state[w] for w in weights}, trained)
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
        "label": {**_value(label), "classes": _classes(trainer)},
        "sample_weight": _value(inputs[sample_weight]) if sample_weight else None,
        "loss": {
            "output": roles["loss"],
            "name": trainer.loss_.name if trainer.loss_ is not None else None,
            "reduction": trainer.loss_.reduction if trainer.loss_ is not None else None,
        },
        "prediction": {"output": prediction, **_prediction_kind(trainer)},
        "weights": weights,
        "state": state_entries,
        "batch_size": int(trainer.batch_size),
        "optimizer": {"name": trainer.optimizer_.name, "params": trainer.optimizer_.params},
        "operators": {
            key: sorted({n.op_type for n in model.graph.node})
            for key, model in (("step", step), ("epoch", epoch), ("predict", predict))
        },
    }
    # the same model for Python and other runtimes: the prediction model carrying its
    # training step as a TrainingInfoProto (the page itself does not read it)
    try:
        export_training_info(trainer, out / TRAINABLE)
        manifest["trainable"] = TRAINABLE
    except IncompatibleModelError:  # a weight that is not a prediction-graph initializer
        manifest["trainable"] = None
    if data is not None:
        (out / "data.json").write_text(json.dumps(_rows_json(data)))
        manifest["data"] = "data.json"
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, default=_json_default))
    shutil.copyfile(Path(__file__).with_name(MODULE), out / MODULE)
    return manifest


def _forward(trainer: Any, model: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    """``model`` reduced to ``outputs`` (a ZipMap after the probabilities goes: no web
    runtime returns maps), its operators lowered to standard ONNX, checked."""
    model = copy_model(model)
    kept = [o for o in model.graph.output if o.name in outputs]
    del model.graph.output[:]
    model.graph.output.extend(kept)
    model = trainer._backend.to_standard(prune(model))
    del model.metadata_props[:]
    return finalize(model, full_check=True)


def _template(
    trainer: Any, weights: list[str], state: dict[str, np.ndarray]
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The prediction model without the initializers of ``weights``, and the model with
    the current weights (what the template plus them must give)."""
    trained = (
        trainer.get_trained_onnx()
        if trainer._fitted
        else trainer._untied(trainer._prediction_model())
    )
    present = {t.name for t in trained.graph.initializer}
    missing = [w for w in weights if w not in present]
    if missing:
        raise IncompatibleModelError(
            f"Weights {missing} are not initializers of the prediction model, so the page "
            "could not write the trained model; train a model whose weights are initializers."
        )
    for tensor in trained.graph.initializer:
        if tensor.name in state:
            tensor.CopyFrom(numpy_helper.from_array(state[tensor.name], tensor.name))
    template = copy_model(trained)
    kept = [t for t in template.graph.initializer if t.name not in set(weights)]
    del template.graph.initializer[:]
    template.graph.initializer.extend(kept)
    return template, trained


def _check_assembly(
    template: bytes, weights: dict[str, np.ndarray], trained: onnx.ModelProto
) -> None:
    """The template's bytes followed by ``ModelProto{graph{initializer}}`` (what the
    page's ``exportModel`` writes) parse as the trained model and pass the full check."""
    tail = onnx.ModelProto()
    tail.graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in weights.items())
    model = onnx.ModelProto.FromString(template + tail.SerializeToString())
    onnx.checker.check_model(model, full_check=True)
    got = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for tensor in trained.graph.initializer:
        value = got.get(tensor.name)
        if value is None or not np.array_equal(value, numpy_helper.to_array(tensor)):
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


def _classes(trainer: Any) -> int | None:
    """The number of classes of a classification loss (labels 0 .. K-1), else None."""
    return int(trainer._n_classes()) if trainer._is_classifier() else None


def _prediction_kind(trainer: Any) -> dict[str, Any]:
    """How ``predict`` turns the output into predictions, as
    :meth:`graphkit.losses.Loss.labels` does: the values themselves (regression), the
    argmax of several columns, or a threshold on one column."""
    if not trainer._is_classifier() or trainer.loss_ is None:
        return {"kind": "values"}
    threshold = 0.5 if trainer.loss_.prediction == "probabilities" else 0.0
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
