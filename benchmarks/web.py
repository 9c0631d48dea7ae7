"""Time a training batch in the browser (onnxruntime-web, wasm) against native onnxruntime.

    python benchmarks/web.py [--epochs 20] [--output benchmarks/results/web.md]

The models of tests/web_models.py are exported once (graphkit_train.web.export_web). The
same exported graphs then train in headless Chromium with 1 and with 2 wasm threads (the
page is cross-origin isolated, so threads work), and in Python's onnxruntime with 1 and
2 intra-op threads: the step run batch by batch ("step") and the exported epoch, one
run per epoch ("epoch"). Each contender trains one untimed epoch, then ``--epochs``
timed ones from the same start; the time per batch is the best epoch's. Every contender
reports its last epoch's loss, which must agree (the same weights, the same rows in the
same order). Needs ``make web-deps``; run it alone (2 cores).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper
from report import default_output, header, write

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.browser import WEB, browser_missing, run_page, serve  # noqa: E402
from tests.web_models import BENCHMARKED, MODELS  # noqa: E402

# the page's side: the same loop as graphkit-web.mjs's fit, timed per epoch
_PAGE = """
if (!(await window.demo.ready)) return { error: window.demo.error };
const { loadTrainer } = await import("/bundles/MODEL/graphkit-web.mjs");
const ort = await import("/node_modules/onnxruntime-web/dist/ort.wasm.min.mjs");
const out = {};
for (const mode of ["step", "epoch"]) {
  const t = await loadTrainer("/bundles/MODEL/", { ort });
  const d = t.data;
  await t.fit(d.train.X, d.train.y, { epochs: 1, mode, shuffle: false });  // warm up
  const times = [];
  for (let e = 0; e < EPOCHS; e++) {
    const start = performance.now();
    await t.fit(d.train.X, d.train.y, { epochs: 1, mode, shuffle: false });
    times.push(performance.now() - start);
  }
  out[mode] = { ms: Math.min(...times), loss: t.trainLosses.at(-1) };
}
out.threads = ort.env.wasm.numThreads;
out.isolated = crossOriginIsolated;
return out;
"""


# onnxruntime-web's fixed costs, from synthetic graphs: a chain of 150 Relu kernels at the
# top level and inside a one-iteration Loop (per kernel), 16 Identity inputs/outputs and
# one (per run, and per tensor fed and fetched); the same graphs in native onnxruntime
_FIXED = """
const ort = await import("/node_modules/onnxruntime-web/dist/ort.wasm.min.mjs");
const out = {};
for (const name of ["chain", "loop", "io", "one"]) {
  const session = await ort.InferenceSession.create("/bundles/fixed/" + name + ".onnx");
  const feeds = {};
  for (const input of session.inputNames)
    feeds[input] = new ort.Tensor("float32", new Float32Array(1024), [32, 32]);
  for (let i = 0; i < 50; i++) await session.run(feeds);
  const start = performance.now();
  for (let i = 0; i < 500; i++) await session.run(feeds);
  out[name] = (performance.now() - start) * 2;  // us per run
}
return out;
"""
KERNELS, TENSORS = 150, 16


def fixed_cost_models(folder: Path) -> dict[str, onnx.ModelProto]:
    """chain: KERNELS Relus; loop: the same as the body of a one-iteration Loop; io:
    TENSORS inputs copied to TENSORS outputs by Identity; one: a single Identity."""
    folder.mkdir(parents=True, exist_ok=True)
    square = [32, 32]
    relus = [
        helper.make_node("Relu", ["x" if k == 0 else f"h{k - 1}"], [f"h{k}"])
        for k in range(KERNELS)
    ]
    last = f"h{KERNELS - 1}"
    chain = helper.make_graph(
        relus,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, square)],
        [helper.make_tensor_value_info(last, TensorProto.FLOAT, square)],
    )
    body = helper.make_graph(
        [*relus, helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [
            helper.make_tensor_value_info("iteration", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info(last, TensorProto.FLOAT, square),
        ],
    )
    loop = helper.make_graph(
        [helper.make_node("Loop", ["one", ""], ["stacked"], body=body)],
        "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, square)],
        [helper.make_tensor_value_info("stacked", TensorProto.FLOAT, [1, *square])],
        [numpy_helper.from_array(np.array(1, np.int64), "one")],
    )
    io = helper.make_graph(
        [helper.make_node("Identity", [f"i{k}"], [f"o{k}"]) for k in range(TENSORS)],
        "io",
        [helper.make_tensor_value_info(f"i{k}", TensorProto.FLOAT, square) for k in range(TENSORS)],
        [helper.make_tensor_value_info(f"o{k}", TensorProto.FLOAT, square) for k in range(TENSORS)],
    )
    one = helper.make_graph(
        [helper.make_node("Identity", ["i0"], ["o0"])],
        "one",
        [helper.make_tensor_value_info("i0", TensorProto.FLOAT, square)],
        [helper.make_tensor_value_info("o0", TensorProto.FLOAT, square)],
    )
    models = {}
    for name, graph in (("chain", chain), ("loop", loop), ("io", io), ("one", one)):
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
        onnx.checker.check_model(model, full_check=True)
        onnx.save(model, folder / f"{name}.onnx")
        models[name] = model
    return models


def native_fixed(models: dict[str, onnx.ModelProto]) -> dict[str, float]:
    """us per run of each synthetic model in native onnxruntime, 1 thread."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    out = {}
    for name, model in models.items():
        session = onnxruntime.InferenceSession(
            model.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        feeds = {i.name: np.zeros((32, 32), np.float32) for i in session.get_inputs()}
        for _ in range(50):
            session.run(None, feeds)
        start = time.perf_counter()
        for _ in range(500):
            session.run(None, feeds)
        out[name] = (time.perf_counter() - start) * 2000
    return out


def native(folder: Path, epochs: int, threads: int) -> dict[str, dict[str, float]]:
    """The same loops in Python's onnxruntime: ms per epoch (best) and the last loss."""
    manifest = json.loads((folder / "manifest.json").read_text())
    data = json.loads((folder / "data.json").read_text())["train"]
    spec, label = manifest["inputs"][0], manifest["label"]
    X = np.array(data["X"], spec["type"]).reshape(-1, *spec["dims"][1:])
    y = np.array(data["y"], label["type"]).reshape(-1, *label["dims"][1:])
    feeds = {spec["name"]: X, label["name"]: y}
    if manifest["sample_weight"]:
        feeds[manifest["sample_weight"]["name"]] = np.ones(
            len(X), manifest["sample_weight"]["type"]
        )
    raw = (folder / "state.bin").read_bytes()
    start_state = {
        e["name"]: np.frombuffer(raw[e["offset"] : e["offset"] + e["bytes"]], e["type"])
        .reshape(e["dims"])
        .copy()
        for e in manifest["state"]
    }
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    batch = manifest["batch_size"]
    results = {}
    for mode in ("step", "epoch"):
        session = onnxruntime.InferenceSession(
            str(folder / manifest["files"][mode]["path"]),
            options,
            providers=["CPUExecutionProvider"],
        )
        state = dict(start_state)

        state, loss = _epoch(session, mode, feeds, state, batch)  # warm up
        best = float("inf")
        for _ in range(epochs):
            start = time.perf_counter()
            state, loss = _epoch(session, mode, feeds, state, batch)
            best = min(best, (time.perf_counter() - start) * 1000)
        results[mode] = {"ms": best, "loss": loss}
    return results


def _epoch(
    session: onnxruntime.InferenceSession,
    mode: str,
    feeds: dict[str, np.ndarray],
    state: dict[str, np.ndarray],
    batch: int,
) -> tuple[dict[str, np.ndarray], float]:
    """One epoch in order: the exported epoch in one run, or the step batch by batch;
    the new state and the epoch's mean batch loss."""
    names = [o.name for o in session.get_outputs()]
    state = {**state, "loss_sum": np.zeros_like(state["loss_sum"])}
    rows = len(next(iter(feeds.values())))
    if mode == "epoch":
        run = {**feeds, **state, "permutation": np.arange(rows), "batch_size": np.array(batch)}
        out = dict(zip(names, session.run(None, run)))
        return {n: out[f"{n}.next"] for n in state}, float(out["batch_losses"].mean())
    batches = 0
    for start in range(0, rows, batch):
        run = {k: v[start : start + batch] for k, v in feeds.items()}
        out = dict(zip(names, session.run(None, {**run, **state})))
        state = {n: out[f"{n}.next"] for n in state}
        batches += 1
    return state, float(state["loss_sum"]) / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20, help="timed epochs per contender")
    parser.add_argument("--output", default=str(default_output(__file__)))
    args = parser.parse_args()
    missing = browser_missing()
    if missing:
        sys.exit(f"benchmarks/web.py: {missing}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        bundles = Path(tmp)
        for name in BENCHMARKED:
            MODELS[name](bundles / name)
        synthetic = fixed_cost_models(bundles / "fixed")
        with serve(WEB, {"/bundles/": bundles}) as site:
            answer = run_page(f"{site}/index.html?model=/bundles/regressor/", _FIXED, 600)
            if not answer["ok"]:
                sys.exit(f"fixed costs: {answer}")
            fixed = {"wasm": answer["value"], "native": native_fixed(synthetic)}
            print("fixed costs", json.dumps(fixed))
            for name in BENCHMARKED:
                folder = bundles / name
                manifest = json.loads((folder / "manifest.json").read_text())
                train_rows = len(json.loads((folder / "data.json").read_text())["train"]["y"])
                batches = -(-train_rows // manifest["batch_size"])
                timings: dict[str, dict[str, dict[str, float]]] = {}
                for threads in (1, 2):
                    url = f"{site}/index.html?model=/bundles/{name}/&threads={threads}"
                    script = _PAGE.replace("MODEL", name).replace("EPOCHS", str(args.epochs))
                    answer = run_page(url, script, timeout_s=600)
                    if not answer["ok"] or "error" in answer["value"]:
                        sys.exit(f"{name}, {threads} threads: {answer}")
                    assert answer["value"]["isolated"] and answer["value"]["threads"] == threads
                    timings[f"wasm, {threads} thread{'s' * (threads > 1)}"] = answer["value"]
                    timings[f"native, {threads} thread{'s' * (threads > 1)}"] = native(
                        folder, args.epochs, threads
                    )
                rows.append((name, manifest, train_rows, batches, timings))
                print(name, json.dumps(timings))
    write(args.output, report(rows, args.epochs, fixed))
    print(f"wrote {args.output}")


def report(rows: list, epochs: int, fixed: dict[str, dict[str, float]]) -> list[str]:
    libraries = (
        f"CPython {platform.python_version()}, onnxruntime {onnxruntime.__version__}, "
        "onnxruntime-web 1.30.0 in headless Chromium (Debian)"
    )
    lines = header(
        "Training in the browser: onnxruntime-web (wasm) against native onnxruntime",
        libraries=libraries,
    ) + [
        f"Best of {epochs} epochs after one untimed; µs / batch; **x native** is the ratio "
        "to native onnxruntime with the same threads and mode. "
        "`step`: one run per batch (graphkit-web's `mode: \"step\"`, Python's PortableTrainer); "
        "`epoch`: the exported epoch, one run per epoch (the page's default).",
        "",
        "| model | rows, batch | mode | wasm 1 thread | native 1 thread | x native "
        "| wasm 2 threads | native 2 threads | x native | last loss (all agree) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, manifest, train_rows, batches, timings in rows:
        for mode in ("step", "epoch"):
            us = {k: v[mode]["ms"] * 1000 / batches for k, v in timings.items()}
            losses = [v[mode]["loss"] for v in timings.values()]
            spread = (max(losses) - min(losses)) / abs(np.mean(losses))
            cells = []
            for threads in ("1 thread", "2 threads"):
                wasm, nat = us[f"wasm, {threads}"], us[f"native, {threads}"]
                cells += [f"{wasm:.0f}", f"{nat:.0f}", f"{wasm / nat:.2f}"]
            lines.append(
                f"| {name} ({manifest['optimizer']['name']}) | {train_rows}, "
                f"{manifest['batch_size']} | {mode} | {' | '.join(cells)} | "
                f"{np.mean(losses):.6g} (spread {spread:.1e}) |"
            )
    per_kernel = {k: (v["chain"] - v["one"]) / KERNELS for k, v in fixed.items()}
    in_loop = {k: (v["loop"] - v["one"]) / KERNELS for k, v in fixed.items()}
    per_tensor = {k: (v["io"] - v["one"]) / (2 * TENSORS - 2) for k, v in fixed.items()}
    lines += [
        "",
        "## Why: onnxruntime-web's fixed costs",
        "",
        "Synthetic graphs on [32, 32] tensors, 1 thread, microseconds per run (best of "
        "500 after 50 untimed): one Identity, a chain of 150 Relu kernels, the same chain "
        "as the body of a one-iteration Loop, and 16 inputs copied to 16 outputs by "
        "Identity.",
        "",
        "| | one Identity (a run) | 150 kernels | 150 in a Loop | 16 in + 16 out |",
        "|---|---:|---:|---:|---:|",
        *(
            f"| {k} | {v['one']:.0f} | {v['chain']:.0f} | {v['loop']:.0f} | {v['io']:.0f} |"
            for k, v in fixed.items()
        ),
        "",
        f"A run costs about {fixed['wasm']['one']:.0f} us in wasm before any kernel "
        f"({fixed['native']['one']:.0f} natively), a kernel about {per_kernel['wasm']:.1f} us "
        f"({in_loop['wasm']:.1f} inside a Loop) against {per_kernel['native']:.2f} us "
        f"natively, and each tensor fed or fetched about {per_tensor['wasm']:.1f} us "
        f"({per_tensor['native']:.2f} natively). A step of 100 to 200 kernels and 15 to 30 "
        "resident tensors pays these fixed costs more than its arithmetic. The exported "
        "epoch pays the run and the resident tensors once per epoch instead of once per "
        'batch, which is why `mode: "epoch"` is the page\'s default.',
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
