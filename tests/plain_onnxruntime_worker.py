"""Runs graphkit's exported training in an environment with plain onnxruntime (the
latest release from PyPI) and no graphkit, no onnxruntime-training:

    python plain_onnxruntime_worker.py CASES_FOLDER

For each ``<name>.step.onnx`` (an exported training step), ``<name>.info.onnx`` (a model
carrying a TrainingInfoProto), ``<name>.batches.npz``, and optionally ``<name>.epoch.onnx`` with
``<name>.epoch_feeds.npz`` and ``<name>.rows.npz``, in
the folder, it trains over the batches and writes ``<name>.result.npz``: the step's final
resident tensors (prefix ``step/``), the TrainingInfoProto run's final initializers
(prefix ``info/``), the state after two shuffled epochs of ``PortableTrainer`` over the rows
(prefix ``trainer/``) and the onnxruntime version.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    """graphkit/<name>.py from its file: it needs only onnx, numpy and the runtime."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "graphkit" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_step(path: Path, batches: list[dict], training_info) -> dict[str, np.ndarray]:
    """The step over the batches, from the initial state it carries (the outputs of its
    TrainingInfoProto's initialization graph)."""
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = [o.name for o in session.get_outputs()]
    resident = training_info.initial_state(onnx.load(path))
    for batch in batches:
        values = dict(zip(outputs, session.run(None, {**batch, **resident})))
        resident = {n[: -len(".next")]: v for n, v in values.items() if n.endswith(".next")}
    return resident


def main() -> None:
    folder = Path(sys.argv[1])
    assert not hasattr(onnxruntime, "training"), "this must be plain onnxruntime"
    training_info, portable_trainer = load("training_info"), load("portable_trainer")
    for batches_file in sorted(folder.glob("*.batches.npz")):
        name = batches_file.name[: -len(".batches.npz")]
        data = np.load(batches_file)
        count = len({k.split("/")[0] for k in data.files})
        batches = [
            {k.split("/", 1)[1]: data[k] for k in data.files if k.startswith(f"{i}/")}
            for i in range(count)
        ]
        result = {
            f"step/{k}": v
            for k, v in run_step(folder / f"{name}.step.onnx", batches, training_info).items()
        }
        model = onnx.load(folder / f"{name}.info.onnx")
        model, _ = training_info.run_training_info(model, batches, runtime="onnxruntime")
        for tensor in model.graph.initializer:
            result[f"info/{tensor.name}"] = onnx.numpy_helper.to_array(tensor)
        if (folder / f"{name}.epoch.onnx").exists():
            # one epoch as one Loop, over the rows and permutation the test chose
            session = onnxruntime.InferenceSession(
                str(folder / f"{name}.epoch.onnx"), providers=["CPUExecutionProvider"]
            )
            # the rows and permutation, and the initial state the epoch carries
            feeds = dict(np.load(folder / f"{name}.epoch_feeds.npz"))
            feeds.update(training_info.initial_state(onnx.load(folder / f"{name}.epoch.onnx")))
            names = [o.name for o in session.get_outputs()]
            epoch = dict(zip(names, session.run(None, feeds)))
            result.update({f"epoch/{k}": v for k, v in epoch.items()})
        if (folder / f"{name}.rows.npz").exists():
            # two epochs of the step trainer over the same rows, shuffled with seed 0
            rows = np.load(folder / f"{name}.rows.npz")
            trainer = portable_trainer.PortableTrainer(
                folder / f"{name}.step.onnx", batch_size=10, shuffle=True, random_state=0
            )
            trainer.fit(rows["X"], rows["y"], epochs=2)
            result.update({f"trainer/{k}": v for k, v in trainer.state().items()})
            result["trainer_losses"] = np.array(trainer.train_losses_)
        result["version"] = np.array(onnxruntime.__version__)
        np.savez(folder / f"{name}.result.npz", **result)


if __name__ == "__main__":
    main()
