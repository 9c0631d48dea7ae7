"""LoRA fine-tuning: time per step and peak memory of graphkit against PyTorch + PEFT.

    make bench-lora           # .venv-bench-finetune (with peft), then the full run
    python benchmarks/lora.py [--quick] [--only llama|tiny] [--who WORD] [--steps 5]
                              [--warmup 2] [--workdir DIR] [--output FILE]
                              [--quantized-base]

The torch contender (and the exports) run in ``.venv-bench-finetune``, finetune.py's
environment with ``peft==0.21.2`` added (``make bench-finetune-env``); graphkit's in the
environment running this script (``.venv``).

What is timed: LoRA (rank 8, alpha 16, no dropout) trained with AdamW (lr 1e-3,
weight_decay 0.0, betas (0.9, 0.999), eps 1e-8: torch.optim.AdamW's defaults, which
graphkit.optimizers.adamw's are too; passed explicitly to both), the same data, the same
base weights, the same initial adapters and the same batches in the same order (no
shuffling) for every contender. Each contender runs in a process of its own, one process
per row, which starts from nothing: it loads the model from its files, adds the
adapters, trains ``--warmup`` steps (untimed: session building, first-touch
allocations), then trains the timed steps as one run, repeated (2 runs for the Llama
decoder, 3 for the tiny models; each run goes on from the previous one's adapters and
AdamW state): *ms / batch* is the best run's time over its steps. *loss* is the mean
step loss of the first timed run; ≠ marks one that differs from PyTorch + PEFT's by
more than 1e-4 relative. *peak MB* is the process's peak resident memory (VmHWM, read
from /proc/self/status at the end: imports, loading, training).

Models:

* **llama**: finetune.py's Llama-shaped decoder (TinyLlama-1.1B's shape, random weights,
  sequence 128, batch 1; ``--quick``: its 2-layer toy, sequence 16), its cached export
  and data (finetune.llama_models: the same cache folder, ``--workdir``, default
  ``/tmp/graphkit-finetune``), its loss: the cross-entropy of the last position's logits
  against a random label. Adapters on ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj``
  of every layer. *x base+state* is the peak over the base weights' bytes (the file
  ``model.onnx.data``) plus the adapters' state (the adapters and AdamW's two moments,
  3 x the adapters' bytes); the targets: ms / batch no slower than PyTorch + PEFT's,
  peak at most 1.2 x (base + adapters' state).
* **tiny**: tests/test_lora_peft.py's tiny Llama and tiny BERT (transformers configs,
  seed 0, hidden 32, 2 layers, vocabulary 64), exported by the TorchScript exporter
  (opset 18, no constant folding, static shapes [8, 32]) in ``.venv-bench-finetune``,
  adapters on the q and v projections (``q_proj``, ``v_proj``; ``query``, ``value``),
  the mean squared error against random targets (the logits' shape), batches of 8
  sequences of 32 tokens, 5 warm-up steps, 50 timed.

Contenders: graphkit's ``Trainer`` on the ``native`` and on the ``ort_training``
backend, on ``graphkit.lora.add_lora(graphkit.compat.load_model(path), ...)`` (the base
memory-mapped from its file, never copied; only the adapters trained, as the model's
LoRA record says), and PyTorch eager + PEFT (the torch model with the same weights,
``peft.get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=[...],
lora_dropout=0.0))``, its ``lora_A``/``lora_B`` set to graphkit's initial adapters
(``graphkit.lora.lora_state``, transposed, read from an .npz that a graphkit process
writes beside the model), ``torch.optim.AdamW`` on the trainable parameters,
``torch.set_num_threads(cores)``).

A quantized base (QLoRA): ``--quantized-base`` adds the variant ``"quantized base"`` to
the Llama rows: the same decoder with its linear layers' weights in int8, one scale per
output channel, behind ``DequantizeLinear`` (:func:`write_quantized_base`, written once
by the driver), the same adapters; graphkit's contenders only (the loss differs from the
float base's by the quantization; the table compares its memory with the float base's
weights).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import finetune  # noqa: E402
from finetune import BENCH_PYTHON, GRAPHKIT_PYTHON, THREADS, WORKDIR, MiB  # noqa: E402
from report import default_output, header, machine, write  # noqa: E402

RANK, ALPHA, SEED = 8, 16.0, 0  # SEED: add_lora's random_state (A's draw)
TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "tiny-llama": ["q_proj", "v_proj"],
    "tiny-bert": ["query", "value"],
}
# torch.optim.AdamW's defaults but the decay, passed to both optimizers
LR = 1e-3
ADAMW = {"b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
WARMUP = {"llama": 2, "tiny": 5}  # untimed steps
STEPS = {"llama": 5, "tiny": 50}  # timed steps per run
REPEATS = {"llama": 2, "tiny": 3}  # timed runs, the best reported
TOLERANCE = 1e-4  # relative, on the first timed run's mean loss
MEMORY_TARGET = 1.2  # peak / (base weights + adapters' state)
MEMORY_FACTOR = 2.0  # a LoRA row of the Llama decoder needs about weights x this
MEMORY_SHARE = 0.8  # of MemAvailable

TINY_BATCH, TINY_SEQ, TINY_VOCAB = 8, 32, 64

FLOAT_BASE = "float base"
QUANTIZED_BASE = "quantized base"  # the QLoRA row: see write_quantized_base


QUANTIZED_FOLDER = "int8"  # the quantized base, beside the float one in its cache folder


def write_quantized_base(folder: Path) -> Path:
    """The base of ``folder`` with each weight a ``Transpose`` hands to a ``MatMul`` (every
    linear layer and ``lm_head``; the embedding stays float) quantized to int8, one
    symmetric scale per output channel: ``DequantizeLinear(q, scale, 0, axis=0)``, whose
    output the ``Transpose`` reads. The quantized tensor keeps the weight's name, so
    add_lora's targets and the initial adapters are the float base's. Written once
    into ``folder / "int8"`` (external data beside it), by the driver: a contender's
    memory never holds the float weights. Returns the model's path."""
    import onnx
    from onnx import helper, numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor

    out = folder / QUANTIZED_FOLDER / "model.onnx"
    if out.exists():
        return out
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    where = finetune._tensors(folder)
    transposed = {n.input[0] for n in model.graph.node if n.op_type == "Transpose"}
    linear = {
        name for name, (_, _, shape) in where.items() if name in transposed and len(shape) == 2
    }
    kept, added = [], []
    for tensor in model.graph.initializer:
        value = finetune._read(folder, where[tensor.name]) if tensor.name in where else None
        if tensor.name not in linear:
            if value is not None:  # a float tensor of the data file (the embedding, norms)
                tensor = numpy_helper.from_array(value, tensor.name)
            elif tensor.data_location == onnx.TensorProto.EXTERNAL:  # a small constant
                load_external_data_for_tensor(tensor, str(folder))
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
            kept.append(tensor)
            continue
        scale = (np.abs(value).max(axis=1) / 127).astype(np.float32)
        quantized = np.round(value / scale[:, None]).astype(np.int8)
        kept.append(numpy_helper.from_array(quantized, tensor.name))
        added += [
            numpy_helper.from_array(scale, f"{tensor.name}.scale"),
            numpy_helper.from_array(np.zeros_like(quantized[:, 0]), f"{tensor.name}.zero"),
        ]
    nodes = []
    for name in sorted(linear):
        inputs = [name, f"{name}.scale", f"{name}.zero"]
        nodes.append(helper.make_node("DequantizeLinear", inputs, [f"{name}.float"], axis=0))
    for node in model.graph.node:
        if node.op_type == "Transpose" and node.input[0] in linear:
            node.input[0] = f"{node.input[0]}.float"
        nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept + added)
    opset = next(o for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if opset.version < 13:  # per-axis DequantizeLinear
        raise RuntimeError(f"opset {opset.version}: per-channel quantization needs 13")
    out.parent.mkdir(exist_ok=True)
    onnx.save_model(
        model, str(out), save_as_external_data=True, location="model.onnx.data", size_threshold=0
    )
    return out


# -- models ----------------------------------------------------------------------------


@dataclass
class Model:
    """A model in its cache folder: ``model.onnx`` (+ ``model.onnx.data`` for the Llama
    decoder), ``data.npz``, ``spec.json`` and the initial adapters (:attr:`adapters`)."""

    kind: str  # "llama", "tiny-llama" or "tiny-bert"
    title: str
    folder: Path

    @property
    def group(self) -> str:
        return "llama" if self.kind == "llama" else "tiny"

    @property
    def spec(self) -> dict:
        return json.loads((self.folder / "spec.json").read_text())

    @property
    def adapters(self) -> Path:
        targets = "-".join(TARGETS[self.kind])
        return self.folder / f"lora-r{RANK}-a{ALPHA:g}-{targets}-seed{SEED}.npz"

    @property
    def base_bytes(self) -> int:
        data = self.folder / "model.onnx.data"
        return (data if data.exists() else self.folder / "model.onnx").stat().st_size

    @property
    def state_bytes(self) -> int:
        """The adapters and AdamW's two moments, bytes."""
        with np.load(self.adapters) as found:
            return 3 * sum(found[k].nbytes for k in found.files if not k.startswith("__"))


def llama_model(quick: bool, workdir: Path, rows: int) -> Model:
    """finetune.py's cached Llama export (written by finetune.llama_models if missing)."""
    (model,) = finetune.llama_models(quick, workdir, rows)
    return Model("llama", model.title, model.folder)


def _tiny_module(kind: str):
    """tests/test_lora_peft.py's tiny model, as a module that takes token ids and returns
    the logits (Llama with an explicit causal mask: the exporter cannot trace
    transformers' own)."""
    import torch
    import transformers

    class Logits(torch.nn.Module):
        def __init__(self, model, causal: bool) -> None:
            super().__init__()
            self.m = model
            self.causal = causal

        def forward(self, ids):
            if self.causal:
                t = ids.shape[1]
                mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)[None, None]
                return self.m(input_ids=ids, attention_mask=mask, use_cache=False).logits
            return self.m(input_ids=ids).logits

    torch.manual_seed(0)
    shape = dict(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64)
    shape.update(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32)
    if kind == "tiny-llama":
        config = transformers.LlamaConfig(
            **shape,
            num_key_value_heads=2,
            attn_implementation="eager",
            tie_word_embeddings=False,
        )
        return Logits(transformers.LlamaForCausalLM(config).eval(), causal=True)
    config = transformers.BertConfig(
        **shape,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    return Logits(transformers.BertForSequenceClassification(config).eval(), causal=False)


def export_tiny(kind: str, folder: Path, rows: int) -> None:
    """In ``.venv-bench-finetune``: the tiny model's graph (TorchScript exporter, as
    tests/test_lora_peft.py exports it), its torch weights (``state.npz``: the torch
    contender loads them), its data and its spec."""
    import io
    import warnings

    import torch

    folder.mkdir(parents=True, exist_ok=True)
    net = _tiny_module(kind)
    ids = torch.zeros((TINY_BATCH, TINY_SEQ), dtype=torch.int64)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net, (ids,), f, dynamo=False, opset_version=18, do_constant_folding=False,
            input_names=["ids"], output_names=["logits"],
        )  # fmt: skip
    (folder / "model.onnx").write_bytes(f.getvalue())
    np.savez(folder / "state.npz", **{k: v.numpy() for k, v in net.state_dict().items()})
    with torch.no_grad():
        width = tuple(net(ids).shape[1:])
    rng = np.random.default_rng(0)
    X = rng.integers(0, TINY_VOCAB, size=(rows, TINY_SEQ), dtype=np.int64)
    y = rng.normal(size=(rows, *width)).astype(np.float32)
    np.savez(folder / "data.npz", X=X, y=y)
    spec = {"kind": kind, "batch_size": TINY_BATCH, "seq": TINY_SEQ, "output": list(width)}
    (folder / "spec.json").write_text(json.dumps(spec, indent=1))


def tiny_models(workdir: Path, rows: int) -> list[Model]:
    out = []
    for kind in ("tiny-llama", "tiny-bert"):
        folder = workdir / f"lora-{kind}-{TINY_BATCH}-{TINY_SEQ}-{rows}"
        if not (folder / "spec.json").exists():
            if not BENCH_PYTHON.exists():
                raise FileNotFoundError(f"{BENCH_PYTHON} is missing: see this script's docstring")
            print(f"exporting the {kind} model in {folder}", flush=True)
            subprocess.run(
                [str(BENCH_PYTHON), __file__, "--export-tiny", kind, "--folder", str(folder)]
                + ["--rows", str(rows)],
                check=True,
            )
        name = "Llama" if kind == "tiny-llama" else "BERT"
        title = (
            f"Tiny {name} (tests/test_lora_peft.py's: hidden 32, 2 layers, vocabulary "
            f"{TINY_VOCAB}), sequence {TINY_SEQ}, batch {TINY_BATCH}"
        )
        out.append(Model(kind, title, folder))
    return out


def write_adapters(kind: str, folder: Path, path: Path) -> None:
    """In graphkit's environment: the initial adapters every contender starts from,
    ``graphkit.lora.lora_state`` of the adapted model (graph layout: A [in, rank], B
    [rank, out]), and ``__names__``: for each adapter, its weight, A and B."""
    from graphkit import lora
    from graphkit.compat import load_model

    adapted = lora.add_lora(
        load_model(folder / "model.onnx"), TARGETS[kind], RANK, ALPHA, random_state=SEED
    )
    names = np.array([[a.weight, a.a, a.b] for a in lora.adapters(adapted)])
    state = lora.lora_state(adapted)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, __names__=names, **state)
    tmp.replace(path)


def ensure_adapters(model: Model) -> None:
    if model.adapters.exists():
        return
    subprocess.run(
        [str(GRAPHKIT_PYTHON), __file__, "--write-adapters", model.kind]
        + ["--folder", str(model.folder), "--path", str(model.adapters)],
        check=True,
    )


# -- contenders (each in a process of its own) -----------------------------------------


@dataclass(frozen=True)
class Contender:
    name: str
    kind: str  # "native", "ort_training" (graphkit) or "torch"

    @property
    def python(self) -> Path:
        return BENCH_PYTHON if self.kind == "torch" else GRAPHKIT_PYTHON


CONTENDERS = [
    Contender("graphkit native", "native"),
    Contender("graphkit ort_training", "ort_training"),
    Contender("PyTorch eager + PEFT", "torch"),
]
REFERENCE = "PyTorch eager + PEFT"
VARIANTS = [FLOAT_BASE]  # --quantized-base appends QUANTIZED_BASE (the Llama rows)


def _loss_name(kind: str) -> str:
    return "cross_entropy" if kind == "llama" else "squared_error"


def run_graphkit(
    backend: str, kind: str, folder: Path, variant: str, warmup: int, steps: int, repeats: int
) -> dict:
    from graphkit import lora, optimizers
    from graphkit.compat import load_model
    from graphkit_train import Trainer

    spec, (Xw, yw), (X, y) = finetune._load(folder, warmup, steps)
    # the weights stay mapped in their file; the quantized base is its own file
    path = folder / QUANTIZED_FOLDER / "model.onnx" if variant == QUANTIZED_BASE else folder
    base = load_model(path if variant == QUANTIZED_BASE else folder / "model.onnx")
    adapted = lora.add_lora(base, TARGETS[kind], RANK, ALPHA, random_state=SEED)
    del base
    model = Model(kind, "", folder)
    with np.load(model.adapters) as initial:
        for name, value in lora.lora_state(adapted).items():
            if not np.array_equal(value, initial[name]):
                raise RuntimeError(f"{name}: not the initial adapter of {model.adapters}")
    trainer = Trainer(
        adapted,  # trains the adapters its LoRA record names, nothing else
        loss=_loss_name(kind),
        optimizer=optimizers.adamw(learning_rate=LR, **ADAMW),
        batch_size=spec["batch_size"],
        max_iter=1,
        shuffle=False,
        warm_start=True,  # each fit goes on from the previous one's adapters and moments
        validation_every=0,
        backend=backend,
    )
    trainer.fit(Xw, yw)
    trained = sorted(trainer.update_step_.weights)
    if trained != sorted(lora.adapter_names(adapted)):
        raise RuntimeError(f"the trainer trains {trained[:6]}..., not the adapters")
    first = trainer.train_losses_[-1]
    times, losses = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        trainer.fit(X, y)
        times.append(time.perf_counter() - start)
        losses.append(trainer.train_losses_[-1])
    result = {"seconds": min(times), "steps": steps, "first": first, "loss": losses[0]}
    if variant == QUANTIZED_BASE:  # the base is no longer the file's
        result["base_bytes"] = _base_bytes(adapted)
    return result


def _base_bytes(adapted) -> int:
    """The bytes of an adapted model's initializers, the adapters excepted."""
    from onnx import helper

    from graphkit import lora

    skip = set(lora.adapter_names(adapted))
    return sum(
        math.prod(t.dims) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        for t in adapted.graph.initializer
        if t.name not in skip
    )


def _torch_model(kind: str, folder: Path, spec: dict):
    """The torch module (token ids in, the logits the graph outputs out) with the
    graph's weights, and the prefix the graph's weight names lack (the wrapper's
    attribute, ``m.``, which finetune.py's export removes)."""
    import torch

    if kind != "llama":
        net = _tiny_module(kind)
        with np.load(folder / "state.npz") as state:
            net.load_state_dict({k: torch.from_numpy(state[k]) for k in state.files})
        return net, "", lambda out: out

    # as finetune.py's torch contender loads them: every parameter from model.onnx.data
    module = finetune._llama_wrapper(spec["config"])
    tensors = finetune._tensors(folder)
    with torch.no_grad():
        for name, param in module.m.named_parameters():
            value = torch.from_numpy(finetune._read(folder, tensors[name]))
            if value.shape != param.shape:
                raise ValueError(f"{name}: {tuple(value.shape)} in the file, {param.shape}")
            param.copy_(value)
            del value
    return module, "m.", lambda out: out[:, -1]


def run_torch(kind: str, folder: Path, warmup: int, steps: int, repeats: int) -> dict:
    import peft
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(THREADS)
    spec, warm, timed = finetune._load(folder, warmup, steps)
    net, prefix, last = _torch_model(kind, folder, spec)
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=TARGETS[kind], lora_dropout=0.0
    )
    twin = peft.get_peft_model(net, config)
    twin.train()
    with np.load(Model(kind, "", folder).adapters) as initial, torch.no_grad():
        names = initial["__names__"]
        for weight, a, b in names:
            layer = twin.get_submodule(f"base_model.model.{prefix}{weight.removesuffix('.weight')}")
            layer.lora_A["default"].weight.copy_(torch.from_numpy(initial[a].T))
            layer.lora_B["default"].weight.copy_(torch.from_numpy(initial[b].T))
    params = [p for p in twin.parameters() if p.requires_grad]
    if len(params) != 2 * len(names):
        raise RuntimeError(f"PEFT trains {len(params)} tensors, {2 * len(names)} adapters")
    adamw = torch.optim.AdamW(
        params,
        lr=LR,
        betas=(ADAMW["b1"], ADAMW["b2"]),
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
    )
    loss_of = F.cross_entropy if kind == "llama" else F.mse_loss
    batch = spec["batch_size"]

    def epoch(X: np.ndarray, y: np.ndarray) -> float:
        losses = []
        for start in range(0, len(X), batch):
            ids = torch.from_numpy(X[start : start + batch])
            target = torch.from_numpy(y[start : start + batch])
            adamw.zero_grad(set_to_none=True)
            loss = loss_of(last(twin(ids)), target)
            loss.backward()
            adamw.step()
            losses.append(loss.item())
        return float(np.mean(losses))

    first = epoch(*warm)
    times, losses = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        losses.append(epoch(*timed))
        times.append(time.perf_counter() - start)
    return {"seconds": min(times), "steps": steps, "first": first, "loss": losses[0]}


def contender_main(args) -> None:
    """The ``--contender`` mode: one row, one JSON line on stdout (libraries' prints go to
    stderr)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    run = (args.model_kind, args.folder)
    try:
        if args.contender == "torch":
            result = run_torch(*run, args.warmup, args.steps, args.repeats)
            from importlib.metadata import version

            result["version"] = ", ".join(
                f"{d} {version(d)}" for d in ("torch", "transformers", "peft")
            )
        else:
            result = run_graphkit(
                args.contender, *run, args.variant, args.warmup, args.steps, args.repeats
            )
            from importlib.metadata import version

            from report import ONNXRUNTIME_BUILDS, _version

            build = next(d for d in ONNXRUNTIME_BUILDS if _version(d))
            result["version"] = f"graphkit {version('graphkit-onnx')}, {build} {version(build)}"
    except Exception as exc:
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        raise
    result["peak"] = finetune._peak()
    out.write(json.dumps(result) + "\n")


def run_contender(
    c: Contender, model: Model, variant: str, warmup: int, steps: int, repeats: int
) -> dict:
    if not c.python.exists():
        return {"error": f"{c.python} is missing: see this script's docstring"}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [str(c.python), __file__, "--contender", c.kind, "--model-kind", model.kind]
    command += ["--folder", str(model.folder), "--variant", variant, "--warmup", str(warmup)]
    command += ["--steps", str(steps), "--repeats", str(repeats)]
    log = model.folder / f"lora-{c.kind}-{variant.replace(' ', '-')}.log"
    return finetune.contender_result(command, env, log)


# -- the report ------------------------------------------------------------------------

_number = finetune._number


def _same(r: dict, ref: dict) -> bool:
    return "loss" not in ref or abs(r["loss"] - ref["loss"]) <= TOLERANCE * abs(ref["loss"])


def table(model: Model, results: dict[tuple[str, str], dict]) -> list[str]:
    llama = model.kind == "llama"
    lines = [f"## {model.title}", ""]
    if llama:
        base, state = model.base_bytes, model.state_bytes
        lines += [
            f"Base weights: {_number(base / MiB)} MB (the file model.onnx.data); adapters' "
            f"state: {_number(state / MiB)} MB (the adapters, rank {RANK}, alpha {ALPHA:g}, on "
            f"{', '.join(TARGETS[model.kind])} of every layer, and AdamW's two moments). "
            f"Targets: ms / batch at most PyTorch + PEFT's (*x torch* <= 1), peak at most "
            f"{MEMORY_TARGET} x (base + adapters' state) (*x base+state* <= {MEMORY_TARGET}); "
            "the quantized base's peak below the float base's weights (its *x base+state* is "
            "the peak over the float base's bytes, < 1).",
            "",
            "| variant | contender | ms / batch | x torch | peak MB | x base+state | loss "
            "| time target | memory target |",
            "|---|---|---:|---:|---:|---:|---:|---|---|",
        ]
    else:
        lines += [
            f"Adapters rank {RANK}, alpha {ALPHA:g}, on {', '.join(TARGETS[model.kind])}.",
            "",
            "| contender | ms / batch | x torch | loss |",
            "|---|---:|---:|---:|",
        ]
    print(model.title)
    for variant in VARIANTS if llama else [FLOAT_BASE]:
        ref = results.get((FLOAT_BASE, REFERENCE), {})
        for c in CONTENDERS:
            r = results.get((variant, c.name))
            if r is None:
                continue
            lead = f"| {variant} | {c.name} |" if llama else f"| {c.name} |"
            if "seconds" not in r:
                why = r.get("skip") or r.get("error", "")
                cells = " | | | | not run: {} | | |" if llama else " | | not run: {} |"
                lines.append(f"{lead} —{cells.format(why)}")
                print(f"  {variant:14s} {c.name:22s} not run: {why}")
                continue
            ms = r["seconds"] / r["steps"] * 1e3
            ratio = r["seconds"] / ref["seconds"] if "seconds" in ref else math.nan
            loss = f"{r['loss']:.7g}" + ("" if _same(r, ref) else " ≠")
            if not llama:
                lines.append(f"{lead} {_number(ms)} | {ratio:.2f} | {loss} |")
                print(f"  {c.name:22s} {ms:10.3f} ms  x{ratio:5.2f} torch  loss {loss}")
                continue
            fast = "—" if math.isnan(ratio) else "met" if ratio <= 1 else "missed"
            if variant == QUANTIZED_BASE:  # target: below the float base's weights
                against = r["peak"] / base
                small = "met" if against < 1 else "missed"
            else:
                against = r["peak"] / (base + state)
                small = "met" if against <= MEMORY_TARGET else "missed"
            lines.append(
                f"{lead} {_number(ms)} | {ratio:.2f} | {r['peak'] / MiB:,.0f} | {against:.2f} | "
                f"{loss} | {fast} | {small} |"
            )
            print(
                f"  {variant:14s} {c.name:22s} {ms:10.1f} ms  x{ratio:5.2f} torch  "
                f"peak {r['peak'] / MiB:8,.0f} MB  x{against:5.2f} base+state  loss {loss}  "
                f"(warm-up loss {r['first']:.8g})"
            )
    return lines + [""]


def report(args, started, versions, sections, results, done: bool = False) -> list[str]:
    libraries = "; ".join(
        [f"CPython {platform.python_version()}"] + [f"{k}: {v}" for k, v in versions.items()]
    )
    gaps = [0.0]
    for (title, _, _), r in results.items():
        ref = results.get((title, FLOAT_BASE, REFERENCE), {})
        if "first" in r and "first" in ref:
            gaps.append(abs(r["first"] - ref["first"]) / abs(ref["first"]))
    head = header(
        "LoRA fine-tuning: time per step and peak memory, graphkit against PyTorch + PEFT",
        on=machine(THREADS),
        libraries=libraries,
    ) + [
        ("**A smoke run (tiny models): not results.** " if args.quick else "")
        + ("" if done else "**A run under way or cut short: the tables so far.** ")
        + f"LoRA rank {RANK}, alpha {ALPHA:g}, no dropout, trained with AdamW (lr {LR:g}, "
        f"weight decay {ADAMW['weight_decay']:g}, betas ({ADAMW['b1']}, {ADAMW['b2']}), eps "
        f"{ADAMW['eps']:g}): the same base weights, the same initial adapters (graphkit's "
        "add_lora, copied into PEFT's lora_A/lora_B), the same batches in the same order. "
        "Each row is a process of its own that loads the model from its files, adds the "
        f"adapters, trains warm-up steps untimed ({args.warmup} for the Llama decoder, "
        f"{WARMUP['tiny']} for the tiny models), then the timed steps ({args.steps} for "
        f"the Llama decoder, {REPEATS['llama']} runs; {STEPS['tiny']} for the tiny models, "
        f"{REPEATS['tiny']} runs): **ms / batch** is the best run's time over its steps "
        "(one step: a batch's forward, backward and AdamW update), **x torch** the ratio to "
        "PyTorch eager + PEFT's (lower is faster). *loss* is the first timed run's mean "
        "step loss, ≠ marking one that differs from PyTorch + PEFT's by more than 1e-4 "
        "relative. **peak MB** is the process's peak resident memory (VmHWM: imports, "
        "loading the model, training; graphkit maps the base weights from their file, "
        "whose pages read count), **x base+state** that peak over the base weights' bytes "
        "plus the adapters' state (the adapters and AdamW's two moments). Graphkit's "
        "contenders train graphkit.lora.add_lora's model with graphkit_train.Trainer; "
        "PyTorch's, peft.get_peft_model's with torch.optim.AdamW. See the script's "
        "docstring for the models and the losses.",
        "",
    ]
    tail = [
        f"Largest relative difference of a contender's warm-up mean loss from PyTorch + "
        f"PEFT's: {max(gaps):.1e}. Total run: {time.perf_counter() - started:.0f} s."
    ]
    return head + sections + tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="finetune's toy Llama (a smoke run)")
    parser.add_argument("--only", action="append", help="models whose name has this word")
    parser.add_argument("--who", action="append", help="contenders whose name has this word")
    parser.add_argument("--steps", type=int, default=STEPS["llama"], help="timed steps, llama")
    parser.add_argument("--warmup", type=int, default=WARMUP["llama"], help="untimed, llama")
    parser.add_argument("--workdir", type=Path, default=WORKDIR, help="the models' cache")
    parser.add_argument("--output", help="default: results/lora.md (--quick: lora-quick.md)")
    parser.add_argument(
        "--quantized-base",
        action="store_true",
        help="add the quantized-base variant to the Llama rows (see write_quantized_base)",
    )
    # the processes this one starts
    parser.add_argument("--contender", help=argparse.SUPPRESS)
    parser.add_argument("--model-kind", help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--variant", default=FLOAT_BASE, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--export-tiny", help=argparse.SUPPRESS)
    parser.add_argument("--write-adapters", help=argparse.SUPPRESS)
    parser.add_argument("--path", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.contender:
        contender_main(args)
        return
    if args.export_tiny:
        export_tiny(args.export_tiny, args.folder, args.rows)
        return
    if args.write_adapters:
        write_adapters(args.write_adapters, args.folder, args.path)
        return
    if args.output is None:
        args.output = default_output(__file__, "quick" if args.quick else "")
    if args.who:
        CONTENDERS[:] = [c for c in CONTENDERS if any(w in c.name for w in args.who)]
    if args.quantized_base:
        VARIANTS.append(QUANTIZED_BASE)

    started = time.perf_counter()
    workdir = args.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    wanted = [k for k in ("llama", "tiny") if not args.only or any(w in k for w in args.only)]
    sections, versions, all_results = [], {}, {}
    for group in wanted:
        warmup = args.warmup if group == "llama" else WARMUP["tiny"]
        steps = args.steps if group == "llama" else STEPS["tiny"]
        try:
            if group == "llama":
                # finetune's cache: its default run's rows (2 + 5) reuse its export
                models = [llama_model(args.quick, workdir, (warmup + steps) * finetune.LLAMA_BATCH)]
            else:
                models = tiny_models(workdir, (warmup + steps) * TINY_BATCH)
            for model in models:
                ensure_adapters(model)
                if group == "llama" and QUANTIZED_BASE in VARIANTS:
                    write_quantized_base(model.folder)
        except (OSError, subprocess.CalledProcessError) as exc:
            print(f"{group}: not run: {exc}", file=sys.stderr)
            sections += [f"## {group}", "", f"Not run: {exc}", ""]
            continue
        for model in models:
            results: dict[tuple[str, str], dict] = {}
            for variant in VARIANTS if group == "llama" else [FLOAT_BASE]:
                for c in CONTENDERS:
                    if variant == QUANTIZED_BASE and c.kind == "torch":
                        continue  # compared with PyTorch + PEFT on the float base
                    need, available = model.base_bytes * MEMORY_FACTOR, finetune.mem_available()
                    if group == "llama" and need > MEMORY_SHARE * available:
                        why = (
                            f"weights x {MEMORY_FACTOR} = {need / MiB:,.0f} MB > "
                            f"{MEMORY_SHARE:.0%} of MemAvailable ({available / MiB:,.0f} MB)"
                        )
                        print(f"skipping {model.title}, {c.name}: {why}")
                        results[(variant, c.name)] = {"skip": why}
                        continue
                    results[(variant, c.name)] = r = run_contender(
                        c, model, variant, warmup, steps, REPEATS[group]
                    )
                    if "version" in r:
                        versions[c.name.split()[0]] = r["version"]
            sections += table(model, results)
            all_results.update({(model.title, *k): v for k, v in results.items()})
            write(args.output, report(args, started, versions, sections, all_results))
    write(args.output, report(args, started, versions, sections, all_results, done=True))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
