"""Trains an MLP with a checkpoint every epoch; run by tests/test_checkpoint.py, which
kills it with SIGKILL in the middle of an epoch and starts it again.

    python tests/checkpoint_worker.py CHECKPOINT RESULT.npz MARKERS_FOLDER [--no-checkpoint]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
from conftest import mlp_onnx  # the script's folder, tests/, is on sys.path

import graphkit as gk
from graphkit_train import OrtGradientOptimizer

EPOCHS = 6


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
        gk.add_loss_output(mlp_onnx(10, 32, 1, "Tanh", scale=0.3)),
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
