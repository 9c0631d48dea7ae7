"""LoRA adapters (graphkit.lora) against the formula; PEFT itself is the reference of
tests/test_lora_peft.py.

* the rewrite, on hand-built graphs (``MatMul``, ``Transpose`` then ``MatMul``, ``Gemm``
  with ``transB``): the adapted output and one SGD step against the numpy formula
  ``y = x W + (alpha / r) (x A) B``;
* onnxruntime's adapter format, where the installed onnxruntime writes it (1.20+);
* the errors of bad input.
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from conftest import INSTALLED_BACKENDS
from onnx import TensorProto, helper, numpy_helper

from graphkit import lora, optimizers
from graphkit.engine import ort_engine
from graphkit.prepare import prepare_for_training
from graphkit.quantized import matmul_nbits_as_standard
from graphkit_train import ForwardBackwardTrainer, Trainer

ROWS, BATCH, SEQ, VOCAB = 20, 2, 8, 64  # 10 steps of one epoch
RANK, ALPHA, LR, DECAY = 4, 8, 0.01, 0.01


# -- the rewrite against the formula -----------------------------------------------------


def _linear_graph(layout: str) -> onnx.ModelProto:
    """y = x W (+ b) with W [3, 5] read by MatMul ("in_out"), or W [5, 3] read through
    Transpose ("transpose") or by Gemm(transB=1) ("gemm")."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(3, 5) if layout == "in_out" else (5, 3))
    b = rng.normal(size=5)
    if layout == "in_out":
        nodes = [helper.make_node("MatMul", ["x", "lin.weight"], ["xw"])]
    elif layout == "transpose":
        nodes = [
            helper.make_node("Transpose", ["lin.weight"], ["wt"], perm=[1, 0]),
            helper.make_node("MatMul", ["x", "wt"], ["xw"]),
        ]
    else:
        nodes = [helper.make_node("Gemm", ["x", "lin.weight"], ["xw"], transB=1)]
    nodes.append(helper.make_node("Add", ["xw", "lin.bias"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", 5])],
        [numpy_helper.from_array(w, "lin.weight"), numpy_helper.from_array(b, "lin.bias")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


@pytest.mark.parametrize("layout", ["in_out", "transpose", "gemm"])
def test_adapted_output_and_one_sgd_step_follow_the_formula(layout):
    model = _linear_graph(layout)
    adapted = lora.add_lora(model, "lin", rank=2, alpha=3, init="gaussian", random_state=4)
    onnx.checker.check_model(adapted, full_check=True)
    (adapter,) = lora.adapters(adapted)
    assert (adapter.a, adapter.b) == ("lin.lora_A.weight", "lin.lora_B.weight")
    values = {t.name: numpy_helper.to_array(t) for t in adapted.graph.initializer}
    w = values["lin.weight"] if layout == "in_out" else values["lin.weight"].T
    a, b = values[adapter.a], values[adapter.b]
    assert a.shape == (3, 2) and b.shape == (2, 5) and not b.any()
    assert a.std() == pytest.approx(1 / 2, rel=0.5)  # N(0, 1/r^2)

    rng = np.random.default_rng(2)
    x, target = rng.normal(size=(6, 3)), rng.normal(size=(6, 5))
    b = rng.normal(size=b.shape)  # a B as if trained, so that the adapters show
    (y,) = ort_engine.run(lora.merge_lora(adapted, {adapter.b: b}), {"x": x}).values()
    expected = x @ w + values["lin.bias"] + (3 / 2) * (x @ a) @ b
    np.testing.assert_allclose(y, expected, rtol=1e-12)

    # one SGD step of the mean squared error from that B: only A and B move
    lr = 0.1
    start = lora.add_lora(model, "lin", rank=2, alpha=3, init="gaussian", random_state=4)
    start.graph.initializer[-1].CopyFrom(numpy_helper.from_array(b, adapter.b))
    trainer = Trainer(
        start,
        optimizer=optimizers.sgd(learning_rate=lr),
        loss="squared_error",
        batch_size=6,
        max_iter=1,
        shuffle=False,
    ).fit(x, target)
    assert sorted(trainer.update_step_.weights) == sorted([adapter.a, adapter.b])
    s = 3 / 2
    residual = 2 * (expected - target) / target.size  # d mean((y - t)^2) / d y
    grad_b = s * (x @ a).T @ residual
    grad_a = s * x.T @ (residual @ b.T)
    state = trainer.get_state()
    np.testing.assert_allclose(state[adapter.a], a - lr * grad_a, rtol=1e-10)
    np.testing.assert_allclose(state[adapter.b], b - lr * grad_b, rtol=1e-10)


# -- onnxruntime's adapter format ----------------------------------------------------------


def test_onnxruntime_adapter_activates_on_the_serving_model(tmp_path):
    """The adapter file holds the trained adapters; activated on the serving model it
    predicts as the trained model, and without it the serving model is the base model.
    (onnxruntime 1.20 and later: the native environment; the training build refuses,
    naming the version.)"""
    ort = ort_engine.onnxruntime()
    model = _linear_graph("transpose")
    adapted = lora.add_lora(model, "lin", rank=2, alpha=4, random_state=0)
    rng = np.random.default_rng(3)
    x, target = rng.normal(size=(8, 3)), rng.normal(size=(8, 5))
    trainer = Trainer(adapted, optimizer="adam", loss="squared_error", batch_size=4)
    trainer.set_params(max_iter=3, shuffle=False).fit(x, target)
    path = tmp_path / "tuned.onnx_adapter"
    if not hasattr(ort, "AdapterFormat"):
        with pytest.raises(ImportError, match="onnxruntime 1.20"):
            trainer.save_adapter(path)
        pytest.skip(f"onnxruntime {ort.__version__} has no adapter format (1.20+ has)")
    trainer.save_adapter(path)
    read = ort.AdapterFormat.read_adapter(str(path))
    stored = {k: v.numpy() for k, v in read.get_parameters().items()}
    trained = trainer.lora_state()
    assert sorted(stored) == sorted(trained) == sorted(lora.adapter_names(adapted))
    for name, value in trained.items():
        np.testing.assert_array_equal(stored[name], value)

    serving = lora.serving_model(adapted)
    onnx.checker.check_model(serving, full_check=True)
    session = ort.InferenceSession(serving.SerializeToString())
    adapter = ort.LoraAdapter()
    adapter.Load(str(path))
    options = ort.RunOptions()
    options.add_active_adapter(adapter)
    (served,) = session.run(None, {"x": x}, options)
    values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    a, b = trained["lin.lora_A.weight"], trained["lin.lora_B.weight"]
    expected = x @ values["lin.weight"].T + values["lin.bias"] + 2 * (x @ a) @ b
    np.testing.assert_allclose(served, expected, rtol=1e-12)
    np.testing.assert_allclose(trainer.predict(x), expected, rtol=1e-12)
    (base,) = session.run(None, {"x": x})
    np.testing.assert_allclose(base, x @ values["lin.weight"].T + values["lin.bias"], rtol=1e-12)


# -- bad input -----------------------------------------------------------------------------


def test_targets_that_match_nothing_list_the_candidates():
    with pytest.raises(lora.LoraError, match=r"match no weight.*'lin\.weight'"):
        lora.add_lora(_linear_graph("in_out"), "q_proj")


def test_a_target_no_product_reads_is_refused():
    with pytest.raises(lora.LoraError, match=r"'lin\.bias'.*no product"):
        lora.add_lora(_linear_graph("in_out"), "lin.bias")


@pytest.mark.parametrize("rank", [0, 4, 2.5, True])
def test_a_rank_out_of_range_is_refused(rank):
    with pytest.raises(lora.LoraError, match="rank"):
        lora.add_lora(_linear_graph("in_out"), "lin", rank=rank)


def test_other_bad_parameters_are_refused():
    model = _linear_graph("in_out")
    for dropout in (-0.1, 1.0):
        with pytest.raises(lora.LoraError, match="dropout"):
            lora.add_lora(model, "lin", rank=2, dropout=dropout)
    with pytest.raises(lora.LoraError, match="alpha"):
        lora.add_lora(model, "lin", rank=2, alpha=-1)
    with pytest.raises(lora.LoraError, match="init"):
        lora.add_lora(model, "lin", rank=2, init="orthogonal")
    with pytest.raises(lora.LoraError, match="already"):
        lora.add_lora(lora.add_lora(model, "lin", rank=2), "lin", rank=2)


def test_a_model_without_adapters_is_refused_by_merge_save_and_serve(tmp_path):
    model = _linear_graph("in_out")
    for call in (
        lambda: lora.merge_lora(model),
        lambda: lora.serving_model(model),
        lambda: lora.save_adapter(model, tmp_path / "a", format="peft"),
    ):
        with pytest.raises(lora.LoraError, match="no LoRA adapters"):
            call()


def test_peft_format_needs_torch_module_names(tmp_path):
    model = _linear_graph("in_out")
    model.graph.initializer[0].name = "W"
    model.graph.node[0].input[1] = "W"
    adapted = lora.add_lora(model, "W", rank=2)
    with pytest.raises(lora.LoraError, match="torch module.*'W'"):
        lora.save_adapter(adapted, tmp_path / "peft", format="peft")
    with pytest.raises(lora.LoraError, match="format must be one of"):
        lora.save_adapter(adapted, tmp_path / "x", format="gguf")


def test_the_default_weights_of_an_adapted_model_are_its_adapters():
    """The base stays frozen unless named: prepare's one choice of weights."""
    adapted = lora.add_lora(_linear_graph("gemm"), "lin", rank=2)
    _, weights = prepare_for_training(adapted, None)
    assert weights == lora.adapter_names(adapted)
    _, named = prepare_for_training(adapted, ["lin.bias", *lora.adapter_names(adapted)])
    assert "lin.bias" in named


# -- a quantized base (QLoRA) --------------------------------------------------------------


def _quantized_mlp(dequantize: bool, zero_point: bool = True) -> onnx.ModelProto:
    """x [N, 16] -> Transpose(DQ(int8 [32, 16], per output channel)) -> Relu -> MatMul by
    DQ(int4 [32, 4], block-wise along the inputs, blocks of 8) -> y [N, 4]; with
    ``dequantize``, the same model with float weights (onnx's reference dequantizes).
    Without ``zero_point``, the first layer's is left to its default (0)."""
    rng = np.random.default_rng(5)
    w1 = helper.make_tensor("l1.weight", TensorProto.INT8, [32, 16], rng.integers(-127, 127, 512))
    s1 = numpy_helper.from_array(rng.uniform(0.005, 0.01, 32).astype(np.float32), "l1.scale")
    z1 = numpy_helper.from_array(rng.integers(-4, 4, 32).astype(np.int8), "l1.zero")
    w2 = helper.make_tensor("l2.weight", TensorProto.INT4, [32, 4], rng.integers(-8, 7, 128))
    s2 = numpy_helper.from_array(rng.uniform(0.05, 0.1, (4, 4)).astype(np.float32), "l2.scale")
    nodes = [
        helper.make_node(
            "DequantizeLinear",
            ["l1.weight", "l1.scale", "l1.zero" if zero_point else ""],
            ["w1"],
            axis=0,
        ),
        helper.make_node("Transpose", ["w1"], ["w1t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "w1t"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node(
            "DequantizeLinear", ["l2.weight", "l2.scale"], ["w2"], axis=0, block_size=8
        ),
        helper.make_node("MatMul", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qmlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [w1, s1, z1, w2, s2] if zero_point else [w1, s1, w2, s2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    if not dequantize:
        return model
    from onnx.reference import ReferenceEvaluator

    floats = {}
    for node in nodes:
        if node.op_type == "DequantizeLinear":
            single = copy.deepcopy(model)
            del single.graph.output[:]
            single.graph.output.append(helper.make_tensor_value_info(node.output[0], 1, None))
            (floats[node.output[0]],) = ReferenceEvaluator(single).run(
                None, {"x": np.zeros((1, 16), np.float32)}
            )
    kept = [n for n in nodes if n.op_type != "DequantizeLinear"]
    for node in kept:
        node.input[:] = [{"w1": "l1.weight", "w2": "l2.weight"}.get(i, i) for i in node.input]
    graph = helper.make_graph(
        kept,
        "mlp",
        list(graph.input),
        list(graph.output),
        [
            numpy_helper.from_array(floats["w1"], "l1.weight"),
            numpy_helper.from_array(floats["w2"], "l2.weight"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


QUANTIZED_CASES = [
    pytest.param(backend, trainer, True, id=f"{backend}-{trainer.__name__}")
    for backend in INSTALLED_BACKENDS
    for trainer in (Trainer, ForwardBackwardTrainer)
] + [
    pytest.param(backend, Trainer, False, id=f"{backend}-no-zero-point")
    for backend in INSTALLED_BACKENDS
]


@pytest.mark.parametrize("backend,trainer_class,zero_point", QUANTIZED_CASES)
def test_adapters_on_a_quantized_base_equal_those_on_its_float_twin(
    backend, trainer_class, zero_point
):
    """10 AdamW steps of adapters on both layers (the first one's gradient flows back
    through the int4 weight); the quantized tensors never change, and the merged model
    predicts as the float twin's. (An int8 weight without a zero point failed to load on
    onnxruntime 1.19.2 before graphkit named one.)"""
    quantized = _quantized_mlp(False, zero_point)
    floating = _quantized_mlp(True, zero_point)
    rng = np.random.default_rng(6)
    x = rng.normal(size=(40, 16)).astype(np.float32)
    y = rng.normal(size=(40, 4)).astype(np.float32)
    states, predictions = [], []
    for model in (quantized, floating):
        adapted = lora.add_lora(model, ["l1", "l2"], rank=2, alpha=4, random_state=0)
        assert lora.adapter_names(adapted) == [
            "l1.lora_A.weight", "l1.lora_B.weight", "l2.lora_A.weight", "l2.lora_B.weight"
        ]  # fmt: skip
        trainer = trainer_class(
            adapted,
            optimizer=optimizers.adamw(learning_rate=0.01),
            loss="squared_error",
            batch_size=4,
            max_iter=1,
            shuffle=False,
            backend=backend,
        ).fit(x, y)
        states.append(trainer.get_state())
        merged = lora.merge_lora(trainer.get_trained_onnx())
        onnx.checker.check_model(merged, full_check=True)
        predictions.append(ort_engine.run(merged, {"x": x})["y"])
        if model is quantized:
            trained = trainer.get_trained_onnx()
            for name in ("l1.weight", "l2.weight"):
                before = next(t for t in quantized.graph.initializer if t.name == name)
                after = next(t for t in trained.graph.initializer if t.name == name)
                assert after.SerializeToString() == before.SerializeToString()
            assert not any(n.op_type == "DequantizeLinear" for n in merged.graph.node)
    for name in lora.adapter_names(lora.add_lora(quantized, ["l1", "l2"], rank=2)):
        np.testing.assert_allclose(states[0][name], states[1][name], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(predictions[0], predictions[1], rtol=1e-4, atol=1e-5)


def _nbits_layer(name: str, w: np.ndarray, block: int, bits: int, zero: bool, bias: bool):
    """``MatMulNBits`` of the float weight ``w`` [N, K] quantized as onnxruntime packs it
    (blocks along K, two 4-bit values a byte, low nibble first; zero points packed per
    row), and the float weight its quantized values stand for: (q - z) s."""
    n, k = w.shape
    blocks = -(-k // block)
    padded = np.zeros((n, blocks * block), np.float32)
    padded[:, :k] = w
    grouped = padded.reshape(n, blocks, block)
    top = (1 << bits) - 1
    low, high = grouped.min(-1), grouped.max(-1)
    scale = ((high - low) / top).astype(np.float32)
    z = np.clip(np.round(-low / scale), 0, top) if zero else np.full((n, blocks), 1 << (bits - 1))
    z = z.astype(np.uint8)
    q = np.clip(np.round(grouped / scale[..., None]) + z[..., None], 0, top).astype(np.uint8)
    dequantized = ((q.astype(np.float32) - z[..., None]) * scale[..., None]).reshape(n, -1)[:, :k]
    if bits == 4:
        pairs = q.reshape(n, blocks, block // 2, 2)
        packed = pairs[..., 0] | (pairs[..., 1] << 4)
        rows = np.zeros((n, 2 * -(-blocks // 2)), np.uint8)
        rows[:, :blocks] = z
        zeros = (rows[:, 0::2] | (rows[:, 1::2] << 4)).reshape(-1)
    else:
        packed, zeros = q, z.reshape(-1)
    inits = [
        numpy_helper.from_array(packed.astype(np.uint8), f"{name}.weight"),
        numpy_helper.from_array(scale.reshape(-1), f"{name}.scales"),
    ]
    inputs = [f"{name}.x", f"{name}.weight", f"{name}.scales", ""]
    if zero:
        inits.append(numpy_helper.from_array(zeros.astype(np.uint8), f"{name}.zeros"))
        inputs[3] = f"{name}.zeros"
    if bias:
        inits.append(
            numpy_helper.from_array(np.linspace(-1, 1, n, dtype=np.float32), f"{name}.bias")
        )
        inputs += ["", f"{name}.bias"]
    attrs = dict(K=k, N=n, bits=bits, block_size=block)
    node = helper.make_node(
        "MatMulNBits", inputs, [f"{name}.y"], domain="com.microsoft", name=name, **attrs
    )
    return node, inits, dequantized


def _nbits_mlp(bits: int = 4):
    """x [M, 40] -> MatMulNBits (24 outputs, blocks of 16: the last one padded, zero
    points, bias) -> Relu -> MatMulNBits (3 outputs, default zero points); and the same
    network with the float weights the quantized ones stand for."""
    rng = np.random.default_rng(7)
    node1, inits1, w1 = _nbits_layer("l1", rng.normal(size=(24, 40)), 16, bits, True, True)
    node2, inits2, w2 = _nbits_layer("l2", rng.normal(size=(3, 24)), 16, bits, False, False)
    node1.input[0], node1.output[0] = "x", "h"
    node2.input[0], node2.output[0] = "r", "y"
    io = (
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", 40])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", 3])],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    nodes = [node1, helper.make_node("Relu", ["h"], ["r"]), node2]
    graph = helper.make_graph(nodes, "nbits", *io, inits1 + inits2)
    quantized = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    floats = [
        helper.make_node("MatMul", ["x", "l1.weight"], ["h0"]),
        helper.make_node("Add", ["h0", "l1.bias"], ["h"]),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "l2.weight"], ["y"]),
    ]
    weights = [
        numpy_helper.from_array(w1.T.copy(), "l1.weight"),
        numpy_helper.from_array(w2.T.copy(), "l2.weight"),
        next(t for t in inits1 if t.name == "l1.bias"),
    ]
    graph = helper.make_graph(floats, "float", *io, weights)
    return quantized, helper.make_model(graph, opset_imports=opsets[:1], ir_version=10)


@pytest.mark.parametrize("bits", [4, 8])
def test_matmul_nbits_as_standard_predicts_as_onnxruntimes_kernel(bits):
    quantized, floating = _nbits_mlp(bits)
    standard = matmul_nbits_as_standard(quantized)
    onnx.checker.check_model(standard, full_check=True)
    assert not any(n.domain for n in standard.graph.node)
    x = np.random.default_rng(8).normal(size=(5, 40)).astype(np.float32)
    (ours,) = ort_engine.run(standard, {"x": x}).values()
    (twin,) = ort_engine.run(floating, {"x": x}).values()
    np.testing.assert_allclose(ours, twin, rtol=1e-5, atol=1e-5)
    try:
        (kernel,) = ort_engine.run(quantized, {"x": x}).values()
    except Exception as exc:  # onnxruntime 1.19.2's kernel takes 4 bits only
        pytest.skip(f"onnxruntime {ort_engine.version()} cannot run this MatMulNBits: {exc}")
    np.testing.assert_allclose(ours, kernel, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_adapters_on_matmul_nbits_equal_those_on_the_float_weights(backend):
    quantized, floating = _nbits_mlp(4)
    rng = np.random.default_rng(9)
    x = rng.normal(size=(40, 40)).astype(np.float32)
    y = rng.normal(size=(40, 3)).astype(np.float32)
    states, predictions = [], []
    for model in (quantized, floating):
        adapted = lora.add_lora(model, ["l1.weight", "l2.weight"], rank=2, random_state=0)
        trainer = Trainer(
            adapted,
            optimizer=optimizers.adamw(learning_rate=0.01),
            loss="squared_error",
            batch_size=4,
            max_iter=1,
            shuffle=False,
            backend=backend,
        ).fit(x, y)
        states.append(trainer.lora_state())
        merged = lora.merge_lora(trainer.get_trained_onnx())
        onnx.checker.check_model(merged, full_check=True)
        predictions.append(ort_engine.run(merged, {"x": x})["y"])
    assert sorted(states[0]) == sorted(states[1])
    for name in states[0]:
        np.testing.assert_allclose(states[0][name], states[1][name], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(predictions[0], predictions[1], rtol=1e-4, atol=1e-5)


def test_an_adapted_model_resumes_from_its_checkpoint_and_trains_exported(tmp_path):
    """Checkpoints and the portable exports see an ordinary graph: 2 epochs then 2 more
    from the checkpoint equal 4 at once; the exported step, run by PortableTrainer on
    onnx and numpy alone, continues as the trainer does and moves only the adapters."""
    from graphkit.portable_trainer import PortableTrainer

    adapted = lora.add_lora(_linear_graph("transpose"), "lin", rank=2, random_state=0)
    rng = np.random.default_rng(10)
    x, y = rng.normal(size=(16, 3)), rng.normal(size=(16, 5))
    settings = dict(optimizer="adam", loss="squared_error", batch_size=4, shuffle=False)
    path = tmp_path / "adapted.ckpt"
    Trainer(adapted, max_iter=2, **settings).fit(x, y, checkpoint=path)
    resumed = Trainer(adapted, max_iter=4, **settings).fit(x, y, checkpoint=path)
    straight = Trainer(adapted, max_iter=4, **settings).fit(x, y)
    for name, value in straight.lora_state().items():
        np.testing.assert_allclose(resumed.lora_state()[name], value, rtol=1e-12)

    step = Trainer(adapted, max_iter=2, **settings).fit(x, y)
    exported = step.export_training_step()  # run by onnx.reference, as anywhere
    portable = PortableTrainer(exported, batch_size=4, shuffle=False, runtime="reference")
    portable.fit(x, y, epochs=2)
    state = portable.state()
    for name, value in straight.lora_state().items():
        np.testing.assert_allclose(state[name], value, rtol=1e-10)
    base = {t.name: numpy_helper.to_array(t) for t in adapted.graph.initializer}
    np.testing.assert_array_equal(state.get("lin.weight", base["lin.weight"]), base["lin.weight"])


def test_a_session_that_dequantizes_runs_the_graph_as_written():
    """onnxruntime's rewrites would quantize each dequantized weight again at every step
    (a QuantizeLinear after its Transpose): such a session has none of them."""
    ort = ort_engine.onnxruntime()
    quantized = ort_engine.inference_session(_quantized_mlp(False))
    floating = ort_engine.inference_session(_quantized_mlp(True))
    disabled = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    assert quantized.get_session_options().graph_optimization_level == disabled
    assert floating.get_session_options().graph_optimization_level != disabled
    x = np.random.default_rng(11).normal(size=(3, 16)).astype(np.float32)
    (got,) = quantized.run(None, {"x": x})
    (expected,) = floating.run(None, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
