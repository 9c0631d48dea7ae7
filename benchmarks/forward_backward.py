"""Forward/backward training: graphkit's fused update against the seed's design.

The same MLP (10-10-1, ReLU, squared error, SGD, batches of 10, float32) trained for one
epoch by

* graphkit's ``OrtGradientForwardBackwardOptimizer``: forward, loss, backward, and one
  fused update of every weight (4 onnxruntime runs per batch);
* the seed's design, rebuilt from the same graphkit pieces: forward, loss, backward, then
  one update session per weight (3 + number of weights runs per batch);
* graphkit's full training (1 run per batch) and hand-written numpy, for scale.

    python benchmarks/forward_backward.py [--rows 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from run import BATCH, LR, best_of, initial_weights, mlp_onnx, numpy_epoch

import graphkit as gk
from graphkit._ort import inference_session
from graphkit.optimizers import update_model
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer


class SeedDesign:
    """forward / loss / backward sessions and one update session per weight."""

    def __init__(self, trainer: OrtGradientForwardBackwardOptimizer) -> None:
        trainer._build()
        self.fb = trainer.forward_backward_
        self.variant = trainer._variant
        self.loss = inference_session(trainer.loss_onnx_)
        rate = trainer.learning_rate_
        self.weights = {w: self.fb.weights[w] for w in self.fb.weight_names}
        self.updates = {
            w: inference_session(update_model(rate, w, np.float32, tuple(v.shape())))
            for w, v in self.weights.items()
        }
        self.order = self.fb.feed_sources(self.variant)
        self.step = 0

    def epoch(self, X: np.ndarray, y: np.ndarray) -> None:
        ort = gk._ort.onnxruntime()
        for start in range(0, len(X), BATCH):
            x = ort.OrtValue.ortvalue_from_numpy(X[start : start + BATCH])
            feeds = [x if n == self.fb.input_names[0] else self.weights[n] for n in self.order]
            pending = self.fb.run_forward(self.variant, [v._ortvalue for v in feeds])
            label = ort.OrtValue.ortvalue_from_numpy(y[start : start + BATCH])
            _, grad = self.loss.run_with_ort_values(
                ["loss", "prediction_grad"], {"prediction": pending.outputs[0], "label": label}
            )
            grads = self.fb.run_backward(pending, [grad._ortvalue])
            step = ort.OrtValue.ortvalue_from_numpy(np.array(self.step, dtype=np.int64))
            for w, session in self.updates.items():
                (self.weights[w],) = session.run_with_ort_values(
                    ["param.new"], {"param": self.weights[w], "grad": grads[w], "step": step}
                )
            self.step += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--output", default=str(Path(__file__).with_name("results_forward_backward.md"))
    )
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    X = rng.normal(size=(args.rows, 10)).astype(np.float32)
    y = (X[:, :1] * 0.5 - X[:, 1:2]).astype(np.float32)
    n_weights = len(initial_weights())
    rate = gk.LearningRateSGD(eta0=LR, learning_rate="constant")

    results: dict[str, tuple[float, int]] = {}
    weights = initial_weights()
    order = np.arange(args.rows)
    results["numpy (hand-written)"] = (
        best_of(args.repeat, lambda: numpy_epoch(X, y, weights, order)),
        0,
    )

    full = OrtGradientOptimizer(
        gk.add_loss_output(mlp_onnx(initial_weights())),
        max_iter=1,
        batch_size=BATCH,
        learning_rate=rate,
        warm_start=True,
        shuffle=False,
    )
    full.fit(X, y)
    results["graphkit full training"] = (best_of(args.repeat, lambda: full.fit(X, y)), 1)

    partial = OrtGradientForwardBackwardOptimizer(
        mlp_onnx(initial_weights()),
        max_iter=1,
        batch_size=BATCH,
        learning_rate=rate,
        warm_start=True,
        shuffle=False,
    )
    partial.fit(X, y)
    results["graphkit forward/backward (fused update)"] = (
        best_of(args.repeat, lambda: partial.fit(X, y)),
        4,
    )

    seed = SeedDesign(
        OrtGradientForwardBackwardOptimizer(mlp_onnx(initial_weights()), learning_rate=rate)
    )
    seed.epoch(X, y)
    results["seed design (one update per weight)"] = (
        best_of(args.repeat, lambda: seed.epoch(X, y)),
        3 + n_weights,
    )

    reference = results["numpy (hand-written)"][0]
    fused = results["graphkit forward/backward (fused update)"][0]
    lines = [
        "# Forward/backward training",
        "",
        f"One epoch of an MLP 10-10-1 (ReLU), squared error, SGD, batches of {BATCH}, float32, "
        f"{args.rows} rows; best of {args.repeat}. Regenerate with `make bench`.",
        "",
        "| implementation | onnxruntime runs per batch | time / numpy "
        "| time / fused forward/backward |",
        "|---|---|---|---|",
    ]
    for name, (seconds, runs) in results.items():
        lines.append(
            f"| {name} | {runs or '-'} | {seconds / reference:.2f} | {seconds / fused:.2f} |"
        )
        print(
            f"{name:44s} {seconds / (args.rows / BATCH) * 1e6:8.1f} us/step  "
            f"x{seconds / reference:.2f}"
        )
    Path(args.output).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
