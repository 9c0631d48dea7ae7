"""``graphkit-train``: train an ONNX model on a dataset from the command line.

    graphkit-train model.onnx --data train.csv --label price --loss huber \\
        --optimizer adam --lr 0.01 --epochs 50 --batch-size 32 --output out/

Without a model and data it trains the embedded default job: an MLP built for
scikit-learn's bundled diabetes data (feature and target scaling inside the graph),
and prints its held-out score next to scikit-learn's MLPRegressor trained on the same
split. It writes the trained model, the fused training-step graph, ``report.json`` and
``loss_curve.png`` into ``--output``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import losses, optimizers, schedules
from graphkit.compat import load_model
from graphkit.rewrite import META_LOSS, metadata
from graphkit_train.full import OrtGradientOptimizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphkit-train",
        description=(
            "Train the weights of an ONNX model with onnxruntime-training. With no MODEL "
            "and no --data, train the embedded default job (an MLP on scikit-learn's "
            "diabetes data) and compare it with scikit-learn."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "model",
        nargs="?",
        help="ONNX prediction graph (a loss is appended with --loss) or training graph "
        "(with a 'loss' output, used as is)",
    )
    parser.add_argument("--data", help="dataset: a CSV file with a header row, or an NPZ file")
    parser.add_argument(
        "--label",
        default=None,
        help="CSV: the label column (default: the last one); NPZ: the label array (default 'y')",
    )
    parser.add_argument("--features", default="X", help="NPZ: the feature array")
    parser.add_argument(
        "--loss",
        default="squared_error",
        help=f"loss name, one of {', '.join(losses.LOSSES.names())}",
    )
    parser.add_argument(
        "--optimizer",
        default="adam",
        help=f"optimizer name, one of {', '.join(optimizers.OPTIMIZERS.names())}",
    )
    parser.add_argument(
        "--schedule",
        default="constant",
        help=f"learning-rate schedule, one of {', '.join(schedules.SCHEDULES.names())}",
    )
    parser.add_argument("--lr", type=float, default=0.001, help="initial learning rate (eta0)")
    parser.add_argument("--epochs", type=int, default=100, help="number of epochs")
    parser.add_argument("--batch-size", type=int, default=32, help="rows per training step")
    parser.add_argument(
        "--validation-split", type=float, default=0.2, help="fraction of rows held out"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the shuffling")
    parser.add_argument(
        "--weights", default=None, help="comma-separated weights to train (default: all)"
    )
    parser.add_argument("--output", default="graphkit-out", help="folder for the results")
    parser.add_argument("--quiet", action="store_true", help="no progress bar, no per-epoch lines")
    return parser


# -- data -------------------------------------------------------------------------------


def read_dataset(
    path: str, label: str | None, features: str
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """``(X, y, feature names)`` from a CSV (header row) or an NPZ file."""
    if path.endswith(".npz"):
        with np.load(path) as data:
            label = label or "y"
            missing = [k for k in (features, label) if k not in data]
            if missing:
                raise SystemExit(f"{path} has no array {missing}; it holds {sorted(data)}.")
            X, y = data[features], data[label]
        return X, y, [f"x{i}" for i in range(X.shape[1])]
    with open(path) as handle:
        header = handle.readline().strip().split(",")
    table = np.genfromtxt(path, delimiter=",", skip_header=1, dtype=np.float64, ndmin=2)
    if table.shape[1] != len(header):
        raise SystemExit(f"{path}: {len(header)} header names but {table.shape[1]} columns.")
    label = label or header[-1]
    if label not in header:
        raise SystemExit(f"{path} has no column {label!r}; columns are {header}.")
    index = header.index(label)
    X = np.delete(table, index, axis=1)
    return X, table[:, index], [h for h in header if h != label]


def split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if not 0 <= fraction < 1:
        raise SystemExit(f"--validation-split must lie in [0, 1), got {fraction}.")
    order = np.random.default_rng(seed).permutation(n)
    n_test = int(round(n * fraction))
    return order[n_test:], order[:n_test]


# -- the embedded default job ---------------------------------------------------------


def default_mlp(X: np.ndarray, y: np.ndarray, hidden: int, seed: int) -> onnx.ModelProto:
    """An MLP for tabular regression; scaling of X and y lives inside the graph.

    Y = ((X - mean) / std) W1 + b1 -> tanh -> W2 + b2, then * y_std + y_mean. The scaling
    constants are initializers that are not trained.
    """
    rng = np.random.default_rng(seed)
    n_features = X.shape[1]
    limit1, limit2 = np.sqrt(6 / (n_features + hidden)), np.sqrt(6 / (hidden + 1))
    init = {
        "x_mean": X.mean(axis=0),
        "x_std": X.std(axis=0) + 1e-12,
        "W1": rng.uniform(-limit1, limit1, (n_features, hidden)),
        "b1": np.zeros(hidden),
        "W2": rng.uniform(-limit2, limit2, (hidden, 1)),
        "b2": np.zeros(1),
        "y_mean": np.array([y.mean()]),
        "y_std": np.array([y.std()]),
    }
    nodes = [
        helper.make_node("Sub", ["X", "x_mean"], ["centered"]),
        helper.make_node("Div", ["centered", "x_std"], ["scaled"]),
        helper.make_node("Gemm", ["scaled", "W1", "b1"], ["hidden_in"]),
        helper.make_node("Tanh", ["hidden_in"], ["hidden_out"]),
        helper.make_node("Gemm", ["hidden_out", "W2", "b2"], ["standardized"]),
        helper.make_node("Mul", ["standardized", "y_std"], ["rescaled"]),
        helper.make_node("Add", ["rescaled", "y_mean"], ["Y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp_regressor",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", n_features])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(v.astype(np.float32), k) for k, v in init.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def r2(y: np.ndarray, prediction: np.ndarray) -> float:
    y, prediction = y.reshape(-1).astype(np.float64), prediction.reshape(-1).astype(np.float64)
    return float(1 - ((y - prediction) ** 2).sum() / ((y - y.mean()) ** 2).sum())


# -- the job ----------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train as ``args`` say; return the report (also written to the output folder)."""
    say = (lambda *a: None) if args.quiet else print
    default_job = args.model is None and args.data is None
    if default_job:
        from sklearn.datasets import load_diabetes

        X, y = load_diabetes(return_X_y=True)
        names = list(load_diabetes().feature_names)
        dataset = "scikit-learn diabetes"
    elif args.data is None:
        raise SystemExit("A MODEL needs --data (CSV or NPZ).")
    else:
        X, y, names = read_dataset(args.data, args.label, args.features)
        dataset = args.data
    train_rows, test_rows = split(len(X), args.validation_split, args.seed)
    loss = losses.get(args.loss)
    X = X.astype(np.float32)
    y = y.astype(np.int64) if loss.task == "classification" else y.astype(np.float32)
    if default_job:
        model = default_mlp(X[train_rows], y[train_rows], hidden=32, seed=args.seed)
        weights = ["W1", "b1", "W2", "b2"]
    else:
        model = load_model(args.model)
        weights = args.weights.split(",") if args.weights else None
    outputs = [o.name for o in model.graph.output]
    already = metadata(model).get(META_LOSS) or ("loss" if "loss" in outputs else None)
    train_onx = model if already else gk.add_loss_output(model, loss)
    schedule = (
        schedules.get(args.schedule, eta0=args.lr) if args.schedule != "constant" else args.lr
    )
    learning_rate = (optimizers.get(args.optimizer), schedule)

    trainer = OrtGradientOptimizer(
        train_onx,
        weights,
        max_iter=1,
        batch_size=args.batch_size,
        learning_rate=learning_rate,
        warm_start=True,
        validation_every=1,
        random_state=args.seed,
    )
    say(
        f"graphkit-train: {dataset}, {len(train_rows)} training rows, {len(test_rows)} held out; "
        f"loss {loss.name}, optimizer {args.optimizer}, schedule {args.schedule}, lr {args.lr}"
    )
    validation = (X[test_rows], y[test_rows]) if len(test_rows) else (None, None)
    progress = None if args.quiet else _bar(args.epochs)
    every = max(1, args.epochs // 10)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        trainer.fit(X[train_rows], y[train_rows], X_val=validation[0], y_val=validation[1])
        line = f"epoch {epoch + 1:4d}  train loss {trainer.train_losses_[-1]:.6g}"
        if trainer.validation_losses_:
            line += f"  held-out loss {trainer.validation_losses_[-1]:.6g}"
        if progress is not None:
            progress.update(1)
            progress.set_postfix_str(line.split("  ", 1)[1], refresh=False)
            if (epoch + 1) % every == 0 or epoch == 0:
                progress.write(line)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress.close()

    report: dict[str, Any] = {
        "dataset": dataset,
        "features": names,
        "rows": {"train": int(len(train_rows)), "held_out": int(len(test_rows))},
        "settings": {k: v for k, v in vars(args).items() if k not in ("quiet",)},
        "train_losses": trainer.train_losses_,
        "held_out_losses": trainer.validation_losses_,
        "training_seconds": seconds,
    }
    if len(test_rows):
        prediction = trainer.predict(X[test_rows])
        if loss.task == "regression":
            report["held_out_r2"] = r2(y[test_rows], prediction)
            say(f"held-out R^2 (graphkit): {report['held_out_r2']:.4f}")
        else:
            labels = (
                prediction.argmax(axis=1) if prediction.ndim == 2 else (prediction > 0).astype(int)
            )
            report["held_out_accuracy"] = float((labels == y[test_rows]).mean())
            say(f"held-out accuracy (graphkit): {report['held_out_accuracy']:.4f}")
    if default_job and len(test_rows):
        report["sklearn"] = _sklearn_reference(X, y, train_rows, test_rows, args)
        say(
            f"held-out R^2 (scikit-learn {report['sklearn']['estimator']}): "
            f"{report['sklearn']['held_out_r2']:.4f}"
        )
    report["files"] = _write(trainer, args.output, report)
    say(f"wrote {', '.join(sorted(report['files'].values()))}")
    return report


def _sklearn_reference(X, y, train_rows, test_rows, args) -> dict[str, Any]:  # noqa: ANN001
    import warnings

    from sklearn.compose import TransformedTargetRegressor
    from sklearn.neural_network import MLPRegressor
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    # the same model as the default job: scaled features and target, 32 tanh units, Adam
    mlp = MLPRegressor(
        hidden_layer_sizes=(32,),
        activation="tanh",
        solver="adam",
        learning_rate_init=args.lr,
        batch_size=args.batch_size,
        max_iter=args.epochs,
        random_state=args.seed,
    )
    estimator = TransformedTargetRegressor(
        regressor=make_pipeline(StandardScaler(), mlp), transformer=StandardScaler()
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimator.fit(X[train_rows], y[train_rows])
    score = r2(y[test_rows], estimator.predict(X[test_rows]))
    return {"estimator": "MLPRegressor(32, tanh, adam), scaled X and y", "held_out_r2": score}


def _write(trainer: OrtGradientOptimizer, folder: str, report: dict[str, Any]) -> dict[str, str]:
    os.makedirs(folder, exist_ok=True)
    files = {
        "model": os.path.join(folder, "model.onnx"),
        "training_step": os.path.join(folder, "training_step.onnx"),
        "report": os.path.join(folder, "report.json"),
    }
    onnx.save(trainer.get_trained_onnx(), files["model"])
    onnx.save(trainer.training_step_.model, files["training_step"])
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no loss_curve.png", file=sys.stderr)
    else:
        files["loss_curve"] = os.path.join(folder, "loss_curve.png")
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(range(1, len(report["train_losses"]) + 1), report["train_losses"], label="train")
        if report["held_out_losses"]:
            ax.plot(
                range(1, len(report["held_out_losses"]) + 1),
                report["held_out_losses"],
                label="held out",
            )
        ax.set_xlabel("epoch")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(files["loss_curve"], dpi=100)
        plt.close(fig)
    with open(files["report"], "w") as handle:
        json.dump({**report, "files": files}, handle, indent=2)
    return files


def _bar(total: int) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="training", unit="epoch")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        run(args)
    except gk.GraphkitError as exc:
        print(f"graphkit-train: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
