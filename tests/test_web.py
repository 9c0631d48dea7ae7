"""graphkit's web export, trained by onnxruntime-web in headless Chromium.

Each model is exported (:func:`graphkit_train.web.export_web`, or ``graphkit-train
export --web``), served on localhost with the demo page (``web/index.html``), trained in
the page for 3 epochs on fixed permutations, and compared with Python's own run of the
same exported step (:class:`graphkit.portable_trainer.PortableTrainer` on onnxruntime, the
permuted rows fed in order): the epoch losses, the held-out losses and every weight
within 1e-5. The model the page writes (``exportModel``) must pass ``onnx.checker``'s
full check and predict in Python's onnxruntime as it did in the page.

``make web-deps`` installs what this needs (onnxruntime-web and playwright-core from the
lockfile, Debian's chromium); without it every test skips, saying so. ``make test`` runs
this file in its main environment only (``GRAPHKIT_WEB_TESTS=0`` elsewhere).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

import graphkit as gk
from graphkit.portable_trainer import PortableTrainer
from tests.browser import WEB, browser_missing, run_page, serve
from tests.web_models import MODELS

_missing = None if os.environ.get("GRAPHKIT_WEB_TESTS") == "0" else browser_missing()
pytestmark = [
    pytest.mark.skipif(
        os.environ.get("GRAPHKIT_WEB_TESTS") == "0",
        reason="the browser tests run once, in make test's main environment",
    ),
    pytest.mark.skipif(_missing is not None, reason=f"no browser here: {_missing}"),
]

EPOCHS = 3
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def bundles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every model's exported folder, under one root served at /bundles/."""
    root = tmp_path_factory.mktemp("bundles")
    for name, build in MODELS.items():
        build(root / name)
    return root


@pytest.fixture(scope="module")
def site(bundles: Path):
    """The demo page (web/) on localhost, the exported folders at /bundles/."""
    with serve(WEB, {"/bundles/": bundles}) as base:
        yield base


def page(site: str, model: str, **query: object) -> str:
    extra = "".join(f"&{k}={v}" for k, v in query.items())
    return f"{site}/index.html?model=/bundles/{model}/&threads=1{extra}"


def in_page(body: str) -> str:
    """A script that waits for the demo page's trainer, then runs ``body`` with ``t``."""
    return (
        "if (!(await window.demo.ready)) return { loadError: window.demo.error };\n"
        "const t = window.demo.trainer;\n" + body
    )


# -- Python's run of the same exported step ----------------------------------------------


def load_rows(folder: Path, part: str) -> tuple[np.ndarray, np.ndarray]:
    manifest = json.loads((folder / "manifest.json").read_text())
    data = json.loads((folder / "data.json").read_text())[part]
    x_type = manifest["inputs"][0]
    X = np.array(data["X"], dtype=x_type["type"]).reshape(-1, *x_type["dims"][1:])
    y = np.array(data["y"], dtype=manifest["label"]["type"])
    return X, y


def python_run(
    folder: Path, orders: list[np.ndarray], weights: np.ndarray | None
) -> tuple[PortableTrainer, list[float]]:
    """PortableTrainer on the exported step, each epoch's permuted rows in order, and the
    held-out loss after each epoch (evaluate.onnx on Python's onnxruntime)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    X, y = load_rows(folder, "train")
    X_held, y_held = load_rows(folder, "held_out")
    trainer = PortableTrainer(folder / "training_step.onnx", manifest["batch_size"], shuffle=False)
    evaluate = onnxruntime.InferenceSession(str(folder / "evaluate.onnx"))
    label = manifest["label"]
    held_losses = []
    for order in orders:
        w = None if weights is None else weights[order]
        trainer.fit(X[order], y[order], sample_weight=w, epochs=1)
        feeds = {
            manifest["inputs"][0]["name"]: X_held,
            label["name"]: y_held.reshape(-1, *[d for d in label["dims"][1:]]),
        }
        if manifest["sample_weight"]:
            feeds[manifest["sample_weight"]["name"]] = np.ones(
                len(X_held), manifest["sample_weight"]["type"]
            )
        state = trainer.state()
        feeds.update({n: state[n] for n in manifest["weights"]})
        held_losses.append(float(evaluate.run([manifest["loss"]["output"]], feeds)[0]))
    return trainer, held_losses


# -- the tests ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "mode", "weighted"),
    [
        ("regressor", "epoch", False),
        ("classifier", "step", True),
        ("cnn", "epoch", False),
        ("cnn_train_mode", "epoch", False),
    ],
)
def test_browser_training_equals_python(site, bundles, tmp_path, model, mode, weighted):
    folder = bundles / model
    X, y = load_rows(folder, "train")
    rng = np.random.default_rng(1)
    orders = [rng.permutation(len(X)) for _ in range(EPOCHS)]
    weights = rng.uniform(0.5, 2.0, len(X)).astype(np.float32) if weighted else None
    script = in_page(
        f"""
        const d = t.data;
        await t.fit(d.train.X, d.train.y, {{
          epochs: {EPOCHS}, mode: "{mode}", order: {json.dumps([o.tolist() for o in orders])},
          sampleWeight: {json.dumps(None if weights is None else weights.tolist())},
          validation: d.held_out }});
        const state = {{}};
        for (const [n, v] of Object.entries(t.state)) state[n] = Array.from(v.data, Number);
        const bytes = t.exportModel();
        let binary = "";
        for (let i = 0; i < bytes.length; i += 8192)
          binary += String.fromCharCode(...bytes.subarray(i, i + 8192));
        return {{ train: t.trainLosses, heldOut: t.heldOutLosses, state,
                  predicted: await t.predict(d.held_out.X), model: btoa(binary) }};
        """
    )
    answer = run_page(page(site, model), script)
    assert answer["ok"], answer
    got = answer["value"]
    assert "loadError" not in got, got

    python, held_losses = python_run(folder, orders, weights)
    np.testing.assert_allclose(got["train"], python.train_losses_, rtol=TOLERANCE)
    np.testing.assert_allclose(got["heldOut"], held_losses, rtol=TOLERANCE)
    state = python.state()
    assert sorted(got["state"]) == sorted(state)  # weights, optimizer state, step, loss_sum
    assert int(got["state"]["step"][0]) == EPOCHS * -(-len(X) // python.batch_size)
    for name, values in got["state"].items():
        # float32 rounding differs between wasm and x86 kernels: within 1e-5 of each
        # tensor's scale (Adam's moments hold values near 0 beside values near 200)
        scale = float(np.abs(state[name]).max())
        np.testing.assert_allclose(
            np.reshape(values, state[name].shape),
            state[name],
            rtol=TOLERANCE,
            atol=TOLERANCE * scale,
            err_msg=name,
        )
    assert python.train_losses_[-1] < python.train_losses_[0]  # it does learn

    # the page's model: a full-check ONNX model that predicts in Python as in the page
    trained = onnx.load_from_string(base64.b64decode(got["model"]))
    onnx.checker.check_model(trained, full_check=True)
    X_held, _ = load_rows(folder, "held_out")
    session = onnxruntime.InferenceSession(trained.SerializeToString())
    manifest = json.loads((folder / "manifest.json").read_text())
    output = dict(
        zip(
            [o.name for o in session.get_outputs()],
            session.run(None, {session.get_inputs()[0].name: X_held}),
        )
    )[manifest["prediction"]["output"]]
    if manifest["prediction"]["kind"] == "labels":
        np.testing.assert_array_equal(got["predicted"], output.argmax(axis=1))
    else:
        np.testing.assert_allclose(got["predicted"], output.reshape(-1), rtol=TOLERANCE)
    # ... and graphkit takes it as a model to train further
    gk.add_loss_output(
        trained, manifest["loss"]["name"], output_index=manifest["prediction"]["output"]
    )


def test_step_and_epoch_modes_agree(site):
    """The exported epoch (a Loop) and the step run batch by batch give the same weights;
    the default shuffle draws a new permutation per epoch, the same for the same seed."""
    script = in_page(
        """
        const { loadTrainer } = await import("/bundles/regressor/graphkit-web.mjs");
        const ort = await import("/node_modules/onnxruntime-web/dist/ort.wasm.min.mjs");
        const results = [];
        for (const mode of ["epoch", "step", "epoch"]) {
          const u = await loadTrainer("/bundles/regressor/", { ort });
          await u.fit(u.data.train.X, u.data.train.y, { epochs: 2, mode, seed: 7 });
          results.push({ losses: u.trainLosses, W1: Array.from(u.state.W1.data) });
        }
        return results;
        """
    )
    answer = run_page(page(site, "regressor"), script)
    assert answer["ok"], answer
    epoch, step, again = answer["value"]
    np.testing.assert_allclose(epoch["W1"], step["W1"], rtol=TOLERANCE, atol=1e-6)
    np.testing.assert_allclose(epoch["losses"], step["losses"], rtol=TOLERANCE)
    assert epoch == again  # the same seed, the same permutations, bit for bit


def test_demo_page_trains_and_shows_the_losses(site, bundles, tmp_path):
    """The demo page as a user sees it: train, chart, held-out R^2, then the Download
    button's file, which predicts in Python as the page did. The screenshot is the
    README's (GRAPHKIT_UPDATE_SCREENSHOT=1 writes web/screenshot.png)."""
    target = WEB / "screenshot.png" if os.environ.get("GRAPHKIT_UPDATE_SCREENSHOT") else None
    shot = target or bundles / "screenshot.png"
    script = in_page(
        """
        document.getElementById("train").click();  // as a user does: the form's settings
        const result = await window.demo.last;
        return { result, error: window.demo.error,
                 status: document.getElementById("status").textContent,
                 facts: document.getElementById("facts").innerText,
                 download: !document.getElementById("download").disabled,
                 train: t.trainLosses, heldOut: t.heldOutLosses,
                 predicted: await t.predict(t.data.held_out.X) };
        """
    )
    downloaded = tmp_path / "model.trained.onnx"
    answer = run_page(
        page(site, "regressor", epochs=60),
        script,
        screenshot=shot,
        download=("#download", downloaded),
    )
    assert answer["ok"], answer
    got = answer["value"]
    assert got["result"]["ok"] and got["error"] is None, got
    assert got["download"] and "Trained 60 epochs" in got["status"]
    assert len(got["train"]) == len(got["heldOut"]) == 60
    assert got["train"][-1] < got["train"][0] / 2
    r2 = float(got["facts"].split("held-out R²")[1].split()[0])
    assert r2 > 0.3, got["facts"]  # scikit-learn's MLPRegressor reaches 0.49 in 100 epochs
    assert shot.stat().st_size > 10_000
    assert not [m for m in answer["console"] if m["type"] == "error"], answer["console"]
    trained = onnx.load(downloaded)
    onnx.checker.check_model(trained, full_check=True)
    X_held, y_held = load_rows(bundles / "regressor", "held_out")
    session = onnxruntime.InferenceSession(str(downloaded))
    predicted = session.run(None, {"X": X_held})[0].reshape(-1)
    np.testing.assert_allclose(predicted, got["predicted"], rtol=TOLERANCE)
    r2_python = 1 - ((y_held - predicted) ** 2).sum() / ((y_held - y_held.mean()) ** 2).sum()
    assert abs(r2_python - r2) < 1e-4  # the page's R^2, from the downloaded file


# -- bad input: a clear error in the page and the console, never a hang -------------------


def _error_of(answer: dict) -> str:
    assert answer["ok"], answer
    return answer["value"]["error"] if "error" in answer["value"] else answer["value"]["loadError"]


def test_manifest_from_another_model(site, bundles):
    mixed = bundles / "mixed"
    shutil.copytree(bundles / "regressor", mixed)
    shutil.copy(bundles / "classifier" / "manifest.json", mixed / "manifest.json")
    answer = run_page(page(site, "mixed"), in_page("return {};"), timeout_s=60)
    error = _error_of(answer)
    assert "manifest.json does not describe" in error and "Export the folder again" in error
    assert any("manifest.json does not describe" in m["text"] for m in answer["console"])


def test_operator_onnxruntime_web_lacks(site, bundles):
    """A folder whose step holds an operator onnxruntime-web has no kernel for (a
    training-only com.microsoft operator, as onnxruntime-training's own steps hold before
    graphkit lowers them): the page names the file and, in onnxruntime-web's own words,
    the operator, instead of failing later or hanging."""
    lacking = bundles / "lacking"
    shutil.copytree(bundles / "regressor", lacking)
    step = onnx.load(lacking / "training_step.onnx")
    probe = helper.make_node("GeluGrad", ["loss", "loss"], ["probe"], domain="com.microsoft")
    step.graph.node.append(probe)
    step.graph.output.append(helper.make_tensor_value_info("probe", TensorProto.FLOAT, []))
    step.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    blob = step.SerializeToString()
    (lacking / "training_step.onnx").write_bytes(blob)
    manifest = json.loads((lacking / "manifest.json").read_text())
    manifest["files"]["step"]["sha256"] = hashlib.sha256(blob).hexdigest()
    manifest["operators"]["step"].append("GeluGrad")
    (lacking / "manifest.json").write_text(json.dumps(manifest))
    answer = run_page(page(site, "lacking"), in_page("return {};"), timeout_s=60)
    error = _error_of(answer)
    assert "cannot load training_step.onnx" in error, error
    assert "GeluGrad" in error and "is not a registered function/op" in error, error
    assert any("GeluGrad" in m["text"] for m in answer["console"] if m["type"] == "error")


@pytest.mark.parametrize(
    ("model", "call", "expected"),
    [
        (
            "regressor",
            "t.fit(t.data.train.X.map((r) => r.slice(1)), t.data.train.y)",
            "row 0 has 9 values; the model's input X takes 10 per row",
        ),
        (
            "classifier",
            "t.fit(t.data.train.X, t.data.train.y.map((v, i) => (i === 5 ? 3 : v)))",
            "holds the label 3 at row 5; the model has 3 classes, labels 0..2",
        ),
        (
            "regressor",
            "t.fit(t.data.train.X, t.data.train.y.slice(1))",
            "X has 354 rows but y has 353",
        ),
        (
            "regressor",
            "t.predict(t.data.train.X.map((r, i) => (i === 2 ? r.map(() => NaN) : r)))",
            "row 2 holds NaN at position 0, not a finite number",
        ),
    ],
    ids=["wrong-width", "label-out-of-range", "rows-differ", "nan"],
)
def test_bad_data_is_refused_in_the_page(site, model, call, expected):
    script = in_page(
        f"""
        try {{ await {call}; return {{ error: "no error" }}; }}
        catch (e) {{
          console.error(`graphkit-web: ${{e.message}}`);
          return {{ error: e.message, name: e.name }};
        }}
        """
    )
    answer = run_page(page(site, model), script, timeout_s=60)
    got = answer["value"]
    assert got["name"] == "GraphkitWebError" and expected in got["error"], got
    assert any(expected in m["text"] for m in answer["console"] if m["type"] == "error")


def test_bad_data_through_the_page_shows_the_error(site):
    """demo.train (the Train button's path) shows the error in the page and the console,
    and leaves the weights as they were."""
    script = in_page(
        """
        const before = Array.from(t.state.W1.data);
        const result = await window.demo.train({ epochs: 1, order: [[0, 0, 1]] });
        return { result, shown: document.getElementById("error").textContent,
                 visible: getComputedStyle(document.getElementById("error")).display,
                 same: before.every((v, i) => v === t.state.W1.data[i]) };
        """
    )
    answer = run_page(page(site, "regressor"), script, timeout_s=60)
    got = answer["value"]
    assert not got["result"]["ok"] and "is not a permutation of the 354 rows" in got["shown"]
    assert got["visible"] == "block" and got["same"]
    assert any("not a permutation" in m["text"] for m in answer["console"] if m["type"] == "error")
