"""Kernel-count regressions: the whole-epoch graphs the profiling investigations of
docs/design/performance.md looked at, built as full training builds them, and the kernel
counts (or the operators present and absent) their conclusions rely on.

On batches of microseconds a step's time is onnxruntime's 0.35 us per Scan iteration
plus 0.24 us per kernel, so a kernel more in the Scan body is a slower epoch; these
tests fail where a change of graphkit's graph rewrites (or of onnxruntime's) adds one.
Each test says which conclusion it guards and in which section of the design note it
is written. The expected numbers are derived from the models' structure (layers,
weights, elements per tensor) wherever the conclusion allows; the bounds that are
measurements say so.

The graphs are built as the full trainer's fused runner builds them: the problem's
fused step (:class:`graphkit.training.problem.TrainingProblem`), specialized to the
batch size (:func:`graphkit.static_shapes.specialize`, with the backend's constant
folds), as the body of a Scan over the batches
(:func:`graphkit.training.epoch.scan_over_batches`); what onnxruntime runs is that
graph after its own graph optimizations (the model it writes with
``optimized_model_filepath``, under graphkit's session options), after the
ort_training backend's lowering of slow CPU kernels where that backend runs it. Only
graphs are built: nothing trains, nothing is timed.
"""

from __future__ import annotations

import collections
import functools
import math
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import INSTALLED_BACKENDS
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import backends, optimizers
from graphkit.engine import ort_engine
from graphkit.static_shapes import GEMV_FUSED_UP_TO, SIGN_MASK_UP_TO, specialize
from graphkit.training.epoch import scan_over_batches
from graphkit.training.problem import TrainingProblem
from graphkit.training.step import PACK_UP_TO_BYTES

SMALL = (10, 10, 1)
"""benchmarks/run.py's MLP 10-10-1, trained at batch 10: the small-batch investigations."""

LARGE = (100, 256, 256, 1)
"""benchmarks/peers.py's MLP 100-256-256-1, trained at batch 256."""

WIDE = (784, 512, 512, 10)
"""benchmarks/peers.py's MLP 784-512-512-10 (669,706 weights), at batch 128."""

BATCH = {SMALL: 10, LARGE: 256, WIDE: 128}

ADAMW_PASSES = 13
"""The fewest elementwise kernels of AdamW's update in standard ONNX, the step counter's
scalars computed before the epoch: m += (g - m)(1 - b1) [3]; v += (g g - v)(1 - b2)
[4]; u = m / (sqrt(v) + eps') [3]; p' = p (1 - lr wd) - u s [3]."""

PRODUCTS = frozenset({"MatMul", "Gemm", "FusedMatMul", "FusedGemm"})

SHAPE_PLUMBING = frozenset(
    {"Shape", "Size", "Expand", "ConstantOfShape", "BroadcastGradientArgs", "Range"}
)


def mlp(sizes: tuple[int, ...], seed: int = 0) -> onnx.ModelProto:
    """Dense layers of ``sizes`` with a ReLU between them (MatMul + Add each, as an
    exporter writes a Linear layer), float32, opset 18."""
    rng = np.random.default_rng(seed)
    nodes, weights, h = [], [], "X"
    layers = list(zip(sizes[:-1], sizes[1:]))
    for k, (n_in, n_out) in enumerate(layers):
        last = k == len(layers) - 1
        out = "Y" if last else f"z{k}"
        weights += [
            numpy_helper.from_array(
                (rng.normal(size=(n_in, n_out)) / math.sqrt(n_in)).astype(np.float32), f"W{k}"
            ),
            numpy_helper.from_array(np.zeros(n_out, np.float32), f"b{k}"),
        ]
        nodes += [
            helper.make_node("MatMul", [h, f"W{k}"], [f"m{k}"]),
            helper.make_node("Add", [f"m{k}", f"b{k}"], [out]),
        ]
        if not last:
            nodes.append(helper.make_node("Relu", [out], [f"h{k}"]))
            h = f"h{k}"
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", sizes[0]])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", sizes[-1]])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def optimizer(name: str):
    if name == "sgd":
        return optimizers.sgd(learning_rate=0.01)
    return optimizers.adamw(weight_decay=0.01, learning_rate=0.001)


@functools.cache
def epoch(sizes: tuple[int, ...], name: str, backend: str) -> onnx.ModelProto:
    """The whole-epoch graph full training runs for the MLP ``sizes`` at its batch
    size, trained by optimizer ``name`` (squared error; cross-entropy for 10 classes)."""
    loss = "cross_entropy" if sizes[-1] > 1 else "squared_error"
    problem = TrainingProblem.from_model(
        gk.add_loss_output(mlp(sizes), loss), None, optimizer(name), backend=backend
    )
    step, batch = problem.step(), BATCH[sizes]
    folds = backends.get(backend).constant_folds
    static = specialize(step.model, dict.fromkeys(step.data, batch), folds)
    return scan_over_batches(static, step.data, step.resident, step.loss, batch)


def body(model: onnx.ModelProto) -> onnx.GraphProto:
    """The body of the epoch graph's Scan: one training step."""
    (scan,) = [n for n in model.graph.node if n.op_type == "Scan"]
    return next(a.g for a in scan.attribute if a.name == "body")


def kinds(graph: onnx.GraphProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in graph.node)


@functools.cache
def run_kernels(sizes: tuple[int, ...], name: str, backend: str) -> collections.Counter:
    """The kernels onnxruntime runs per batch: the Scan body of :func:`epoch` once
    onnxruntime has optimized it (as the design note's tables count them)."""
    model = epoch(sizes, name, backend)
    if backend == "ort_training":  # as its inference_session does on the CPU
        from graphkit.backends.ort_training.lowering import lower_slow_cpu_ops

        model = lower_slow_cpu_ops(model)
    with tempfile.TemporaryDirectory() as tmp:
        options = ort_engine.session_options()
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath)
    return kinds(body(optimized))


def linear_layers(sizes: tuple[int, ...]) -> int:
    return len(sizes) - 1


def hidden_layers(sizes: tuple[int, ...]) -> int:
    return len(sizes) - 2


def weight_count(sizes: tuple[int, ...]) -> int:
    return sum(n_in * n_out + n_out for n_in, n_out in zip(sizes[:-1], sizes[1:]))


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_small_mlp_sgd_step_is_within_two_kernels_of_the_hand_written_floor(backend):
    """Guards: "graphkit's MLP 10-10-1 at batch 10" (design note, *Small batches: the
    kernels of a step*): the SGD step runs 18 kernels a batch on native, 17 on
    ort_training, against the 16 of the fewest standard kernels, written by hand (the
    two more: the one-column output bias's Reshape and its own learning-rate Mul;
    ort_training's ReluGrad is one kernel where native's mask is two).

    The floor, from the structure (L Linear layers): per layer its forward product (the
    bias and the ReLU fused into it), its weight's gradient and update one Gemm, its
    bias's gradient and update two; per hidden layer the input's gradient, a product,
    and the ReLU mask, two kernels (Sign, Mul); the loss five (Sub, ReduceSumSquare,
    the mean's Mul, the running sum's Add, the learning rate's Mul): 7 L + 2. Products
    (and the one-column bias's full sum) are 4 L - 1: forward, weight gradient, bias
    gradient per layer and the input's gradient per hidden layer; no Transpose is left
    for a kernel of its own, no shape computation in the step."""
    layers = linear_layers(SMALL)
    floor = 7 * layers + 2
    run = run_kernels(SMALL, "sgd", backend)
    assert floor == 16
    assert sum(run.values()) <= floor + 2, run
    assert sum(run[k] for k in PRODUCTS) + run["ReduceSum"] == 4 * layers - 1, run
    assert "Transpose" not in run, run
    assert not set(run) & SHAPE_PLUMBING, run
    assert not kinds(body(epoch(SMALL, "sgd", backend))).keys() & SHAPE_PLUMBING


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_small_mlp_adamw_step_adds_only_its_update_to_the_sgd_step(backend):
    """Guards: "graphkit's MLP 10-10-1 at batch 10", AdamW rows (design note, *Small
    batches: the kernels of a step*): 34 kernels a batch on native, 33 on ort_training,
    the hand-written floor 33. AdamW's step is SGD's with the update in
    :data:`ADAMW_PASSES` passes over the packed weights, the gradients' Concat, the
    weights' Split, and the Reshapes between the vector and the matrices less the SGD
    updates they replace: measured 16 kernels beyond SGD's step on both backends,
    bounded here by the passes and three."""
    sgd, adamw = run_kernels(SMALL, "sgd", backend), run_kernels(SMALL, "adamw", backend)
    assert sum(adamw.values()) <= sum(sgd.values()) + ADAMW_PASSES + 3, (sgd, adamw)
    assert sum(adamw.values()) <= 34, adamw  # the measured count: the floor + 1
    assert adamw["Concat"] == 1 and adamw["Split"] == 1, adamw
    assert "Transpose" not in adamw, adamw


@pytest.mark.parametrize("sizes", [SMALL, LARGE, WIDE], ids=["10-10-1", "100-256-256-1", "784"])
def test_each_weights_gradient_and_sgd_update_is_one_gemm(sizes):
    """Guards: "SGD: each weight's gradient and update one Gemm" (design note, *Small
    batches* and *The MLP 100-256-256-1 against its floor*): in graphkit's step, each
    Linear layer's weight becomes ``Gemm(x, dy, W, transA=1)`` writing its next value,
    except a one-column weight over more than GEMV_FUSED_UP_TO elements of x, whose
    fast matrix-vector path wants no C (its product alone is a Gemm, the Mul and Add
    stay). A unit test of the rewrite: tests/test_fused.py
    (test_a_weights_gradient_and_sgd_update_become_one_gemm)."""
    graph = body(epoch(sizes, "sgd", "native"))
    batch = BATCH[sizes]
    weights = {f"W{k}": (n_in, n_out) for k, (n_in, n_out) in enumerate(zip(sizes, sizes[1:]))}
    expected = {
        w
        for w, (n_in, n_out) in weights.items()
        if not (n_out == 1 and batch * n_in > GEMV_FUSED_UP_TO)
    }
    fused = {
        n.input[2].removeprefix("step/")
        for n in graph.node
        if n.op_type == "Gemm" and len(n.input) == 3 and n.output[0].endswith(".next")
    }
    assert fused == expected


@pytest.mark.parametrize("sizes", [SMALL, LARGE], ids=["10-10-1", "100-256-256-1"])
def test_relu_gradients_are_the_fastest_exact_masks(sizes):
    """Guards: "graphkit writes Cast(y > 0), and Sign(y) on at most 256 elements"
    (design note, *ReLU gradients*): the native step has one mask per hidden ReLU, a
    Sign where the hidden layer's output has at most SIGN_MASK_UP_TO elements (the MLP
    10-10-1 at batch 10: 100), Greater and Cast above (the MLP 100-256-256-1 at batch
    256: 65,536); never the inexact HardSigmoid, nor a Where (6 times Cast(y > 0)'s
    time). A unit test of the rewrite: tests/test_fused.py
    (test_a_small_relu_gradient_mask_is_one_sign); ort_training's ReluGrad lowered where
    large: test_float32_relu_training_runs_the_faster_relu_gradient_and_equals_numpy."""
    found = kinds(body(epoch(sizes, "sgd", "native")))
    hidden = hidden_layers(sizes)
    elements = BATCH[sizes] * sizes[1]
    small = elements <= SIGN_MASK_UP_TO
    assert found["Relu"] == hidden
    assert found["Sign"] == (hidden if small else 0), found
    assert found["Greater"] == found["Cast"] == (0 if small else hidden), found
    assert not found.keys() & {"HardSigmoid", "Where", "ReluGrad"}, found


def packed_size_kernels(graph_model: onnx.ModelProto, size: int) -> list[str]:
    """The operators of the Scan body's nodes whose output is a vector of ``size``."""
    graph = body(onnx.shape_inference.infer_shapes(graph_model))
    shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in [*graph.value_info, *graph.input, *graph.output]
    }
    return [n.op_type for n in graph.node if shapes.get(n.output[0]) == [size]]


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
@pytest.mark.parametrize("sizes", [SMALL, LARGE], ids=["10-10-1", "100-256-256-1"])
def test_adamw_updates_packed_weights_in_thirteen_passes(sizes, backend):
    """Guards: "AdamW's update is 13 passes over the weights, laid end to end up to 512
    KiB" (design note, *AdamW's update*): for a model of at most PACK_UP_TO_BYTES of
    weights (121 and 91,905 float32 here), the Scan carries them as one vector: one
    Split gives the layers their weights, one Concat packs the gradients, and the
    update is :data:`ADAMW_PASSES` kernels on that vector (the decay's factors
    gathered, the counter's scalars computed before the Scan), not the optimizer
    chain's 15. Unit tests: tests/test_decay_factors.py (the gathered formula),
    tests/test_counter.py (the counter out of the Scan), tests/test_packed_carry.py."""
    size = weight_count(sizes)
    assert size * 4 <= PACK_UP_TO_BYTES
    model = epoch(sizes, "adamw", backend)
    found = kinds(body(model))
    assert found["Split"] == 1 and found["Concat"] == 1, found
    on_vector = packed_size_kernels(model, size)
    assert on_vector.count("Concat") == 1 and len(on_vector) == 1 + ADAMW_PASSES, on_vector
    assert on_vector.count("Sqrt") == on_vector.count("Div") == 1, on_vector


def test_adamw_updates_weights_beyond_512_kib_one_tensor_each():
    """Guards: "graphkit packs an update's weights only up to 512 KiB" (design note,
    *AdamW's update*): laid end to end, each of the 13 passes over the MLP
    784-512-512-10's 2.7 MB leaves the caches (82 us a pass against 50 one tensor per
    weight): its Scan carries each weight apart, no Concat or Split, one update (one
    Sqrt) per weight. The threshold itself: tests/test_fused.py
    (test_packing_is_used_where_it_saves_kernels)."""
    assert weight_count(WIDE) * 4 > PACK_UP_TO_BYTES
    found = kinds(body(epoch(WIDE, "adamw", "native")))
    assert not found.keys() & {"Concat", "Split"}, found
    assert found["Sqrt"] == 2 * linear_layers(WIDE), found


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_large_mlp_runs_no_transpose_of_its_own(backend):
    """Guards: "products of a transposed operand fold into the product" (design note,
    *The MLP 100-256-256-1 against its floor*): in the step onnxruntime runs for the
    MLP 100-256-256-1 at batch 256, on each backend, every product's transposed operand
    is the product's own (Gemm's trans attributes, FusedMatMul), no Transpose kernel,
    and no shape computation."""
    run = run_kernels(LARGE, "sgd", backend)
    assert "Transpose" not in run, run
    assert not set(run) & SHAPE_PLUMBING, run
