"""LoRA adapters against PEFT itself (needs torch, transformers and PEFT: the main
environment; the native-only one skips this module).

A tiny Llama and a tiny BERT built from transformers configs, exported by both torch
exporters, adapted as PEFT adapts them, with the same initial adapters, AdamW and
batches: graphkit's adapters after 10 steps equal PEFT's (both backends, both trainers,
``OnnxModule``), the merged model predicts as ``merge_and_unload()``, and the adapters
saved in PEFT's format load with ``PeftModel.from_pretrained``.
"""

from __future__ import annotations

import copy
import io
import json
import warnings

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS, dropout_uniform

import graphkit as gk
from graphkit import lora, optimizers
from graphkit.engine import ort_engine
from graphkit_train import ForwardBackwardTrainer, Trainer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ROWS, BATCH, SEQ, VOCAB = 20, 2, 8, 64  # 10 steps of one epoch
RANK, ALPHA, LR, DECAY = 4, 8, 0.01, 0.01


class _Logits(torch.nn.Module):
    """A transformers model as the exporters take it: token ids in, logits out. Llama
    gets an explicit causal mask (the TorchScript exporter cannot trace transformers'
    own, built with vmap)."""

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


def _tiny(kind: str) -> _Logits:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            attn_implementation="eager",
            tie_word_embeddings=False,
        )
        return _Logits(transformers.LlamaForCausalLM(config).eval(), causal=True)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=32,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",
    )
    return _Logits(transformers.BertForSequenceClassification(config).eval(), causal=False)


TARGETS = {"llama": ["q_proj", "v_proj"], "bert": ["query", "value"]}


def _export(net, exporter: str) -> onnx.ModelProto:
    """``torchscript`` and ``dynamo`` keep the weights' names (no folding);
    ``torchscript-folded`` is the exporter's default: each linear weight's transpose
    folded into an initializer of a made-up name (``onnx::MatMul_644``), whose module
    only the product's node name tells."""
    ids = torch.zeros((BATCH, SEQ), dtype=torch.int64)
    dynamo, fold = exporter == "dynamo", exporter == "torchscript-folded"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(
                net, (ids,), dynamo=True, optimize=False, verbose=False,
                input_names=["ids"], output_names=["logits"],
            )  # fmt: skip
            return program.model_proto
        f = io.BytesIO()
        torch.onnx.export(
            net, (ids,), f, dynamo=False, opset_version=18, do_constant_folding=fold,
            input_names=["ids"], output_names=["logits"],
        )  # fmt: skip
        return onnx.load_from_string(f.getvalue())


@pytest.fixture(scope="module")
def exported():
    """(torch module, ONNX graph) per (model, exporter), exported once."""
    cache: dict = {}

    def get(kind: str, exporter: str):
        if (kind, exporter) not in cache:
            net = _tiny(kind)
            cache[kind, exporter] = (net, _export(net, exporter))
        return cache[kind, exporter]

    return get


def _data(kind: str):
    rng = np.random.default_rng(0)
    X = rng.integers(0, VOCAB, size=(ROWS, SEQ), dtype=np.int64)
    width = (SEQ, VOCAB) if kind == "llama" else (3,)
    return X, rng.normal(size=(ROWS, *width)).astype(np.float32)


def _peft_twin(net, adapted: onnx.ModelProto, kind: str):
    """PEFT's LoRA on a copy of ``net``, its adapters set to graphkit's initial ones."""
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=TARGETS[kind], lora_dropout=0.0
    )
    twin = peft.get_peft_model(copy.deepcopy(net), config)
    initial = lora.lora_state(adapted)
    with torch.no_grad():
        for adapter in lora.adapters(adapted):
            layer = _peft_layer(twin, adapter)
            layer.lora_A["default"].weight.copy_(torch.from_numpy(initial[adapter.a].T))
            layer.lora_B["default"].weight.copy_(torch.from_numpy(initial[adapter.b].T))
    return twin


def _peft_layer(twin, adapter: lora.Adapter):
    return twin.get_submodule("base_model.model." + adapter.module)


def _adamw(forward, trained, X, y) -> None:
    """torch's 10 AdamW steps of the mean squared error, the trainer's batches in order."""
    adamw = torch.optim.AdamW(trained, lr=LR, weight_decay=DECAY)
    for start in range(0, ROWS, BATCH):
        rows = slice(start, start + BATCH)
        adamw.zero_grad()
        out = forward(torch.from_numpy(X[rows]))
        torch.nn.functional.mse_loss(out, torch.from_numpy(y[rows])).backward()
        adamw.step()


def _adamw_fit(trainer_class, adapted, X, y, **options):
    """One epoch of graphkit's ``trainer_class`` with torch's AdamW settings, the
    batches in order (the 10 steps ``_adamw`` takes)."""
    return trainer_class(
        adapted,
        optimizer=optimizers.adamw(learning_rate=LR, weight_decay=DECAY),
        loss="squared_error",
        batch_size=BATCH,
        max_iter=1,
        shuffle=False,
        **options,
    ).fit(X, y)


def _peft_adamw(twin, X, y) -> None:
    _adamw(twin, [p for p in twin.parameters() if p.requires_grad], X, y)


def _assert_adapters_equal(state, twin, adapted) -> None:
    for adapter in lora.adapters(adapted):
        layer = _peft_layer(twin, adapter)
        for name, theirs in [(adapter.a, layer.lora_A), (adapter.b, layer.lora_B)]:
            reference = theirs["default"].weight.detach().numpy().T
            scale = np.abs(reference).max()
            np.testing.assert_allclose(state[name], reference, rtol=0, atol=1e-5 * scale)


# Llama: every exporter on every backend; BERT: each exporter once, each backend once
CASES = (
    [
        pytest.param("llama", exporter, backend, id=f"llama-{exporter}-{backend}")
        for exporter in ("torchscript", "dynamo")
        for backend in INSTALLED_BACKENDS
    ]
    + [
        pytest.param("bert", exporter, backend, id=f"bert-{exporter}-{backend}")
        for exporter, backend in zip(("torchscript", "dynamo"), INSTALLED_BACKENDS * 2)
    ]
    + [pytest.param("llama", "torchscript-folded", "native", id="llama-torchscript-folded-native")]
)


@pytest.mark.parametrize("kind,exporter,backend", CASES)
def test_adapters_after_10_adamw_steps_equal_pefts(exported, kind, exporter, backend, tmp_path):
    net, onx = exported(kind, exporter)
    adapted = lora.add_lora(onx, TARGETS[kind], rank=RANK, alpha=ALPHA, random_state=0)
    X, y = _data(kind)
    trainer = _adamw_fit(Trainer, adapted, X, y, backend=backend)
    assert sorted(trainer.update_step_.weights) == sorted(lora.adapter_names(adapted))
    twin = _peft_twin(net, adapted, kind)
    _peft_adamw(twin, X, y)
    state = trainer.get_state()
    _assert_adapters_equal(state, twin, adapted)

    # the merged model predicts as PEFT's merge_and_unload(), and carries no adapter
    merged = lora.merge_lora(trainer.get_trained_onnx())
    onnx.checker.check_model(merged, full_check=True)
    assert not lora.adapters(merged) and not any(
        n.name.startswith("lora/") for n in merged.graph.node
    )
    assert {t.name for t in merged.graph.initializer} == {t.name for t in onx.graph.initializer}
    if exporter == "torchscript-folded":  # named after the module the node names say
        assert all(a.weight.startswith("onnx::") for a in lora.adapters(adapted))
        assert all(a.a.endswith("_proj.lora_A.weight") for a in lora.adapters(adapted))
    (ours,) = ort_engine.run(merged, {"ids": X[:BATCH]}).values()
    theirs = copy.deepcopy(twin).merge_and_unload()(torch.from_numpy(X[:BATCH])).detach().numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())

    # PEFT's format, loaded by PEFT into the torch model the graph came from
    if exporter.startswith("torchscript") and backend == INSTALLED_BACKENDS[0]:
        folder = trainer.save_adapter(tmp_path / "peft", format="peft", module_prefix="m.")
        config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
        assert config["r"] == RANK and config["lora_alpha"] == ALPHA
        loaded = peft.PeftModel.from_pretrained(copy.deepcopy(net.m), folder)
        wrapped = _Logits(loaded, causal=kind == "llama").eval()
        predicted = wrapped(torch.from_numpy(X[:BATCH])).detach().numpy()
        np.testing.assert_allclose(predicted, theirs, rtol=0, atol=1e-5 * np.abs(theirs).max())


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_forward_backward_trainer_trains_the_adapters_as_peft(exported, backend):
    net, onx = exported("llama", "torchscript")
    adapted = lora.add_lora(onx, TARGETS["llama"], rank=RANK, alpha=ALPHA, random_state=0)
    X, y = _data("llama")
    trainer = _adamw_fit(ForwardBackwardTrainer, adapted, X, y, backend=backend)
    twin = _peft_twin(net, adapted, "llama")
    _peft_adamw(twin, X, y)
    _assert_adapters_equal(trainer.get_state(), twin, adapted)


def test_onnx_module_parameters_are_the_adapters(exported):
    """OnnxModule of an adapted graph: its parameters are the adapters, and torch's
    AdamW on them follows PEFT's."""
    from graphkit_train import OnnxModule

    net, onx = exported("llama", "torchscript")
    adapted = lora.add_lora(onx, TARGETS["llama"], rank=RANK, alpha=ALPHA, random_state=0)
    module = OnnxModule(adapted)
    assert sorted(module.parameter_names.values()) == sorted(lora.adapter_names(adapted))
    X, y = _data("llama")
    _adamw(module, list(module.parameters()), X, y)
    twin = _peft_twin(net, adapted, "llama")
    _peft_adamw(twin, X, y)
    state = {module.parameter_names[k]: v.detach().numpy() for k, v in module.named_parameters()}
    _assert_adapters_equal(state, twin, adapted)


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_conv_adapters_after_10_adamw_steps_equal_pefts(backend, tmp_path):
    """A small CNN's convolution with PEFT's Conv2d adapters (a 3 x 3 kernel to the rank,
    then 1 x 1), exported by TorchScript: adapters, merged model and saved format."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 6, 3, padding=1, stride=2),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(6 * 4 * 4, 3),
    ).eval()
    rng = np.random.default_rng(0)
    X = rng.normal(size=(ROWS, 2, 8, 8)).astype(np.float32)
    y = rng.normal(size=(ROWS, 3)).astype(np.float32)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net, (torch.from_numpy(X[:BATCH]),), f, dynamo=False, opset_version=18,
            input_names=["X"], output_names=["Y"], dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}},
        )  # fmt: skip
    onx = onnx.load_from_string(f.getvalue())
    adapted = lora.add_lora(onx, "0", rank=RANK, alpha=ALPHA, random_state=0)
    (adapter,) = lora.adapters(adapted)
    assert adapter.layout == "conv" and adapter.module == "0"
    trainer = _adamw_fit(Trainer, adapted, X, y, backend=backend)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["0"], lora_dropout=0.0)
    twin = peft.get_peft_model(copy.deepcopy(net), config)
    initial = lora.lora_state(adapted)
    layer = twin.get_submodule("base_model.model.0")
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.from_numpy(initial[adapter.a]))
        layer.lora_B["default"].weight.copy_(torch.from_numpy(initial[adapter.b]))
    _peft_adamw(twin, X, y)
    state = trainer.get_state()
    for name, theirs in [(adapter.a, layer.lora_A), (adapter.b, layer.lora_B)]:
        reference = theirs["default"].weight.detach().numpy()
        np.testing.assert_allclose(state[name], reference, atol=1e-5 * np.abs(reference).max())
    merged = lora.merge_lora(trainer.get_trained_onnx())
    onnx.checker.check_model(merged, full_check=True)
    (ours,) = ort_engine.run(merged, {"X": X[:BATCH]}).values()
    theirs = copy.deepcopy(twin).merge_and_unload()(torch.from_numpy(X[:BATCH])).detach().numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-5 * np.abs(theirs).max())
    folder = trainer.save_adapter(tmp_path / "peft", format="peft")
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(net), folder)
    predicted = loaded(torch.from_numpy(X[:BATCH])).detach().numpy()
    np.testing.assert_allclose(predicted, theirs, atol=1e-5 * np.abs(theirs).max())


class _FedDropout(torch.nn.Module):
    """PEFT's lora_dropout with graphkit's masks (layer 0 of the stream) at ``step``."""

    def __init__(self, p: float, seed: int) -> None:
        super().__init__()
        self.p, self.seed, self.step = p, seed, 0

    def forward(self, x):
        u = dropout_uniform(self.seed, self.step, 0, x.numel())
        self.step += 1
        return x * torch.from_numpy((u >= self.p).reshape(tuple(x.shape))) / (1 - self.p)


def _onnx_module_adamw(adapted, X, y):
    """``OnnxModule`` of ``adapted`` trained by torch's AdamW (its parameters: the
    adapters): its state by graph names, the masks' seed included, and its trained
    model."""
    from graphkit_train import OnnxModule

    module = OnnxModule(adapted)
    seed = module.buffer_values()["graphkit.dropout_seed"]
    _adamw(module, list(module.parameters()), X, y)
    state = {n: getattr(module, a).detach().numpy() for a, n in module.parameter_names.items()}
    return {**state, "graphkit.dropout_seed": seed.numpy()}, module.trained_model()


@pytest.mark.parametrize("trainer_class", [Trainer, ForwardBackwardTrainer, "OnnxModule"])
def test_lora_dropout_trains_as_pefts_with_the_same_masks(trainer_class):
    """``add_lora(dropout=0.3)``: the adapters read Dropout(x) while training (PEFT's
    ``lora_dropout``, fed graphkit's masks: 10 AdamW steps equal; through both trainers
    and ``OnnxModule`` in ``train()``), not when predicting (the merged model equals
    PEFT's merge), and the PEFT config says so."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    rng = np.random.default_rng(0)
    X = rng.normal(size=(ROWS, 6)).astype(np.float32)
    y = rng.normal(size=(ROWS, 3)).astype(np.float32)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net.eval(), (torch.from_numpy(X[:BATCH]),), f, dynamo=False, opset_version=18,
            input_names=["X"], output_names=["Y"], dynamic_axes={"X": {0: "N"}, "Y": {0: "N"}},
        )  # fmt: skip
    adapted = lora.add_lora(
        onnx.load_from_string(f.getvalue()), "0", rank=2, alpha=ALPHA, dropout=0.3
    )
    (adapter,) = lora.adapters(adapted)
    initial = lora.lora_state(adapted)  # B starts at zero: give the masks work to do
    initial[adapter.b] = rng.normal(size=initial[adapter.b].shape).astype(np.float32)
    adapted = gk.set_weights(adapted, initial)
    if trainer_class == "OnnxModule":
        state, trained = _onnx_module_adamw(adapted, X, y)
    else:
        trainer = _adamw_fit(trainer_class, adapted, X, y, random_state=1)
        state, trained = trainer.get_state(), trainer.get_trained_onnx()
    config = peft.LoraConfig(r=2, lora_alpha=ALPHA, target_modules=["0"], lora_dropout=0.3)
    twin = peft.get_peft_model(copy.deepcopy(net), config)
    layer = twin.get_submodule("base_model.model.0")
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.from_numpy(initial[adapter.a].T))
        layer.lora_B["default"].weight.copy_(torch.from_numpy(initial[adapter.b].T))
    layer.lora_dropout["default"] = _FedDropout(0.3, int(state["graphkit.dropout_seed"]))
    twin.train()
    _peft_adamw(twin, X, y)
    for name, theirs in [(adapter.a, layer.lora_A), (adapter.b, layer.lora_B)]:
        reference = theirs["default"].weight.detach().numpy().T
        np.testing.assert_allclose(state[name], reference, atol=1e-5 * np.abs(reference).max())
    merged = lora.merge_lora(trained)
    onnx.checker.check_model(merged, full_check=True)
    assert not any(n.op_type == "Dropout" for n in merged.graph.node)
    (ours,) = ort_engine.run(merged, {"X": X[:BATCH]}).values()
    theirs = copy.deepcopy(twin).eval().merge_and_unload()(torch.from_numpy(X[:BATCH]))
    np.testing.assert_allclose(ours, theirs.detach().numpy(), atol=1e-5)
