"""Every notebook in notebooks/ executes without error (its cells assert their results)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from conftest import HAS_TORCH
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def uses_torch(notebook) -> bool:
    return any(
        line.strip().startswith(("import torch", "from torch"))
        for cell in notebook.cells
        if cell.cell_type == "code"
        for line in cell.source.splitlines()
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    if uses_torch(notebook) and not HAS_TORCH:
        pytest.skip("the notebook uses torch, which is not installed")
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors
