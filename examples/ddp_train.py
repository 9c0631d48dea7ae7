"""Data-parallel training with graphkit: every process trains on its share of each batch.

    torchrun --nproc_per_node=2 examples/ddp_train.py

(on several machines: the same script under ``torchrun --nnodes=M --nproc_per_node=N
--rdzv-endpoint=HOST:PORT``). Every rank loads the same data and the same model;
graphkit shards the rows, averages the gradients with one all-reduce per step, and keeps
the weights identical on every rank. Rank 0 reports and saves the trained model.
"""

from __future__ import annotations

import numpy as np
import onnx
from sklearn.datasets import load_diabetes

import graphkit as gk
from graphkit_train import OrtGradientOptimizer, distributed
from graphkit_train.cli import default_mlp, r2


def main() -> None:
    group = distributed.init(backend="gloo", timeout_seconds=120)
    X, y = load_diabetes(return_X_y=True)  # bundled with scikit-learn
    X, y = X.astype(np.float32), y.astype(np.float32)
    order = np.random.default_rng(0).permutation(len(X))
    train, test = order[:350], order[350:]
    # an MLP whose feature and target scaling are constants inside the graph
    onx = default_mlp(X[train], y[train], hidden=32, seed=0)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(onx),
        max_iter=100,
        batch_size=16,  # per rank: the global batch is 16 x the number of processes
        learning_rate=(gk.optimizers.get("adam"), 0.001),
        random_state=0,
        verbose=1,  # shown by rank 0 only
        distributed=True,
    )
    trainer.fit(X[train], y[train], X_val=X[test], y_val=y[test])
    if group.rank == 0:
        score = r2(y[test], trainer.predict(X[test]))
        print(f"{group.world_size} processes: held-out R^2 {score:.3f}")
        onnx.save(trainer.get_trained_onnx(), "diabetes_mlp.onnx")


if __name__ == "__main__":
    main()
