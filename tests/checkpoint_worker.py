"""Trains an MLP with a checkpoint every epoch; run by tests/test_checkpoint.py, which
kills it with SIGKILL in the middle of an epoch and starts it again.

    python tests/checkpoint_worker.py CHECKPOINT RESULT.npz MARKERS_FOLDER [--no-checkpoint]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit_train import OrtGradientOptimizer

EPOCHS = 6


def mlp_onnx() -> object:
    rng = np.random.default_rng(0)
    inits = {
        "W1": rng.normal(size=(10, 32)).astype(np.float32) * 0.3,
        "b1": np.zeros(32, np.float32),
        "W2": rng.normal(size=(32, 1)).astype(np.float32) * 0.3,
        "b2": np.zeros(1, np.float32),
    }
    nodes = [
        helper.make_node("MatMul", ["X", "W1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Tanh", ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "W2"], ["o0"]),
        helper.make_node("Add", ["o0", "b2"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 10])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    X = rng.normal(size=(30_000, 10)).astype(np.float32)
    return X, np.sin(X[:, 0] - X[:, 1]).astype(np.float32)


def main() -> None:
    checkpoint, result, markers = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    use_checkpoint = "--no-checkpoint" not in sys.argv
    X, y = data()
    learning_rate = (gk.optimizers.adam(), gk.schedules.cosine(0.01, EPOCHS * 3000))
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(mlp_onnx()),
        learning_rate=learning_rate,
        max_iter=EPOCHS,
        batch_size=10,
        random_state=0,
    )

    def mark(epoch: int, losses: dict, trainer: object) -> None:
        (markers / f"epoch{epoch}").write_text(str(time.time()))

    trainer.fit(X, y, callback=mark, checkpoint=checkpoint if use_checkpoint else None)
    np.savez(result, losses=np.array(trainer.train_losses_), **trainer.get_state())


if __name__ == "__main__":
    main()
