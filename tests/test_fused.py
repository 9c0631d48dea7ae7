"""Fused epochs, static shapes and packed updates (graphkit.training.epoch,
graphkit.static_shapes, graphkit.update_step.Packing).

The references are numpy written from the formulas (SGD on an MLP, Adam), onnxruntime's
own BroadcastGradientArgs kernel, and the one-run-per-batch path on the graph built for
any batch size, which the parity tests against torch and scikit-learn check.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from conftest import (
    INSTALLED_BACKENDS,
    four_calls_a_batch,
    linear_regression_onnx,
    mlp_onnx,
    requires_ort_training,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import graphkit as gk
from graphkit import optimizers, schedules, transforms
from graphkit._graph import all_graphs
from graphkit.backends.ort_training.folding import broadcast_gradient_args
from graphkit.backends.ort_training.lowering import SLOW_ON_CPU, lower_slow_cpu_ops
from graphkit.engine.ort_engine import inference_session
from graphkit.static_shapes import GEMM_ABOVE, specialize
from graphkit.training import batches
from graphkit.training.step import PACK_UP_TO_BYTES, build_update_step
from graphkit.update_step import PACKED
from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

# (steps_per_run, static_shapes, bytes of shuffled rows gathered per run)
ALL = batches.GATHER_BYTES
RUNS = [(1, False, ALL), (1, True, ALL), (3, True, ALL), ("epoch", True, ALL)]
RUNS += [("epoch", False, ALL), ("epoch", True, 1), (4, True, 1000)]


def mlp_sgd_numpy(weights, X, y, w, batch_size, lr, epochs, seed):
    """Hand-written SGD on Y = relu(X W1 + b1) W2 + b2 with graphkit's squared error
    (weighted mean over the batch of (y - p)^2) and graphkit's permutations."""
    W1, b1, W2, b2 = (weights[k].astype(np.float64).copy() for k in ("W1", "b1", "W2", "b2"))
    rng = np.random.default_rng(seed)
    losses = []
    for _ in range(epochs):
        order = rng.permutation(len(X))
        total, count = 0.0, 0
        for start in range(0, len(X), batch_size):
            rows = order[start : start + batch_size]
            x, t, s = X[rows], y[rows], w[rows]
            h = x @ W1 + b1
            a = np.maximum(h, 0)
            p = a @ W2 + b2
            total += float((s[:, None] * (p - t) ** 2).sum() / s.sum())
            count += 1
            g = 2 * s[:, None] * (p - t) / s.sum()
            gW2, gb2 = a.T @ g, g.sum(axis=0)
            ga = (g @ W2.T) * (h > 0)
            gW1, gb1 = x.T @ ga, ga.sum(axis=0)
            W1, b1, W2, b2 = W1 - lr * gW1, b1 - lr * gb1, W2 - lr * gW2, b2 - lr * gb2
        losses.append(total / count)
    return {"W1": W1, "b1": b1, "W2": W2, "b2": b2}, losses


def weighted_rows():
    """53 rows at batch 10 (five full batches and a short one), weighted, and a float64
    MLP 4-5-1."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(53, 4))
    y = rng.normal(size=(53, 1))
    w = rng.uniform(0.5, 2.0, size=53)
    return X, y, w, mlp_onnx(4, 5, 1, dtype=np.float64, scale=0.5)


def assert_numpy_sgd(trainer, model, X, y, w):
    """The trainer, fitted for 3 shuffled epochs (random_state=7) of SGD at lr 0.05 from
    ``model``'s weights, holds what mlp_sgd_numpy computes."""
    initial = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    expected, losses = mlp_sgd_numpy(initial, X, y, w, 10, 0.05, 3, seed=7)
    state = trainer.get_state()
    for name, value in expected.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(trainer.train_losses_, losses, rtol=1e-10)
    assert int(state["step"]) == 18


@pytest.mark.parametrize("steps_per_run, static_shapes, gather_bytes", RUNS)
def test_every_way_of_running_equals_numpy_sgd(
    steps_per_run, static_shapes, gather_bytes, monkeypatch
):
    """Weighted, shuffled rows (gathered a batch, two batches or all batches at a time)
    with a short last batch, whichever way full training runs them."""
    monkeypatch.setattr(batches, "GATHER_BYTES", gather_bytes)
    X, y, w, model = weighted_rows()
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model, weight_name="weight"),
        max_iter=3,
        batch_size=10,
        learning_rate=optimizers.sgd(learning_rate=0.05),
        random_state=7,
        steps_per_run=steps_per_run,
        static_shapes=static_shapes,
    ).fit(X, y, sample_weight=w)
    assert_numpy_sgd(trainer, model, X, y, w)


@pytest.mark.parametrize("calls", [pytest.param(2, marks=requires_ort_training), 4])
@pytest.mark.parametrize("gather_bytes", [ALL, 1, 1000])
def test_forward_backward_gathers_shuffled_rows_a_piece_at_a_time(gather_bytes, calls, monkeypatch):
    """Forward/backward training on the same rows of 48 bytes, gathered a batch at a time
    (an eighth of the data, 318 bytes, is less than a batch), two batches (1000 bytes) or
    all at once, in two-call batches (onnxruntime-training's fused agent step) and
    four-call batches (the default backend)."""
    monkeypatch.setattr(batches, "GATHER_BYTES", gather_bytes)
    X, y, w, model = weighted_rows()
    if calls == 4:
        four_calls_a_batch(monkeypatch)
    trainer = OrtGradientForwardBackwardOptimizer(
        model,
        max_iter=3,
        batch_size=10,
        learning_rate=optimizers.sgd(learning_rate=0.05),
        random_state=7,
        backend="ort_training" if calls == 2 else None,
    ).fit(X, y, sample_weight=w)
    assert bool(trainer._agent_runs) == (calls == 2)


@pytest.mark.parametrize("backend", INSTALLED_BACKENDS)
def test_a_model_at_an_older_opset_is_raised_and_its_batches_fuse(backend):
    """A model exported at opset 17 (torch's TorchScript exporter's default) is raised to
    opset 18, the loss and update graphs' own, so that they join its gradient graph: one
    fused step a batch, which trains as SGD in numpy does."""
    X, y, w, model = weighted_rows()
    older = onnx.ModelProto()
    older.CopyFrom(model)
    older.opset_import[0].version = 17
    trainer = OrtGradientForwardBackwardOptimizer(
        older,
        max_iter=3,
        batch_size=10,
        learning_rate=optimizers.sgd(learning_rate=0.05),
        random_state=7,
        backend=backend,
    ).fit(X, y, sample_weight=w)
    assert trainer._agent_runs  # the fused step ran, not four sessions
    assert_numpy_sgd(trainer, model, X, y, w)
    assert_numpy_sgd(trainer, model, X, y, w)


@requires_ort_training
@pytest.mark.parametrize("hidden, lowered", [(6, False), (512, True)])
def test_float32_relu_training_runs_the_faster_relu_gradient_and_equals_numpy(hidden, lowered):
    """onnxruntime-training's ReluGrad CPU kernel costs 4x its lowering on large tensors
    (10 x 512 here), less on small ones (10 x 6): the epoch graph runs the faster (in the
    Scan body too), and trains as numpy's float64 SGD does."""
    rng = np.random.default_rng(3)
    X = rng.normal(size=(45, 4)).astype(np.float32)
    y = rng.normal(size=(45, 1)).astype(np.float32)
    w = np.ones(45, np.float32)
    model = mlp_onnx(4, hidden, 1, scale=0.5)
    initial = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model),
        max_iter=3,
        batch_size=10,
        learning_rate=0.01,
        random_state=1,
        backend="ort_training",
    )
    trainer.fit(X, y)
    expected, losses = mlp_sgd_numpy(initial, X, y, w, 10, 0.01, 3, seed=1)
    for name, value in expected.items():
        np.testing.assert_allclose(trainer.get_state()[name], value, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(trainer.train_losses_, losses, rtol=1e-4)

    def ops(model):
        return {n.op_type for graph in all_graphs(model.graph) for n in graph.node}

    epoch = trainer._runner(10).scan_model
    assert "ReluGrad" in ops(epoch)
    assert ("ReluGrad" not in ops(lower_slow_cpu_ops(epoch))) == lowered
    assert not lowered or not ops(lower_slow_cpu_ops(epoch)) & SLOW_ON_CPU


@requires_ort_training
def test_float64_and_old_opset_graphs_keep_their_kernels():
    """ort_training lowers its slow CPU gradient kernels in float32 graphs only."""
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(mlp_onnx(4, 6, 1, dtype=np.float64)), backend="ort_training"
    )
    trainer._build()
    assert lower_slow_cpu_ops(trainer.training_step_.model) is trainer.training_step_.model
    trainer = OrtGradientOptimizer(gk.add_loss_output(mlp_onnx(4, 6, 1)), backend="ort_training")
    trainer._build()
    old = onnx.ModelProto()
    old.CopyFrom(trainer.training_step_.model)
    old.opset_import[0].version = 14
    assert lower_slow_cpu_ops(old) is old


OPTIMIZERS = {
    "sgd": lambda: optimizers.sgd(learning_rate=0.05),
    "nesterov": lambda: optimizers.nesterov(momentum=0.9, learning_rate=0.05),
    "adam": lambda: optimizers.adam(learning_rate=0.01),
    "adamw": lambda: optimizers.adamw(weight_decay=0.1, learning_rate=0.01),
    "adagrad": lambda: optimizers.adagrad(learning_rate=0.05),
    "rmsprop": lambda: optimizers.rmsprop(learning_rate=0.01),
    "lion": lambda: optimizers.lion(learning_rate=0.001),
    "lamb": lambda: optimizers.lamb(learning_rate=0.01),
    "radam": lambda: optimizers.radam(learning_rate=0.01),
    "adadelta": lambda: optimizers.adadelta(learning_rate=1.0),
    "adafactor": lambda: optimizers.adafactor(learning_rate=0.01),
    "adam+cosine": lambda: transforms.chain(
        transforms.clip_by_global_norm(1.0),
        optimizers.adam(learning_rate=schedules.cosine(0.01, 20)),
    ),
    "sgd+warmup": lambda: optimizers.sgd(
        learning_rate=schedules.warmup(schedules.cosine(0.05, 20), 5)
    ),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_epochs_equal_one_run_per_batch(name, dtype):
    """Same weights and state after 2 epochs whichever way the batches run (the
    one-run-per-batch path on the dynamic graph is the one checked against torch)."""
    rng = np.random.default_rng(1)
    X = rng.normal(size=(47, 3)).astype(dtype)
    y = rng.normal(size=(47, 2)).astype(dtype)
    w = rng.uniform(0.5, 2.0, size=47).astype(dtype)
    states = {}
    for steps_per_run, static in [(1, False), ("epoch", True), (4, True)]:
        trainer = OrtGradientOptimizer(
            gk.add_loss_output(mlp_onnx(3, 4, 2, dtype=dtype, scale=0.5), weight_name="weight"),
            max_iter=2,
            batch_size=8,
            learning_rate=OPTIMIZERS[name](),
            random_state=3,
            steps_per_run=steps_per_run,
            static_shapes=static,
        )
        trainer.fit(X, y, sample_weight=w)
        states[steps_per_run] = trainer.get_state()
    reference = states[1]
    for other in ("epoch", 4):
        assert set(states[other]) == set(reference)
        for key, value in reference.items():
            if dtype == np.float64:
                np.testing.assert_allclose(states[other][key], value, rtol=1e-12, atol=1e-14)
            else:  # a static step sums bias gradients with a MatMul: another order
                np.testing.assert_allclose(states[other][key], value, rtol=2e-5, atol=1e-6)


def test_no_shuffle_and_a_batch_larger_than_the_data():
    rng = np.random.default_rng(2)
    X, y = rng.normal(size=(7, 4)), rng.normal(size=(7, 1))
    model = mlp_onnx(4, 5, 1, dtype=np.float64, scale=0.5)
    initial = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    for batch_size in (3, 50):
        trainer = OrtGradientOptimizer(
            gk.add_loss_output(model),
            max_iter=2,
            batch_size=batch_size,
            learning_rate=0.1,
            shuffle=False,
        )
        trainer.fit(X, y)
        W = {k: v.copy() for k, v in initial.items()}
        for _ in range(2):
            for start in range(0, 7, batch_size):
                x, t = X[start : start + batch_size], y[start : start + batch_size]
                h = x @ W["W1"] + W["b1"]
                a = np.maximum(h, 0)
                g = 2 * (a @ W["W2"] + W["b2"] - t) / len(x)
                ga = (g @ W["W2"].T) * (h > 0)
                grads = {"W2": a.T @ g, "b2": g.sum(0), "W1": x.T @ ga, "b1": ga.sum(0)}
                W = {k: W[k] - 0.1 * grads[k] for k in W}
        for k in W:
            np.testing.assert_allclose(trainer.get_state()[k], W[k], rtol=1e-10)


def test_rows_in_order_are_fed_without_a_copy():
    X = np.random.default_rng(0).normal(size=(40, 4)).astype(np.float32)
    y = np.zeros((40, 1), np.float32)
    trainer = OrtGradientOptimizer(gk.add_loss_output(mlp_onnx(4, 3, 1)), max_iter=1, shuffle=False)
    trainer.fit(X, y)
    runner = trainer._runner(10)
    assert runner.session is None and len(runner.bindings) == 2  # the Scan runs, not steps
    assert runner._in_order[0][0].data_ptr() == X.ctypes.data


def test_warm_started_fits_on_the_same_arrays_see_changes_made_in_place():
    """The batches of rows in order are views kept across fits on the same arrays: a
    label changed in place between fits is what the next fit trains on (numpy SGD)."""
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(40, 3)), rng.normal(size=(40, 1))
    coef, intercept = rng.normal(size=(3, 1)), np.zeros(1)
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(linear_regression_onnx(coef, intercept)),
        max_iter=1,
        batch_size=10,
        learning_rate=0.1,
        shuffle=False,
        warm_start=True,
    )
    W, b = coef.copy(), intercept.copy()
    for fit in range(3):
        if fit == 2:
            y *= 3  # in place: the same array object
        trainer.fit(X, y)
        for start in range(0, 40, 10):
            x, t = X[start : start + 10], y[start : start + 10]
            g = 2 * (x @ W + b - t) / 10
            W, b = W - 0.1 * x.T @ g, b - 0.1 * g.sum(axis=0)
    np.testing.assert_allclose(trainer.get_state()["coef"], W, rtol=1e-10)
    np.testing.assert_allclose(trainer.get_state()["intercept"], b, rtol=1e-10)


def test_divergence_in_a_fused_epoch_restores_the_last_good_epoch():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(100, 4)) * 100
    y = rng.normal(size=(100, 1)) * 1e6
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(mlp_onnx(4, 3, 1, dtype=np.float64)),
        max_iter=50,
        learning_rate=1.0,
        random_state=0,
    )
    with pytest.raises(gk.ConvergenceError, match="previous epoch"):
        trainer.fit(X, y)
    good = len(trainer.train_losses_)
    state = trainer.get_state()
    assert all(np.isfinite(v).all() for v in state.values())
    assert int(state["step"]) == good * 10  # the epochs kept, not the one that failed


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"steps_per_run": 0}, "steps_per_run"),
        ({"steps_per_run": "batch"}, "steps_per_run"),
        ({"intra_op_num_threads": 0}, "intra_op_num_threads"),
        ({"execution_mode": "fast"}, "execution_mode"),
    ],
)
def test_bad_run_options(kwargs, message):
    trainer = OrtGradientOptimizer(gk.add_loss_output(mlp_onnx(2, 2, 1)), **kwargs)
    with pytest.raises(ValueError, match=message):
        trainer.fit(np.zeros((4, 2), np.float32), np.zeros(4, np.float32))


def test_threads_and_parallel_mode_train_the_same():
    rng = np.random.default_rng(3)
    X, y = rng.normal(size=(60, 4)), rng.normal(size=(60, 1))
    states = []
    for kwargs in ({}, {"intra_op_num_threads": 1, "execution_mode": "parallel"}):
        trainer = OrtGradientOptimizer(
            gk.add_loss_output(mlp_onnx(4, 5, 1, dtype=np.float64)),
            max_iter=2,
            learning_rate="adam",
            random_state=0,
            **kwargs,
        )
        states.append(trainer.fit(X, y).get_state())
    for key in states[0]:
        np.testing.assert_array_equal(states[0][key], states[1][key])


# -- packing ---------------------------------------------------------------------------


def adam_numpy(params, grads_per_step, lr, b1=0.9, b2=0.999, eps=1e-8):
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(v) for k, v in params.items()}
    p = {k: val.copy() for k, val in params.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        for k in p:
            m[k] = b1 * m[k] + (1 - b1) * grads[k]
            v[k] = b2 * v[k] + (1 - b2) * grads[k] ** 2
            m_hat, v_hat = m[k] / (1 - b1**t), v[k] / (1 - b2**t)
            p[k] = p[k] - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p, m, v


@settings(max_examples=15, deadline=None)
@given(
    shapes=st.lists(
        st.lists(st.integers(1, 4), min_size=0, max_size=3).map(tuple), min_size=2, max_size=5
    ),
    seed=st.integers(0, 10_000),
)
def test_packed_adam_equals_numpy(shapes, seed):
    rng = np.random.default_rng(seed)
    params = {f"w{i}": rng.normal(size=s) for i, s in enumerate(shapes)}
    step = build_update_step(params, optimizers.adam(learning_rate=0.01), None, np.float64)
    assert step.packing.weights == tuple(params)
    assert step.packing.sizes == [int(np.prod(s)) for s in shapes]
    assert step.state == [f"{PACKED}.adam.m", f"{PACKED}.adam.v"]
    session = inference_session(step.model)
    resident = dict(step.initial)
    grads_per_step = []
    for _ in range(3):
        grads = {k: rng.normal(size=v.shape) for k, v in params.items()}
        grads_per_step.append(grads)
        feeds = {**resident, "loss": np.array(0.0), **{f"{k}_grad": g for k, g in grads.items()}}
        out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        resident = {n: out[f"{n}.next"] for n in step.resident}
    p, m, v = adam_numpy(params, grads_per_step, 0.01)
    public = step.public(resident)
    for k in params:
        np.testing.assert_allclose(public[k], p[k], rtol=1e-12)
        np.testing.assert_allclose(public[f"{k}.adam.m"], m[k], rtol=1e-12)
        np.testing.assert_allclose(public[f"{k}.adam.v"], v[k], rtol=1e-12)
    assert step.internal(public).keys() == resident.keys()


def test_packing_is_used_where_it_saves_kernels():
    params = {"W1": np.zeros((3, 4)), "b1": np.zeros(4), "W2": np.zeros((4, 1)), "b2": np.zeros(1)}
    assert build_update_step(params, optimizers.adam(learning_rate=0.01)).packing is not None
    assert (
        build_update_step(params, optimizers.sgd(learning_rate=0.01)).packing is None
    )  # one Mul each
    assert (
        build_update_step(params, optimizers.lamb(learning_rate=0.01)).packing is None
    )  # per-weight norm
    assert build_update_step(params, transforms.freeze(["W1"])).packing is None  # by name
    # weights beyond PACK_UP_TO_BYTES: each pass over the vector leaves the caches
    rows = PACK_UP_TO_BYTES // 4 // 64 + 1
    large = {"W": np.zeros((rows, 64), np.float32), "b": np.zeros(64, np.float32)}
    assert build_update_step(large, optimizers.adam(learning_rate=0.01)).packing is None
    fits = {"W": np.zeros((rows - 2, 64), np.float32), "b": np.zeros(64, np.float32)}
    assert build_update_step(fits, optimizers.adam(learning_rate=0.01)).packing is not None
    packed = build_update_step(params, optimizers.adam(learning_rate=0.01))
    plain = build_update_step(params, optimizers.adam(learning_rate=0.01), pack=False)
    assert len(packed.model.graph.node) < len(plain.model.graph.node) * 0.6


def test_packed_state_round_trips_through_get_state_and_checkpoints(tmp_path):
    rng = np.random.default_rng(4)
    X, y = rng.normal(size=(30, 3)), rng.normal(size=(30, 1))
    make = lambda: OrtGradientOptimizer(  # noqa: E731
        gk.add_loss_output(mlp_onnx(3, 4, 1, dtype=np.float64)),
        max_iter=2,
        learning_rate="adam",
        random_state=0,
    )
    trainer = make().fit(X, y)
    assert trainer.training_step_.packing.weights == ("W1", "b1", "W2", "b2")
    state = trainer.get_state()
    assert {"W1.adam.m", "b2.adam.v"} <= set(state)
    assert state["W1.adam.m"].shape == (3, 4)
    trainer.save_checkpoint(tmp_path / "c.npz")
    other = make().load_checkpoint(tmp_path / "c.npz")
    for key, value in state.items():
        np.testing.assert_array_equal(other.get_state()[key], value)
    with pytest.raises(gk.UnknownNameError, match="W1.adam.m"):
        make().set_state({"graphkit.packed.adam.m": np.zeros(21)})


def test_forward_backward_packs_adam_too():
    rng = np.random.default_rng(5)
    X, y = rng.normal(size=(30, 3)), rng.normal(size=(30, 1))
    trainer = OrtGradientForwardBackwardOptimizer(
        mlp_onnx(3, 4, 1, dtype=np.float64), max_iter=2, learning_rate="adam", random_state=0
    )
    trainer.fit(X, y)
    assert trainer.update_step_.packing.sizes == [12, 4, 4, 1]
    assert trainer.get_state()["W1.adam.v"].shape == (3, 4)


# -- static shapes ---------------------------------------------------------------------


@requires_ort_training  # the kernel is onnxruntime-training's
@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.sampled_from([1, 3]), min_size=0, max_size=4),
    st.lists(st.sampled_from([1, 3]), min_size=0, max_size=4),
)
def test_broadcast_gradient_args_matches_onnxruntime(a, b):
    graph = helper.make_graph(
        [
            helper.make_node(
                "BroadcastGradientArgs", ["a", "b"], ["ra", "rb"], domain="com.microsoft"
            )
        ],
        "bga",
        [helper.make_tensor_value_info(n, TensorProto.INT64, [None]) for n in "ab"],
        [helper.make_tensor_value_info(n, TensorProto.INT64, [None]) for n in ("ra", "rb")],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
        ir_version=10,
    )
    ra, rb = inference_session(model).run(
        None, {"a": np.array(a, np.int64), "b": np.array(b, np.int64)}
    )
    assert broadcast_gradient_args(a, b) == (ra.tolist(), rb.tolist())
    # and the axes are those numpy sums a broadcast gradient over
    out = np.ones(np.broadcast_shapes(tuple(a), tuple(b)))
    assert np.sum(out, axis=tuple(ra.tolist())).size == int(np.prod(a))


def test_specialize_keeps_tiny_constants():
    """onnxscript's rewrite rules take x + 1e-8 for x + 0; folding must not."""
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["X"], ["s"]),
            helper.make_node("ConstantOfShape", ["s"], ["z"]),
            helper.make_node("Add", ["X", "eps"], ["Xe"]),
            helper.make_node("Add", ["Xe", "z"], ["Y"]),
        ],
        "eps",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(np.array(1e-8, np.float32), "eps")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    static = specialize(model, {"X": 3})
    assert not any(n.op_type == "Shape" for n in static.graph.node)
    (out,) = inference_session(static).run(None, {"X": np.zeros((3, 2), np.float32)})
    np.testing.assert_array_equal(out, np.full((3, 2), 1e-8, np.float32))


def test_specialized_step_has_no_shape_plumbing_and_computes_the_same():
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(mlp_onnx(4, 5, 1, dtype=np.float64)), learning_rate="adam"
    )
    trainer._build()
    step = trainer.training_step_
    folds = trainer._backend.constant_folds  # its BroadcastGradientArgs
    static = specialize(step.model, {step.features: 6, step.label: 6}, folds)
    kinds = {n.op_type for n in static.graph.node}
    assert not kinds & {"Shape", "BroadcastGradientArgs", "Expand", "Size"}
    assert len(static.graph.node) < len(step.model.graph.node) / 2
    rng = np.random.default_rng(0)
    feeds = {
        **step.initial,
        step.features: rng.normal(size=(6, 4)),
        step.label: rng.normal(size=(6, 1)),
    }
    a = inference_session(step.model).run(None, feeds)
    b = inference_session(static).run(None, feeds)
    for x, z in zip(a, b):
        np.testing.assert_allclose(x, z, rtol=1e-13, atol=1e-15)


def _reduce_sum_model(shape, axes, keepdims, noop, dtype):
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inputs = ["X"] + (["axes"] if axes is not None else [])
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["X", "ones"], ["Xo"]),
            helper.make_node(
                "ReduceSum",
                ["Xo", *inputs[1:]],
                ["S"],
                keepdims=keepdims,
                noop_with_empty_axes=noop,
            ),
            helper.make_node("Mul", ["S", "two"], ["Y"]),
        ],
        "reduce",
        [helper.make_tensor_value_info("X", elem, ["N", *shape[1:]])],
        [helper.make_tensor_value_info("Y", elem, None)],
        [
            numpy_helper.from_array(np.ones(shape[1:], dtype), "ones"),
            numpy_helper.from_array(np.array(2, dtype), "two"),
        ]
        + ([numpy_helper.from_array(np.array(axes, np.int64), "axes")] if axes is not None else []),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 2, 5]), min_size=1, max_size=4),
    data=st.data(),
    keepdims=st.sampled_from([0, 1]),
    noop=st.sampled_from([0, 1]),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_static_reductions_sum_what_numpy_sums(shape, data, keepdims, noop, dtype):
    """Every ReduceSum rewrite (Reshape, full reduction, MatMul with ones, Identity)
    computes numpy's sum; the product with a constant of ones is gone."""
    rank = len(shape)
    axes = data.draw(
        st.none()
        | st.lists(st.integers(-rank, rank - 1), max_size=rank, unique_by=lambda a: a % rank)
    )
    model = _reduce_sum_model(shape, axes, keepdims, noop, dtype)
    static = specialize(model, {"X": shape[0]})
    assert [n.op_type for n in static.graph.node].count("Mul") == 1
    assert {i.name for i in static.graph.initializer} <= {
        i for n in static.graph.node for i in n.input
    }
    X = np.random.default_rng(0).normal(size=shape).astype(dtype)
    if not axes and noop:  # no axes (absent or empty) with noop_with_empty_axes: identity
        expected = 2 * X
    else:
        summed = None if not axes else tuple(a % rank for a in axes)
        expected = 2 * X.sum(axis=summed, keepdims=bool(keepdims))
    (out,) = inference_session(static).run(None, {"X": X})
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-5 if dtype == np.float32 else 1e-12)


_NUMPY_REDUCTIONS = {
    "ReduceSum": np.sum,
    "ReduceMean": np.mean,
    "ReduceMax": np.max,
    "ReduceL2": lambda x, axis, keepdims: np.sqrt(np.sum(x * x, axis=axis, keepdims=keepdims)),
}


@settings(max_examples=80, deadline=None)
@given(
    shape=st.lists(st.sampled_from([1, 1, 2, 3]), min_size=2, max_size=5),
    op=st.sampled_from(["Transpose", *_NUMPY_REDUCTIONS]),
    data=st.data(),
    keepdims=st.sampled_from([0, 1]),
)
def test_transposes_and_reductions_without_unit_axes_compute_numpy(shape, op, data, keepdims):
    """A Transpose or a reduction run on the tensor without its axes of size 1 (a
    gradient's seed axis) computes numpy's result, the axes given as an input
    (ReduceSum) or an attribute (opset 17); the kernel sees only the axes that are not 1
    (or that a reduction reduces)."""
    from graphkit import static_shapes

    rank = len(shape)
    X = np.random.default_rng(rank).normal(size=shape).astype(np.float32)
    initializers = []
    if op == "Transpose":
        perm = data.draw(st.permutations(range(rank)))
        node = helper.make_node(op, ["X"], ["Y"], perm=perm)
        expected = X.transpose(perm)
        summed = ()
        needed = sum(d != 1 for d in shape)
    else:
        axes = data.draw(
            st.lists(
                st.integers(-rank, rank - 1),
                min_size=1,
                max_size=rank,
                unique_by=lambda a: a % rank,
            )
        )
        inputs = ["X"]
        attributes = {"keepdims": keepdims}
        if op == "ReduceSum":
            initializers.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
            inputs.append("axes")
        else:
            attributes["axes"] = axes
        node = helper.make_node(op, inputs, ["Y"], **attributes)
        summed = tuple(a % rank for a in axes)
        expected = _NUMPY_REDUCTIONS[op](X, axis=summed, keepdims=bool(keepdims))
        needed = sum(d != 1 or a in summed for a, d in enumerate(shape))
    graph = helper.make_graph(
        [node],
        "squeeze",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(expected.shape))],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    static = static_shapes.simplify_reductions(model)
    onnx.checker.check_model(static, full_check=True)
    (out,) = inference_session(static).run(None, {"X": X})
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    shapes = static_shapes.static_shapes(static)
    for kernel in static.graph.node:
        if kernel.op_type != op:
            continue
        if op == "ReduceSum" and all(d == 1 for a, d in enumerate(shape) if a not in summed):
            assert len(kernel.input) == 1  # every axis of size > 1 summed: a full reduction
        else:
            assert len(shapes[kernel.input[0]]) == needed


def test_bias_gradients_are_summed_by_a_matmul():
    """onnxruntime's ReduceSum over the batch axis is slow; the static step uses ones @ G."""
    trainer = OrtGradientOptimizer(gk.add_loss_output(mlp_onnx(4, 5, 1)), learning_rate="SGD")
    trainer._build()
    step = trainer.training_step_
    folds = trainer._backend.constant_folds  # its BroadcastGradientArgs
    static = specialize(step.model, {step.features: 6, step.label: 6}, folds)
    reductions = [n for n in static.graph.node if n.op_type == "ReduceSum" and len(n.input) > 1]
    assert not reductions
    assert any(n.op_type == "MatMul" for n in static.graph.node)


def test_epoch_graph_refuses_a_model_using_its_names():
    from graphkit.training.epoch import loop_over_batches, scan_over_batches

    graph = helper.make_graph(
        [helper.make_node("Identity", ["permutation"], ["permutation.next"])],
        "g",
        [helper.make_tensor_value_info("permutation", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("permutation.next", TensorProto.FLOAT, [1])],
    )
    with pytest.raises(ValueError, match="permutation"):
        loop_over_batches(helper.make_model(graph), [], ["permutation"], "permutation.next")
    with pytest.raises(ValueError, match="permutation"):
        scan_over_batches(helper.make_model(graph), [], ["permutation"], "permutation.next", 2)


@pytest.mark.parametrize("target, dropped", [([3, 5], True), ([5, 3], False), ([15], False)])
def test_a_reshape_to_the_shape_a_tensor_has_is_dropped(target, dropped):
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["X"], ["R"]),
            helper.make_node("Reshape", ["R", "target"], ["S"]),
            helper.make_node("Mul", ["S", "two"], ["Y"]),
        ],
        "reshape",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 5])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.array(target, np.int64), "target"),
            numpy_helper.from_array(np.array(2, np.float32), "two"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    static = specialize(model, {"X": 3})
    assert ("Reshape" not in [n.op_type for n in static.graph.node]) == dropped
    X = np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32)
    (out,) = inference_session(static).run(None, {"X": X})
    np.testing.assert_array_equal(out, 2 * np.maximum(X, 0).reshape(target))


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("constant_first", [True, False])
@pytest.mark.parametrize("constant_shape", [(), (1,), (1, 1)])
@pytest.mark.parametrize("shape", [(7, 1), (7,), (2, 3, 1)])
def test_one_element_constants_take_the_rank_of_the_other_operand(
    op, constant_first, constant_shape, shape
):
    """onnxruntime broadcasts a lower-rank scalar over an (n, 1) tensor one element at a
    time; a specialized graph gives the constant the other operand's rank. The values
    and the result's shape are numpy's broadcasting of the original operands."""
    c = np.full(constant_shape, 3.0, np.float32)
    inputs = ["c", "R"] if constant_first else ["R", "c"]
    graph = helper.make_graph(
        [helper.make_node("Relu", ["X"], ["R"]), helper.make_node(op, inputs, ["Y"])],
        "scalar",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", *shape[1:]])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(c, "c")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    static = specialize(model, {"X": shape[0]})
    node = next(n for n in static.graph.node if n.op_type == op)
    constants = {t.name: numpy_helper.to_array(t) for t in static.graph.initializer}
    constant = next(i for i in node.input if i in constants)
    assert constants[constant].shape == (1,) * max(len(shape), len(constant_shape))
    X = np.random.default_rng(0).normal(size=shape).astype(np.float32)
    (out,) = inference_session(static).run(None, {"X": X})
    numpy_op = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.divide}[op]
    R = np.maximum(X, 0)
    expected = numpy_op(c, R) if constant_first else numpy_op(R, c)
    assert out.shape == expected.shape
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("rows, reshaped", [(100, True), (7, False)])
def test_a_computed_scalar_takes_the_rank_of_a_large_operand(rows, reshaped):
    """R / sum(R): the sum (rank 0) is reshaped to (1, 1) from RESHAPE_SCALARS_FROM
    elements of R (below, the Reshape would cost more than the slow broadcast saves)."""
    graph = helper.make_graph(
        [
            helper.make_node("Relu", ["X"], ["R"]),
            helper.make_node("ReduceSum", ["R"], ["S"], keepdims=0),
            helper.make_node("Div", ["R", "S"], ["Y"]),
        ],
        "normalize",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 1])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    static = specialize(model, {"X": rows})
    assert ("Reshape" in [n.op_type for n in static.graph.node]) == reshaped
    X = np.random.default_rng(0).uniform(0.1, 1, size=(rows, 1)).astype(np.float32)
    (out,) = inference_session(static).run(None, {"X": X})
    assert out.shape == (rows, 1)
    np.testing.assert_allclose(out, X / X.astype(np.float64).sum(), rtol=1e-6)


class CountingSession:
    """An InferenceSession that counts its runs."""

    def __init__(self, session):
        self.session, self.runs = session, 0

    def run_with_iobinding(self, *args):
        self.runs += 1
        return self.session.run_with_iobinding(*args)

    def __getattr__(self, name):
        return getattr(self.session, name)


def spins(session) -> bool:
    """onnxruntime's default (no entry) spins."""
    options = session.get_session_options()
    try:
        return options.get_session_config_entry("session.intra_op.allow_spinning") != "0"
    except RuntimeError:  # no such entry
        return True


def test_one_run_per_batch_uses_the_specialized_step_and_a_short_batch_does_not_spin():
    """steps_per_run=1: the 3 full batches of 8 rows run the step specialized to 8 rows,
    the last 2 rows the step for any size, whose idle threads do not spin into the next
    epoch's runs (a session that runs once per epoch)."""
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(26, 10)).astype(np.float32), rng.normal(size=(26, 1))
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(mlp_onnx(10, 4, 1)), batch_size=8, max_iter=1, steps_per_run=1
    )
    trainer.fit(X, y.astype(np.float32))
    (runner,) = trainer._fused_runners.values()
    specialized = runner.session = CountingSession(runner.session)
    any_size = trainer._resident_session = CountingSession(trainer._resident_session)
    trainer.set_params(warm_start=True).fit(X, y.astype(np.float32))
    assert (specialized.runs, any_size.runs) == (3, 1)
    assert spins(specialized.session) and not spins(any_size.session)


@requires_ort_training
def test_forward_backward_short_batch_session_does_not_spin():
    """The fused agent step's session for the short last batch (ort_training)."""
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(26, 10)).astype(np.float32), rng.normal(size=(26, 1))
    trainer = OrtGradientForwardBackwardOptimizer(
        mlp_onnx(10, 4, 1), batch_size=8, max_iter=1, backend="ort_training"
    )
    trainer.fit(X, y.astype(np.float32))
    runs = trainer._agent_runs
    assert set(runs) == {(False, 8), (False, 2)}
    assert spins(runs[(False, 8)].session) and not spins(runs[(False, 2)].session)


@requires_ort_training
def test_embedding_gradient_runs_lowered_and_trains_like_torch():
    """onnxruntime-training's GatherGrad CPU kernel is 13x its lowering on an embedding
    table's gradient (17x on a transformer's pick of q, k or v): the step runs the
    lowering, and an embedding model trains as torch's SGD does."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    table = torch.nn.Embedding(50, 32)
    head = torch.nn.Linear(32, 3)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=(64, 4))
    y = rng.integers(0, 3, size=64)
    initial = {
        "table": table.weight.detach().numpy().copy(),
        "W": head.weight.detach().numpy().T.copy(),
        "b": head.bias.detach().numpy().copy(),
        "axes": np.array([1], np.int64),
    }
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("Gather", ["table", "ids"], ["rows"]),
            onnx.helper.make_node("ReduceMean", ["rows", "axes"], ["mean"], keepdims=0),
            onnx.helper.make_node("Gemm", ["mean", "W", "b"], ["Y"]),
        ],
        "embedding_bag",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["N", 4])],
        [onnx.helper.make_tensor_value_info("Y", onnx.TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(v, k) for k, v in initial.items()],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)])
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(model, "cross_entropy"),
        max_iter=2,
        batch_size=32,  # the table's gradient: 32 x 4 x 32 = 4096 elements, SLOW_FROM
        learning_rate=0.1,
        shuffle=False,
        backend="ort_training",
    ).fit(ids, y)
    step = trainer.training_step_.model
    assert "GatherGrad" in {n.op_type for n in step.graph.node}
    lowered = lower_slow_cpu_ops(trainer._runner(32).scan_model)
    assert "GatherGrad" not in {n.op_type for g in all_graphs(lowered.graph) for n in g.node}
    sgd = torch.optim.SGD([*table.parameters(), *head.parameters()], lr=0.1)
    for _ in range(2):
        for start in range(0, 64, 32):
            sgd.zero_grad()
            logits = head(table(torch.from_numpy(ids[start : start + 32])).mean(dim=1))
            torch.nn.functional.cross_entropy(
                logits, torch.from_numpy(y[start : start + 32])
            ).backward()
            sgd.step()
    state = trainer.get_state()
    np.testing.assert_allclose(state["table"], table.weight.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(state["W"], head.weight.detach().numpy().T, atol=1e-6)


@pytest.mark.parametrize(
    "rows, columns, fused, dtype",
    [(8, 6, True, np.float32), (8, 1, True, np.float32), (600, 1, False, np.float32)]
    + [(8, 6, None, np.float64)],
)
def test_a_weights_gradient_and_sgd_update_become_one_gemm(rows, columns, fused, dtype):
    """W + lr * (x^T dy): one Gemm (alpha = lr, C = W) once specialized, but for a
    one-column product of a large operand, whose fast Gemm path wants alpha 1 and no C
    (there the product alone becomes a Gemm, and the Mul and Add stay), and for a
    float64 rate that Gemm's float32 alpha cannot hold (nothing changes); numpy's
    values."""
    f32 = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0]),
        helper.make_node("MatMul", ["xt", "dy"], ["grad"]),
        helper.make_node("Mul", ["grad", "lr"], ["step"]),
        helper.make_node("Add", ["W", "step"], ["W.next"]),
    ]
    graph = helper.make_graph(
        nodes,
        "update",
        [
            helper.make_tensor_value_info("x", f32, ["N", 4]),
            helper.make_tensor_value_info("dy", f32, ["N", columns]),
            helper.make_tensor_value_info("W", f32, [4, columns]),
        ],
        [helper.make_tensor_value_info("W.next", f32, [4, columns])],
        [numpy_helper.from_array(np.array(-0.05, dtype), "lr")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    x_rows = 1200 if not fused else rows  # > GEMV_FUSED_UP_TO elements of x
    static = specialize(model, {"x": x_rows, "dy": x_rows})
    onnx.checker.check_model(static, full_check=True)
    kinds = [n.op_type for n in static.graph.node]
    if fused is None:
        assert kinds == ["Transpose", "MatMul", "Mul", "Add"], kinds
    else:
        assert kinds == (["Gemm"] if fused else ["Gemm", "Mul", "Add"]), kinds
        gemm = static.graph.node[0]
        assert {a.name: a.i for a in gemm.attribute if a.name == "transA"} == {"transA": 1}
    rng = np.random.default_rng(rows)
    feeds = {
        "x": rng.normal(size=(x_rows, 4)).astype(dtype),
        "dy": rng.normal(size=(x_rows, columns)).astype(dtype),
        "W": rng.normal(size=(4, columns)).astype(dtype),
    }
    (out,) = inference_session(static).run(None, feeds)
    expected = feeds["W"].astype(np.float64) - 0.05 * (
        feeds["x"].T.astype(np.float64) @ feeds["dy"].astype(np.float64)
    )
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@settings(max_examples=12, deadline=None)
@given(
    batch=st.integers(1, 5),
    rows=st.integers(1, 6),
    sizes=st.tuples(st.integers(1, 5), st.integers(1, 5)),
    torch_layout=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_a_batched_weights_gradient_becomes_one_product_of_the_batch(
    batch, rows, sizes, torch_layout, dtype
):
    """sum_b x_b^T dy_b (a weight multiplying a [B, S, in] input, as onnx-ad writes its
    gradient: a batched MatMul summed over the batch) becomes one product of the batch
    laid end to end, X^T DY; its transpose (a weight stored [out, in], torch's Linear)
    one Gemm of the operands the other way round, no Transpose of the result; the SGD
    update then folds into that Gemm. numpy's values, in float64."""
    n_in, n_out = sizes
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["xt", "dy"], ["per_sample"]),
        helper.make_node("ReduceSum", ["per_sample", "batch_axis"], ["grad"], keepdims=0),
    ]
    weight = [n_out, n_in] if torch_layout else [n_in, n_out]
    if torch_layout:
        nodes.append(helper.make_node("Transpose", ["grad"], ["grad_w"], perm=[1, 0]))
    nodes += [
        helper.make_node("Mul", ["grad_w" if torch_layout else "grad", "lr"], ["step"]),
        helper.make_node("Add", ["W", "step"], ["W.next"]),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("x", elem, ["N", rows, n_in]),
            helper.make_tensor_value_info("dy", elem, ["N", rows, n_out]),
            helper.make_tensor_value_info("W", elem, weight),
        ],
        [helper.make_tensor_value_info("W.next", elem, weight)],
        [
            numpy_helper.from_array(np.array([0], np.int64), "batch_axis"),
            numpy_helper.from_array(np.array(-0.125, dtype), "lr"),  # exact in float32
        ],
    )
    static = specialize(model, {"x": batch, "dy": batch})
    onnx.checker.check_model(static, full_check=True)
    kinds = [n.op_type for n in static.graph.node]
    if min(batch, rows, *sizes) > 1:  # axes of size 1 take other rewrites first
        assert sorted(kinds) == ["Gemm", "Reshape", "Reshape"], kinds
    rng = np.random.default_rng(batch * 100 + rows)
    feeds = {
        "x": rng.normal(size=(batch, rows, n_in)).astype(dtype),
        "dy": rng.normal(size=(batch, rows, n_out)).astype(dtype),
        "W": rng.normal(size=weight).astype(dtype),
    }
    (out,) = inference_session(static).run(None, feeds)
    grad = np.einsum("bsi,bso->io", feeds["x"].astype(np.float64), feeds["dy"].astype(np.float64))
    expected = feeds["W"].astype(np.float64) - 0.125 * (grad.T if torch_layout else grad)
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, expected, rtol=tolerance, atol=tolerance)


def test_a_batched_product_read_elsewhere_is_not_summed_again():
    """The per-sample products are also an output: they are computed anyway, and the
    sum over the batch stays a sum of them (one product, not two); numpy's values."""
    f = TensorProto.FLOAT
    model = _model(
        [
            helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
            helper.make_node("MatMul", ["xt", "dy"], ["per_sample"]),
            helper.make_node("ReduceSum", ["per_sample", "batch_axis"], ["grad"], keepdims=0),
        ],
        [
            helper.make_tensor_value_info("x", f, ["N", 3, 4]),
            helper.make_tensor_value_info("dy", f, ["N", 3, 2]),
        ],
        [
            helper.make_tensor_value_info("grad", f, [4, 2]),
            helper.make_tensor_value_info("per_sample", f, ["N", 4, 2]),
        ],
        [numpy_helper.from_array(np.array([0], np.int64), "batch_axis")],
    )
    static = specialize(model, {"x": 5, "dy": 5})
    kinds = [n.op_type for n in static.graph.node]
    assert kinds.count("MatMul") == 1 and kinds.count("Transpose") == 1, kinds
    rng = np.random.default_rng(0)
    x, dy = rng.normal(size=(5, 3, 4)).astype(np.float32), rng.normal(size=(5, 3, 2))
    grad, per_sample = inference_session(static).run(None, {"x": x, "dy": dy.astype(np.float32)})
    np.testing.assert_allclose(per_sample, np.einsum("bsi,bso->bio", x, dy), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, np.einsum("bsi,bso->io", x, dy), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("transposed", ["a", "b", "both", "neither"])
def test_the_transpose_of_a_product_is_the_product_of_the_transposes(transposed):
    """Transpose(A @ B) = B^T A^T, each operand's own Transpose cancelled: attention's
    keys' gradient (batched, [2, 3, 5, 4]) has one Transpose fewer, or two where both
    operands were transposed; a pair with neither is left alone (two Transposes for
    one). numpy's values."""
    f = TensorProto.FLOAT
    swap = [0, 1, 3, 2]
    a_shape = [2, 3, 5, 6] if transposed in ("a", "both") else [2, 3, 6, 5]
    b_shape = [2, 3, 4, 5] if transposed in ("b", "both") else [2, 3, 5, 4]
    nodes = [
        helper.make_node("Transpose", ["a_in"], ["a"], perm=swap)
        if transposed in ("a", "both")
        else helper.make_node("Identity", ["a_in"], ["a"]),
        helper.make_node("Transpose", ["b_in"], ["b"], perm=swap)
        if transposed in ("b", "both")
        else helper.make_node("Identity", ["b_in"], ["b"]),
        helper.make_node("MatMul", ["a", "b"], ["ab"]),
        helper.make_node("Transpose", ["ab"], ["y"], perm=swap),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("a_in", f, a_shape),
            helper.make_tensor_value_info("b_in", f, b_shape),
        ],
        [helper.make_tensor_value_info("y", f, [2, 3, 4, 6])],
    )
    static = specialize(model, {})
    onnx.checker.check_model(static, full_check=True)
    transposes = [n.op_type for n in static.graph.node].count("Transpose")
    expected_count = {"a": 1, "b": 1, "both": 0, "neither": 1}[transposed]
    assert transposes == expected_count, [n.op_type for n in static.graph.node]
    rng = np.random.default_rng(1)
    feeds = {
        "a_in": rng.normal(size=a_shape).astype(np.float32),
        "b_in": rng.normal(size=b_shape).astype(np.float32),
    }
    (y,) = inference_session(static).run(None, feeds)
    a = np.swapaxes(feeds["a_in"], -1, -2) if transposed in ("a", "both") else feeds["a_in"]
    b = np.swapaxes(feeds["b_in"], -1, -2) if transposed in ("b", "both") else feeds["b_in"]
    np.testing.assert_allclose(y, np.swapaxes(a @ b, -1, -2), rtol=1e-5, atol=1e-5)


def test_the_transpose_of_a_matrix_product_is_one_gemm():
    """Transpose(A @ B) of matrices neither transposed: one Gemm with both ``trans``
    attributes, no Transpose; numpy's values."""
    f = TensorProto.FLOAT
    model = _model(
        [
            helper.make_node("MatMul", ["a", "b"], ["ab"]),
            helper.make_node("Transpose", ["ab"], ["y"], perm=[1, 0]),
        ],
        [
            helper.make_tensor_value_info("a", f, [3, 5]),
            helper.make_tensor_value_info("b", f, [5, 4]),
        ],
        [helper.make_tensor_value_info("y", f, [4, 3])],
    )
    static = specialize(model, {})
    (gemm,) = static.graph.node
    assert gemm.op_type == "Gemm"
    assert {a.name: a.i for a in gemm.attribute} == {"transA": 1, "transB": 1}
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(5, 4)).astype(np.float32)
    (y,) = inference_session(static).run(None, {"a": a, "b": b})
    np.testing.assert_allclose(y, (a @ b).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "shape, transposed, gemm",
    [((300, 64, 300), "a", True), ((300, 64, 300), "b", True), ((256, 64, 256), "a", False)],
)
def test_a_large_product_of_a_transposed_matrix_is_a_gemm(shape, transposed, gemm):
    """MatMul(Transpose(A), B) (or of B transposed) of more than GEMM_ABOVE elements:
    one Gemm with the ``trans`` attribute (faster than onnxruntime's FusedMatMul there);
    at GEMM_ABOVE elements the MatMul stays. numpy's values."""
    m, k, n = shape
    assert (m * n > GEMM_ABOVE) == gemm
    f = TensorProto.FLOAT
    a_shape, b_shape = ([k, m], [k, n]) if transposed == "a" else ([m, k], [n, k])
    operands = ["at", "b"] if transposed == "a" else ["a", "bt"]
    model = _model(
        [
            helper.make_node("Transpose", [transposed], [f"{transposed}t"], perm=[1, 0]),
            helper.make_node("MatMul", operands, ["y"]),
        ],
        [
            helper.make_tensor_value_info("a", f, a_shape),
            helper.make_tensor_value_info("b", f, b_shape),
        ],
        [helper.make_tensor_value_info("y", f, [m, n])],
    )
    static = specialize(model, {})
    onnx.checker.check_model(static, full_check=True)
    kinds = [node.op_type for node in static.graph.node]
    if gemm:
        (node,) = static.graph.node
        assert node.op_type == "Gemm"
        flags = {a.name: a.i for a in node.attribute}
        assert flags == {"transA": int(transposed == "a"), "transB": int(transposed == "b")}
    else:
        assert kinds == ["Transpose", "MatMul"], kinds
    rng = np.random.default_rng(3)
    a, b = rng.normal(size=a_shape).astype(np.float32), rng.normal(size=b_shape).astype(np.float32)
    (y,) = inference_session(static).run(None, {"a": a, "b": b})
    expected = (a.T @ b) if transposed == "a" else (a @ b.T)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("through_reshape", [False, True])
def test_a_full_sum_of_squares_is_one_reduce_sum_square(through_reshape):
    """The squared error's full sum of d * d (through the per-sample Reshape
    onnxruntime-training's graph has) is one ReduceSumSquare; the Mul that another node
    reads stays. numpy's values."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["d", "d"], ["squares"])]
    summed = "squares"
    if through_reshape:
        nodes.append(helper.make_node("Reshape", ["squares", "flat"], ["per_sample"]))
        summed = "per_sample"
    nodes.append(helper.make_node("ReduceSum", [summed], ["loss"], keepdims=0))
    model = _model(
        nodes,
        [helper.make_tensor_value_info("d", f, ["N", 3])],
        [helper.make_tensor_value_info("loss", f, [])],
        [numpy_helper.from_array(np.array([-1], np.int64), "flat")],
    )
    static = specialize(model, {"d": 4})
    onnx.checker.check_model(static, full_check=True)
    assert [n.op_type for n in static.graph.node] == ["ReduceSumSquare"]
    d = np.random.default_rng(3).normal(size=(4, 3)).astype(np.float32)
    (loss,) = inference_session(static).run(None, {"d": d})
    np.testing.assert_allclose(loss, (d.astype(np.float64) ** 2).sum(), rtol=1e-6)


@pytest.mark.parametrize("case", ["folds", "constant broadcasts", "product read elsewhere"])
def test_a_doubled_scaled_gradient_is_one_mul(case):
    """Sum(x, x) with x = c * a (a squared error's gradient, d dy + d dy): a * 2c, one
    kernel; not where c would broadcast a to a larger shape, nor where another node reads
    x (an output here). numpy's values."""
    f = TensorProto.FLOAT
    c = np.full((1, 3) if case == "constant broadcasts" else (4, 3), 0.1, np.float32)
    a_shape = [4, 1] if case == "constant broadcasts" else [4, 3]
    outputs = [helper.make_tensor_value_info("y", f, [4, 3])]
    if case == "product read elsewhere":
        outputs.append(helper.make_tensor_value_info("x", f, [4, 3]))
    model = _model(
        [
            helper.make_node("Mul", ["c", "a"], ["x"]),
            helper.make_node("Sum", ["x", "x"], ["y"]),
        ],
        [helper.make_tensor_value_info("a", f, a_shape)],
        outputs,
        [numpy_helper.from_array(c, "c")],
    )
    static = specialize(model, {})
    onnx.checker.check_model(static, full_check=True)
    kinds = [n.op_type for n in static.graph.node]
    assert kinds == (["Mul"] if case == "folds" else ["Mul", "Sum"]), kinds
    a = np.random.default_rng(4).normal(size=a_shape).astype(np.float32)
    results = inference_session(static).run(None, {"a": a})
    np.testing.assert_array_equal(results[0], (c * a) + (c * a))  # doubling is exact


@pytest.mark.parametrize(
    "rows, relu, expected",
    [(10, True, ["Relu", "Sign", "Mul"]), (40, True, ["Relu", "Greater", "Cast", "Mul"])]
    + [(10, False, ["Abs", "Greater", "Cast", "Mul"])],
)
def test_a_small_relu_gradient_mask_is_one_sign(rows, relu, expected):
    """dy * Cast(y > 0) with y = Relu(x) (native's ReLU gradient) of at most
    SIGN_MASK_UP_TO elements: dy * Sign(y), a kernel fewer; a larger one, or a y no
    Relu made (here Abs), keeps its Greater and Cast. numpy's values, exactly."""
    f = TensorProto.FLOAT
    model = _model(
        [
            helper.make_node("Relu" if relu else "Abs", ["x"], ["y"]),
            helper.make_node("Greater", ["y", "zero"], ["positive"]),
            helper.make_node("Cast", ["positive"], ["mask"], to=f),
            helper.make_node("Mul", ["dy", "mask"], ["dx"]),
        ],
        [
            helper.make_tensor_value_info("x", f, [rows, 10]),
            helper.make_tensor_value_info("dy", f, [rows, 10]),
        ],
        [helper.make_tensor_value_info("dx", f, [rows, 10])],
        [numpy_helper.from_array(np.array(0, np.float32), "zero")],
    )
    static = specialize(model, {})
    onnx.checker.check_model(static, full_check=True)
    assert [n.op_type for n in static.graph.node] == expected
    rng = np.random.default_rng(rows)
    x = rng.normal(size=(rows, 10)).astype(np.float32)
    x[0, :3] = 0.0  # Relu'(0) = 0
    dy = rng.normal(size=(rows, 10)).astype(np.float32)
    (dx,) = inference_session(static).run(None, {"x": x, "dy": dy})
    y = np.maximum(x, 0) if relu else np.abs(x)
    np.testing.assert_array_equal(dx, dy * (y > 0))


@pytest.mark.parametrize("ones", ["column", "vector on the left", "not ones"])
@pytest.mark.parametrize("negated", [False, True])
def test_a_full_sum_of_per_sample_sums_is_one_full_sum(ones, negated):
    """The full sum of per-sample sums (a MatMul by ones, a Reshape, a Neg: a
    classification loss's) is the full sum of what they sum, negated as often: two
    kernels fewer. A MatMul by another constant stays. numpy's values."""
    f = TensorProto.FLOAT
    if ones == "vector on the left":
        product = helper.make_node("MatMul", ["ones", "m"], ["sums"])
        constant = np.ones(4, np.float32)
    else:
        product = helper.make_node("MatMul", ["m", "ones"], ["sums"])
        constant = np.ones((3, 1), np.float32) * (1 if ones == "column" else 2)
    nodes = [product, helper.make_node("Reshape", ["sums", "flat"], ["flat_sums"])]
    summed = "flat_sums"
    if negated:
        nodes.append(helper.make_node("Neg", ["flat_sums"], ["negated"]))
        summed = "negated"
    nodes.append(helper.make_node("ReduceSum", [summed], ["total"], keepdims=0))
    model = _model(
        nodes,
        [helper.make_tensor_value_info("m", f, [4, 3])],
        [helper.make_tensor_value_info("total", f, [])],
        [
            numpy_helper.from_array(constant, "ones"),
            numpy_helper.from_array(np.array([-1], np.int64), "flat"),
        ],
    )
    static = specialize(model, {})
    onnx.checker.check_model(static, full_check=True)
    kinds = [n.op_type for n in static.graph.node]
    if ones == "not ones":
        assert "MatMul" in kinds, kinds
    else:
        assert kinds == (["ReduceSum", "Neg"] if negated else ["ReduceSum"]), kinds
    m = np.random.default_rng(6).normal(size=(4, 3)).astype(np.float32)
    (total,) = inference_session(static).run(None, {"m": m})
    expected = m.astype(np.float64).sum() * (1 if ones != "not ones" else 2)
    np.testing.assert_allclose(total, -expected if negated else expected, rtol=1e-5, atol=1e-6)
