"""LoRA adapters (graphkit.lora) against the formula; PEFT itself is the reference of
tests/test_lora_peft.py.

* the rewrite, on hand-built graphs (``MatMul``, ``Transpose`` then ``MatMul``, ``Gemm``
  with ``transB``): the adapted output and one SGD step against the numpy formula
  ``y = x W + (alpha / r) (x A) B``;
* onnxruntime's adapter format, where the installed onnxruntime writes it (1.20+);
* the errors of bad input.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphkit import lora, optimizers
from graphkit.engine import ort_engine
from graphkit.prepare import prepare_for_training
from graphkit_train import Trainer

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
    with pytest.raises(lora.LoraError, match="Dropout"):
        lora.add_lora(model, "lin", rank=2, dropout=0.1)
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
