"""Time one training epoch of the same MLP (10-10-1, ReLU, squared error, plain SGD,
batches of 10, float32) with graphkit's full training, hand-written numpy, scikit-learn's
MLPRegressor and PyTorch, in one run; write the ratios to benchmarks/results.md.

    python benchmarks/run.py [--rows 10000] [--repeat 5]

Ratios, not seconds, are the result: they carry over between machines far better.
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit_train import OrtGradientOptimizer

HIDDEN, FEATURES, BATCH, LR = 10, 10, 10, 0.01


def initial_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "W1": rng.normal(scale=0.3, size=(FEATURES, HIDDEN)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "W2": rng.normal(scale=0.3, size=(HIDDEN, 1)).astype(np.float32),
        "b2": np.zeros(1, np.float32),
    }


def mlp_onnx(weights: dict[str, np.ndarray]):
    graph = helper.make_graph(
        [
            helper.make_node("Gemm", ["X", "W1", "b1"], ["h"]),
            helper.make_node("Relu", ["h"], ["a"]),
            helper.make_node("Gemm", ["a", "W2", "b2"], ["Y"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", FEATURES])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def numpy_epoch(X, y, w, order):
    """Forward, backward (mean squared error) and SGD, written by hand."""
    W1, b1, W2, b2 = w["W1"], w["b1"], w["W2"], w["b2"]
    for start in range(0, len(X), BATCH):
        rows = order[start : start + BATCH]
        x, t = X[rows], y[rows]
        h = x @ W1 + b1
        a = np.maximum(h, 0)
        p = a @ W2 + b2
        g = (2.0 / len(x)) * (p - t)
        gW2, gb2 = a.T @ g, g.sum(axis=0)
        ga = (g @ W2.T) * (h > 0)
        gW1, gb1 = x.T @ ga, ga.sum(axis=0)
        W1 -= LR * gW1
        b1 -= LR * gb1
        W2 -= LR * gW2
        b2 -= LR * gb2


def best_of(repeat: int, run) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--output", default=str(Path(__file__).with_name("results.md")))
    args = parser.parse_args()

    rng = np.random.default_rng(1)
    X = rng.normal(size=(args.rows, FEATURES)).astype(np.float32)
    y = (X[:, :1] * 0.5 - X[:, 1:2] + rng.normal(scale=0.1, size=(args.rows, 1))).astype(np.float32)
    batches = -(-args.rows // BATCH)
    results: dict[str, float] = {}

    weights = initial_weights()
    order = rng.permutation(args.rows)
    results["numpy (hand-written)"] = best_of(
        args.repeat, lambda: numpy_epoch(X, y, weights, order)
    )

    trainer = OrtGradientOptimizer(
        gk.add_loss_output(mlp_onnx(initial_weights())),
        max_iter=1,
        batch_size=BATCH,
        learning_rate=LR,
        warm_start=True,
        random_state=0,
    )
    trainer.fit(X, y)  # builds the graphs and sessions: not timed
    results["graphkit OrtGradientOptimizer"] = best_of(args.repeat, lambda: trainer.fit(X, y))

    from sklearn.neural_network import MLPRegressor

    sk = MLPRegressor(
        hidden_layer_sizes=(HIDDEN,),
        solver="sgd",
        momentum=0.0,
        learning_rate_init=LR,
        batch_size=BATCH,
        alpha=0.0,
        max_iter=1,
        random_state=0,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sk.partial_fit(X, y[:, 0])
        results["scikit-learn MLPRegressor"] = best_of(
            args.repeat, lambda: sk.partial_fit(X, y[:, 0])
        )

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(1)
        net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
        )
        optimizer = torch.optim.SGD(net.parameters(), lr=LR)
        Xt, yt = torch.from_numpy(X), torch.from_numpy(y)

        def torch_epoch():
            perm = torch.randperm(len(Xt))
            for start in range(0, len(Xt), BATCH):
                rows = perm[start : start + BATCH]
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(net(Xt[rows]), yt[rows])
                loss.backward()
                optimizer.step()

        torch_epoch()
        results["PyTorch (eager, 1 thread)"] = best_of(args.repeat, torch_epoch)

    reference = results["numpy (hand-written)"]
    lines = [
        "# Benchmarks",
        "",
        f"One epoch of an MLP {FEATURES}-{HIDDEN}-1 (ReLU), squared error, plain SGD, batches of "
        f"{BATCH}, float32, {args.rows} rows ({batches} steps); best of {args.repeat}. "
        "Time relative to hand-written numpy (lower is faster).",
        "",
        f"Machine: {platform.machine()}, {platform.python_implementation()} "
        f"{platform.python_version()}, onnxruntime-training 1.19.2. Regenerate with `make bench`.",
        "",
        "| implementation | time / numpy |",
        "|---|---|",
    ]
    for name, seconds in results.items():
        lines.append(f"| {name} | {seconds / reference:.2f} |")
        print(f"{name:32s} {seconds / batches * 1e6:8.1f} us/step   x{seconds / reference:.2f}")
    Path(args.output).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
