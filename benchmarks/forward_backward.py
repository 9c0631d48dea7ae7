"""Forward/backward training: graphkit's design against the seed's.

The MLP 10-10-1 workload of ``run.py`` (ReLU, squared error, SGD, batches of 10, float32,
same data and initial weights) trained for one epoch by

* graphkit's ``OrtGradientForwardBackwardOptimizer``: the TrainingAgent's forward with
  the loss and its gradient fused in, its backward with one fused update of every weight
  (2 onnxruntime calls per batch, graphs specialized to the batch size);
* the same trainer on the graph declared at opset 17, older than the loss and update
  graphs, which runs them as separate sessions as distributed training does: forward,
  loss, backward, update (4 calls per batch);
* the seed's design, rebuilt from the same graphkit pieces: forward, loss, backward, then
  one update session per weight (3 + number of weights runs per batch);
* graphkit's full training (one run per epoch) and hand-written numpy, for scale.

Every implementation computes each batch's loss; their last losses are printed.

    python benchmarks/forward_backward.py [--quick] [--repeat 5]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import onnx
from report import default_output, header, write
from run import (
    TURN,
    Workload,
    _graphkit_optimizer,
    graphkit_forward_backward,
    graphkit_full,
    numpy_contender,
    timed_round_robin,
    workloads,
)

from graphkit.engine.ort_engine import inference_session, onnxruntime
from graphkit.optimizers import update_model
from graphkit_train import OrtGradientForwardBackwardOptimizer


class SeedDesign:
    """forward / loss / backward sessions and one update session per weight."""

    def __init__(self, trainer: OrtGradientForwardBackwardOptimizer) -> None:
        trainer._build()
        self.batch_size = trainer.batch_size
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

    def epoch(self, X: np.ndarray, y: np.ndarray) -> float:
        """One epoch; the mean batch loss."""
        ort = onnxruntime()
        losses = []
        for start in range(0, len(X), self.batch_size):
            stop = start + self.batch_size
            x = ort.OrtValue.ortvalue_from_numpy(X[start:stop])
            feeds = [x if n == self.fb.input_names[0] else self.weights[n] for n in self.order]
            pending = self.fb.run_forward(self.variant, [v._ortvalue for v in feeds])
            label = ort.OrtValue.ortvalue_from_numpy(y[start:stop])
            loss, grad = self.loss.run_with_ort_values(
                ["loss", "prediction_grad"], {"prediction": pending.outputs[0], "label": label}
            )
            losses.append(float(loss.numpy()))
            grads = self.fb.run_backward(pending, [grad._ortvalue])
            step = ort.OrtValue.ortvalue_from_numpy(np.array(self.step, dtype=np.int64))
            for w, session in self.updates.items():
                (self.weights[w],) = session.run_with_ort_values(
                    ["param.new"], {"param": self.weights[w], "grad": grads[w], "step": step}
                )
            self.step += 1
        return float(np.mean(losses))


def four_calls(w: Workload) -> Workload:
    """``w`` with its graph declared at opset 17 (its operators mean the same there)."""
    model = onnx.ModelProto()
    model.CopyFrom(w.model)
    model.opset_import[0].version = 17
    return dataclasses.replace(w, model=model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the rows")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--output", default=str(default_output(__file__)))
    args = parser.parse_args()
    w = next(w for w in workloads(args.quick) if w.name.startswith("MLP 10-10-1, batch 10"))
    repeat = args.repeat
    runs = {
        "numpy (hand-written)": "-",
        "graphkit full training": "1 per epoch",
        "graphkit forward/backward": "2",
        "graphkit forward/backward, four calls": "4",
        "seed design (one update per weight)": str(3 + len(w.weights)),
    }
    timed = timed_round_robin(
        w,
        repeat,
        {
            "numpy (hand-written)": numpy_contender(w, "sgd"),
            "graphkit full training": graphkit_full(w, "sgd", "epoch"),
            "graphkit forward/backward": graphkit_forward_backward(w, "sgd"),
            "graphkit forward/backward, four calls": graphkit_forward_backward(
                four_calls(w), "sgd"
            ),
        },
    )
    seed = SeedDesign(  # timed alone: its sessions exist only while it is timed
        OrtGradientForwardBackwardOptimizer(
            w.model, batch_size=w.batch_size, learning_rate=_graphkit_optimizer("sgd")
        )
    )
    timed.update(
        timed_round_robin(
            w, repeat, {"seed design (one update per weight)": lambda: seed.epoch(w.X, w.y)}
        )
    )
    # name: ((best epoch seconds, last loss), onnxruntime runs per batch)
    results = {name: (timed[name], runs[name]) for name in runs}
    reference = results["numpy (hand-written)"][0][0]
    fb = results["graphkit forward/backward"][0][0]
    lines = header("Forward/backward training") + [
        f"One epoch of {w.name}, SGD, float32, {len(w.X)} rows; best of {repeat} or more "
        f"epochs, taken in turns of {TURN} (the first untimed) by numpy and graphkit, then by the "
        "seed design alone. Regenerate with `make bench`.",
        "",
        "| implementation | onnxruntime runs per batch | µs / batch | x numpy "
        "| x graphkit forward/backward | loss |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, ((seconds, loss), runs) in results.items():
        per_batch = seconds / w.batches * 1e6
        lines.append(
            f"| {name} | {runs} | {per_batch:.1f} | {seconds / reference:.2f} | "
            f"{seconds / fb:.2f} | {loss:.6g} |"
        )
        print(f"{name:40s} {per_batch:8.1f} us/batch  x{seconds / reference:.2f}  loss {loss:.6g}")
    write(args.output, lines)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
