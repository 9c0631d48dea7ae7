"""The browser harness (tests/browser.py, tests/web/drive.mjs) against facts known without it.

Every answer a page gives is checked against something computed independently (hashlib,
numpy, a hand-assembled wasm module), so a harness that returned stale or made-up values would
fail. The server's headers are read with urllib, without a browser.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from tests import browser
from tests.browser import ORT_DIST, browser_missing, run_page, serve

pytestmark = pytest.mark.skipif(
    os.environ.get("GRAPHKIT_WEB_TESTS") == "0",
    reason="the browser harness is checked once, in make test's main environment",
)
MISSING = browser_missing()
needs_browser = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

# (module (func (export "add") (param i32 i32) (result i32) local.get 0 local.get 1 i32.add))
ADD_WASM = bytes.fromhex(
    "0061736d01000000"  # magic, version 1
    "01070160027f7f017f"  # type section: (i32, i32) -> i32
    "03020100"  # function section: one function of type 0
    "070701036164640000"  # export section: "add" = function 0
    "0a09010700200020016a0b"  # code section: local.get 0, local.get 1, i32.add
)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A folder of small pages, each exercising one thing the harness must get right."""
    (tmp_path / "index.html").write_text(
        "<!doctype html><title>t</title><p>hello</p>"
        "<script>console.log('hello from the page'); console.warn('careful');</script>"
    )
    (tmp_path / "mod.mjs").write_text("export const answer = 6 * 7;\n")
    (tmp_path / "module.html").write_text(
        "<!doctype html><script type='module'>"
        "import { answer } from './mod.mjs'; window.answer = answer; window.done = true;"
        "</script>"
    )
    (tmp_path / "add.wasm").write_bytes(ADD_WASM)
    (tmp_path / "throws.html").write_text(
        "<!doctype html><script type='module'>"
        "await new Promise((r) => setTimeout(r, 100)); throw new Error('boom from the page');"
        "</script>"
    )
    (tmp_path / "never.html").write_text("<!doctype html><p>window.done is never set</p>")
    return tmp_path


def test_serve_sends_isolation_headers_types_and_mounts(
    site: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    other = tmp_path_factory.mktemp("other")
    (other / "x.txt").write_text("mounted")
    with serve(site, {"/mnt/": other}) as base:
        for path, mime in [("/mod.mjs", "text/javascript"), ("/add.wasm", "application/wasm")]:
            with urllib.request.urlopen(base + path) as r:
                assert r.headers["Content-Type"] == mime
                assert r.headers["Cross-Origin-Opener-Policy"] == "same-origin"
                assert r.headers["Cross-Origin-Embedder-Policy"] == "require-corp"
                assert r.headers["Cache-Control"] == "no-store"
                assert r.read() == (site / path[1:]).read_bytes()
        with urllib.request.urlopen(base + "/mnt/x.txt") as r:
            assert r.read() == b"mounted"
        # ".." never leaves the mounted folder: this is other/index.html, which does not exist
        with pytest.raises(urllib.error.HTTPError, match="404"):
            urllib.request.urlopen(base + "/mnt/../index.html")


@needs_browser
def test_page_computes_what_python_computes(site: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    script = """
    const digest = await crypto.subtle.digest("SHA-256", new TextEncoder().encode("abc"));
    const { instance } = await WebAssembly.instantiateStreaming(fetch("/add.wasm"));
    return {
      sha256: Array.from(new Uint8Array(digest), (b) => b.toString(16).padStart(2, "0")).join(""),
      add: instance.exports.add(40, 2),
      isolated: crossOriginIsolated,
      sab: typeof SharedArrayBuffer,
      text: document.querySelector("p").textContent,
    };
    """
    with serve(site) as base:
        result = run_page(base + "/index.html", script, timeout_s=60, screenshot=shot)
    assert result["ok"], result
    assert result["value"] == {
        "sha256": hashlib.sha256(b"abc").hexdigest(),
        "add": 42,  # streaming compilation needs application/wasm
        "isolated": True,  # COOP + COEP: SharedArrayBuffer, hence wasm threads
        "sab": "function",
        "text": "hello",
    }
    assert {"type": "log", "text": "hello from the page"} in result["console"]
    assert {"type": "warning", "text": "careful"} in result["console"]
    assert result["pageErrors"] == []
    assert all(u.startswith(base + "/") for u in result["requests"]), result["requests"]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_browser
def test_wait_for_an_es_module(site: Path) -> None:
    with serve(site) as base:
        result = run_page(base + "/module.html", "return window.answer;", wait_for="window.done")
    assert result["ok"], result
    assert result["value"] == 42


@needs_browser
def test_a_page_that_throws_answers_at_once(site: Path) -> None:
    start = time.monotonic()
    with serve(site) as base:
        result = run_page(base + "/throws.html", "return 1;", wait_for="window.done", timeout_s=60)
    assert time.monotonic() - start < 30  # not the 60 s timeout
    assert not result["ok"]
    assert "boom from the page" in result["error"]
    assert any("boom from the page" in e for e in result["pageErrors"])


@needs_browser
def test_a_script_that_throws_is_an_answer(site: Path) -> None:
    with serve(site) as base:
        result = run_page(base + "/index.html", "throw new TypeError('bad script');")
    assert not result["ok"]
    assert "bad script" in result["error"]


@needs_browser
@pytest.mark.parametrize(
    "page, script, wait_for",
    [("never.html", None, "window.done"), ("index.html", "while (true) {}", None)],
    ids=["never-done", "busy-loop"],
)
def test_a_page_that_never_finishes_is_stopped_at_the_timeout(
    site: Path, page: str, script: str | None, wait_for: str | None
) -> None:
    start = time.monotonic()
    with serve(site) as base:
        result = run_page(f"{base}/{page}", script, wait_for=wait_for, timeout_s=3)
    assert time.monotonic() - start < 3 + 3  # the kill's grace period at most
    assert not result["ok"]
    assert "timed out" in result["error"]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_node_itself_failing_or_hanging_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What drive.mjs cannot report itself: node dying, or hanging past its own deadline."""
    fake = tmp_path / "fake.mjs"
    monkeypatch.setattr(browser, "DRIVE", fake)
    fake.write_text("console.error('drive broke'); process.exit(3);\n")
    with pytest.raises(RuntimeError, match="(?s)exited with 3.*drive broke"):
        run_page("http://127.0.0.1:9/")
    fake.write_text("setInterval(() => {}, 1000);\n")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="killed after 2 s"):
        run_page("http://127.0.0.1:9/", timeout_s=2)
    assert time.monotonic() - start < 2 + 3


@needs_browser
def test_a_missing_page_is_an_error(site: Path) -> None:
    with serve(site) as base:
        result = run_page(base + "/nope.html", "return 1;")
    assert not result["ok"]
    assert "404" in result["error"]


@needs_browser
@pytest.mark.parametrize("threads", [1, 2])
def test_onnxruntime_web_runs_a_matmul_add(site: Path, threads: int) -> None:
    """onnxruntime-web's wasm backend from /ort/ (no CDN), 1 and 2 threads, against numpy."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    b = rng.normal(size=2).astype(np.float32)
    x = rng.normal(size=(4, 3)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["X", "W"], ["XW"]),
            helper.make_node("Add", ["XW", "b"], ["Y"]),
        ],
        "matmul_add",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 2])],
        [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, site / "matmul_add.onnx")
    script = f"""
    const ort = await import("/ort/ort.wasm.min.mjs");
    ort.env.wasm.wasmPaths = "/ort/";
    ort.env.wasm.numThreads = {threads};
    const session = await ort.InferenceSession.create("/matmul_add.onnx");
    const X = new ort.Tensor("float32", Float32Array.from({x.ravel().tolist()}), [4, 3]);
    const {{ Y }} = await session.run({{ X }});
    // onnxruntime-web falls back to 1 thread (a console warning) when not isolated
    return {{ y: Array.from(Y.data), dims: Y.dims, threads: ort.env.wasm.numThreads,
              version: ort.env.versions.web }};
    """
    with serve(site, {"/ort/": ORT_DIST}) as base:
        result = run_page(base + "/never.html", script, timeout_s=60)
    assert result["ok"], result
    value = result["value"]
    assert value["version"] == "1.30.0"
    assert value["threads"] == threads
    assert value["dims"] == [4, 2]
    np.testing.assert_allclose(np.reshape(value["y"], (4, 2)), x @ w + b, rtol=1e-5, atol=1e-6)
    assert not [m for m in result["console"] if m["type"] in ("error", "warning")]
    assert all(u.startswith(base + "/") for u in result["requests"])
