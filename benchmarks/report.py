"""The one convention of the benchmarks' results (benchmarks/README.md).

Every script writes ``benchmarks/results/<script>.md`` (``<script>-<variant>.md`` for a
variant of its run, such as ``peers-cuda.md``; ``--output`` writes elsewhere), and every
such file opens with the same header: its title, then the command that wrote it, the
date, the machine and the library versions (:func:`header`). The tables after it follow
the column conventions of benchmarks/README.md.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
"""Where the scripts write their results."""

ONNXRUNTIME_BUILDS = (
    "onnxruntime-training",
    "onnxruntime-training-cpu",
    "onnxruntime-gpu",
    "onnxruntime",
)
"""The distributions that install ``onnxruntime``, the first installed one named."""


def default_output(script: str, variant: str = "") -> Path:
    """``benchmarks/results/<script>.md`` for the script at path ``script`` (``__file__``),
    ``<script>-<variant>.md`` for a variant of its run."""
    name = Path(script).stem + (f"-{variant}" if variant else "")
    return RESULTS / f"{name}.md"


def command() -> str:
    """The command line that runs this script, as a reader would type it."""
    script = Path(sys.argv[0])
    shown = f"benchmarks/{script.name}" if script.parent.name == "benchmarks" else str(script)
    return shlex.join(["python", shown, *sys.argv[1:]])


def machine(cores: int | None = None, gpu: bool = False) -> str:
    """The machine's architecture and cores (``cores``: the cores the run used), and
    with ``gpu`` the GPU (``nvidia-smi``'s name for it)."""
    text = f"{platform.machine()}, {cores or os.cpu_count()} cores"
    if gpu:
        try:
            found = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            found = ""
        first = found.splitlines()[0].split(", ") if found else []
        text += f", {first[0]} (driver {first[1]})" if len(first) == 2 else ", a CUDA GPU"
    return text


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(*also: str) -> str:
    """CPython, the installed onnxruntime build, onnx and numpy, then ``also`` (more
    distributions by name, each named with its version where installed)."""
    found = [f"CPython {platform.python_version()}"]
    ort = next((d for d in ONNXRUNTIME_BUILDS if _version(d)), None)
    for name in ([ort] if ort else []) + ["onnx", "numpy", *also]:
        version = _version(name)
        if version:
            found.append(f"{name} {version}")
    return ", ".join(found)


def header(
    title: str,
    *,
    run: str | None = None,
    date: str | None = None,
    on: str | None = None,
    libraries: str | None = None,
) -> list[str]:
    """The opening lines of a results file: ``# title``, then the command (``run``;
    default :func:`command`), the date (default today), the machine (``on``; default
    :func:`machine`) and the library versions (``libraries``; default :func:`versions`)."""
    return [
        f"# {title}",
        "",
        f"- **command**: `{run or command()}`",
        f"- **date**: {date or time.strftime('%Y-%m-%d')}",
        f"- **machine**: {on or machine()}",
        f"- **versions**: {libraries or versions()}",
        "",
    ]


def write(path: str | Path, lines: list[str]) -> None:
    """Write the results file ``path`` (its folder made when missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines).rstrip() + "\n")


__all__ = ["RESULTS", "command", "default_output", "header", "machine", "versions", "write"]
