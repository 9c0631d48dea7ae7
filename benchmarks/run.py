"""Time graphkit against every peer on the same training work, in one run.

    python benchmarks/run.py [--quick] [--output benchmarks/results/run.md]

Each workload fixes the data, the initial weights and the updates (SGD, or AdamW with
weight decay 0.01, whose form torch, onnxruntime's training API and graphkit share).
Every contender starts from the same weights, takes the rows in the same order (no
shuffling: scikit-learn shuffles with its own generator), computes every batch's loss as
a real training loop does, and trains the same number of epochs; the table shows the
last epoch's mean batch loss next to each time, and a contender whose loss differs from
the first one's by more than 1e-4 (relative) is flagged. Times are the best of
``--repeat`` epochs (the contenders take turns of 2 epochs, the first untimed, so that
the machine's slow moments fall on all of them alike), per batch; ratios are to
hand-written numpy and to the fastest peer (a contender that is not graphkit).

Contenders: graphkit full training (one run per batch, ``k`` batches per run, one run
per epoch), graphkit forward/backward training, hand-written numpy, scikit-learn
(``MLPRegressor``/``MLPClassifier`` with the same updates; ``SGDRegressor``, which
updates per row, is timed but not comparable), PyTorch eager on the CPU with
onnxruntime's thread count, and onnxruntime's on-device training API (artifacts +
``Module``/``Optimizer``; it imports torch). Peak memory is measured on the
50,000-row MLP and on 256 of its rows (the runtime's fixed cost), each contender in a
process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from report import default_output, header, machine, versions, write

LR_SGD, LR_ADAM, WEIGHT_DECAY = 0.01, 0.001, 0.01
THREADS = os.cpu_count() or 1

# -- workloads -------------------------------------------------------------------------


@dataclass
class Workload:
    """Data, initial weights and the ONNX prediction graph of one benchmark."""

    name: str
    X: np.ndarray
    y: np.ndarray  # float targets (n, 1) for "mse", int64 classes (n,) for "ce"
    batch_size: int
    loss: str  # "mse" or "ce"
    layers: list[tuple[str, ...]]  # ("dense", W, b, activation) / ("conv", K, c, act)
    weights: dict[str, np.ndarray]
    model: onnx.ModelProto = field(repr=False, default=None)  # type: ignore[assignment]
    epochs: int = 3

    @property
    def batches(self) -> int:
        return -(-len(self.X) // self.batch_size)

    @property
    def footprint(self) -> int:
        """Bytes of data + weights + AdamW state (two moments per weight)."""
        weights = sum(w.nbytes for w in self.weights.values())
        return self.X.nbytes + self.y.nbytes + 3 * weights


def _dense_weights(sizes: list[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    weights = {}
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
        bound = 1 / np.sqrt(n_in)
        weights[f"W{i}"] = rng.uniform(-bound, bound, size=(n_in, n_out)).astype(np.float32)
        weights[f"b{i}"] = rng.uniform(-bound, bound, size=n_out).astype(np.float32)
    return weights


def _dense_model(sizes: list[int], weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    nodes, last = [], "X"
    for i in range(1, len(sizes)):
        out = "Y" if i == len(sizes) - 1 else f"h{i}"
        nodes.append(
            helper.make_node("Gemm", [last, f"W{i}", f"b{i}"], [out + "_" if out != "Y" else out])
        )
        if out != "Y":
            nodes.append(helper.make_node("Relu", [out + "_"], [out]))
        last = out
    graph = helper.make_graph(
        nodes,
        "dense",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", sizes[-1]])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def dense(name, X, y, sizes, batch_size, loss="mse", epochs=3, seed=0) -> Workload:
    weights = _dense_weights(sizes, np.random.default_rng(seed))
    layers = [
        ("dense", f"W{i}", f"b{i}", "relu" if i < len(sizes) - 1 else "")
        for i in range(1, len(sizes))
    ]
    return Workload(
        name, X, y, batch_size, loss, layers, weights, _dense_model(sizes, weights), epochs
    )


def cnn(X: np.ndarray, y: np.ndarray, batch_size: int, channels: int = 8) -> Workload:
    """Conv 3x3 (1 -> channels, same padding) + ReLU + dense 64*channels -> 10 on 8x8."""
    rng = np.random.default_rng(0)
    weights = {
        "K": (rng.normal(size=(channels, 1, 3, 3)) / 3).astype(np.float32),
        "c": np.zeros(channels, np.float32),
        **{k.replace("1", "2"): v for k, v in _dense_weights([64 * channels, 10], rng).items()},
    }
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["X", "K", "c"], ["conv"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["conv"], ["act"]),
            helper.make_node("Flatten", ["act"], ["flat"]),
            helper.make_node("Gemm", ["flat", "W2", "b2"], ["Y"]),
        ],
        "cnn",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1, 8, 8])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 10])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    layers = [("conv", "K", "c", "relu"), ("dense", "W2", "b2", "")]
    return Workload("small CNN, digits 8x8", X, y, batch_size, "ce", layers, weights, model)


def workloads(quick: bool) -> list[Workload]:
    rng = np.random.default_rng(1)
    scale = 10 if quick else 1
    X10 = rng.normal(size=(10_000 // scale, 10)).astype(np.float32)
    y10 = X10 @ rng.normal(size=(10, 1)) + rng.normal(scale=0.1, size=(len(X10), 1))
    y10 = y10.astype(np.float32)
    X100 = rng.normal(size=(50_000 // scale, 100)).astype(np.float32)
    y100 = np.tanh(X100[:, :5].sum(axis=1, keepdims=True)).astype(np.float32)
    from sklearn.datasets import load_digits

    digits = load_digits()
    Xd = (digits.data / 16).astype(np.float32)
    yd = digits.target.astype(np.int64)
    return [
        dense("linear regression 10,000x10, batch 10", X10, y10, [10, 1], 10),
        dense("linear regression 10,000x10, batch 1000", X10, y10, [10, 1], 1000, epochs=6),
        dense("MLP 10-10-1, batch 10", X10, y10, [10, 10, 1], 10),
        dense("MLP 10-10-1, batch 1000", X10, y10, [10, 10, 1], 1000, epochs=6),
        dense("MLP 100-256-256-1, 50,000 rows, batch 256", X100, y100, [100, 256, 256, 1], 256),
        dense("softmax classifier, digits, batch 32", Xd, yd, [64, 10], 32, loss="ce"),
        cnn(Xd.reshape(-1, 1, 8, 8), yd, 32),
    ]


# -- contenders ------------------------------------------------------------------------


class NotApplicable(Exception):
    """A contender that cannot do this workload's work (its table row is left out)."""


# each sets a contender up and returns its epoch: a callable that trains one epoch and
# returns its mean batch loss

Epoch = Callable[[], float]
Result = tuple[float, float]  # (seconds of the best epoch, mean batch loss of the last one)
TURN = 2
"""Epochs a contender runs in a row, the first untimed: it absorbs what the previous
contender left behind (thread pools still spinning: PyTorch's OpenMP threads spin for
200 ms after a parallel region; cold caches). Short turns spread each contender's timed
epochs over the whole workload: this machine has slow phases of 10-20 s, which turns of
3 epochs let fall on every timed epoch of one contender (a 1.5x outlier in one run of
three)."""


def timed_round_robin(w: Workload, repeat: int, epochs: dict[str, Epoch]) -> dict[str, Result]:
    """Every contender's epochs, in turns of ``TURN`` epochs (the first of each turn
    untimed) until each has ``max(w.epochs - 1, repeat)`` timed ones, so that the
    machine's slow moments fall on all of them alike; the best time and the last loss of
    each (every contender trains the same number of epochs)."""
    best = dict.fromkeys(epochs, np.inf)
    loss = dict.fromkeys(epochs, np.nan)
    turns = -(-max(w.epochs - 1, repeat) // (TURN - 1))
    for _ in range(turns):
        for name, epoch in epochs.items():
            for i in range(TURN):
                start = time.perf_counter()
                loss[name] = epoch()
                if i:
                    best[name] = min(best[name], time.perf_counter() - start)
    return {name: (best[name], loss[name]) for name in epochs}


def graphkit_full(w: Workload, optimizer: str, steps_per_run, backend: str | None = None) -> Epoch:
    import graphkit as gk
    from graphkit_train import OrtGradientOptimizer

    loss = "squared_error" if w.loss == "mse" else "cross_entropy"
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(w.model, loss),
        max_iter=1,
        batch_size=w.batch_size,
        learning_rate=_graphkit_optimizer(optimizer),
        shuffle=False,
        warm_start=True,
        validation_every=0,
        steps_per_run=steps_per_run,
        backend=backend,
    )

    def epoch() -> float:
        trainer.fit(w.X, w.y)
        return trainer.train_losses_[-1]

    return epoch


def graphkit_forward_backward(w: Workload, optimizer: str, backend: str | None = None) -> Epoch:
    from graphkit_train import OrtGradientForwardBackwardOptimizer

    trainer = OrtGradientForwardBackwardOptimizer(
        w.model,
        max_iter=1,
        batch_size=w.batch_size,
        learning_rate=_graphkit_optimizer(optimizer),
        learning_loss="squared_error" if w.loss == "mse" else "cross_entropy",
        shuffle=False,
        warm_start=True,
        validation_every=0,
        backend=backend,
    )

    def epoch() -> float:
        trainer.fit(w.X, w.y)
        return trainer.train_losses_[-1]

    return epoch


def _graphkit_optimizer(optimizer: str):
    from graphkit import optimizers

    if optimizer == "sgd":
        return optimizers.sgd(learning_rate=LR_SGD)
    return optimizers.adamw(weight_decay=WEIGHT_DECAY, learning_rate=LR_ADAM)


def numpy_contender(w: Workload, optimizer: str) -> Epoch:
    """Forward, loss, backward and update of dense ReLU layers, written by hand."""
    if any(layer[0] != "dense" for layer in w.layers):
        raise NotApplicable("no hand-written numpy convolution")
    p = {k: v.copy() for k, v in w.weights.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v2 = {k: np.zeros_like(v) for k, v in p.items()}
    t = [0]
    b1, b2, eps = np.float32(0.9), np.float32(0.999), np.float32(1e-8)

    def step(x: np.ndarray, y: np.ndarray) -> float:
        acts = [x]
        for _, W, b, act in w.layers:
            h = acts[-1] @ p[W] + p[b]
            acts.append(np.maximum(h, 0) if act else h)
        out = acts[-1]
        n = len(x)
        if w.loss == "mse":
            diff = out - y
            loss = float((diff * diff).mean())
            g = diff * np.float32(2 / diff.size)
        else:
            z = out - out.max(axis=1, keepdims=True)
            e = np.exp(z)
            s = e.sum(axis=1, keepdims=True)
            loss = float((np.log(s[:, 0]) - z[np.arange(n), y]).mean())
            g = e / s
            g[np.arange(n), y] -= 1
            g *= np.float32(1 / n)
        grads = {}
        for i in range(len(w.layers) - 1, -1, -1):
            _, W, b, act = w.layers[i]
            if i < len(w.layers) - 1 and w.layers[i][3]:
                g = g * (acts[i + 1] > 0)
            grads[W], grads[b] = acts[i].T @ g, g.sum(axis=0)
            if i:
                g = g @ p[W].T
        if optimizer == "sgd":
            for k in p:
                p[k] -= np.float32(LR_SGD) * grads[k]
        else:
            t[0] += 1
            c1, c2 = 1 - b1 ** t[0], 1 - b2 ** t[0]
            for k in p:
                p[k] *= np.float32(1 - LR_ADAM * WEIGHT_DECAY)
                m[k] = b1 * m[k] + (1 - b1) * grads[k]
                v2[k] = b2 * v2[k] + (1 - b2) * grads[k] * grads[k]
                p[k] -= np.float32(LR_ADAM) * (m[k] / c1) / (np.sqrt(v2[k] / c2) + eps)
        return loss

    def epoch() -> float:
        total = 0.0
        for start in range(0, len(w.X), w.batch_size):
            total += step(w.X[start : start + w.batch_size], w.y[start : start + w.batch_size])
        return total / w.batches

    return epoch


def torch_module(w: Workload):
    import torch

    modules = []
    for kind, W, b, act in w.layers:
        weight, bias = torch.from_numpy(w.weights[W].copy()), torch.from_numpy(w.weights[b].copy())
        if kind == "conv":
            layer = torch.nn.Conv2d(1, weight.shape[0], 3, padding=1)
            layer.weight.data, layer.bias.data = weight, bias
            modules += [layer, torch.nn.ReLU(), torch.nn.Flatten()]
            continue
        layer = torch.nn.Linear(*weight.shape)
        layer.weight.data, layer.bias.data = weight.T.contiguous(), bias
        modules += [layer] + ([torch.nn.ReLU()] if act else [])
    return torch.nn.Sequential(*modules)


def torch_contender(w: Workload, optimizer: str) -> Epoch:
    import torch

    torch.set_num_threads(THREADS)
    net = torch_module(w)
    if optimizer == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=LR_SGD)
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=LR_ADAM, weight_decay=WEIGHT_DECAY)
    criterion = torch.nn.MSELoss() if w.loss == "mse" else torch.nn.CrossEntropyLoss()
    X, y = torch.from_numpy(w.X), torch.from_numpy(w.y)

    def epoch() -> float:
        total = 0.0
        for start in range(0, len(X), w.batch_size):
            opt.zero_grad()
            loss = criterion(net(X[start : start + w.batch_size]), y[start : start + w.batch_size])
            loss.backward()
            opt.step()
            total += loss.item()
        return total / w.batches

    return epoch


def ort_training_api(w: Workload, optimizer: str) -> Epoch:
    """onnxruntime's on-device training: artifacts generated from the same graph."""
    import onnxruntime
    import torch  # noqa: F401  (onnxruntime.training needs it)
    from onnxruntime.training import api, artifacts

    folder = tempfile.mkdtemp(prefix="ort_artifacts_")
    artifacts.generate_artifacts(
        w.model,
        requires_grad=list(w.weights),
        loss=artifacts.LossType.MSELoss if w.loss == "mse" else artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.SGD if optimizer == "sgd" else artifacts.OptimType.AdamW,
        artifact_directory=folder,
    )
    onnxruntime.set_default_logger_severity(3)  # onnxruntime.training turns on info logs
    for file in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        path = os.path.join(folder, file)  # written with the installed onnx's IR version,
        model = onnx.load(path)  # newer than onnxruntime 1.19.2 reads
        model.ir_version = min(model.ir_version, 10)
        onnx.save(model, path)
    state = api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = api.Module(os.path.join(folder, "training_model.onnx"), state)
    opt = api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR_SGD if optimizer == "sgd" else LR_ADAM)
    module.train()

    def epoch() -> float:
        total = 0.0
        for start in range(0, len(w.X), w.batch_size):
            loss = module(w.X[start : start + w.batch_size], w.y[start : start + w.batch_size])
            opt.step()
            module.lazy_reset_grad()
            total += float(loss)
        return total / w.batches

    return epoch


def sklearn_mlp(w: Workload, optimizer: str) -> Epoch:
    """MLPRegressor / MLPClassifier with the same weights and updates (their squared
    error is halved: the learning rate is doubled to match). Adam without weight decay
    is not AdamW: only SGD runs."""
    if optimizer != "sgd" or any(layer[0] != "dense" for layer in w.layers):
        raise NotApplicable("same updates only for SGD on dense layers")
    if len(w.layers) < 2:
        raise NotApplicable("an MLP needs a hidden layer")
    from sklearn.neural_network import MLPClassifier, MLPRegressor

    hidden = tuple(w.weights[layer[1]].shape[1] for layer in w.layers[:-1])
    common = dict(
        hidden_layer_sizes=hidden,
        solver="sgd",
        momentum=0.0,
        alpha=0.0,
        batch_size=w.batch_size,
        shuffle=False,
        max_iter=1,
    )
    if w.loss == "mse":
        net = MLPRegressor(learning_rate_init=2 * LR_SGD, **common)
        target = w.y[:, 0]
    else:
        net = MLPClassifier(learning_rate_init=LR_SGD, **common)
        target = w.y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net.partial_fit(
            w.X[:2], target[:2], **({"classes": np.arange(10)} if w.loss == "ce" else {})
        )
    net.coefs_ = [w.weights[layer[1]].copy() for layer in w.layers]
    net.intercepts_ = [w.weights[layer[2]].copy() for layer in w.layers]
    scale = 2.0 if w.loss == "mse" else 1.0

    def epoch() -> float:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            net.partial_fit(w.X, target)
        # loss_curve_ holds the epoch's mean of per-batch losses (x batch size / rows)
        return scale * net.loss_curve_[-1]

    return epoch


def sklearn_sgd_regressor(w: Workload, optimizer: str) -> Epoch:
    """SGDRegressor updates after every row: the same data, another algorithm."""
    if optimizer != "sgd" or w.loss != "mse" or len(w.layers) != 1:
        raise NotApplicable("linear regression with SGD only")
    from sklearn.linear_model import SGDRegressor

    reg = SGDRegressor(
        penalty=None, learning_rate="constant", eta0=LR_SGD, shuffle=False, max_iter=1, tol=None
    )
    target = w.y[:, 0]

    def epoch() -> float:
        reg.partial_fit(w.X, target)
        return float(np.mean((reg.predict(w.X) - target) ** 2))

    return epoch


CONTENDERS: dict[str, Callable[[Workload, str], Epoch]] = {
    "graphkit full, 1 step per run": lambda w, o: graphkit_full(w, o, 1),
    "graphkit full, 10 steps per run": lambda w, o: graphkit_full(w, o, 10),
    "graphkit full, 1 epoch per run": lambda w, o: graphkit_full(w, o, "epoch"),
    "graphkit forward/backward": graphkit_forward_backward,
    # the native backend (standard-ONNX gradients, graphkit/backends/native)
    "graphkit native, 1 epoch per run": lambda w, o: graphkit_full(w, o, "epoch", "native"),
    "graphkit native forward/backward": lambda w, o: graphkit_forward_backward(w, o, "native"),
    "numpy (hand-written)": numpy_contender,
    "scikit-learn MLP": sklearn_mlp,
    "scikit-learn SGDRegressor (per row)": sklearn_sgd_regressor,
    "PyTorch eager": torch_contender,
    "onnxruntime training API": ort_training_api,
}
NOT_COMPARABLE = {"scikit-learn SGDRegressor (per row)"}


def is_graphkit(name: str) -> bool:
    return name.startswith("graphkit")


# -- memory ----------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


FIXED_COST_ROWS = 256


def memory_child(contender: str, quick: bool, rows: int | None) -> None:
    """In a process of its own: peak memory of training the 50,000-row MLP (its first
    ``rows`` rows when given), beyond what the process held before the data existed."""
    import torch  # noqa: F401  (every child imports the same modules first)

    import graphkit_train  # noqa: F401

    w = workloads(quick)[4]
    w.epochs = 1
    if rows is not None:
        w.X, w.y = w.X[:rows].copy(), w.y[:rows].copy()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak (VmHWM): imports and data creation are not counted
    before = rss_bytes()
    epoch = CONTENDERS[contender](w, "adamw")
    for _ in range(w.epochs):
        epoch()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
    print(
        json.dumps(
            {"extra": peak - before, "data": w.X.nbytes + w.y.nbytes, "footprint": w.footprint}
        )
    )


def measure_memory(quick: bool) -> dict[str, dict[str, int]]:
    """Each contender's peak memory on the 50,000 rows, and on 256 of them: the
    second is the runtime's fixed cost (sessions, arenas, graphs), which does not grow
    with the data."""
    out = {}
    for name in [
        "graphkit full, 1 epoch per run",
        "graphkit forward/backward",
        "numpy (hand-written)",
        "PyTorch eager",
        "onnxruntime training API",
    ]:
        measured = {}
        for rows in (None, FIXED_COST_ROWS):
            run = subprocess.run(
                [sys.executable, __file__, "--memory-child", name]
                + (["--quick"] if quick else [])
                + ([] if rows is None else ["--memory-rows", str(rows)]),
                capture_output=True,
                text=True,
                check=False,
            )
            if run.returncode != 0:
                print(f"memory of {name} failed: {run.stderr[-500:]}", file=sys.stderr)
                break
            measured[rows] = json.loads(run.stdout.strip().splitlines()[-1])
        else:
            out[name] = {**measured[None], "fixed": measured[FIXED_COST_ROWS]["extra"]}
    return out


# -- the run ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the rows (a smoke run)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--output", default=str(default_output(__file__)))
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--memory-rows", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        memory_child(args.memory_child, args.quick, args.memory_rows)
        return

    started = time.perf_counter()
    lines = header(
        "graphkit against numpy, scikit-learn, PyTorch and onnxruntime's training API",
        on=machine(THREADS),
        libraries=versions("scikit-learn", "torch"),
    ) + [
        f"Per-batch time of the best of {args.repeat} or more epochs, the contenders "
        f"taking turns of {TURN} epochs (the first untimed); **x numpy** is the ratio to "
        "hand-written numpy, **x best peer** to the fastest contender that is not "
        "graphkit (lower is faster). Same data, same initial weights, same rows in the "
        "same order, same updates (SGD lr 0.01; AdamW lr 0.001, weight decay 0.01); "
        "*loss* is the last epoch's mean batch loss, and ≠ marks "
        "one that differs from the first contender's by more than 1e-5 (SGD) or 1e-3 "
        "(AdamW, whose division by sqrt(v) amplifies float32 rounding) relative. "
        "onnxruntime's AdamW is not quite torch's (its losses differ by 1e-3 to 1e-2); "
        "scikit-learn reports its epoch loss weighted by batch size, which differs when the "
        "last batch is short.",
        "",
    ]
    summary = {}
    for w in workloads(args.quick):
        for optimizer in ("sgd", "adamw"):
            epochs: dict[str, Epoch] = {}
            for name, contender in CONTENDERS.items():
                try:
                    epochs[name] = contender(w, optimizer)
                except NotApplicable:
                    continue
                except ImportError as exc:
                    print(f"{name}: not installed ({exc})", file=sys.stderr)
            results = timed_round_robin(w, args.repeat, epochs)
            del epochs  # the contenders' sessions and buffers
            numpy_time = results.get("numpy (hand-written)", (np.nan,))[0]
            peers = [
                t for n, (t, _) in results.items() if not is_graphkit(n) and n not in NOT_COMPARABLE
            ]
            best_peer = min(peers) if peers else np.nan
            reference = next(iter(results.values()))[1]
            title = (
                f"{w.name}, {'SGD' if optimizer == 'sgd' else 'AdamW'} ({w.batches} batches/epoch)"
            )
            lines += [
                f"## {title}",
                "",
                "| contender | µs / batch | x numpy | x best peer | loss |",
                "|---|---:|---:|---:|---:|",
            ]
            print(title)
            for name, (seconds, loss) in results.items():
                per_batch = seconds / w.batches * 1e6
                tolerance = 1e-5 if optimizer == "sgd" else 1e-3  # Adam divides by sqrt(v)
                same = abs(loss - reference) <= tolerance * abs(reference) or name in NOT_COMPARABLE
                mark = "" if same else " ≠"
                lines.append(
                    f"| {name} | {per_batch:.1f} | {seconds / numpy_time:.2f} | "
                    f"{seconds / best_peer:.2f} | {loss:.6g}{mark} |"
                )
                summary[(title, name)] = seconds / best_peer
                print(
                    f"  {name:38s} {per_batch:9.1f} us  x{seconds / numpy_time:5.2f} numpy  "
                    f"x{seconds / best_peer:5.2f} peer  loss {loss:.7g}{mark}"
                )
            lines.append("")
    memory = measure_memory(args.quick)
    if memory:
        lines += [
            "## Peak memory, MLP 100-256-256-1 on 50,000 rows, AdamW",
            "",
            "Peak memory of training beyond what the process held once the data existed "
            "(imports and data creation are not counted); *fixed* is the same measure for "
            f"training on {FIXED_COST_ROWS} of the rows: the runtime's fixed cost (sessions, "
            "arenas, graphs), which does not grow with the data. The ratios are the peak of "
            "data + training over data + weights + AdamW state, with and without the fixed cost.",
            "",
            "| contender | training MB | fixed MB | x (data + weights + state) | x without fixed |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, m in memory.items():
            ratio = (m["data"] + m["extra"]) / m["footprint"]
            net = (m["data"] + m["extra"] - m["fixed"]) / m["footprint"]
            lines.append(
                f"| {name} | {m['extra'] / 2**20:.0f} | {m['fixed'] / 2**20:.0f} | "
                f"{ratio:.2f} | {net:.2f} |"
            )
        lines.append("")
    lines.append(f"Total run: {time.perf_counter() - started:.0f} s.")
    write(args.output, lines)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
