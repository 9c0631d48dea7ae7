"""The two gradient sources side by side on the model zoo: coverage, agreement, size, speed.

For every case of ``tests/zoo`` (a loss added with ``add_loss_output``, its parameters
trained), the gradient graph of each installed backend:

* **coverage**: does the backend build it (or refuse, naming the operator);
* **agreement**: the largest difference between the two backends' gradients on one batch
  (relative to the largest gradient), and each backend's directional derivative against
  central finite differences along the native gradient;
* **size**: nodes of the gradient graph as built, and after graphkit's static-shape
  specialization (onnxscript's constant folding) for batches of ``--batch`` rows;
* **speed**: microseconds per run of the specialized gradient graph, and seconds per
  epoch of full training with each backend (``Trainer``, SGD, same data and weights).

Run alone (2 cores): ``.venv/bin/python benchmarks/gradient_sources.py`` (writes
``benchmarks/results/gradient_sources.md``; ``--output`` elsewhere).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
from report import default_output, header, write

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import graphkit as gk  # noqa: E402
from graphkit import backends  # noqa: E402
from graphkit.engine.ort_engine import inference_session  # noqa: E402
from graphkit.prepare import prepare_for_training  # noqa: E402
from graphkit.rewrite import initializers_to_inputs, prune  # noqa: E402
from graphkit.static_shapes import specialize  # noqa: E402
from tests.zoo.models import CASES  # noqa: E402
from tests.zoo.run import built  # noqa: E402


def feeds_for(train: onnx.ModelProto, X: np.ndarray, y: np.ndarray) -> dict:
    feeds = {}
    for value in train.graph.input:
        if value.name in {i.name for i in train.graph.initializer}:
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
        rank = len(value.type.tensor_type.shape.dim)
        array = X if value.name != "y" else y
        array = np.asarray(array).astype(dtype)
        feeds[value.name] = (
            array.reshape(len(array), -1) if rank == 2 and array.ndim == 1 else array
        )
    return feeds


def timed(session, feeds: dict, repeat: int) -> float:
    session.run(None, feeds)
    start = time.perf_counter()
    for _ in range(repeat):
        session.run(None, feeds)
    return (time.perf_counter() - start) / repeat * 1e6


def directional(train, weights, values, feeds, direction, loss) -> float:
    """Central differences of the loss along ``direction`` (float64 sums)."""
    opened = initializers_to_inputs(train, weights)
    session = inference_session(opened)
    norm = np.sqrt(sum(float((d.astype(np.float64) ** 2).sum()) for d in direction.values()))
    eps = 1e-2 / max(norm, 1e-12)

    def at(sign):
        moved = {
            w: (values[w] + sign * eps * direction[w]).astype(values[w].dtype) for w in weights
        }
        return float(np.sum(session.run([loss], {**feeds, **moved})[0], dtype=np.float64))

    return (at(1) - at(-1)) / (2 * eps)


def one_case(case, names, batch, repeat):
    onx, data = built(case)
    train = gk.add_loss_output(onx, case.loss, output_index=case.output_index, label_name="y")
    row = {"case": case.id}
    grads = {}
    for name in names:
        try:
            prepared, weights = prepare_for_training(train, None, name)
            loss = prepared.graph.output[0].name
            del prepared.graph.output[1:]  # the loss only, as the trainers differentiate it
            prepared = prune(prepared)
            weights = [w for w in weights if w in {i.name for i in prepared.graph.initializer}]
            opened = initializers_to_inputs(prepared, weights)
            grad = gk.gradient_model(opened, loss, weights, backend=name)
        except gk.GraphkitError as exc:
            row[name] = {"refused": type(exc).__name__ + ": " + str(exc)[:80]}
            continue
        values = gk.rewrite.weight_values(prepared, weights)
        feeds = feeds_for(prepared, data.X_train[:batch], data.y_train[:batch])
        rows = {n: batch for n in feeds}
        special = specialize(grad, rows, backends.get(name).constant_folds)
        backend = backends.get(name)
        session = backend.inference_session(special)
        out = dict(
            zip([o.name for o in session.get_outputs()], session.run(None, {**feeds, **values}))
        )
        grads[name] = (out, weights, values, feeds, prepared, loss)
        trainer = gk_trainer(train, name)
        start = time.perf_counter()
        trainer.set_params(max_iter=1).fit(data.X_train, data.y_train)  # builds the graphs
        build = time.perf_counter() - start
        trainer.set_params(max_iter=3, warm_start=True)
        start = time.perf_counter()
        trainer.fit(data.X_train, data.y_train)
        epoch = (time.perf_counter() - start) / trainer.max_iter
        row[name] = {
            "nodes": len(grad.graph.node),
            "specialized": len(special.graph.node),
            "us": timed(session, {**feeds, **values}, repeat),
            "epoch_ms": epoch * 1e3,
            "build_s": build,
        }
    if len(grads) == 2:
        (a, weights, values, feeds, prepared, loss), (b, *_) = grads.values()
        scale = max(float(np.abs(a[f"{w}_grad"]).max()) for w in weights) or 1.0
        row["difference"] = (
            max(float(np.abs(a[f"{w}_grad"] - b[f"{w}_grad"]).max()) for w in weights) / scale
        )
    if "native" in grads:
        out, weights, values, feeds, prepared, loss = grads["native"]
        direction = {w: out[f"{w}_grad"] for w in weights}
        fd = directional(prepared, weights, values, feeds, direction, loss)
        for name, (got, *_rest) in grads.items():
            slope = sum(
                float((got[f"{w}_grad"].astype(np.float64) * direction[w]).sum()) for w in weights
            )
            row.setdefault("fd", {})[name] = abs(slope - fd) / max(abs(fd), 1e-12)
    return row


def gk_trainer(train, name):
    from graphkit_train import Trainer

    return Trainer(
        train,
        optimizer=gk.optimizers.get("sgd", learning_rate=0.01),
        max_iter=3,
        batch_size=32,
        random_state=0,
        backend=name,
    )


BACKEND_COLUMNS = ("nodes (specialized)", "µs / batch", "ms / epoch")


def render(rows, names) -> str:
    lines = [
        "| model | "
        + " | ".join(f"{n}: {c}" for n in names for c in BACKEND_COLUMNS)
        + " | difference | vs finite differences |",
        "|---|" + "---|" * (4 * len(names) + 2),
    ]
    for row in rows:
        cells = [row["case"]]
        for name in names:
            r = row.get(name, {})
            if "refused" in r:
                cells += ["refused", "", ""]
            elif r:
                cells += [
                    f"{r['nodes']} ({r['specialized']})",
                    f"{r['us']:.0f}",
                    f"{r['epoch_ms']:.0f}",
                ]
            else:
                cells += ["", "", ""]
        cells.append(f"{row['difference']:.1e}" if "difference" in row else "")
        fd = row.get("fd", {})
        cells.append(", ".join(f"{n} {v:.0e}" for n, v in fd.items()))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows, names) -> str:
    out = []
    for name in names:
        built_ = [r for r in rows if "nodes" in r.get(name, {})]
        out.append(f"- {name}: builds {len(built_)} of {len(rows)} gradient graphs")
    both = [r for r in rows if all("nodes" in r.get(n, {}) for n in names)]
    if len(names) == 2 and both:
        a, b = names
        ratio_us = np.exp(np.mean([np.log(r[b]["us"] / r[a]["us"]) for r in both]))
        ratio_ep = np.exp(np.mean([np.log(r[b]["epoch_ms"] / r[a]["epoch_ms"]) for r in both]))
        ratio_build = np.exp(np.mean([np.log(r[b]["build_s"] / r[a]["build_s"]) for r in both]))
        nodes = np.exp(np.mean([np.log(r[b]["specialized"] / r[a]["specialized"]) for r in both]))
        worst = max(r["difference"] for r in both)
        out.append(
            f"- on the {len(both)} graphs both build: {b}/{a} geometric mean ratios: "
            f"specialized nodes {nodes:.2f}, time per gradient run {ratio_us:.2f}, "
            f"time per training epoch {ratio_ep:.2f} (after the build), time to build the "
            f"training graphs and run one epoch {ratio_build:.2f}; largest gradient "
            f"difference {worst:.1e}"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--output", type=Path, default=default_output(__file__))
    args = parser.parse_args()
    names = [b.name for b in backends.available() if b.installed]
    warnings.simplefilter("ignore")
    rows = [one_case(case, names, args.batch, args.repeat) for case in CASES]
    lines = header("Gradient sources on the model zoo") + [
        f"Batch {args.batch}. For each model of tests/zoo and each backend: the nodes of "
        "its gradient graph (in parentheses once specialized to the batch size), the time "
        "of one run of the specialized gradient graph (**µs / batch**) and of one epoch of "
        "full training (**ms / epoch**), the largest difference between the two backends' "
        "gradients, and each backend's directional derivative against central finite "
        "differences.",
        "",
        summary(rows, names),
        "",
        render(rows, names),
    ]
    print("\n".join(lines))
    write(args.output, lines)


if __name__ == "__main__":
    main()
