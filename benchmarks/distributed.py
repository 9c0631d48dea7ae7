"""Data-parallel throughput: 1 process against 2 processes (torchrun, gloo) training the
same MLP 100-256-256-1 (ReLU, float32, squared error, Adam) on 50,000 rows, at a batch
of 256 rows per process; write benchmarks/results/distributed.md.

    python benchmarks/distributed.py [--epochs 2] [--output FILE]

Each process keeps onnxruntime's default thread pool (one thread per core) and torchrun
sets OMP_NUM_THREADS=1. Every contender computes the loss of every batch; the epoch
losses of "1 process, batch 512" and "2 processes x 256" must be equal (the same global
batches), which the table shows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from report import default_output, header, versions, write

import graphkit as gk
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

ROWS, FEATURES, HIDDEN, BATCH = 50_000, 100, 256, 256


def mlp():
    rng = np.random.default_rng(0)
    shapes = {"W1": (FEATURES, HIDDEN), "W2": (HIDDEN, HIDDEN), "W3": (HIDDEN, 1)}
    init = {k: (rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32) for k, s in shapes.items()}
    init.update(b1=np.zeros(HIDDEN, np.float32), b2=np.zeros(HIDDEN, np.float32))
    init["b3"] = np.zeros(1, np.float32)
    nodes = [
        helper.make_node("Gemm", ["X", "W1", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("Gemm", ["r1", "W2", "b2"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("Gemm", ["r2", "W3", "b3"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(v, k) for k, v in init.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def data():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    return X, (np.sin(X[:, :10]).sum(axis=1) + 0.1 * rng.normal(size=ROWS)).astype(np.float32)


def measure(kind: str, batch: int, epochs: int, distributed: bool) -> dict:
    """Seconds per epoch (after one warm-up epoch) and the last epoch's loss."""
    settings = dict(
        batch_size=batch,
        learning_rate=(gk.optimizers.get("adam"), 1e-3),
        random_state=0,
        warm_start=True,
        distributed=distributed,
        validation_every=0,
    )
    if kind == "full":
        trainer = OrtGradientOptimizer(gk.add_loss_output(mlp()), max_iter=1, **settings)
    else:
        trainer = OrtGradientForwardBackwardOptimizer(mlp(), max_iter=1, **settings)
    X, y = data()
    trainer.fit(X, y)  # warm-up: graphs built, sessions initialized
    start = time.perf_counter()
    trainer.set_params(max_iter=epochs).fit(X, y)
    seconds = (time.perf_counter() - start) / epochs
    return {"seconds": seconds, "rows_per_s": ROWS / seconds, "loss": trainer.train_losses_[-1]}


def worker(epochs: int, out: str) -> None:
    from graphkit_train import distributed

    group = distributed.init()
    results = {kind: measure(kind, BATCH, epochs, True) for kind in ("full", "forward_backward")}
    if group.rank == 0:
        Path(out).write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--output", default=str(default_output(__file__)))
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.epochs, args.worker)
    rows = []
    out = Path(__file__).with_name("_distributed.json")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += [__file__, "--epochs", str(args.epochs), "--worker", str(out)]
    subprocess.run(command, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    two = json.loads(out.read_text())
    out.unlink()
    for kind in ("full", "forward_backward"):
        same_work = measure(kind, BATCH, args.epochs, False)
        same_batches = measure(kind, 2 * BATCH, args.epochs, False)
        base = same_work["rows_per_s"]
        for label, r in (
            ("1 process, batch 256", same_work),
            ("1 process, batch 512", same_batches),
            ("2 processes x batch 256", two[kind]),
        ):
            rows.append((kind, label, r["rows_per_s"], r["rows_per_s"] / base, r["loss"]))
    lines = header("Data-parallel throughput", libraries=versions("torch")) + [
        f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-1, {ROWS:,} rows, Adam, float32. **x 1 process "
        "(batch 256)** is the ratio of rows per second to one process's at batch 256 (a "
        "throughput: higher is faster). Each process uses onnxruntime's default pool "
        "(one thread per core), so 2 processes share the cores that 1 process had.",
        "",
        "| trainer | run | rows/s | x 1 process (batch 256) | epoch loss |",
        "|---|---|---:|---:|---:|",
    ]
    for kind, label, speed, ratio, loss in rows:
        lines.append(f"| {kind} | {label} | {speed:,.0f} | {ratio:.2f} | {loss:.6f} |")
    write(args.output, lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
