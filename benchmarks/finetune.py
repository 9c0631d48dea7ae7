"""Fine-tuning large weights: peak memory and time per batch of graphkit against PyTorch.

    make bench-finetune-env   # once (the Llama rows): .venv-bench-finetune, as below
    python benchmarks/finetune.py [--quick] [--only embedding|llama] [--who WORD]
                                  [--batches 20] [--llama-batches 5] [--workdir DIR]
                                  [--output FILE]

The environment of the Llama rows (the export and the torch contender; transformers is
no dependency of graphkit, so it is not in ``.venv``)::

    python3 -m venv .venv-bench-finetune
    .venv-bench-finetune/bin/python -m pip install --upgrade pip
    .venv-bench-finetune/bin/python -m pip install torch==2.13.0 transformers==4.57.6 \\
        onnx numpy psutil

(torch==2.13.0 by name: the CPU wheel on this machine; an unpinned torch pulls CUDA.)

What is timed: fine-tuning with plain SGD (constant learning rate, no momentum, no
weight decay), every batch's loss computed, the same data, the same initial weights and
the same batches in the same order (no shuffling) for every contender. Each contender
runs in a process of its own, one process per row (model x variant x contender), which
starts from nothing: it loads the model from its files, trains ``--warmup`` batches
(untimed: session building, first-touch allocations), then trains ``--batches`` batches
timed as one run, three times for the embedding model (once for the decoder); *ms /
batch* is the best run's time over its batches. *loss* is the mean batch loss of the
first timed run; ≠ marks one that differs from
PyTorch's by more than 1e-4 relative. *peak MB* is the process's peak resident memory
(VmHWM, read from /proc/self/status at the end: imports, loading, training), and
*x weights* that peak over the size of the weights' file (``model.onnx.data``).

Models, each written once per size by this process into a cache folder (``--workdir``,
default ``/tmp/graphkit-finetune``; kept between runs, the folder's name says the size)
as an ONNX graph whose weights are external data in one file, ``model.onnx.data``:

* **embedding**: Gather of int64 token ids [N, 8] over a table [V, 256] float32,
  ReduceMean over the 8 tokens, MatMul by a head [256, 4], cross-entropy over 4 classes;
  batches of 64 rows. Tables of 1 GiB and 2.3 GiB (``--quick``: 50 MiB). The table is
  written to ``model.onnx.data`` in chunks, with the ONNX tensors' external-data entries
  (location, offset, length) pointing into it: the file ``onnx.save_model(...,
  save_as_external_data=True, all_tensors_to_one_file=True, location="model.onnx.data")``
  writes, without holding the table in memory. PyTorch's contender reads the same file
  (``np.memmap`` at each tensor's offset, copied: the module owns its weights, as after
  loading a checkpoint): ``nn.Embedding`` (dense gradient, torch's default), mean,
  ``nn.Linear(256, 4, bias=False)`` (its weight is the head transposed),
  ``F.cross_entropy``.
* **llama**: a Llama-shaped decoder (``transformers.LlamaConfig`` with TinyLlama's shape:
  22 layers, hidden 2048, intermediate 5632, 32 heads, 4 key/value heads, vocabulary
  32000; ``--quick``: 2 layers, hidden 64, intermediate 128, 4 heads, 2 key/value heads,
  vocabulary 256), random weights (seed 0; the RMSNorm weights perturbed so that no two
  initializers are equal, or the exporter would merge them), sequences of 128 tokens
  (``--quick``: 16), batch 1. Exported by ``torch.onnx.export`` (TorchScript exporter,
  opset 17, no constant folding, eager attention with an explicit 4-D causal mask:
  transformers' own mask builder uses ``vmap``, which the exporter cannot trace; static
  shapes [1, T]), in ``.venv-bench-finetune``. Exported with a dynamic batch axis
  (``dynamic_axes={"input_ids": {0: "N"}, ...}``), the graph is refused by graphkit's
  native backend (onnx-ad 0.3.0): "MissingGradientError: ... Concat node
  '/m/model/layers.1/self_attn/Concat_4': Concat is differentiable in reverse only where
  the concatenated extent of each operand is declared; '/m/model/layers.1/self_attn/
  Neg_1_output_0' has none" (rotate_half's Concat); ort_training trains either. The
  export outputs logits [N, T, V]; the graph is then edited: the initializers lose the
  wrapper's ``m.`` prefix (they are named as in ``state_dict()``), and a
  ``Gather(axis=1)`` of position T-1 is appended, whose output ``last_logits`` [N, V]
  becomes the graph's only output. The loss of every contender is the cross-entropy of
  the last position's logits against a label (N,) (random tokens): graphkit's
  ``loss="cross_entropy"`` on ``last_logits``, torch's ``F.cross_entropy(logits[:, -1],
  label)``. PyTorch's contender builds ``LlamaForCausalLM`` and copies every parameter
  from ``model.onnx.data`` by name.

Variants: **full** (every weight trained; skipped, with the reason printed, where the
weights' size x 4 exceeds 80% of MemAvailable) and **frozen base** (embedding: only the
head; llama: the last 2 decoder blocks, the final norm and ``lm_head``; torch:
``requires_grad_(False)`` on the others, which the optimizer does not hold).

Contenders: graphkit's ``Trainer`` (the whole graph, ``loss="cross_entropy"``,
``optimizer=graphkit.optimizers.sgd(learning_rate=LR)``: a constant rate, as torch's)
on the ``native`` and on the ``ort_training`` backend, the native one again with
``rollback="checkpoint"`` (no copy of the trained state per epoch; its timed runs
include writing the checkpoint when each fit starts and after its epoch), and PyTorch eager
(``torch.optim.SGD``, ``torch.set_num_threads(cores)``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from report import default_output, header, machine, write  # noqa: E402

GRAPHKIT_PYTHON = Path(sys.executable)
BENCH_PYTHON = ROOT / ".venv-bench-finetune" / "bin" / "python"
WORKDIR = Path("/tmp/graphkit-finetune")
THREADS = os.cpu_count() or 1
LR = {"embedding": 0.1, "llama": 0.01}
WARMUP = 2  # untimed batches
# timed runs of the same batches, the best reported (the first can still allocate)
REPEATS = {"embedding": 3, "llama": 1}
TOLERANCE = 1e-4  # relative, on the timed batches' mean loss
MEMORY_FACTOR = 3.5  # a full fine-tuning row needs about weights x this
MEMORY_SHARE = 0.8  # of MemAvailable
CONTENDER_TIMEOUT = 3 * 3600  # seconds
MiB = 2**20

# -- models ----------------------------------------------------------------------------

EMBED_DIM, TOKENS, CLASSES, EMBED_BATCH = 256, 8, 4, 64
EMBEDDING_SIZES = {"1 GiB": 2**30, "2.3 GiB": int(2.3 * 2**30)}
EMBEDDING_QUICK = {"50 MiB": 50 * MiB}

LLAMA = dict(  # TinyLlama-1.1B's shape
    num_hidden_layers=22,
    hidden_size=2048,
    intermediate_size=5632,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
)
LLAMA_QUICK = dict(
    num_hidden_layers=2,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
LLAMA_SEQ, LLAMA_SEQ_QUICK, LLAMA_BATCH = 128, 16, 1


@dataclass
class Model:
    """A model written in its cache folder: ``model.onnx`` + ``model.onnx.data``,
    ``data.npz`` (X, y: the warm-up batches, then the timed ones) and ``spec.json``
    (written last: a folder without it is incomplete)."""

    kind: str  # "embedding" or "llama"
    title: str
    folder: Path

    @property
    def spec(self) -> dict:
        return json.loads((self.folder / "spec.json").read_text())

    @property
    def weights_bytes(self) -> int:
        return (self.folder / "model.onnx.data").stat().st_size


def _external(name: str, shape: tuple, offset: int, length: int, data_type: int):
    """A tensor whose bytes are at ``offset`` in ``model.onnx.data``."""
    from onnx import TensorProto

    tensor = TensorProto(name=name, data_type=data_type, dims=list(shape))
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "model.onnx.data"), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    return tensor


def _key_value(entry) -> tuple[str, str]:
    return entry.key, entry.value


def write_embedding(folder: Path, table_bytes: int, rows: int) -> None:
    """The embedding model with a table of ``table_bytes`` (rounded down to whole rows),
    written in chunks (never whole in memory), and ``rows`` rows of data."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    vocab = table_bytes // (EMBED_DIM * 4)
    rng = np.random.default_rng(0)
    align = 4096
    with open(folder / "model.onnx.data", "wb") as f:
        chunk = 2**16
        for start in range(0, vocab, chunk):
            n = min(chunk, vocab - start)
            (0.1 * rng.standard_normal((n, EMBED_DIM), dtype=np.float32)).tofile(f)
        table_length = f.tell()
        head_offset = -(-table_length // align) * align
        f.write(b"\0" * (head_offset - table_length))
        head = (0.1 * rng.standard_normal((EMBED_DIM, CLASSES))).astype(np.float32)
        head.tofile(f)
    table = _external("table", (vocab, EMBED_DIM), 0, table_length, TensorProto.FLOAT)
    head_tensor = _external("head", head.shape, head_offset, head.nbytes, TensorProto.FLOAT)
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["embedded"], axis=0),
        helper.make_node("ReduceMean", ["embedded", "token_axis"], ["pooled"], keepdims=0),
        helper.make_node("MatMul", ["pooled", "head"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", TOKENS])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", CLASSES])],
        [table, head_tensor, numpy_helper.from_array(np.array([1], np.int64), "token_axis")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    onnx.save(model, folder / "model.onnx")
    onnx.checker.check_model(str(folder / "model.onnx"))
    X = rng.integers(0, vocab, size=(rows, TOKENS), dtype=np.int64)
    y = rng.integers(0, CLASSES, size=rows, dtype=np.int64)
    np.savez(folder / "data.npz", X=X, y=y)
    spec = {
        "kind": "embedding",
        "lr": LR["embedding"],
        "batch_size": EMBED_BATCH,
        "trainable": {"full": ["table", "head"], "frozen base": ["head"]},
    }
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))


def _llama_wrapper(config: dict):
    """LlamaForCausalLM of ``config``, in a module that takes token ids and returns the
    logits [N, T, V], with an explicit causal mask (the exporter cannot trace
    transformers' own: it uses vmap)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    class Logits(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = LlamaForCausalLM(
                LlamaConfig(
                    **config,
                    tie_word_embeddings=False,
                    use_cache=False,
                    attention_dropout=0.0,
                    attn_implementation="eager",
                )
            )

        def forward(self, ids):
            T = ids.shape[1]
            mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
            return self.m(input_ids=ids, attention_mask=mask, use_cache=False).logits

    return Logits()


def export_llama(folder: Path, config: dict, seq: int, rows: int) -> None:
    """In ``.venv-bench-finetune``: the Llama model's ONNX graph, its data and its spec."""
    import tempfile
    import warnings

    import onnx
    import torch
    from onnx import helper, numpy_helper

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    module = _llama_wrapper(config).eval()
    with torch.no_grad():  # no two weights equal, or the exporter would merge them
        for key, value in module.state_dict().items():
            if "norm" in key:
                value.add_(0.1 * torch.randn_like(value))
    params = [k.removeprefix("m.") for k, _ in module.named_parameters()]
    rng = np.random.default_rng(0)
    X = rng.integers(0, config["vocab_size"], size=(rows, seq), dtype=np.int64)
    y = rng.integers(0, config["vocab_size"], size=rows, dtype=np.int64)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        raw = os.path.join(tmp, "raw.onnx")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module,
                (torch.from_numpy(X[:LLAMA_BATCH]),),
                raw,
                dynamo=False,
                opset_version=17,
                do_constant_folding=False,
                input_names=["input_ids"],
                output_names=["logits"],
                # a static batch (1): with dynamic_axes {0: "N"} graphkit's native
                # backend refuses the graph (see the docstring)
            )
        del module
        model = onnx.load(raw)  # with its weights, wherever the exporter put them
    graph = model.graph
    rename = {i.name: i.name.removeprefix("m.") for i in graph.initializer}
    for tensor in graph.initializer:
        tensor.name = rename[tensor.name]
    for node in graph.node:
        for i, name in enumerate(node.input):
            node.input[i] = rename.get(name, name)
    missing = sorted(set(params) - {i.name for i in graph.initializer})
    if missing:
        raise RuntimeError(f"the export merged or renamed weights: {missing[:10]}")
    # the loss reads the last position's logits: Gather(axis=1) of T-1, the only output
    graph.initializer.append(numpy_helper.from_array(np.array(seq - 1, np.int64), "last_position"))
    graph.node.append(
        helper.make_node("Gather", ["logits", "last_position"], ["last_logits"], axis=1)
    )
    del graph.output[:]
    vocab = config["vocab_size"]
    graph.output.append(
        helper.make_tensor_value_info("last_logits", onnx.TensorProto.FLOAT, [LLAMA_BATCH, vocab])
    )
    model.ir_version = min(model.ir_version, 9)
    onnx.save_model(
        model,
        str(folder / "model.onnx"),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="model.onnx.data",
        size_threshold=0,
    )
    del model
    onnx.checker.check_model(str(folder / "model.onnx"))
    np.savez(folder / "data.npz", X=X, y=y)
    layers = config["num_hidden_layers"]
    last = re.compile(rf"^model\.layers\.({layers - 2}|{layers - 1})\.|^model\.norm\.|^lm_head\.")
    spec = {
        "kind": "llama",
        "config": config,
        "seq": seq,
        "lr": LR["llama"],
        "batch_size": LLAMA_BATCH,
        "trainable": {"full": params, "frozen base": [p for p in params if last.match(p)]},
    }
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))


def embedding_models(quick: bool, workdir: Path, rows: int) -> list[Model]:
    out = []
    for label, size in (EMBEDDING_QUICK if quick else EMBEDDING_SIZES).items():
        folder = workdir / f"embedding-{size}-{rows}"
        if not (folder / "spec.json").exists():
            print(f"writing the embedding model ({label} table) in {folder}", flush=True)
            write_embedding(folder, size, rows)
        vocab = size // (EMBED_DIM * 4)
        title = (
            f"Embedding {vocab:,} x {EMBED_DIM} ({label} table) + mean + head {EMBED_DIM}x"
            f"{CLASSES}, batch {EMBED_BATCH}"
        )
        out.append(Model("embedding", title, folder))
    return out


def llama_models(quick: bool, workdir: Path, rows: int) -> list[Model]:
    config, seq = (LLAMA_QUICK, LLAMA_SEQ_QUICK) if quick else (LLAMA, LLAMA_SEQ)
    shape = "-".join(str(config[k]) for k in sorted(config))
    folder = workdir / f"llama-{shape}-{seq}-{rows}-static"
    c = config
    title = (
        f"Llama decoder {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
        f"intermediate {c['intermediate_size']}, {c['num_attention_heads']} heads "
        f"({c['num_key_value_heads']} kv), vocabulary {c['vocab_size']}, sequence {seq}, "
        f"batch {LLAMA_BATCH}"
    )
    if not (folder / "spec.json").exists():
        if not BENCH_PYTHON.exists():
            raise FileNotFoundError(f"{BENCH_PYTHON} is missing: see this script's docstring")
        print(f"exporting the Llama model in {folder}", flush=True)
        subprocess.run(
            [str(BENCH_PYTHON), __file__, "--export-llama", str(folder)]
            + ["--config", json.dumps(config), "--seq", str(seq), "--rows", str(rows)],
            check=True,
        )
    return [Model("llama", title, folder)]


# -- contenders (each in a process of its own) -----------------------------------------


@dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # "native", "native-checkpoint", "ort_training" (graphkit) or "torch"

    def python(self, model: str) -> Path:
        if self.kind == "torch" and model == "llama":
            return BENCH_PYTHON
        return GRAPHKIT_PYTHON


CONTENDERS = [
    Contender("graphkit native", "native"),
    # rollback="checkpoint": a failed epoch returns to the last checkpoint, not to a copy
    Contender("graphkit native, rollback to checkpoint", "native-checkpoint"),
    Contender("graphkit ort_training", "ort_training"),
    Contender("PyTorch eager", "torch"),
]
REFERENCE = "PyTorch eager"
VARIANTS = ["full", "frozen base"]


def _peak() -> int:
    """This process's peak resident memory (VmHWM), bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _load(folder: Path, warmup: int, batches: int):
    spec = json.loads((folder / "spec.json").read_text())
    data = np.load(folder / "data.npz")
    rows = spec["batch_size"] * (warmup + batches)
    X, y = data["X"][:rows], data["y"][:rows]
    if len(X) < rows:
        raise ValueError(f"{folder} holds {len(X)} rows, {rows} needed")
    split = spec["batch_size"] * warmup
    return spec, (X[:split], y[:split]), (X[split:], y[split:])


def run_graphkit(backend: str, folder: Path, variant: str, warmup: int, batches: int) -> dict:
    from graphkit import optimizers
    from graphkit_train import Trainer

    spec, (Xw, yw), (X, y) = _load(folder, warmup, batches)
    backend, _, rollback = backend.partition("-")
    # rollback="checkpoint": each fit starts a checkpoint of its own (a fit resuming
    # one that holds its epochs would train none); its writes, when the fit starts and
    # after its epoch, are in the timed run
    repeats = REPEATS[spec["kind"]]
    checkpoints: list[Path | None] = [None] * (1 + repeats)
    if rollback:
        checkpoints = [folder / f"{variant.replace(' ', '-')}-{k}.ckpt" for k in range(1 + repeats)]
        for path in checkpoints:
            path.unlink(missing_ok=True)  # type: ignore[union-attr]
    trainer = Trainer(
        str(folder / "model.onnx"),
        spec["trainable"][variant],
        rollback=rollback or "epoch",
        loss="cross_entropy",
        optimizer=optimizers.sgd(learning_rate=spec["lr"]),
        batch_size=spec["batch_size"],
        max_iter=1,
        shuffle=False,
        warm_start=True,  # the timed fit goes on from the warm-up's weights
        validation_every=0,
        backend=backend,
    )
    trainer.fit(Xw, yw, checkpoint=checkpoints[0])
    first = trainer.train_losses_[-1]
    times, losses = [], []
    for k in range(repeats):
        start = time.perf_counter()
        trainer.fit(X, y, checkpoint=checkpoints[1 + k])
        times.append(time.perf_counter() - start)
        losses.append(trainer.train_losses_[-1])
    return {"seconds": min(times), "batches": batches, "first": first, "loss": losses[0]}


def _tensors(folder: Path) -> dict[str, tuple[int, int, tuple]]:
    """name -> (offset, length, shape) of each float tensor in ``model.onnx.data``."""
    import onnx

    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    out = {}
    for tensor in model.graph.initializer:
        entries = dict(map(_key_value, tensor.external_data))
        if tensor.data_type == onnx.TensorProto.FLOAT and "offset" in entries:
            out[tensor.name] = (int(entries["offset"]), int(entries["length"]), tuple(tensor.dims))
    return out


def _read(folder: Path, where: tuple[int, int, tuple]) -> np.ndarray:
    """A tensor of ``model.onnx.data``, copied out of the file 64 MiB at a time (each
    piece mapped, copied, unmapped: the file's pages do not add up in the process's
    resident memory, whose peak is then the weights and one piece)."""
    offset, length, shape = where
    out = np.empty(length // 4, np.float32)
    piece = 16 * MiB  # floats
    for start in range(0, len(out), piece):
        n = min(piece, len(out) - start)
        mapped = np.memmap(folder / "model.onnx.data", np.float32, "r", offset + 4 * start, (n,))
        out[start : start + n] = mapped
        del mapped
    return out.reshape(shape)


def run_torch(folder: Path, variant: str, warmup: int, batches: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(THREADS)
    spec, warm, timed = _load(folder, warmup, batches)
    trainable = set(spec["trainable"][variant])
    tensors = _tensors(folder)
    if spec["kind"] == "embedding":
        table = torch.from_numpy(_read(folder, tensors["table"]))
        embedding = torch.nn.Embedding.from_pretrained(table, freeze="table" not in trainable)
        head = torch.nn.Linear(EMBED_DIM, CLASSES, bias=False)
        with torch.no_grad():
            head.weight.copy_(torch.from_numpy(_read(folder, tensors["head"]).T))
        head.weight.requires_grad_("head" in trainable)
        params = [p for p in (embedding.weight, head.weight) if p.requires_grad]

        def logits(ids):
            return head(embedding(ids).mean(dim=1))

    else:
        module = _llama_wrapper(spec["config"]).train()
        with torch.no_grad():
            for name, param in module.m.named_parameters():
                value = torch.from_numpy(_read(folder, tensors[name]))
                if value.shape != param.shape:
                    raise ValueError(f"{name}: {tuple(value.shape)} in the file, {param.shape}")
                param.copy_(value)
                param.requires_grad_(name in trainable)
                del value
        params = [p for p in module.parameters() if p.requires_grad]

        def logits(ids):
            return module(ids)[:, -1]

    optimizer = torch.optim.SGD(params, lr=spec["lr"])
    batch = spec["batch_size"]

    def epoch(X: np.ndarray, y: np.ndarray) -> float:
        losses = []
        for start in range(0, len(X), batch):
            ids = torch.from_numpy(X[start : start + batch])
            label = torch.from_numpy(y[start : start + batch])
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(logits(ids), label)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return float(np.mean(losses))

    first = epoch(*warm)
    times, losses = [], []
    for _ in range(REPEATS[spec["kind"]]):
        start = time.perf_counter()
        losses.append(epoch(*timed))
        times.append(time.perf_counter() - start)
    return {"seconds": min(times), "batches": batches, "first": first, "loss": losses[0]}


def contender_main(kind: str, folder: Path, variant: str, warmup: int, batches: int) -> None:
    """The ``--contender`` mode: one row, one JSON line on stdout (libraries' prints go to
    stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    try:
        if kind == "torch":
            result = run_torch(folder, variant, warmup, batches)
            import torch

            result["version"] = f"torch {torch.__version__}"
            if "transformers" in sys.modules:
                result["version"] += f", transformers {sys.modules['transformers'].__version__}"
        else:
            result = run_graphkit(kind, folder, variant, warmup, batches)
            from importlib.metadata import version

            from report import ONNXRUNTIME_BUILDS, _version

            build = next(d for d in ONNXRUNTIME_BUILDS if _version(d))
            result["version"] = f"graphkit {version('graphkit')}, {build} {version(build)}"
    except Exception as exc:
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        raise
    result["peak"] = _peak()
    out.write(json.dumps(result) + "\n")


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable"))


def run_contender(
    c: Contender, model: Model, variant: str, warmup: int, batches: int, log: Path
) -> dict:
    python = c.python(model.kind)
    if not python.exists():
        return {"error": f"{python} is missing: see this script's docstring"}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [str(python), __file__, "--contender", c.kind, "--folder", str(model.folder)]
    command += ["--variant", variant, "--warmup", str(warmup), "--batches", str(batches)]
    return contender_result(command, env, log)


def contender_result(command: list[str], env: dict, log: Path) -> dict:
    """Run a contender's process (its stderr to ``log``) and read the JSON line it prints
    last; ``{"error": ...}`` when it printed none or ran past the timeout."""
    with open(log, "w") as stderr:
        try:
            done = subprocess.run(
                command,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env=env,
                timeout=CONTENDER_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            return {"error": f"no answer within {CONTENDER_TIMEOUT} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    tail = log.read_text().strip().splitlines()[-1:]
    return {"error": f"exit {done.returncode}: {' '.join(tail)[:500]}"}


# -- the report ------------------------------------------------------------------------


def _number(x: float) -> str:
    """1,234 / 12.3 / 0.123: three significant digits below 100."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def table(model: Model, results: dict[tuple[str, str], dict]) -> list[str]:
    weights = model.weights_bytes
    lines = [
        f"## {model.title}",
        "",
        f"Weights' file: {_number(weights / MiB)} MB. Batches of {model.spec['batch_size']}, "
        f"SGD lr {model.spec['lr']}.",
        "",
        "| variant | contender | ms / batch | x torch | peak MB | x weights | loss |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    print(model.title)
    for variant in VARIANTS:
        ref = results.get((variant, REFERENCE), {})
        for c in CONTENDERS:
            r = results.get((variant, c.name))
            if r is None:
                continue
            if "seconds" not in r:
                why = r.get("skip") or r.get("error", "")
                lines.append(f"| {variant} | {c.name} | — | | | | not run: {why} |")
                print(f"  {variant:12s} {c.name:22s} not run: {why}")
                continue
            ms = r["seconds"] / r["batches"] * 1e3
            ratio = r["seconds"] / ref["seconds"] if "seconds" in ref else math.nan
            same = "seconds" not in ref or abs(r["loss"] - ref["loss"]) <= TOLERANCE * abs(
                ref["loss"]
            )
            loss = f"{r['loss']:.7g}" + ("" if same else " ≠")
            lines.append(
                f"| {variant} | {c.name} | {_number(ms)} | {ratio:.2f} | {r['peak'] / MiB:,.0f} | "
                f"{r['peak'] / weights:.2f} | {loss} |"
            )
            print(
                f"  {variant:12s} {c.name:22s} {ms:10.1f} ms  x{ratio:5.2f} torch  "
                f"peak {r['peak'] / MiB:8,.0f} MB  x{r['peak'] / weights:5.2f} weights  "
                f"loss {loss}  (warm-up loss {r['first']:.8g})"
            )
    return lines + [""]


def warmup_gaps(results: dict[tuple[str, str], dict]) -> float:
    """The largest relative difference of a contender's warm-up mean loss from torch's."""
    gaps = [0.0]
    for (variant, _), r in results.items():
        ref = results.get((variant, REFERENCE), {})
        if "first" in r and "first" in ref:
            gaps.append(abs(r["first"] - ref["first"]) / abs(ref["first"]))
    return max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models (a smoke run)")
    parser.add_argument("--only", action="append", help="models whose name has this word")
    parser.add_argument("--who", action="append", help="contenders whose name has this word")
    parser.add_argument("--batches", type=int, default=20, help="timed batches, embedding")
    parser.add_argument("--llama-batches", type=int, default=5, help="timed batches, llama")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed batches first")
    parser.add_argument("--workdir", type=Path, default=WORKDIR, help="the models' cache")
    parser.add_argument("--output", help="default: results/finetune.md (--quick: -quick.md)")
    # the processes this one starts
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--export-llama", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        contender_main(args.contender, args.folder, args.variant, args.warmup, args.batches)
        return
    if args.export_llama:
        export_llama(args.export_llama, json.loads(args.config), args.seq, args.rows)
        return
    if args.output is None:
        args.output = default_output(__file__, "quick" if args.quick else "")
    if args.who:
        CONTENDERS[:] = [c for c in CONTENDERS if any(w in c.name for w in args.who)]

    started = time.perf_counter()
    workdir = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    wanted = [k for k in ("embedding", "llama") if not args.only or any(w in k for w in args.only)]
    sections, versions, all_results = [], {}, {}
    for kind in wanted:
        batches = args.batches if kind == "embedding" else args.llama_batches
        rows = (args.warmup + batches) * (EMBED_BATCH if kind == "embedding" else LLAMA_BATCH)
        try:
            models = (embedding_models if kind == "embedding" else llama_models)(
                args.quick, workdir, rows
            )
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"{kind}: not run: {exc}", file=sys.stderr)
            sections += [f"## {kind}", "", f"Not run: {exc}", ""]
            continue
        for model in models:
            results: dict[tuple[str, str], dict] = {}
            if kind == "llama":
                spec = model.spec
                print("frozen base trains:", ", ".join(spec["trainable"]["frozen base"]))
            for variant in VARIANTS:
                need = model.weights_bytes * MEMORY_FACTOR
                available = mem_available()
                for c in CONTENDERS:
                    if variant == "full" and need > MEMORY_SHARE * available:
                        why = (
                            f"weights x {MEMORY_FACTOR} = {need / MiB:,.0f} MB > "
                            f"{MEMORY_SHARE:.0%} of MemAvailable ({available / MiB:,.0f} MB)"
                        )
                        print(f"skipping {model.title}, {variant}, {c.name}: {why}")
                        results[(variant, c.name)] = {"skip": why}
                        continue
                    log = model.folder / f"{c.kind}-{variant.replace(' ', '-')}.log"
                    results[(variant, c.name)] = r = run_contender(
                        c, model, variant, args.warmup, batches, log
                    )
                    if "version" in r:
                        versions[c.name.split()[0]] = r["version"]
            sections += table(model, results)
            all_results.update({(model.title, *k): v for k, v in results.items()})
            write(args.output, report(args, started, versions, sections, all_results))
    write(args.output, report(args, started, versions, sections, all_results, done=True))
    print(f"wrote {args.output}")


def report(args, started, versions, sections, results, done: bool = False) -> list[str]:
    libraries = "; ".join(
        [f"CPython {platform.python_version()}"] + [f"{k}: {v}" for k, v in versions.items()]
    )
    by_row = {(t, v, n): r for (t, v, n), r in results.items()}
    gap = warmup_gaps({(f"{t}|{v}", n): r for (t, v, n), r in by_row.items()})
    head = header(
        "Fine-tuning: peak memory and time per batch, graphkit against PyTorch",
        on=machine(THREADS),
        libraries=libraries,
    ) + [
        ("**A smoke run (tiny models): not results.** " if args.quick else "")
        + ("" if done else "**A run under way or cut short: the tables so far.** ")
        + "Each row is a process of its own (model x variant x contender) that loads the "
        f"model from its files, trains {args.warmup} batches untimed, then the timed batches "
        f"({args.batches} for the embedding model, {args.llama_batches} for the Llama "
        "decoder) in one run, three runs of them for the embedding model: **ms / batch** "
        "is the best run's time over its batches (a fit's first run can still allocate), "
        "**x torch** the ratio to PyTorch eager's (lower is faster). Same data, same "
        "initial weights, same batches in the same order, same updates (plain SGD, "
        "constant rate). *loss* is the first timed run's mean loss, ≠ marking one that "
        "differs from PyTorch's by more than 1e-4 relative. **peak MB** is the process's "
        "peak resident memory (VmHWM: imports, loading the model, training), **x weights** "
        "that peak over the weights' file size. *full* trains every weight, *frozen base* "
        "only the head (embedding) or the last 2 decoder blocks, the final norm and the "
        "lm_head (Llama). See the script's docstring for the models and the losses.",
        "",
    ]
    tail = [
        f"Largest relative difference of a contender's warm-up mean loss from PyTorch's: "
        f"{gap:.1e}. Total run: {time.perf_counter() - started:.0f} s."
    ]
    return head + sections + tail


if __name__ == "__main__":
    main()
