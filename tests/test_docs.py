"""The documentation's promises: every ```python block of a page under docs/ runs as
written, the blocks of a page in order in one namespace, as a reader runs them.

A block that cannot run standalone is written ```text, or follows a skip marker, a line
``<!-- skip: why -->`` right before its fence (used sparingly: the reason must say what
runs the code instead). A block a page includes from another file (``--8<--``, such as
the Quickstart from README.md) is not in the page's source: its own file's test runs it
(tests/test_readme.py). ``mkdocs build --strict`` (``make docs``) checks the pages'
links and includes; this file only runs their code.
"""

from __future__ import annotations

import re
import runpy
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SKIP = re.compile(r"^\s*<!-- skip: \S.*-->\s*$")
FENCE = re.compile(r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)\s*$")


def python_blocks(text: str) -> tuple[list[str], list[str]]:
    """``(blocks to run, skip markers)``: the dedented ```python blocks of a page, in order,
    less those that follow a skip marker."""
    blocks, skipped = [], []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, end = opening["indent"], i + 1
        while not re.match(rf"^{indent}```\s*$", lines[end]):
            end += 1
        if opening["lang"] == "python":
            marker = lines[i - 1] if i else ""
            block = textwrap.dedent("\n".join(lines[i + 1 : end])) + "\n"
            (skipped if SKIP.match(marker) else blocks).append(marker or block)
        i = end + 1
    return blocks, skipped


PAGES = sorted(p for p in DOCS.rglob("*.md") if python_blocks(p.read_text())[0])


def check_dsl(namespace: dict) -> None:
    """The optimizer chain trains the page's linear regression, and the scripted
    transformation names its state after the weight."""
    X, y = namespace["X"], namespace["y"]
    trainer = namespace["trainer"].set_params(max_iter=60, batch_size=10)
    trainer.fit(X, y)
    assert trainer.train_losses_[-1] < trainer.train_losses_[0] / 2
    assert any(name.endswith(".adam.m") for name in trainer.get_state())
    assert list(namespace["signum"].init({"w": np.zeros(2)})) == ["w.signum.m"]


CHECKS = {"guide/dsl.md": check_dsl}
"""What a page's blocks must have built, beyond running: page -> check of its namespace."""


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(DOCS).as_posix())
def test_page_runs_as_written(page, tmp_path, monkeypatch):
    blocks, _ = python_blocks(page.read_text())
    script = tmp_path / f"{page.stem}.py"  # onnxscript reads sources: run from a real file
    script.write_text("\n".join(blocks))
    monkeypatch.chdir(tmp_path)
    namespace = runpy.run_path(str(script))
    check = CHECKS.get(page.relative_to(DOCS).as_posix())
    if check is not None:
        check(namespace)


def test_every_check_has_its_page():
    assert {p.relative_to(DOCS).as_posix() for p in PAGES} >= set(CHECKS)


def test_skips_are_few_and_say_why():
    """Skipped blocks stay the exception; each marker gives its reason."""
    skipped = [m for p in DOCS.rglob("*.md") for m in python_blocks(p.read_text())[1]]
    assert len(skipped) <= 3, skipped
    assert all("tests/" in m or "needs" in m for m in skipped), skipped


def test_python_blocks_are_found():
    page = """Text.

```python
a = 1
```

- an item:

    ```python
    b = a + 1
    ```

<!-- skip: needs a GPU -->
```python
c = run_on_gpu()
```

```text
not python
```
"""
    blocks, skipped = python_blocks(page)
    assert blocks == ["a = 1\n", "b = a + 1\n"]
    assert skipped == ["<!-- skip: needs a GPU -->"]
