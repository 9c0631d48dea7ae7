"""Time graphkit against its strongest peers on the same training work, in one run.

    make bench-envs   # once: .venv-bench-jax (JAX + optax), .venv-bench-torch (torch + onnx2torch)
    python benchmarks/peers.py [--quick] [--repeat 5] [--only WORD] [--contender WORD]
                               [--optimizer sgd|adamw] [--output FILE]
                               [--device cpu|cuda] [--one-python]

Contenders, each in a process of its own and in an environment of its own
(``benchmarks/contenders/``): graphkit full training (the whole epoch in one run) and
forward/backward training, each on the ``ort_training`` and the ``native`` backend;
PyTorch eager, ``torch.compile`` (inductor) and ``onnx2torch`` + torch (torch 2.13.0 CPU);
JAX ``jax.jit`` of one step and ``jax.jit`` of a ``lax.scan`` over the epoch's batches
(optax's ``sgd`` and ``adamw``). None of them is a dependency of graphkit.

Workloads: those of ``run.py`` (on its data: synthetic regression, scikit-learn's digits)
and six that users train, 100 batches an epoch of synthetic data (fixed seeds; labels
from a random linear teacher, 10 classes, cross-entropy): the MLP 784-512-512-10 at
batch 128; a CNN (Conv 3x3 1->16 and 16->32, each + ReLU + MaxPool 2, then Linear; 28x28
single-channel inputs, batch 64); a transformer encoder (input Linear 16->64 + learned
positions, 2 post-norm layers of d_model 64, 4 heads, feed-forward 128, dropout 0; mean
over the sequence of 32, Linear head; batch 32) exported by torch.onnx.export; an LSTM
classifier (16 -> 64, sequence 32, last hidden state, Linear head; batch 32), exported
the same way; a GRU classifier of the same shape (16 -> 64, sequence 32, last hidden
state, Linear head; batch 32); a bidirectional LSTM tagger (16 -> 2 x 32, sequence 32,
a Linear head 64 -> 10 at every step; batch 32), a label per token (the teacher on the
step's features) and the mean cross-entropy over the batch's tokens. ``--quick`` trains
3.5 batches an epoch instead (a smoke run).

``--device cuda`` trains every contender on the GPU (graphkit needs a CUDA build of
onnxruntime: ``onnxruntime-gpu`` for the native backend), in float32 throughout (TF32 off
in onnxruntime, torch and JAX); ``--one-python`` runs every contender in this Python,
for a machine whose one environment holds graphkit's needs, torch and JAX (a GPU box's
image) instead of ``make bench-envs``'s environments. Peak memory is the host's (VmHWM),
not the GPU's.

This process writes each workload once (data, initial weights, settings, and the ONNX
graph built from the same weights, or exported from the same torch module), and every
contender reads it: same data, same initial weights, same batches in the same order (no
shuffling, a short last batch included), same updates (SGD; AdamW in torch's form),
every batch's loss computed.

The contenders' processes live side by side and take turns of ``TURN`` epochs (the first
untimed), as in ``run.py``, so that the machine's slow moments fall on all of them alike.
Each reports the best epoch's time per batch, its first epoch (compilation and session
building included), the last epoch's mean batch loss and its peak memory (VmHWM). The
report is written again after every table, so that a run cut short (a time limit)
keeps what it measured, marked as partial.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import select
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "contenders"))

from report import default_output, header, machine, write  # noqa: E402
from spec import save  # noqa: E402

LR = {"sgd": 0.01, "adamw": 0.001}
WEIGHT_DECAY = 0.01
THREADS = os.cpu_count() or 1
TURN = 2  # epochs a contender runs in a row, the first untimed (see run.py)
PAUSE = 0.25  # seconds between two contenders' turns: spinning thread pools (OpenMP's
# spin for 200 ms after a parallel region, onnxruntime's too) of the process whose turn
# ended go idle before the next process starts
TOLERANCE = {"sgd": 1e-5, "adamw": 1e-3}  # relative, on the last epoch's mean loss
ANSWER_TIMEOUT = 900  # seconds a contender may take to set up or train an epoch

# -- contenders ------------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    name: str
    env: str  # "graphkit" (this process's Python), "torch" or "jax": see ENVS
    module: str  # in benchmarks/contenders/
    kind: str

    @property
    def is_graphkit(self) -> bool:
        return self.env == "graphkit"


ENVS = {
    "graphkit": Path(sys.executable),
    "torch": ROOT / ".venv-bench-torch" / "bin" / "python",
    "jax": ROOT / ".venv-bench-jax" / "bin" / "python",
}

CONTENDERS = [
    Contender("graphkit full, ort_training", "graphkit", "graphkit_peer", "full:ort_training"),
    Contender("graphkit full, native", "graphkit", "graphkit_peer", "full:native"),
    Contender(
        "graphkit fwd/bwd, ort_training", "graphkit", "graphkit_peer", "fwd_bwd:ort_training"
    ),
    Contender("graphkit fwd/bwd, native", "graphkit", "graphkit_peer", "fwd_bwd:native"),
    Contender("PyTorch eager", "torch", "torch_peer", "eager"),
    Contender("torch.compile", "torch", "torch_peer", "compile"),
    Contender("onnx2torch + torch", "torch", "torch_peer", "onnx2torch"),
    Contender("JAX jit, one step", "jax", "jax_peer", "jit"),
    Contender("JAX jit, lax.scan epoch", "jax", "jax_peer", "scan"),
]
REFERENCE = "PyTorch eager"  # the losses are compared to its

# -- workloads -------------------------------------------------------------------------


@dataclass
class Workload:
    """What every contender trains: data, initial weights, architecture, ONNX graph."""

    name: str
    X: np.ndarray
    # float targets (n, outputs) for "mse", int64 classes (n,) for "ce", int64 classes
    # (n, seq) for "token_ce"
    y: np.ndarray
    batch_size: int
    loss: str  # "mse", "ce" or "token_ce" (a label per token): see contenders/spec.py
    arch: dict  # {"kind": "sequential", "layers": [...]}, or a torch_models module's config
    weights: dict[str, np.ndarray]
    model: onnx.ModelProto = field(repr=False)
    skip: dict[str, str] = field(default_factory=dict)  # contender name -> why not

    @property
    def batches(self) -> int:
        return -(-len(self.X) // self.batch_size)

    def write(self, folder: Path, device: str = "cpu") -> None:
        settings = {
            "device": device,
            "name": self.name,
            "batch_size": self.batch_size,
            "loss": self.loss,
            "arch": self.arch,
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            "threads": THREADS,
        }
        save(folder, settings, self.X, self.y, self.weights)
        onnx.save(self.model, folder / "model.onnx")


def sequential_model(layers: list[dict], weights, input_shape: list) -> onnx.ModelProto:
    """The ONNX graph of dense / conv / relu / maxpool / flatten layers ending with a
    dense one: Gemm (W stored (in, out)), Conv, Relu, MaxPool, Flatten."""
    nodes, last = [], "X"
    outputs = weights[layers[-1]["W"]].shape[1]
    for i, layer in enumerate(layers):
        out = "Y" if i == len(layers) - 1 else f"h{i}"
        op = layer["op"]
        if op == "dense":
            nodes.append(helper.make_node("Gemm", [last, layer["W"], layer["b"]], [out]))
        elif op == "conv":
            pad = layer["pad"]
            inputs = [last, layer["K"], layer["c"]]
            nodes.append(helper.make_node("Conv", inputs, [out], pads=[pad] * 4))
        elif op == "maxpool":
            size = [layer["size"]] * 2
            nodes.append(
                helper.make_node("MaxPool", [last], [out], kernel_shape=size, strides=size)
            )
        else:
            nodes.append(
                helper.make_node({"relu": "Relu", "flatten": "Flatten"}[op], [last], [out])
            )
        last = out
    graph = helper.make_graph(
        nodes,
        "sequential",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", *input_shape])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", outputs])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _uniform(rng, fan_in: int, shape) -> np.ndarray:
    """torch's default initialization of Linear and Conv: U(-1/sqrt(fan_in), ...)."""
    bound = 1 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def _classes(rng, features: np.ndarray, classes: int = 10) -> np.ndarray:
    """Labels of a random linear teacher (learnable, balanced enough)."""
    teacher = rng.normal(size=(features.shape[1], classes))
    return (features @ teacher).argmax(axis=1).astype(np.int64)


def _rows(batch_size: int, batches: int, quick: bool) -> int:
    """A few batches and a short last one for a smoke run."""
    return 3 * batch_size + batch_size // 2 if quick else batches * batch_size


def from_run_py(quick: bool) -> list[Workload]:
    """run.py's workloads, on the same data and weights."""
    import run

    out = []
    for w in run.workloads(quick=False):
        layers = []
        for kind, W, b, act in w.layers:
            if kind == "conv":
                layers += [{"op": "conv", "K": W, "c": b, "pad": 1}, {"op": "relu"}]
                layers.append({"op": "flatten"})
            else:
                layers.append({"op": "dense", "W": W, "b": b})
                layers += [{"op": "relu"}] if act else []
        rows = _rows(w.batch_size, 0, True) if quick else len(w.X)
        arch = {"kind": "sequential", "layers": layers}
        X, y = w.X[:rows].copy(), w.y[:rows].copy()
        out.append(Workload(w.name, X, y, w.batch_size, w.loss, arch, w.weights, w.model))
    return out


def mlp784(quick: bool) -> Workload:
    rng = np.random.default_rng(784)
    sizes = [784, 512, 512, 10]
    weights, layers = {}, []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
        weights[f"W{i}"] = _uniform(rng, n_in, (n_in, n_out))
        weights[f"b{i}"] = _uniform(rng, n_in, n_out)
        layers += [{"op": "dense", "W": f"W{i}", "b": f"b{i}"}] + [{"op": "relu"}] * (i < 3)
    X = rng.normal(size=(_rows(128, 100, quick), 784)).astype(np.float32)
    model = sequential_model(layers, weights, [784])
    arch = {"kind": "sequential", "layers": layers}
    return Workload(
        "MLP 784-512-512-10, batch 128", X, _classes(rng, X), 128, "ce", arch, weights, model
    )


def cnn28(quick: bool) -> Workload:
    """Conv 3x3 1->16 + ReLU + MaxPool 2, Conv 3x3 16->32 + ReLU + MaxPool 2, Linear
    32*7*7 -> 10, on 28x28 single-channel inputs."""
    rng = np.random.default_rng(28)
    weights = {
        "K1": _uniform(rng, 9, (16, 1, 3, 3)),
        "c1": _uniform(rng, 9, 16),
        "K2": _uniform(rng, 16 * 9, (32, 16, 3, 3)),
        "c2": _uniform(rng, 16 * 9, 32),
        "W3": _uniform(rng, 32 * 49, (32 * 49, 10)),
        "b3": _uniform(rng, 32 * 49, 10),
    }
    layers = []
    for i in (1, 2):
        layers += [{"op": "conv", "K": f"K{i}", "c": f"c{i}", "pad": 1}, {"op": "relu"}]
        layers.append({"op": "maxpool", "size": 2})
    layers += [{"op": "flatten"}, {"op": "dense", "W": "W3", "b": "b3"}]
    X = rng.uniform(size=(_rows(64, 100, quick), 1, 28, 28)).astype(np.float32)
    y = _classes(rng, X.reshape(len(X), -1) - 0.5)
    model = sequential_model(layers, weights, [1, 28, 28])
    arch = {"kind": "sequential", "layers": layers}
    return Workload(
        "CNN 2x(Conv+ReLU+MaxPool)+Linear, 28x28, batch 64", X, y, 64, "ce", arch, weights, model
    )


def exported(
    name: str, arch: dict, X: np.ndarray, y: np.ndarray, batch_size: int, loss: str = "ce"
) -> Workload:
    """A torch_models module's initial weights (seed 0) and its ONNX export (TorchScript
    exporter, opset 17, no constant folding, so the initializers keep their state_dict
    names, which the JAX contender reads: an LSTM's or a GRU's, either direction, stay
    whole initializers that Slice + Concat nodes reorder into ONNX's gate order)."""
    import torch
    from torch_models import build

    torch.manual_seed(0)
    module = build(arch, None)
    with torch.no_grad():  # no two weights equal, or the exporter would merge them
        for key, value in module.state_dict().items():
            if "norm" in key or key == "pos":
                value.add_(0.1 * torch.randn_like(value))
    weights = {k: v.detach().numpy().copy() for k, v in module.state_dict().items()}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.onnx")
        with warnings.catch_warnings():  # the TorchScript exporter's deprecation, RNN's
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                (torch.from_numpy(X[:batch_size]),),
                path,
                dynamo=False,
                opset_version=17,
                do_constant_folding=False,
                input_names=["X"],
                output_names=["Y"],
                dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}},
            )
        model = onnx.load(path)
    model.ir_version = min(model.ir_version, 9)
    names = {i.name for i in model.graph.initializer if i.data_type == TensorProto.FLOAT}
    assert names == set(weights), f"export renamed weights: {sorted(names ^ set(weights))}"
    return Workload(name, X, y, batch_size, loss, arch, weights, model)


def transformer(quick: bool) -> Workload:
    rng = np.random.default_rng(64)
    arch = dict(
        kind="transformer", d_in=16, d_model=64, heads=4, layers=2, d_ff=128, seq=32, classes=10
    )
    X = rng.normal(size=(_rows(32, 100, quick), 32, 16)).astype(np.float32)
    name = "transformer encoder 2x(d 64, 4 heads, ff 128), seq 32, batch 32"
    return exported(name, arch, X, _classes(rng, X.mean(axis=1)), 32)


def _no_gradient(op: str) -> str:
    """Why full training on ort_training does not train a recurrent workload."""
    return (
        f"onnxruntime-training 1.19.2's gradient builder has no gradient for {op} "
        "(MissingGradientError; forward/backward training uses its other builder, which has)"
    )


def lstm(quick: bool) -> Workload:
    rng = np.random.default_rng(32)
    arch = dict(kind="lstm", d_in=16, hidden=64, classes=10)
    X = rng.normal(size=(_rows(32, 100, quick), 32, 16)).astype(np.float32)
    w = exported(
        "LSTM 16->64, seq 32, batch 32", arch, X, _classes(rng, X[:, -8:].mean(axis=1)), 32
    )
    w.skip["graphkit full, ort_training"] = _no_gradient("LSTM")
    return w


def gru(quick: bool) -> Workload:
    rng = np.random.default_rng(33)
    arch = dict(kind="gru", d_in=16, hidden=64, classes=10)
    X = rng.normal(size=(_rows(32, 100, quick), 32, 16)).astype(np.float32)
    w = exported("GRU 16->64, seq 32, batch 32", arch, X, _classes(rng, X[:, -8:].mean(axis=1)), 32)
    w.skip["graphkit full, ort_training"] = _no_gradient("GRU")
    return w


def bilstm_tagger(quick: bool) -> Workload:
    rng = np.random.default_rng(34)
    arch = dict(kind="bilstm_tagger", d_in=16, hidden=32, classes=10)
    X = rng.normal(size=(_rows(32, 100, quick), 32, 16)).astype(np.float32)
    y = _classes(rng, X.reshape(-1, 16)).reshape(X.shape[:2])  # a label per token
    name = "bidirectional LSTM tagger 16->2x32, seq 32, batch 32"
    w = exported(name, arch, X, y, 32, loss="token_ce")
    w.skip["graphkit full, ort_training"] = (
        "onnxruntime-training 1.19.2's gradient builder has no gradient for LSTM "
        "(MissingGradientError)"
    )
    # its other builder differentiates LSTM, but its LSTMGrad kernel refuses the graph
    w.skip["graphkit fwd/bwd, ort_training"] = (
        "onnxruntime-training 1.19.2's LSTMGrad kernel takes the forward direction only "
        "(IncompatibleModelError: 'LSTM and LSTMGrad kernel only supports the forward "
        "direction for now. Provided direction: 2')"
    )
    return w


def workloads(quick: bool) -> list[Workload]:
    return [
        *from_run_py(quick),
        mlp784(quick),
        cnn28(quick),
        transformer(quick),
        lstm(quick),
        gru(quick),
        bilstm_tagger(quick),
    ]


# -- running the contenders ------------------------------------------------------------


@dataclass
class Outcome:
    """A contender's result on one workload and optimizer, or why there is none."""

    times: list[float] = field(default_factory=list)  # timed epochs, seconds
    first: float = math.nan  # the first epoch (compilation, sessions), seconds
    loss: float = math.nan  # the last epoch's mean batch loss
    peak: int = 0  # bytes: the process's peak resident memory
    extra: int = 0  # bytes: the peak beyond imports and data
    version: str = ""
    failed: str = ""  # why it did not run

    @property
    def best(self) -> float:
        return min(self.times) if self.times else math.nan


class Process:
    """One contender's worker (benchmarks/contenders/worker.py)."""

    def __init__(self, contender: Contender, folder: Path, optimizer: str, log: Path) -> None:
        python = ENVS[contender.env]
        if not python.exists():
            raise FileNotFoundError(f"{python} is missing: run `make bench-envs`")
        env = dict(os.environ)
        if contender.is_graphkit:  # this checkout's graphkit, wherever the venv points
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.log = open(log, "w")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [str(python), str(HERE / "contenders" / "worker.py"), contender.module]
            + [contender.kind, str(folder), optimizer],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )

    def ask(self, command: str | None = None) -> dict:
        """Send a command (None: wait for the setup's answer) and read the answer."""
        if command is not None:
            try:
                self.proc.stdin.write(command + "\n")
                self.proc.stdin.flush()
            except BrokenPipeError:
                pass  # it died: readline says so
        if not select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT)[0]:
            self.proc.kill()
            return {"error": f"no answer within {ANSWER_TIMEOUT} s"}
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            tail = Path(self.log.name).read_text().strip().splitlines()[-1:]
            return {"error": f"exit {self.proc.returncode}: {' '.join(tail)[:300]}"}
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def run_workload(w: Workload, optimizer: str, repeat: int, folder: Path) -> dict[str, Outcome]:
    """Every contender on one workload and optimizer, in turns."""
    outcomes: dict[str, Outcome] = {}
    running: dict[str, Process] = {}
    for c in CONTENDERS:
        outcome = outcomes[c.name] = Outcome()
        if c.name in w.skip:
            outcome.failed = w.skip[c.name]
            continue
        try:  # set up one at a time
            process = Process(c, folder, optimizer, folder / f"{c.module}-{c.kind}-{optimizer}.log")
        except FileNotFoundError as exc:
            outcome.failed = str(exc)
            continue
        reply = process.ask()
        if "ready" in reply:
            outcome.version = reply["version"]
            running[c.name] = process
        else:
            outcome.failed = reply.get("skip") or reply.get("error", "")
            process.close()
    turns = -(-repeat // (TURN - 1))
    epochs = 0
    for _ in range(turns):
        for name, process in list(running.items()):
            time.sleep(PAUSE)
            for i in range(TURN):
                reply = process.ask("epoch")
                if "error" in reply:
                    outcomes[name].failed = reply["error"]
                    process.close()
                    del running[name]
                    break
                if epochs == 0 and i == 0:
                    outcomes[name].first = reply["seconds"]
                elif i:
                    outcomes[name].times.append(reply["seconds"])
                outcomes[name].loss = reply["loss"]
        epochs += TURN
    for name, process in running.items():
        memory = process.ask("done")
        outcomes[name].peak, outcomes[name].extra = memory.get("peak", 0), memory.get("extra", 0)
        process.close()
    return outcomes


# -- the report ------------------------------------------------------------------------


def table(w: Workload, optimizer: str, outcomes: dict[str, Outcome]) -> tuple[list[str], dict]:
    """The markdown lines of one workload and optimizer; the summary's row."""
    peers = {n: o.best for n, o in outcomes.items() if not n.startswith("graphkit") and o.times}
    fastest = min(peers, key=peers.get) if peers else None
    best_peer = peers[fastest] if fastest else math.nan
    ref = outcomes.get(REFERENCE)
    reference = (
        ref.loss
        if ref and ref.times
        else next((o.loss for o in outcomes.values() if o.times), math.nan)
    )
    title = f"{w.name}, {'SGD' if optimizer == 'sgd' else 'AdamW'} ({w.batches} batches/epoch)"
    lines = [
        f"### {title}",
        "",
        "| contender | µs / batch | x fastest peer | first epoch s | peak MB | training MB "
        "| loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    print(title)
    for name, o in outcomes.items():
        if not o.times:
            lines.append(f"| {name} | — | | | | | not run: {o.failed} |")
            print(f"  {name:32s} not run: {o.failed}")
            continue
        per_batch = o.best / w.batches * 1e6
        same = abs(o.loss - reference) <= TOLERANCE[optimizer] * abs(reference)
        loss = f"{o.loss:.7g}" + ("" if same else " ≠")
        lines.append(
            f"| {name} | {per_batch:.1f} | {o.best / best_peer:.2f} | {o.first:.2f} | "
            f"{o.peak / 2**20:.0f} | {o.extra / 2**20:.0f} | {loss} |"
        )
        print(
            f"  {name:32s} {per_batch:10.1f} us  x{o.best / best_peer:5.2f} peer  "
            f"first {o.first:6.2f} s  peak {o.peak / 2**20:5.0f} MB  "
            f"(+{o.extra / 2**20:4.0f})  loss {loss}"
        )
    lines.append("")
    row: dict = {n: o.best / best_peer for n, o in outcomes.items() if o.times}
    row["fastest peer"] = f"{fastest} ({best_peer / w.batches * 1e6:.1f} µs)" if fastest else "—"
    gaps = {n: abs(o.loss - reference) / abs(reference) for n, o in outcomes.items() if o.times}
    apart = [n for n, gap in gaps.items() if gap > TOLERANCE[optimizer]]
    row["losses"] = f"≠ {', '.join(apart)}" if apart else f"{max(gaps.values(), default=0):.0e}"
    row["outcomes"] = outcomes
    return lines, {title: row}


def summary(rows: dict[str, dict]) -> list[str]:
    graphkit = [c.name for c in CONTENDERS if c.is_graphkit]
    lines = [
        "## Summary: time per batch relative to the fastest peer (lower is faster)",
        "",
        "*losses*: the largest relative difference of a contender's last loss from PyTorch "
        "eager's, or the contenders whose loss differs by more than the tolerance.",
        "",
        "| workload | " + " | ".join(graphkit) + " | fastest peer | losses |",
        "|---|" + "---:|" * len(graphkit) + "---|---:|",
    ]
    for title, row in rows.items():
        cells = [f"{row[n]:.2f}" if n in row else "—" for n in graphkit]
        lines.append(
            f"| {title} | " + " | ".join(cells) + f" | {row['fastest peer']} | {row['losses']} |"
        )
    return lines + [""]


def targets(rows: dict[str, dict]) -> list[str]:
    """The ratios issue 23's targets name, per workload (lower is better for graphkit).
    *full* is graphkit's full training on ort_training (native where ort_training does not
    train the workload); the last column compares peak resident memory, and in brackets
    the training MB."""

    def ratio(o: dict[str, Outcome], a: str, b: str) -> str:
        if a not in o or b not in o or not (o[a].times and o[b].times):
            return "—"
        return f"{o[a].best / o[b].best:.2f}"

    full, native = "graphkit full, ort_training", "graphkit full, native"
    fwd, fwd_native = "graphkit fwd/bwd, ort_training", "graphkit fwd/bwd, native"
    lines = [
        "## The targets of issue 23 (ratios of time per batch; lower is better for graphkit)",
        "",
        "| workload | full ÷ JAX scan | full ÷ torch eager | fwd/bwd ÷ full, ort_training "
        "| fwd/bwd ÷ full, native | native ÷ ort_training, full | native ÷ ort_training, "
        "fwd/bwd | peak memory ÷ torch eager's |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for title, row in rows.items():
        o = row["outcomes"]
        best = full if o[full].times else native
        memory = "—"
        if o[best].times and o[REFERENCE].times:
            peak = o[best].peak / o[REFERENCE].peak
            memory = f"{peak:.2f} ({o[best].extra / o[REFERENCE].extra:.2f})"
        cells = [
            ratio(o, best, "JAX jit, lax.scan epoch"),
            ratio(o, best, REFERENCE),
            ratio(o, fwd, full),
            ratio(o, fwd_native, native),
            ratio(o, native, full),
            ratio(o, fwd_native, fwd),
            memory,
        ]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few batches (a smoke run)")
    parser.add_argument("--repeat", type=int, default=5, help="timed epochs per contender")
    parser.add_argument("--only", action="append", help="workloads whose name has this word")
    parser.add_argument("--contender", action="append", help="contenders whose name has this")
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], action="append")
    parser.add_argument("--output", help="default: benchmarks/results/peers[-cuda].md")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--one-python", action="store_true", help="every contender in this Python")
    args = parser.parse_args()
    if args.output is None:
        args.output = default_output(__file__, "cuda" if args.device == "cuda" else "")
    if args.one_python:
        ENVS.update(dict.fromkeys(ENVS, Path(sys.executable)))
    repeat = 1 if args.quick else args.repeat
    if args.contender:
        CONTENDERS[:] = [c for c in CONTENDERS if any(x in c.name for x in args.contender)]

    started, load = time.perf_counter(), os.getloadavg()[0]
    sections, rows, versions = [], {}, {}
    chosen = [
        w
        for w in workloads(args.quick)
        if not args.only or any(word.lower() in w.name.lower() for word in args.only)
    ]
    optimizers = args.optimizer or ["sgd", "adamw"]
    with tempfile.TemporaryDirectory(prefix="graphkit-peers-") as tmp:
        for index, w in enumerate(chosen):
            folder = Path(tmp) / str(index)
            w.write(folder, args.device)
            for optimizer in optimizers:
                outcomes = run_workload(w, optimizer, repeat, folder)
                for c in CONTENDERS:
                    if outcomes[c.name].version:
                        versions[c.env] = outcomes[c.name].version
                lines, row = table(w, optimizer, outcomes)
                sections += lines
                rows.update(row)
                # written after every table, so that a run cut short keeps what it measured
                done = len(rows) == len(chosen) * len(optimizers)
                report = Report(args, repeat, started, load, versions, rows, sections)
                write(args.output, report.text(done).splitlines())
    print(f"wrote {args.output}")


@dataclass
class Report:
    """The markdown of a run, complete or so far."""

    args: argparse.Namespace
    repeat: int
    started: float
    load: float
    versions: dict[str, str]
    rows: dict[str, dict]
    sections: list[str]

    def text(self, done: bool) -> str:
        args = self.args
        libraries = "; ".join(
            [f"CPython {platform.python_version()}"]
            + [f"{env}: {v}" for env, v in self.versions.items()]
        )
        head = header(
            "graphkit against its strongest peers",
            on=machine(THREADS, gpu=args.device == "cuda"),
            libraries=libraries,
        ) + [
            (
                "Every contender on the GPU (`--device cuda`, float32: TF32 off). "
                if args.device == "cuda"
                else ""
            )
            + ("**A smoke run (a few batches): not results.** " if args.quick else "")
            + ("" if done else "**A run under way or cut short: the tables so far.** ")
            + f"Per-batch time of the best of {self.repeat} timed epochs, the contenders "
            f"(each in a process of its own) taking turns of {TURN} epochs, the first "
            "untimed; **x fastest peer** is the ratio to the fastest contender that is not "
            "graphkit. Same synthetic data (fixed seeds), same initial weights, same batches "
            "in the same order, same updates (SGD lr 0.01; AdamW lr 0.001, weight decay "
            "0.01, torch's form); *loss* is the last epoch's mean batch loss, ≠ marking one "
            "that differs from PyTorch eager's by more than 1e-5 (SGD) or 1e-3 (AdamW) "
            "relative. *first epoch* includes compilation (JAX, torch.compile) and building "
            "sessions (graphkit). *peak MB* is the process's peak resident memory (imports, "
            "data and training); *training MB* the peak beyond what it held once imports "
            "and data were loaded.",
            "",
        ]
        tail = [
            f"Total run: {time.perf_counter() - self.started:.0f} s; load average (1 min) "
            f"{self.load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end (this run's "
            "own processes count about 1: more means another program shared the cores)."
        ]
        return "\n".join(
            head
            + summary(self.rows)
            + targets(self.rows)
            + ["## Every contender", ""]
            + self.sections
            + tail
        )


if __name__ == "__main__":
    main()
