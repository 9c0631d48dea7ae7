"""Headless Chromium for tests and benchmarks of graphkit's web export (stdlib only).

graphkit's web export trains in onnxruntime-web's wasm backend inside a browser page. Testing
that needs three things, all here: a local HTTP server with the headers that make the page
cross-origin isolated (``serve``), a one-line answer to "can this machine run a browser at all"
so tests skip with the fix instead of failing (``browser_missing``), and a way to open a page,
wait for it, evaluate JavaScript in it and get the answer back as JSON (``run_page``, which runs
``tests/web/drive.mjs`` under node with playwright-core and the system Chromium).
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WEB = REPO / "web"
DRIVE = REPO / "tests" / "web" / "drive.mjs"
ORT_DIST = WEB / "node_modules" / "onnxruntime-web" / "dist"
"""onnxruntime-web's built files; serve them with ``extra={"/ort/": ORT_DIST}``."""

# SharedArrayBuffer, hence onnxruntime-web's wasm threads, exists only in a cross-origin
# isolated page; caching is off so a test never sees a previous test's export.
_HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-store",
}
# Browsers refuse ES modules and wasm streaming compilation served with another type.
_TYPES = {
    ".mjs": "text/javascript",
    ".js": "text/javascript",
    ".wasm": "application/wasm",
    ".json": "application/json",
    ".onnx": "application/octet-stream",
}


def _chromium() -> str:
    return os.environ.get("CHROMIUM", "/usr/bin/chromium")


@contextlib.contextmanager
def serve(root: Path, extra: dict[str, Path] | None = None) -> Iterator[str]:
    """Serve ``root`` on 127.0.0.1 (a free port) in a background thread; yield the base URL.

    ``extra`` maps URL prefixes such as ``"/ort/"`` to other folders, so that onnxruntime-web's
    dist folder is served beside an export without copying 15 MB of wasm per test. The URL has
    no trailing slash: ``f"{base}/index.html"``.
    """
    mounts = [("/" + p.strip("/") + "/", Path(folder)) for p, folder in (extra or {}).items()]

    class Handler(http.server.SimpleHTTPRequestHandler):
        extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, **_TYPES}

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(root), **kwargs)

        def translate_path(self, path: str) -> str:
            for prefix, folder in mounts:
                if path.startswith(prefix):
                    # the base class's normalisation (no "..", no query) against another root
                    saved, self.directory = self.directory, str(folder)
                    try:
                        return super().translate_path("/" + path[len(prefix) :])
                    finally:
                        self.directory = saved
            return super().translate_path(path)

        def send_head(self) -> Any:
            # Chromium asks for /favicon.ico on every page; a 404 would put an error in the
            # console that tests checking for a clean console would have to ignore.
            if self.path == "/favicon.ico" and not os.path.exists(self.translate_path(self.path)):
                self.send_response(204)
                self.end_headers()
                return None
            return super().send_head()

        def end_headers(self) -> None:
            for name, value in _HEADERS.items():
                self.send_header(name, value)
            super().end_headers()

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: pytest output stays readable

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="graphkit-serve", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def browser_missing() -> str | None:
    """None when a page can be driven here, else one line saying what is missing and the fix."""
    if shutil.which("node") is None:
        return "node is not installed (Node.js 18 or later is needed to drive Chromium)"
    if not (WEB / "node_modules" / "playwright-core").is_dir():
        return "web/node_modules/playwright-core is missing: run `make web-deps`"
    if not ORT_DIST.is_dir():
        return "web/node_modules/onnxruntime-web is missing: run `make web-deps`"
    chromium = _chromium()
    if not os.access(chromium, os.X_OK):
        return f"no Chromium at {chromium} (set $CHROMIUM or run `make web-deps` as root)"
    return None


def run_page(
    url: str,
    script: str | None = None,
    timeout_s: float = 120,
    screenshot: Path | None = None,
    wait_for: str | None = None,
    download: tuple[str, Path] | None = None,
) -> dict[str, Any]:
    """Open ``url`` in headless Chromium, optionally wait and evaluate ``script``; return the JSON.

    ``wait_for`` is a JS expression polled until truthy (``"window.done"``); an uncaught page
    error ends the wait at once. ``script`` is the body of an async JS function; its return value
    comes back JSON-serialised as ``value``. The dict is ``{"ok": True, "value", "console",
    "pageErrors", "requests"}`` or ``{"ok": False, "error", ...}``: a failing page is an answer,
    not an exception. ``console`` holds ``{"type", "text"}`` entries; ``requests`` every URL the
    page fetched (a test can check nothing left 127.0.0.1).

    The page has ``timeout_s`` in all, Chromium's start included: drive.mjs answers
    ``ok: False`` just before, and node is killed at ``timeout_s`` whatever happens (2 s more at
    most), so a stuck page never hangs a test. RuntimeError when node itself fails or gives no
    answer.

    ``download = (selector, path)``: after the script (and the screenshot), click the element
    and save the file the page then offers for download at ``path``.
    """
    # drive.mjs's own deadline comes first, leaving it time to report and close Chromium.
    inner_s = max(timeout_s - 5.0, timeout_s * 0.75)
    request = {
        "url": url,
        "script": script,
        "waitFor": wait_for,
        "timeoutMs": round(inner_s * 1000),
        "screenshot": str(Path(screenshot).resolve()) if screenshot is not None else None,
        "download": (
            {"click": download[0], "path": str(Path(download[1]).resolve())} if download else None
        ),
    }
    with tempfile.TemporaryDirectory(prefix="graphkit-drive-") as tmp:
        args = Path(tmp) / "args.json"
        args.write_text(json.dumps(request))
        env = {**os.environ, "CHROMIUM": _chromium()}
        # A session of its own, so a timeout kills node and anything else in its group.
        proc = subprocess.Popen(
            ["node", str(DRIVE), str(args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
        killed = False
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            killed = True
            _kill(proc)
            stdout, stderr = proc.communicate()
    # An answer printed before the kill (closing Chromium was what hung) is still the answer.
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    what = f"was killed after {timeout_s} s" if killed else f"exited with {proc.returncode}"
    raise RuntimeError(
        f"node tests/web/drive.mjs {what} on {url} with no answer; stderr:\n{stderr}"
    )


def _kill(proc: subprocess.Popen[str]) -> None:
    """SIGTERM first (Playwright's handler then closes Chromium, which runs in its own process
    group), SIGKILL to node's whole group if that has not ended it within 2 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
