"""Where a batch's time goes in graphkit's whole-epoch run, on small batches.

    python benchmarks/profile_epoch.py [--output benchmarks/PROFILE.md]

onnxruntime's own profiler costs more than the kernels it times at this size (about 180
us a batch profiled against 8.5 unprofiled on the MLP 10-10-1), so this script measures
with a model instead:

1. onnxruntime's fixed costs, from synthetic Scans of 1,000 iterations whose body is a
   chain of k element-wise kernels on a [10, 10] tensor: the time per iteration is
   ``scan + k * kernel``, fitted by least squares over k = 1, 2, 4, 8, 16, 32 (``scan``:
   the Scan's own work per iteration, copying the carried values included; ``kernel``:
   one kernel launch on a tiny tensor).
2. graphkit's step for the MLP 10-10-1 at batch 10 (benchmarks/run.py's workload), SGD
   and Adam, each backend: the kernels in the Scan body after onnxruntime's graph
   optimizations (the model onnxruntime writes with ``optimized_model_filepath``), and
   the measured time per batch of ``fit`` (one run per epoch).
3. The floor the model predicts for that many kernels, ``scan + kernels * kernel``,
   beside the measured time: what fewer kernels could gain, and what no rewrite of the
   step can (the Scan's per-iteration cost).
4. Forward/backward training (a batch at a time, from Python) against full training on
   run.py's workloads whose batches take tens of microseconds, the trainer's calls for
   one batch alone, and the fixed cost of one session call from Python.
5. AdamW's update on a large model (the MLP 784-512-512-10 of ``peers.py``): graphkit's
   AdamW step against its SGD step, and the fewest standard kernels AdamW needs (13
   passes over all the weights, laid end to end), timed alone in a Scan.
6. Where a large step's time goes: peers.py's workloads of a millisecond and more under
   onnxruntime's profiler, by group of kernels.
7. The MLP 100-256-256-1 of ``peers.py``, SGD and AdamW: graphkit's step against the
   fewest standard kernels it needs, written by hand (:func:`hand_written_mlp`, which
   also writes item 3's hand-written floors), and the standard forms of a ReLU
   gradient's mask.
8. The 28x28 CNN of ``peers.py``: its max poolings' forward and gradient in the forms
   onnxruntime offers (MaxPool with and without its indices, the scatter and the
   ``MaxUnpool`` that send the gradient back, a nearest upsampling, and an exact
   gradient that does without the indices).

Run it alone (2 cores): it times microseconds.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import math
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "contenders"))  # peers.py's workloads

ITERATIONS = 1000


def best_of(run, repeat: int = 7) -> float:
    """The fastest of ``repeat`` calls, in seconds (after one untimed call)."""
    # trainers measured before and dropped may sit in reference cycles, their sessions'
    # threads spinning after each run and taking the cores: collect them first
    gc.collect()
    run()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def synthetic_scan(kernels: int) -> onnx.ModelProto:
    """A Scan over ITERATIONS rows carrying a [10, 10] tensor through ``kernels`` Adds of
    each row (the carried value changes every iteration, as a weight does)."""
    nodes, last = [], "carried_in"
    for k in range(kernels):
        out = "carried_out" if k == kernels - 1 else f"t{k}"
        nodes.append(helper.make_node("Add", [last, "row"], [out]))
        last = out
    body = helper.make_graph(
        nodes,
        "body",
        [
            helper.make_tensor_value_info("carried_in", TensorProto.FLOAT, [10, 10]),
            helper.make_tensor_value_info("row", TensorProto.FLOAT, [10, 10]),
        ],
        [helper.make_tensor_value_info("carried_out", TensorProto.FLOAT, [10, 10])],
    )
    scan = helper.make_node("Scan", ["init", "rows"], ["final"], body=body, num_scan_inputs=1)
    graph = helper.make_graph(
        [scan],
        "scan",
        [
            helper.make_tensor_value_info("init", TensorProto.FLOAT, [10, 10]),
            helper.make_tensor_value_info("rows", TensorProto.FLOAT, [ITERATIONS, 10, 10]),
        ],
        [helper.make_tensor_value_info("final", TensorProto.FLOAT, [10, 10])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def fixed_costs() -> tuple[float, float, list[tuple[int, float]]]:
    """(scan, kernel) in microseconds, and the measured points."""
    rows = np.random.default_rng(0).normal(size=(ITERATIONS, 10, 10)).astype(np.float32) * 1e-3
    feeds = {"init": np.zeros((10, 10), np.float32), "rows": rows}
    sessions = {
        kernels: ort.InferenceSession(
            synthetic_scan(kernels).SerializeToString(), providers=["CPUExecutionProvider"]
        )
        for kernels in (1, 2, 4, 8, 16, 32)
    }
    best = dict.fromkeys(sessions, float("inf"))
    for _ in range(7):  # in turns: a slow moment of the machine falls on every point alike
        for kernels, session in sessions.items():
            best[kernels] = min(best[kernels], best_of(lambda s=session: s.run(None, feeds), 1))
    points = [(kernels, seconds * 1e6 / ITERATIONS) for kernels, seconds in best.items()]
    k = np.array([p[0] for p in points], float)
    t = np.array([p[1] for p in points])
    kernel, scan = np.polyfit(k, t, 1)
    return float(scan), float(kernel), points


def optimized_body_kernels(model: onnx.ModelProto) -> collections.Counter:
    """The kernels of the Scan body once onnxruntime has optimized the model."""
    with tempfile.TemporaryDirectory() as tmp:
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        options.log_severity_level = 3
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath)
    scans = [n for n in optimized.graph.node if n.op_type == "Scan"]
    body = next(a.g for a in scans[0].attribute if a.name == "body")
    return collections.Counter(n.op_type for n in body.node)


ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8


SMALL_MLP = "MLP 10-10-1, batch 10"
"""run.py's workload whose steps the small-batch floors are written for."""


@functools.cache
def peer_workloads() -> tuple:
    """peers.py's workloads, built once (2.5 s: their data, their graphs exported)."""
    import peers

    return tuple(peers.workloads(quick=False))


def peer_workload(name: str):
    """The one of :func:`peer_workloads` whose name starts with ``name``."""
    return next(w for w in peer_workloads() if w.name.startswith(name))


def workload_spec(name: str, optimizer: str, folder: Path):
    """peers.py's workload whose name starts with ``name`` (run.py's, for the small
    ones: the same data and weights) as a contender reads it, written to ``folder``."""
    import spec as specs

    workload = peer_workload(name)
    if not (folder / "w").exists():
        workload.write(folder / "w")
    return specs.load(folder / "w", optimizer)


def hand_written_row(
    scan: float, kernel: float, optimizer: str
) -> tuple[str, dict[str, np.ndarray]]:
    """The hand-written step of :data:`SMALL_MLP` (:func:`hand_written_mlp`): its table
    row, and its weights after one epoch (checked against graphkit's own epoch by the
    caller)."""
    with tempfile.TemporaryDirectory() as tmp:
        spec = workload_spec(SMALL_MLP, optimizer, Path(tmp))
    batches = len(spec.X) // spec.batch_size
    model = hand_written_mlp(spec, batches, optimizer)
    feeds = _hand_written_mlp_feeds(spec, batches)
    # the best of three sessions: one session in two ran 1.6x slower throughout, here
    seconds = float("inf")
    for _ in range(3):
        session = ort.InferenceSession(
            model.SerializeToString(), providers=["CPUExecutionProvider"]
        )
        seconds = min(seconds, best_of(lambda s=session: s.run(None, feeds)))
    after = _hand_written_weights(spec, session, feeds)
    kernels = optimized_body_kernels(model)
    total = sum(kernels.values())
    measured = seconds * 1e6 / batches
    listed = ", ".join(f"{op} {n}" for op, n in kernels.most_common())
    row = (
        f"| hand-written (standard ONNX) | {optimizer} | {measured:.2f} | {total} | "
        f"{scan + total * kernel:.2f} | {measured - scan - total * kernel:.2f} | {listed} |"
    )
    return row, after


def graphkit_rows(scan: float, kernel: float) -> list[str]:
    import run as bench

    import graphkit as gk
    from graphkit import backends
    from graphkit_train import OrtGradientOptimizer

    workload = next(w for w in bench.workloads(False) if w.name == "MLP 10-10-1, batch 10")
    batches = len(workload.X) // workload.batch_size
    rows = []
    for backend in [b.name for b in backends.available() if b.installed]:
        for optimizer in ("sgd", "adamw"):
            trainer = OrtGradientOptimizer(
                gk.add_loss_output(workload.model, "squared_error"),
                max_iter=1,
                batch_size=workload.batch_size,
                learning_rate=bench._graphkit_optimizer(optimizer),
                shuffle=False,
                warm_start=True,
                validation_every=0,
                steps_per_run="epoch",
                backend=backend,
            )
            seconds = best_of(lambda t=trainer: t.fit(workload.X, workload.y))
            measured = seconds * 1e6 / batches
            (runner,) = trainer._fused_runners.values()
            kernels = optimized_body_kernels(runner.scan_model)
            total = sum(kernels.values())
            floor = scan + total * kernel
            listed = ", ".join(f"{op} {n}" for op, n in kernels.most_common())
            rows.append(
                f"| {backend} | {optimizer} | {measured:.2f} | {total} | {floor:.2f} | "
                f"{measured - floor:.2f} | {listed} |"
            )
    return rows


def session_call_cost() -> float:
    """Microseconds of one ``run_with_iobinding`` from Python on a one-Identity graph
    over a [10, 10] tensor, its binding made once: what any call per batch costs."""
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "call",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [10, 10])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10, 10])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, ["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(np.zeros((10, 10), "f")))
    binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_numpy(np.zeros((10, 10), "f")))
    run, c_binding = session._sess.run_with_iobinding, binding._iobinding

    def calls() -> None:
        for _ in range(ITERATIONS):
            run(c_binding, None)

    return best_of(calls) * 1e6 / ITERATIONS


FORWARD_BACKWARD_WORKLOADS = (
    "MLP 10-10-1, batch 10",
    "MLP 10-10-1, batch 1000",
    "softmax classifier, digits, batch 32",
    "linear regression 10,000x10, batch 1000",
    "small CNN, digits 8x8",
)
"""run.py's workloads whose batches take tens of microseconds, where a call's own cost
weighs most: forward/backward against full training on each."""


def forward_backward_rows() -> list[str]:
    """Each of :data:`FORWARD_BACKWARD_WORKLOADS` (SGD) trained by each backend's
    forward/backward trainer (one Python-driven batch at a time) and by full training
    (the epoch in one run): the table's rows."""
    import run as bench

    import graphkit as gk
    from graphkit import backends
    from graphkit_train import OrtGradientForwardBackwardOptimizer, OrtGradientOptimizer

    rows = []
    for workload in bench.workloads(False):
        if workload.name not in FORWARD_BACKWARD_WORKLOADS:
            continue
        batches = -(-len(workload.X) // workload.batch_size)
        loss = "squared_error" if workload.loss == "mse" else "cross_entropy"
        common = dict(
            max_iter=1,
            batch_size=workload.batch_size,
            learning_rate=bench._graphkit_optimizer("sgd"),
            shuffle=False,
            warm_start=True,
            validation_every=0,
        )
        for backend in [b.name for b in backends.available() if b.installed]:
            full = OrtGradientOptimizer(
                gk.add_loss_output(workload.model, loss),
                steps_per_run="epoch",
                backend=backend,
                **common,
            )
            split = OrtGradientForwardBackwardOptimizer(
                workload.model, learning_loss=loss, backend=backend, **common
            )
            times = [
                best_of(lambda t=t, w=workload: t.fit(w.X, w.y)) * 1e6 / batches
                for t in (full, split)
            ]
            # the floor of any batch driven from Python: the trainer's own calls for one
            # batch, its arrays and buffers ready, repeated (no slicing, no loop around)
            run = split._agent_runs[(False, workload.batch_size)]  # not the short last one
            X, y = workload.X[: workload.batch_size], workload.y[: workload.batch_size]
            resident, new = split._agent_sets[split._current]

            def calls(run=run, X=X, y=y, resident=resident, new=new, n=batches) -> None:
                for _ in range(n):
                    run([X], y, None, resident, new)

            floor = best_of(calls) * 1e6 / batches
            count = 2 if backend == "ort_training" else 1  # the agent's forward, backward
            rows.append(
                f"| {workload.name} | {backend} | {times[0]:.1f} | {times[1]:.1f} | "
                f"{times[1] / times[0]:.2f} | {count} | {floor:.1f} | {floor / times[0]:.2f} |"
            )
    return rows


def check_hand_written(weights: dict[str, np.ndarray], optimizer: str) -> None:
    """The hand-written epoch computes graphkit's epoch (else its time means nothing)."""
    import run as bench

    import graphkit as gk
    from graphkit_train import OrtGradientOptimizer

    workload = next(w for w in bench.workloads(False) if w.name == "MLP 10-10-1, batch 10")
    full = len(workload.X) // workload.batch_size * workload.batch_size
    trainer = OrtGradientOptimizer(
        gk.add_loss_output(workload.model, "squared_error"),
        max_iter=1,
        batch_size=workload.batch_size,
        learning_rate=bench._graphkit_optimizer(optimizer),
        shuffle=False,
        validation_every=0,
    ).fit(workload.X[:full], workload.y[:full])
    state = trainer.get_state()
    for name in ("W1", "b1", "W2", "b2"):
        scale = float(np.abs(state[name]).max())
        np.testing.assert_allclose(weights[name], state[name], rtol=1e-5, atol=1e-5 * scale)


ADAMW_PASSES = 13
"""The fewest elementwise kernels of AdamW in standard ONNX on weights laid end to end:
m += (g - m)(1 - b1) [3]; v += (g g - v)(1 - b2) [4]; u = m / (sqrt(v) + eps') [3];
p' = p (1 - lr wd) - u s [3], with s = lr sqrt(c2) / c1 and eps' = eps sqrt(c2) scalars."""


def adamw_floor_scan(sizes: Sequence[int], steps: int, passes: bool = True) -> onnx.ModelProto:
    """A Scan of ``steps`` AdamW updates of weights of ``sizes`` (one vector: laid end
    to end; several: one tensor per weight), each in the 13 kernels of
    :data:`ADAMW_PASSES` (``passes=False``: one Add, the cost of a single pass)."""
    f32 = TensorProto.FLOAT

    def value(name: str, shape: list[int]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, f32, shape)

    def node(op: str, inputs: list[str], output: str) -> onnx.NodeProto:
        return helper.make_node(op, inputs, [output])

    nodes, carried = [], []
    for k, size in enumerate(sizes):

        def at(name: str, k: int = k) -> str:
            return f"{name}{k}"

        if passes:
            nodes += [
                node("Sub", [at("g"), at("m")], at("d1")),
                node("Mul", [at("d1"), "one_minus_b1"], at("e1")),
                node("Add", [at("m"), at("e1")], at("m_next")),
                node("Mul", [at("g"), at("g")], at("g2")),
                node("Sub", [at("g2"), at("v")], at("d2")),
                node("Mul", [at("d2"), "one_minus_b2"], at("e2")),
                node("Add", [at("v"), at("e2")], at("v_next")),
                node("Sqrt", [at("v_next")], at("root")),
                node("Add", [at("root"), "eps"], at("denominator")),
                node("Div", [at("m_next"), at("denominator")], at("direction")),
                node("Mul", [at("p"), "decay"], at("decayed")),
                node("Mul", [at("direction"), "lr"], at("step")),
                node("Sub", [at("decayed"), at("step")], at("p_next")),
            ]
        else:
            nodes += [
                node("Add", [at("p"), at("g")], at("p_next")),
                node("Identity", [at("m")], at("m_next")),
                node("Identity", [at("v")], at("v_next")),
            ]
        carried += [(at(n), at(f"{n}_next"), size) for n in ("p", "m", "v")]
    nodes.append(node("Identity", ["tick"], "tock"))
    scalars = dict(one_minus_b1=0.1, one_minus_b2=0.001, eps=1e-8, decay=1 - 1e-5, lr=1e-3)
    body = helper.make_graph(
        nodes,
        "adamw",
        [value(n, [size]) for n, _, size in carried] + [value("tick", [1])],
        [value(nxt, [size]) for _, nxt, size in carried] + [value("tock", [1])],
        [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in scalars.items()],
    )
    scan = helper.make_node(
        "Scan",
        [f"{n}_0" for n, _, _ in carried] + ["ticks"],
        [f"{n}_final" for n, _, _ in carried] + ["tocks"],
        body=body,
        num_scan_inputs=1,
    )
    graph = helper.make_graph(
        [scan],
        "adamw_floor",
        [value(f"{n}_0", [size]) for n, _, size in carried]
        + [value("ticks", [steps, 1])]
        + [value(f"g{k}", [size]) for k, size in enumerate(sizes)],
        [value(f"{n}_final", [size]) for n, _, size in carried] + [value("tocks", [steps, 1])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def adamw_floor(sizes: Sequence[int], steps: int = 100) -> tuple[float, float]:
    """us per step of :func:`adamw_floor_scan` on ``sizes``: one pass, and 13."""
    rng = np.random.default_rng(0)
    feeds = {"ticks": np.zeros((steps, 1), np.float32)}
    for k, size in enumerate(sizes):
        feeds[f"p{k}_0"] = rng.normal(size=size).astype(np.float32)
        feeds[f"m{k}_0"] = np.zeros(size, np.float32)
        feeds[f"v{k}_0"] = np.zeros(size, np.float32)
        feeds[f"g{k}"] = rng.normal(size=size).astype(np.float32)
    per_step = []
    for passes in (False, True):
        session = ort.InferenceSession(
            adamw_floor_scan(sizes, steps, passes).SerializeToString(),
            providers=["CPUExecutionProvider"],
        )
        per_step.append(best_of(lambda s=session: s.run(None, feeds), repeat=5) * 1e6 / steps)
    return per_step[0], per_step[1]


def adamw_rows() -> tuple[list[str], int, dict[str, tuple[float, float]]]:
    """graphkit's AdamW and SGD steps on the MLP 784-512-512-10 (each backend, one run
    per epoch), and the floor: ``(rows, weights, {layout: (us per pass, us per 13-kernel
    update)})``, the weights laid end to end or one tensor each."""
    import graphkit as gk
    from graphkit import backends, optimizers
    from graphkit_train import OrtGradientOptimizer

    workload = peer_workload("MLP 784")
    size = sum(w.size for w in workload.weights.values())
    rows = []
    for backend in [b.name for b in backends.available() if b.installed]:
        trainers = {
            name: OrtGradientOptimizer(
                gk.add_loss_output(workload.model, "cross_entropy"),
                list(workload.weights),
                max_iter=1,
                batch_size=workload.batch_size,
                learning_rate=rate,
                shuffle=False,
                warm_start=True,
                validation_every=0,
                steps_per_run="epoch",
                backend=backend,
            )
            for name, rate in (
                ("sgd", optimizers.sgd(learning_rate=0.01)),
                ("adamw", optimizers.adamw(weight_decay=0.01, learning_rate=0.001)),
            )
        }
        times = dict.fromkeys(trainers, float("inf"))
        for _ in range(4):  # in turns, so that a slow moment of the machine hits both
            for name, trainer in trainers.items():
                time.sleep(0.25)  # the other trainer's threads stop spinning
                seconds = best_of(lambda t=trainer: t.fit(workload.X, workload.y), repeat=1)
                times[name] = min(times[name], seconds * 1e6 / workload.batches)
        rows.append(
            f"| {backend} | {times['sgd']:.0f} | {times['adamw']:.0f} | "
            f"{times['adamw'] - times['sgd']:.0f} |"
        )
        del trainers
    sizes = [w.size for w in workload.weights.values()]
    floors = {
        "MLP 784-512-512-10, laid end to end": adamw_floor([size]),
        "MLP 784-512-512-10, one tensor per weight (as graphkit updates it)": adamw_floor(sizes),
    }
    # the MLP 100-256-256-1's 91,905 weights, which graphkit packs (under 512 KiB)
    large = peer_workload("MLP 100-256")
    total = sum(w.size for w in large.weights.values())
    floors["MLP 100-256-256-1, laid end to end (as graphkit updates it)"] = adamw_floor(
        [total], steps=300
    )
    return rows, size, floors


def pooling_graph(shape: tuple[int, ...], form: str) -> onnx.ModelProto:
    """One 2x2 max pooling of stride 2 of ``x`` (``shape``) and, by ``form``, what its
    gradient needs: ``alone`` (the pooled values only), ``indices`` (with its indices),
    ``scatter`` (the indices, and ``dy`` added into zeros there: onnx-ad's form),
    ``unpool`` (``MaxUnpool`` of ``dy``: graphkit's), ``upsample`` (the pooled values
    without indices, repeated back over each window by a nearest ``Resize``),
    ``index_free`` (the gradient without indices, exact: ``dy`` at each window's first
    maximum, found by pooling a score that weighs each position of a window's maxima
    by its rank)."""
    n, c, h, w = shape
    pool = dict(kernel_shape=[2, 2], strides=[2, 2])
    floats = TensorProto.FLOAT
    inits = []
    if form == "alone":
        nodes = [helper.make_node("MaxPool", ["x"], ["y"], **pool)]
    elif form == "upsample":
        nodes = [
            helper.make_node("MaxPool", ["x"], ["y"], **pool),
            helper.make_node("Resize", ["y", "", "scales"], ["out"], mode="nearest"),
        ]
        inits = [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    else:
        nodes = [helper.make_node("MaxPool", ["x"], ["y", "indices"], **pool)]
    if form == "scatter":
        ints = {"flat": [n * c * h * w, 1], "column": [-1, 1], "shape": list(shape)}
        inits = [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in ints.items()]
        zero = numpy_helper.from_array(np.zeros(1, np.float32))
        nodes += [
            helper.make_node("ConstantOfShape", ["flat"], ["zeros"], value=zero),
            helper.make_node("Reshape", ["indices", "column"], ["where"]),
            helper.make_node("Reshape", ["dy", "column"], ["values"]),
            helper.make_node("ScatterND", ["zeros", "where", "values"], ["sum"], reduction="add"),
            helper.make_node("Reshape", ["sum", "shape"], ["out"]),
        ]
    elif form == "unpool":
        nodes.append(helper.make_node("MaxUnpool", ["dy", "indices"], ["out"], **pool))
    elif form == "index_free":
        rank = np.tile(np.array([[8, 4], [2, 1]], np.float32), (h // 2, w // 2))
        inits = [
            numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
            numpy_helper.from_array(rank, "rank"),
            numpy_helper.from_array(np.array(0, np.float32), "zero"),
        ]
        nearest = dict(mode="nearest")
        nodes = [
            helper.make_node("MaxPool", ["x"], ["y"], **pool),
            helper.make_node("Resize", ["y", "", "scales"], ["y_up"], **nearest),
            helper.make_node("Equal", ["x", "y_up"], ["maxima"]),
            helper.make_node("Where", ["maxima", "rank", "zero"], ["score"]),
            helper.make_node("MaxPool", ["score"], ["first"], **pool),
            helper.make_node("Resize", ["first", "", "scales"], ["first_up"], **nearest),
            helper.make_node("Equal", ["score", "first_up"], ["chosen"]),
            helper.make_node("Resize", ["dy", "", "scales"], ["dy_up"], **nearest),
            helper.make_node("Where", ["chosen", "dy_up", "zero"], ["out"]),
        ]
    outputs = ["y"] + (["out"] if form not in ("alone", "indices") else [])
    graph = helper.make_graph(
        nodes,
        form,
        [
            helper.make_tensor_value_info("x", floats, list(shape)),
            helper.make_tensor_value_info("dy", floats, [n, c, h // 2, w // 2]),
        ],
        [helper.make_tensor_value_info(o, floats, None) for o in outputs],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


POOLING_FORMS = {
    "alone": "MaxPool",
    "indices": "MaxPool with indices",
    "scatter": "+ ScatterND of dy",
    "unpool": "+ MaxUnpool of dy",
    "upsample": "MaxPool + nearest Resize",
    "index_free": "MaxPool + a gradient without indices",
}


def pooling_rows() -> list[str]:
    """The pooling forms of :func:`pooling_graph` at the 28x28 CNN's two poolings, us."""
    workload = peer_workload("CNN 2x")
    rng = np.random.default_rng(0)
    pool_rows = []
    for shape in ((workload.batch_size, 16, 28, 28), (workload.batch_size, 32, 14, 14)):
        x = np.maximum(rng.normal(size=shape), 0).astype(np.float32)  # a ReLU's output
        dy = rng.normal(size=(*shape[:2], shape[2] // 2, shape[3] // 2)).astype(np.float32)
        x[0] = 0.0  # a blank image: every window's maximum is tied
        times, gradients = [], []
        for form in POOLING_FORMS:
            options = ort.SessionOptions()
            options.intra_op_num_threads = 2
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            session = ort.InferenceSession(
                pooling_graph(shape, form).SerializeToString(),
                options,
                providers=["CPUExecutionProvider"],
            )
            feeds = {"x": x, "dy": dy}
            if form in ("scatter", "unpool", "index_free"):
                gradients.append(session.run(["out"], feeds)[0])
            times.append(best_of(lambda s=session, f=feeds: s.run(None, f)) * 1e6)
        for other in gradients[1:]:  # the three gradients are one, ties included
            np.testing.assert_array_equal(other, gradients[0])
        dims = " x ".join(map(str, shape))
        pool_rows.append(f"| {dims} | " + " | ".join(f"{t:.0f}" for t in times) + " |")
    return pool_rows


KERNEL_GROUPS = {
    "products": frozenset(
        {"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "Conv", "FusedConv", "ConvGrad"}
        | {"ConvTranspose", "LSTM", "GRU", "RNN"}
    ),
    "pooling": frozenset({"MaxPool", "MaxUnpool", "AveragePool", "MaxPoolGrad"}),
    "data movement": frozenset(
        {"Transpose", "Concat", "Split", "Slice", "Gather", "ScatterND", "Pad", "Expand"}
        | {"Tile", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten"}
    ),
}
"""How the large steps' kernels are grouped; the rest: elementwise operators,
reductions, normalizations, softmax and their gradients."""

LARGE_WORKLOADS = ("MLP 100-256-256-1", "MLP 784", "CNN 2x", "transformer", "LSTM")
"""peers.py's workloads whose steps take a millisecond or more."""


def large_step_rows() -> list[str]:
    """Each of :data:`LARGE_WORKLOADS` trained by full training (SGD, one run per
    epoch) on each backend under onnxruntime's profiler: the kernels' time per batch by
    :data:`KERNEL_GROUPS`. The profiler costs little at this size; the shares are what
    the table is for."""
    import json

    import spec as specs
    from graphkit_peer import make

    from graphkit import backends
    from graphkit.engine import ort_engine

    rows = []
    for workload in peer_workloads():
        if not any(workload.name.startswith(n) for n in LARGE_WORKLOADS):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            workload.write(Path(tmp) / "w")
            for backend in [b.name for b in backends.available() if b.installed]:
                if f"graphkit full, {backend}" in workload.skip:  # no gradient for its LSTM
                    continue
                plain, made = ort_engine.session_options, iter(range(10**6))

                def profiled(threads=None, plain=plain, made=made, backend=backend):
                    options = plain(threads)
                    options.enable_profiling = True  # a file per session
                    options.profile_file_prefix = f"{tmp}/{backend}-{next(made)}-profile"
                    return options

                ort_engine.session_options = profiled
                try:
                    epoch = make(f"full:{backend}", specs.load(Path(tmp) / "w", "sgd"))
                    epoch()
                    epoch()
                    for session in gc.get_objects():  # each writes its file as it ends
                        if isinstance(session, ort.InferenceSession):
                            session.end_profiling()
                    del epoch
                finally:
                    ort_engine.session_options = plain
                kernels: collections.Counter = collections.Counter()
                for path in Path(tmp).glob(f"{backend}-*-profile*.json"):
                    for event in json.loads(path.read_text()):
                        op = event.get("args", {}).get("op_name")
                        if event.get("cat") != "Node" or op in (None, "Scan", "Loop"):
                            continue
                        if event["name"].endswith("_kernel_time"):
                            group = next(
                                (g for g, ops in KERNEL_GROUPS.items() if op in ops), "the rest"
                            )
                            kernels[group] += event["dur"]
                total = sum(kernels.values())
                per_batch = total / (2 * workload.batches)
                shares = " | ".join(
                    f"{100 * kernels[g] / total:.0f}%" for g in [*KERNEL_GROUPS, "the rest"]
                )
                rows.append(f"| {workload.name} | {backend} | {per_batch:.0f} | {shares} |")
    return rows


LARGE_MLP = "MLP 100-256-256-1"
"""The large MLP of peers.py whose SGD step graphkit runs level with JAX's lax.scan."""

MASK_FORMS = {
    "greater": "Cast(y > 0) (graphkit's)",
    "sign": "Sign(y)",
    "ceil": "Ceil(Min(y, 1))",
    "where": "Where(y > 0, dy, 0)",
    "hard_sigmoid": "HardSigmoid(y, alpha=2^127) (not exact)",
}
"""The forms of a ReLU's gradient ``dy * (y > 0)`` in standard ONNX, ``y >= 0`` the
ReLU's output; the last is wrong where ``0 < y < 2^-127`` (a subnormal y: alpha y < 1)."""


def _mask_nodes(form: str, y: str, dy: str, out: str) -> list[onnx.NodeProto]:
    """``out = dy * (y > 0)`` in ``form`` (:data:`MASK_FORMS`); constants ``zero``,
    ``one``."""
    make = helper.make_node
    if form == "greater":
        return [
            make("Greater", [y, "zero"], [f"{out}/on"]),
            make("Cast", [f"{out}/on"], [f"{out}/mask"], to=TensorProto.FLOAT),
            make("Mul", [dy, f"{out}/mask"], [out]),
        ]
    if form == "sign":
        return [make("Sign", [y], [f"{out}/mask"]), make("Mul", [dy, f"{out}/mask"], [out])]
    if form == "ceil":
        return [
            make("Min", [y, "one"], [f"{out}/low"]),
            make("Ceil", [f"{out}/low"], [f"{out}/mask"]),
            make("Mul", [dy, f"{out}/mask"], [out]),
        ]
    if form == "where":
        return [
            make("Greater", [y, "zero"], [f"{out}/on"]),
            make("Where", [f"{out}/on", dy, "zero"], [out]),
        ]
    return [
        make("HardSigmoid", [y], [f"{out}/mask"], alpha=2.0**127, beta=0.0),
        make("Mul", [dy, f"{out}/mask"], [out]),
    ]


def mask_rows(shape: tuple[int, int] = (256, 256), steps: int = 400) -> list[str]:
    """Each of :data:`MASK_FORMS` on a ReLU's output of ``shape`` (the large MLP's
    hidden layers at batch 256) in a Scan of ``steps``: us a step beyond the Scan's
    carried sum of ``dy``, which every form adds its result to."""
    f = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    y = np.maximum(rng.normal(size=shape), 0).astype(np.float32)
    dy = rng.normal(size=shape).astype(np.float32)
    feeds = {"acc": np.zeros(shape, np.float32), "ticks": np.zeros((steps, 1), np.float32)}
    feeds |= {"y": y, "dy": dy}  # inputs: onnxruntime would fold constants' masks away
    expected = dy * (y > 0)

    def epoch(form: str | None) -> onnx.ModelProto:
        nodes = _mask_nodes(form, "y", "dy", "masked") if form else []
        summed = "masked" if form else "dy"
        nodes.append(helper.make_node("Add", ["acc", summed], ["acc.next"]))
        nodes.append(helper.make_node("Identity", ["tick"], ["tick.out"]))
        body = helper.make_graph(
            nodes,
            "body",
            [helper.make_tensor_value_info("acc", f, list(shape))]
            + [helper.make_tensor_value_info("tick", f, [1])],
            [helper.make_tensor_value_info("acc.next", f, list(shape))]
            + [helper.make_tensor_value_info("tick.out", f, [1])],
        )
        scan = helper.make_node(
            "Scan", ["acc", "ticks"], ["sum", "ticks.out"], body=body, num_scan_inputs=1
        )
        graph = helper.make_graph(
            [scan],
            "masks",
            [helper.make_tensor_value_info("acc", f, list(shape))]
            + [helper.make_tensor_value_info("ticks", f, [steps, 1])]
            + [helper.make_tensor_value_info(n, f, list(shape)) for n in ("y", "dy")],
            [helper.make_tensor_value_info("sum", f, list(shape))],
            [
                numpy_helper.from_array(np.array(0, np.float32), "zero"),
                numpy_helper.from_array(np.array(1, np.float32), "one"),
            ],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        model.ir_version = 10
        return model

    def timed(form: str | None) -> tuple[float, np.ndarray]:
        options = ort.SessionOptions()
        options.log_severity_level = 3  # the forms that read neither constant
        session = ort.InferenceSession(
            epoch(form).SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        (total,) = session.run(["sum"], feeds)
        return best_of(lambda: session.run(["sum"], feeds)) * 1e6 / steps, total

    base, _ = timed(None)
    cells = []
    for form in MASK_FORMS:
        seconds, total = timed(form)
        exact = np.array_equal(total, expected * steps) or np.allclose(total, expected * steps)
        cells.append(f"{seconds - base:.1f}" + ("" if exact else " (wrong)"))
    return [f"| {shape[0]} x {shape[1]} | " + " | ".join(cells) + " |"]


def hand_written_mlp(
    spec, batches: int, optimizer: str = "sgd", masks: bool = True
) -> onnx.ModelProto:
    """The fewest standard kernels a step of ``spec``'s MLP (dense layers, ReLU between,
    mean squared error) needs, as the body of a Scan over ``batches`` full batches: each
    layer's forward one Gemm (onnxruntime fuses the ReLU into it), each bias's gradient
    a MatMul by a vector of ones, each ReLU's gradient in its fastest exact form
    (:func:`mask_rows`; ``Sign(y)`` on at most 256 elements).

    * ``sgd``: the learning rate folded into the output's gradient once, each weight's
      gradient and update one Gemm (``beta=1`` adds the old weight), each bias's an Add.
    * ``adamw``: the weights, moments and gradients laid end to end (a ``Split`` and a
      ``Reshape`` per matrix give the layers their weights, a ``Reshape`` per gradient
      and a ``Concat`` pack the gradients: graphkit's layout), the update in the 13
      passes of :data:`ADAMW_PASSES`, its step-counter scalars computed before the
      epoch and handed to each step by the Scan.

    ``masks=False`` leaves the ReLU gradients out: not a correct step, the time of the
    rest alone."""
    f = TensorProto.FLOAT
    dense = [layer for layer in spec.arch["layers"] if layer["op"] == "dense"]
    names = [n for layer in dense for n in (layer["W"], layer["b"])]
    shapes = {n: list(spec.weights[n].shape) for n in names}
    batch, sgd = spec.batch_size, optimizer == "sgd"
    make = helper.make_node
    constants = {
        "scale": np.array((-2.0 * spec.lr if sgd else 2.0) / batch, np.float32),
        "mean": np.array(1.0 / batch, np.float32),
        "ones": np.ones(batch, np.float32),  # a bias's gradient: ones @ dy, 1-D
        "zero": np.array(0, np.float32),
        "one": np.array(1, np.float32),
        "flat": np.array([-1], np.int64),
    }
    nodes = []
    if not sgd:
        sizes = [math.prod(shapes[n]) for n in names]
        pieces = [f"{n}/flat" if len(shapes[n]) > 1 else n for n in names]
        nodes.append(make("Split", ["p", "sizes"], pieces))
        constants["sizes"] = np.array(sizes, np.int64)
        for n, piece in zip(names, pieces):
            if piece != n:
                nodes.append(make("Reshape", [piece, f"{n}/shape"], [n]))
                constants[f"{n}/shape"] = np.array(shapes[n], np.int64)
    h = "X"
    for k, layer in enumerate(dense):
        out = "Y" if k == len(dense) - 1 else f"h{k}"
        pre = "Y" if out == "Y" else f"{out}/pre"
        nodes.append(make("Gemm", [h, layer["W"], layer["b"]], [pre]))
        if out != "Y":
            nodes.append(make("Relu", [pre], [out]))
        h = out
    nodes += [
        make("Sub", ["Y", "label"], ["d"]),
        make("ReduceSumSquare", ["d"], ["squares"], keepdims=0),
        make("Mul", ["squares", "mean"], ["loss"]),
        make("Add", ["loss_sum", "loss"], ["loss_sum.next"]),
        make("Mul", ["d", "scale"], ["g_Y"]),
    ]
    grad = "g_Y"  # d loss / d (the layer's output), times -lr for SGD
    for k in reversed(range(len(dense))):
        layer, below = dense[k], "X" if k == 0 else f"h{k - 1}"
        W, b = layer["W"], layer["b"]
        if sgd:
            nodes.append(make("Gemm", [below, grad, W], [f"{W}.next"], transA=1))
            nodes.append(make("MatMul", ["ones", grad], [f"{b}/step"]))
            nodes.append(make("Add", [b, f"{b}/step"], [f"{b}.next"]))
        else:
            nodes.append(make("Gemm", [below, grad], [f"{W}/grad"], transA=1))
            nodes.append(make("Reshape", [f"{W}/grad", "flat"], [f"{W}/flat_grad"]))
            nodes.append(make("MatMul", ["ones", grad], [f"{b}/flat_grad"]))
        if k == 0:
            continue
        nodes.append(make("Gemm", [grad, W], [f"g_{below}"], transB=1))
        form = "sign" if shapes[W][0] * batch <= 256 else "greater"
        if masks:
            nodes += _mask_nodes(form, below, f"g_{below}", f"g_{below}/pre")
            grad = f"g_{below}/pre"
        else:
            grad = f"g_{below}"
    if sgd:
        carried = [(n, shapes[n]) for n in names]
        counters: list[tuple[str, str]] = []
    else:
        b1, b2 = ADAM_BETAS
        constants |= {
            "one_minus_b1": np.array(1 - b1, np.float32),
            "one_minus_b2": np.array(1 - b2, np.float32),
            "decay": np.array(1 - spec.lr * spec.weight_decay, np.float32),
        }
        nodes.append(make("Concat", [f"{n}/flat_grad" for n in names], ["grad"], axis=0))
        nodes += _adamw_passes()
        carried = [(n, [sum(sizes)]) for n in ("p", "m", "v")]
        counters = [("rate_t", "rates"), ("eps_t", "epsilons")]
    carried.append(("loss_sum", []))
    n_in, n_out = spec.X.shape[1], shapes[dense[-1]["W"]][1]
    scanned = [("X", "Xs", [batch, n_in]), ("label", "labels", [batch, n_out])]
    scanned += [(inner, outer, []) for inner, outer in counters]
    body = helper.make_graph(
        nodes,
        f"{optimizer}_step",
        [helper.make_tensor_value_info(n, f, s) for n, s in carried]
        + [helper.make_tensor_value_info(n, f, s) for n, _, s in scanned],
        [helper.make_tensor_value_info(f"{n}.next", f, s) for n, s in carried],
        [numpy_helper.from_array(v, k) for k, v in constants.items()],
    )
    scan = helper.make_node(
        "Scan",
        [n for n, _ in carried] + [outer for _, outer, _ in scanned],
        [f"{n}.final" for n, _ in carried],
        body=body,
        num_scan_inputs=len(scanned),
    )
    graph = helper.make_graph(
        [scan],
        f"{optimizer}_epoch",
        [helper.make_tensor_value_info(n, f, s) for n, s in carried]
        + [helper.make_tensor_value_info(outer, f, [batches, *s]) for _, outer, s in scanned],
        [helper.make_tensor_value_info(f"{n}.final", f, s) for n, s in carried],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.checker.check_model(model, full_check=True)
    return model


def _adamw_passes() -> list[onnx.NodeProto]:
    """AdamW's update of ``p`` with ``m``, ``v`` from ``grad`` in the 13 passes of
    :data:`ADAMW_PASSES` (``rate_t``, ``eps_t``: the step's counter scalars)."""
    make = helper.make_node
    return [
        make("Sub", ["grad", "m"], ["d1"]),
        make("Mul", ["d1", "one_minus_b1"], ["e1"]),
        make("Add", ["m", "e1"], ["m.next"]),
        make("Mul", ["grad", "grad"], ["g2"]),
        make("Sub", ["g2", "v"], ["d2"]),
        make("Mul", ["d2", "one_minus_b2"], ["e2"]),
        make("Add", ["v", "e2"], ["v.next"]),
        make("Sqrt", ["v.next"], ["root"]),
        make("Add", ["root", "eps_t"], ["denominator"]),
        make("Div", ["m.next", "denominator"], ["direction"]),
        make("Mul", ["p", "decay"], ["decayed"]),
        make("Mul", ["direction", "rate_t"], ["step"]),
        make("Sub", ["decayed", "step"], ["p.next"]),
    ]


def numpy_mlp(spec, batches: int) -> tuple[dict[str, np.ndarray], float]:
    """``spec``'s MLP trained by ``spec.optimizer`` (SGD, or AdamW in torch's form) on
    its first ``batches`` batches, in float64 numpy from the formulas: the hand-written
    step's reference. Returns the weights and the epoch's mean batch loss."""
    dense = [layer for layer in spec.arch["layers"] if layer["op"] == "dense"]
    w = {k: v.astype(np.float64) for k, v in spec.weights.items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v2 = {k: np.zeros_like(v) for k, v in w.items()}
    b1, b2 = ADAM_BETAS
    batch, total = spec.batch_size, 0.0
    for i in range(batches):
        rows = slice(i * batch, (i + 1) * batch)
        hs = [spec.X[rows].astype(np.float64)]
        for k, layer in enumerate(dense):
            z = hs[-1] @ w[layer["W"]] + w[layer["b"]]
            hs.append(z if k == len(dense) - 1 else np.maximum(z, 0))
        d = hs[-1] - spec.y[rows].reshape(hs[-1].shape)
        total += float((d * d).sum() / batch)
        grad, grads = 2 * d / batch, {}
        for k in reversed(range(len(dense))):
            W, b = dense[k]["W"], dense[k]["b"]
            grads[W], grads[b] = hs[k].T @ grad, grad.sum(0)
            grad = grad @ w[W].T * (hs[k] > 0)
        t = i + 1
        for name, g in grads.items():
            if spec.optimizer == "sgd":
                w[name] -= spec.lr * g
                continue
            m[name] = b1 * m[name] + (1 - b1) * g
            v2[name] = b2 * v2[name] + (1 - b2) * g * g
            step = spec.lr / (1 - b1**t) * m[name]
            denominator = np.sqrt(v2[name]) / np.sqrt(1 - b2**t) + ADAM_EPS
            w[name] = w[name] * (1 - spec.lr * spec.weight_decay) - step / denominator
    return w, total / batches


def large_mlp_floor_rows() -> tuple[dict[str, list[str]], int]:
    """The large MLP's step for each optimizer, us a batch: graphkit's full training
    (one run per epoch, each backend) against :func:`hand_written_mlp` (for SGD also
    without its ReLU gradients), all in this process, the hand-written steps checked
    against numpy. Returns the rows by optimizer and the batches timed."""
    from graphkit_peer import make

    from graphkit import backends

    rows: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for optimizer in ("sgd", "adamw"):
            spec = workload_spec(LARGE_MLP, optimizer, Path(tmp))  # graphkit reads its model
            batches = len(spec.X) // spec.batch_size  # full batches
            rows[optimizer] = found = []
            for backend in [b.name for b in backends.available() if b.installed]:
                epoch = make(f"full:{backend}", spec)
                seconds = best_of(epoch, repeat=5)
                found.append(f"| graphkit, {backend} | {seconds * 1e6 / spec.batches:.0f} |")
                del epoch
            _check_hand_written_mlp(spec, optimizer)
            feeds = _hand_written_mlp_feeds(spec, batches)
            variants = [(True, "hand-written")]
            variants += [(False, "hand-written, no ReLU gradients")] if optimizer == "sgd" else []
            for masks, label in variants:
                model = hand_written_mlp(spec, batches, optimizer, masks)
                session = ort.InferenceSession(
                    model.SerializeToString(), providers=["CPUExecutionProvider"]
                )
                seconds = best_of(lambda s=session, f=feeds: s.run(None, f), repeat=5)
                found.append(f"| {label} | {seconds * 1e6 / batches:.0f} |")
    return rows, batches


def _hand_written_mlp_feeds(spec, batches: int) -> dict[str, np.ndarray]:
    """:func:`hand_written_mlp`'s inputs: the workload's first ``batches`` batches and
    initial weights (laid end to end for AdamW, its moments zero, its counter scalars
    for steps 1, 2...)."""
    n = batches * spec.batch_size
    dense = [layer for layer in spec.arch["layers"] if layer["op"] == "dense"]
    names = [k for layer in dense for k in (layer["W"], layer["b"])]
    feeds = {
        "loss_sum": np.array(0, np.float32),
        "Xs": spec.X[:n].reshape(batches, spec.batch_size, -1),
        "labels": spec.y[:n].reshape(batches, spec.batch_size, -1).astype(np.float32),
    }
    if spec.optimizer == "sgd":
        return feeds | {k: spec.weights[k].copy() for k in names}
    packed = np.concatenate([spec.weights[k].ravel() for k in names])
    t = np.arange(1, batches + 1, dtype=np.float64)
    c1, c2 = 1 - ADAM_BETAS[0] ** t, 1 - ADAM_BETAS[1] ** t
    return feeds | {
        "p": packed,
        "m": np.zeros_like(packed),
        "v": np.zeros_like(packed),
        "rates": (spec.lr * np.sqrt(c2) / c1).astype(np.float32),
        "epsilons": (ADAM_EPS * np.sqrt(c2)).astype(np.float32),
    }


CHECKED_BATCHES = 20
"""Batches over which :func:`_check_hand_written_mlp` compares the hand-written step with
numpy: AdamW's float32 rounding, amplified where ``v`` is small, takes its weights 1e-2
from float64's over the 195 batches of an epoch, 3e-4 over 20."""


def _hand_written_weights(spec, session, feeds) -> dict[str, np.ndarray]:
    """The weights after the hand-written epoch, by name (AdamW's unpacked)."""
    outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    dense = [layer for layer in spec.arch["layers"] if layer["op"] == "dense"]
    names = [k for layer in dense for k in (layer["W"], layer["b"])]
    if spec.optimizer == "sgd":
        return {k: outputs[f"{k}.final"] for k in names}
    offsets = np.cumsum([spec.weights[k].size for k in names])[:-1]
    parts = np.split(outputs["p.final"], offsets)
    return {k: part.reshape(spec.weights[k].shape) for k, part in zip(names, parts)}


def _check_hand_written_mlp(spec, optimizer: str) -> None:
    """The hand-written epoch of :data:`CHECKED_BATCHES` against numpy's in float64:
    its mean batch loss to 1e-4 relative, its weights to 2e-3."""
    batches = CHECKED_BATCHES
    feeds = _hand_written_mlp_feeds(spec, batches)
    expected, loss = numpy_mlp(spec, batches)
    model = hand_written_mlp(spec, batches, optimizer)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (total,) = session.run(["loss_sum.final"], feeds)
    np.testing.assert_allclose(total / batches, loss, rtol=1e-4)
    weights = _hand_written_weights(spec, session, feeds)
    for name, value in expected.items():
        np.testing.assert_allclose(weights[name], value, rtol=2e-3, atol=2e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "PROFILE.md"))
    args = parser.parse_args()
    scan, kernel, points = fixed_costs()
    call = session_call_cost()
    fb_rows = forward_backward_rows()
    hand_rows = []
    for optimizer in ("sgd", "adamw"):
        hand_row, hand_weights = hand_written_row(scan, kernel, optimizer)
        check_hand_written(hand_weights, optimizer)
        hand_rows.append(hand_row)
    adam_rows, adam_size, floors = adamw_rows()
    pool_rows = pooling_rows()
    large_rows = large_step_rows()
    floor_rows, floor_batches = large_mlp_floor_rows()
    relu_rows = mask_rows()
    lines = [
        "# Where a small batch's time goes (benchmarks/profile_epoch.py)",
        "",
        f"{time.strftime('%Y-%m-%d')}, onnxruntime {ort.__version__}, Python "
        f"{platform.python_version()}, {platform.machine()}; microseconds per batch (one "
        "Scan iteration).",
        "",
        "## onnxruntime's fixed costs",
        "",
        "A Scan of 1,000 iterations whose body chains k Adds on [10, 10] tensors:",
        "",
        "| kernels in the body | us per iteration |",
        "|---:|---:|",
        *(f"| {k} | {t:.3f} |" for k, t in points),
        "",
        f"Least squares: **{scan:.2f} us per Scan iteration** (the Scan's own work) plus "
        f"**{kernel:.3f} us per kernel**.",
        "",
        "## graphkit's MLP 10-10-1 at batch 10, one run per epoch",
        "",
        "| backend | optimizer | measured us/batch | kernels per batch (after onnxruntime's "
        "optimizations) | floor: Scan + kernels x kernel | the rest (compute, copies) | "
        "kernels |",
        "|---|---|---:|---:|---:|---:|---|",
        *graphkit_rows(scan, kernel),
        *hand_rows,
        "",
        "The hand-written rows are the floors on onnxruntime: the fewest standard kernels "
        "each step needs (SGD: the learning rate folded into the output's gradient, each "
        "weight's gradient and update one Gemm; AdamW: the weights, moments and gradients "
        "laid end to end, the update in 13 passes, its counter's scalars computed before "
        "the epoch), their weights after the epoch equal to graphkit's within 1e-5.",
        "",
        "## Forward/backward training on batches of microseconds",
        "",
        "The forward/backward trainer runs a batch at a time from Python (the ONNX graph "
        "is a layer of a larger program), full training the whole epoch in one run. The "
        "workloads of run.py whose batches take tens of microseconds, SGD, us per batch:",
        "",
        "| workload | backend | full, one run per epoch | forward/backward | ratio | "
        "onnxruntime calls a batch | the calls alone | ratio |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
        *fb_rows,
        "",
        "*The calls alone*: the trainer's onnxruntime calls for one batch, repeated on the "
        "same bound arrays and buffers, without the batch loop (slicing, the labels' "
        "checks, the loss bookkeeping): the floor of any batch driven from Python. "
        f"One `run_with_iobinding` from Python on a one-node graph costs **{call:.1f} us** "
        f"against the Scan's {scan:.2f} per iteration. Where the calls alone exceed 1.2 "
        "times full training, forward/backward training cannot come within 1.2 times full "
        "training at this size on onnxruntime, whatever the trainer does around them.",
        "",
        "## AdamW's update on the MLP 784-512-512-10 (batch 128)",
        "",
        f"{adam_size:,} weights. graphkit's step, us per batch (one run per epoch):",
        "",
        "| backend | SGD | AdamW | AdamW's update (the difference) |",
        "|---|---:|---:|---:|",
        *adam_rows,
        "",
        f"The fewest standard kernels AdamW needs ({ADAMW_PASSES} elementwise passes over "
        "the weights, scalars folded, no Concat or Split), alone in a Scan of 100 steps "
        "that carries the weights and both moments, us per step:",
        "",
        "| weights | one pass (an Add) | 13 passes | us per pass |",
        "|---|---:|---:|---:|",
        *(
            f"| {layout} | {one:.0f} | {all_:.0f} | {(all_ - one) / (ADAMW_PASSES - 1):.0f} |"
            for layout, (one, all_) in floors.items()
        ),
        "",
        "ONNX has no fused optimizer operator, so AdamW in standard ONNX on onnxruntime's "
        f"CPU kernels costs at least {ADAMW_PASSES} such passes a step where SGD takes one; "
        "a compiler that fuses the update into one loop (JAX, torch.compile) reads and "
        "writes each weight's values once. Compare with the JAX rows of this workload in "
        "RESULTS.md (its AdamW epoch against its SGD epoch): graphkit's SGD step plus the "
        "12 passes beyond SGD's one is a floor for its AdamW step. Laid end to end, each pass "
        "runs over 2.7 MB vectors that leave the caches: graphkit packs an update's weights "
        "only up to 512 KiB (graphkit.training.step.PACK_UP_TO_BYTES). graphkit's AdamW "
        "update is these 13 passes: the decoupled decay's scalar factors gathered, "
        "`p (1 - lr wd) - ((lr sqrt(c2) / c1) m) / (sqrt(v) + eps sqrt(c2))` "
        "(graphkit.decay_factors; the optimizer chain writes 15). Packed, it adds the "
        "gradients' Concat and the weights' Split; updating the large matrices of the "
        f"{LARGE_MLP} on their own and packing only the rest measured slower (857-953 "
        "against 829-904 us a batch).",
        "",
        "## Where a large step's time goes",
        "",
        "peers.py's workloads of a millisecond and more a batch, full training (SGD, one "
        "run per epoch) under onnxruntime's profiler: its kernels' time per batch, and "
        "the share of each group of kernels (*products*: MatMul, Gemm, convolutions and "
        "their fused forms; *data movement*: Transpose, Concat, Split, Slice, Gather, "
        "Pad, Expand, Reshape...; *the rest*: elementwise operators, reductions, "
        "normalizations, softmax and their gradients):",
        "",
        "| workload | backend | kernels, us a batch | products | pooling | data movement "
        "| the rest |",
        "|---|---|---:|---:|---:|---:|---:|",
        *large_rows,
        "",
        f"## The {LARGE_MLP}'s step (batch 256) against its floor",
        "",
        "The fewest standard kernels its step needs, written by hand as the body of a "
        "Scan (`hand_written_mlp`: each layer's forward one Gemm with its ReLU fused, each "
        "bias's gradient a MatMul by ones, each ReLU's gradient in its fastest exact form; "
        "SGD: the learning rate folded into the output's gradient once, each weight's "
        "gradient and update one Gemm; AdamW: graphkit's layout, the weights, moments and "
        "gradients laid end to end, the update in 13 passes), over the workload's "
        f"{floor_batches} full batches, checked against numpy's float64 training over "
        f"its first {CHECKED_BATCHES}; graphkit's full training (one run per epoch) on "
        "the same data, in this process; us per batch:",
        "",
        "| SGD | us per batch |",
        "|---|---:|",
        *floor_rows["sgd"],
        "",
        "| AdamW | us per batch |",
        "|---|---:|",
        *floor_rows["adamw"],
        "",
        "Compare the floors with the JAX rows of this workload in RESULTS.md (its "
        "`lax.scan` epoch fuses each ReLU mask into its product and AdamW's update into "
        "one loop): a step of onnxruntime's kernels can be ahead of it only by what the "
        "floor is below it.",
        "",
        "*No ReLU gradients* is not a correct step: the products, the biases and the "
        "loss alone. The two ReLU gradients (a [256, 256] mask each) are what separates it "
        "from the floor: onnxruntime runs each as kernels of their own, a compiler fuses "
        "them into the products' loops. Their standard forms, us a step beyond a Scan's "
        "carried sum (an Add of the same size):",
        "",
        "| mask | " + " | ".join(MASK_FORMS.values()) + " |",
        "|---|" + "---:|" * len(MASK_FORMS),
        *relu_rows,
        "",
        "graphkit writes `Cast(y > 0)` (and `Sign(y)` on at most 256 elements, "
        "graphkit.static_shapes.SIGN_MASK_UP_TO). The one faster form, a `HardSigmoid` "
        "of slope 2^127, is wrong for a subnormal y (0 < y < 2^-127 gives a mask below "
        "1): not used.",
        "",
        "## Max pooling in the 28x28 CNN (peers.py, batch 64)",
        "",
        "Its two 2x2 poolings of stride 2, forward and what the gradient needs, us a call "
        "(a ReLU's output as input):",
        "",
        "| pooled input | " + " | ".join(POOLING_FORMS.values()) + " |",
        "|---|" + "---:|" * len(POOLING_FORMS),
        *pool_rows,
        "",
        "graphkit's whole step on that CNN: its rows in RESULTS.md (each contender in a "
        "process of its own; timed here, after the sections above, the step read up to "
        "1.5 times as long).",
        "",
        "graphkit sends a tiling pooling's gradient back with `MaxUnpool` "
        "(graphkit/backends/pool_adjoints.py). What remains is the forward's indices: "
        "onnxruntime's MaxPool computes them on a slower path than the pooled values "
        "alone. A gradient without them must find each window's first maximum (ties go "
        "to the first, as torch's do) from the pooled values repeated over the window, "
        "and the last column shows that costs more than the indices and MaxUnpool.",
        "",
    ]
    Path(args.output).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
