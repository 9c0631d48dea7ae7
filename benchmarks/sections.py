"""``RESULTS.md`` holds two reports: ``run.py``'s (graphkit against numpy, scikit-learn,
PyTorch eager, onnxruntime's training API and the older library) and ``peers.py``'s
(against JAX, ``torch.compile``, ``onnx2torch`` and PyTorch eager, on larger models too).
Each script rewrites its own section, between two HTML comments, and leaves the other's
as it was."""

from __future__ import annotations

from pathlib import Path


def _markers(key: str) -> tuple[str, str]:
    return f"<!-- {key}: begin -->", f"<!-- {key}: end -->"


def write_section(path: str | Path, key: str, text: str) -> None:
    """Replace the section ``key`` of the markdown file ``path`` with ``text`` (appended
    when the file has no such section; the file is created when missing)."""
    path = Path(path)
    begin, end = _markers(key)
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text() if path.exists() else ""
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        new = head + block + tail
    else:
        new = (old.rstrip() + "\n\n" if old.strip() else "") + block
    path.write_text(new)


def demoted(text: str) -> str:
    """``text`` with every markdown heading one level deeper (a report that becomes a
    section of a larger page)."""
    return "\n".join("#" + line if line.startswith("#") else line for line in text.splitlines())


__all__ = ["demoted", "write_section"]
